"""What the testbed benchmarks that run agents share (sim/bench/failover.py and coordinator.py):
which hosts run them, their flap-damping half-life, and the hard-fault trial that times fault ->
DOWN verdict and fault -> route rewritten. No benchmark imports another; both import this, and
the simulator's calibration reads the agents' set-up from here (the testbed is imported only by
the trial, so reading a constant does not load netlink)."""
from __future__ import annotations

import gc
import re
import time

from .report import progress

A, B = 0, 2  # the two hosts with agents (leaf 0 and leaf 1)
# Flap damping with its default 10 s half-life would (rightly) call a link that fails every few
# seconds flapping and keep it out; repeated trials are that link. The benchmarks' agents use a
# 1 s half-life so every trial starts undamped.
FLAP_HALF_LIFE_MS = 1000
# agents' events carry the wall time of a verdict (at_ns) next to the monotonic time they were logged
MONO_TO_WALL = time.time_ns() - time.monotonic_ns()


def ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def first(events, pred):
    return next((e for e in events if pred(e)), None)


def plane_of(link: str) -> int:
    """The plane of a fabric link's name (`h0-p1l0`, `p1l0-p1s0` -> 1)."""
    return int(re.search(r"p(\d+)l", link).group(1))


def apply_fault(prefix: str, spec):
    """`faults.apply`, after a garbage collection. The fault's time stamp is bounded by the kernel
    call that makes it; a collection inside that call (tens of ms on a busy 2-core host) stretches
    the bound and can put the stamp after the agent's verdict."""
    from linkpass.testbed import faults

    gc.collect()
    return faults.apply(prefix, spec)


def linkpass_hard(prefix, agents, links, trials, spacing_s, windows: list[float] | None = None):
    """Down one link per trial (alternating planes); fault -> DOWN verdict and -> route rewritten at A.
    `windows` collects how long each fault's kernel call took (the bound on its time stamp)."""
    from linkpass.testbed import faults
    from linkpass.testbed.faults import FaultSpec

    detect, reroute = [], []
    for i in range(trials):
        if not agents.wait_healthy(timeout_s=60):  # each trial starts from a healthy fabric
            progress("paths not all up after 60 s; measuring anyway")
        link = links[i % len(links)]
        plane = plane_of(link)
        rec = apply_fault(prefix, FaultSpec("down", link))
        t0 = rec["effective_mono_ns"]
        if windows is not None:
            windows.append(ms(rec["effective_window_ns"][1] - rec["effective_window_ns"][0]))
        ev = agents.wait_for(A, "route_change", lambda e: e["mono_ns"] >= t0 and e["peer"] == f"h{B}"
                             and plane not in e["planes"], 2.0)
        down = first(agents.events(A, "path_state"),
                     lambda e: e["mono_ns"] >= t0 and e["new"] == "down" and e["peer"] == f"h{B}"
                     and e["plane"] == plane)
        time.sleep(0.2)
        faults.clear(prefix)
        got = None
        if ev is not None and down is not None:
            got = ms(ev["mono_ns"] - t0)
            reroute.append(got)
            detect.append(ms(down["at_ns"] - MONO_TO_WALL - t0))
        progress(f"linkpass {link} trial {i + 1}/{trials}: reroute {got if got is not None else 'none'} ms")
        time.sleep(spacing_s)
    return detect, reroute
