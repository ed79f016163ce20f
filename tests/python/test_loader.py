"""The lazy loader: importing kvplug loads nothing; the first call loads the
library, and a missing or wrong library gives a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvplug
from kvplug import _lib


def run(code: str, library: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVPLUG_LIBRARY=library)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_import_loads_nothing():
    out = run("import kvplug, kvplug._lib as l; print(l._lib is None)", "/nonexistent/libkvplug.so")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_missing_library_error():
    code = (
        "import kvplug\n"
        "try:\n"
        "    kvplug.Manager(8)\n"
        "except kvplug.LibraryLoadError as e:\n"
        "    print(type(e).__name__, isinstance(e, OSError), e)\n"
    )
    out = run(code, "/nonexistent/dir/libkvplug.so")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("LibraryLoadError True")
    assert "KVPLUG_LIBRARY=/nonexistent/dir/libkvplug.so" in line
    assert "not found" in line and "make" in line


def test_not_a_library_error(tmp_path):
    bogus = tmp_path / "libkvplug.so"
    bogus.write_text("not an ELF file")
    out = run("import kvplug\ntry:\n    kvplug.version()\nexcept kvplug.LibraryLoadError as e:\n    print(e)\n", str(bogus))
    assert out.returncode == 0, out.stderr
    assert f"cannot load {bogus}" in out.stdout


def test_package_directory_is_the_default(tmp_path):
    # Without KVPLUG_LIBRARY the library next to the package is used.
    env = {k: v for k, v in os.environ.items() if k != "KVPLUG_LIBRARY"}
    code = "import kvplug\ntry:\n    kvplug.version()\nexcept kvplug.LibraryLoadError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pkg_lib = os.path.join(os.path.dirname(kvplug.__file__), "libkvplug.so")
    if os.path.exists(pkg_lib):
        assert out.stdout == ""
    else:
        assert f"the package directory ({pkg_lib})" in out.stdout


def test_loaded_once_from_the_environment():
    assert _lib.library_path() == os.environ["KVPLUG_LIBRARY"]
    assert _lib.library() is _lib.library()


def test_missing_function_error():
    with pytest.raises(kvplug.LibraryLoadError, match="no function kvp_not_there"):
        _lib.fn("kvp_not_there", None, [])


def test_fn_is_cached_per_signature():
    import ctypes

    a = _lib.fn("kvp_version", ctypes.c_uint32, [])
    assert _lib.fn("kvp_version", ctypes.c_uint32, []) is a
    b = _lib.fn("kvp_version", ctypes.c_int, [])
    assert b is not a and a.restype is ctypes.c_uint32  # other modules' signatures do not clash
