"""The probe budget: how fast each path is probed when the wanted rates do not fit the ceiling.

Pure: no I/O, no clock reads; the caller passes the measurements and the times.

The agent never sends more than `probe.budget_pps` probes per second. When the rates its paths
want (`core/activity.py`: active, progressing, standby, idle) add up to more, rates are given up
by priority, lowest first:

- ACTIVE: paths carrying the job's traffic (active and progressing): failover needs them at once;
- STANDBY: the other paths of peers the job uses: where failover lands;
- COVERAGE: paths the coordinator's plan asked for: the fleet's evidence for localization;
- REST: everything else.

`apportion` stretches the lowest class's intervals by one common factor until the total fits,
none beyond `slowest_s` (a path probed less often than that is as good as unwatched); if the
class at `slowest_s` still does not fit, the next class up is stretched the same way, ACTIVE
last. If every path at `slowest_s` is still too many, all are stretched by one more common
factor, so the ceiling holds whatever the path count.

`CpuGovernor` turns the CPU share (`probe.budget_cpu_pct`) into a factor on that ceiling, from the
CPU time the process used in each window.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

ACTIVE, STANDBY, COVERAGE, REST = "active", "standby", "coverage", "rest"
CLASSES = (ACTIVE, STANDBY, COVERAGE, REST)  # highest priority first
# a stretched class aims this little below its share, so float sums of the result stay <= pps
_MARGIN = 1e-9


@dataclass(frozen=True)
class ClassShare:
    """One priority class in an apportionment."""

    paths: int
    wanted_pps: float  # the sum of 1/interval at the intervals asked for
    granted_pps: float  # ... at the intervals given
    degraded: bool  # some of its paths are probed less often than asked

    def to_dict(self) -> dict:
        return {"paths": self.paths, "wanted_pps": round(self.wanted_pps, 3),
                "granted_pps": round(self.granted_pps, 3), "degraded": self.degraded}


@dataclass(frozen=True)
class Apportioned:
    """What `apportion` decided: an interval per path and, per class, what it wanted and got."""

    intervals: dict[int, float]  # path id -> seconds between probes
    pps: float  # probes per second at these intervals (<= the budget when there is one)
    wanted_pps: float  # ... at the intervals asked for
    budget_pps: float  # the ceiling applied (0: none)
    classes: dict[str, ClassShare]  # every class of CLASSES, in that order
    overflow: float = 1.0  # > 1: every path at slowest_s was still too many; all stretched by this

    @property
    def degraded(self) -> tuple[str, ...]:
        """The classes given less than they asked for, highest priority first."""
        return tuple(c for c in CLASSES if self.classes[c].degraded)

    def to_dict(self) -> dict:
        return {"pps": round(self.pps, 3), "wanted_pps": round(self.wanted_pps, 3), "budget_pps": self.budget_pps,
                "overflow": self.overflow, "degraded": list(self.degraded),
                "classes": {c: s.to_dict() for c, s in self.classes.items()}}


def apportion(wanted: Mapping[int, tuple[str, float]], pps: float, slowest_s: float = 1.0) -> Apportioned:
    """Intervals for `wanted` (path id -> (class, wanted interval in seconds)) whose total rate
    stays within `pps` probes per second (0: no ceiling). See the module doc for the order in
    which classes give up rate. O(n log n); the result depends on the contents of `wanted` only,
    not on its order."""
    if not (isinstance(pps, (int, float)) and math.isfinite(pps) and pps >= 0):
        raise ValueError(f"pps: expected a finite number >= 0, got {pps!r}")
    if not (math.isfinite(slowest_s) and slowest_s > 0):
        raise ValueError(f"slowest_s: expected a finite number > 0, got {slowest_s!r}")
    by_class: dict[str, list[tuple[int, float]]] = {c: [] for c in CLASSES}
    for pid in sorted(wanted):  # sorted: float sums, and so the result, do not depend on the order given
        cls, interval = wanted[pid]
        if cls not in by_class:
            raise ValueError(f"path {pid}: class {cls!r} is not one of {', '.join(CLASSES)}")
        if not (isinstance(interval, (int, float)) and math.isfinite(interval) and interval > 0):
            raise ValueError(f"path {pid}: expected an interval in seconds > 0, got {interval!r}")
        by_class[cls].append((pid, float(interval)))
    want = {c: sum((1.0 / t for _, t in by_class[c]), 0.0) for c in CLASSES}
    total = sum(want.values())
    intervals = {pid: t for c in CLASSES for pid, t in by_class[c]}
    if pps == 0 or total <= pps:
        return Apportioned(intervals, total, total, pps, {c: ClassShare(len(by_class[c]), want[c], want[c], False)
                                                          for c in CLASSES})
    # a class at its floor: every path at slowest_s, or slower if it asked for slower
    floor = {c: sum((1.0 / max(t, slowest_s) for _, t in by_class[c]), 0.0) for c in CLASSES}
    granted = dict(want)
    overflow = 1.0
    for cls in reversed(CLASSES):  # lowest priority first
        room = pps - sum(granted.values()) + granted[cls]  # what the other classes leave it
        if floor[cls] <= room * (1 - _MARGIN):
            factor = _stretch(by_class[cls], room * (1 - _MARGIN), slowest_s)
            for pid, t in by_class[cls]:
                intervals[pid] = min(t * factor, max(t, slowest_s))
            granted[cls] = sum(1.0 / intervals[pid] for pid, _ in by_class[cls])
            break
        for pid, t in by_class[cls]:
            intervals[pid] = max(t, slowest_s)
        granted[cls] = floor[cls]
    else:  # even every path at its floor is too many: all slower by one factor, to the ceiling
        overflow = sum(floor.values()) / pps * (1 + _MARGIN)
        for pid in intervals:
            intervals[pid] *= overflow
        granted = {c: floor[c] / overflow for c in CLASSES}
    classes = {c: ClassShare(len(by_class[c]), want[c], granted[c], granted[c] < want[c]) for c in CLASSES}
    return Apportioned(intervals, sum(1.0 / intervals[pid] for c in CLASSES for pid, _ in by_class[c]),
                       total, pps, classes, overflow)


def _stretch(paths: list[tuple[int, float]], target: float, slowest_s: float) -> float:
    """The factor f >= 1 for which sum(1 / min(t * f, max(t, slowest_s))) == target, given that
    the floor (every path at max(t, slowest_s)) is <= target < the sum at f = 1.

    Path i reaches its floor at f_i = max(t_i, slowest_s) / t_i; between those breakpoints the
    rate is U / f + C (U: sum of 1/t over paths not at their floor, C: the floors' sum), so one
    sweep over the breakpoints in order finds the segment and solves it there."""
    points = sorted((max(t, slowest_s) / t, t) for _, t in paths)
    # U and C at each breakpoint from sums in one direction each (a running U - 1/t would lose
    # the digits the margin relies on)
    free = [0.0] * (len(points) + 1)
    for i in range(len(points) - 1, -1, -1):
        free[i] = free[i + 1] + 1.0 / points[i][1]
    fixed = 0.0
    for i, (f_i, t) in enumerate(points):
        if free[i] / f_i + fixed <= target:
            return max(1.0, free[i] / (target - fixed))  # the answer lies before this breakpoint
        fixed += 1.0 / max(t, slowest_s)
    return math.inf  # every path at its floor


class CpuGovernor:
    """A factor in (0, 1] for the pps ceiling that keeps the agent's CPU near `share` (of one
    core: 0.05 is 5 %; 0 turns it off).

    Control law, once per window of measured CPU time (multiplicative decrease, additive
    increase, as TCP's congestion control):
    - above the share: factor x= share / measured. Probing costs CPU about in proportion to its
      rate, so this is the step that would have met the share: the agent backs off within a
      window or two (a part of the CPU that does not scale with the rate only makes the step
      short, never too long, so it never drops below what the share allows);
    - below headroom x share: factor += step, slowly, since a burst of CPU elsewhere in the
      process or the job's traffic coming back must not make the rate jump back up;
    - in between: hold. The band is what lets it settle instead of sawing around the share.
    """

    def __init__(self, share: float, step: float = 0.05, headroom: float = 0.9, least: float = 0.01):
        if not (math.isfinite(share) and share >= 0):
            raise ValueError(f"share: expected a finite number >= 0, got {share!r}")
        if not (0 < step <= 1 and 0 < headroom <= 1 and 0 < least <= 1):
            raise ValueError("step, headroom and least must be in (0, 1]")
        self.share, self.step, self.headroom, self.least = share, step, headroom, least
        self.factor = 1.0
        self.measured: float | None = None  # the last window's CPU share

    def update(self, cpu_s: float, wall_s: float) -> float:
        """The factor after a window of `wall_s` seconds in which the process used `cpu_s` CPU
        seconds; a window with no length (or no reading) leaves it as it was."""
        if self.share == 0:
            return 1.0
        if not (math.isfinite(cpu_s) and math.isfinite(wall_s) and wall_s > 0 and cpu_s >= 0):
            return self.factor
        self.measured = used = cpu_s / wall_s
        if used > self.share:
            self.factor = max(self.least, self.factor * self.share / used)
        elif used < self.headroom * self.share:
            self.factor = min(1.0, self.factor + self.step)
        return self.factor
