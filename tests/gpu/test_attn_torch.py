"""GPU tests of kvplug.attn on torch CUDA tensors, through libkvplug's C ABI.

Each test draws fresh random inputs, poisons outputs with NaN, and compares
with a float64 torch reference (attention over each sequence's contiguous
K and V). Run on a GPU machine with the library built:

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \
        python3 -m pytest -q tests/gpu/test_attn_torch.py

Skips only on a machine with no NVIDIA device, and fails under
KVPLUG_REQUIRE_GPU=1 (tests/gpu/gputest.py).
"""

import itertools
import math
import zlib

import pytest

from gputest import capture, check_rows, cuda_torch, window_reference  # noqa: E402  (tests/gpu: skips only where there is no NVIDIA device)

torch = cuda_torch()

import kvplug  # noqa: E402
from kvplug import attn  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


class Paged:
    """A random batch: logical K/V per sequence, a paged cache filled by
    attn.kv_write through a shuffled block allocation, and its block table.
    combined: K and V are views of one [num_blocks, 2, bs, kvh, D] tensor
    (a block stride of twice the block), as engines with one KV tensor
    per layer hold them."""

    def __init__(self, gen, dtype, D, qh, kvh, bs, lens, combined=False):
        self.dtype, self.D, self.qh, self.kvh, self.bs, self.lens = dtype, D, qh, kvh, bs, lens
        nblk = [math.ceil(L / bs) for L in lens]
        self.num_blocks = sum(nblk) + 2
        self.max_blocks = max(max(nblk), 1)
        perm = torch.randperm(self.num_blocks, generator=gen).tolist()
        table = torch.full((len(lens), self.max_blocks + 1), -7, dtype=torch.int32)
        slots, nxt = [], 0
        for b, L in enumerate(lens):
            for c in range(nblk[b]):
                table[b, c] = perm[nxt]
                nxt += 1
            slots += [int(table[b, t // bs]) * bs + t % bs for t in range(L)]
        self.table = table.to(DEV)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        total = sum(lens)
        self.k = (torch.rand((total, kvh, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
        self.v = (torch.rand((total, kvh, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
        if combined:
            kv = torch.full((self.num_blocks, 2, bs, kvh, D), float("nan"), dtype=dtype, device=DEV)
            self.k_cache, self.v_cache = kv[:, 0], kv[:, 1]
        else:
            shape = (self.num_blocks, bs, kvh, D)
            self.k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
            self.v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
        self.slots = torch.tensor(slots, dtype=torch.int32, device=DEV)
        attn.kv_write(self.k, self.v, self.k_cache, self.v_cache, self.slots)
        self.q = (torch.rand((len(lens), qh, D), generator=gen) * 4 - 2).to(dtype).to(DEV)

    def reference(self, scale, q=None, q_len=1, lens=None, keep=None):
        """float64 attention of q ([batch * q_len, qh, D]; default self.q):
        sequence b's new token t sits at position L - q_len + t and sees
        positions [0, that position], L = lens[b] (default self.lens: the
        first lens[b] of the sequence's self.lens[b] written tokens); of
        those, only the positions keep[b] (bool [L]) holds, when given."""
        q = self.q if q is None else q
        lens = self.lens if lens is None else lens
        B = len(lens)
        out = torch.zeros((B * q_len, self.qh, self.D), dtype=torch.float64, device=DEV)
        lse = torch.full((B * q_len, self.qh), float("-inf"), dtype=torch.float64, device=DEV)
        g = self.qh // self.kvh
        start = 0
        for b, (L, written) in enumerate(zip(lens, self.lens)):
            k = self.k[start:start + L].double().repeat_interleave(g, dim=1)  # [L, qh, D]
            v = self.v[start:start + L].double().repeat_interleave(g, dim=1)
            for t in range(q_len):
                end = L - q_len + t + 1
                kk, vv = (k[:end], v[:end]) if end > 0 else (k[:0], v[:0])
                if keep is not None and end > 0:
                    kk, vv = kk[keep[b][:end]], vv[keep[b][:end]]
                if kk.shape[0] > 0:
                    r = b * q_len + t
                    s = torch.einsum("hd,lhd->hl", q[r].double(), kk) * scale
                    lse[r] = torch.logsumexp(s, dim=1)
                    out[r] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=1), vv)
            start += written
        return out, lse


def ragged(gen, batch, bs, max_len):
    lens = [0, 1, bs, min(bs + 1, max_len), max_len][:batch]
    lens += torch.randint(0, max_len + 1, (batch - len(lens),), generator=gen).tolist()
    return lens


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("bs", [1, 16, 64, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode(dtype, D, bs, group, seed):
    gen = torch.Generator().manual_seed(seed)
    p = Paged(gen, dtype, D, 2 * group, 2, bs, ragged(gen, 6, bs, 700), combined=bs != 16)
    ws = torch.empty(attn.workspace_size(6, 2 * group, D), dtype=torch.uint8, device=DEV)
    out = torch.full_like(p.q, float("nan"))
    lse = torch.full((6, 2 * group), float("nan"), dtype=torch.float32, device=DEV)
    scale = 1 / math.sqrt(D)
    attn.paged_decode(p.q, p.k_cache, p.v_cache, p.table, p.seq_lens, out=out, lse=lse,
                      workspace=ws, max_seq_len=max(p.lens))
    torch.cuda.synchronize()
    want, want_lse = p.reference(scale)
    check_rows(out, want, TOL[dtype])
    empty = want_lse.isinf()
    assert torch.isneginf(lse[empty]).all()
    assert torch.allclose(lse[~empty].double(), want_lse[~empty], rtol=1e-3, atol=1e-3)


def decode_and_check(p, splits, table=None, keep=None):
    """paged_decode of p.q into poisoned out and lse with splits (0: the
    library's choice), against the float64 reference, row by row."""
    B, qh = p.q.shape[0], p.q.shape[1]
    ws = torch.empty(attn.workspace_size(B, qh, p.D, 8), dtype=torch.uint8, device=DEV)
    out = torch.full_like(p.q, float("nan"))
    lse = torch.full((B, qh), float("nan"), dtype=torch.float32, device=DEV)
    attn.paged_decode(p.q, p.k_cache, p.v_cache, p.table if table is None else table, p.seq_lens, out=out, lse=lse,
                      workspace=ws, num_splits=splits, max_seq_len=max(max(p.lens), 1))
    torch.cuda.synchronize()
    want, want_lse = p.reference(1 / math.sqrt(p.D), keep=keep)
    check_rows(out, want, TOL[p.dtype], f"splits {splits}")
    empty = want_lse.isinf()
    assert torch.isneginf(lse[empty]).all()
    assert torch.allclose(lse[~empty].double(), want_lse[~empty], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [3, 20, 32])
def test_paged_decode_odd_groups(dtype, group, seed):
    """Groups that are not powers of two or exceed one tile's 16 q heads."""
    gen = torch.Generator().manual_seed(seed)
    p = Paged(gen, dtype, 128, 2 * group, 2, 16, [5, 200, 0, 77])
    decode_and_check(p, 1)
    decode_and_check(p, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs", [1, 16, 48])
def test_paged_decode_ignores_bad_table_entries(dtype, bs, seed):
    """Block ids outside [0, num_blocks) inside a sequence, and table columns
    at or past max_blocks_per_seq (a table narrower than the sequences),
    are skipped: their tokens are left out, and nothing faults."""
    gen = torch.Generator().manual_seed(seed)
    lens = [3 * bs + 5, 2 * bs + 1, bs, 0]
    p = Paged(gen, dtype, 64, 8, 2, bs, lens)
    table = p.table.clone()
    nblk = [math.ceil(L / bs) for L in lens]
    keep = [torch.ones(L, dtype=torch.bool, device=DEV) for L in lens]
    for b, n in enumerate(nblk):
        if n >= 2:  # the second block of the sequence: past the pool's end, or negative
            table[b, 1] = p.num_blocks + 3 if b % 2 else -5
            keep[b][bs:2 * bs] = False
    cols = max(1, max(nblk) - 1)  # one column short of the longest sequence
    for b in range(len(lens)):
        keep[b][cols * bs:] = False
    narrow = table[:, :cols]  # a view: the row stride stays the full table's
    assert narrow.stride(0) > cols
    decode_and_check(p, 1, narrow, keep)
    decode_and_check(p, 2, narrow, keep)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("bs", [1, 16, 64, 256])
def test_kv_write_exact(dtype, D, bs, seed):
    """kv_write from strided K and V (slices of a fused [tokens, 3, heads,
    D] QKV buffer) into one combined cache [blocks, 2, bs, heads, D]: each
    token's slot holds its bytes exactly, padding slots (-1) and slots past
    the pool are skipped, and every other byte is left as it was."""
    gen = torch.Generator().manual_seed(seed)
    heads, ntok = 3, 45
    num_blocks = math.ceil(2 * ntok / bs) + 2
    qkv = (torch.rand((ntok, 3, heads, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:ntok].to(torch.int32)
    slots[torch.randperm(ntok, generator=gen)[:5]] = -1
    slots[0] = num_blocks * bs + 7
    cache = (torch.rand((num_blocks, 2, bs, heads, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
    want = cache.clone()
    attn.kv_write(qkv[:, 1], qkv[:, 2], cache[:, 0], cache[:, 1], slots.to(DEV))
    torch.cuda.synchronize()
    ok = ((slots >= 0) & (slots < num_blocks * bs)).to(DEV)
    s = slots.to(DEV).long()[ok]
    want[s // bs, 0, s % bs] = qkv[ok, 1]
    want[s // bs, 1, s % bs] = qkv[ok, 2]
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_merge_states_reference(dtype, D, n, seed):
    """merge_states of n states with empty (-inf) entries, a token empty in
    every state, into views of wider poisoned buffers: the merge against
    float64, out 0 and lse -inf where every state is empty, and the
    buffers' columns past the views left unwritten."""
    gen = torch.Generator().manual_seed(seed)
    T, H = 9, 5
    vs = [(torch.rand((T, H, D), generator=gen) * 4 - 2).to(dtype) for _ in range(n)]
    ss = [torch.randn((T, H), generator=gen) * 4 for _ in range(n)]
    for st in ss:
        st[torch.rand((T, H), generator=gen) < 0.2] = float("-inf")
        st[1, 2] = float("-inf")  # token 1, head 2: empty everywhere
    ss[0][0, :] = float("-inf")
    S = torch.stack(ss).double()  # [n, T, H]
    want_lse = torch.logsumexp(S, dim=0)
    w = torch.softmax(S, dim=0).nan_to_num(0.0)  # an all -inf column is NaN: weight 0
    want = (w[..., None] * torch.stack([v.double() for v in vs])).sum(0)
    out_buf = torch.full((T, H, D + 8), float("nan"), dtype=dtype, device=DEV)
    lse_buf = torch.full((T, H + 1), float("nan"), dtype=torch.float32, device=DEV)
    attn.merge_states([v.to(DEV) for v in vs], [st.to(DEV) for st in ss], out=out_buf[..., :D], out_lse=lse_buf[:, :H])
    torch.cuda.synchronize()
    check_rows(out_buf[..., :D], want, TOL[dtype])
    assert out_buf[..., D:].isnan().all(), "out's row padding was written"
    assert lse_buf[:, H].isnan().all(), "out_lse's row padding was written"
    lse = lse_buf[:, :H].cpu().double()
    empty = want_lse.isneginf()
    assert empty[1, 2] and torch.equal(lse.isneginf(), empty)
    assert (out_buf[1, 2, :D] == 0).all()
    assert torch.allclose(lse[~empty], want_lse[~empty], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 7, 0])
def test_paged_decode_splits_long(splits, seed):
    gen = torch.Generator().manual_seed(seed)
    p = Paged(gen, torch.bfloat16, 128, 32, 8, 16, [4000, 3, 0, 2100])
    ws = torch.empty(attn.workspace_size(4, 32, 128, 8), dtype=torch.uint8, device=DEV)
    out = torch.full_like(p.q, float("nan"))
    lse = torch.full((4, 32), float("nan"), dtype=torch.float32, device=DEV)
    attn.paged_decode(p.q, p.k_cache, p.v_cache, p.table, p.seq_lens, out=out, lse=lse, workspace=ws,
                      num_splits=splits)
    want, want_lse = p.reference(1 / math.sqrt(128))
    check_rows(out, want, TOL[torch.bfloat16])
    finite = ~want_lse.isinf()
    assert torch.isneginf(lse[~finite]).all()
    assert torch.allclose(lse[finite].double(), want_lse[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("q_len", [2, 3, 4, 7, 16])
@pytest.mark.parametrize("dtype,D,bs,group", [
    (torch.float16, 128, 16, 4), (torch.bfloat16, 64, 1, 8), (torch.bfloat16, 256, 64, 1),
    (torch.float16, 128, 256, 2), (torch.float32, 128, 16, 4),
])
@pytest.mark.parametrize("splits", [1, 3, 0])
def test_paged_decode_multi_token(q_len, dtype, D, bs, group, splits, seed):
    """q_len new tokens per sequence (speculative verification, multi-token
    prediction): causal among them, every split count, lse."""
    gen = torch.Generator().manual_seed(seed)
    lens = [q_len, q_len + 1, 700, 64 * 3 + q_len, 1500]
    p = Paged(gen, dtype, D, 2 * group, 2, bs, lens)
    B = len(lens)
    q = (torch.rand((B * q_len, 2 * group, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
    ws = torch.empty(attn.workspace_size(B * q_len, 2 * group, D, 8), dtype=torch.uint8, device=DEV)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B * q_len, 2 * group), float("nan"), dtype=torch.float32, device=DEV)
    attn.paged_decode(q, p.k_cache, p.v_cache, p.table, p.seq_lens, out=out, lse=lse, workspace=ws,
                      num_splits=splits, max_seq_len=max(lens), q_len=q_len)
    torch.cuda.synchronize()
    want, want_lse = p.reference(1 / math.sqrt(D), q, q_len)
    check_rows(out, want, TOL[dtype])
    assert torch.allclose(lse.double(), want_lse, rtol=1e-3, atol=1e-3)


def test_paged_decode_multi_token_errors():
    gen = torch.Generator().manual_seed(1)
    p = Paged(gen, torch.float16, 128, 8, 2, 16, [40, 50])
    q = torch.zeros((6, 8, 128), dtype=torch.float16, device=DEV)
    for bad in (0, 4, 17):  # 6 rows: q_len 4 leaves a remainder; 0 and 17 are out of range
        with pytest.raises(kvplug.InvalidArgumentError):
            attn.paged_decode(q, p.k_cache, p.v_cache, p.table, p.seq_lens, q_len=bad)
    with pytest.raises(kvplug.InvalidArgumentError):  # 6 rows of 2 tokens: 3 sequences, 2 in the table
        attn.paged_decode(q, p.k_cache, p.v_cache, p.table, p.seq_lens, q_len=2)


def test_merge_states_equals_whole(seed):
    gen = torch.Generator().manual_seed(seed)
    whole = Paged(gen, torch.float32, 128, 8, 2, 16, [300])
    # Cut the sequence in three parts that share the query.
    cuts = [0, 90, 90, 300]  # the middle part is empty
    outs, lses = [], []
    for i in range(3):
        lo, hi = cuts[i], cuts[i + 1]
        k_cache = torch.zeros((max(math.ceil((hi - lo) / 16), 1), 16, 2, 128), device=DEV)
        v_cache = torch.zeros_like(k_cache)
        n = hi - lo
        slots = torch.arange(n, dtype=torch.int32, device=DEV)
        attn.kv_write(whole.k[lo:hi], whole.v[lo:hi], k_cache, v_cache, slots)
        table = torch.arange(k_cache.shape[0], dtype=torch.int32, device=DEV)[None]
        lens = torch.tensor([n], dtype=torch.int32, device=DEV)
        o = torch.full_like(whole.q, float("nan"))
        s = torch.full(whole.q.shape[:2], float("nan"), dtype=torch.float32, device=DEV)
        attn.paged_decode(whole.q, k_cache, v_cache, table, lens, out=o, lse=s)
        outs.append(o)
        lses.append(s)
    assert torch.isneginf(lses[1]).all() and (outs[1] == 0).all(), "an empty part is out 0, lse -inf"
    merged = torch.full_like(whole.q, float("nan"))
    merged_lse = torch.full(whole.q.shape[:2], float("nan"), dtype=torch.float32, device=DEV)
    attn.merge_states(outs, lses, out=merged, out_lse=merged_lse)
    want, want_lse = whole.reference(1 / math.sqrt(128))
    check_rows(merged, want, 1e-5)
    assert torch.allclose(merged_lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_states_in_place(dtype):
    T, H, D = 33, 4, 64
    vs = [torch.rand((T, H, D), device=DEV).to(dtype) for _ in range(3)]
    ss = [torch.randn((T, H), device=DEV) * 3 for _ in range(3)]
    ss[1][0] = float("-inf")
    w = torch.softmax(torch.stack(ss).double(), dim=0)  # [3, T, H]
    want = (w[..., None] * torch.stack([v.double() for v in vs])).sum(0)
    want_lse = torch.logsumexp(torch.stack(ss).double(), dim=0)
    v0, s0 = vs[0].clone(), ss[0].clone()
    out, out_lse = attn.merge_states([v0] + vs[1:], [s0] + ss[1:], out=v0, out_lse=s0)
    assert out.data_ptr() == v0.data_ptr()
    check_rows(v0, want, TOL[dtype])
    assert torch.allclose(s0.double(), want_lse, rtol=1e-4, atol=1e-4)


def test_graph_capture(seed):
    gen = torch.Generator().manual_seed(seed)
    p = Paged(gen, torch.float16, 128, 32, 8, 16, [2000, 5, 700])
    ws = torch.empty(attn.workspace_size(3, 32, 128), dtype=torch.uint8, device=DEV)
    out = torch.empty_like(p.q)
    attn.prepare()
    g = capture(torch, lambda: attn.paged_decode(p.q, p.k_cache, p.v_cache, p.table, p.seq_lens, out=out, workspace=ws,
                                                 max_seq_len=2000))
    for _ in range(2):
        p.q.copy_((torch.rand(p.q.shape, generator=gen) * 4 - 2).to(p.q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        want, _ = p.reference(1 / math.sqrt(128))
        check_rows(out, want, TOL[torch.float16])


def test_graph_capture_multi_token(seed):
    """A captured q_len = 4 decode (speculative verification) replays over
    new queries and grown sequences: the lengths are read on the device, so
    a graph captured once serves every step of the same shape."""
    gen = torch.Generator().manual_seed(seed)
    Q = 4
    lens = [900, 40, 2000]
    p = Paged(gen, torch.bfloat16, 128, 32, 8, 16, lens)
    q = torch.empty((3 * Q, 32, 128), dtype=torch.bfloat16, device=DEV)
    ws = torch.empty(attn.workspace_size(3 * Q, 32, 128), dtype=torch.uint8, device=DEV)
    out = torch.empty_like(q)
    attn.prepare()
    g = capture(torch, lambda: attn.paged_decode(q, p.k_cache, p.v_cache, p.table, p.seq_lens, out=out, workspace=ws,
                                                 max_seq_len=2000, q_len=Q))
    for step in range(3):
        # Each step the sequences are shorter views of the same cache (the
        # accepted tokens of a verification differ): new lengths, new q.
        cut = [L - 7 * step for L in lens]
        p.seq_lens.copy_(torch.tensor(cut, dtype=torch.int32))
        q.copy_((torch.rand(q.shape, generator=gen) * 4 - 2).to(q.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        want, _ = p.reference(1 / math.sqrt(128), q, Q, lens=cut)  # the first cut[b] tokens of each
        check_rows(out, want, TOL[torch.bfloat16], f"step {step}")


def test_argument_errors():
    gen = torch.Generator().manual_seed(1)
    p = Paged(gen, torch.float16, 64, 4, 2, 16, [20, 5])
    with pytest.raises(kvplug.InvalidArgumentError):
        attn.paged_decode(p.q.float(), p.k_cache, p.v_cache, p.table, p.seq_lens)  # dtype mismatch
    with pytest.raises(kvplug.InvalidArgumentError):
        attn.paged_decode(p.q, p.k_cache, p.v_cache, p.table.long(), p.seq_lens)  # int64 table
    with pytest.raises(kvplug.InvalidArgumentError):
        attn.paged_decode(p.q.cpu(), p.k_cache, p.v_cache, p.table, p.seq_lens)  # host tensor
    with pytest.raises(kvplug.InvalidArgumentError):
        attn.paged_decode(p.q.transpose(1, 2).contiguous().transpose(1, 2), p.k_cache, p.v_cache, p.table, p.seq_lens)
    q3 = torch.zeros((2, 3, 64), dtype=torch.float16, device=DEV)
    with pytest.raises(kvplug.InvalidArgumentError):  # 3 q heads over 2 kv heads
        attn.paged_decode(q3, p.k_cache, p.v_cache, p.table, p.seq_lens)
    with pytest.raises(kvplug.BufferTooSmallError):
        attn.paged_decode(p.q, p.k_cache, p.v_cache, p.table, p.seq_lens, num_splits=4,
                          workspace=torch.empty(16, dtype=torch.uint8, device=DEV))
    k80 = torch.zeros((4, 16, 2, 80), dtype=torch.float16, device=DEV)
    with pytest.raises(kvplug.UnsupportedError):
        attn.paged_decode(torch.zeros((2, 4, 80), dtype=torch.float16, device=DEV), k80, k80.clone(),
                          p.table, p.seq_lens)
    # A failed call wrote nothing.
    out = torch.full_like(p.q, 5.0)
    with pytest.raises(kvplug.InvalidArgumentError):
        attn.paged_decode(p.q, p.k_cache, p.v_cache[:, :8], p.table, p.seq_lens, out=out)
    assert (out == 5.0).all()
    assert attn.cuda_available()
    assert attn.num_splits(torch.bfloat16, 128, 1, 32, 8, 4096) >= 1


# ---- decode with a sliding window; decode with no sequences ----------------

def dt_id(v):
    """Short test ids of dtypes (f16, bf16); None: pytest's own id."""
    names = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
    return names.get(v) if isinstance(v, torch.dtype) else None


def window_table(p, q_lens, window):
    """p's block table with every block that ends before the first position
    any of sequence b's q_lens[b] new tokens sees (L - q_len - window) set to
    -1, as a sliding-window layer group drops them: a kernel that read one
    would read nothing there, so the result shows whether the window was
    applied, not whether the dropped blocks happened to be masked."""
    t = p.table.clone().cpu()
    for b, (L, ql) in enumerate(zip(p.lens, q_lens)):
        first = L - ql - window
        for c in range(t.shape[1]):
            if (c + 1) * p.bs <= first:
                t[b, c] = -1
    return t.to(DEV)


@pytest.mark.parametrize("dtype,D,bs,group,q_len,window,splits,sinks", [
    (torch.float16, 128, 16, 4, 1, 40, 0, False),
    (torch.float16, 128, 16, 4, 1, 40, 5, True),
    (torch.bfloat16, 64, 1, 8, 1, 0, 0, False),     # token mode; each token sees itself only
    (torch.bfloat16, 128, 16, 4, 4, 100, 3, False),  # four new tokens, each its own window
    (torch.bfloat16, 128, 64, 1, 16, 63, 1, True),
    (torch.bfloat16, 256, 16, 2, 1, 5000, 0, False),  # a window over every token: no window
    (torch.float32, 128, 16, 4, 2, 33, 2, False),
], ids=dt_id)
def test_paged_decode_window(dtype, D, bs, group, q_len, window, splits, sinks, seed):
    """paged_decode(window_left=w): new token t of a sequence of length L
    (at position L - q_len + t) sees [pos - w, pos], against the float64
    reference, with the blocks before every new token's window dropped from
    the table (-1), forced and chosen splits, several new tokens, sinks,
    and f32; the window's lse too."""
    gen = torch.Generator().manual_seed(seed)
    lens = [q_len, bs + q_len, 41 + q_len, 700, 300, 129, 1000]
    B, kvh = len(lens), 2
    qh = group * kvh
    p = Paged(gen, dtype, D, qh, kvh, bs, lens, combined=True)
    q = (torch.rand((B * q_len, qh, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
    qo = torch.arange(B + 1, dtype=torch.int32) * q_len
    sk = (torch.rand(qh, generator=gen) * 4 - 2).to(DEV) if sinks else None
    table = window_table(p, [q_len] * B, window)
    ws = torch.empty(attn.workspace_size(B * q_len, qh, D, 8), dtype=torch.uint8, device=DEV)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B * q_len, qh), float("nan"), dtype=torch.float32, device=DEV)
    attn.paged_decode(q, p.k_cache, p.v_cache, table, p.seq_lens, out=out, lse=lse, workspace=ws,
                      num_splits=splits, max_seq_len=max(lens), q_len=q_len, sinks=sk, window_left=window)
    torch.cuda.synchronize()
    what = f"window_left {window}, {dtype}, D {D}, bs {bs}, group {group}, q_len {q_len}, splits {splits}"
    want, want_lse = window_reference(q, p.k.split(p.lens), p.v.split(p.lens), p.lens, qo, window, sinks=sk)
    check_rows(out, want, TOL[dtype], what)
    d = (lse.double() - want_lse).abs().amax(dim=1)
    assert float(d.max()) < 2e-3, f"{what}: lse of row {int(d.argmax())}: max abs error {float(d.max()):.3g}"
    if window >= max(lens):  # the whole sequence: the same as no window, through the full table
        plain = torch.full_like(q, float("nan"))
        attn.paged_decode(q, p.k_cache, p.v_cache, p.table, p.seq_lens, out=plain, max_seq_len=max(lens),
                          q_len=q_len, sinks=sk)
        torch.cuda.synchronize()
        check_rows(out, plain.double(), TOL[dtype], f"{what}: against no window")


@pytest.mark.parametrize("dtype,D,bs,window,q_lens", [
    (torch.float16, 128, 16, 40, [1] * 6),           # uniform: the decode route
    (torch.bfloat16, 64, 1, 0, [1] * 6),
    (torch.bfloat16, 128, 16, 90, [2] * 6),           # two new tokens x group 4: still the decode route
    (torch.bfloat16, 128, 16, 90, [1, 30, 1, 1, 200, 1]),  # mixed: prefill rows, decode rows
], ids=dt_id)
def test_windowed_decode_through_prefill_plan(dtype, D, bs, window, q_lens):
    """A windowed step planned with attn.prefill_plan(..., window_left=w):
    uniform short queries take the decode route (ROUTE_DECODE), a mixed
    batch the prefill kernel with its one-token rows on the decode kernel
    (decode_rows > 0); both against the windowed float64 reference, over a
    table with the blocks before every window dropped."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {D} {bs} {window} {q_lens}".encode()))
    lens = [1 + q_lens[0], bs + q_lens[1], 41 + q_lens[2], 700 + q_lens[3], 300 + q_lens[4], 77 + q_lens[5]]
    B, qh, kvh = len(lens), 8, 2
    p = Paged(gen, dtype, D, qh, kvh, bs, lens, combined=True)
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    total = int(qo[-1])
    q = (torch.rand((total, qh, D), generator=gen) * 4 - 2).to(dtype).to(DEV)
    ws = torch.empty(attn.prefill_workspace_size(B, total, qh, kvh, D), dtype=torch.uint8, device=DEV)
    plan = attn.prefill_plan(qo.to(DEV), p.seq_lens, qh, kvh, D, dtype, ws, window_left=window, qo_indptr_host=qo,
                             kv_lens_host=lens)
    what = f"window_left {window}, {dtype}, D {D}, block size {bs}, q_lens {q_lens} ({plan})"
    if len(set(q_lens)) == 1:
        assert plan.route == attn.ROUTE_DECODE, what
    else:
        assert plan.route == attn.ROUTE_PREFILL and plan.decode_rows == q_lens.count(1), what
    out = torch.full_like(q, float("nan"))
    lse = torch.full((total, qh), float("nan"), dtype=torch.float32, device=DEV)
    attn.paged_prefill(plan, q, p.k_cache, p.v_cache, window_table(p, q_lens, window), out=out, lse=lse)
    torch.cuda.synchronize()
    want, want_lse = window_reference(q, p.k.split(p.lens), p.v.split(p.lens), p.lens, qo, window)
    check_rows(out, want, TOL[dtype], what)
    d = (lse.double() - want_lse).abs().amax(dim=1)
    assert float(d.max()) < 2e-3, f"{what}: lse of row {int(d.argmax())}: max abs error {float(d.max()):.3g}"


def empty_decode(q_len, splits, gen):
    """Buffers of a decode call with batch 0: q, table, seq_lens, out and lse
    are zero-row views into real buffers (out and lse poisoned with NaN, so
    that a stray write shows), and a workspace holding a byte pattern."""
    p = Paged(gen, torch.bfloat16, 128, 8, 2, 16, [40, 17], combined=True)
    out_buf = torch.full((4 * q_len, 8, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    lse_buf = torch.full((4 * q_len, 8), float("nan"), dtype=torch.float32, device=DEV)
    ws = torch.full((attn.workspace_size(4 * q_len, 8, 128, 8),), 0xA5, dtype=torch.uint8, device=DEV)
    return p, out_buf, lse_buf, ws


@pytest.mark.parametrize("q_len,splits", [(1, 0), (1, 4), (3, 1)])
def test_paged_decode_empty_batch(q_len, splits, seed):
    """batch 0 (a step with no sequences): paged_decode returns OK and
    writes nothing, whatever the split count (a forced one too) and q_len:
    out, lse and the workspace keep their poison, the caches their bytes; the
    outputs it returns have zero rows. Fresh empty tensors (no storage) and
    out=None work too."""
    gen = torch.Generator().manual_seed(seed)
    p, out_buf, lse_buf, ws = empty_decode(q_len, splits, gen)
    cache0 = p.k_cache.clone().view(torch.int16), p.v_cache.clone().view(torch.int16)
    what = f"batch 0, q_len {q_len}, num_splits {splits}"
    out, lse = attn.paged_decode(p.q[:0], p.k_cache, p.v_cache, p.table[:0], p.seq_lens[:0], out=out_buf[:0],
                                 lse=lse_buf[:0], workspace=ws, num_splits=splits, max_seq_len=40, q_len=q_len,
                                 return_lse=True)
    torch.cuda.synchronize()
    assert tuple(out.shape) == (0, 8, 128) and tuple(lse.shape) == (0, 8), what
    assert out_buf.isnan().all(), f"{what}: out's buffer was written"
    assert lse_buf.isnan().all(), f"{what}: lse's buffer was written"
    assert (ws == 0xA5).all(), f"{what}: the workspace was written"
    for name, c, c0 in (("k_cache", p.k_cache, cache0[0]), ("v_cache", p.v_cache, cache0[1])):
        assert torch.equal(c.view(torch.int16), c0), f"{what}: {name} was written"
    # No storage behind q, the table, the lengths; out and lse allocated by the binding.
    q = torch.empty((0, 8, 128), dtype=torch.bfloat16, device=DEV)
    table = torch.empty((0, 3), dtype=torch.int32, device=DEV)
    lens = torch.empty((0,), dtype=torch.int32, device=DEV)
    out, lse = attn.paged_decode(q, p.k_cache, p.v_cache, table, lens, workspace=ws if splits > 1 else None,
                                 num_splits=splits, q_len=q_len, return_lse=True)
    torch.cuda.synchronize()
    assert tuple(out.shape) == (0, 8, 128) and tuple(lse.shape) == (0, 8), what
    assert (ws == 0xA5).all(), f"{what}, fresh empty tensors: the workspace was written"


def gpu_activities(fn):
    """Names of the GPU activities (kernels, copies, memsets) the profiler
    (CUPTI) records while fn runs and the device finishes its work."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_paged_decode_empty_batch_launches_nothing(seed):
    """batch 0 launches nothing, with splits forced or the library's choice:
    the profiler records no GPU activity for it, where it records the
    kernels of the same call with two sequences."""
    gen = torch.Generator().manual_seed(seed)
    p, out_buf, lse_buf, ws = empty_decode(1, 4, gen)
    attn.prepare()

    def call(n, splits):
        attn.paged_decode(p.q[:n], p.k_cache, p.v_cache, p.table[:n], p.seq_lens[:n], out=out_buf[:n],
                          lse=lse_buf[:n], workspace=ws, num_splits=splits, max_seq_len=40)

    seen = gpu_activities(lambda: call(2, 4))
    assert seen, "the profiler recorded no GPU activity for a batch-2 paged_decode, so it cannot show that batch 0 " \
                 "launches nothing on this machine"
    for splits in (0, 1, 4):
        got = gpu_activities(lambda: call(0, splits))
        assert not got, f"batch 0, num_splits {splits}: paged_decode launched {got} (batch 2 launched {seen})"
