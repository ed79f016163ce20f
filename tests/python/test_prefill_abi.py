"""The prefill plan/run ABI through ctypes, on any machine (no GPU needed):
struct sizes against the header, the workspace size, and argument checks
that fail before any device is touched."""

from __future__ import annotations

import ctypes

import pytest

import kvplug
from kvplug import _lib, attn


def test_struct_sizes_match_the_header():
    # Header layout: size_t + 8 int32 + 2 host pointers + 4 uint64 = 88;
    # size_t + 14 int32 + 9 uint64 = 136; size_t + 4 int32 + 14 eight-byte
    # fields + float + int32 = 144, the kv pointer of 0.4: 152, and the
    # sinks of 0.6: 160.
    assert ctypes.sizeof(attn._PrefillPlanArgs) == 88
    assert ctypes.sizeof(attn._AttnPlan) == 136
    assert ctypes.sizeof(attn._PagedPrefillArgs) == 160


def test_workspace_size():
    n = attn.prefill_workspace_size(8, 4096, 32, 8, 128)
    # The work list of the worst batch (one partial tile per sequence) or the
    # decode route's split partials, whichever is larger.
    items = (4096 * 4 + 63) // 64 + 8
    assert n >= 4 * (8 + 8 * items)
    assert n >= 4 * 32 * 8 * 32 * 129
    with pytest.raises(kvplug.UnsupportedError):
        attn.prefill_workspace_size(8, 4096, 32, 8, 96)
    with pytest.raises(kvplug.InvalidArgumentError, match="multiple"):
        attn.prefill_workspace_size(8, 4096, 32, 7, 128)


def _plan(qo, kv, ws_bytes=1 << 20, struct_size=None):
    n = len(kv)
    a = attn._PrefillPlanArgs(
        ctypes.sizeof(attn._PrefillPlanArgs) if struct_size is None else struct_size,
        attn.DTYPE_BF16, 128, 8, 2, n, 0, 0, 0,
        (ctypes.c_int32 * len(qo))(*qo), (ctypes.c_int32 * max(n, 1))(*kv),
        0x1000, 0x2000, 0x3000, ws_bytes)
    plan = attn._AttnPlan()
    plan.struct_size = ctypes.sizeof(attn._AttnPlan)
    f = _lib.fn("kvp_prefill_plan", ctypes.c_int,
                [ctypes.POINTER(attn._PrefillPlanArgs), ctypes.POINTER(attn._AttnPlan), ctypes.c_uint64])
    st = f(ctypes.byref(a), ctypes.byref(plan), 0)
    return st, plan


def test_plan_argument_errors():
    st, plan = _plan([0, 3, 2], [10, 4])
    assert st == _lib.Status.INVALID_ARGUMENT and plan.kind == 0
    assert "decrease" in _lib.last_error()
    st, _ = _plan([0, 11, 12], [10, 4])
    assert st == _lib.Status.INVALID_ARGUMENT and "kv_len" in _lib.last_error()
    st, _ = _plan([0, 3, 4], [10, 4], ws_bytes=40)
    assert st == _lib.Status.BUFFER_TOO_SMALL
    st, _ = _plan([0, 3, 4], [10, 4], struct_size=16)
    assert st == _lib.Status.STRUCT_SIZE
