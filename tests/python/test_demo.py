"""bench/demo.py's command line: bad arguments end in a usage message, not a
traceback or a silent run that serves nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "bench" / "demo.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("kvplug_demo", DEMO)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--num-blocks", "10"], "cannot serve this workload"),
        (["--arrival-rate", "-1"], "--arrival-rate must be >= 0"),
        (["--block-size", "-1"], "block_size must be in [1, 2^16]"),
        (["--num-blocks", str(2**26 + 1), "--block-size", "1"], "num_blocks must be in [1, 2^26]"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(demo, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        demo.main(argv + ["--quiet", "--no-prefix"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_run_too_short_to_finish_a_request_says_so(demo, capsys):
    demo.main(["--steps", "3", "--quiet", "--no-prefix"])
    out = capsys.readouterr().out
    assert "no request finished" in out and "run more steps" in out
