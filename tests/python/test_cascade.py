"""Shared-prefix decode attention's Python bindings without a GPU: workspace
sizes, checked integers and argument errors (the GPU tests are in
tests/gpu/test_cascade_torch.py)."""

from __future__ import annotations

import pytest

import kvplug
from kvplug import cascade


def test_workspace_size_grows_with_capacity():
    d1, h1 = cascade.workspace_size(16, 32, 8, 128)
    d2, h2 = cascade.workspace_size(32, 32, 8, 128)
    assert 0 < d1 < d2 and 0 < h1 < h2
    # Partial states dominate the device workspace: MAX_PARTS per sequence,
    # float32 head_dim + 1 per q head.
    assert d2 - d1 >= 16 * cascade.MAX_PARTS * 32 * 129 * 4


@pytest.mark.parametrize("args", [(0, 32, 8, 128), (16, 32, 3, 128), (16, 32, 8, -1)])
def test_workspace_size_bad_values(args):
    with pytest.raises(kvplug.KvplugError):
        cascade.workspace_size(*args)


@pytest.mark.parametrize("bad", [1.5, "16", True, 2**31])
def test_workspace_size_checked_ints(bad):
    with pytest.raises(kvplug.InvalidArgumentError):
        cascade.workspace_size(bad, 32, 8, 128)


def test_plan_rejects_wrong_workspaces():
    with pytest.raises(kvplug.InvalidArgumentError, match="Workspaces"):
        cascade.plan([[0]], [1], None, 32, 8, 128, 1, object())


def test_exported():
    assert kvplug.cascade is cascade
    assert cascade.ROUTE_CASCADE == 3 and cascade.ROUTE_DECODE == 2


def test_run_rejects_a_foreign_plan():
    with pytest.raises(kvplug.InvalidArgumentError, match="cascade.plan"):
        cascade.paged_cascade(object(), None, None, None, None)
