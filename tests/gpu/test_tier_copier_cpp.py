"""tests/gpu/tier_copier_gpu.cpp, the C++ tier copier (kvplug::TierCopier
over per-layer kvp_paged_kv descriptors) on the GPU, built with nvcc and
run: blocks of a 3-layer paged cache (f16, and e4m3 with per-(token, kv
head) scales; three GPU layouts) are demoted into pinned host slots by the
tier copy kernel and by the copy engines, poisoned on the GPU and reloaded
into other blocks, and every byte of the cache and the slots is compared
with the header's layout. It prints one line per case and exits 0 with "ok"
only when every case passed; a copy-engine copier that the library answers
UNSUPPORTED fails its case.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python -m pytest -q tests/gpu/test_tier_copier_cpp.py

The cache's bytes come from the test's seed (conftest.py), passed as
--seed. nvcc: as gputest.nvcc finds it; a GPU machine without one fails the
test."""

from __future__ import annotations

import os
import subprocess

import pytest
from gputest import build_cpp, cuda_torch

from kvplug import _lib

cuda_torch()  # skips the module on a machine with no NVIDIA device, fails it where CUDA is broken

# 2 cache formats x 3 GPU layouts x 2 store engines.
CASES = 12


@pytest.fixture(scope="module")
def tier_copier_gpu(tmp_path_factory) -> str:
    return build_cpp("tests/gpu/tier_copier_gpu.cpp", tmp_path_factory.mktemp("tier_copier_gpu") / "tier_copier_gpu")


def test_tier_copier_cpp(tier_copier_gpu, seed):
    env = dict(os.environ, KVPLUG_LIBRARY=_lib.library_path())
    r = subprocess.run([tier_copier_gpu, "--seed", str(seed)], capture_output=True, text=True, timeout=600, env=env)
    print(r.stdout, r.stderr)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines and lines[-1] == "ok", f"exit {r.returncode}:\n{r.stdout}{r.stderr}"
    # Every case ran and passed, the copy engines' included.
    passed = [line for line in lines if line.endswith(": ok")]
    assert len(passed) == CASES and sum("copy-engine" in line for line in passed) == CASES // 2, r.stdout
    assert "FAILED" not in r.stdout, r.stdout


def test_tier_copier_cpp_refuses_a_bad_command_line(tier_copier_gpu):
    r = subprocess.run([tier_copier_gpu, "--seed", "x"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr, (r.returncode, r.stdout, r.stderr)
