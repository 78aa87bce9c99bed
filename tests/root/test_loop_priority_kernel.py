"""The decision loop's scheduling switch against the kernel: the thread it runs on goes SCHED_FIFO
and back (in a thread of its own, so the test process keeps its scheduling whatever happens)."""
from __future__ import annotations

import os
import threading

from linkpass.agent.loop_priority import LoopPriority


def test_the_calling_thread_goes_real_time_and_back():
    seen: list = []

    def run():
        p = LoopPriority(5)
        try:
            seen.append(os.sched_getscheduler(0))
            p.set(True)
            seen.append((os.sched_getscheduler(0), os.sched_getparam(0).sched_priority))
        finally:
            p.set(False)
        seen.append(os.sched_getscheduler(0))
        seen.append(p.refused)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert seen == [os.SCHED_OTHER, (os.SCHED_FIFO, 5), os.SCHED_OTHER, None]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the test's own thread was never touched
