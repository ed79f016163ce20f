"""What a first user of the package runs into: arrays that view the library's
memory outliving their owner, tables written with the wrong width, errors
that are not kvplug's, empty batches, prompts that can never fit, settings
that were silently changed or accepted, and GPU entry points on a machine
without a GPU. Each test is the regression test of one of these."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import kvplug
from kvplug import _lib
from kvplug.hoststore import HostStore
from kvplug.vmem import VirtualKVCache


def run_python(code: str) -> subprocess.CompletedProcess:
    """code run by a fresh interpreter with this one's environment (the
    library and the package found the same way): a crash there is a failed
    assertion here, not the end of the test run."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))


def tier_manager(slots: int = 8, block_bytes: int = 4096) -> kvplug.Manager:
    return kvplug.Manager(64, 16, prefix_cache=True, host_tier_slots=slots, host_block_bytes=block_bytes)


def live() -> int:
    """The library's live handles once the count has settled: an earlier
    test's handles may still be released by threads it left finishing
    (the shared tier's workers), which would move the count under a test."""
    gc.collect()
    n, same = _lib.live_handles(), 0
    for _ in range(200):  # unchanged over three samples 20 ms apart, within 4 s
        time.sleep(0.02)
        gc.collect()
        m = _lib.live_handles()
        same = same + 1 if m == n else 0
        if same == 3:
            break
        n = m
    return n


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


# ---- every error is a KvplugError, and the matching built-in ------------------------------


def test_the_new_error_classes():
    assert issubclass(kvplug.ArgumentTypeError, kvplug.InvalidArgumentError)
    assert issubclass(kvplug.ArgumentTypeError, TypeError) and issubclass(kvplug.ArgumentTypeError, ValueError)
    assert issubclass(kvplug.PromptTooLongError, kvplug.InvalidArgumentError)
    # Not "not now": a scheduler that retries on OutOfBlocksError must not retry it.
    assert not issubclass(kvplug.PromptTooLongError, kvplug.OutOfBlocksError)
    assert _lib.error_for(kvplug.Status.IN_USE, "m").__class__ is kvplug.InUseError


def bad_calls(m):
    """(call, exception class, what its message must name)."""
    return [
        (lambda: m.admit([1], prompts=None), kvplug.ArgumentTypeError, "prompts"),
        (lambda: m.admit(None, [[1, 2]]), kvplug.ArgumentTypeError, "seq_ids"),
        (lambda: m.grow(None), kvplug.ArgumentTypeError, "seq_ids"),
        (lambda: m.grow([1], None), kvplug.ArgumentTypeError, "num_tokens"),
        (lambda: m.grow([1], np.array([1.0], np.float32)), kvplug.ArgumentTypeError, "num_tokens"),
        (lambda: m.grow([1], torch.tensor(1.0)), kvplug.ArgumentTypeError, "num_tokens"),
        (lambda: m.grow(torch.tensor([1], dtype=torch.bfloat16)), kvplug.ArgumentTypeError, "seq_ids"),
        (lambda: m.grow_tokens([1], None), kvplug.ArgumentTypeError, "tokens"),
        (lambda: m.remove("1"), kvplug.ArgumentTypeError, "seq_ids"),
        (lambda: m.describe_into([1], np.empty((1, 8), np.int64)), kvplug.ArgumentTypeError, "block_table"),
        (lambda: m.describe_into([1], np.empty((1, 16), np.int32)[:, ::2]), kvplug.InvalidArgumentError, "block_table"),
        (lambda: m.describe_into([1], None, np.empty(1, np.int32).astype(np.int16)), kvplug.ArgumentTypeError, "seq_lens"),
        (lambda: m.describe_into([1], None, None, torch.empty(4, dtype=torch.int64)), kvplug.ArgumentTypeError,
         "slot_mapping"),
        (lambda: m.admit([2], [[1, 2]], keys=5), kvplug.ArgumentTypeError, "keys"),
        (lambda: m.match(None), kvplug.ArgumentTypeError, "prompts"),
        (lambda: m.admit([2], [None]), kvplug.ArgumentTypeError, "prompt 0"),
    ]


def test_bad_arguments_raise_kvplug_errors_naming_them():
    with kvplug.Manager(64, 16, prefix_cache=True) as m:
        m.add(1, 5)
        for i, (call, cls, name) in enumerate(bad_calls(m)):
            with pytest.raises(cls) as e:
                call()
            assert isinstance(e.value, kvplug.KvplugError), i
            assert name in str(e.value), (i, str(e.value))
        assert m.stats().num_seqs == 1  # nothing was admitted or removed


def test_other_bad_arguments_raise_kvplug_errors():
    cases = [
        (lambda: kvplug.Manager(8, 16, shared_tier=5), kvplug.ArgumentTypeError, "shared_tier"),
        (lambda: kvplug.Manager(8, 16, shared_tier="a\x00b:1"), kvplug.InvalidArgumentError, "shared_tier"),
        (lambda: VirtualKVCache(1, 1, 8, "float13", 1, 16, 1 << 20, backend="host"), kvplug.ArgumentTypeError, "dtype"),
        (lambda: HostStore(4, 64).state(None), kvplug.ArgumentTypeError, "keys"),
        (lambda: HostStore(4, 64).state([-1]), kvplug.InvalidArgumentError, "keys"),
        (lambda: kvplug.set_logger(42), kvplug.ArgumentTypeError, "callback"),
        (lambda: kvplug.as_ptr(None, None), kvplug.ArgumentTypeError, "numpy array"),
    ]
    for i, (call, cls, name) in enumerate(cases):
        with pytest.raises(cls) as e:
            call()
        assert isinstance(e.value, kvplug.KvplugError) and name in str(e.value), (i, str(e.value))


def test_torch_integer_scalars_and_arrays_are_taken_like_numpys():
    with kvplug.Manager(64, 4) as a, kvplug.Manager(64, 4) as b:
        a.add(np.int64(7), np.int64(5))
        b.add(torch.tensor(7), torch.tensor(5))
        a.grow([7], np.int64(3))
        b.grow([7], torch.tensor(3))
        a.grow(np.array([7], np.int32), np.array([2], np.int64))
        b.grow(torch.tensor([7], dtype=torch.int32), torch.tensor([2]))  # int64 counts, int32 ids
        a.grow([7], np.array(1))  # a 0-d array is one number
        b.grow([7], torch.tensor(1, dtype=torch.int32))
        assert a.describe([7]).seq_lens.tolist() == b.describe(torch.tensor([7])).seq_lens.tolist() == [11]
        with pytest.raises(kvplug.InvalidArgumentError, match="num_tokens must be in"):
            b.grow([7], torch.tensor(2**40))  # checked as numpy's would be, never wrapped
        b.remove(torch.tensor([7], dtype=torch.int32))
        assert b.stats().num_seqs == 0


# ---- empty batches do nothing ------------------------------------------------------------------


def test_empty_batches_do_nothing():
    with kvplug.Manager(64, 16, prefix_cache=True) as m:
        m.admit([1], [list(range(40))])
        before = (m.stats(), m.describe([1]))
        m.grow([])
        m.grow([], 1)
        m.grow(np.empty(0, np.int64), np.empty(0, np.int32))
        m.grow_tokens([], [])
        m.grow_tokens(np.empty(0, np.int64), np.empty(0, np.int32))
        m.remove([])
        assert m.admit([], []).tolist() == []
        assert m.match([]) == []
        d = m.describe([])
        assert d.block_table.shape == (0, 1) and d.seq_lens.shape == (0,) and d.slot_mapping.shape == (0,)
        assert m.describe([], 4).block_table.shape == (0, 4)
        table, lens, slots = np.full((2, 4), 9, np.int32), np.full(2, 9, np.int32), np.full(2, 9, np.int32)
        assert m.describe_into([], table, lens, slots) == 0
        assert (table == 9).all() and (lens == 9).all() and (slots == 9).all()  # nothing written
        after = (m.stats(), m.describe([1]))
        assert before[0] == after[0]
        assert before[1].block_table.tolist() == after[1].block_table.tolist()
        # Counts or tokens for sequences that are not there are still refused.
        with pytest.raises(kvplug.InvalidArgumentError, match="1 token counts for 0 sequences"):
            m.grow([], [1])
        with pytest.raises(kvplug.InvalidArgumentError, match="tokens for 0 sequences"):
            m.grow_tokens([], [[5]])
        with pytest.raises(kvplug.InvalidArgumentError, match="0 ids for 1 prompts"):
            m.admit([], [[1]])
    # A closed manager says so even for an empty batch.
    for call in (lambda: m.grow([]), lambda: m.remove([]), lambda: m.describe([]), lambda: m.admit([], []),
                 lambda: m.grow_tokens([], [])):
        with pytest.raises(kvplug.InvalidHandleError, match="closed"):
            call()


def test_empty_match_tiers():
    with tier_manager() as m:
        assert m.match_tiers([]) == []


# ---- a prompt that can never fit is not "not now" ------------------------------------------


def test_admit_refuses_a_prompt_longer_than_the_pool():
    with kvplug.Manager(8, 4, prefix_cache=True) as m:  # 32 tokens in all
        with pytest.raises(kvplug.PromptTooLongError, match="sequence 5's prompt of 33 tokens needs 9 blocks") as e:
            m.admit([5], [list(range(33))])
        assert "never" in str(e.value)
        # In a batch: nothing admitted, not even the prompts before it.
        with pytest.raises(kvplug.PromptTooLongError, match="sequence 7's"):
            m.admit([6, 7], [list(range(4)), np.arange(40, dtype=np.int32)])
        with pytest.raises(kvplug.PromptTooLongError, match="sequence 8's"):
            m.admit(np.array([8, 9]), np.zeros((2, 33), np.int32))  # a 2-D batch
        with pytest.raises(kvplug.PromptTooLongError, match="sequence 10's"):
            m.add(10, 33)
        assert m.stats().num_seqs == 0
        # The whole pool is a prompt that fits; a prompt that fits the pool but
        # not now is still "retry later" ([] admitted, no error).
        assert m.admit([11], [list(range(32))]).tolist() == [0]
        assert m.admit([12], [list(range(4))]).tolist() == []
        with pytest.raises(kvplug.OutOfBlocksError):
            m.add(13, 4)


# ---- settings refused at creation ------------------------------------------------------------


def test_block_size_zero_is_refused():
    with pytest.raises(kvplug.InvalidArgumentError, match="block_size must be >= 1"):
        kvplug.Manager(64, block_size=0)


@pytest.mark.parametrize("addr", ["not an address", "", "localhost", "localhost:", ":6379", "::1:6379",
                                  "host:99999", "host:0", "host:63 79", "host:port"])
def test_shared_tier_must_be_host_and_port(addr):
    with pytest.raises(kvplug.InvalidArgumentError, match="shared_tier must be \"host:port\""):
        kvplug.Manager(64, 16, prefix_cache=True, host_tier_slots=8, host_block_bytes=4096, shared_tier=addr,
                       shared_tier_namespace="ns")


@pytest.mark.parametrize("addr", ["127.0.0.1:1", "localhost:6379", "[::1]:1"])
def test_shared_tier_addresses_that_are_taken(addr):
    kvplug.Manager(64, 16, prefix_cache=True, host_tier_slots=8, host_block_bytes=4096, shared_tier=addr,
                   shared_tier_namespace="ns", shared_tier_timeout_ms=10).close()


@pytest.mark.parametrize("mem", [np.zeros(8 * 512, np.float64), np.zeros(8 * 2048, np.int16),
                                 torch.zeros(8 * 1024, dtype=torch.float32)], ids=["float64", "int16", "torch.float32"])
def test_host_tier_memory_must_be_bytes(mem):
    with pytest.raises(kvplug.ArgumentTypeError, match="host_tier_memory must be a"):
        kvplug.Manager(64, 16, prefix_cache=True, host_tier_slots=8, host_block_bytes=4096, host_tier_memory=mem)
    ok = mem.view(np.uint8) if isinstance(mem, np.ndarray) else mem.view(torch.uint8)
    kvplug.Manager(64, 16, prefix_cache=True, host_tier_slots=8, host_block_bytes=4096, host_tier_memory=ok).close()


# ---- GPU entry points on a machine without a GPU --------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_entry_points_raise_no_device_error():
    from kvplug import attn, cascade

    for call, name in ((attn.prepare, "attn.prepare"), (lambda: cascade.Workspaces(8, 32, 8, 128), "cascade.Workspaces"),
                       (lambda: attn.num_splits(torch.float16, 128, 1, 32, 8, 100), "attn.num_splits")):
        with pytest.raises(kvplug.NoDeviceError, match=name + ": no CUDA device"):
            call()


# ---- the smoke runs: examples/hf_engine.py and bench/hf_bench.py ------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_script(name: str, path: str):
    """A script of the repository as a module (registered: its dataclasses look their module up)."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_engine_help_lists_the_models_without_importing_torch():
    r = run_python(f"""
        import runpy, sys
        sys.argv = ["hf_engine.py", "--help"]
        try:
            runpy.run_path({str(ROOT / "examples" / "hf_engine.py")!r}, run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, e.code
        print("imported:", sorted(m for m in ("torch", "transformers", "kvplug.hf") if m in sys.modules))
    """)
    assert r.returncode == 0, r.stderr
    assert "{tiny-llama,tiny-mistral,tiny-qwen2,llama3-8b}" in r.stdout.replace("\n", "").replace(" ", "")
    assert r.stdout.splitlines()[-1] == "imported: []"


def engine_summary(capsys, *flags: str) -> list:
    E = load_script("hf_engine", "examples/hf_engine.py")
    E.main(["--device", "cpu", "--dtype", "float32", "--requests", "4", "--rate", "0", "--system", "32", "--own", "8", "8",
            "--output", "2", "2", "--max-batch", "4", "--step-tokens", "256", "--quiet", *flags])
    return capsys.readouterr().out.splitlines()


def test_engine_summary_counts_each_admitted_prompt_once(capsys):
    lines = engine_summary(capsys)
    hit = [ln for ln in lines if "prefix cache:" in ln]
    assert len(hit) == 1, lines
    # Four prompts of 32 + 8 tokens, none preempted: 160 prompt tokens at admission, not 320.
    assert "of 160)" in hit[0], hit[0]
    assert "preemptions" in lines[1] and ", 0 preemptions" in lines[1], lines[1]


def test_engine_summary_has_no_shared_tier_line_without_one(capsys):
    lines = engine_summary(capsys, "--host-cache-gb", "0.01")
    assert any("host tier:" in ln for ln in lines), lines
    assert not any("shared tier" in ln for ln in lines), lines


def test_bench_formats_missing_figures_as_a_dash():
    B = load_script("hf_bench", "bench/hf_bench.py")
    assert B.fmt(float("nan"), "8.1f") == "       -" and B.fmt(float("nan"), ".1%") == "-"
    assert B.fmt(0.25, ".1%") == "25.0%" and B.fmt(3.14159, "6.1f") == "   3.1"


def test_bench_pool_defaults_to_the_workload_within_the_device(monkeypatch):
    import argparse

    B = load_script("hf_bench", "bench/hf_bench.py")
    assert B.device_free_bytes("cpu") > 0
    args = argparse.Namespace(device="cpu", max_batch=8)
    monkeypatch.setattr(B, "device_free_bytes", lambda device: 1 << 40)
    assert B.default_pool_blocks(args, 1 << 20, 1000) == 1008  # the working set fits
    assert B.default_pool_blocks(args, 1 << 20, 10**6) == 40 * 1024  # at most 40 GiB
    monkeypatch.setattr(B, "device_free_bytes", lambda device: 100 << 20)
    assert B.default_pool_blocks(args, 1 << 20, 1000) == 100  # at most what the device has free


def test_bench_smoke_run_without_kv_gb(tmp_path, capsys):
    B = load_script("hf_bench", "bench/hf_bench.py")
    out = tmp_path / "c.json"
    B.main(["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--workloads", "c", "--systems", "kvplug",
            "--scale", "0.02", "--samples-c", "2", "--own", "8", "16", "--output", "4", "8", "--max-batch", "4",
            "--step-tokens", "64", "--chunk", "32", "--quiet", "--json", str(out)])
    text = capsys.readouterr().out
    r = json.loads(out.read_text())["c/kvplug"]
    assert r["finished"] == r["requests"] == 1
    assert r["num_blocks"] == r["working_set_blocks"] + 4  # sized to the workload, not 40 GiB
    assert "nan" not in text and "full batch -" in text, text  # two sequences: no full batch of 4
