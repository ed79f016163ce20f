"""The Python package's copies of the header, checked against it: every
ctypes struct (size and the offset of every field, by compiling a C program
against include/kvplug.h), the status codes, the dtype codes and the version.
A struct added to the header or the package without its counterpart fails
here, not in a user's process."""

from __future__ import annotations

import ctypes
import inspect
import pathlib
import re
import shutil
import subprocess

import pytest

import kvplug
from kvplug import _capi, _lib, _tensors as _t, attn, cascade, events, manager, prefix, vmem

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "kvplug.h"

# ctypes struct of the package -> the header's struct.
MIRRORS = {
    manager.ManagerConfig: "kvp_manager_config",
    manager.BlockCopy: "kvp_block_copy",
    manager.ManagerStatsStruct: "kvp_manager_stats",
    prefix.MMItemStruct: "kvp_mm_item",
    prefix.PrefixKeysStruct: "kvp_prefix_keys",
    prefix.PrefixMatchStruct: "kvp_prefix_match",
    prefix.BlockMatchStruct: "kvp_block_match",
    prefix.PrefixStatsStruct: "kvp_prefix_stats",
    prefix.BlockMMStruct: "kvp_block_mm",
    prefix.KVEventStruct: "kvp_kv_event",
    prefix.KVGroupEventStruct: "kvp_kv_group_event",
    _capi.PagedKV: "kvp_paged_kv",
    attn._KVWriteArgs: "kvp_kv_write_args",
    attn._PagedDecodeArgs: "kvp_paged_decode_args",
    attn._MergeStatesArgs: "kvp_merge_states_args",
    vmem.VCacheConfig: "kvp_vcache_config",
    vmem.VCacheStats: "kvp_vcache_stats",
    cascade._CascadePlanArgs: "kvp_cascade_plan_args",
}
MIRRORS.update({
    attn._PrefillPlanArgs: "kvp_prefill_plan_args",
    attn._AttnPlan: "kvp_attn_plan",
    attn._PagedPrefillArgs: "kvp_paged_prefill_args",
    events.EventPublisherConfig: "kvp_event_publisher_config",
    events.EventPublisherStatsStruct: "kvp_event_publisher_stats",
    _capi.TierCopyStruct: "kvp_tier_copy",
    _capi.TierMatchStruct: "kvp_tier_match",
    _capi.TierStatsStruct: "kvp_tier_stats",
    _capi.KVLayersStruct: "kvp_kv_layers",
})
MIRRORS.update({
    _capi.HostStoreConfig: "kvp_host_store_config",
    _capi.HostStoreStatsStruct: "kvp_host_store_stats",
    _capi.SharedStoreConfig: "kvp_shared_store_config",
    _capi.SharedStoreStatsStruct: "kvp_shared_store_stats",
    _capi.LayerGroupStruct: "kvp_layer_group",
})

# ctypes structs of the package that mirror no header struct (DLPack's ABI).
NOT_HEADER = {"_DLDevice", "_DLDataType", "_DLTensor", "_DLManagedTensor"}


def header_text() -> str:
    return HEADER.read_text()


def header_structs() -> set:
    return set(re.findall(r"^typedef struct (kvp_\w+) \{", header_text(), re.M))


def test_every_struct_is_mirrored():
    found = set()
    for mod in (_capi, _lib, manager, prefix, attn, cascade, events, vmem):
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, ctypes.Structure) and obj.__module__ == mod.__name__:
                if name in NOT_HEADER:
                    continue
                assert obj in MIRRORS, f"{mod.__name__}.{name} is a ctypes struct with no header struct in MIRRORS"
                found.add(MIRRORS[obj])
    missing = header_structs() - set(MIRRORS.values())
    assert not missing, f"header structs with no Python mirror: {sorted(missing)}"
    assert found == set(MIRRORS.values())


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_struct_layouts_match_the_header(tmp_path):
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kvplug.h"', "int main(void) {"]
    for cls, cname in MIRRORS.items():
        lines.append(f'  printf("{cname} size %zu\\n", sizeof({cname}));')
        for field, _ in cls._fields_:
            lines.append(f'  printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    cc = subprocess.run(["cc", "-std=c99", f"-I{HEADER.parent}", str(src), "-o", str(tmp_path / "layout")],
                        capture_output=True, text=True)
    assert cc.returncode == 0, "a ctypes field the header does not have:\n" + cc.stderr
    c = {}
    for line in subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.splitlines():
        struct, field, value = line.split()
        c[(struct, field)] = int(value)
    wrong = []
    for cls, cname in MIRRORS.items():
        if ctypes.sizeof(cls) != c[(cname, "size")]:
            wrong.append(f"{cname}: size {ctypes.sizeof(cls)} in Python, {c[(cname, 'size')]} in C")
        for field, _ in cls._fields_:
            off = getattr(cls, field).offset
            if off != c[(cname, field)]:
                wrong.append(f"{cname}.{field}: offset {off} in Python, {c[(cname, field)]} in C")
    assert not wrong, "\n".join(wrong)


def _enum(name: str) -> dict:
    body = re.search(r"typedef enum " + name + r" \{(.*?)\} " + name + ";", header_text(), re.S)
    assert body, f"enum {name} not found in the header"
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*(KVP_\w+)\s*=\s*(-?\d+)", body.group(1), re.M)}


def test_status_codes_match_the_header():
    c = _enum("kvp_status")
    py = {("KVP_OK" if s.name == "OK" else "KVP_ERR_" + s.name): int(s) for s in _lib.Status}
    assert py == c
    # Every error code has an exception class of its own, carrying the code.
    classes = set()
    for s in _lib.Status:
        if s:
            err = _lib.error_for(int(s), "x")
            assert err.status == int(s)
            classes.add(type(err))
    assert len(classes) == len(_lib.Status) - 1


def test_dtype_codes_match_the_header():
    c = _enum("kvp_dtype")
    assert {"KVP_DTYPE_F16": attn.DTYPE_F16, "KVP_DTYPE_BF16": attn.DTYPE_BF16, "KVP_DTYPE_F32": attn.DTYPE_F32,
            "KVP_DTYPE_E4M3": attn.DTYPE_E4M3} == c
    s = _enum("kvp_kv_scale")
    assert s == {"KVP_KV_SCALE_NONE": 0, "KVP_KV_SCALE_TOKEN_HEAD": _t.SCALE_TOKEN_HEAD, "KVP_KV_SCALE_TENSOR": _t.SCALE_TENSOR}


def test_plan_flags_match_the_header():
    from kvplug import cascade
    d = {k: int(x) for k, x in re.findall(r"#define (KVP_(?:PREFILL|CASCADE)_NO_\w+) (\d+)", header_text())}
    assert d == {"KVP_PREFILL_NO_DECODE_ROUTE": attn.PLAN_NO_DECODE_ROUTE, "KVP_PREFILL_NO_SPLIT_KV": attn.PLAN_NO_SPLIT_KV,
                 "KVP_PREFILL_NO_HOPPER": attn.PLAN_NO_HOPPER, "KVP_CASCADE_NO_DECODE_ROUTE": cascade.NO_DECODE_ROUTE,
                 "KVP_CASCADE_NO_HOPPER": cascade.NO_HOPPER}


def test_version_matches_the_header():
    v = {k: int(x) for k, x in re.findall(r"#define KVP_VERSION_(MAJOR|MINOR|PATCH) (\d+)", header_text())}
    assert kvplug.__version__ == f"{v['MAJOR']}.{v['MINOR']}.{v['PATCH']}"
    assert _lib._ABI_MAJOR == v["MAJOR"]
    assert kvplug.version() == (v["MAJOR"], v["MINOR"], v["PATCH"]), "the library under test is of another version"
