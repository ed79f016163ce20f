"""cmd/kvindex routing a fleet of engines by their own KV events (vLLM's,
SGLang's: one wire format): the engine's own publisher and event types,
block hashes that are the engine's own (SHA-256 bytes, or an int), and
no snapshots. The index must score each instance by the prefix it holds
and route a prompt to the instance holding it. The engines' test modules
call run_fleet with their publisher and event classes."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
BS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_kvindex(out_dir: pathlib.Path) -> pathlib.Path:
    go = os.environ.get("KVPLUG_GO") or shutil.which("go")
    assert go, "kvindex is built with Go (make test-engines passes its Go as KVPLUG_GO)"
    out = out_dir / "kvindex"
    subprocess.run([go, "build", "-o", str(out), "./cmd/kvindex"], cwd=ROOT, check=True)
    return out


def engine_hashes(tokens: list[int], as_int: bool) -> list:
    """A prompt's block hashes as a vLLM engine makes them: SHA-256 chained
    over the blocks' tokens, sent as bytes or as an int (vLLM's two
    forms); nothing kvindex could compute from a prompt."""
    chain, out = b"root", []
    for i in range(len(tokens) // BS):
        chain = hashlib.sha256(chain + json.dumps(tokens[i * BS:(i + 1) * BS]).encode()).digest()
        out.append(int.from_bytes(chain[-8:], "big") if as_int else chain)
    return out


class Engine:
    """One instance's event stream: its engine's publisher and the chains it
    has stored, as its prefix cache would announce them."""

    def __init__(self, name: str, kinds, engine: str, as_int: bool):
        publisher, self.batch, self.stored, self.removed = kinds
        self.name, self.engine, self.as_int = name, engine, as_int
        self.pub_port, self.replay_port = free_port(), free_port()
        self.pub = publisher(0, endpoint=f"tcp://*:{self.pub_port}",
                             replay_endpoint=f"tcp://*:{self.replay_port}", topic="kv")

    def flag(self) -> str:
        return f"{self.name}=tcp://127.0.0.1:{self.pub_port},tcp://127.0.0.1:{self.replay_port},kv,{self.engine}"

    def store(self, tokens: list[int], lora: int | None = None) -> list:
        """Announces the prompt's full blocks in one BlockStored, as vLLM's
        cache does for a new prefill; returns the engine's hashes."""
        hashes = engine_hashes(tokens, self.as_int)
        n = len(hashes) * BS
        self.pub.publish(self.batch(ts=time.time(), events=[self.stored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:n], block_size=BS,
            lora_id=lora, medium="GPU", lora_name=None)]))
        return hashes

    def remove(self, hashes: list) -> None:
        self.pub.publish(self.batch(ts=time.time(), events=[self.removed(block_hashes=hashes, medium="GPU")]))

    def close(self) -> None:
        self.pub.shutdown()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def wait_for(what: str, cond, timeout: float = 20.0):
    deadline = time.time() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.time() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.05)


def run_fleet(kinds, engine: str, as_int: bool, tmp_path: pathlib.Path) -> None:
    """Three instances of an engine behind kvindex. kinds: the engine's
    (ZmqEventPublisher, KVEventBatch, BlockStored, BlockRemoved)."""
    kvindex_binary = build_kvindex(tmp_path)
    engines = [Engine(f"v{i}", kinds, engine, as_int) for i in range(3)]
    port = free_port()
    args = [str(kvindex_binary), "-listen", f"127.0.0.1:{port}", "-block-size", str(BS)]
    for e in engines:
        args += ["-instance", e.flag()]
    log = open(tmp_path / "kvindex.log", "w")
    # A batch published before kvindex subscribes: it must come back by
    # the engine's replay protocol once a later batch shows the gap.
    early = [random.Random(9).randrange(32000) for _ in range(5 * BS)]
    engines[0].store(early)
    time.sleep(0.3)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready():
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=1) as r:
                    body = json.loads(r.read())
                    return body["fresh"] == len(engines) and body
            except OSError:
                return None
        wait_for(f"every {engine} instance to be fresh (no snapshot needed)", ready)

        rng = random.Random(5)
        system = [rng.randrange(32000) for _ in range(4 * BS)]
        prompts = [system + [rng.randrange(32000) for _ in range(rng.randrange(2, 6) * BS + 7)] for _ in engines]
        stored = [e.store(p) for e, p in zip(engines, prompts)]
        # An adapter's prompt is another prefix: only a query with its
        # adapter matches it.
        lora_prompt = [rng.randrange(32000) for _ in range(3 * BS)]
        engines[2].store(lora_prompt, lora=7)

        def scores(tokens, adapter=0):
            body = {"tokens": tokens}
            if adapter:
                body["adapter"] = adapter
            return post(base + "/v1/score", body)

        def routed():
            for e, p in zip(engines, prompts):
                r = scores(p)
                by = {s["instance"]: s for s in r["scores"]}
                if r["best"] != e.name or by[e.name]["gpu_tokens"] != len(p) // BS * BS:
                    return None
                # The others hold the shared system prompt only.
                if any(by[o.name]["gpu_tokens"] != len(system) for o in engines if o is not e):
                    return None
            return True
        wait_for("each prompt routed to the instance holding it, the system prompt seen on all", routed)
        wait_for("the adapter's prompt", lambda: scores(lora_prompt, 7)["best"] == "v2")
        early_scores = {s["instance"]: s for s in scores(early)["scores"]}
        assert early_scores["v0"]["gpu_tokens"] == len(early), early_scores
        no_adapter = {s["instance"]: s for s in scores(lora_prompt)["scores"]}
        assert no_adapter["v2"]["tokens"] == 0, "a prompt without the adapter matched the adapter's blocks"

        # Eviction: v0 drops its chain's last two blocks; the index follows.
        engines[0].remove(stored[0][-2:])
        want = (len(prompts[0]) // BS - 2) * BS
        wait_for("the removal", lambda: {s["instance"]: s for s in scores(prompts[0])["scores"]}["v0"]["gpu_tokens"] == want)

        with urllib.request.urlopen(base + "/v1/instances", timeout=5) as resp:
            st = {s["name"]: s for s in json.loads(resp.read())}
        assert all(s["engine"] == engine and s["state"] == "fresh" for s in st.values()), st
        assert st["v0"]["translated_blocks"] == len(prompts[0]) // BS - 2 + len(early) // BS, st["v0"]
        assert st["v0"]["replayed_batches"] >= 1 and "joined_mid_stream" not in st["v0"], st["v0"]
        assert "untranslated_blocks" not in st["v0"], st["v0"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        for e in engines:
            e.close()
