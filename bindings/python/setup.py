"""Build step of the kvplug wheel: compile the CUDA kernels and
libkvplug.so from the repository's sources and place the library inside the
package, next to __init__.py, where kvplug._lib finds it.

The repository root is the directory two levels up (this file lives in
bindings/python/), or KVPLUG_SOURCE_DIR when building from elsewhere. The
Go toolchain is taken from PATH, or from the GO environment variable. The
kernels are compiled by kernels/build.sh, which fetches nvcc 13.0 from PyPI
into the repository's .tools/cuda when the machine has none;
KVPLUG_KERNELS=off builds a library without them.
"""

import os
import re
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


def header_version() -> str:
    """The package's version is the header's (KVP_VERSION_MAJOR.MINOR.PATCH):
    one number for the ABI, the library and the wheel."""
    text = (source_root() / "include" / "kvplug.h").read_text()
    parts = dict(re.findall(r"#define KVP_VERSION_(MAJOR|MINOR|PATCH) (\d+)", text))
    if len(parts) != 3:
        sys.exit("kvplug: include/kvplug.h lacks KVP_VERSION_MAJOR, _MINOR or _PATCH")
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


class BuildPyWithLibrary(build_py):
    """build_py that also compiles the shared library into the package."""

    def run(self) -> None:
        super().run()
        root = source_root()
        go = os.environ.get("GO") or shutil.which("go")
        if not go:
            sys.exit("kvplug: the Go toolchain (go) is needed to build libkvplug.so; put it on PATH or set GO")
        kernels = os.environ.get("KVPLUG_KERNELS", "on")
        if kernels not in ("on", "off"):
            sys.exit(f"kvplug: KVPLUG_KERNELS must be on or off, not {kernels!r}")
        out_dir = Path(self.build_lib).resolve() / "kvplug"  # absolute: go runs in the repository root
        out_dir.mkdir(parents=True, exist_ok=True)
        lib = out_dir / "libkvplug.so"
        tags = []
        if kernels == "on":
            run(self, [str(root / "kernels" / "build.sh")], root, "compiling the CUDA kernels",
                "KVPLUG_KERNELS=off builds the package without them")
        else:
            tags = ["-tags", "kvplug_nokernels"]
        run(self, [go, "build", "-trimpath", *tags, "-buildmode=c-shared", "-o", str(lib), "./capi"], root,
            "building libkvplug.so with Go", "kvplug needs Go 1.25 or newer: put go on PATH or set GO")
        # go build writes a cgo header beside the library; the real header is include/kvplug.h.
        (out_dir / "libkvplug.h").unlink(missing_ok=True)
        shutil.copyfile(root / "include" / "kvplug.h", out_dir / "kvplug.h")


def run(cmd_obj, cmd, cwd: Path, what: str, hint: str) -> None:
    """Runs one build step; a failure ends the build with its cause (the
    step's last message) as the last lines pip shows, not a traceback."""
    cmd_obj.announce("kvplug: " + " ".join(cmd), level=2)
    sys.stdout.flush()
    try:
        p = subprocess.run(cmd, cwd=cwd, stderr=subprocess.PIPE, text=True, errors="replace")
    except FileNotFoundError as e:
        sys.exit(f"kvplug: {what} failed: {e}\n  ({hint})")
    sys.stderr.write(p.stderr)
    if p.returncode != 0:
        last = [line for line in p.stderr.splitlines() if line.strip()][-1:] or ["(no message)"]
        sys.exit(f"kvplug: {what} failed (exit status {p.returncode}): {last[0].strip()}\n  ({hint})")


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
    version=header_version(),
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel},
)
