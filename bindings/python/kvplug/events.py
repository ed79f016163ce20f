"""KV events on ZMQ in vLLM's wire format (the "KV event publisher" part of
include/kvplug.h).

    m = kvplug.Manager(4096, 16, prefix_cache=True, kv_events=True)
    with kvplug.EventPublisher(m, "tcp://*:5557", replay_endpoint="tcp://*:5558",
                               topic="kv@engine-0@my-model") as pub:
        ...                     # admit / grow_tokens / remove as usual
        pub.flush()             # optional: publish this step's events now

Routers and indexers written for vLLM's KV events subscribe to the PUB
endpoint and replay missed batches from the ROUTER endpoint. Both sockets
bind their endpoints by default, so subscribers (cmd/kvindex, pyzmq's
connect) connect to them; bind_mode=CONNECT makes the PUB socket dial a
subscriber that binds instead, and BIND_VLLM applies vLLM's rule (bind a
wildcard or ipc endpoint, connect to any other). Each event's
"medium" says where its blocks are: "GPU" (the prefix cache; the name
the medium argument gives) or "CPU" (a manager's host tier, whose blocks
carry the fields of their GPU events, the same hash included), as vLLM's
own events and its CPU offloading's do; MEDIUM_SHARED is reserved for a
tier that instances share. A manager with layer_groups publishes every
group's blocks, as vLLM does for hybrid models: each BlockStored and
BlockRemoved with vLLM's group_idx, a BlockStored also with its group's
kv_cache_spec_kind ("full_attention", "sliding_window", "mamba") and
kv_cache_spec_sliding_window (include/kvplug.h, "KV events of layer
groups"). The publisher
runs on the library's own thread; no Manager call waits on the network.
While it runs it is the manager's one consumer of events: do not call
Manager.drain_events or Manager.drain_group_events on that manager.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Optional

from . import _lib
from ._capi import EventPublisherConfig, EventPublisherStatsStruct
from ._lib import C
from .prefix import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_SHARED

__all__ = ["EventPublisher", "EventPublisherStats", "BIND_VLLM", "BIND", "CONNECT", "FORMAT_MAP", "FORMAT_ARRAY",
           "HASH_BYTES", "HASH_INT64", "MEDIUM_GPU", "MEDIUM_CPU", "MEDIUM_SHARED"]

# bind_mode values (the C header's KVP_EVENTS_BIND_...). EventPublisher
# passes BIND unless told otherwise: the C field's 0 is BIND_VLLM, kept for
# hosts built against released headers, under which tcp://127.0.0.1:PORT
# connects, and a subscriber connecting to it is refused forever.
BIND_VLLM = 0  # vLLM's rule: bind a wildcard or ipc endpoint, connect to others
BIND = 1  # always bind (EventPublisher's default)
CONNECT = 2  # always connect: the subscriber binds the endpoint; redials until it does
FORMAT_MAP = 0  # events as maps tagged by "type" (vLLM now)
FORMAT_ARRAY = 1  # positional events (older vLLM)
HASH_BYTES = 0  # 16-byte hashes
HASH_INT64 = 1  # the hash's last 8 bytes as an unsigned integer

_vp = ctypes.c_void_p


@dataclasses.dataclass(frozen=True)
class EventPublisherStats:
    """A publisher's counters since it started (kvp_event_publisher_stats)."""

    batches: int
    events: int
    bytes: int
    dropped_sends: int
    replay_requests: int
    replay_batches: int
    snapshots: int
    source_errors: int
    buffered_batches: int
    buffered_bytes: int
    subscribers: int
    pub_port: int
    replay_port: int


class EventPublisher(_lib.Owner):
    """Publishes a Manager's KV events (the manager needs prefix_cache=True
    and kv_events=True) on a ZMQ PUB socket, with replay on a ROUTER socket
    when replay_endpoint is given. Endpoints are tcp://host:port
    (tcp://*:port binds every interface; port 0 picks a free port, see
    pub_port) or ipc:///path. The PUB socket binds its endpoint unless
    bind_mode says otherwise: CONNECT dials a subscriber that binds it (and
    redials until one does), BIND_VLLM follows vLLM's rule (bind tcp://*:port
    and ipc://, connect to a named host). The replay socket always binds. Every batch carries data_parallel_rank, as
    vLLM's do; None leaves it out (the batches of vLLM before it had one).
    medium names the GPU's events (None: "GPU"); the host tier's go as
    "CPU".
    Failures raise KvplugError subclasses with the library's message (an
    endpoint in use: InvalidArgumentError)."""

    _destroy = "kvp_event_publisher_destroy"

    def __init__(
        self,
        manager: Any,
        endpoint: str,
        *,
        replay_endpoint: Optional[str] = None,
        topic: str = "",
        medium: Optional[str] = None,
        bind_mode: int = BIND,
        event_format: int = FORMAT_MAP,
        hash_format: int = HASH_BYTES,
        data_parallel_rank: Optional[int] = 0,
        buffer_steps: int = 0,
        hwm: int = 0,
        max_batch_events: int = 0,
        flush_interval_us: int = 0,
        buffer_bytes: int = 0,
    ) -> None:
        mh = getattr(manager, "handle", None)
        if mh is None:
            raise _lib.error_for(int(_lib.Status.INVALID_HANDLE), "EventPublisher: the manager is closed (or not a Manager)")
        i32 = lambda v, what, lo=None: _lib.checked_int(v, f"EventPublisher: {what}", "int32", lo=lo)  # noqa: E731
        cfg = EventPublisherConfig(
            ctypes.sizeof(EventPublisherConfig),
            _lib.c_string(endpoint, "EventPublisher: endpoint"),
            _lib.c_string(replay_endpoint, "EventPublisher: replay_endpoint"),
            _lib.c_string(topic, "EventPublisher: topic"),
            _lib.c_string(medium, "EventPublisher: medium"),
            i32(bind_mode, "bind_mode"),
            i32(event_format, "event_format"),
            i32(hash_format, "hash_format"),
            -1 if data_parallel_rank is None else i32(data_parallel_rank, "data_parallel_rank", 0),
            i32(buffer_steps, "buffer_steps"),
            i32(hwm, "hwm"),
            i32(max_batch_events, "max_batch_events"),
            i32(flush_interval_us, "flush_interval_us"),
            _lib.checked_int(buffer_bytes, "EventPublisher: buffer_bytes", "int64"),
        )
        out = _vp()
        st = C.kvp_event_publisher_create(mh, ctypes.byref(cfg), ctypes.byref(out))
        if st:
            _lib.raise_status(st)
        self._own(out.value, C.kvp_event_publisher_destroy, out.value)
        self._manager = manager  # kept alive: the publisher reads its events
        s = self.stats()
        self.pub_port = s.pub_port
        self.replay_port = s.replay_port

    def close(self) -> None:
        """Publishes what is pending (waiting at most a second), closes the
        sockets; idempotent."""
        super().close()

    def __repr__(self) -> str:
        state = "closed" if self._h is None else f"pub_port={self.pub_port}, replay_port={self.replay_port}"
        return f"EventPublisher({state})"

    def _handle(self) -> Optional[int]:
        return self._h

    def flush(self) -> None:
        """Publishes the pending events now (never waits on the network)."""
        _lib.check(C.kvp_event_publisher_flush(self._handle()))

    def resync(self) -> None:
        """Sends AllBlocksCleared and every cached block next."""
        _lib.check(C.kvp_event_publisher_resync(self._handle()))

    def stats(self) -> EventPublisherStats:
        s = EventPublisherStatsStruct()
        s.struct_size = ctypes.sizeof(s)
        _lib.check(C.kvp_event_publisher_stats_get(self._handle(), ctypes.byref(s)))
        return EventPublisherStats(
            s.batches, s.events, s.bytes, s.dropped_sends, s.replay_requests, s.replay_batches, s.snapshots,
            s.source_errors, s.buffered_batches, s.buffered_bytes, s.subscribers, s.pub_port, s.replay_port,
        )
