"""A process that forks after loading kvplug and calls it in the child gets
an immediate, clear error instead of a hang: the library's Go runtime does
not survive fork(), and every entry point checks for it before entering Go."""

from __future__ import annotations

import os
import time

import kvplug


def _wait(pid: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child was still running after {seconds} s: a call into kvplug hung")


def test_a_forked_child_fails_at_once():
    with kvplug.Manager(8, 4) as m:  # the library is loaded and its runtime running
        m.add(1, 5)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: every call fails at once, naming the cause
            os.close(r)
            code = 0
            try:
                kvplug.Manager(8, 4)
                code = 10
            except kvplug.UnsupportedError as e:
                os.write(w, str(e).encode())
                code = 0
            except BaseException:  # noqa: BLE001 - any other outcome is the test's failure
                code = 11
            try:
                m.add(2, 5)  # a manager made before the fork is no better
                code = 12
            except kvplug.UnsupportedError:
                pass
            except BaseException:  # noqa: BLE001
                code = 13
            os._exit(code)
        os.close(w)
        code = _wait(pid, 20)
        msg = os.read(r, 4096).decode()
        os.close(r)
        assert code == 0, f"child exit code {code}: {msg}"
        assert "forked" in msg and "spawn" in msg and "kvp_manager_create" in msg, msg
        m.add(2, 5)  # the parent is unaffected
        assert m.stats().num_seqs == 2
