"""The standalone shared store (include/kvplug.h, "standalone shared
store"): blocks in a Valkey or Redis server that instances share, keyed by
16-byte keys (key128(): a 128-bit hash of the block's identity), for
kvplug.sglang.

    with kvplug.SharedStore("127.0.0.1:6379", "llama3-8b", fingerprint=fp) as ss:
        keys = [key128(h) for h in block_hashes]
        ss.put(keys, ptrs, lens)          # ptrs/lens: [n, segs] per key
        found = ss.exists(keys)           # bool array
        found = ss.get(keys, ptrs, lens)  # copies into the segments

A server that is down, slow or restarting never raises: calls return
misses or store nothing within op_timeout_ms, counted in stats(); after a
failure the server is skipped for a backoff window (lookups and stores
each their own). A value that fails its
checks (short, corrupt, another fingerprint's) is a miss counted in corrupt.

For a server others can reach (include/kvplug.h, "Shared KV tier",
Security), all off by default:

    SharedStore("valkey.internal:6380", "llama3-8b", fingerprint=fp,
                username="kvplug", password_file="/run/secrets/valkey-password",
                tls=True, tls_ca_file="/etc/valkey/ca.pem",
                mac_keys_env="KVPLUG_MAC_KEYS")

The password and the MAC keys are never arguments: password_env /
mac_keys_env name an environment variable, password_file / mac_keys_file a
file, that holds them (the password is read again on every connect). A
refused AUTH or TLS handshake is a fault like a down server (misses,
counted in auth_failures or tls_failures, logged), never a fallback to
plaintext; a value whose MAC does not verify is a miss counted in corrupt
and mac_failures. No message holds a secret.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import re
from typing import Any, Dict, Optional, Union

import numpy as np

from . import _lib
from ._capi import SharedStoreConfig, SharedStoreStatsStruct
from ._lib import C
from .hoststore import _segments

__all__ = ["SharedStore", "SharedStoreStats", "key128", "keys128", "keys64"]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
_SECURITY_FIELDS = ("username", "password_env", "password_file", "tls_ca_file", "tls_cert_file", "tls_key_file",
                    "tls_server_name", "mac_keys_env", "mac_keys_file")


def _security(what: str, prefix: str, *, username: Any = None, password_env: Any = None, password_file: Any = None,
              tls: Any = False, tls_ca_file: Any = None, tls_cert_file: Any = None, tls_key_file: Any = None,
              tls_server_name: Any = None, mac_keys_env: Any = None, mac_keys_file: Any = None) -> Dict[str, Any]:
    """The security fields of a config struct (their C names less prefix:
    bytes or None, and tls 0 or 1), after the checks the bindings can make
    without the library: types, and environment variable names (whose
    value is never shown: a caller who passed the secret itself must not
    find it in a traceback). The library checks the rest (the files, the
    variables' values, which fields need which)."""
    args = dict(username=username, password_env=password_env, password_file=password_file, tls_ca_file=tls_ca_file,
                tls_cert_file=tls_cert_file, tls_key_file=tls_key_file, tls_server_name=tls_server_name,
                mac_keys_env=mac_keys_env, mac_keys_file=mac_keys_file)
    out: Dict[str, Any] = {}
    for name, v in args.items():
        arg = prefix + name
        if v is None:
            out[name] = None
            continue
        if name.endswith("_file") and isinstance(v, os.PathLike):
            v = os.fspath(v)
        if not isinstance(v, str):
            raise _lib.ArgumentTypeError(f"{what}: {arg} must be a str{' or a path' if name.endswith('_file') else ''}"
                                         f" (or None): got {type(v).__name__}", _lib.Status.INVALID_ARGUMENT)
        if name.endswith("_env") and not _ENV_NAME.fullmatch(v):
            raise _lib.InvalidArgumentError(
                f"{what}: {arg} must be the name of an environment variable ([A-Za-z_][A-Za-z0-9_]*) that holds the "
                f"{'password' if name.startswith('password') else 'MAC keys'}, not the secret itself (the value is not shown)",
                _lib.Status.INVALID_ARGUMENT)
        out[name] = _lib.c_string(v, f"{what}: {arg}")
    if not isinstance(tls, bool) and not (type(tls) is int and tls in (0, 1)):
        raise _lib.ArgumentTypeError(f"{what}: {prefix}tls must be a bool: got {type(tls).__name__}", _lib.Status.INVALID_ARGUMENT)
    out["tls"] = int(bool(tls))
    tls_set = [prefix + n for n in ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name") if out[n] is not None]
    if tls_set and not out["tls"]:
        raise _lib.InvalidArgumentError(f"{what}: {', '.join(tls_set)} given without {prefix}tls=True (a TLS setting on a "
                                        "plaintext connection)", _lib.Status.INVALID_ARGUMENT)
    return out


def key128(data: Union[bytes, bytearray, memoryview, str]) -> bytes:
    """A 16-byte key of a block's identity (bytes, or a str such as a hex
    digest): its BLAKE2b digest of 16 bytes. Its first 8 bytes, read
    little-endian, are kvplug.hoststore.key64 of the same data's digest
    (keys64 of a keys128 array)."""
    if isinstance(data, str):
        data = data.encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def keys128(keys: Any) -> np.ndarray:
    """keys (16-byte bytes objects, or a uint8 [n, 16] array) as a
    C-contiguous uint8 [n, 16] array."""
    if isinstance(keys, np.ndarray):
        a = np.ascontiguousarray(keys, dtype=np.uint8)
    else:
        a = np.frombuffer(b"".join(bytes(k) for k in keys), dtype=np.uint8).copy()
    a = a.reshape(-1, 16) if a.size else np.empty((0, 16), np.uint8)
    return a


def keys64(keys128_array: np.ndarray) -> np.ndarray:
    """The 64-bit host-store keys of 16-byte keys (their first 8 bytes)."""
    return np.ascontiguousarray(keys128_array[:, :8]).view("<u8").reshape(-1).astype(np.uint64)

_vp, _i32 = ctypes.c_void_p, ctypes.c_int32


@dataclasses.dataclass(frozen=True)
class SharedStoreStats:
    """struct kvp_shared_store_stats."""

    hits: int
    misses: int
    stores: int
    corrupt: int
    timeouts: int
    errors: int
    skipped: int
    bytes_read: int
    bytes_written: int
    available: bool
    auth_failures: int = 0  # of errors: AUTH refused, commands refused (NOAUTH, NOPERM)
    tls_failures: int = 0  # of errors: TLS handshakes or certificate verifications failed
    mac_failures: int = 0  # of corrupt: values whose MAC did not verify
    redirects: int = 0  # cluster mode: MOVED and ASK replies followed
    map_reads: int = 0  # cluster mode: slot maps read
    cluster: bool = False  # the server is a Valkey/Redis Cluster
    primaries: int = 0  # its primaries in the last map


class SharedStore(_lib.Owner):
    """A kvp_shared_store: a client of one server (see the module docstring).
    key_space names the keys' space (kvplug:<key_space>:<key>); fingerprint
    is the model and KV layout's, so that another layout's values are
    misses; block_bytes (0: any) the payload size every block must have.

    username, password_env or password_file (AUTH), tls with tls_ca_file
    (None: the system's roots), tls_cert_file and tls_key_file (a client
    certificate) and tls_server_name (None: the address's host), and
    mac_keys_env or mac_keys_file (one or two hex keys; the first signs):
    see the module docstring."""

    _destroy = "kvp_shared_store_destroy"

    def __init__(self, address: str, key_space: str, *, fingerprint: int = 0, block_bytes: int = 0,
                 dial_timeout_ms: int = 0, op_timeout_ms: int = 0, ttl_ms: int = 0, backoff_ms: int = 0,
                 max_backoff_ms: int = 0, username: Optional[str] = None, password_env: Optional[str] = None,
                 password_file: Optional[Union[str, os.PathLike]] = None, tls: bool = False,
                 tls_ca_file: Optional[Union[str, os.PathLike]] = None,
                 tls_cert_file: Optional[Union[str, os.PathLike]] = None,
                 tls_key_file: Optional[Union[str, os.PathLike]] = None, tls_server_name: Optional[str] = None,
                 mac_keys_env: Optional[str] = None, mac_keys_file: Optional[Union[str, os.PathLike]] = None) -> None:
        i32 = lambda v, what: _lib.checked_int(v, f"SharedStore: {what}", "int32")  # noqa: E731
        sec = _security("SharedStore", "", username=username, password_env=password_env, password_file=password_file,
                        tls=tls, tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file, tls_key_file=tls_key_file,
                        tls_server_name=tls_server_name, mac_keys_env=mac_keys_env, mac_keys_file=mac_keys_file)
        self._address = address.encode()
        self._key_space = key_space.encode()
        cfg = SharedStoreConfig(
            ctypes.sizeof(SharedStoreConfig), self._address, self._key_space,
            _lib.checked_int(fingerprint, "SharedStore: fingerprint", "uint64"),
            _lib.checked_int(block_bytes, "SharedStore: block_bytes", "int64"),
            i32(dial_timeout_ms, "dial_timeout_ms"), i32(op_timeout_ms, "op_timeout_ms"), i32(ttl_ms, "ttl_ms"),
            i32(backoff_ms, "backoff_ms"), i32(max_backoff_ms, "max_backoff_ms"), 0,
            *(sec[n] for n in _SECURITY_FIELDS), sec["tls"], 0,
        )
        out = _vp()
        _lib.check(C.kvp_shared_store_create(ctypes.byref(cfg), ctypes.byref(out)))
        self._own(out.value, C.kvp_shared_store_destroy, out.value)
        self.address = address
        self.key_space = key_space

    def __repr__(self) -> str:
        return "SharedStore(closed)" if self._h is None else f"SharedStore({self.address!r}, {self.key_space!r})"

    def exists(self, keys: Any) -> np.ndarray:
        """Which keys the server holds (bool array); all False on a fault."""
        k = keys128(keys)
        found = np.zeros(len(k), np.int32)
        if len(k):
            _lib.check(C.kvp_shared_store_exists(self._h, len(k), k.ctypes.data, found.ctypes.data))
        return found.astype(bool)

    def prefix(self, keys: Any) -> int:
        """How many keys, from the first, the server holds."""
        found = self.exists(keys)
        miss = np.flatnonzero(~found)
        return int(miss[0]) if len(miss) else len(found)

    def put(self, keys: Any, ptrs: Any, lens: Any) -> int:
        """Stores key i's payload, the concatenation of its segments (ptrs[i, :]
        addresses of lens[i, :] bytes); returns how many the server accepted."""
        k = keys128(keys)
        if not len(k):
            return 0
        p, ln, segs = _segments(len(k), ptrs, lens)
        n = _i32()
        _lib.check(C.kvp_shared_store_put(self._h, len(k), k.ctypes.data, segs, p.ctypes.data, ln.ctypes.data,
                                          ctypes.byref(n)))
        return n.value

    def get(self, keys: Any, ptrs: Any, lens: Any) -> np.ndarray:
        """Fetches key i's payload into its segments; found[i] (bool) says
        whether it was found whole and copied (else its segments are untouched)."""
        k = keys128(keys)
        found = np.zeros(len(k), np.int32)
        if not len(k):
            return found.astype(bool)
        p, ln, segs = _segments(len(k), ptrs, lens)
        _lib.check(C.kvp_shared_store_get(self._h, len(k), k.ctypes.data, segs, p.ctypes.data, ln.ctypes.data,
                                          found.ctypes.data))
        return found.astype(bool)

    def stats(self) -> SharedStoreStats:
        s = SharedStoreStatsStruct()
        s.struct_size = ctypes.sizeof(s)
        _lib.check(C.kvp_shared_store_stats_get(self._h, ctypes.byref(s)))
        return SharedStoreStats(s.hits, s.misses, s.stores, s.corrupt, s.timeouts, s.errors, s.skipped,
                                s.bytes_read, s.bytes_written, bool(s.available), s.auth_failures, s.tls_failures,
                                s.mac_failures, s.redirects, s.map_reads, bool(s.cluster), s.primaries)
