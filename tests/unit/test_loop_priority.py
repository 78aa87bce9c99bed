"""The decision loop's scheduling switch (agent/loop_priority.py), with the system call recorded."""
from __future__ import annotations

import errno
import os

from linkpass.agent.loop_priority import LoopPriority, loop_rt_priority


class _Sched:
    def __init__(self, refuse: bool = False):
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse

    def __call__(self, pid, policy, param):
        if self.refuse:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        self.calls.append((policy, param.sched_priority))


def test_the_loop_runs_one_step_below_the_probe_thread():
    assert loop_rt_priority(10) == 9
    assert loop_rt_priority(2) == 1
    assert loop_rt_priority(1) == 0  # no real-time step below the lowest
    assert loop_rt_priority(0) == 0


def test_real_time_while_urgent_and_a_call_only_on_a_change():
    sched = _Sched()
    p = LoopPriority(9, setscheduler=sched)
    p.set(False)
    assert sched.calls == []  # already normal
    p.set(True)
    p.set(True)
    p.set(False)
    p.set(False)
    p.set(True)
    assert sched.calls == [(os.SCHED_FIFO, 9), (os.SCHED_OTHER, 0), (os.SCHED_FIFO, 9)]
    assert p.raised and p.raises == 2


def test_no_priority_asks_nothing():
    sched = _Sched()
    p = LoopPriority(0, setscheduler=sched)
    p.set(True)
    assert sched.calls == [] and not p.raised


def test_a_refusal_is_logged_once_and_never_asked_again():
    sched, logs = _Sched(refuse=True), []
    p = LoopPriority(9, log=lambda event, **f: logs.append((event, f)), setscheduler=sched)
    for _ in range(3):
        p.set(True)
        p.set(False)
    assert [e for e, _ in logs] == ["loop_priority_refused"]
    assert logs[0][1]["priority"] == 9 and "permitted" in logs[0][1]["error"]
    assert not p.raised and p.refused
