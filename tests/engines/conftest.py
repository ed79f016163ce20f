"""Shared fixtures of the engine conformance tests (make test-engines):
a throwaway valkey-server or redis-server, and the harness directories on
sys.path. The library comes from KVPLUG_LIBRARY."""

from __future__ import annotations

import pathlib
import shutil
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

HERE = pathlib.Path(__file__).resolve().parent
for sub in ("vllm", "sglang"):
    if str(HERE / sub) not in sys.path:
        sys.path.insert(0, str(HERE / sub))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def valkey(tmp_path) -> Iterator[str]:
    """host:port of a fresh server (skips when none is installed)."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        pytest.skip("neither valkey-server nor redis-server is installed")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.02)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
