"""The prefix cache's block hashes recomputed in Python from core/prefix/HASH.md,
checked against the test vectors the Go implementation generated
(core/prefix/testdata/hash_vectors.json): a router or engine written in Python
can compute the same block identities as the library."""

from __future__ import annotations

import json
import pathlib
import struct

import pytest

from conftest import require

xxhash = require("xxhash")

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "core" / "prefix" / "testdata" / "hash_vectors.json"


def block_inputs(tokens, block_size, adapter=0, mm=(), salt=b""):
    """Yields (input bytes, hash) per full block, per HASH.md's layout."""
    parent = bytes(16)
    for i in range(len(tokens) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        blk = tokens[lo:hi]
        ents = [(o - lo, h) for (o, n, h) in mm if o < hi and o + n > lo]
        s = salt if i == 0 else b""
        b = bytes([1]) + parent
        b += struct.pack("<I%di" % len(blk), len(blk), *blk)
        b += struct.pack("<QI", adapter, len(ents))
        for o, h in ents:
            b += struct.pack("<i", o) + h
        b += struct.pack("<I", len(s)) + s
        parent = xxhash.xxh3_128_digest(b)
        yield b, parent


def load_vectors():
    data = json.loads(VECTORS.read_text())
    assert data["layout_version"] == 1
    return data["vectors"]


def test_vector_file_is_substantial():
    vectors = load_vectors()
    assert len(vectors) >= 10
    assert sum(len(v["blocks"]) for v in vectors) >= 20
    assert any(v["salt"] for v in vectors), "no vector exercises the salt"
    assert any(v["mm"] for v in vectors), "no vector exercises multimodal keys"
    assert any(v["adapter"] for v in vectors), "no vector exercises the adapter"


@pytest.mark.parametrize("vec", load_vectors(), ids=lambda v: v["name"])
def test_block_hashes_match_go(vec):
    mm = [(m["offset"], m["length"], bytes.fromhex(m["hash"])) for m in vec["mm"]]
    got = list(block_inputs(vec["tokens"], vec["block_size"], vec["adapter"], mm, bytes.fromhex(vec["salt"])))
    assert len(got) == len(vec["blocks"])
    for i, ((inp, h), want) in enumerate(zip(got, vec["blocks"])):
        assert inp.hex() == want["input"], f"block {i}: input bytes differ"
        assert h.hex() == want["hash"], f"block {i}: hash differs"


def test_salt_changes_every_block():
    tokens = list(range(64))
    a = [h for _, h in block_inputs(tokens, 16)]
    b = [h for _, h in block_inputs(tokens, 16, salt=b"tenant-b")]
    assert all(x != y for x, y in zip(a, b))
