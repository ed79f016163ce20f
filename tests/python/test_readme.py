"""Every code example of the README runs as written: C and C++ compiled with
the README's build lines (C held to strict C99), the Python ones run as
scripts, the Go one in a module of its own outside this repository, set up
with the README's commands. The GPU example runs where torch sees a GPU (the
device machine) and is skipped elsewhere."""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from readme_snippets import find, snippets  # noqa: E402

LIB = pathlib.Path(os.environ.get("KVPLUG_LIBRARY", ROOT / "build" / "libkvplug.so")).resolve()


def _env() -> dict:
    env = dict(os.environ, KVPLUG_LIBRARY=str(LIB))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "bindings" / "python"), env.get("PYTHONPATH")) if p)
    return env


def _run(cmd, cwd, timeout=300, env=None) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=dict(_env(), **(env or {})), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_every_example_is_covered():
    langs = sorted({(s.heading, s.lang) for s in snippets() if s.lang in ("c", "cpp", "python", "go")})
    assert langs == sorted([
        ("### C", "c"),
        ("### C++ (header-only wrapper, no link-time dependency)", "cpp"),
        ("### Python", "python"),
        ("### The prefix cache (Python; the same calls exist in C, C++ and Go)", "python"),
        ("#### The host KV tier (Python; C: `kvp_manager_flush_copies`)", "python"),
        ("#### The shared KV tier (Python; C: `shared_tier_addr` in `kvp_manager_config`)", "python"),
        # Run by tests/python/test_shared_auth.py, against a TLS server it starts.
        ("##### A server others can reach: AUTH, TLS and a MAC (Python)", "python"),
        ("### Go", "go"),
        ("### KV events for a router (Python; C: `kvp_event_publisher_*`)", "python"),
        ("### Hybrid models (Python; C: `kvp_layer_group`)", "python"),
        ("### On the GPU (Python, torch)", "python"),
        ("### Prefill and mixed batches on the GPU (Python, torch)", "python"),
        ("### FP8 KV caches on the GPU (Python, torch)", "python"),
        ("### Hugging Face transformers (Python, torch)", "python"),
    ]), "a README example was added or renamed: run it here too"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_c_quickstart(tmp_path):
    (tmp_path / "quickstart.c").write_text(find("### C", "c").code)
    # The README's line, with -Lbuild pointing at the library under test.
    _run(["cc", "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", f"-I{ROOT / 'include'}", "quickstart.c",
          f"-L{LIB.parent}", "-lkvplug", f"-Wl,-rpath,{LIB.parent}", "-o", "quickstart"], tmp_path)
    out = _run([str(tmp_path / "quickstart")], tmp_path)
    assert "seq 100: len 41" in out and "seq 101: len 8" in out, out
    assert "KVP_ERR_OUT_OF_BLOCKS" in out, out


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_cpp_quickstart(tmp_path):
    (tmp_path / "quick.cpp").write_text(find("### C++ (header-only wrapper, no link-time dependency)", "cpp").code)
    _run(["c++", "-std=c++17", f"-I{ROOT / 'include'}", f"-I{ROOT / 'bindings' / 'cpp'}", "quick.cpp", "-ldl",
          "-o", "quick"], tmp_path)
    out = _run([str(tmp_path / "quick")], tmp_path)
    assert "seq 100: len 41" in out and "KVP_ERR_OUT_OF_BLOCKS" in out, out


def test_python_quickstart(tmp_path):
    (tmp_path / "quick.py").write_text(find("### Python", "python").code)
    out = _run([sys.executable, "quick.py"], tmp_path)
    assert "[41  8]" in out, out
    assert "new blocks" in out and "free" in out, out


def test_python_prefix_cache(tmp_path):
    (tmp_path / "prefix.py").write_text(find("### The prefix cache (Python; the same calls exist in C, C++ and Go)",
                                             "python").code)
    out = _run([sys.executable, "prefix.py"], tmp_path)
    assert "[  0 512]" in out and "matched_tokens=512" in out, out
    assert out.splitlines()[-1] == "48 80", out  # the image's blocks only for the image's keys


def test_python_host_tier(tmp_path):
    (tmp_path / "tier.py").write_text(find("#### The host KV tier (Python; C: `kvp_manager_flush_copies`)", "python").code)
    out = _run([sys.executable, "tier.py"], tmp_path)
    assert out.splitlines() == ["58", "[TierMatch(gpu_tokens=64, host_tokens=928)]", "[992]", "58", "True 928"], out


def test_python_shared_tier(tmp_path, valkey_server):
    (tmp_path / "shared.py").write_text(
        find("#### The shared KV tier (Python; C: `shared_tier_addr` in `kvp_manager_config`)", "python").code)
    out = _run([sys.executable, "shared.py"], tmp_path, env={"VALKEY_ADDR": valkey_server})
    assert out.splitlines() == ["[TierMatch(gpu_tokens=0, host_tokens=496)]", "[496]", "True 31"], out


def test_python_hybrid_models(tmp_path):
    (tmp_path / "hybrid.py").write_text(find("### Hybrid models (Python; C: `kvp_layer_group`)", "python").code)
    out = _run([sys.executable, "hybrid.py"], tmp_path)
    assert "blocks after 200 tokens: [75, 8]" in out and "matches 1200 of 1203" in out, out


def test_python_kv_events(tmp_path):
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    (tmp_path / "events.py").write_text(find("### KV events for a router (Python; C: `kvp_event_publisher_*`)", "python").code)
    out = _run([sys.executable, "events.py"], tmp_path, timeout=60)
    assert out.split() == ["1", "4", "16"], out  # first batch, four stored blocks of 16 tokens


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain")
def test_go_quickstart_outside_the_repository(tmp_path):
    """A module of its own, pointed at this checkout by the README's commands."""
    setup = find("### Go", "sh").code.replace("/path/to/kvplug", str(ROOT))
    (tmp_path / "main.go").write_text(find("### Go", "go").code)
    _run(["go", "mod", "init", "example.com/quickstart"], tmp_path)
    for line in setup.splitlines():
        if line.strip():
            _run(["sh", "-c", line], tmp_path)
    out = _run(["go", "run", "."], tmp_path)
    assert "[41 8]" in out, out


def _torch_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _torch_gpu(), reason="needs torch with a CUDA GPU")
def test_gpu_example(tmp_path):
    (tmp_path / "gpu.py").write_text(find("### On the GPU (Python, torch)", "python").code)
    out = _run([sys.executable, "gpu.py"], tmp_path)
    assert out.count("max |kvplug - SDPA|") == 2, out


@pytest.mark.skipif(not _torch_gpu(), reason="needs torch with a CUDA GPU")
def test_gpu_prefill_example(tmp_path):
    (tmp_path / "prefill.py").write_text(find("### Prefill and mixed batches on the GPU (Python, torch)", "python").code)
    out = _run([sys.executable, "prefill.py"], tmp_path)
    assert out.count("max |kvplug - SDPA|") == 2, out


@pytest.mark.skipif(not _torch_gpu(), reason="needs torch with a CUDA GPU")
def test_gpu_fp8_example(tmp_path):
    (tmp_path / "fp8.py").write_text(find("### FP8 KV caches on the GPU (Python, torch)", "python").code)
    out = _run([sys.executable, "fp8.py"], tmp_path)
    assert "FP8 cache: relative error" in out, out
    assert "FP8 prefill: relative error" in out, out


def test_hf_example(tmp_path):
    """Runs on the CPU (the torch reference path over the same block tables);
    make test's venv has torch and transformers, so this never skips there."""
    (tmp_path / "hf.py").write_text(find("### Hugging Face transformers (Python, torch)", "python").code)
    out = _run([sys.executable, "hf.py"], tmp_path, timeout=600)
    lines = out.splitlines()
    assert len(lines) == 3, out
    first = ast.literal_eval(lines[0])  # generate: two prompts, eight new tokens each
    assert [len(x) for x in first] == [8, 8], out
    assert lines[1] == "[ 0 48]", out  # request 2 starts on request 1's three cached blocks
    assert "no pending token" in lines[2], out


def test_contents_lists_every_section():
    """The README's contents list names every section heading (##, ###,
    ####) in order, each linked to the anchor GitHub gives it."""
    import re

    text = (ROOT / "README.md").read_text()
    heads = [(len(m.group(1)), m.group(2)) for m in re.finditer(r"(?m)^(#{2,4}) (.*)$", text)]
    heads = [h for h in heads if h[1] != "Contents"]
    start = text.index("## Contents")
    block = text[start:text.index("\n## ", start + 1)]
    listed = [(len(m.group(1)) // 2 + 2, m.group(2), m.group(3))
              for m in re.finditer(r"(?m)^( *)- \[(.*)\]\(#([^)]*)\)$", block)]

    def anchor(h: str) -> str:
        return re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")

    assert [(lvl, h) for lvl, h, _ in listed] == heads
    for _, h, a in listed:
        assert a == anchor(h), (h, a)
