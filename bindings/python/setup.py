"""Build step of the kvplug wheel: compile libkvplug.so from the repository's
Go sources and place it inside the package, next to __init__.py, where
kvplug._lib finds it.

The repository root is the directory two levels up (this file lives in
bindings/python/), or KVPLUG_SOURCE_DIR when building from elsewhere. The
Go toolchain is taken from PATH, or from the GO environment variable.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 ships bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # older setuptools: the wheel package's
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent


def source_root() -> Path:
    root = Path(os.environ.get("KVPLUG_SOURCE_DIR") or HERE.parent.parent).resolve()
    if not (root / "go.mod").is_file() or not (root / "capi").is_dir():
        sys.exit(
            f"kvplug: {root} is not the kvplug source tree (no go.mod and capi/); "
            "build from a checkout, or set KVPLUG_SOURCE_DIR to one"
        )
    return root


class BuildPyWithLibrary(build_py):
    """build_py that also compiles the shared library into the package."""

    def run(self) -> None:
        super().run()
        root = source_root()
        go = os.environ.get("GO") or shutil.which("go")
        if not go:
            sys.exit("kvplug: the Go toolchain (go) is needed to build libkvplug.so; put it on PATH or set GO")
        out_dir = Path(self.build_lib).resolve() / "kvplug"  # absolute: go runs in the repository root
        out_dir.mkdir(parents=True, exist_ok=True)
        lib = out_dir / "libkvplug.so"
        cmd = [go, "build", "-trimpath", "-buildmode=c-shared", "-o", str(lib), "./capi"]
        self.announce("kvplug: " + " ".join(cmd), level=2)
        subprocess.run(cmd, cwd=root, check=True)
        # go build writes a cgo header beside the library; the real header is include/kvplug.h.
        (out_dir / "libkvplug.h").unlink(missing_ok=True)
        shutil.copyfile(root / "include" / "kvplug.h", out_dir / "kvplug.h")


class BinaryDistribution(Distribution):
    """The package carries a native library, so it installs as platform
    code (platlib) even though it has no Python extension module."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """The library does not use the Python C API: the wheel is specific to
    the platform, not to the Python version."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel},
)
