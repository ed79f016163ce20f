"""Throwaway Valkey/Redis servers for the benchmarks' shared KV tier
(bench/moved_sessions.py, bench/hf_bench.py's kvplug-shared system), and
the few RESP commands the benchmarks send them (redis_command,
redis_info, namespace_keys, delete_keys, drop_namespace).

RedisServer starts redis-server (or valkey-server) on a free loopback
port without persistence, with a maxmemory and allkeys-lru; RedisCluster
starts N of them in cluster mode and assigns each an equal range of the
slots. stop() ends the servers and removes their directories.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any, Dict, List


class RedisServer:
    """A throwaway redis-server (or valkey-server) on a free loopback port:
    no persistence, maxmemory with allkeys-lru (the tier never deletes
    keys)."""

    def __init__(self, binary: str, maxmemory: int, extra: List[str], cluster: bool = False) -> None:
        path = shutil.which(binary)
        if path is None:
            raise SystemExit(f"--redis-server {binary}: not found (install redis-server or valkey-server, or pass its path, "
                             "or --shared-tier HOST:PORT for a running server)")
        # Free ports, the cluster bus's its own (port + 10000 may not exist): both sockets held
        # while choosing, so that the two differ.
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            t.bind(("127.0.0.1", 0))
            self.port, self.bus_port = s.getsockname()[1], t.getsockname()[1] if cluster else 0
        self.dir = tempfile.mkdtemp(prefix="kvplug-redis-")
        self.proc: Any = None
        try:
            self._start(path, maxmemory, extra, cluster)
        except BaseException:  # a failed start, or an interrupt while it waits: nothing left behind
            self.stop()
            raise

    def _start(self, path: str, maxmemory: int, extra: List[str], cluster: bool) -> None:
        self.log = os.path.join(self.dir, "server.log")
        cmd = [path, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir,
               "--logfile", self.log, "--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru", *extra]
        if cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(self.dir, "nodes.conf"),
                    "--cluster-node-timeout", "5000", "--cluster-port", str(self.bus_port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.command("PING") == "PONG":
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
                try:
                    with open(self.log, errors="replace") as f:
                        err += "".join(f.readlines()[-5:])
                except OSError:
                    pass
                raise SystemExit(f"{path} did not start on port {self.port}: {err.strip()}")
            time.sleep(0.02)
        self.version = self.info().get("redis_version", "?")
        self.binary = path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self, *words: str) -> Any:
        return redis_command(self.address, *words)

    def info(self) -> Dict[str, str]:
        return redis_info(self.address)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if self.proc.stderr is not None:
                self.proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """A throwaway cluster of `primaries` servers in cluster mode (no
    replicas), each serving an equal range of the slots and a share of
    maxmemory; the client reaches it through any node (address: the
    first), and reads the nodes' shares of a fetch concurrently."""

    def __init__(self, binary: str, primaries: int, maxmemory: int, extra: List[str]) -> None:
        self.servers: List[RedisServer] = []
        try:
            for _ in range(primaries):
                self.servers.append(RedisServer(binary, max(maxmemory // primaries, 64 << 20), extra, cluster=True))
            for i, sv in enumerate(self.servers):
                lo, hi = i * 16384 // primaries, (i + 1) * 16384 // primaries - 1
                sv.command("CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi))
            for sv in self.servers[1:]:
                sv.command("CLUSTER", "MEET", "127.0.0.1", str(self.servers[0].port), str(self.servers[0].bus_port))
            deadline = time.monotonic() + 60
            want = ("cluster_state:ok", f"cluster_known_nodes:{primaries}")
            while not all(all(w in info for w in want)
                          for info in (sv.command("CLUSTER", "INFO") or "" for sv in self.servers)):
                if time.monotonic() > deadline:
                    raise SystemExit(f"a cluster of {primaries} primaries did not become ok within 60 s")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        self.version, self.binary = self.servers[0].version, self.servers[0].binary

    @property
    def address(self) -> str:
        return self.servers[0].address

    @property
    def nodes(self) -> List[str]:
        return [sv.address for sv in self.servers]

    def info(self) -> Dict[str, str]:
        """The nodes' INFO figures summed (the numeric ones)."""
        total: Dict[str, str] = {}
        for sv in self.servers:
            for k, v in sv.info().items():
                try:
                    total[k] = str(int(total.get(k, "0")) + int(v))
                except ValueError:
                    total.setdefault(k, v)
        return total

    def command(self, *words: str) -> Any:
        replies = [sv.command(*words) for sv in self.servers]
        return sum(replies) if all(isinstance(r, int) for r in replies) else replies[0]

    def stop(self) -> None:
        for sv in self.servers:
            sv.stop()


def _reply(f: Any) -> Any:
    head = f.readline().rstrip(b"\r\n")
    kind, rest = head[:1], head[1:].decode()
    if kind == b"+":
        return rest
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:n].decode(errors="replace")
    if kind == b"*":
        return [_reply(f) for _ in range(max(int(rest), 0))]
    raise OSError(f"redis reply {head!r}")


def redis_command(address: str, *words: str) -> Any:
    """One command's reply over RESP (simple string, integer, bulk string, array)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as c:
        c.sendall(f"*{len(words)}\r\n".encode() + b"".join(f"${len(w.encode())}\r\n{w}\r\n".encode() for w in words))
        return _reply(c.makefile("rb"))


def namespace_keys(nodes: List[str], namespace: str) -> Dict[str, List[str]]:
    """The keys the shared tier stored under namespace (kvplug:<namespace>:<hash>), by the node holding them."""
    return {n: redis_command(n, "KEYS", f"kvplug:{namespace}:*") or [] for n in nodes}


def delete_keys(keys: Dict[str, List[str]]) -> None:
    """Deletes keys from the nodes holding them, pipelined, one key a
    command (a cluster refuses commands whose keys lie in several slots)."""
    for node, ks in keys.items():
        if not ks:
            continue
        host, port = node.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as c:
            c.sendall(b"".join(f"*2\r\n$6\r\nUNLINK\r\n${len(k.encode())}\r\n{k}\r\n".encode() for k in ks))
            f = c.makefile("rb")
            for _ in ks:
                _reply(f)


def drop_namespace(nodes: List[str], namespace: str) -> int:
    """Deletes every key the shared tier stored under namespace on nodes
    (a run's blocks on a server of the caller's) and returns how many."""
    keys = namespace_keys(nodes, namespace)
    delete_keys(keys)
    return sum(map(len, keys.values()))


def redis_info(address: str) -> Dict[str, str]:
    text = redis_command(address, "INFO") or ""
    return dict(ln.split(":", 1) for ln in text.splitlines() if ":" in ln and not ln.startswith("#"))
