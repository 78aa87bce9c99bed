"""Timed fault trials on the testbed, for the benchmarks that run agents (bench/failover.py,
bench/coordinator.py): a fault applied with its kernel-stamped time, and the hard-fault trial
that times fault -> DOWN verdict and fault -> route rewritten at the agent's host."""
from __future__ import annotations

import gc
import time
from typing import Callable

from ..core.names import host_name, link_ends, plane_of
from ..core.states import State
from . import faults, steal
from .faults import FaultSpec

# agents' events carry the wall time of a verdict (at_ns) next to the monotonic time they were logged
MONO_TO_WALL = time.time_ns() - time.monotonic_ns()


def ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def first(events, pred):
    return next((e for e in events if pred(e)), None)


def link_plane(link: str) -> int:
    """The plane of a fabric link (`h0-p1l0`, `p1l0-p1s0` -> 1): its upper end's."""
    return plane_of(link_ends(link)[1])


def apply_fault(prefix: str, spec: FaultSpec) -> dict:
    """`faults.apply`, after a garbage collection. The fault's time stamp is bounded by the kernel
    call that makes it; a collection inside that call (tens of ms on a busy 2-core host) stretches
    the bound and can put the stamp after the agent's verdict."""
    gc.collect()
    return faults.apply(prefix, spec)


def linkpass_hard(prefix: str, agents, a: int, b: int, links: list[str], trials: int, spacing_s: float,
                  progress: Callable[[str], None], windows: list[float] | None = None,
                  stolen: list[tuple[float | None, float]] | None = None):
    """Down one link per trial (alternating planes); fault -> DOWN verdict and -> route rewritten at
    host `a` towards host `b`. `windows` collects how long each fault's kernel call took (the bound
    on its time stamp); `stolen`, per trial, (fault -> route ms or None, the most steal.stolen_ms
    any CPU counted from just before the fault until the route change was seen)."""
    detect, reroute = [], []
    for i in range(trials):
        if not agents.wait_healthy(timeout_s=60):  # each trial starts from a healthy fabric
            progress("paths not all up after 60 s; measuring anyway")
        link = links[i % len(links)]
        plane = link_plane(link)
        steal_before = steal.sample()
        rec = apply_fault(prefix, FaultSpec("down", link))
        t0 = rec["effective_mono_ns"]
        if windows is not None:
            windows.append(ms(rec["effective_window_ns"][1] - rec["effective_window_ns"][0]))
        peer = host_name(b)
        ev = agents.wait_for(a, "route_change", lambda e: e["mono_ns"] >= t0 and e["peer"] == peer
                             and plane not in e["planes"], 2.0)
        took_steal = steal.stolen_ms(steal_before, steal.sample())
        down = first(agents.events(a, "path_state"),
                     lambda e: e["mono_ns"] >= t0 and e["new"] == State.DOWN.value and e["peer"] == peer
                     and e["plane"] == plane)
        time.sleep(0.2)
        faults.clear(prefix)
        got = None
        if ev is not None and down is not None:
            got = ms(ev["mono_ns"] - t0)
            reroute.append(got)
            detect.append(ms(down["at_ns"] - MONO_TO_WALL - t0))
        if stolen is not None:
            stolen.append((got, took_steal))
        progress(f"linkpass {link} trial {i + 1}/{trials}: reroute {got if got is not None else 'none'} ms"
                 + (f" (host steal {took_steal} ms)" if took_steal else ""))
        time.sleep(spacing_s)
    return detect, reroute
