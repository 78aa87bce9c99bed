"""The decision loop's scheduling: real time while a failure is being decided, normal otherwise.

From a path's first miss to its route change the loop's work is on the reroute's critical path:
the confirming answers arrive about a round trip after the probe core sends them, and a loop the
scheduler keeps waiting behind other work (a training job's threads, the softirqs of a busy NIC)
acts on them milliseconds late. So the loop's thread runs SCHED_FIFO one step below the probe
thread (which must still send, reflect and time-stamp first) while it sleeps for the probe core
(a thread asleep takes no CPU at any priority, and one that wakes at real time runs at once),
through every step the probe core wakes it for (a miss, a late reply, the answers a DOWN waits
for), and while `Failover.in_flight()` holds after the step (a few timeouts per failure; at most
the confirmation window or the lateness cap). A wake-up of its own timer, with nothing in
flight, goes back to normal scheduling: the loop's batches, logs and metrics wait their turn
like any other work. Two system calls a loop turn; `set` makes none when nothing changes.

Needs what the probe thread needs (CAP_SYS_NICE or RLIMIT_RTPRIO, the unit's LimitRTPRIO=);
refused, the loop stays at normal priority, which is logged once.
"""
from __future__ import annotations

import os
from collections.abc import Callable


def loop_rt_priority(probe_rt_priority: int) -> int:
    """The loop's real-time priority for a probe thread at `probe_rt_priority`: one below it
    (0, none, when the probe thread runs at normal priority or at the lowest real-time one)."""
    return probe_rt_priority - 1 if probe_rt_priority > 1 else 0


class LoopPriority:
    """Switches the calling thread between SCHED_FIFO at `rt_priority` and SCHED_OTHER. `set`
    makes a system call only when the wanted state changes; after a refusal it asks no more."""

    def __init__(self, rt_priority: int, log: Callable[..., None] | None = None,
                 setscheduler: Callable[[int, int, os.sched_param], None] = os.sched_setscheduler):
        self.rt_priority = rt_priority
        self.log = log
        self.setscheduler = setscheduler
        self.raised = False
        self.refused: str | None = None  # why the kernel refused, once it has
        self.raises = 0  # how often the loop went real-time

    def set(self, urgent: bool) -> None:
        if urgent == self.raised or self.rt_priority <= 0 or self.refused is not None:
            return
        try:
            if urgent:
                self.setscheduler(0, os.SCHED_FIFO, os.sched_param(self.rt_priority))
                self.raises += 1
            else:
                self.setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError as exc:
            self.refused = exc.strerror or str(exc)
            if self.log is not None:
                self.log("loop_priority_refused", priority=self.rt_priority, error=self.refused,
                         note="the decision loop stays at normal priority: a reroute may wait for the "
                              "scheduler; grant what the probe thread's priority needs (LimitRTPRIO=)")
            return
        self.raised = urgent
