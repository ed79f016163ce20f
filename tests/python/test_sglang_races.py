"""kvplug.sglang under SGLang's threads, and its shared tier's keys.

SGLang's HiCache calls its storage backend from several threads: prefetch
threads (batch_exists, batch_get_v1), the backup thread (batch_set_v1), and
the scheduler, which may clear it (/clear_hicache_storage_backend) or close
it at any time. The races are forced, not left to timing: a host-store
copy is held inside its call (a patched HostStore.read or write waiting on
an event) while another thread clears or closes, and the test goes on once
that thread has finished or waits at the store's gate (_Gate.waiting), so
each test runs the same interleaving every time. The backend-level tests
reuse test_sglang_hybrid's stand-ins of SGLang's storage types and host
pools."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable, List

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_sglang_hybrid import PAGE, KVPool, fill, hybrid, keys, sg  # noqa: E402, F401  (sg: the fixture)

import kvplug.sglang as ks  # noqa: E402
from kvplug.sglang import PageStore  # noqa: E402
from kvplug.sharedstore import SharedStore, key128  # noqa: E402

BYTES = 256  # PageStore-level page size


def kk(*names: str) -> np.ndarray:
    return np.frombuffer(b"".join(key128(n) for n in names), np.uint8).reshape(-1, 16)


def seg(bufs: List[np.ndarray]) -> tuple:
    return (np.array([[b.ctypes.data] for b in bufs], np.uint64), np.array([[b.nbytes] for b in bufs], np.int64))


def page(v: int) -> np.ndarray:
    return np.full(BYTES, v, np.uint8)


def put(ps: PageStore, names: List[str], values: List[int]) -> np.ndarray:
    """ps.put of pages filled with values (held here until put returns: a
    pointer list alone would let them be freed before the copy)."""
    bufs = [page(v) for v in values]
    return ps.put(kk(*names), *seg(bufs))


class Runner:
    """fn on a thread of its own; join() returns its result or raises its
    exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001  (handed to join)
            self.error = e

    def join(self) -> Any:
        self.thread.join(30)
        assert not self.thread.is_alive(), "thread still running"
        if self.error is not None:
            raise self.error
        return self.result


def waiting_at_gate(stores: List[PageStore]) -> bool:
    return any(getattr(getattr(s, "_gate", None), "waiting", 0) for s in stores)


def wait_for(cond: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def settle(stores: List[PageStore], r: Runner) -> None:
    """Returns once r's thread has finished, or waits at a store's gate for
    the transfers running (without the gate: once it has finished)."""
    wait_for(lambda: not r.thread.is_alive() or waiting_at_gate(stores), "neither finished nor waiting at the gate")


def pause_first(host: Any, method: str) -> tuple:
    """Patches host.<method> so that its first call signals `entered` and
    waits for `go` before copying; returns (entered, go)."""
    real = getattr(host, method)
    entered, go = threading.Event(), threading.Event()
    first = [True]

    def paused(*a: Any, **kw: Any) -> Any:
        if first[0]:
            first[0] = False
            entered.set()
            assert go.wait(10)
        return real(*a, **kw)

    setattr(host, method, paused)
    return entered, go


# -- clear and close against running transfers --


def test_get_racing_clear_never_returns_another_pages_bytes():
    # A prefetch thread's get(k1) has pinned k1's slot and is about to copy
    # it out; the scheduler clears the store, and the backup thread stores
    # k2, which takes the slot reset freed. The get must copy k1's bytes
    # (clear waits for it), never report k1 found with k2's.
    ps = PageStore(BYTES, host_bytes=BYTES)  # one slot
    assert put(ps, ["k1"], [0xAA]).all()
    entered, go = pause_first(ps.host, "read")
    out = np.zeros(BYTES, np.uint8)
    getter = Runner(lambda: ps.get(kk("k1"), *seg([out])))
    assert entered.wait(10)
    other = Runner(lambda: (ps.clear(), put(ps, ["k2"], [0xBB]))[1])
    settle([ps], other)
    go.set()
    found = getter.join()
    assert other.join().all()
    assert found[0] and (out == 0xAA).all(), f"get(k1): found {found[0]} with bytes {out[0]:#x}"
    got = np.zeros(BYTES, np.uint8)
    assert ps.get(kk("k2"), *seg([got]))[0] and (got == 0xBB).all()
    assert not ps.get(kk("k1"), *seg([got]))[0]
    s = ps.host.stats()
    assert s.pinned == 0 and s.pending == 0
    ps.close()


def test_put_racing_clear_never_stores_a_page_under_another_key():
    # Backup thread A: put(k1) has reserved slot 0 and is about to write it.
    # The store is cleared; thread B's put(k2) reserves slot 0 again and
    # writes it; A's write lands in the slot (pending again, now for k2)
    # before B completes. k2 must never read back as k1's bytes: clear
    # waits for A's put to finish.
    ps = PageStore(BYTES, host_bytes=BYTES)
    host = ps.host
    entered, go = pause_first(host, "write")
    real_complete = host.complete
    b_at_complete, go_b = threading.Event(), threading.Event()
    on_b = threading.local()

    def complete(k64: Any, failed: bool = False) -> int:
        if getattr(on_b, "yes", False):
            b_at_complete.set()
            assert go_b.wait(10)
        return real_complete(k64, failed=failed)

    host.complete = complete
    a = Runner(lambda: put(ps, ["k1"], [0xAA]))
    assert entered.wait(10)

    def b_put() -> np.ndarray:
        on_b.yes = True
        ps.clear()
        return put(ps, ["k2"], [0xBB])

    b = Runner(b_put)
    # Without the gate B reaches its complete (its write done); with it, B
    # waits at the gate for A.
    wait_for(lambda: b_at_complete.is_set() or waiting_at_gate([ps]),
             "B neither at its complete nor waiting at the gate")
    go.set()  # A's write lands
    a.join()
    go_b.set()
    assert b.join().all()
    host.complete = real_complete
    got = np.zeros(BYTES, np.uint8)
    found = ps.get(kk("k2"), *seg([got]))
    assert found[0] and (got == 0xBB).all(), f"get(k2): found {found[0]} with bytes {got[0]:#x}"
    assert not ps.get(kk("k1"), *seg([got]))[0]  # cleared, then k2 took the only slot
    s = host.stats()
    assert s.pinned == 0 and s.pending == 0
    ps.close()


def test_close_racing_a_read_waits_for_it_then_refuses(sg):
    # SGLang closes the backend while a prefetch thread copies pages out of
    # the local tier: the C store's destroy freed the memory under the copy
    # (a SIGSEGV). close must wait for the copy, and transfers after it must
    # be refused with the backend's failure results, never raised or a crash.
    be, kv, mamba = hybrid(sg, kvplug_host_bytes=1 << 20)
    k = keys(2)
    idx, state = kv.alloc(2 * PAGE), mamba.alloc(1)
    fill(kv, idx, 1)
    fill(mamba, state, 2)
    assert be.batch_set_v1(k, idx) == [True, True]
    assert be.batch_set_v2([sg.PoolTransfer(name=sg.PoolName.MAMBA, host_indices=state, keys=[k[1]])]) == {
        "mamba": [True]}
    store = be._stores["kv"]
    entered, go = pause_first(store.host, "read")
    idx2 = kv.alloc(2 * PAGE)
    getter = Runner(lambda: be.batch_get_v1(k, idx2))
    assert entered.wait(10)
    closer = Runner(be.close)
    settle([store], closer)
    go.set()
    assert getter.join() == [True, True]
    closer.join()
    for a, b in zip(idx.tolist()[::PAGE], idx2.tolist()[::PAGE]):
        assert (kv.page(a) == kv.page(b)).all()
    # After close: failures, not exceptions.
    errors = be.counters()["errors"]
    assert be.batch_get_v1(k, kv.alloc(2 * PAGE)) == [False, False]
    assert be.batch_set_v1(k, idx) == [False, False]
    assert be.batch_exists(k) == 0 and not be.exists(k[0])
    assert be.batch_get_v2([sg.PoolTransfer(name=sg.PoolName.MAMBA, host_indices=mamba.alloc(1), keys=[k[1]])]) == {
        "mamba": [False]}
    assert be.clear() is True  # nothing left to clear
    assert be.counters()["errors"] > errors
    # The stores themselves, if a thread held one across the close.
    assert not store.get(kk("x"), *seg([np.zeros(store.page_bytes, np.uint8)])).any()
    assert store.exists_prefix(kk("x")) == 0 and not store.exists(kk("x")).any()
    store.clear()
    be.close()  # again: a no-op


def test_transfers_stay_concurrent_with_each_other():
    # The gate is shared among transfers: two gets are inside their copies
    # at once (a barrier both must reach; a gate that serialised them would
    # break it).
    ps = PageStore(BYTES, host_bytes=4 * BYTES)
    assert put(ps, ["a", "b"], [1, 2]).all()
    real = ps.host.read
    barrier = threading.Barrier(2, timeout=10)

    def read(*a: Any) -> None:
        barrier.wait()
        real(*a)

    ps.host.read = read
    outs = [np.zeros(BYTES, np.uint8) for _ in range(2)]
    rs = [Runner(lambda i=i: ps.get(kk("ab"[i]), *seg([outs[i]]))) for i in range(2)]
    assert all(r.join()[0] for r in rs)
    assert (outs[0] == 1).all() and (outs[1] == 2).all()
    ps.close()


def test_threads_with_clears_keep_every_page_its_own_bytes():
    # Many transfers on several threads while another clears over and over:
    # every page found holds its own bytes, nothing raises, nothing stays
    # pinned or pending.
    ps = PageStore(BYTES, host_bytes=4 * BYTES)
    wrong: List[Any] = []
    done = threading.Event()

    def io(t: int) -> None:
        rng = np.random.default_rng(t)
        for _ in range(1500):
            i = int(rng.integers(0, 16))
            if rng.random() < 0.5:
                put(ps, [f"p{i}"], [i])
            else:
                out = page(255)
                if ps.get(kk(f"p{i}"), *seg([out]))[0] and not (out == i).all():
                    wrong.append((i, sorted(set(out.tolist()))))

    def clearer() -> int:
        n = 0
        while not done.is_set():
            ps.clear()
            n += 1
            time.sleep(0.0002)  # pacing only: a clear waits at the gate, and holds new transfers back
        return n

    c = Runner(clearer)
    ios = [Runner(lambda t=t: io(t)) for t in range(6)]
    try:
        for r in ios:
            r.join()
    finally:
        done.set()
    assert c.join() > 0
    assert not wrong, wrong[:3]
    s = ps.host.stats()
    assert s.pinned == 0 and s.pending == 0
    ps.close()


_CLOSE_UNDER_READS = textwrap.dedent("""
    import threading, numpy as np
    from kvplug.sglang import PageStore
    from kvplug.sharedstore import key128
    PAGE = 8 << 20
    ps = PageStore(PAGE, host_bytes=2 * PAGE)
    k = np.frombuffer(key128("k"), np.uint8).reshape(1, 16)
    src = np.ones(PAGE, np.uint8)
    assert ps.put(k, np.array([[src.ctypes.data]], np.uint64), np.array([[PAGE]], np.int64)).all()
    started, closing, errors = threading.Barrier(5), threading.Event(), []
    def reader():
        try:
            dst = np.zeros(PAGE, np.uint8)
            p, l = np.array([[dst.ctypes.data]], np.uint64), np.array([[PAGE]], np.int64)
            started.wait()
            for _ in range(100000):
                if ps.get(k, p, l)[0]:
                    assert dst[0] == 1 and dst[-1] == 1, "wrong bytes"
                elif closing.is_set():
                    return
                else:
                    raise AssertionError("a miss before close")
            raise AssertionError("no miss after close")
        except BaseException as e:
            errors.append(repr(e))
    ts = [threading.Thread(target=reader) for _ in range(4)]
    [t.start() for t in ts]
    started.wait()
    closing.set()
    ps.close()
    [t.join() for t in ts]
    assert not errors, errors
    print("ok")
""")


def test_close_under_reading_threads_in_a_process_of_its_own():
    # The crash itself, in a child process: threads copy 8 MiB pages out of
    # the local tier while the store is closed. Without the gate, the
    # destroy freed the memory under a running copy (SIGSEGV), or a get
    # raised; with it, close waits for the copies and the gets after it
    # are misses.
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ks.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", _CLOSE_UNDER_READS], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), (r.returncode, r.stdout[-2000:], r.stderr[-3000:])


# -- the shared tier --


def _shared_page_store(server: str, host_pages: int = 4) -> PageStore:
    return PageStore(BYTES, host_bytes=host_pages * BYTES,
                     shared=SharedStore(server, "races", fingerprint=1, block_bytes=BYTES))


class PutLog:
    """Wraps a store's SharedStore.put: the keys of every call, and an
    optional override of the count it returns."""

    def __init__(self, ps: PageStore) -> None:
        self.real = ps.shared.put
        self.calls: List[List[bytes]] = []
        self.fail = False
        ps.shared.put = self

    def __call__(self, keys: np.ndarray, ptrs: Any, lens: Any) -> int:
        self.calls.append([bytes(k) for k in keys])
        return 0 if self.fail else self.real(keys, ptrs, lens)


def test_a_page_whose_server_write_failed_is_written_at_its_next_store(valkey_server):
    # The first backup of k1: the server does not take it (down, slow),
    # the local tier does. The next backup of k1 finds it in the local
    # tier: it must still go to the server, so that other instances see
    # it. Once the server has it, later backups make no server call.
    a = _shared_page_store(valkey_server)
    log = PutLog(a)
    log.fail = True
    assert put(a, ["k1"], [7]).all()  # in the local tier
    assert not a.shared.exists(kk("k1"))[0]
    log.fail = False
    assert put(a, ["k1"], [7]).all()
    assert a.shared.exists(kk("k1"))[0], "k1 never reaches the server while the local tier holds it"
    n = len(log.calls)
    assert put(a, ["k1"], [7]).all()
    assert len(log.calls) == n, "a page the server holds is written again"
    c = a.counters()
    assert c["shared_present"] == 1 and c["shared_stored"] == 1 and c["shared_skipped"] == 1
    # Another instance finds it on the server; the page it fetched is known
    # to be there, so its own backup of it makes no server call either.
    b = _shared_page_store(valkey_server)
    blog = PutLog(b)
    out = np.zeros(BYTES, np.uint8)
    assert b.get(kk("k1"), *seg([out]))[0] and (out == 7).all()
    assert put(b, ["k1"], [7]).all() and blog.calls == []
    a.close()
    b.close()


def test_with_an_expiry_a_page_is_written_again_once_half_of_it_has_passed(valkey_server, monkeypatch):
    # kvplug_ttl_ms: the server drops a page that long after its write. A
    # page the local tier holds is taken to be on the server for half of
    # that; a store after that writes it again (renewing it), and a page
    # only served by the server (written when, unknown) is written at its
    # next store.
    clock = [1000.0]
    monkeypatch.setattr(ks, "_now", lambda: clock[0])
    ttl = 10_000

    def store() -> PageStore:
        return PageStore(BYTES, host_bytes=4 * BYTES, shared_ttl_ms=ttl,
                         shared=SharedStore(valkey_server, "races", fingerprint=1, block_bytes=BYTES, ttl_ms=ttl))

    a = store()
    log = PutLog(a)
    assert put(a, ["t1"], [1]).all() and len(log.calls) == 1
    clock[0] += 4.9
    assert put(a, ["t1"], [1]).all() and len(log.calls) == 1
    clock[0] += 0.2  # past half the expiry
    assert put(a, ["t1"], [1]).all() and len(log.calls) == 2
    assert put(a, ["t1"], [1]).all() and len(log.calls) == 2
    b = store()
    blog = PutLog(b)
    out = np.zeros(BYTES, np.uint8)
    assert b.get(kk("t1"), *seg([out]))[0] and (out == 1).all()
    assert put(b, ["t1"], [1]).all() and len(blog.calls) == 1
    a.close()
    b.close()


def test_a_batch_the_server_took_part_of_is_written_again(valkey_server):
    # The server says how many pages it took, not which: a batch it took
    # part of is written again, whole, at the next store.
    a = _shared_page_store(valkey_server)
    log = PutLog(a)
    real = log.real
    log.real = lambda k, p, ln: real(k[:1], p[:1], ln[:1])  # only the first page reaches it
    assert put(a, ["x", "y"], [1, 2]).all()
    assert list(a.shared.exists(kk("x", "y"))) == [True, False]
    log.real = real
    assert put(a, ["x", "y"], [1, 2]).all()
    assert log.calls[-1] == [bytes(k) for k in kk("x", "y")]
    assert a.shared.exists(kk("x", "y")).all()
    a.close()


def test_put_says_ok_only_for_a_page_a_tier_holds(valkey_server):
    # ok[i]: the page is resident in the local tier, or the server took it.
    from conftest import free_port

    down = PageStore(BYTES, host_bytes=BYTES, shared=SharedStore(f"127.0.0.1:{free_port()}", "races",
                                                                   fingerprint=1, block_bytes=BYTES,
                                                                   op_timeout_ms=100))
    assert put(down, ["a"], [1]).all()  # local
    # Two new pages do not fit the one slot, and the server is down.
    assert not put(down, ["b", "c"], [2, 3]).any()
    # With the one the local tier holds: that one only.
    assert list(put(down, ["a", "b", "c"], [1, 2, 3])) == [True, False, False]
    down.close()
    # A page the local tier evicted is forgotten as the server's: its next
    # store writes it again (and the known set stays within the local tier).
    a = _shared_page_store(valkey_server, host_pages=1)
    log = PutLog(a)
    assert put(a, ["e1"], [1]).all()
    assert put(a, ["e2"], [2]).all()  # evicts e1
    assert put(a, ["e1"], [1]).all()
    assert [len(c) for c in log.calls] == [1, 1, 1] and log.calls[2] == [key128("e1")]
    assert len(a._on_server) <= a.host.num_slots
    a.clear()
    assert not a._on_server
    a.close()


def test_another_layout_of_the_model_shares_no_keys(sg, valkey_server):
    # A bf16 and an fp8 instance of one model on one server (server only:
    # no local tier to answer first). Each must neither count the other's
    # pages (batch_exists would promise pages batch_get_v1 then misses) nor
    # overwrite them; an instance of the same layout shares them.
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    if e4m3 is None:
        pytest.skip("this torch has no float8_e4m3fn")

    def instance(dtype: Any, tok_bytes: int) -> tuple:
        be = sg.make(kvplug_valkey=valkey_server)
        kv = KVPool(64, PAGE, tok_bytes)
        kv.dtype = dtype
        be.register_mem_pool_host(kv)
        return be, kv

    bf16, kv16 = instance(torch.bfloat16, 64)
    fp8, kv8 = instance(e4m3, 32)
    k = keys(3)
    idx16 = kv16.alloc(3 * PAGE)
    fill(kv16, idx16, 1)
    assert bf16.batch_set_v1(k, idx16) == [True] * 3
    assert fp8.batch_exists(k) == 0, "fp8 counts bf16's pages"
    idx8 = kv8.alloc(3 * PAGE)
    fill(kv8, idx8, 2)
    assert fp8.batch_set_v1(k, idx8) == [True] * 3
    assert fp8.batch_exists(k) == 3
    back = kv16.alloc(3 * PAGE)
    assert bf16.batch_get_v1(k, back) == [True] * 3, "fp8's store overwrote bf16's pages"
    for a, b in zip(idx16.tolist()[::PAGE], back.tolist()[::PAGE]):
        assert torch.equal(kv16.page(a), kv16.page(b))
    twin, kv16b = instance(torch.bfloat16, 64)
    assert twin.batch_exists(k) == 3
    assert twin.batch_get_v1(k, kv16b.alloc(3 * PAGE)) == [True] * 3
