"""Synchronous training with periodic checkpoints: what failures cost, in GPU time. Pure.

The job runs on every GPU at once, so any time lost is lost on all of them and goodput is

    goodput = useful GPU-hours / paid GPU-hours = (wall - lost) / wall

A job `Hit` is what one failure does to the job:
    restart    the job dies: the time since the last checkpoint is recomputed, plus the time to
               notice (`detect_s`: NCCL's ~30 s for a network error) and to restart (`restart_s`);
               checkpoints resume from the restart
    stall      the job waits `stall_s` and goes on (LinkPass's failover, or a fabric that
               reroutes by itself before NCCL gives up)
    slowdown   the job runs `slow_fraction` slower for `slow_s` (a plane lost until repair)
Hits that land while the job is down (restarting) are absorbed by that restart.
Checkpoints are taken every `checkpoint_s` of wall time since the last (re)start; their own cost
is the same with or without LinkPass and is left out (so no failures means 100 %).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class JobParams:
    checkpoint_s: float = 1800.0  # assumed 30 min (docs/fleet-sim.md: published 2-4 h down to ~15 min)
    restart_s: float = 600.0  # MegaScale: detection and diagnosis < 10 min; Meta: 5-20 min
    nccl_timeout_s: float = 30.0  # NCCL_IB_TIMEOUT=20 x NCCL_IB_RETRY_CNT=7, NCCL docs
    other_detect_s: float = 0.0  # a crashed GPU or host is noticed at once (the same in both worlds)
    comm_fraction: float = 0.3  # assumed share of a step the job waits on the network

    def __post_init__(self) -> None:
        for name in ("checkpoint_s", "restart_s", "nccl_timeout_s", "other_detect_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"JobParams.{name}: {getattr(self, name)!r} must be ≥ 0")
        if self.checkpoint_s <= 0:
            raise ValueError("JobParams.checkpoint_s: must be > 0 (a job that never checkpoints restarts from 0)")
        if not 0 <= self.comm_fraction <= 1:
            raise ValueError(f"JobParams.comm_fraction: {self.comm_fraction!r} must be in [0, 1]")


@dataclass(frozen=True)
class Hit:
    t_s: float
    kind: str  # "restart" | "stall" | "slowdown"
    detect_s: float = 0.0  # restart: time before anyone notices
    stall_s: float = 0.0
    slow_fraction: float = 0.0
    slow_s: float = 0.0
    cause: str = ""


@dataclass
class JobResult:
    wall_s: float
    lost_s: float = 0.0
    restarts: int = 0
    lost_by: dict = field(default_factory=dict)  # "recompute" | "detect" | "restart" | "stall" | "slowdown"
    timeline: list = field(default_factory=list)  # (t_s, lost_s so far) after each hit that cost time

    @property
    def goodput(self) -> float:
        return (self.wall_s - self.lost_s) / self.wall_s if self.wall_s else 1.0

    def _add(self, what: str, s: float) -> None:
        self.lost_s += s
        self.lost_by[what] = self.lost_by.get(what, 0.0) + s


def run(hits: list[Hit], wall_s: float, params: JobParams) -> JobResult:
    """Goodput of a job of `wall_s` that takes `hits` (any order)."""
    res = JobResult(wall_s)
    up_at = 0.0  # when the job last (re)started; checkpoints every checkpoint_s from here
    for h in sorted(hits, key=lambda h: h.t_s):
        if h.t_s >= wall_s:
            break
        if h.t_s < up_at:
            continue  # the job is down: this restart covers it
        if h.kind == "restart":
            since = (h.t_s - up_at) % params.checkpoint_s
            back = min(wall_s, h.t_s + h.detect_s + params.restart_s)
            res._add("recompute", since)
            res._add("detect", min(h.detect_s, wall_s - h.t_s))
            res._add("restart", back - h.t_s - min(h.detect_s, wall_s - h.t_s))
            res.restarts += 1
            up_at = back
        elif h.kind == "stall":
            res._add("stall", min(h.stall_s, wall_s - h.t_s))
        elif h.kind == "slowdown":
            res._add("slowdown", h.slow_fraction * min(h.slow_s, wall_s - h.t_s))
        else:
            raise ValueError(f"Hit.kind {h.kind!r} is unknown; one of restart, stall, slowdown")
        res.timeline.append((h.t_s, res.lost_s))
    return res


def degraded_fraction(params: JobParams, lost_share: float) -> float:
    """How much slower the job runs when the worst host loses `lost_share` of its network
    bandwidth (one plane of 8: 1/8): its traffic squeezes into the rest, and a synchronous step
    waits for the slowest host."""
    if not 0 <= lost_share < 1:
        raise ValueError(f"lost_share {lost_share!r} must be in [0, 1)")
    return params.comm_fraction * (1.0 / (1.0 - lost_share) - 1.0)
