"""What a first user of the package runs into: arrays that view the library's
memory outliving their owner, tables written with the wrong width, errors
that are not kvplug's, empty batches, prompts that can never fit, settings
that were silently changed or accepted, and GPU entry points on a machine
without a GPU. Each test is the regression test of one of these."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvplug
from kvplug import _lib
from kvplug.hoststore import HostStore
from kvplug.vmem import VirtualKVCache

torch = pytest.importorskip("torch")


def run_python(code: str) -> subprocess.CompletedProcess:
    """code run by a fresh interpreter with this one's environment (the
    library and the package found the same way): a crash there is a failed
    assertion here, not the end of the test run."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))


def tier_manager(slots: int = 8, block_bytes: int = 4096) -> kvplug.Manager:
    return kvplug.Manager(64, 16, prefix_cache=True, host_tier_slots=slots, host_block_bytes=block_bytes)


def live() -> int:
    gc.collect()
    return _lib.live_handles()


# ---- views of the library's memory keep it alive ------------------------------------------


def test_the_issue_snippet_reads_the_host_tier_of_a_dropped_manager():
    # The manager goes out of scope with its function; the array it returned
    # is read afterwards (a segmentation fault when the array did not keep
    # the memory alive).
    r = run_python("""
        import gc, kvplug
        def buf():
            m = kvplug.Manager(64, 16, prefix_cache=True, host_tier_slots=4096, host_block_bytes=65536)
            return m.host_tier_memory()
        mem = buf()
        gc.collect()
        mem[:, 0] = 3
        print(int(mem[:, 0].sum()))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(3 * 4096)]


def test_host_tier_view_keeps_a_dropped_manager_alive():
    before = live()

    def view():
        m = tier_manager()
        return m.host_tier_memory()

    mem = view()
    assert live() == before + 1  # the manager, and its memory, stay
    mem[:] = np.arange(mem.shape[1], dtype=np.uint64).astype(np.uint8)
    assert int(mem[5, 300]) == 300 % 256
    del mem
    assert live() == before  # the last view gone: the manager is destroyed


def test_host_tier_view_survives_close_and_the_manager_refuses_calls():
    before = live()
    m = tier_manager()
    mem = m.host_tier_memory()
    mem[:] = 7
    t = torch.from_numpy(mem[2:4])  # a tensor of a slice: it holds the memory too
    del mem
    m.close()
    with pytest.raises(kvplug.InvalidHandleError):
        m.host_tier_memory()
    with pytest.raises(kvplug.InvalidHandleError):
        m.add(1, 4)
    assert live() == before + 1  # closed, but its memory is still viewed
    assert int(t.sum()) == 7 * 2 * 4096
    del t
    assert live() == before


def test_close_without_views_destroys_at_once():
    before = live()
    m = tier_manager()
    m.host_tier_memory()  # a view made and dropped
    m.close()
    assert _lib.live_handles() == before  # no gc needed: nothing still views it


def test_host_tier_view_of_engine_memory_keeps_it_alive():
    before = live()
    own = np.zeros(8 * 4096, np.uint8)
    m = kvplug.Manager(64, 16, prefix_cache=True, host_tier_slots=8, host_block_bytes=4096, host_tier_memory=own)
    mem = m.host_tier_memory()
    assert mem.ctypes.data == own.ctypes.data
    del own, m
    mem[1] = 9
    assert live() == before + 1
    assert int(mem.sum()) == 9 * 4096
    del mem
    assert live() == before


def test_host_store_view_survives_close():
    before = live()
    hs = HostStore(num_slots=4, slot_bytes=4096)
    mem = hs.memory()
    mem[3] = 5
    hs.close()
    with pytest.raises(kvplug.InvalidHandleError):
        hs.memory()
    assert live() == before + 1
    assert int(mem[3].sum()) == 5 * 4096 and int(mem[:3].sum()) == 0
    del mem
    assert live() == before


def test_host_store_view_keeps_a_dropped_store_alive():
    before = live()
    mem = HostStore(num_slots=4, slot_bytes=4096).memory()
    assert live() == before + 1
    mem[:] = 1
    assert int(mem.sum()) == 4 * 4096
    del mem
    assert live() == before


def host_vcache() -> VirtualKVCache:
    return VirtualKVCache(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", max_batch=2, max_context=300,
                          budget_bytes=64 << 20, backend="host", background=False)


def test_vmem_view_survives_close():
    # The host backend unmaps its memory on destroy: a read of an array
    # that outlived close() would fault.
    before = live()
    vc = host_vcache()
    s = vc.alloc()
    vc.step([s], [100])
    k = vc.k(1)
    k[s, :100] = 2.0
    t = torch.from_numpy(k[s, :100])
    del k
    vc.close()
    with pytest.raises(kvplug.InvalidHandleError):
        vc.k(0)
    with pytest.raises(kvplug.InvalidHandleError):
        vc.alloc()
    assert live() == before + 1
    assert float(t.sum()) == 2.0 * 100 * 2 * 8
    del t
    assert live() == before


def test_vmem_close_without_views_destroys_at_once():
    before = live()
    vc = host_vcache()
    vc.k(0)
    vc.v(1)
    vc.close()
    assert _lib.live_handles() == before


def test_vmem_view_survives_close_in_a_fresh_process():
    # The same read after close() where a crash cannot take the test run with it.
    r = run_python("""
        from kvplug.vmem import VirtualKVCache
        vc = VirtualKVCache(2, 2, 8, "float32", 2, 300, 64 << 20, backend="host", background=False)
        s = vc.alloc()
        vc.step([s], [300])
        k = vc.k(0)
        k[s] = 1.5
        vc.close()
        print(float(k[s].sum()))
    """)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) == 1.5 * 300 * 2 * 8


# ---- describe_into: a 2-D table's width is its row stride -----------------------------------


def two_sequences() -> kvplug.Manager:
    m = kvplug.Manager(16, 4)
    m.add(1, 6)  # blocks 0, 1
    m.add(2, 9)  # blocks 2, 3, 4
    return m


def test_describe_into_refuses_a_max_blocks_other_than_the_tables_width():
    with two_sequences() as m:
        table = np.full((2, 8), -7, np.int32)
        lens = np.zeros(2, np.int32)
        with pytest.raises(kvplug.InvalidArgumentError, match="max_blocks=4 but block_table has 8 columns"):
            m.describe_into([1, 2], table, lens, max_blocks=4)
        assert (table == -7).all() and (lens == 0).all()  # nothing written
        # The width itself, given or not, fills one row per sequence.
        for mb in (None, 8):
            table[:] = -7
            m.describe_into([1, 2], table, lens, max_blocks=mb)
            assert table.tolist() == [[0, 1] + [-1] * 6, [2, 3, 4] + [-1] * 5]
            assert lens.tolist() == [6, 9]


def test_describe_into_a_flat_table_uses_max_blocks_as_its_stride():
    with two_sequences() as m:
        flat = np.full(10, -7, np.int32)
        m.describe_into([1, 2], flat, max_blocks=4)
        assert flat.tolist() == [0, 1, -1, -1, 2, 3, 4, -1, -7, -7]


def test_describe_with_out_checks_max_blocks_against_the_table():
    with two_sequences() as m:
        out = (np.empty((2, 8), np.int32), np.empty(2, np.int32), np.empty(15, np.int32))  # 6 + 9 new tokens
        with pytest.raises(kvplug.InvalidArgumentError, match="8 columns"):
            m.describe([1, 2], 4, out=out)
        assert m.describe([1, 2], 8, out=out).block_table.shape == (2, 8)


def test_describe_into_refuses_a_three_dimensional_table():
    with two_sequences() as m:
        with pytest.raises(kvplug.InvalidArgumentError, match="block_table must be 2-D"):
            m.describe_into([1, 2], np.empty((2, 2, 4), np.int32), max_blocks=4)
