"""The computed-K/V contract (kvplug.h, "Computed K/V") driven as an engine
drives it, against an oracle of what every token slot holds.

A numpy array stands in for the GPU pool: one 64-bit digest per slot, the
digest of the token prefix whose K/V the forward pass computed there (a
token's K/V depends on every token before it). The host tier's slots hold
the same digests, moved by the tier copies as an engine performs them. A
random scheduler admits requests (bursts under a new shared prefix among
them), decodes and chunks, preempts and aborts requests at random points
within a step, sometimes abandons a step, and otherwise runs the forward
pass (which writes the new tokens' digests, then reads every live
sequence's slots and checks each against its own prefix), marks the step
computed and retires finished requests. Any K/V served that no forward pass
computed for that prefix fails the test."""

from __future__ import annotations

import numpy as np
import pytest

import kvplug

MASK = (1 << 64) - 1


def digests(tokens) -> list:
    out, d = [], 14695981039346656037
    for t in tokens:
        d = ((d ^ (int(t) & 0xFFFFFFFF)) * 1099511628211) & MASK
        d ^= d >> 29
        out.append(d | 1)  # never 0, the unwritten slot
    return out


class Engine:
    def __init__(self, seed: int, bs: int, num_blocks: int, tier: bool) -> None:
        self.rng = np.random.default_rng(seed)
        self.bs = bs
        kw = {}
        if tier:
            kw = dict(host_tier_slots=num_blocks, host_block_bytes=8 * bs, demote_ahead=num_blocks // 4)
        self.m = kvplug.Manager(num_blocks, bs, prefix_cache=True, **kw)
        self.tier = tier
        self.gpu = np.zeros(num_blocks * bs, np.uint64)
        self.host = self.m.host_tier_memory().view(np.uint64) if tier else None
        self.seqs: dict = {}  # id -> [tokens, digests, fresh, target]
        self.order: list = []  # live ids, admission order
        self.new: list = []  # admitted this step, in order
        self.next_id = 0
        self.shared = [self.tokens(bs * int(self.rng.integers(1, 5))) for _ in range(3)]
        self.served = self.refused = self.preempted = self.abandoned = 0

    def tokens(self, n: int) -> list:
        return self.rng.integers(0, 4, n).tolist()

    def admit(self) -> None:
        n = int(self.rng.integers(1, 4))
        head = None
        if self.rng.integers(6) == 0:  # a burst under a prefix nobody computed yet
            n, head = 3, self.tokens(self.bs * int(self.rng.integers(2, 5)))
        prompts = [(head or self.shared[int(self.rng.integers(3))]) + self.tokens(int(self.rng.integers(1, 2 * self.bs)))
                   for _ in range(n)]
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        matched = self.m.admit(ids, prompts)
        for sid, p, k in zip(ids, prompts, matched.tolist()):
            self.seqs[sid] = [p, digests(p), len(p) - k, len(p) + int(self.rng.integers(0, 3 * self.bs))]
            self.order.append(sid)
            self.new.append(sid)

    def grow(self, running: list) -> None:
        batch = [s for s in running if s in self.seqs]
        while batch:
            add = {s: self.tokens(1 if self.rng.integers(4) else int(self.rng.integers(1, 2 * self.bs))) for s in batch}
            try:
                self.m.grow_tokens(batch, [add[s] for s in batch])
            except kvplug.OutOfBlocksError:
                self.preempt(lifo=True)  # preempt the newest and retry
                batch = [s for s in batch if s in self.seqs]
                continue
            for s in batch:
                st = self.seqs[s]
                st[0] = st[0] + add[s]
                st[1] = digests(st[0])
                st[2] = len(add[s])
            return

    def forget(self, ids: list) -> None:
        for s in ids:
            del self.seqs[s]
            self.order.remove(s)
            if s in self.new:
                self.new.remove(s)

    def preempt(self, lifo: bool) -> None:
        if not self.order:
            return
        victim = self.order[-1]
        if not lifo and len(self.new) > 1 and self.rng.integers(2):
            victim = self.new[int(self.rng.integers(len(self.new) - 1))]  # one admitted earlier this step
        elif not lifo:
            victim = self.order[int(self.rng.integers(len(self.order)))]
        batch = [victim]
        before = self.m.stats()
        try:
            self.m.remove(batch)
        except kvplug.InUseError as e:
            assert not lifo, f"removing the newest sequence {victim} was refused: {e}"
            assert self.m.stats() == before, "a refused remove changed the manager"
            self.refused += 1
            # with everything admitted after its fill: after its admission, or (a running
            # sequence whose decode token filled a block) all of this step's
            batch += self.new[self.new.index(victim) + 1:] if victim in self.new else list(self.new)
            self.m.remove(batch)
        self.preempted += len(batch)
        self.forget(batch)

    def copies(self) -> None:
        if not self.tier:
            return
        b = self.m.flush_copies()
        bs = self.bs
        for blk, slot in zip(b.demote_blocks.tolist(), b.demote_slots.tolist()):
            self.host[slot] = self.gpu[blk * bs:(blk + 1) * bs]
        for blk, slot in zip(b.reload_blocks.tolist(), b.reload_slots.tolist()):
            self.gpu[blk * bs:(blk + 1) * bs] = self.host[slot]
        if b.ticket:
            self.m.complete_copies(b.ticket)

    def forward(self) -> None:
        if not self.order:
            return
        ids = list(self.order)
        d = self.m.describe(ids)
        k = 0
        for s in ids:
            toks, dig, fresh, _ = self.seqs[s]
            for p in range(len(toks) - fresh, len(toks)):
                self.gpu[d.slot_mapping[k]] = dig[p]
                k += 1
        assert k == len(d.slot_mapping)
        bs = self.bs
        for row, s in enumerate(ids):
            toks, dig, _, _ = self.seqs[s]
            assert d.seq_lens[row] == len(toks)
            blocks = d.block_table[row]
            slots = blocks[np.arange(len(toks)) // bs].astype(np.int64) * bs + np.arange(len(toks)) % bs
            got = self.gpu[slots]
            bad = np.nonzero(got != np.array(dig, np.uint64))[0]
            assert not bad.size, (f"sequence {s} reads token {bad[0]} from slot {slots[bad[0]]}, "
                                  f"which holds K/V no forward pass computed for its prefix")
            self.served += len(toks)

    def step(self) -> None:
        self.new = []
        running = list(self.order)
        for s in running:
            self.seqs[s][2] = 0
        ops = ["admit", "admit", "grow", "preempt", "abort"]
        self.rng.shuffle(ops)
        for op in ops:
            if op == "admit":
                self.admit()
            elif op == "grow":
                self.grow(running)
            elif op == "preempt" and self.rng.integers(2):
                self.preempt(lifo=bool(self.rng.integers(2)))
            elif op == "abort" and self.new and self.rng.integers(4) == 0:
                self.preempt(lifo=False)  # a client disconnects right after admission
        self.copies()
        if self.rng.integers(20) == 0:  # the step is abandoned: its new work goes
            gone = [s for s in self.order if self.seqs[s][2] > 0]
            if gone:
                self.m.remove(gone)
                self.abandoned += len(gone)
                self.forget(gone)
            return
        self.forward()
        self.m.mark_computed()
        done = [s for s in self.order if len(self.seqs[s][0]) >= self.seqs[s][3]]
        if done:
            self.m.remove(done)
            self.forget(done)


@pytest.mark.parametrize("seed,bs,tier", [(0, 1, False), (1, 2, True), (2, 4, True), (3, 4, False)])
def test_no_request_is_served_uncomputed_kv(seed, bs, tier):
    e = Engine(seed, bs, 96 // bs, tier)
    try:
        for _ in range(250):
            e.step()
            e.m.check()
        ps = e.m.prefix_stats()
        assert ps.hit_tokens > 0 and ps.dropped_uncomputed > 0, ps
        assert e.preempted > 0 and e.refused > 0 and e.abandoned > 0, (e.preempted, e.refused, e.abandoned)
        if tier:
            assert e.m.tier_stats().reloads > 0
    finally:
        e.m.close()
