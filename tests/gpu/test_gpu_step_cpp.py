"""examples/gpu_step.cpp, one engine step from C++ through kvplug.hpp, built
with nvcc and run in each of its modes: the 16-bit cache, an e4m3 cache
with one scale per (token, kv head), and an e4m3 cache with one scale for
K and one for V. In the e4m3 modes it runs every kernel route that reads
the cache (both prefill mainloops, FP8 Q/K/V, decode with and without
split-KV, a prefill plan's decode route, shared-prefix attention) and
checks each against float64 over the dequantised cache; it exits 0 and
prints "ok" only when every route passed.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python -m pytest -q tests/gpu/test_gpu_step_cpp.py

nvcc: $NVCC, else nvcc on PATH, /usr/local/cuda/bin/nvcc or the copy
kernels/build.sh installs into .tools/cuda (gputest.nvcc). A GPU machine
without one fails the test (the C++ routes would go unchecked)."""

from __future__ import annotations

import os
import subprocess

import pytest
from gputest import build_cpp, cuda_torch

from kvplug import _lib

torch = cuda_torch()


@pytest.fixture(scope="module")
def gpu_step(tmp_path_factory) -> str:
    return build_cpp("examples/gpu_step.cpp", tmp_path_factory.mktemp("gpu_step") / "gpu_step")


@pytest.mark.parametrize("mode", [[], ["--kv-dtype", "e4m3"], ["--kv-dtype", "e4m3", "--kv-scale", "tensor"]],
                         ids=["f16", "e4m3-token-head", "e4m3-tensor"])
def test_gpu_step(gpu_step, mode):
    env = dict(os.environ, KVPLUG_LIBRARY=_lib.library_path())
    r = subprocess.run([gpu_step, *mode], capture_output=True, text=True, timeout=600, env=env)
    print(r.stdout, r.stderr)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines and lines[-1] == "ok", f"exit {r.returncode}:\n{r.stdout}{r.stderr}"
    assert "no CUDA device" not in r.stdout
    if mode:
        # Every route line passed, and the FP8 routes ran (not one of them failed to plan).
        assert "MISMATCH" not in r.stdout and "FAILED" not in r.stdout, r.stdout
        if torch.cuda.get_device_capability() == (9, 0):
            assert "skipped" not in r.stdout, r.stdout  # FP8 Q/K/V runs on Hopper


def test_gpu_step_refuses_a_bad_command_line(gpu_step):
    r = subprocess.run([gpu_step, "--kv-dtype", "e5m2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr, (r.returncode, r.stdout, r.stderr)
