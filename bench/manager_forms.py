"""Host time of the manager's Python calls per input form, for the same work.

Every documented form of an argument (lists, lists of lists, numpy arrays
of either integer width, torch CPU tensors, 2-D arrays) is timed on the same
call, the forms taking turns call by call so that the manager's state and
the machine's load fall on all of them alike; the table gives each form's
median and its ratio to the fastest form of the same work (the target: at
most 1.5x).

Work (n sequences of 1000-4000 tokens, block size 16, prefix cache on):
  a decode step: grow_tokens(ids, tokens), one new token per sequence, then
      describe_into(ids, table, lens, slots) into preallocated arrays; once
      with the tokens in each form (ids an int64 array), once with the ids
      in each form (tokens an int32 array);
  a decode step without tokens: grow(ids, 1) + describe_into, ids in each form;
  admission: admit([id], [prompt]) of a 2048-token prompt whose first 1024
      tokens are a cached system prompt, and admit(ids, prompts) of 8 such
      prompts, the prompts in each form.

    KVPLUG_LIBRARY=build/libkvplug.so PYTHONPATH=bindings/python \\
        python3 bench/manager_forms.py [--seqs 64 256] [--steps 400]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

import kvplug

try:
    import torch
except ImportError:  # the torch forms are left out
    torch = None


def forms_of_tokens(toks: np.ndarray) -> Dict[str, Any]:
    """One decode step's tokens (one per sequence) in every documented form."""
    f: Dict[str, Any] = {
        "int32 array": toks.astype(np.int32),
        "int64 array": toks.astype(np.int64),
        "list of ints": toks.tolist(),
        "list of 1-token lists": [[t] for t in toks.tolist()],
        "list of 1-token int32 arrays": [toks[i : i + 1].astype(np.int32) for i in range(len(toks))],
        "2-D int32 array (n, 1)": toks.astype(np.int32).reshape(-1, 1),
    }
    if torch is not None:
        f["torch int32"] = torch.from_numpy(toks.astype(np.int32))
        f["torch int64"] = torch.from_numpy(toks.astype(np.int64))
    return f


def forms_of_ids(ids: np.ndarray) -> Dict[str, Any]:
    f: Dict[str, Any] = {
        "int64 array": ids.astype(np.int64),
        "int32 array": ids.astype(np.int32),
        "list of ints": ids.tolist(),
        "tuple of ints": tuple(ids.tolist()),
    }
    if torch is not None:
        f["torch int64"] = torch.from_numpy(ids.astype(np.int64))
    return f


def forms_of_prompt(p: np.ndarray) -> Dict[str, Any]:
    f: Dict[str, Any] = {
        "int32 array": p.astype(np.int32),
        "int64 array": p.astype(np.int64),
        "list of ints": p.tolist(),
    }
    if torch is not None:
        f["torch int32"] = torch.from_numpy(p.astype(np.int32))
        f["torch int64"] = torch.from_numpy(p.astype(np.int64))
    return f


def timed(fn: Callable[[], Any]) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def rotated(items: List[Tuple[str, Any]], k: int) -> List[Tuple[str, Any]]:
    """items starting at the k-th (mod len): each form goes first in turn."""
    k %= len(items)
    return items[k:] + items[:k]


def decode_work(n: int, steps: int, rng: np.random.Generator) -> Dict[str, Dict[str, float]]:
    """Median microseconds of a decode step per form, n sequences: the
    step's calls with one argument in each form, the others arrays."""
    bs, rnd = 16, 32
    ids = np.arange(n, dtype=np.int64)
    ids_forms = list(forms_of_ids(ids).items())
    grown = rnd * (len(forms_of_tokens(ids)) + 2 * len(ids_forms))  # tokens a sequence grows by in a round
    width = (4000 + grown) // bs + 2  # the widest block table row
    m = kvplug.Manager(n * width, bs, prefix_cache=True)
    table = np.empty((n, width), np.int32)
    lens, slots = np.empty(n, np.int32), np.empty(n, np.int32)
    tok32 = np.zeros(n, np.int32)
    works: Dict[str, Dict[str, List[int]]] = {
        "grow_tokens(ids, tokens) + describe_into(ids), tokens as": {},
        "grow_tokens(ids, tokens) + describe_into(ids), ids as": {},
        "grow(ids, 1) + describe_into(ids), ids as": {},
    }
    w_tok, w_ids, w_grow = works.values()

    def step_tokens(t: Any) -> None:
        m.grow_tokens(ids, t)
        m.describe_into(ids, table, lens, slots)

    def step_ids(i: Any) -> None:
        m.grow_tokens(i, tok32)
        m.describe_into(i, table, lens, slots)

    def step_grow(i: Any) -> None:
        m.grow(i, 1)
        m.describe_into(i, table, lens, slots)

    for step in range(steps):
        if step % rnd == 0:  # a fresh batch every rnd steps, so the pool never fills
            if step:
                m.mark_computed()
                m.remove(ids)
            m.admit(ids, [rng.integers(0, 50_000, k, dtype=np.int32) for k in rng.integers(1000, 4000, n)])
        toks = rng.integers(0, 50_000, n)
        tok32[:] = toks
        for name, t in rotated(list(forms_of_tokens(toks).items()), step):
            w_tok.setdefault(name, []).append(timed(lambda: step_tokens(t)))
        for name, i in rotated(ids_forms, step):
            w_ids.setdefault(name, []).append(timed(lambda: step_ids(i)))
            w_grow.setdefault(name, []).append(timed(lambda: step_grow(i)))
    m.close()
    return {w: {f: statistics.median(v) / 1e3 for f, v in d.items()} for w, d in works.items()}


def admit_work(calls: int, rng: np.random.Generator) -> Dict[str, Dict[str, float]]:
    """Median microseconds of admission per prompt form: one prompt, and a
    batch of 8, of 2048 tokens each, the first 1024 a cached system prompt."""
    bs, plen, batch = 16, 2048, 8
    m = kvplug.Manager(4 * (batch + 1) * plen // bs, bs, prefix_cache=True)
    system = rng.integers(0, 50_000, plen // 2, dtype=np.int32)
    m.admit([-1], [np.append(system, 0)])  # caches the system prompt's blocks
    m.mark_computed()  # its forward pass ran
    m.remove([-1])
    m.pin(system)
    works: Dict[str, Dict[str, List[int]]] = {"admit([id], [prompt])": {}, "admit(8 ids, 8 prompts)": {}}
    w_one, w_batch = works.values()
    sid = 0
    for k in range(calls):
        p = np.concatenate([system, rng.integers(0, 50_000, plen // 2)])
        for name, f in rotated(list(forms_of_prompt(p).items()), k):
            w_one.setdefault(name, []).append(timed(lambda: m.admit([sid], [f])))
            m.mark_computed()
            m.remove([sid])
            sid += 1
        ps = np.concatenate([np.tile(system, (batch, 1)), rng.integers(0, 50_000, (batch, plen // 2))], axis=1)
        bids = list(range(sid, sid + batch))
        batch_forms: Dict[str, Any] = {
            "2-D int32 array": ps.astype(np.int32),
            "list of int32 arrays": list(ps.astype(np.int32)),
            "list of int64 arrays": list(ps.astype(np.int64)),
            "list of lists": ps.tolist(),
        }
        if torch is not None:
            batch_forms["2-D torch int32"] = torch.from_numpy(ps.astype(np.int32))
            batch_forms["list of torch int64"] = list(torch.from_numpy(ps.astype(np.int64)))
        for name, f in rotated(list(batch_forms.items()), k):
            w_batch.setdefault(name, []).append(timed(lambda: m.admit(bids, f)))
            m.mark_computed()
            m.remove(bids)
        sid += batch
    m.close()
    return {w: {f: statistics.median(v) / 1e3 for f, v in d.items()} for w, d in works.items()}


def table(title: str, res: Dict[str, float]) -> List[str]:
    best = min(res.values())
    rows = [f"| {title} | median us | ratio to fastest |", "| --- | --- | --- |"]
    for name, us in sorted(res.items(), key=lambda kv: kv[1]):
        rows.append(f"| {name} | {us:.2f} | {us / best:.2f}x |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256], help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=400, help="decode steps per batch size")
    ap.add_argument("--admits", type=int, default=300, help="admission rounds")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    worst: List[Tuple[float, str]] = []
    out: List[str] = []
    for n in args.seqs:
        for work, res in decode_work(n, args.steps, rng).items():
            out += [""] + table(f"{work} ({n} sequences)", res)
            worst.append((max(res.values()) / min(res.values()), f"{work} ({n} sequences)"))
    for work, res in admit_work(args.admits, rng).items():
        out += [""] + table(f"{work}, prompts as", res)
        worst.append((max(res.values()) / min(res.values()), work))
    print(f"kvplug {kvplug.__version__} ({kvplug.version_string()}), numpy {np.__version__}, "
          f"torch {torch.__version__ if torch is not None else 'absent'}")
    print("\n".join(out))
    w, where = max(worst)
    print(f"\nslowest form against the fastest of the same work: {w:.2f}x ({where}); target at most 1.5x")


if __name__ == "__main__":
    main()
