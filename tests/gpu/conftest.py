"""Fixtures of the GPU tests."""

from __future__ import annotations

import os
import random
import sys

import pytest

SEED_ENV = "KVPLUG_TEST_SEED"


@pytest.fixture(autouse=True)
def seed() -> int:
    """Each test's random seed: KVPLUG_TEST_SEED when it is set (to replay a
    failure), else a fresh one, so that runs explore new inputs. It is
    printed, which a failed test's report shows, and torch's global
    generators start from it too, for code that draws from them."""
    env = os.environ.get(SEED_ENV)
    s = int(env, 0) if env else random.SystemRandom().randrange(1 << 63)
    print(f"seed {s}: replay with {SEED_ENV}={s}")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(s)
    return s
