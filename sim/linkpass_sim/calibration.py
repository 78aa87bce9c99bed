"""Calibration: the simulator against the testbed, on the testbed's own cases.

`bench/failover.py` measures, on the default testbed (4 hosts, 2 planes, 2 leaves and 2
spines per plane), how long the real agent on h0 takes to call its paths to h2 bad after a fault.
This module replays those cases in the simulator, with the same agent set-up (1 ms probes, every
100th full-size, flap half-life 1 s, 4 paths h0 -> h2) and the same measure (fault to the first
DOWN, or to the first DEGRADED with the expected reason), and compares the medians. A simulator
whose detection times drift from the testbed's by more than 20 % is not to be trusted at scale.
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Callable

import numpy as np

from linkpass.agent.config import AgentConfig
from linkpass.core.decide import PathInfo
from linkpass.core.constants import PROBE_PORT_BASE
from linkpass.core.detector import DetectorConfig
from linkpass.core.fabric import DOWN, UP, directed, generated
from linkpass.core.names import PRESET_SHAPES, LeafSpine, host_name
from linkpass.core.states import State

from . import benchkit
from .virtual import MS, Effect, Rtt, VirtualAgent, VirtualPath, peer_addr

TOLERANCE_PCT = 20.0
# the testbed's detection figures (bench/failover.py's detect rows, 20 trials per case), shipped with the package
TESTBED_JSON = os.path.join(os.path.dirname(__file__), "data", "failover-detect.json")
A, B = host_name(benchkit.A), host_name(benchkit.B)  # the hosts the benchmark's agents run on
# measured on the testbed's h0 -> h2 paths (60 s, agents idle): p50 8-9 µs, p99 70-127 µs, no
# probe lost in 480 000; below the timeout floor (250 µs) the RTT hardly matters
TESTBED_RTT = Rtt(8_000, 20_000)
# paths start at random within the first half of the warm-up, so at the fault each has probed for
# more than one cycle of the sensitive loss test (~1 150 probes): its phase is random, as on the
# testbed's long-running agents
WARM_NS = 3_000 * MS
FLAP_HALF_LIFE_NS = benchkit.FLAP_HALF_LIFE_MS * MS  # the benchmark's agents
MODEL = generated(LeafSpine.blocks(**PRESET_SHAPES["default"]))  # the testbed the benchmark runs on, as a fleet model


@dataclass(frozen=True)
class Case:
    name: str  # the failover benchmark's case
    links: Callable[[int], tuple[str, ...]]  # directed links it faults, given the plane (hard faults alternate it)
    kind: str  # Effect kind
    loss: float = 0.0
    reasons: tuple[str, ...] = ()  # () = the first DOWN; else the first DEGRADED with one of these
    window_s: float = 2.0


def _both(link: str) -> tuple[str, ...]:
    return (directed(link, UP), directed(link, DOWN))


def _uplink(plane: int) -> str:
    """A's uplink on `plane`."""
    return MODEL.uplink(A, plane).name


def _leaf_spine(plane: int) -> str:
    """The link from A's leaf to spine 0 on `plane`."""
    return MODEL.leaf_spine(MODEL.leaf_of(A, plane), 0).name


CASES = (  # the gray ones stay on plane 0, as on the testbed
    Case("host-uplink-down", lambda p: _both(_uplink(p)), "down", window_s=0.2),
    Case("leaf-spine-down", lambda p: _both(_leaf_spine(p)), "down", window_s=0.2),
    Case("gray-loss-10", lambda p: _both(_uplink(0)), "loss", 0.10, ("gray_loss_fwd", "gray_loss_rev"), 2.0),
    Case("gray-loss-1", lambda p: _both(_uplink(0)), "loss", 0.01, ("gray_loss_fwd", "gray_loss_rev"), 10.0),
    Case("one-direction-loss", lambda p: (directed(_uplink(0), UP),), "loss", 0.10, ("gray_loss_fwd",), 2.0),
    Case("mtu-blackhole", lambda p: _both(_uplink(0)), "mtu", 0.0, ("mtu_blackhole",), 5.0),
)


def trial(case: Case, rng: np.random.Generator, plane: int = 0) -> float | None:
    """One fault on a freshly warmed agent: ms from the fault to the verdict, or None."""
    cfg = DetectorConfig(flap_half_life_ns=FLAP_HALF_LIFE_NS)
    interval = round(AgentConfig.interval_ms * MS)
    every = AgentConfig.size_probe_every
    agent = VirtualAgent(A, cfg, rng, interval, batch_phase_ns=int(rng.integers(0, 10 * MS)))
    warm = WARM_NS
    t0 = warm + int(rng.integers(0, MS))
    links = frozenset(case.links(plane))
    effect = Effect(links, case.kind, t0, t0 + int(case.window_s * 1e9), loss=case.loss)
    pid = 0
    for p in range(MODEL.planes):
        for spine in range(len(MODEL.spines(p))):
            pid += 1
            fwd, rev = MODEL.node_path(A, B, p, spine), MODEL.node_path(B, A, p, spine)
            vp = VirtualPath(PathInfo(pid, B, p, PROBE_PORT_BASE + pid, peer_addr(B, p)), fwd, rev, interval,
                             int(rng.integers(0, warm // 2)), every, TESTBED_RTT,
                             size_offset=int(rng.integers(0, every)))
            vp.fwd_effects = [effect] if links.intersection(fwd) else []
            vp.rev_effects = [effect] if links.intersection(rev) else []
            agent.add_path(vp)

    def verdict():
        for t in agent.transitions:
            if t.at_ns < t0:
                continue
            if not case.reasons and t.new is State.DOWN and agent.paths[t.path - 1].info.plane == plane:
                return t.at_ns
            if case.reasons and t.new is State.DEGRADED and t.reason.value in case.reasons:
                return t.at_ns
        return None

    agent.run_until(t0 - 20 * MS, batch_ns=100 * MS)
    agent.run_until(t0 + int(case.window_s * 1e9), stop=lambda: verdict() is not None)
    at = verdict()
    return None if at is None else (at - t0) / MS


def testbed_figures(path: str = TESTBED_JSON) -> dict[str, dict]:
    """The failover benchmark's detect rows: case -> row."""
    with open(path) as f:
        doc = json.load(f)
    return {r["case"]: r for r in doc["rows"] if r["metric"] == "detect" and r.get("median") is not None}


def calibrate(trials: int = 40, seed: int = 7, path: str = TESTBED_JSON, progress=None) -> list[dict]:
    """Per case: the simulator's detection median over `trials` against the testbed's."""
    rng = np.random.default_rng(seed)
    measured = testbed_figures(path)
    out = []
    for case in CASES:
        tb = measured.get(case.name)
        if tb is None:
            continue
        times = [trial(case, rng, plane=k % 2 if not case.reasons else 0) for k in range(trials)]
        got = [t for t in times if t is not None]
        sim = statistics.median(got) if got else None
        err = None if sim is None else round(100 * abs(sim - tb["median"]) / tb["median"], 1)
        out.append({"case": case.name, "sim_median_ms": None if sim is None else round(sim, 3),
                    "sim_n": len(got), "sim_missed": trials - len(got), "testbed_median_ms": tb["median"],
                    "testbed_n": tb["n"], "error_pct": err})
        if progress is not None:
            progress(f"calibration {case.name}: sim {out[-1]['sim_median_ms']} ms vs testbed {tb['median']} ms "
                     f"({err} %)")
    return out
