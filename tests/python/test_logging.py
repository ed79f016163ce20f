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
    calls = []

    def bad(level, msg):
        calls.append(msg)
        raise RuntimeError("boom")

    caplog.set_level(logging.ERROR, logger="kvplug")
    kvplug.set_logger(bad, kvplug.LOG_DEBUG)
    with kvplug.Manager(8, 4) as m:  # the library keeps working
        m.add(1, 4)
        m.check()
        assert m.stats().used_blocks == 1
    kvplug.set_logger(None)
    assert calls, "the callback never ran, so nothing was raised"
    # Each exception is reported through logging instead of crossing into the library.
    failed = [r for r in caplog.records if r.name == "kvplug" and r.getMessage() == "kvplug log callback failed"]
    assert failed and len(failed) <= len(calls)
    assert all(r.exc_info and isinstance(r.exc_info[1], RuntimeError) and str(r.exc_info[1]) == "boom" for r in failed)


def test_set_logger_rejects_non_callables_at_once():
    lines = []
    kvplug.set_logger(lambda level, msg: lines.append(msg), kvplug.LOG_DEBUG)
    for bad in (42, "print", b"x"):
        with pytest.raises(TypeError, match="callable"):
            kvplug.set_logger(bad)
    with kvplug.Manager(8, 4):  # the logger installed before is still the one
        pass
    assert lines


def test_lines_have_no_line_ending():
    lines = []
    kvplug.set_logger(lambda level, msg: lines.append(msg), kvplug.LOG_DEBUG)
    with kvplug.Manager(8, 4, prefix_cache=True) as m:
        m.add(9, 32)  # every block taken
        m.admit([1], [list(range(10))])  # does not fit now: a debug line
    kvplug.set_logger(None)
    assert lines
    assert not [m for m in lines if m.endswith(("\n", "\r"))]


def test_calls_from_the_callback_fail_instead_of_deadlocking():
    import threading

    seen = []
    with kvplug.Manager(4, 4, prefix_cache=True) as m:
        m.add(9, 16)  # every block taken

        def reenter(level, msg):
            for call in (m.stats, m.check, lambda: kvplug.set_logger(None)):
                try:
                    call()
                    seen.append("ok")
                except (kvplug.UnsupportedError, RuntimeError) as e:
                    seen.append(type(e).__name__ + ": " + str(e))

        kvplug.set_logger(reenter, kvplug.LOG_DEBUG)
        result = []
        # admit logs "pool full" while it holds the manager's lock.
        t = threading.Thread(target=lambda: result.append(m.admit([1], [list(range(8))])), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "admit deadlocked in its log callback"
        kvplug.set_logger(None)
        assert result and len(result[0]) == 0
        assert seen and "ok" not in seen
        assert any(s.startswith("UnsupportedError") and "log callback" in s for s in seen)
        assert any(s.startswith("RuntimeError") and "log callback" in s for s in seen)
        m.check()  # outside the callback, calls work
