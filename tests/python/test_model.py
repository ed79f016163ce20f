"""A randomized test of the manager against a Python model: random adds,
grows, forks, removes (valid and invalid) and describes, with the model
predicting every outcome and the library's answers checked after each step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np
import pytest

import kvplug


@dataclass
class Seq:
    length: int
    fresh: int
    blocks: List[int] = field(default_factory=list)  # as last described


class Model:
    def __init__(self, num_blocks: int, bs: int) -> None:
        self.num_blocks, self.bs = num_blocks, bs
        self.seqs: Dict[int, Seq] = {}
        self.peak = 0

    def nblocks(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def used(self) -> int:
        return len({b for s in self.seqs.values() for b in s.blocks})

    def free(self) -> int:
        return self.num_blocks - self.used()


def verify(m: kvplug.Manager, model: Model, rng: random.Random) -> None:
    """Describes every live sequence (in a random order) and checks it
    against the model, then adopts the described tables."""
    m.check()
    live = list(model.seqs)
    rng.shuffle(live)
    bs = model.bs
    if live:
        max_blocks = max(model.nblocks(s.length) for s in model.seqs.values()) + rng.randrange(3)
        table, lens, slots = m.describe(np.array(live, np.int64), max_blocks=max_blocks)
        assert lens.tolist() == [model.seqs[i].length for i in live]
        k = 0
        refs: Dict[int, int] = {}
        for row, i in enumerate(live):
            s = model.seqs[i]
            nb = model.nblocks(s.length)
            blocks = table[row, :nb].tolist()
            assert (table[row, nb:] == -1).all()
            assert all(0 <= b < model.num_blocks for b in blocks) and len(set(blocks)) == nb
            # Blocks a sequence holds never move.
            assert blocks[: len(s.blocks)] == s.blocks, f"sequence {i}'s blocks changed"
            for p in range(s.length - s.fresh, s.length):
                assert slots[k] == blocks[p // bs] * bs + p % bs
                k += 1
            s.blocks = blocks
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
            if s.length % bs:
                last_block = blocks[-1]
                assert sum(1 for j in live if last_block in (model.seqs[j].blocks or [])) <= 1
        assert k == len(slots)
        for i in live:  # a partial last block is never shared
            s = model.seqs[i]
            if s.length % bs:
                assert refs[s.blocks[-1]] == 1
        shared = sum(1 for r in refs.values() if r > 1)
    else:
        shared = 0
    st = m.stats()
    used = model.used()
    model.peak = max(model.peak, used)
    assert (st.used_blocks, st.free_blocks, st.num_seqs) == (used, model.num_blocks - used, len(model.seqs))
    assert st.shared_blocks == shared
    assert st.peak_used_blocks >= model.peak
    assert st.num_tokens == sum(s.length for s in model.seqs.values())
    waste = sum(model.nblocks(s.length) * bs - s.length for s in model.seqs.values())
    assert st.internal_waste == waste and st.allocated_slots == used * bs


@pytest.mark.parametrize("bs, seed", [(16, 1), (4, 2), (1, 3), (7, 4)])
def test_random_ops_match_model(bs, seed):
    rng = random.Random(seed)
    num_blocks = 300 if bs > 1 else 1500
    model = Model(num_blocks, bs)
    next_id = 0
    counts = {"ok": 0, "rejected": 0}
    with kvplug.Manager(num_blocks, bs) as m:
        for step in range(600):
            op = rng.choices(["add", "grow", "fork", "remove", "bad"], [5, 8, 1, 3, 2])[0]
            live = list(model.seqs)
            if op == "add":
                sid = rng.randrange(-(2**62), 2**62) if rng.random() < 0.2 else next_id
                next_id += 1
                plen = rng.randrange(1, 8 * bs + 2)
                need = model.nblocks(plen)
                if sid in model.seqs:
                    with pytest.raises(kvplug.DuplicateSequenceError):
                        m.add(sid, plen)
                elif need > model.free():
                    with pytest.raises(kvplug.OutOfBlocksError, match=f"{model.free()} are free"):
                        m.add(sid, plen)
                    counts["rejected"] += 1
                else:
                    m.add(sid, plen)
                    model.seqs[sid] = Seq(plen, plen)
                    counts["ok"] += 1
            elif op == "grow" and live:
                batch = rng.sample(live, rng.randrange(1, len(live) + 1))
                num = [rng.choice([0, 1, 1, 1, rng.randrange(0, 3 * bs + 1)]) for _ in batch]
                need = sum(
                    model.nblocks(model.seqs[i].length + c) - model.nblocks(model.seqs[i].length)
                    for i, c in zip(batch, num)
                )
                if need > model.free():
                    with pytest.raises(kvplug.OutOfBlocksError):
                        m.grow(np.array(batch, np.int64), np.array(num, np.int32))
                    counts["rejected"] += 1
                else:
                    m.grow(np.array(batch, np.int64), np.array(num, np.int32))
                    for i, c in zip(batch, num):
                        model.seqs[i].length += c
                        model.seqs[i].fresh = c
                    counts["ok"] += 1
            elif op == "fork" and live:
                parent = rng.choice(live)
                kids = [next_id + j for j in range(rng.randrange(1, 4))]
                next_id += len(kids)
                p = model.seqs[parent]
                partial = p.length % bs != 0
                if partial and len(kids) > model.free():
                    with pytest.raises(kvplug.OutOfBlocksError):
                        m.fork(parent, kids)
                    counts["rejected"] += 1
                else:
                    copies = m.fork(parent, kids)
                    assert len(copies) == (len(kids) if partial else 0)
                    full = model.nblocks(p.length) - (1 if partial else 0)
                    for j, k in enumerate(kids):
                        blocks = p.blocks[:full]
                        if partial:
                            assert copies[j][0] == p.blocks[-1]
                            blocks = blocks + [copies[j][1]]
                        model.seqs[k] = Seq(p.length, 0, blocks)
                    counts["ok"] += 1
            elif op == "remove" and live:
                batch = rng.sample(live, rng.randrange(1, min(len(live), 4) + 1))
                m.remove(batch)
                for i in batch:
                    del model.seqs[i]
                counts["ok"] += 1
            elif op == "bad":
                dead = next_id + 10_000
                choice = rng.randrange(4)
                with pytest.raises(kvplug.KvplugError) as info:
                    if choice == 0:
                        m.remove(live[:1] + [dead])
                    elif choice == 1:
                        m.grow(live[:1] + [dead], 1)
                    elif choice == 2:
                        m.describe_into(live[:1] + [dead])
                    elif live:
                        m.grow(live[:1] * 2, 1)
                    else:
                        m.add(dead, 0)
                assert str(info.value), "an error without a message"
                counts["rejected"] += 1
            verify(m, model, rng)
        assert counts["ok"] > 200 and counts["rejected"] > 20, counts
