"""Helpers of the GPU tests: whether one runs, skips or fails (the Python side
of internal/gputest), the capture of one launch in a CUDA graph, the
row-by-row comparison of outputs, and the float64 reference of windowed
attention, and the build of the C++ test programs with nvcc.

A test skips only on a machine with no NVIDIA device: no /dev/nvidiaN (nor
WSL's /dev/dxg) and torch finding no CUDA device. Where a device node exists,
torch failing to reach it (a broken or mismatched driver, a torch built
without CUDA) fails the test, since a skip there would hide the breakage
behind a green run. KVPLUG_REQUIRE_GPU=1, set on the GPU machine, turns every
skip of a GPU test into a failure, so that such a run cannot pass without
running them.

    from gputest import cuda_torch
    torch = cuda_torch()  # at module level: skips or fails the module
    g = capture(torch, lambda: attn.paged_decode(...))  # a CUDA graph of one launch
    exe = build_cpp("examples/gpu_step.cpp", tmp / "gpu_step")  # nvcc, against kvplug.hpp
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import pytest

REQUIRE_ENV = "KVPLUG_REQUIRE_GPU"
CPU_TESTS = pathlib.Path(__file__).resolve().parents[1] / "python"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def cpu_test_module(name: str) -> Any:
    """tests/python/<name>.py (a CPU test module whose harness a GPU test
    reuses) as the module cpu_<name>: tests/gpu has modules of the same
    names, which a plain import would find first. tests/python goes on
    sys.path for the harness's own imports."""
    if str(CPU_TESTS) not in sys.path:
        sys.path.insert(0, str(CPU_TESTS))
    key = f"cpu_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, CPU_TESTS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def device_nodes() -> List[str]:
    """The device files a GPU is reached through. /dev/nvidiactl and
    /dev/nvidia-uvm are left out: they exist wherever the kernel module is
    loaded, GPU or not."""
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if os.path.exists("/dev/dxg"):
        nodes.append("/dev/dxg")
    return nodes


def skip(reason: str, module: bool = False) -> None:
    """Skips for a reason only a GPU test has (no device, a device of
    another architecture), or fails under KVPLUG_REQUIRE_GPU=1."""
    if required():
        pytest.fail(f"{REQUIRE_ENV}=1, but this GPU test would skip: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def probe(torch: Any) -> Tuple[Optional[str], bool]:
    """(None, False) when torch can use a CUDA device; else why not, and
    whether the reason is that the machine has no NVIDIA device."""
    if torch.cuda.is_available():
        return None, False
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is built without CUDA"
    else:
        try:
            torch.cuda.init()
            why = f"torch finds {torch.cuda.device_count()} CUDA devices"
        except Exception as e:  # torch's own message says what failed
            why = f"torch cannot initialise CUDA: {e}"
    nodes = device_nodes()
    if nodes:
        return f"{', '.join(nodes)} exist, but {why}", False
    return f"no NVIDIA device on this machine (no /dev/nvidiaN; {why})", True


def import_torch() -> Any:
    """torch; a machine with no device may lack it (the module is skipped),
    one with a device must have it."""
    try:
        import torch
    except ImportError as e:
        nodes = device_nodes()
        if nodes:
            pytest.fail(f"{', '.join(nodes)} exist, but torch is not installed: {e}", pytrace=False)
        skip(f"no NVIDIA device on this machine and torch is not installed: {e}", module=True)
    return torch


def cuda_usable(torch: Any) -> bool:
    """True when torch can use a CUDA device, False on a machine with none
    (for modules whose CPU cases run anyway); fails the caller on any other
    CUDA error, and under KVPLUG_REQUIRE_GPU=1 when there is no device."""
    reason, absent = probe(torch)
    if reason is None:
        return True
    if absent and not required():
        return False
    if absent:
        reason = f"{REQUIRE_ENV}=1, but {reason}"
    pytest.fail(reason, pytrace=False)
    return False  # unreachable: pytest.fail raises


def cuda_torch() -> Any:
    """torch, when it can use a CUDA device. Called at module level: skips
    the module on a machine with no NVIDIA device, fails it otherwise."""
    torch = import_torch()
    reason, absent = probe(torch)
    if reason is None:
        return torch
    if absent:
        skip(reason, module=True)
    pytest.fail(reason, pytrace=False)


def capture(torch: Any, fn: Callable[[], Any], stream: Any = None) -> Any:
    """A CUDA graph of what fn() launches, captured on stream; stream None: on
    a new side stream that first waits on the current stream. Warm-up runs and
    attn.prepare() stay with the caller. Returns the graph, for g.replay()."""
    if stream is None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g


def nvcc(what: str) -> str:
    """The nvcc that builds a C++ test program: $NVCC, else nvcc on PATH,
    /usr/local/cuda/bin/nvcc or the copy kernels/build.sh installs into
    .tools/cuda. A GPU machine without one fails the caller, whose program
    (what) would otherwise go unchecked."""
    found = [os.environ.get("NVCC", ""), shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc",
             *sorted(glob.glob(str(ROOT / ".tools/cuda/lib/python*/site-packages/nvidia/cu*/bin/nvcc")))]
    for p in found:
        if p and os.access(p, os.X_OK):
            return p
    pytest.fail(f"no nvcc found ($NVCC, PATH, /usr/local/cuda/bin, .tools/cuda): {what} cannot be built")


def build_cpp(source: str, exe: str | os.PathLike) -> str:
    """Builds source (a C++17 program, its path relative to the repository
    root) with nvcc against include/kvplug.h and bindings/cpp/kvplug.hpp
    into exe, linking the CUDA runtime and libdl (kvplug.hpp loads the
    library at run time: KVPLUG_LIBRARY). Fails the caller with nvcc's
    output when it does not build; returns exe's path."""
    compiler = nvcc(source)
    exe = str(exe)
    cmd = [compiler, "-std=c++17", f"-I{ROOT / 'include'}", f"-I{ROOT / 'bindings/cpp'}", str(ROOT / source),
           "-o", exe, "-ldl"]
    # The PyPI nvcc keeps the CUDA runtime beside its bin folder, where its own link line does not look.
    lib = pathlib.Path(compiler).resolve().parent.parent / "lib"
    if lib.is_dir():
        cmd.append(f"-L{lib}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"
    return exe


def row_err(got: Any, want: Any) -> Tuple[float, int]:
    """The largest relative L2 error of one row of got against want (rows:
    dim 0, one query token's heads), and that row, so that one bad short row
    shows however long the rest of the batch is. A row whose reference is
    zero (an empty sequence) must be zero; NaN anywhere (an unwritten,
    poisoned element) fails."""
    assert tuple(got.shape) == tuple(want.shape), f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    g = got.detach().cpu().double().reshape(got.shape[0], -1)
    w = want.detach().cpu().double().reshape(want.shape[0], -1)
    nan = g.isnan().any(dim=1).nonzero().flatten().tolist()
    assert not nan, f"rows {nan[:16]} hold NaN (unwritten elements)"
    if g.shape[0] == 0:
        return 0.0, -1
    num, den = (g - w).norm(dim=1), w.norm(dim=1)
    err = num / den.clamp_min(1e-300)
    err[den == 0] = float("inf")
    err[(den == 0) & (num == 0)] = 0.0
    row = int(err.argmax())
    return float(err[row]), row


def check_rows(got: Any, want: Any, tol: float, what: str = "") -> None:
    """Asserts that every row of got is within tol of want (row_err)."""
    err, row = row_err(got, want)
    assert err < tol, f"{what}{': ' if what else ''}row {row}: relative error {err:.3g} above {tol:.1g}"


def window_reference(q: Any, ks: Sequence[Any], vs: Sequence[Any], kv_lens: Sequence[int], qo: Any, window: int = -1,
                     scale: Optional[float] = None, sinks: Any = None) -> Tuple[Any, Any]:
    """float64 windowed attention of the varlen rows q ([total_q, qh, D]):
    sequence b's rows q[qo[b]:qo[b+1]] (q_len n) sit at positions [L - n, L),
    L = kv_lens[b], and the row at position p sees tokens
    [max(0, p - window), p] of ks[b][:L] / vs[b][:L] ([>= L, kvh, D]; window
    -1: [0, p]); sinks: one logit per q head in every row's softmax
    denominator (gpt-oss). Returns (out [total_q, qh, D], lse [total_q, qh])
    on q's device."""
    import torch  # here, not at the top: this module decides whether torch is usable

    T, qh, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros((T, qh, D), dtype=torch.float64, device=q.device)
    lse = torch.full((T, qh), float("-inf"), dtype=torch.float64, device=q.device)
    for b, L in enumerate(kv_lens):
        r0, r1 = int(qo[b]), int(qo[b + 1])
        n = r1 - r0
        if n == 0:
            continue
        g = qh // ks[b].shape[1]
        k = ks[b][:L].to(q.device).double().repeat_interleave(g, dim=1)  # [L, qh, D]
        v = vs[b][:L].to(q.device).double().repeat_interleave(g, dim=1)
        s = torch.einsum("ihd,thd->hit", q[r0:r1].double(), k) * scale   # [qh, n, L]
        pos = torch.arange(L - n, L, device=q.device)[:, None]
        t = torch.arange(L, device=q.device)[None, :]
        mask = t <= pos
        if window >= 0:
            mask &= t >= pos - window
        s = s.masked_fill(~mask[None], float("-inf"))
        if sinks is not None:  # a last column of every row, in the denominator only
            s = torch.cat([s, sinks.to(q.device).double()[:, None, None].expand(qh, n, 1)], dim=-1)
        lse[r0:r1] = torch.logsumexp(s, dim=-1).transpose(0, 1)
        out[r0:r1] = torch.einsum("hit,thd->ihd", torch.softmax(s, dim=-1)[..., :L], v)
    return out, lse
