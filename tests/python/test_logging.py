"""The log hook: library lines reach a Python callback or the logging module."""

from __future__ import annotations

import logging

import pytest

import kvplug


@pytest.fixture(autouse=True)
def silence_after():
    yield
    kvplug.set_logger(None)


def test_bad_levels_rejected():
    with pytest.raises(kvplug.InvalidArgumentError, match="got 9"):
        kvplug.set_logger(lambda level, msg: None, 9)
    with pytest.raises(kvplug.InvalidArgumentError, match="got -1"):
        kvplug.set_log_level(-1)


def test_callback_receives_lines():
    lines = []
    kvplug.set_logger(lambda level, msg: lines.append((level, msg)), kvplug.LOG_DEBUG)
    with kvplug.Manager(8, 4) as m:
        m.add(1, 4)
    kvplug.set_logger(None)
    assert lines, "no log line delivered at LOG_DEBUG for a manager's life"
    assert all(kvplug.LOG_DEBUG <= lvl <= kvplug.LOG_ERROR and isinstance(msg, str) and msg for lvl, msg in lines)


def test_silenced_logger_gets_nothing():
    lines = []
    kvplug.set_logger(lambda level, msg: lines.append(msg), kvplug.LOG_OFF)
    with kvplug.Manager(8, 4) as m:
        m.add(1, 4)
    assert lines == []


def test_enable_logging_routes_to_the_logging_module(caplog):
    caplog.set_level(logging.DEBUG, logger="kvplug")
    kvplug.enable_logging()
    with kvplug.Manager(8, 4):
        pass
    kvplug.set_logger(None)
    assert [r for r in caplog.records if r.name == "kvplug"], "no record reached logging"


def test_callback_exceptions_do_not_escape(caplog):
    def bad(level, msg):
        raise RuntimeError("boom")

    kvplug.set_logger(bad, kvplug.LOG_DEBUG)
    with kvplug.Manager(8, 4):  # the library keeps working
        pass
    kvplug.set_logger(None)
