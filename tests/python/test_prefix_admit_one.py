"""Admission of one prompt by one id, the case Manager.admit converts
without numpy (a ctypes scalar id and offsets): it must accept and refuse
exactly what the general path does."""

from __future__ import annotations

import numpy as np
import pytest

import kvplug


def test_one_id_edges_and_refusals():
    with kvplug.Manager(16, 4, prefix_cache=True) as m:
        p = np.arange(9, dtype=np.int32)
        lo, hi = -(1 << 63), (1 << 63) - 1
        # The int64 range's ends are ids like any other.
        assert list(m.admit([lo], [p])) == [0]
        assert list(m.admit([hi], [p])) == [8]  # the first prompt's two full blocks
        assert m.stats().num_seqs == 2
        # Past int64, or not an integer: refused, nothing admitted.
        for bad in (hi + 1, lo - 1, 1.0, True):
            with pytest.raises(kvplug.InvalidArgumentError):
                m.admit([bad], [p])
        # The same id again is a duplicate, as through the general path.
        with pytest.raises(kvplug.DuplicateSequenceError):
            m.admit([hi], [p])
        with pytest.raises(kvplug.DuplicateSequenceError):
            m.admit(np.array([hi], np.int64), [p])
        assert m.stats().num_seqs == 2
        # An empty prompt is refused, and a list prompt is converted.
        with pytest.raises(kvplug.InvalidArgumentError):
            m.admit([5], [np.zeros(0, np.int32)])
        assert list(m.admit([6], [list(range(9))])) == [8]
