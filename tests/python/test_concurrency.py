"""One Manager with the prefix cache on, called from many Python threads at
once (each with sequence ids of its own), as an engine's threads would.
ctypes releases the GIL around every call into the library (a CDLL's
functions), so the threads' calls really run at once, serialised only by
the manager's own lock; the shared tier's fetch runs outside even that.

Every call's exception type is checked against those it may raise when
other threads share the manager; any other (InternalError above all)
fails the test. At the end the manager must pass check() and agree with
what the threads did and with the KV events they drained."""

from __future__ import annotations

import collections
import socket
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import kvplug

BS, BYTES = 4, 32
NS = "pytest-concurrency.bs4"
MAX_LEN = 40  # a sequence is removed once this long

# The exception types each call may raise under concurrency (valid
# arguments, ids of the caller's own).
ALLOWED: Dict[str, Tuple[type, ...]] = {
    "admit": (),  # a full pool admits fewer prompts, without an exception
    "grow_tokens": (kvplug.OutOfBlocksError,),
    "describe": (),
    "match": (),
    "match_tiers": (),
    "remove": (kvplug.InUseError,),  # another thread's sequence shares a block ours filled this step
    "remove after mark_computed": (),
    "mark_computed": (),
    "flush_copies": (),
    "complete_copies": (),
    "drain_events": (),
    "pin": (kvplug.NotFoundError,),  # not cached (evicted, cleared, dropped) or not computed yet
    "unpin": (kvplug.NotFoundError,),  # clear_prefix_cache dropped the pin
    "set_priority": (kvplug.NotFoundError,),
    "clear_prefix_cache": (kvplug.InvalidArgumentError,),  # live sequences hold cached blocks
    "check": (),
    "stats": (),
    "prefix_stats": (),
    "tier_stats": (),
}

FAILED = object()


class Calls:
    """Runs the threads' calls, counting outcomes by exception type and
    keeping every unexpected exception (or failed check) for the test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.unexpected: List[str] = []

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), or FAILED when it raised an exception the call may
        raise (anything else is recorded as unexpected, and FAILED too)."""
        try:
            out = fn(*args)
        except Exception as e:  # every type: the test fails on those not listed
            with self.lock:
                self.counts[name, type(e).__name__] += 1
                if type(e) not in ALLOWED[name]:
                    self.unexpected.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return FAILED
        with self.lock:
            self.counts[name, "ok"] += 1
        return out

    def fail(self, what: str) -> None:
        with self.lock:
            self.unexpected.append(what)

    def thread(self, name: str, target: Callable[..., Any], *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            except BaseException:  # an assertion of the thread's, or a bug: the test's to report
                self.fail(f"{name} raised:\n{traceback.format_exc()}")

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    def check(self) -> None:
        assert not self.unexpected, "\n".join(self.unexpected[:5])


class Replay:
    """A consumer of the KV events: the blocks each medium holds, with
    vLLM's rules (a GPU block stored under a known parent, removed after
    its children; a block stored twice or an unknown one removed is an
    error), so that events drained out of order fail."""

    def __init__(self) -> None:
        self.gpu: Dict[bytes, bytes] = {}  # hash -> parent
        self.children: collections.Counter = collections.Counter()
        self.cpu: set = set()

    def apply(self, ev: kvplug.KVEvent) -> None:
        if ev.kind == "cleared":
            self.gpu.clear()
            self.children.clear()
            self.cpu.clear()
        elif ev.medium == "CPU":
            if ev.kind == "stored":
                assert ev.hash not in self.cpu, f"CPU block {ev.hash.hex()} stored twice"
                self.cpu.add(ev.hash)
            else:
                for h in ev.hashes:
                    assert h in self.cpu, f"removed CPU block {h.hex()} is not stored"
                    self.cpu.remove(h)
        elif ev.kind == "stored":
            assert ev.medium == "GPU" and ev.hash not in self.gpu, f"GPU block {ev.hash.hex()} stored twice"
            assert ev.parent == bytes(16) or ev.parent in self.gpu, f"block {ev.hash.hex()} stored under an unknown parent"
            self.gpu[ev.hash] = ev.parent
            self.children[ev.parent] += 1
        else:
            for h in ev.hashes:
                assert h in self.gpu, f"removed GPU block {h.hex()} is not stored"
                assert self.children[h] == 0, f"GPU block {h.hex()} removed before its children"
                p = self.gpu.pop(h)
                self.children[p] -= 1


def prompt(rng: np.random.Generator, prefixes: List[np.ndarray]) -> np.ndarray:
    """A shared prefix and a short tail of a small vocabulary, so that whole
    blocks repeat between threads too."""
    tail = rng.integers(0, 3, int(rng.integers(1, 2 * BS + 1)), dtype=np.int32)
    return np.concatenate([prefixes[int(rng.integers(len(prefixes)))], tail])


def worker(m: kvplug.Manager, w: int, iters: int, prefixes: List[np.ndarray], call: Calls,
           live: Dict[int, List[int]]) -> None:
    """Scheduler steps on sequences of its own: admit, match per tier, grow
    by tokens, describe, flush the copies (completed a step later),
    mark_computed (not every step: a removal may then meet a block another
    thread's sequence shares), remove. live ends with its sequences."""
    rng = np.random.default_rng([w, 39])
    next_id = (w + 1) << 32
    tickets: List[int] = []
    for _ in range(iters):
        if len(live) < 3:
            k = int(rng.integers(1, 3))
            ids = list(range(next_id + 1, next_id + k + 1))
            next_id += k
            ps = [prompt(rng, prefixes) for _ in range(k)]
            matched = call("admit", m.admit, ids, ps)
            if matched is not FAILED:
                assert len(matched) <= k
                for sid, p, got in zip(ids, ps, matched.tolist()):
                    assert 0 <= got < len(p) and got % BS == 0, (sid, len(p), got)
                    live[sid] = p.tolist()
                if len(matched) and rng.integers(8) == 0:
                    # Preempted before its forward pass, after a twin was
                    # admitted on its blocks: InUseError unless another
                    # thread called mark_computed in between.
                    sid = ids[len(matched) - 1]
                    next_id += 1
                    twin = call("admit", m.admit, [next_id], [live[sid]])
                    if twin is not FAILED and len(twin):  # admitted (the pool had room)
                        live[next_id] = list(live[sid])
                    if call("remove", m.remove, [sid]) is FAILED:
                        call("mark_computed", m.mark_computed)
                        call("remove after mark_computed", m.remove, [sid])
                    del live[sid]
        p = prompt(rng, prefixes)
        tm = call("match_tiers", m.match_tiers, [p])
        if tm is not FAILED:
            g, h = tm[0]
            assert g % BS == 0 and h % BS == 0 and 0 <= g + h < len(p), (tm, len(p))
        if live:
            ids = list(live)
            toks = [rng.integers(0, 3, int(rng.integers(1, BS + 2)), dtype=np.int32).tolist() for _ in ids]
            if call("grow_tokens", m.grow_tokens, ids, toks) is not FAILED:
                for sid, t in zip(ids, toks):
                    live[sid] += t
            d = call("describe", m.describe, ids)
            if d is not FAILED:
                for i, sid in enumerate(ids):
                    n = -(-len(live[sid]) // BS)
                    row = d.block_table[i]
                    assert d.seq_lens[i] == len(live[sid]), (sid, d.seq_lens[i], len(live[sid]))
                    assert len(set(row[:n].tolist())) == n and (row[:n] >= 0).all() and (row[n:] == -1).all(), row
        batch = call("flush_copies", m.flush_copies)
        if batch is not FAILED and batch.ticket:
            tickets.append(batch.ticket)
        if len(tickets) > 1:
            call("complete_copies", m.complete_copies, tickets.pop(0), bool(rng.integers(16) == 0))
        if rng.integers(2) == 0:
            call("mark_computed", m.mark_computed)
        gone = [sid for sid, t in live.items() if len(t) >= MAX_LEN]
        if live and not gone and rng.integers(3) == 0:
            gone = [list(live)[int(rng.integers(len(live)))]]
        if gone:
            if call("remove", m.remove, gone) is FAILED:
                # Only blocks our sequences filled since the last
                # mark_computed can be in use elsewhere: after it, not.
                call("mark_computed", m.mark_computed)
                call("remove after mark_computed", m.remove, gone)
            for sid in gone:
                del live[sid]
    for tk in tickets:
        call("complete_copies", m.complete_copies, tk)


def operator(m: kvplug.Manager, prefixes: List[np.ndarray], call: Calls, stop: threading.Event) -> None:
    """What a serving process calls beside the scheduler until the workers
    are done: pins, priorities, matches, clear_prefix_cache, check(), stats
    whose pool figures must add up at every call."""
    rng = np.random.default_rng(99)
    pins: List[int] = []
    i = 0
    while not stop.is_set():
        p = prefixes[int(rng.integers(len(prefixes)))]
        op = i % 7
        i += 1
        if op == 0:
            r = call("pin", m.pin, p)
            if r is not FAILED:
                assert r[1] >= 1, r
                pins.append(r[0])
        elif op == 1 and pins:
            call("unpin", m.unpin, pins.pop(0))
        elif op == 2:
            call("clear_prefix_cache", m.clear_prefix_cache)
        elif op == 3:
            r = call("match", m.match, [prompt(rng, prefixes)])
            assert r is FAILED or r[0].matched_tokens % BS == 0, r
        elif op == 4:
            call("set_priority", m.set_priority, p, int(rng.integers(3)))
        elif op == 5:
            call("check", m.check)
        else:
            st = call("stats", m.stats)
            if st is not FAILED:
                assert st.free_blocks + st.used_blocks + st.cached_blocks == st.num_blocks, st
            call("prefix_stats", m.prefix_stats)
            call("tier_stats", m.tier_stats)
    for pid in pins:
        call("unpin", m.unpin, pid)


def drainer(m: kvplug.Manager, call: Calls, replay: Replay, stop: threading.Event) -> None:
    """Drains the KV events in batches of varying size, applying them in
    order, until the workers are done and nothing is left."""
    rng = np.random.default_rng(7)
    while True:
        done = stop.is_set()
        evs = call("drain_events", m.drain_events, int(rng.integers(1, 9)))
        if evs is not FAILED:
            for ev in evs:
                replay.apply(ev)
        if done and not evs:
            return


def run(m: kvplug.Manager, prefixes: List[np.ndarray], workers: int, iters: int) -> Tuple[Calls, Replay, Dict[int, List[int]]]:
    """Runs the workers with the operator and drainer beside them; returns
    the calls' record, the drained events' view and the live sequences."""
    call, replay, stop = Calls(), Replay(), threading.Event()
    lives: List[Dict[int, List[int]]] = [{} for _ in range(workers)]
    side = [call.thread("operator", operator, m, prefixes, call, stop), call.thread("drainer", drainer, m, call, replay, stop)]
    ts = [call.thread(f"worker {w}", worker, m, w, iters, prefixes, call, lives[w]) for w in range(workers)]
    for t in ts:
        t.join(120)
    stop.set()
    for t in side:
        t.join(120)
    assert not any(t.is_alive() for t in ts + side), "a thread did not finish"
    call.check()
    live: Dict[int, List[int]] = {}
    for d in lives:
        live.update(d)
    return call, replay, live


def settle(m: kvplug.Manager, replay: Replay) -> None:
    """Runs the copies still queued to completion, waits for the shared
    tier's stores to unpin their host slots (the slots of fetches under
    way stay reserved, pinned), and drains the events."""
    for _ in range(8):
        b = m.flush_copies()
        if not b.ticket:
            break
        m.complete_copies(b.ticket)
    deadline = time.monotonic() + 10
    while (ts := m.tier_stats()).shared_queue_len or ts.host_pinned != ts.host_reserved:
        assert time.monotonic() < deadline, f"stores still pending: {ts}"
        time.sleep(0.001)
    while True:
        evs = m.drain_events()
        if not evs:
            break
        for ev in evs:
            replay.apply(ev)


def check_quiet(m: kvplug.Manager, replay: Replay, live: Dict[int, List[int]]) -> None:
    """The quiet manager agrees with the threads' sequences and the events:
    stats, every sequence's length and block table (a partial last block
    is its own), the cached blocks on each medium."""
    m.check()
    st, ps, ts = m.stats(), m.prefix_stats(), m.tier_stats()
    assert st.free_blocks + st.used_blocks + st.cached_blocks == st.num_blocks, st
    assert st.num_seqs == len(live) and st.num_tokens == sum(map(len, live.values())), (st, len(live))
    assert ts.in_flight == 0 and ts.host_reserved == 0 and ts.host_pinned == 0, ts
    assert len(replay.gpu) == ps.cached_blocks, (len(replay.gpu), ps)
    assert len(replay.cpu) == ts.host_resident, (len(replay.cpu), ts)
    if live:
        ids = list(live)
        d = m.describe(ids)
        owners: Dict[int, int] = {}
        for i, sid in enumerate(ids):
            n = -(-len(live[sid]) // BS)
            row = d.block_table[i]
            assert d.seq_lens[i] == len(live[sid])
            assert len(set(row[:n].tolist())) == n and (row[n:] == -1).all(), row
            if len(live[sid]) % BS:
                last = int(row[n - 1])
                assert last not in owners, f"sequences {owners[last]} and {sid} share block {last}, a partial last block"
                owners[last] = sid


def test_threads_share_one_manager_with_prefix_cache():
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(0, 50000, 3 * BS, dtype=np.int32) for _ in range(3)]
    with kvplug.Manager(64, BS, prefix_cache=True, kv_events=True, host_tier_slots=24, host_block_bytes=BYTES,
                        demote_ahead=8) as m:
        call, replay, live = run(m, prefixes, workers=4, iters=250)
        settle(m, replay)
        check_quiet(m, replay, live)
        # The workload reached the cache and the host tier.
        assert call.counts["admit", "ok"] and call.counts["grow_tokens", "ok"] and call.counts["remove", "ok"], call.counts
        assert m.prefix_stats().hit_tokens > 0 and m.tier_stats().demotions_completed > 0
        # Everything removed, then cleared: the pool is free again.
        m.mark_computed()
        if live:
            m.remove(list(live))
        cached = m.stats().cached_blocks
        assert m.clear_prefix_cache() == cached
        settle(m, replay)
        check_quiet(m, replay, {})
        assert m.stats().free_blocks == 64 and not replay.gpu


# --- the shared tier ---------------------------------------------------------


class Gate:
    """A TCP proxy in front of a server that can hold, on request, the next
    pipeline carrying a command before the server sees it, until released:
    the library call that sent it then waits mid-round-trip."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.ln = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.ln.getsockname()[1]}"
        self.lock = threading.Lock()
        self.cmd: Optional[bytes] = None
        self.held = threading.Event()
        self.release = threading.Event()
        self.socks: List[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def hold(self, cmd: str) -> Tuple[threading.Event, threading.Event]:
        with self.lock:
            self.cmd = b"\r\n" + cmd.encode() + b"\r\n"
            self.held, self.release = threading.Event(), threading.Event()
            return self.held, self.release

    def close(self) -> None:
        self.release.set()
        self.ln.close()
        with self.lock:
            for s in self.socks:
                s.close()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.ln.accept()
            except OSError:
                return
            s = socket.create_connection(self.target)
            with self.lock:
                self.socks += [c, s]
            threading.Thread(target=self._pipe, args=(s, c, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(c, s, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                if gated:
                    release = None
                    with self.lock:
                        if self.cmd is not None and self.cmd in chunk:
                            self.cmd = None
                            self.held.set()
                            release = self.release
                    if release is not None:
                        release.wait()
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for x in (src, dst):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def shared_manager(addr: str, **kw: Any) -> kvplug.Manager:
    return kvplug.Manager(32, BS, prefix_cache=True, kv_events=True, host_tier_slots=16, host_block_bytes=BYTES,
                          shared_tier=addr, shared_tier_namespace=NS, shared_tier_timeout_ms=10000, **kw)


def store(addr: str, conv: np.ndarray) -> None:
    """Another instance computes conv, demotes its blocks and stores them."""
    with shared_manager(addr, demote_ahead=32) as m:
        replay = Replay()
        m.admit([1], [conv])
        settle(m, replay)  # the step's flush: its blocks are written after it
        m.mark_computed()
        m.remove([1])
        settle(m, replay)  # demoted: the stores are queued
        assert m.tier_stats().shared_puts_queued == (len(conv) - 1) // BS
    # close() wrote them out.


def test_shared_fetch_holds_neither_the_gil_nor_the_lock(valkey_server):
    """With one admission's shared-tier fetch stopped mid-round-trip (its
    GET held), this thread runs Python and every call that needs no round
    trip: the fetch released the GIL and holds no manager lock. A second
    admission of the same prompt waits for the connection. Released, both
    start on the fetched blocks."""
    conv = np.arange(100, 117, dtype=np.int32)  # four full blocks and one token
    store(valkey_server, conv)
    gate = Gate(valkey_server)
    try:
        with shared_manager(gate.addr) as m:
            replay = Replay()
            held, release = gate.hold("GET")
            call = Calls()
            results: Dict[int, Any] = {}
            done = {1: threading.Event(), 2: threading.Event()}

            def admit(sid: int) -> None:
                results[sid] = call("admit", m.admit, [sid], [conv])
                done[sid].set()

            call.thread("admission 1", admit, 1)
            assert held.wait(10), "the admission's fetch sent no GET"
            call.thread("admission 2", admit, 2)

            def meanwhile() -> None:
                # Python, and every call that needs no round trip.
                assert m.tier_stats().host_reserved == 4
                short = np.arange(3, dtype=np.int32)  # no full block: nothing to fetch
                assert m.admit([10], [short]).tolist() == [0]
                m.grow_tokens([10], [[1, 2, 3, 4]])
                assert m.match([conv])[0].matched_tokens == 0
                assert m.describe([10]).seq_lens.tolist() == [7]
                for ev in m.drain_events():
                    replay.apply(ev)
                settle(m, replay)
                m.mark_computed()
                m.remove([10])
                m.check()

            t = call.thread("calls meanwhile", meanwhile)
            t.join(5)
            assert not t.is_alive(), "calls that need no round trip waited on the held fetch"
            call.check()
            assert not done[1].is_set(), "the admission returned while its fetch was held"
            release.set()
            assert done[1].wait(20) and done[2].wait(20), "the admissions did not return"
            call.check()
            assert results[1].tolist() == [16] and results[2].tolist() == [16], results
            ts = m.tier_stats()
            assert (ts.shared_fetched, ts.shared_fetch_misses, ts.shared_hit_tokens) == (4, 0, 16), ts
            assert ts.shared_corrupt + ts.shared_errors + ts.shared_timeouts == 0, ts
            settle(m, replay)
            m.mark_computed()
            m.remove([1, 2])
            check_quiet(m, replay, {})
    finally:
        gate.close()


def test_shared_tier_threads(valkey_server):
    """The threads of the first test with a shared tier holding the
    prefixes another instance stored: admissions and matches fetch them
    outside the lock, at once."""
    rng = np.random.default_rng(2)
    convs = [rng.integers(0, 50000, 4 * BS + 1, dtype=np.int32) for _ in range(3)]
    for c in convs:
        store(valkey_server, c)
    with kvplug.Manager(64, BS, prefix_cache=True, kv_events=True, host_tier_slots=12, host_block_bytes=BYTES,
                        demote_ahead=8, shared_tier=valkey_server, shared_tier_namespace=NS,
                        shared_tier_timeout_ms=10000) as m:
        call, replay, live = run(m, [c[: 4 * BS] for c in convs], workers=4, iters=150)
        settle(m, replay)
        check_quiet(m, replay, live)
        ts = m.tier_stats()
        assert ts.shared_fetched > 0 and ts.shared_corrupt + ts.shared_errors + ts.shared_timeouts == 0, ts


def test_calls_after_close_raise_invalid_handle():
    """close() (which no call on another thread may race) while threads
    that use the manager wait between calls: each call they make after it
    raises InvalidHandleError, whatever the call."""
    m = kvplug.Manager(32, BS, prefix_cache=True, kv_events=True, host_tier_slots=8, host_block_bytes=BYTES)
    call = Calls()
    barrier = threading.Barrier(4)
    p = np.arange(9, dtype=np.int32)
    after: List[Tuple[str, Any]] = []
    lock = threading.Lock()

    def user(w: int) -> None:
        sid = w + 1
        call("admit", m.admit, [sid], [p])
        call("grow_tokens", m.grow_tokens, [sid], [[1]])
        call("mark_computed", m.mark_computed)
        barrier.wait(10)  # the calls are done
        barrier.wait(10)  # closed
        for name, fn, args in [
            ("admit", m.admit, ([sid + 10], [p])), ("grow_tokens", m.grow_tokens, ([sid], [[2]])),
            ("describe", m.describe, ([sid],)), ("match", m.match, ([p],)), ("match_tiers", m.match_tiers, ([p],)),
            ("drain_events", m.drain_events, ()), ("flush_copies", m.flush_copies, ()),
            ("mark_computed", m.mark_computed, ()), ("remove", m.remove, ([sid],)), ("pin", m.pin, (p,)),
            ("clear_prefix_cache", m.clear_prefix_cache, ()), ("check", m.check, ()), ("stats", m.stats, ()),
        ]:
            try:
                fn(*args)
                r: Any = "returned"
            except Exception as e:  # the type is what the test checks
                r = e
            with lock:
                after.append((name, r))

    ts = [call.thread(f"user {w}", user, w) for w in range(3)]
    barrier.wait(10)
    m.close()
    barrier.wait(10)
    for t in ts:
        t.join(30)
    call.check()
    assert len(after) == 3 * 13
    for name, r in after:
        assert type(r) is kvplug.InvalidHandleError and "handle" in str(r), f"{name} after close: {r!r}"
    m.close()  # twice: nothing
