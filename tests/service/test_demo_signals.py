"""The demo stays stoppable after its coordinator is gone: Ray's shutdown resets the kernel's
SIGTERM action to the default while Python still lists the demo's handler, so a SIGTERM in the
run's second half killed it without its cleanup (the testbed left behind)."""
from __future__ import annotations

import argparse
import signal
from contextlib import ExitStack


def sigterm_caught() -> bool:
    """Whether the kernel delivers SIGTERM to a handler of this process (not Python's view)."""
    with open("/proc/self/status") as f:
        mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def test_a_sigterm_after_the_coordinator_stopped_still_reaches_the_demo(tmp_path):
    from linkpass.coordinator import ray_actor
    from linkpass.demo.run import Demo

    def unwind(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, unwind)
    try:
        with ExitStack() as stack:
            demo = Demo(argparse.Namespace(out=str(tmp_path), output="table", faults=None), stack)
            ray_actor.connect(num_cpus=1)
            signal.signal(signal.SIGTERM, unwind)  # as start_coordinator does after connecting
            assert sigterm_caught()
            demo.stop_coordinator()
            assert signal.getsignal(signal.SIGTERM) is unwind
            assert sigterm_caught(), "after Ray's shutdown a SIGTERM would kill the demo without its cleanup"
    finally:
        ray_actor.shutdown()
        signal.signal(signal.SIGTERM, before)
