"""Integers cross into C checked: a value the C type cannot hold, or one
that is not an integer, is an InvalidArgumentError naming the argument, and
nothing changes (ctypes alone would wrap 2**64 to 0 and act on another
object). Binding objects collected without close() release their handles."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

import kvplug
from kvplug import _lib, attn
from kvplug.prefix import Keys


def _raises(fragment: str):
    return pytest.raises(kvplug.InvalidArgumentError, match=fragment)


def test_fork_parent_out_of_int64_is_refused():
    with kvplug.Manager(16, 4) as m:
        m.add(0, 5)
        with _raises("fork: parent must be in"):
            m.fork(2**64, [5])
        with _raises("fork: parent must be an integer"):
            m.fork(0.0, [5])
        assert m.stats().num_seqs == 1  # sequence 0 was not forked


def test_admit_ids_must_be_int64_integers():
    with kvplug.Manager(16, 4, prefix_cache=True) as m:
        for ids in ([1.7], ["7"], [2**63]):
            with pytest.raises(kvplug.InvalidArgumentError, match="seq_ids"):
                m.admit(ids, [[1, 2, 3]])
        assert m.stats().num_seqs == 0


def test_add_and_grow_arguments():
    with kvplug.Manager(16, 4) as m:
        with _raises("add: seq_id must be in"):
            m.add(2**63, 4)
        with _raises("add: prompt_len must be in"):
            m.add(1, 2**31)
        m.add(1, 4)
        with _raises("grow: num_tokens must be an integer: got float 1.5"):
            m.grow([1], 1.5)
        with _raises("grow: num_tokens must be in"):
            m.grow([1], 2**40)
        m.grow(np.array([1]), np.int64(2))  # numpy integers are integers
        assert m.describe([1]).seq_lens.tolist() == [6]


def test_describe_max_blocks_must_be_positive():
    with kvplug.Manager(16, 4) as m:
        m.add(1, 4)
        with _raises("describe: max_blocks must be in \\[1, 2\\^31-1\\]: got -1"):
            m.describe([1], max_blocks=-1)


def test_prefix_scalars():
    with kvplug.Manager(16, 4, prefix_cache=True) as m:
        with _raises("unpin: pin_id must be in \\[0, 2\\^64-1\\]"):
            m.unpin(-1)
        with _raises("set_priority: priority must be in"):
            m.set_priority([1, 2, 3, 4], 2**31)
        with _raises("add_mm_items: seq_id must be an integer"):
            m.add_mm_items("1", [])
        with _raises("keys: adapter must be in"):
            m.match([[1, 2, 3, 4]], Keys(adapter=2**64))
        with _raises("drain_events: max_events must be an integer"):
            m.drain_events(1.0)


def test_vcache_integers():
    with _raises("VirtualKVCache: num_layers must be in"):
        kvplug.VirtualKVCache(2**32 + 1, 8, 128, "float16", 1, 64, 1 << 20, backend="host")
    with kvplug.VirtualKVCache(1, 8, 128, "float16", 2, 64, 1 << 22, backend="host") as vc:
        s = vc.alloc()
        with _raises("free: slot must be in"):
            vc.free(2**32 + s)  # would free slot s if wrapped
        assert vc.stats()["active_slots"] == 1
        with _raises("element 0 must be an integer"):
            vc.step([1.5], [16])
        with _raises("layer must be in"):
            vc.layer_ptrs(2**31)


def test_attn_workspace_size_does_not_wrap():
    with _raises("max_batch must be in"):
        attn.workspace_size(2**32 + 64, 32, 128)


def test_a_manager_collected_without_close_is_destroyed_and_says_so():
    gc.collect()
    before = _lib.live_handles()
    m = kvplug.Manager(16, 4)
    m.add(1, 4)
    assert _lib.live_handles() == before + 1
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del m
        gc.collect()
    assert _lib.live_handles() == before
    assert any(issubclass(x.category, ResourceWarning) and "1 live sequence" in str(x.message) for x in w)
    # close() is the deterministic way, and says nothing.
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = kvplug.Manager(16, 4)
        m.add(1, 4)
        m.close()
        del m
        gc.collect()
    assert not [x for x in w if issubclass(x.category, ResourceWarning)]
    assert _lib.live_handles() == before


def test_host_int32_arrays_of_a_plan_are_checked():
    """The host arrays a plan copies (qo_indptr_host, kv_lens_host,
    seq_lens_host) are int32 values: anything else is refused whole, from
    lists, numpy arrays and tensors alike."""
    from kvplug.attn import _host_i32

    assert list(_host_i32([0, 3, 7], 3, "qo_indptr_host")) == [0, 3, 7]
    assert list(_host_i32(np.array([[5], [9]], dtype=np.int64), 2, "kv_lens_host")) == [5, 9]
    with _raises("kv_lens_host has 3 entries; 2 expected"):
        _host_i32([1, 2, 3], 2, "kv_lens_host")
    with _raises(r"kv_lens_host must be in \[-2\^31, 2\^31-1\]: got 2147483648"):
        _host_i32(np.array([1, 2**31], dtype=np.int64), 2, "kv_lens_host")
    with _raises("seq_lens_host must be an integer: got float 1.5"):
        _host_i32([1.5, 2], 2, "seq_lens_host")
    with _raises("seq_lens_host must be an integer: got bool"):
        _host_i32([True, 2], 2, "seq_lens_host")
