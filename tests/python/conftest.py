"""Shared fixtures of the Python tests. The library comes from KVPLUG_LIBRARY
(`make test-python` sets it to build/libkvplug.so)."""

from __future__ import annotations

import importlib
import socket
import sys
from types import ModuleType
from typing import Iterator, List, Optional, Tuple

import numpy as np
import pytest

import kvplug


def require(module: str, package: Optional[str] = None) -> ModuleType:
    """Imports a module the tests need from a package the Makefile installs
    in build/venv (xxhash, hypothesis, msgspec, pyzmq, torch, ...). A missing
    one fails the importing test module instead of skipping it, so that a
    broken environment cannot pass as a run of skipped tests."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"cannot import {module} ({e}): install the {package or module} package, which the Makefile "
                    "installs in build/venv for make test", pytrace=False)
        raise  # unreachable: pytest.fail raises


@pytest.fixture(autouse=True)
def _torch_seed() -> None:
    """Tests that fill tensors from torch's global generator (those of the
    argument checks and packing, whose values do not matter) draw the same
    values on every run."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """A module's tests run torch with one intra-op thread: tiny models gain
    nothing from more, and on a busy machine their spinning makes each step
    many times slower. Modules take it with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    torch = require("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def mgr() -> Iterator[kvplug.Manager]:
    """16 blocks of 4 tokens; sequences 1 (10 tokens), 2 (4), 3 (1): 11 blocks free."""
    with kvplug.Manager(16, 4) as m:
        m.add(1, 10)
        m.add(2, 4)
        m.add(3, 1)
        yield m


def snapshot(m: kvplug.Manager, live: List[int]) -> Tuple:
    """Everything a caller can observe of m, for before/after comparisons."""
    m.check()
    d = m.describe(live, max_blocks=16)
    return (m.stats(), d.block_table.tolist(), d.seq_lens.tolist(), d.slot_mapping.tolist())


class Unchanged:
    """with Unchanged(m, live): ... asserts that the block changed nothing."""

    def __init__(self, m: kvplug.Manager, live: List[int]) -> None:
        self.m, self.live = m, live

    def __enter__(self) -> "Unchanged":
        self.before = snapshot(self.m, self.live)
        return self

    def __exit__(self, *exc) -> None:
        assert snapshot(self.m, self.live) == self.before, "a failed call changed the manager"


@pytest.fixture
def unchanged(mgr):
    return lambda live=(1, 2, 3): Unchanged(mgr, list(live))


def ids(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def row_segments(*bufs: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The (ptrs, lens) arrays the stores' put/get/read/write take, of shape
    [n, len(bufs)]: key i's segment j is row i of bufs[j] (each [n, bytes]
    with contiguous rows). One buffer is one segment per key; a K and a V buffer
    are SGLang's page_first layout, two segments at two addresses."""
    n = bufs[0].shape[0]
    rows = np.arange(n, dtype=np.uint64)
    ptrs = np.stack([b.ctypes.data + rows * np.uint64(b.strides[0]) for b in bufs], axis=1)
    lens = np.stack([np.full(n, b.shape[1] * b.itemsize, np.int64) for b in bufs], axis=1)
    return ptrs, lens


def free_port() -> int:
    """A loopback TCP port that was free when the OS picked it (released at
    once): for a server to bind, or for an address that must refuse
    connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary() -> str:
    """valkey-server or redis-server, whichever is on PATH; the calling
    test is skipped when neither is installed (CI installs redis-server)."""
    import shutil

    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        pytest.skip("neither valkey-server nor redis-server is installed")
    return binary


@pytest.fixture
def valkey_server(tmp_path) -> Iterator[str]:
    """A throwaway valkey-server or redis-server on a free loopback port,
    without persistence; yields its host:port (as internal/redistest does
    for the Go tests). Skipped when neither is installed (CI installs
    redis-server)."""
    import subprocess
    import time

    binary = server_binary()
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"{binary} did not start on port {port}")
            time.sleep(0.02)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
