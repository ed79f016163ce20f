"""gputest's decisions, on stand-ins for torch and the device nodes: runs
anywhere, no GPU needed."""

import types

import pytest
import torch

import gputest


def fake_torch(available, cuda_version="13.0", init_error=None, count=0):
    def init():
        if init_error:
            raise RuntimeError(init_error)

    cuda = types.SimpleNamespace(is_available=lambda: available, init=init, device_count=lambda: count)
    return types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda=cuda_version), __version__="2.11.0")


@pytest.mark.parametrize("nodes,t,usable,absent", [
    ([], fake_torch(False, init_error="Found no NVIDIA driver"), False, True),
    ([], fake_torch(False), False, True),                               # a driver, no device
    ([], fake_torch(False, cuda_version=None), False, True),            # CPU torch, no device
    (["/dev/nvidia0"], fake_torch(False, init_error="CUDA driver version is insufficient"), False, False),
    (["/dev/nvidia0"], fake_torch(False, cuda_version=None), False, False),  # CPU torch on a GPU machine
    (["/dev/nvidia0"], fake_torch(True, count=1), True, False),
])
def test_probe(monkeypatch, nodes, t, usable, absent):
    monkeypatch.setattr(gputest, "device_nodes", lambda: nodes)
    reason, is_absent = gputest.probe(t)
    assert (reason is None) == usable and is_absent == absent, reason


def test_cuda_usable_skips_nothing_and_fails_when_broken_or_required(monkeypatch):
    monkeypatch.delenv(gputest.REQUIRE_ENV, raising=False)
    monkeypatch.setattr(gputest, "device_nodes", lambda: [])
    assert gputest.cuda_usable(fake_torch(False)) is False
    monkeypatch.setenv(gputest.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="KVPLUG_REQUIRE_GPU=1"):
        gputest.cuda_usable(fake_torch(False))
    monkeypatch.delenv(gputest.REQUIRE_ENV)
    monkeypatch.setattr(gputest, "device_nodes", lambda: ["/dev/nvidia0"])
    with pytest.raises(pytest.fail.Exception, match="/dev/nvidia0 exist"):
        gputest.cuda_usable(fake_torch(False, init_error="CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"))


def test_skip_fails_when_required(monkeypatch):
    monkeypatch.setenv(gputest.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="would skip: no Hopper"):
        gputest.skip("no Hopper")
    monkeypatch.setenv(gputest.REQUIRE_ENV, "0")
    with pytest.raises(pytest.skip.Exception):
        gputest.skip("no Hopper")


def test_row_err_finds_one_bad_short_row():
    want = torch.ones((64, 4, 8), dtype=torch.float64)
    got = want.clone()
    got[37, 0, 0] += 0.5  # one element of one row: 0.5 / sqrt(32) of that row, ~1e-3 of the batch
    err, row = gputest.row_err(got, want)
    assert row == 37 and err == pytest.approx(0.5 / 32 ** 0.5)
    whole = ((got - want).norm() / want.norm()).item()
    assert whole < err / 5
    zero = torch.zeros_like(want)
    got = zero.clone()
    got[3, 1, 1] = 1e-9  # a row whose reference is zero must be zero
    assert gputest.row_err(got, zero) == (float("inf"), 3)
    assert gputest.row_err(zero, zero) == (0.0, 0)
    got[5, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match=r"rows \[5\]"):
        gputest.row_err(got, zero)


@pytest.mark.parametrize("window,sinks", [(-1, False), (0, False), (3, False), (5, True), (100, True)])
def test_window_reference_against_each_row(window, sinks):
    """The windowed tests' reference (on the CPU) against attention computed
    row by row over the positions each row sees, with GQA 4:2, a sequence
    with no new rows, and sinks."""
    gen = torch.Generator().manual_seed(11 + window)
    qh, kvh, D, lens, q_lens = 4, 2, 8, [9, 5, 12], [3, 0, 12]
    ks = [torch.rand((L + 2, kvh, D), generator=gen, dtype=torch.float64) * 4 - 2 for L in lens]  # rows past L unread
    vs = [torch.rand((L + 2, kvh, D), generator=gen, dtype=torch.float64) * 4 - 2 for L in lens]
    q = torch.rand((sum(q_lens), qh, D), generator=gen, dtype=torch.float64) * 4 - 2
    qo = [0, 3, 3, 15]
    sk = torch.rand(qh, generator=gen, dtype=torch.float64) * 4 - 2 if sinks else None
    out, lse = gputest.window_reference(q, ks, vs, lens, qo, window, scale=0.3, sinks=sk)
    assert out.dtype == lse.dtype == torch.float64 and out.shape == q.shape and lse.shape == (15, qh)
    for b, (L, n) in enumerate(zip(lens, q_lens)):
        for i in range(n):
            r, pos = qo[b] + i, L - n + i
            lo = 0 if window < 0 else max(0, pos - window)
            k = ks[b][lo:pos + 1].repeat_interleave(2, dim=1)  # [seen, qh, D]
            v = vs[b][lo:pos + 1].repeat_interleave(2, dim=1)
            s = torch.einsum("hd,lhd->hl", q[r], k) * 0.3
            if sinks:
                s = torch.cat([s, sk[:, None]], dim=1)
            p = torch.softmax(s, dim=1)[:, :pos + 1 - lo]
            assert torch.allclose(lse[r], torch.logsumexp(s, dim=1), atol=1e-12), (b, i)
            assert torch.allclose(out[r], torch.einsum("hl,lhd->hd", p, v), atol=1e-12), (b, i)
    if 0 <= window < 11:  # the last sequence's last row sees fewer tokens than without the window
        whole, _ = gputest.window_reference(q, ks, vs, lens, qo, -1, scale=0.3, sinks=sk)
        assert (out[14] - whole[14]).abs().max() > 1e-3


class FakeCuda:
    """The stream and graph calls of torch.cuda that capture makes, as a log."""

    def __init__(self):
        self.log = []
        log = self.log

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                log.append(("wait", self.name, other.name))

        class Graph:
            def __init__(self, g, stream):
                self.g, self.stream = g, stream

            def __enter__(self):
                log.append(("begin", self.g, self.stream.name))

            def __exit__(self, *exc):
                log.append(("end", self.g))

        self.Stream = Stream
        self.graph = Graph
        self.current_stream = lambda: Stream("current")
        self.CUDAGraph = lambda: "g"


@pytest.mark.parametrize("given", [False, True])
def test_capture(given):
    """capture: fn runs once, between the graph's begin and end, on a new side
    stream that first waits on the current one, or on the stream given (no
    wait: the caller orders it)."""
    cuda = FakeCuda()
    t = types.SimpleNamespace(cuda=cuda)
    stream = cuda.Stream("given") if given else None
    g = gputest.capture(t, lambda: cuda.log.append(("launch",)), stream)
    assert g == "g"
    name = "given" if given else "side"
    want = [] if given else [("wait", "side", "current")]
    assert cuda.log == want + [("begin", "g", name), ("launch",), ("end", "g")]
