"""kvplug's published KV events decoded as vLLM's consumers decode them:
with msgspec structs written from vllm/distributed/kv_events.py (the
named-field events of current vLLM, and the positional events of older
releases), received over ZMQ with pyzmq (libzmq) on the PUB socket, and a
dropped range recovered from the ROUTER replay socket. The block hashes are
checked against core/prefix/HASH.md's reference code."""

from __future__ import annotations

import struct
import time
from typing import Any, List, Optional, Tuple, Union

import pytest

from conftest import require

msgspec = require("msgspec")
zmq = require("zmq", "pyzmq")
xxhash = require("xxhash")

import kvplug  # noqa: E402
from kvplug import events  # noqa: E402


# --- vLLM's definitions (named-field events; the batch stays positional) ---

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# --- vLLM's older positional events ---


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: List[Union[ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared]]


# --- vLLM's current events in the positional form: the older events with
# group_idx and the group's spec appended after extra_keys, as kv_events.py
# orders the fields (a subclass's fields follow its base's in the array) ---


class ArrayGroupBlockStored(ArrayBlockStored, tag="BlockStored"):
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class ArrayGroupBlockRemoved(ArrayBlockRemoved, tag="BlockRemoved"):
    group_idx: Optional[int] = None


class ArrayGroupKVEventBatch(EventBatch):
    events: List[Union[ArrayGroupBlockStored, ArrayGroupBlockRemoved, ArrayAllBlocksCleared]]


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_hashes(tokens, block_size, adapter=0, mm=(), salt=b""):
    """core/prefix/HASH.md's reference code."""
    parent, out = bytes(16), []
    for i in range(len(tokens) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        blk = tokens[lo:hi]
        ents = [(o - lo, h) for (o, n, h) in mm if o < hi and o + n > lo]
        s = salt if i == 0 else b""
        b = bytes([1]) + parent
        b += struct.pack("<I%di" % len(blk), len(blk), *blk)
        b += struct.pack("<QI", adapter, len(ents))
        for o, h in ents:
            b += struct.pack("<i", o) + h
        b += struct.pack("<I", len(s)) + s
        parent = xxhash.xxh3_128_digest(b)
        out.append(parent)
    return out


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def wait_batches(pub: events.EventPublisher, n: int) -> None:
    """Waits until pub has published n batches in all (at most 5 s)."""
    deadline = time.monotonic() + 5
    while pub.stats().batches < n:
        assert time.monotonic() < deadline, f"{pub.stats().batches} batches published, {n} expected"
        time.sleep(0.002)


def subscribe(ctx, pub: events.EventPublisher, topic: str) -> Tuple[Any, int]:
    """A SUB socket whose subscription the publisher has, and the sequence
    number of the next batch it will receive. ZMQ tells a subscriber nothing
    of its subscription's arrival, and a batch published before it arrives
    is not sent (the slow joiner); so this publishes snapshots (resync,
    flush) until one reaches the socket, then reads up to the last one
    published. Every batch after a received one is received too, in order."""
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub.pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    deadline = time.monotonic() + 10
    while True:
        n = pub.stats().batches
        pub.resync()
        pub.flush()
        wait_batches(pub, n + 1)
        last = pub.stats().batches - 1
        if sub.poll(200):
            break
        assert time.monotonic() < deadline, "no batch reached the subscriber: its subscription never arrived"
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    while int.from_bytes(sub.recv_multipart()[1], "big") != last:
        pass
    return sub, last + 1


def recv(sub, decoder) -> Tuple[str, int, Any]:
    topic, seq, payload = sub.recv_multipart()
    return topic.decode(), int.from_bytes(seq, "big"), decoder.decode(payload)


def test_named_field_events_decode_as_vllm(ctx):
    m = kvplug.Manager(64, 4, prefix_cache=True, kv_events=True)
    pub = events.EventPublisher(m, "tcp://127.0.0.1:0", bind_mode=events.BIND, topic="kv@engine-0@model",
                                flush_interval_us=60_000_000)
    with m, pub:
        sub, first = subscribe(ctx, pub, "kv@engine-0")
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        img = bytes(range(16))
        keys = kvplug.Keys(adapter=3, mm=[kvplug.MMItem(2, 5, img)], salt=b"tenant-a")
        prompt = list(range(100, 113))  # 3 full blocks and a partial one
        t0 = time.time()
        m.admit([1], [prompt], keys)
        pub.flush()
        topic, seq, batch = recv(sub, dec)
        assert (topic, seq) == ("kv@engine-0@model", first)
        assert abs(batch.ts - t0) < 5 and batch.data_parallel_rank == 0  # sent by default, as vLLM does
        # The admitted chain as one BlockStored, as vLLM sends a request's new blocks.
        (ev,) = batch.events
        assert isinstance(ev, BlockStored)
        want = block_hashes(prompt, 4, adapter=3, mm=[(2, 5, img)], salt=b"tenant-a")
        assert ev.block_hashes == want
        assert ev.parent_block_hash is None
        assert ev.token_ids == prompt[:12]
        assert ev.block_size == 4
        assert ev.lora_id == 3 and ev.lora_name is None
        assert ev.medium == "GPU"
        # The image covers positions 2..6: block 0 at offset 2, block 1 at -2.
        assert ev.extra_keys == [([img.hex(), 2],), ([img.hex(), -2],), None]
        assert ev.group_idx is None and ev.kv_cache_spec_kind is None

        # Growing fills the partial block: a BlockStored under the chain.
        m.grow_tokens([1], [[113, 114, 115]])
        pub.flush()
        _, seq, batch = recv(sub, dec)
        ev = batch.events[0]
        assert seq == first + 1 and ev.parent_block_hash == want[2]
        assert ev.block_hashes == block_hashes(prompt + [113, 114, 115], 4, 3, [(2, 5, img)], b"tenant-a")[3:]

        # Clearing the cache: AllBlocksCleared.
        m.remove([1])
        m.clear_prefix_cache()
        pub.flush()
        _, seq, batch = recv(sub, dec)
        assert seq == first + 2 and [type(e) for e in batch.events] == [AllBlocksCleared]


def test_layer_group_events_decode_as_vllm(ctx):
    """A hybrid model's events: every group's blocks under group 0's hashes,
    each event with vLLM's group_idx and a BlockStored with its group's
    kv_cache_spec_kind and kv_cache_spec_sliding_window, in both layouts;
    a window's blocks evicted alone go out as group 1's BlockRemoved."""
    groups = [kvplug.LayerGroup.full_attention(), kvplug.LayerGroup.sliding_window(8)]
    for fmt, batch_type in ((events.FORMAT_MAP, KVEventBatch), (events.FORMAT_ARRAY, ArrayGroupKVEventBatch)):
        m = kvplug.Manager(40, 4, prefix_cache=True, kv_events=True, layer_groups=groups)
        pub = events.EventPublisher(m, "tcp://127.0.0.1:0", bind_mode=events.BIND, event_format=fmt,
                                    flush_interval_us=60_000_000)
        with m, pub:
            sub, _ = subscribe(ctx, pub, "")
            dec = msgspec.msgpack.Decoder(batch_type)
            a = list(range(1, 41))  # 10 blocks a group
            m.admit([1], [a])
            m.grow_tokens([1], [99])  # the window slides past blocks 0-7
            m.mark_computed()
            m.remove([1])
            b = list(range(1000, 1048))  # 12 blocks a group: evicts 4 of the window's alone
            m.admit([2], [b])
            pub.flush()
            got: List[Any] = []
            while not any(e.block_hashes == block_hashes(b, 4) and e.group_idx == 1 for e in got if hasattr(e, "token_ids")):
                got += [e for e in recv(sub, dec)[2].events if not isinstance(e, (AllBlocksCleared, ArrayAllBlocksCleared))]
            ha = block_hashes(a, 4)
            stored = {(e.group_idx, h) for e in got if hasattr(e, "token_ids") for h in e.block_hashes}
            assert stored == {(g, h) for g in (0, 1) for h in ha + block_hashes(b, 4)}
            for e in got:
                assert e.group_idx in (0, 1) and e.medium == "GPU"
                if hasattr(e, "token_ids"):
                    want = ("full_attention", None) if e.group_idx == 0 else ("sliding_window", 8)
                    assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == want
                    assert e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes)
            removed = [(e.group_idx, h) for e in got if not hasattr(e, "token_ids") for h in e.block_hashes]
            assert len(removed) == 4 and all(g == 1 and h in ha[:8] for g, h in removed)
        m2 = kvplug.Manager(16, 4, prefix_cache=True, kv_events=True)  # no groups: no group fields
        with m2, events.EventPublisher(m2, "tcp://127.0.0.1:0", bind_mode=events.BIND, event_format=fmt,
                                       flush_interval_us=60_000_000) as pub2:
            sub2, _ = subscribe(ctx, pub2, "")
            m2.admit([1], [list(range(9))])
            pub2.flush()
            (ev,) = recv(sub2, msgspec.msgpack.Decoder(batch_type))[2].events
            assert ev.group_idx is None and ev.kv_cache_spec_kind is None and ev.kv_cache_spec_sliding_window is None
            sub2.close(linger=0)
        sub.close(linger=0)


def test_evictions_and_positional_int_hash_events(ctx):
    # 8 blocks: a second prompt evicts the first one's cached blocks.
    m = kvplug.Manager(8, 4, prefix_cache=True, kv_events=True)
    pub = events.EventPublisher(m, "tcp://127.0.0.1:0", bind_mode=events.BIND, event_format=events.FORMAT_ARRAY,
                                hash_format=events.HASH_INT64, data_parallel_rank=1, medium="CPU",
                                flush_interval_us=60_000_000)
    with m, pub:
        sub, _ = subscribe(ctx, pub, "")
        dec = msgspec.msgpack.Decoder(ArrayKVEventBatch)
        a = list(range(1, 25))  # 6 blocks
        m.admit([1], [a])
        m.mark_computed()  # the step's forward pass: a's blocks stay cached when it is removed
        m.remove([1])
        b = list(range(500, 525))  # 6 full blocks + 1 token: evicts 5 of a's
        m.admit([2], [b])
        pub.flush()
        got: List[Any] = []
        while not any(isinstance(e, ArrayBlockStored) and e.token_ids[0] == 500 for e in got):
            _, _, batch = recv(sub, dec)
            assert batch.data_parallel_rank == 1
            got += batch.events
        to_int = lambda h: int.from_bytes(h[-8:], "big")  # noqa: E731 (vLLM's conversion)
        ha, hb = block_hashes(a, 4), block_hashes(b, 4)
        stored_a = [e for e in got if isinstance(e, ArrayBlockStored) and e.token_ids[0] == 1][0]
        assert stored_a.block_hashes == [to_int(h) for h in ha] and stored_a.medium == "CPU" and stored_a.lora_id is None
        removed = [h for e in got if isinstance(e, ArrayBlockRemoved) for h in e.block_hashes]
        assert len(removed) == 5 and set(removed) <= {to_int(h) for h in ha}
        # Children before parents: a's last block goes first.
        assert removed[0] == to_int(ha[5])
        stored_b = [e for e in got if isinstance(e, ArrayBlockStored) and e.token_ids[0] == 500][0]
        assert stored_b.block_hashes == [to_int(h) for h in hb] and stored_b.extra_keys is None


def test_host_tier_events_decode_as_vllm_cpu_events(ctx):
    # A manager with a host tier: blocks demoted there are BlockStored with
    # medium "CPU" (as vLLM's OffloadingConnector sends them), under the
    # hashes their GPU events had; a host eviction is a "CPU" BlockRemoved.
    m = kvplug.Manager(8, 4, prefix_cache=True, kv_events=True, host_tier_slots=2, host_block_bytes=16, demote_ahead=8)
    pub = events.EventPublisher(m, "tcp://127.0.0.1:0", bind_mode=events.BIND, flush_interval_us=60_000_000)
    with m, pub:
        sub, _ = subscribe(ctx, pub, "")
        dec = msgspec.msgpack.Decoder(KVEventBatch)

        def step():
            b = m.flush_copies()  # the engine's copies would go here
            if b.ticket:
                m.complete_copies(b.ticket)
            pub.flush()
            got = []
            while not got or not isinstance(got[-1], BlockStored) or got[-1].medium != "CPU":
                got += recv(sub, dec)[2].events
            return [e for e in got if not isinstance(e, AllBlocksCleared)]

        a = list(range(1, 10))  # two full blocks and one token
        m.admit([1], [a])
        # The step's own flush (nothing to copy; its forward pass writes the
        # blocks): flush_copies never demotes a block allocated since the
        # previous flush.
        assert m.flush_copies().ticket == 0
        m.mark_computed()
        m.remove([1])
        got = step()
        ha = block_hashes(a, 4)
        gpu_stored, gpu_removed, cpu_stored = got
        assert isinstance(gpu_stored, BlockStored) and gpu_stored.medium == "GPU" and gpu_stored.block_hashes == ha
        assert isinstance(gpu_removed, BlockRemoved) and gpu_removed.medium == "GPU" and set(gpu_removed.block_hashes) == set(ha)
        # The demoted chain, parents first: one BlockStored, as on the GPU.
        assert isinstance(cpu_stored, BlockStored) and cpu_stored.medium == "CPU"
        assert cpu_stored.block_hashes == ha and cpu_stored.parent_block_hash is None
        assert cpu_stored.token_ids == a[:8] and cpu_stored.block_size == 4 and cpu_stored.lora_id is None

        b = list(range(50, 55))  # one block: the host tier is full, its LRU block goes
        m.admit([2], [b])
        assert m.flush_copies().ticket == 0  # the step
        m.mark_computed()
        m.remove([2])
        got = step()
        cpu_removed = [e for e in got if isinstance(e, BlockRemoved) and e.medium == "CPU"]
        assert len(cpu_removed) == 1 and cpu_removed[0].block_hashes == [ha[1]]
        assert got[-1].medium == "CPU" and got[-1].block_hashes == block_hashes(b, 4)
        assert got[-1].parent_block_hash is None

        # A resync lists both tiers: the GPU's blocks (none) and the host's.
        pub.resync()
        pub.flush()
        batch = recv(sub, dec)[2]
        assert isinstance(batch.events[0], AllBlocksCleared)
        cpu = {h for e in batch.events[1:] for h in e.block_hashes if e.medium == "CPU"}
        assert cpu == {ha[0]} | set(block_hashes(b, 4)) and all(e.medium == "CPU" for e in batch.events[1:])


def test_replay_of_a_dropped_range(ctx):
    m = kvplug.Manager(256, 4, prefix_cache=True, kv_events=True)
    pub = events.EventPublisher(m, "tcp://127.0.0.1:0", bind_mode=events.BIND, replay_endpoint="tcp://127.0.0.1:0",
                                topic="kv@r", flush_interval_us=60_000_000)
    with m, pub:
        sub, first = subscribe(ctx, pub, "kv@r")
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        prompts = [[1000 * i + j for j in range(8)] for i in range(6)]
        m.admit([0], [prompts[0]])
        pub.flush()
        _, seq, _ = recv(sub, dec)
        assert seq == first
        # The subscriber goes away; batches first+1..first+4 are published meanwhile.
        sub.close(linger=0)
        for i in range(1, 5):
            m.admit([i], [prompts[i]])
            pub.flush()
            wait_batches(pub, first + i + 1)
        sub, resumed = subscribe(ctx, pub, "kv@r")  # after its own snapshots
        m.admit([5], [prompts[5]])
        pub.flush()
        _, seq, batch = recv(sub, dec)
        assert seq == resumed  # the gap: first+1..first+4 were missed
        # Replay from the ROUTER socket, as vLLM's subscribers do.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
        dealer.send_multipart([b"", (first + 1).to_bytes(8, "big")])
        replayed = []
        while True:
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            topic, seq_b, payload = frames[1:]
            if seq_b == END_SEQ:
                assert topic == b"" and payload == b""
                break
            assert topic == b"kv@r"
            replayed.append((int.from_bytes(seq_b, "big"), dec.decode(payload)))
        # The four missed admissions, the snapshots of the second subscribe, the sixth admission.
        assert [s for s, _ in replayed] == list(range(first + 1, resumed + 1))
        for i, (_, b) in enumerate(replayed[:4]):
            (ev,) = b.events
            assert ev.block_hashes == block_hashes(prompts[i + 1], 4)
        assert all(isinstance(b.events[0], AllBlocksCleared) for _, b in replayed[4:-1])
        (ev,) = replayed[-1][1].events
        assert ev.block_hashes == block_hashes(prompts[5], 4)
        # A range older than the buffer cannot be replayed: kvplug's
        # snapshot request (-2) republishes the cache on PUB.
        dealer.send_multipart([b"", (-2).to_bytes(8, "big", signed=True)])
        assert dealer.recv_multipart()[2] == END_SEQ
        _, seq, batch = recv(sub, dec)
        assert seq == resumed + 1 and isinstance(batch.events[0], AllBlocksCleared)
        stored = {h for e in batch.events[1:] for h in e.block_hashes}
        assert stored == {h for p in prompts for h in block_hashes(p, 4)}
        assert pub.stats().replay_requests == 2
        dealer.close(linger=0)
        sub.close(linger=0)


def test_publisher_binds_a_host_and_port_by_default(ctx):
    """EventPublisher(m, "tcp://127.0.0.1:PORT") serves there, so a
    subscriber that connects (kvindex, pyzmq's connect) gets its batches;
    CONNECT dials a subscriber that binds; BIND_VLLM keeps vLLM's rule."""
    m = kvplug.Manager(16, 4, prefix_cache=True, kv_events=True)
    with m:
        with events.EventPublisher(m, "tcp://127.0.0.1:0", flush_interval_us=60_000_000) as pub:
            assert pub.pub_port != 0  # bound
            sub, _ = subscribe(ctx, pub, "")
            sub.close(linger=0)
        # A subscriber that binds, and a publisher told to connect to it.
        for mode in (events.CONNECT, events.BIND_VLLM):
            sub = ctx.socket(zmq.SUB)
            port = sub.bind_to_random_port("tcp://127.0.0.1")
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            with events.EventPublisher(m, f"tcp://127.0.0.1:{port}", bind_mode=mode,
                                       flush_interval_us=60_000_000) as pub:
                assert pub.pub_port == 0  # connected
                deadline = time.monotonic() + 10
                while not sub.poll(200):  # resync until a snapshot gets through
                    assert time.monotonic() < deadline, f"mode {mode}: nothing reached the bound subscriber"
                    pub.resync()
                    pub.flush()
                _, seq, payload = sub.recv_multipart()
                assert msgspec.msgpack.decode(payload)[1][0]["type"] == "AllBlocksCleared"
            sub.close(linger=0)


def test_publisher_errors():
    m = kvplug.Manager(8, 4, prefix_cache=True)  # no KV events
    with m:
        with pytest.raises(kvplug.InvalidArgumentError, match="KV events"):
            events.EventPublisher(m, "tcp://127.0.0.1:0")
    m = kvplug.Manager(8, 4, prefix_cache=True, kv_events=True)
    with m:
        with pytest.raises(kvplug.InvalidArgumentError, match="only tcp"):
            events.EventPublisher(m, "inproc://x")
        with pytest.raises(ValueError, match="NUL"):
            events.EventPublisher(m, "tcp://127.0.0.1:0\x00")
        with pub_ctx(m) as p:
            with pytest.raises(kvplug.InvalidArgumentError, match="has a publisher already"):
                events.EventPublisher(m, "tcp://127.0.0.1:0", bind_mode=events.BIND)
            with pytest.raises(kvplug.InvalidArgumentError, match="address already in use"):
                m2 = kvplug.Manager(8, 4, prefix_cache=True, kv_events=True)
                try:
                    events.EventPublisher(m2, f"tcp://127.0.0.1:{p.pub_port}", bind_mode=events.BIND)
                finally:
                    m2.close()
        p.close()
        with pytest.raises(kvplug.InvalidHandleError):
            p.flush()
    with pytest.raises(kvplug.InvalidHandleError):
        events.EventPublisher(m, "tcp://127.0.0.1:0")  # m is closed


def pub_ctx(m):
    return events.EventPublisher(m, "tcp://127.0.0.1:0", bind_mode=events.BIND)
