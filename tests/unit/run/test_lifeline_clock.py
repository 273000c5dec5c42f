"""The lifeline tells its owner by boot-relative start time (issue 26, item 8): a step of the wall clock (NTP, a VM
resumed) used to move every start time psutil reports, so each child found its owner's start time changed by more
than a second, took the owner for dead and killed itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from grpo_core.run import lifeline
from grpo_core.run.lifeline import OWNER_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc start ticks are Linux's")


def test_a_step_of_the_wall_clock_does_not_orphan_a_child(monkeypatch):
    """The owner (this process) is named before the step; after it, psutil reports every start time 5 s later (the
    kernel's boot time, /proc/stat ``btime``, moves with the wall clock) and the owner still counts as alive."""
    from psutil import _pslinux

    monkeypatch.setenv(OWNER_ENV, lifeline.owner_env()[OWNER_ENV])
    assert lifeline.orphaned(parent=False) is None
    before = psutil.Process().create_time()
    real_boot_time = _pslinux.boot_time
    monkeypatch.setattr(_pslinux, "boot_time", lambda: real_boot_time() + 5.0)
    assert psutil.Process().create_time() == pytest.approx(before + 5.0, abs=0.01)  # the step is seen
    assert lifeline.orphaned(parent=False) is None


def test_the_owner_is_its_start_tick_since_boot_and_a_dead_or_reused_pid_is_not_it(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid, start = lifeline.owner_env(child.pid)[OWNER_ENV].split(":")
        assert int(pid) == child.pid
        since_boot_s = psutil.Process(child.pid).create_time() - psutil.boot_time()  # psutil's own reading
        assert float(start) / os.sysconf("SC_CLK_TCK") == pytest.approx(since_boot_s, abs=0.02)
        monkeypatch.setenv(OWNER_ENV, f"{pid}:{start}")
        assert lifeline.orphaned(parent=False) is None
        monkeypatch.setenv(OWNER_ENV, f"{pid}:{int(start) + 1}")  # the same pid, started one tick later: reused
        assert lifeline.orphaned(parent=False) == f"its owner (pid {pid}) is gone"
        monkeypatch.setenv(OWNER_ENV, f"{pid}:{start}")
        child.kill()  # a zombie until reaped: dead all the same
        deadline = time.monotonic() + 30
        while lifeline.orphaned(parent=False) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lifeline.orphaned(parent=False) == f"its owner (pid {pid}) is gone"
        assert child.poll() is not None or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        child.kill()
        child.wait()
