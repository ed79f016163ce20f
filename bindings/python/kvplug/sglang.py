"""kvplug inside SGLang: a HiCache storage backend (SGLang's L3, below its
host-memory L2) over kvplug's shared tier (a Valkey or Redis server that
instances share, kvplug.sharedstore) and, optionally, a host tier of its own
(kvplug.hoststore) that keeps recently used pages in local memory in front
of the server.

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvplug",
            "module_path": "kvplug.sglang", "class_name": "KvplugHiCacheStorage",
            "interface_v1": 1, "kvplug_valkey": "127.0.0.1:6379",
            "kvplug_host_bytes": 8589934592}'

extra_config keys read here (SGLang's own keys, such as interface_v1, which
selects the zero-copy batch_get_v1 / batch_set_v1 path, keep their meaning):

    kvplug_valkey         host:port of the shared server ("" or absent: none)
    kvplug_host_bytes     bytes of the local host tier (0 or absent: none);
                          at least one of the two is required. A hybrid
                          model's side pools (Mamba states, SWA pages,
                          registered with register_mem_host_pool_v2) share
                          it with the KV pages, split in the proportions of
                          SGLang's own host pools
    kvplug_key_space      the keys' space on the server (default: from the
                          model name); instances that share blocks share it
    kvplug_op_timeout_ms  bound on one server call (default 250)
    kvplug_ttl_ms         expiry of stored pages (default: none)

and for a server others can reach (all off by default; kvplug.sharedstore):

    kvplug_valkey_username         ACL user sent with AUTH (default: the
                                   default user)
    kvplug_valkey_password_env     the name of an environment variable that
                                   holds the AUTH password, or
    kvplug_valkey_password_file    the path of a file that does (never the
                                   password itself: the config is on the
                                   command line)
    kvplug_valkey_tls              true: TLS, the server's certificate verified
    kvplug_valkey_tls_ca_file      PEM CAs (default: the system's roots)
    kvplug_valkey_tls_cert_file    client certificate and key, PEM
    kvplug_valkey_tls_key_file
    kvplug_valkey_tls_server_name  default: the host of kvplug_valkey
    kvplug_mac_keys_env            an environment variable, or
    kvplug_mac_keys_file           a file, holding one or two MAC keys (hex;
                                   the first signs): every page carries a MAC
                                   and a page whose MAC does not verify is a
                                   miss

A page's key is a 128-bit hash of SGLang's page hash (already chained over
the prefix) with the model, this rank's shard (tensor, pipeline and context
parallel rank; MLA ranks, which hold the same bytes, share keys, and each
stores what the tiers lack) and the fingerprint of the pool's layout (its
kind, dtype, layout and page geometry): instances whose pools differ (a
bf16 and an fp8 KV cache of one model) never share a key, so neither counts
the other's pages as there nor overwrites them. Values carry the
fingerprint too, so a value that fails its checks is a miss.

Faults in SGLang's terms, never an exception into its threads: a page never
stored, or stored by another layout, is a miss (batch_exists stops
counting there, batch_get_v1 returns False for it); a store of a page the
local tier holds already makes no local copy, and writes the page to the
server only when the server is not known to hold it (so a server write that
failed is made again at the page's next store); a full local tier skips the
local copy; a server that is down, slow or restarting makes gets and exists
misses and stores skipped within the op timeout (False when no tier took the
page). Every case is counted: KvplugHiCacheStorage.counters().

SGLang's I/O threads transfer concurrently; clear (its
/clear_hicache_storage_backend) and close wait for the transfers running and
hold back new ones, and a transfer after close is a miss, or False.

This module imports without SGLang installed: KvplugHiCacheStorage is built
on first access, which imports SGLang. PageStore, the logic under it, needs
numpy only.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from . import _lib
from .hoststore import RESIDENT, HostStore, key64
from .sharedstore import SharedStore, key128, keys64

logger = logging.getLogger("kvplug.sglang")

__all__ = ["PageStore", "KvplugHiCacheStorage", "shared_security"]

_build_lock = threading.Lock()
_now = time.monotonic  # PageStore's clock (a test may stand in for it)


class _Gate:
    """A readers-writer gate: transfers hold it shared, concurrently with
    each other; clear and close hold it alone. The host store's reset and
    destroy require that no copy uses a slot any more (a reset slot is
    handed to the next reserve while a read or write of the old key still
    targets it; a destroyed store's memory is freed under a running copy),
    which only the callers can guarantee. A waiting clear or close holds
    back new transfers, so that a steady stream of them cannot starve it.
    Not re-entrant: a thread holding it must not take it again."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self.waiting = 0  # exclusive holders waiting (tests read it)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self.waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self.waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self.waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class PageStore:
    """Pages (fixed size, page_bytes) by 16-byte key (kvplug.sharedstore.key128;
    uint8 [n, 16] arrays) in a local host tier (host_bytes of it; none when 0;
    it keys a page by the key's first 8 bytes) in front of a shared store
    (none when None). Pages move as scatter lists: key i's bytes are the concatenation
    of ptrs[i, :] (addresses) of lens[i, :] bytes, as SGLang's host pool
    describes a page (one segment for MLA, K and V for MHA page_first, every
    layer's K and V for layer_first). shared_ttl_ms: the expiry the shared
    store gives the pages it stores (0: none).

    Threads: put, get, exists and exists_prefix may run on several threads
    at once; clear and close wait for the running ones and hold back new
    ones (_Gate). After close every call is a miss, or stores nothing."""

    def __init__(self, page_bytes: int, host_bytes: int = 0, shared: Optional[SharedStore] = None,
                 shared_ttl_ms: int = 0) -> None:
        self.page_bytes = int(page_bytes)
        slots = int(host_bytes) // self.page_bytes if self.page_bytes > 0 else 0
        self.host: Optional[HostStore] = HostStore(num_slots=slots, slot_bytes=self.page_bytes) if slots > 0 else None
        self.shared = shared
        if self.host is None and self.shared is None:
            raise _lib.InvalidArgumentError(f"kvplug PageStore: no tier (host_bytes {host_bytes} holds no page of {page_bytes} "
                                            "bytes, and no shared store)")
        self.counts: Counter = Counter()
        self._lock = threading.Lock()  # counts and _on_server: the stores are thread-safe
        self._gate = _Gate()
        self._closed = False
        # Host keys (64-bit) of pages the local tier holds that the server
        # accepted, or served, each until when the server is taken to hold
        # it: a store of one of them skips the server. Any other page the
        # local tier holds is written to the server at its next store, so
        # that a server write that failed (down, slow, restarting) is made
        # again instead of never. With an expiry, a page is taken to be
        # there for half of it after its write (a store after that writes
        # it again, which renews it), and a page served is not taken to be
        # there at all (when it was written is unknown). Bounded by the
        # local tier: its evictions and clear() drop keys.
        self._on_server: Dict[int, float] = {}
        self._known_s = float("inf") if shared_ttl_ms <= 0 else shared_ttl_ms / 2000.0

    def _count(self, **kw: int) -> None:
        with self._lock:
            self.counts.update(kw)

    def counters(self) -> Dict[str, int]:
        """A copy of counts (taken under the lock the I/O threads update it
        under: iterating the live Counter while one adds a key raises)."""
        with self._lock:
            return dict(self.counts)

    def _known(self, k64: np.ndarray) -> np.ndarray:
        now = _now()
        with self._lock:
            on = self._on_server
            return np.fromiter((on.get(int(k), 0.0) > now for k in k64), bool, len(k64))

    def _mark_on_server(self, k64: np.ndarray, served: bool = False) -> None:
        if not len(k64) or self.host is None or (served and self._known_s != float("inf")):
            return
        until = _now() + self._known_s
        with self._lock:
            self._on_server.update((int(k), until) for k in k64)
            big = len(self._on_server) > 2 * self.host.num_slots + 64
        if big:
            # Keys marked after a racing eviction dropped them, or expired:
            # keep the live ones the local tier still holds.
            now = _now()
            with self._lock:
                keys = np.fromiter((k for k, t in self._on_server.items() if t > now), np.uint64)
            st, _ = self.host.state(keys)
            keep = {int(k) for k in keys[st == RESIDENT]}
            with self._lock:
                for k in [k for k in self._on_server if k not in keep]:
                    del self._on_server[k]

    def _forget_on_server(self, k64: np.ndarray) -> None:
        if len(k64):
            with self._lock:
                for k in k64:
                    self._on_server.pop(int(k), None)

    def exists_prefix(self, keys: np.ndarray) -> int:
        """How many keys, from the first, a tier holds (local hits touched)."""
        with self._gate.shared():
            if self._closed:
                return 0
            n = self.host.lookup_prefix(keys64(keys)) if self.host is not None else 0
            if n < len(keys) and self.shared is not None:
                n += self.shared.prefix(keys[n:])
        self._count(exists_keys=len(keys), exists_hits=n)
        return n

    def exists(self, keys: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), bool)
        with self._gate.shared():
            if self._closed:
                return found
            if self.host is not None:
                st, _ = self.host.state(keys64(keys))
                found = st == RESIDENT
            rest = np.flatnonzero(~found)
            if len(rest) and self.shared is not None:
                found[rest] = self.shared.exists(keys[rest])
        return found

    def _host_fill(self, k64: np.ndarray, ptrs: np.ndarray, lens: np.ndarray) -> Optional[np.ndarray]:
        """Copies the pages of the keys the host tier lacks into it: the
        positions of the keys stored now (the others it held already), or
        None when the batch does not fit. A write that raises gives the
        reserved slots back (completed as failed) before the error goes on:
        left pending they would stay pinned, and their keys unreadable.
        The caller holds the gate shared."""
        r = self.host.try_reserve(k64)
        if r is None:
            return None
        slots, evicted = r
        self._forget_on_server(evicted)
        new = np.flatnonzero(slots >= 0)
        try:
            if len(new):
                self.host.write(slots[new], ptrs[new], lens[new])
            self.host.complete(k64[new])
        except Exception:
            self.host.complete(k64[new], failed=True)
            raise
        return new

    def put(self, keys: np.ndarray, ptrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Stores the pages; ok[i]: key i is in a tier now (resident in the
        local tier, or accepted by the server now or before). A page the
        local tier holds already is not copied again, and goes to the
        server unless the server is known to hold it."""
        n = len(keys)
        ok = np.zeros(n, bool)
        with self._gate.shared():
            if self._closed:
                return ok
            k64 = keys64(keys)
            to_shared = np.arange(n)
            resident = np.zeros(n, bool)  # without a local tier: nothing resident
            if self.host is not None:
                new = self._host_fill(k64, ptrs, lens)
                if new is None:
                    self._count(host_full=n)
                else:
                    self._count(host_present=n - len(new), host_stored=len(new))
                # Resident, not merely held: a key another thread holds
                # pending may yet fail its write.
                st, _ = self.host.state(k64)
                resident = st == RESIDENT
                ok = resident.copy()
                if self.shared is not None:
                    known = self._known(k64)
                    ok |= known
                    to_shared = np.flatnonzero(~known)
                    if n - len(to_shared):
                        self._count(shared_present=n - len(to_shared))
            if self.shared is not None and len(to_shared):
                stored = self.shared.put(keys[to_shared], ptrs[to_shared], lens[to_shared])
                self._count(shared_stored=stored, shared_skipped=len(to_shared) - stored)
                # The server says how many it took, not which: a part
                # stored counts as none (written again next time).
                if stored == len(to_shared):
                    ok[to_shared] = True
                    self._mark_on_server(k64[to_shared[resident[to_shared]]])
        return ok

    def get(self, keys: np.ndarray, ptrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Copies the pages found into their segments; found[i] per key. A
        page the shared store had is kept in the local tier too."""
        n = len(keys)
        found = np.zeros(n, bool)
        with self._gate.shared():
            if self._closed:
                return found
            k64 = keys64(keys)
            if self.host is not None:
                slots, _ = self.host.pin(k64)
                hit = np.flatnonzero(slots >= 0)
                if len(hit):
                    try:
                        self.host.read(slots[hit], ptrs[hit], lens[hit])
                        found[hit] = True
                    finally:
                        self.host.unpin(k64[hit])
                self._count(host_hits=len(hit))
            rest = np.flatnonzero(~found)
            if len(rest) and self.shared is not None:
                got = self.shared.get(keys[rest], ptrs[rest], lens[rest])
                found[rest] = got
                fetched = rest[got]
                self._count(shared_hits=len(fetched), misses=len(rest) - len(fetched))
                if len(fetched) and self.host is not None:
                    new = self._host_fill(k64[fetched], ptrs[fetched], lens[fetched])
                    if new is not None:
                        self._count(host_filled=len(new))
                        self._mark_on_server(k64[fetched], served=True)
            else:
                self._count(misses=len(rest))
        return found

    def clear(self) -> None:
        """Drops the local tier (the shared server's pages stay: its memory
        is bounded by its own maxmemory policy), once the running transfers
        are done."""
        with self._gate.exclusive():
            if self._closed:
                return
            if self.host is not None:
                self.host.reset()
            with self._lock:
                self._on_server.clear()

    def close(self) -> None:
        """Closes the tiers once the running transfers are done (the host
        store's memory is freed at once); later calls are misses."""
        with self._gate.exclusive():
            if self._closed:
                return
            self._closed = True
            if self.host is not None:
                self.host.close()
            if self.shared is not None:
                self.shared.close()


def _segments(ptrs: Sequence[int], sizes: Sequence[int], pages: int) -> tuple:
    """SGLang's page buffer meta (flat lists, consecutive per page) as
    [pages, segs] arrays."""
    if pages == 0 or len(ptrs) % pages or len(ptrs) != len(sizes):
        raise _lib.InvalidArgumentError(f"page buffer meta of {len(ptrs)} pointers and {len(sizes)} sizes for {pages} pages")
    p = np.asarray(ptrs, dtype=np.uint64).reshape(pages, -1)
    ln = np.asarray(sizes, dtype=np.int64).reshape(pages, -1)
    return p, ln


def __getattr__(name: str) -> Any:
    if name == "KvplugHiCacheStorage":
        with _build_lock:
            if name not in globals():
                globals()[name] = _build()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# extra_config keys of the shared store's security -> SharedStore's kwargs.
_SECURITY_KEYS = {
    "kvplug_valkey_username": "username",
    "kvplug_valkey_password_env": "password_env",
    "kvplug_valkey_password_file": "password_file",
    "kvplug_valkey_tls": "tls",
    "kvplug_valkey_tls_ca_file": "tls_ca_file",
    "kvplug_valkey_tls_cert_file": "tls_cert_file",
    "kvplug_valkey_tls_key_file": "tls_key_file",
    "kvplug_valkey_tls_server_name": "tls_server_name",
    "kvplug_mac_keys_env": "mac_keys_env",
    "kvplug_mac_keys_file": "mac_keys_file",
}

# Keys that would put a secret in the config (which is on the command line).
_SECRET_KEYS = ("kvplug_valkey_password", "kvplug_password", "kvplug_mac_keys", "kvplug_mac_key")


def shared_security(extra: Dict[str, Any]) -> Dict[str, Any]:
    """SharedStore's security kwargs from SGLang's extra_config (the
    kvplug_valkey_* and kvplug_mac_keys_* keys of the module docstring).
    A key that would hold a secret itself is refused, without its value
    in the message."""
    for k in _SECRET_KEYS:
        if k in extra:
            raise _lib.InvalidArgumentError(
                f"kvplug: {k} in --hicache-storage-backend-extra-config would put a secret on the command line: "
                f"use {k}_env (an environment variable's name) or {k}_file (a file's path) instead (the value is not shown)",
                _lib.Status.INVALID_ARGUMENT)
    out: Dict[str, Any] = {}
    for key, arg in _SECURITY_KEYS.items():
        v = extra.get(key)
        if v is None or v == "":
            continue
        if arg == "tls":
            if isinstance(v, str) and v.lower() in ("true", "1", "yes", "false", "0", "no"):
                v = v.lower() in ("true", "1", "yes")
            if not isinstance(v, bool) and v not in (0, 1):
                raise _lib.InvalidArgumentError(f"kvplug: {key} must be true or false: got {v!r}", _lib.Status.INVALID_ARGUMENT)
            v = bool(v)
        out[arg] = v
    return out


def _key_space(model: Optional[str]) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]", "-", model or "sglang").strip("-") or "sglang"
    return s[-64:]


def _build() -> Any:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )

    class KvplugHiCacheStorage(HiCacheStorage):
        """SGLang's HiCacheStorage over kvplug's tiers (see the module
        docstring); loaded by `--hicache-storage-backend dynamic`."""

        def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None) -> None:
            extra = dict(storage_config.extra_config or {})
            self.config = storage_config
            self.valkey = str(extra.get("kvplug_valkey") or "")
            self.host_bytes = int(extra.get("kvplug_host_bytes") or 0)
            if not self.valkey and self.host_bytes <= 0:
                raise _lib.InvalidArgumentError("kvplug: the HiCache storage backend needs kvplug_valkey (host:port) or "
                                                "kvplug_host_bytes in --hicache-storage-backend-extra-config")
            self.key_space = str(extra.get("kvplug_key_space") or _key_space(storage_config.model_name))
            self.op_timeout_ms = int(extra.get("kvplug_op_timeout_ms") or 0)
            self.ttl_ms = int(extra.get("kvplug_ttl_ms") or 0)
            self.security = shared_security(extra)
            if self.security and not self.valkey:
                raise _lib.InvalidArgumentError("kvplug: the shared store's security keys (kvplug_valkey_username, ..._tls, "
                                                "kvplug_mac_keys_*) need kvplug_valkey", _lib.Status.INVALID_ARGUMENT)
            c = storage_config
            shard = f"pp{c.pp_rank}/{c.pp_size}|cp{c.attn_cp_rank}/{c.attn_cp_size}"
            if c.dcp_size > 1:
                shard += f"|dcp{c.dcp_rank}/{c.dcp_size}"
            if not c.is_mla_model:
                shard += f"|tp{c.tp_rank}/{c.tp_size}"
            self._suffix = f"|{c.model_name or ''}|{shard}"
            # name -> (host pool, its page size in tokens, page bytes, shared store or None)
            self._pools: Dict[str, tuple] = {}
            self._stores: Dict[str, Optional[PageStore]] = {}
            # name -> what a page key of the pool hashes after SGLang's page
            # hash (see _keys)
            self._key_tails: Dict[str, str] = {}
            self._assembled = False
            self._closed = False
            self._errors: Counter = Counter()
            self._bad: Counter = Counter()
            self._lock = threading.RLock()

        # -- setup --

        def _register(self, pool: Any, name: str) -> None:
            """Records a host pool and its page geometry (a pool whose pages
            cannot be described fails here, at registration, not on the I/O
            threads). The server connection is made now; the local tier is
            assembled at the first transfer, once every pool is known (see
            _assemble)."""
            with self._lock:
                if self._closed or name in self._pools:
                    return
                page = int(getattr(pool, "page_size", 1) or 1)
                ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
                page_bytes = int(sum(sizes))
                layout = getattr(pool, "layout", "")
                fp = key64(f"{self.config.model_name}|{type(pool).__name__}|{layout}|{getattr(pool, 'dtype', '')}|"
                           f"{page}|{page_bytes}|{len(ptrs)}|{name}{self._suffix}")
                shared = None
                if self.valkey:
                    shared = SharedStore(self.valkey, self.key_space, fingerprint=fp, block_bytes=page_bytes,
                                         op_timeout_ms=self.op_timeout_ms, ttl_ms=self.ttl_ms, **self.security)
                # The layout fingerprint is in the key, not only in the value:
                # the server's EXISTS sees keys alone, so two layouts of one
                # model (a bf16 and an fp8 KV cache) sharing keys would count
                # each other's pages as there, and overwrite each other's.
                scope = "" if name == str(PoolName.KV) else f"|{name}"
                self._key_tails[name] = f"{scope}|{fp:016x}{self._suffix}"
                self._pools[name] = (pool, page, page_bytes, shared)
                if self._assembled:
                    # The budget was split already: a pool that comes later
                    # keeps its pages on the server only.
                    logger.warning("kvplug HiCache storage: pool %s registered after the first transfer; it has no "
                                   "local tier", name)
                    self._stores[name] = self._page_store(name, 0)

        def _page_store(self, name: str, host_bytes: int) -> Optional[PageStore]:
            _, _, page_bytes, shared = self._pools[name]
            if shared is None and host_bytes < page_bytes:
                logger.error("kvplug HiCache storage: pool %s gets %d bytes of kvplug_host_bytes, less than one page "
                             "of %d bytes, and there is no kvplug_valkey: its pages are not stored", name, host_bytes,
                             page_bytes)
                return None
            return PageStore(page_bytes, host_bytes, shared, shared_ttl_ms=self.ttl_ms)

        def _assemble(self) -> None:
            """Builds every registered pool's PageStore. kvplug_host_bytes is
            the local tier of all pools together: a hybrid model's side
            pools (Mamba states, SWA pages) live in it beside the KV pages,
            so that a local KV hit is not cut short by a state only the
            server holds (or by the server being down), and the budget is
            split in the proportions of SGLang's own host pools (its L2),
            which the engine sized to hold its pools in balance."""
            with self._lock:
                if self._assembled or self._closed:
                    return
                pages = {name: int(getattr(pool, "size", 0) or 0) // page
                         for name, (pool, page, _, _) in self._pools.items()}
                if not all(pages.values()):
                    # A pool that does not say its size: as many pages of
                    # each pool.
                    pages = {name: 1 for name in self._pools}
                caps = {name: pages[name] * self._pools[name][2] for name in self._pools}
                total = sum(caps.values())
                for name in self._pools:
                    share = self.host_bytes * caps[name] // total if total else 0
                    self._stores[name] = self._page_store(name, share)
                self._assembled = True

        def _store(self, name: str) -> Optional[PageStore]:
            if not self._assembled:
                self._assemble()
            return self._stores.get(name)  # none after close: close empties it

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            super().register_mem_pool_host(mem_pool_host)
            self._register(mem_pool_host, str(PoolName.KV))

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            self._register(host_pool, str(host_pool_name))

        # -- helpers --

        def _keys(self, keys: Sequence[str], pool: str = "kv") -> np.ndarray:
            tail = self._key_tails.get(pool)
            if tail is None:
                raise _lib.InvalidArgumentError(f"kvplug HiCache storage: pool {pool} is not registered")
            raw = b"".join(key128(f"{k}{tail}") for k in keys)
            return np.frombuffer(raw, dtype=np.uint8).reshape(len(keys), 16)

        def _kv(self) -> PageStore:
            store = self._store(str(PoolName.KV))
            if store is None:
                raise _lib.InvalidArgumentError("kvplug HiCache storage: no KV pool registered, or no tier holds it")
            return store

        def _fault(self, what: str, exc: BaseException) -> None:
            with self._lock:
                self._errors[what] += 1
            logger.exception("kvplug HiCache storage: %s failed: %s", what, exc)

        def counters(self) -> Dict[str, int]:
            """Counts of every pool's tiers (PageStore.counts, summed), of
            faults caught (errors) and of v2/v1 transfers refused for host
            indices that are not a page per key (bad_transfers)."""
            out: Counter = Counter()
            with self._lock:
                stores = [s for s in self._stores.values() if s is not None]
            for s in stores:
                out.update(s.counters())
            out["errors"] = sum(self._errors.values())
            out["bad_transfers"] = sum(self._bad.values())
            return dict(out)

        def _pool_io(self, pool: Any, store: PageStore, keys: Sequence[str], host_indices: Any, name: str,
                     write: bool) -> List[bool]:
            if not keys:
                return []
            page = int(getattr(pool, "page_size", 1) or 1)
            n = 0 if host_indices is None else int(host_indices.numel())
            if n != len(keys) * page:
                # A page per key, page_size host slots each (a Mamba pool's
                # page is one slot): anything else would pair keys with
                # other pages' bytes. SGLang ends the transfer at the first
                # False, as for a miss.
                with self._lock:
                    self._bad[name] += 1
                logger.error("kvplug HiCache storage: %s transfer of %d keys with %d host indices (pages of %d)", name,
                             len(keys), n, page)
                return [False] * len(keys)
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
            p, ln = _segments(ptrs, sizes, len(keys))
            k = self._keys(keys, name)
            res = store.put(k, p, ln) if write else store.get(k, p, ln)
            return res.tolist()

        # -- zero-copy v1 --

        def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
            try:
                return self._kv().exists_prefix(self._keys(keys)) if keys else 0
            except Exception as exc:
                self._fault("batch_exists", exc)
                return 0

        def exists(self, key: str) -> bool:
            try:
                return bool(self._kv().exists(self._keys([key]))[0])
            except Exception as exc:
                self._fault("exists", exc)
                return False

        def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                         extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
            try:
                return self._pool_io(self.mem_pool_host, self._kv(), keys, host_indices, str(PoolName.KV), False)
            except Exception as exc:
                self._fault("batch_get_v1", exc)
                return [False] * len(keys)

        def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                         extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
            try:
                return self._pool_io(self.mem_pool_host, self._kv(), keys, host_indices, str(PoolName.KV), True)
            except Exception as exc:
                self._fault("batch_set_v1", exc)
                return [False] * len(keys)

        # -- generic (tensor) interface --

        @staticmethod
        def _tensor_segments(tensors: Sequence[torch.Tensor]) -> tuple:
            for t in tensors:
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise _lib.InvalidArgumentError("page tensors must be contiguous CPU tensors")
            p = np.array([t.data_ptr() for t in tensors], dtype=np.uint64).reshape(-1, 1)
            ln = np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64).reshape(-1, 1)
            return p, ln

        @staticmethod
        def _is_pointer(loc: Any) -> bool:
            return isinstance(loc, int) or (isinstance(loc, (list, tuple)) and bool(loc)
                                             and all(isinstance(x, int) for x in loc))

        @staticmethod
        def _pointer_segments(locs: Sequence[Any], sizes: Sequence[Any]) -> tuple:
            """Raw-address pages (target_location as an address, or a list of
            them, with target_sizes in bytes), as some backends take them."""
            rows_p, rows_l = [], []
            for loc, size in zip(locs, sizes):
                loc = [loc] if isinstance(loc, int) else list(loc)
                size = [size] * len(loc) if isinstance(size, int) else list(size)
                rows_p.append(loc)
                rows_l.append(size)
            return np.array(rows_p, dtype=np.uint64), np.array(rows_l, dtype=np.int64)

        def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                      target_sizes: Optional[Any] = None) -> List[Any]:
            """Pages into tensors (target_locations: flat page tensors, or new
            ones of the host pool's), or into raw addresses (target_locations
            addresses, target_sizes bytes: True per hit). None per miss."""
            try:
                if not keys:
                    return []
                if target_locations is not None and target_sizes is not None and all(
                        self._is_pointer(t) for t in target_locations):
                    p, ln = self._pointer_segments(target_locations, target_sizes)
                    found = self._kv().get(self._keys(keys), p, ln)
                    return [True if f else None for f in found]
                targets = list(target_locations) if target_locations is not None else [
                    self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
                p, ln = self._tensor_segments(targets)
                found = self._kv().get(self._keys(keys), p, ln)
                return [t if f else None for t, f in zip(targets, found)]
            except Exception as exc:
                self._fault("batch_get", exc)
                return [None] * len(keys)

        def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
            locs = None if target_location is None else [target_location]
            sizes = None if target_sizes is None else [target_sizes]
            return self.batch_get([key], locs, sizes)[0]

        def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                      target_sizes: Optional[Any] = None) -> bool:
            """Pages from tensors (values), or from raw addresses
            (target_locations with target_sizes); True when every page is in
            a tier."""
            try:
                if not keys:
                    return True
                pages = None  # contiguous copies of strided pages: alive until put has read them
                if values is None and target_locations is not None and target_sizes is not None:
                    p, ln = self._pointer_segments(target_locations, target_sizes)
                else:
                    pages = [v.contiguous() for v in values]
                    p, ln = self._tensor_segments(pages)
                return bool(self._kv().put(self._keys(keys), p, ln).all())
            except Exception as exc:
                self._fault("batch_set", exc)
                return False

        def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
                target_sizes: Optional[Any] = None) -> bool:
            if value is None and target_location is not None:
                return self.batch_set([key], None, [target_location], [target_sizes])
            return self.batch_set([key], [value])

        # -- multi-pool v2 --

        def _pool_has(self, name: str, keys: Sequence[str]) -> np.ndarray:
            store = self._store(name)
            if store is None or not keys:
                return np.zeros(len(keys), bool)
            return store.exists(self._keys(keys, name))

        def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                            extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
            try:
                kv_pages = self.batch_exists(keys, extra_info)
                hits: Dict[str, int] = {str(PoolName.KV): kv_pages} if kv_pages else {}
                restorable = list(range(1, kv_pages + 1))
                for t in pool_transfers or []:
                    if not restorable:
                        break
                    name = str(t.name)
                    has = self._pool_has(name, keys[:kv_pages])
                    if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                        miss = np.flatnonzero(~has)
                        boundary = int(miss[0]) if len(miss) else kv_pages
                        ok = set(range(1, boundary + 1))
                    elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                        trailing = max(1, len(t.keys) if t.keys else 1)
                        ok = {n for n in range(1, kv_pages + 1) if has[max(0, n - trailing):n].all()}
                        boundary = max(ok, default=0)
                    else:  # a policy this backend does not keep: nothing restorable from it
                        ok, boundary = set(), 0
                    if boundary:
                        hits[name] = boundary
                    restorable = [n for n in restorable if n in ok]
                return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)
            except Exception as exc:
                self._fault("batch_exists_v2", exc)
                return PoolTransferResult.empty()

        def _batch_v2(self, transfers: List[PoolTransfer], write: bool) -> Dict[str, List[bool]]:
            out: Dict[str, List[bool]] = {}
            for t in transfers:
                name, keys = str(t.name), list(t.keys or [])
                try:
                    store = self._store(name)
                    if store is None:
                        raise _lib.InvalidArgumentError(f"no tier holds pool {name} (registered: {sorted(self._pools)})")
                    pool = self._pools[name][0]
                    out[name] = self._pool_io(pool, store, keys, t.host_indices, name, write)
                except Exception as exc:
                    self._fault("batch_set_v2" if write else "batch_get_v2", exc)
                    out[name] = [False] * len(keys)
            return out

        def batch_get_v2(self, transfers: List[PoolTransfer],
                         extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
            return self._batch_v2(transfers, write=False)

        def batch_set_v2(self, transfers: List[PoolTransfer],
                         extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
            return self._batch_v2(transfers, write=True)

        # -- lifecycle --

        def clear(self) -> bool:
            try:
                # The stores are taken under the lock (a registration or a
                # close may change the dict), cleared outside it: each
                # clear waits for its pool's running transfers.
                with self._lock:
                    stores = [s for s in self._stores.values() if s is not None]
                for s in stores:
                    s.clear()
                return True
            except Exception as exc:
                self._fault("clear", exc)
                return False

        def get_stats(self) -> None:
            return None

        def close(self) -> None:
            """Closes every pool's tiers once their running transfers are
            done; a transfer after close is refused as a fault (a miss, or
            False), never a crash."""
            with self._lock:
                self._closed = True
                closing = [(self._stores.get(name), shared) for name, (_, _, _, shared) in self._pools.items()]
                self._stores.clear()
                self._pools.clear()
            for store, shared in closing:
                if store is not None:
                    store.close()  # waits for its transfers; closes its shared store too
                elif shared is not None:
                    shared.close()

    return KvplugHiCacheStorage
