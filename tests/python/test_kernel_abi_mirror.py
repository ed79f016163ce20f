"""kernels/kernel_abi.py (the numpy mirror of the kernels' parameter structs,
which bench scripts pack launches with) checked against
kernels/kvplug_kernels.h: a C program compiled against the header prints the
size and every field's offset of every struct, and each numpy dtype must
agree exactly (nested structs, such as the paged-KV descriptor `kv`, field
by field too). A struct added to the header without its mirror fails here."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "kernels" / "kvplug_kernels.h"


def _kernel_abi():
    spec = importlib.util.spec_from_file_location("kernel_abi", ROOT / "kernels" / "kernel_abi.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kernel_abi = _kernel_abi()


def header_structs() -> set:
    return set(re.findall(r"^typedef struct (kvp_\w+_params) \{", HEADER.read_text(), re.M))


def _fields(dt: np.dtype, prefix: str = ""):
    """(C member path, offset) of every field of dt, nested dtypes flattened
    as `kv.block_size`, at offsets from dt's start."""
    out = []
    for name in dt.names:
        sub, off = dt.fields[name][:2]
        out.append((prefix + name, off))
        if sub.names is not None:
            out += [(path, off + o) for path, o in _fields(sub, prefix + name + ".")]
    return out


def test_every_struct_is_mirrored():
    structs = header_structs()
    assert len(structs) >= 8, structs
    missing = structs - set(kernel_abi.STRUCTS)
    assert not missing, f"kernel structs of the header with no mirror in kernels/kernel_abi.py: {sorted(missing)}"
    extra = set(kernel_abi.STRUCTS) - structs
    assert not extra, f"mirrors in kernels/kernel_abi.py of no header struct: {sorted(extra)}"


def test_constants_match_the_header():
    defines = dict(re.findall(r"^#define (KVP_\w+) (\d+)", HEADER.read_text(), re.M))
    assert int(defines["KVP_KERNELS_ABI_VERSION"]) == kernel_abi.ABI_VERSION
    assert int(defines["KVP_MERGE_MAX_STATES"]) == kernel_abi.MERGE_MAX_STATES
    assert int(defines["KVP_TIER_COPY_OPS"]) == kernel_abi.TIER_COPY_OPS


def test_struct_layouts_match_the_header(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to compile the header with")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvplug_kernels.h"', "int main(void) {"]
    for cname, dt in kernel_abi.STRUCTS.items():
        lines.append(f'  printf("{cname} size %zu\\n", sizeof({cname}));')
        for path, _ in _fields(dt):
            lines.append(f'  printf("{cname} {path} %zu\\n", offsetof({cname}, {path}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "kernel_layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "kernel_layout"
    cc = subprocess.run(["cc", "-std=c99", f"-I{HEADER.parent}", str(src), "-o", str(exe)], capture_output=True,
                        text=True)
    assert cc.returncode == 0, "a mirrored field the header does not have:\n" + cc.stderr
    c = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        struct, field, value = line.split()
        c[(struct, field)] = int(value)
    wrong = []
    for cname, dt in kernel_abi.STRUCTS.items():
        if dt.itemsize != c[(cname, "size")]:
            wrong.append(f"{cname}: size {dt.itemsize} in Python, {c[(cname, 'size')]} in C")
        for path, off in _fields(dt):
            if off != c[(cname, path)]:
                wrong.append(f"{cname}.{path}: offset {off} in Python, {c[(cname, path)]} in C")
    assert not wrong, "\n".join(wrong)


def test_every_header_field_is_mirrored(tmp_path):
    """The other direction: every member the header declares (by name, in
    order) is a field of the mirror, so a field added to the header fails
    even where the sizes happen to agree."""
    text = HEADER.read_text()
    for cname, dt in kernel_abi.STRUCTS.items():
        body = re.search(r"typedef struct " + cname + r" \{(.*?)\} " + cname + ";", text, re.S)
        assert body, cname
        members = re.findall(r"^\s*\w+\s+(\w+)(?:\[[^\]]*\])*;", re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S),
                             re.M)
        assert members == list(dt.names), f"{cname}: header members {members}, mirror fields {list(dt.names)}"
