"""Localization trials on a fleet model: random faults, the probe plan's verdicts, 1 % noisy agents,
the real Localizer, precision and recall. Shared by the coordinator benchmark (the 16k 2-tier
fleet) and the scale benchmark (131k 3-tier, with the 16k fleet as its peer).

A `TrialFleet` holds the model, the plan, one Observation per planned path and which paths
cross which directed link. With `reverse_traced` (the coordinator benchmark's rows) an
observation carries its replies' links, assumed to return through the probes' spine and core;
without (what the coordinator does: reply paths are ECMP-hashed by the peer and not traced)
each path's replies take a route of their own, fixed per path as a flow hash is, and the
observation carries none: the localizer then blames every link a lost reply may have crossed.

Per trial, random faults on random links of any tier (half cuts: both directions; half one
direction only) make every path crossing them bad, with the direction they break; 1 % of the
agents (random) are noisy: each marks a random 30 % of its paths bad with a random direction,
and its truly bad paths good half the time. Only the observations that changed are update()'d
into a Localizer that already holds the healthy fleet, then findings() is timed; afterwards the
changed observations are set back to good.

With shards (`use_shards`), the observations are split over a ShardedLocalizer
(core/shards.py) as the sharded coordinator splits them, and sent to the places before
findings() as the root sends them each tick (taking them in is `update_ms`, as updating one
localizer is): only the places (shards, root) a trial touched explain again, each timed on its
own; the trial's latency is the slowest of them, as the shards and the root run in parallel,
each in its own process (`serial_ms`: the same places explained one after another, as one
process does). With the places in shard actors
(`parts`, the scale benchmark's Ray case), the latency is the wall time of findings(): the
rounds' calls, the shards' work side by side and the root's own.
"""
from __future__ import annotations

import gc
import random
import time

from linkpass.kernel import heap
from linkpass.core.localize import BOTH, Localizer, Observation
from linkpass.core.plan import plan_probes
from linkpass.core.shards import ROOT, LocalParts, ShardedLocalizer, ShardMap
from linkpass.core.states import Direction

from .report import progress, row

NOISY_SHARE = 0.01
NOISE_BAD = 0.30
NOISE_FLIP = 0.5
FWD, REV = Direction.FWD.value, Direction.REV.value  # the localizer takes a direction or its value
NOISE_DIRECTIONS = (FWD, REV, BOTH, None)



class TrialFleet:
    """The model, the plan, the healthy observations and which paths cross which link."""

    def __init__(self, model, reverse_traced: bool = True, seed: int = 0):
        t = time.perf_counter()
        self.model = model
        self.plan = plan_probes(self.model)
        self.reverse_traced = reverse_traced
        rng = random.Random(seed)  # the replies' own routes, when they are not traced
        self.reporter: list[str] = []
        self.keys: list[str] = []
        self.forward: list[tuple[str, ...]] = []
        self.reverse: list[tuple[str, ...]] = []
        self.paths_of_host: dict[str, list[int]] = {}
        self.fwd_index: dict[str, list[int]] = {}  # directed link -> paths whose probes cross it
        self.rev_index: dict[str, list[int]] = {}  # directed link -> paths whose replies cross it
        for host, paths in self.plan.paths.items():
            for n, p in enumerate(paths):
                i = len(self.keys)
                self.reporter.append(host)
                self.keys.append(f"{host}/{n}")
                fwd = self.model.node_path(host, p.peer, p.plane, p.spine, p.core)
                if reverse_traced or p.spine is None:
                    rev = self.model.node_path(p.peer, host, p.plane, p.spine, p.core)
                else:
                    cores = self.model.cores_per_group(p.plane)
                    rev = self.model.node_path(p.peer, host, p.plane, rng.randrange(self.model.spines_per_pod(p.plane)),
                                               rng.randrange(cores) if cores else None)
                self.forward.append(fwd)
                self.reverse.append(rev)
                self.paths_of_host.setdefault(host, []).append(i)
                for d in fwd:
                    self.fwd_index.setdefault(d, []).append(i)
                for d in rev:
                    self.rev_index.setdefault(d, []).append(i)
        self.tiers = self.model.links_by_tier()
        self.localizer: Localizer | ShardedLocalizer = Localizer(self.model, pause=heap.collector_paused)
        self.initial_ingest_us = self._ingest()
        self.setup_s = time.perf_counter() - t
        progress(f"fleet: {len(self.model.links)} links, {len(self.keys)} planned paths, "
                 f"set up in {self.setup_s:.1f} s (ingest {self.initial_ingest_us:.1f} us/observation)")

    def _ingest(self) -> float:
        """The healthy fleet into self.localizer; microseconds per observation."""
        t = time.perf_counter()
        with heap.collector_paused():  # as the coordinator loads its state (kernel/heap.py)
            for i in range(len(self.keys)):
                self.localizer.update(self.observation(i, False, None))
            if isinstance(self.localizer, ShardedLocalizer):
                self.localizer.findings()  # the places take their evidence in (sharded: then only where it changes)
        us = (time.perf_counter() - t) / len(self.keys) * 1e6
        heap.settle()  # as the coordinator does once its state is loaded (coordinator/ray_actor.py)
        return us

    def use_shards(self, shards: int, parts=None) -> None:
        """From now on, localize as `shards` coordinator shards and a root do (1: one Localizer);
        `parts`: where the places run (core/shards.Parts; default all in this process, timed
        each on its own)."""
        gc.unfreeze()  # the old localizer's objects may go
        self.localizer = None
        gc.collect()
        if shards == 1:
            self.localizer = Localizer(self.model, pause=heap.collector_paused)
        else:
            self.localizer = ShardedLocalizer(self.model, ShardMap(self.model, shards), parts,
                                              pause=heap.collector_paused)
            if parts is None:
                self.localizer.parts.clock = time.perf_counter
        self.initial_ingest_us = self._ingest()

    def observation(self, i: int, bad: bool, direction: str | None) -> Observation:
        return Observation(self.reporter[i], self.keys[i], self.forward[i],
                           self.reverse[i] if self.reverse_traced else None, bad, direction if bad else None)


def random_faults(fleet: TrialFleet, rng: random.Random, count: int) -> set[str]:
    """`count` distinct physical links, any tier; each cut (both directions) or one direction."""
    names: set[str] = set()
    tiers = sorted(t for t, links in fleet.tiers.items() if links)
    while len(names) < count:
        names.add(rng.choice(fleet.tiers[rng.choice(tiers)]))
    truth = set()
    for name in sorted(names):
        truth.update([f"{name}:up", f"{name}:down"] if rng.random() < 0.5
                     else [f"{name}:{rng.choice(('up', 'down'))}"])
    return truth


def verdicts(fleet: TrialFleet, rng: random.Random, truth: set[str]) -> dict[int, str | None]:
    """path index -> direction, for the paths reported bad (faults, then noisy agents)."""
    fwd_hit = {i for d in truth for i in fleet.fwd_index.get(d, ())}
    rev_hit = {i for d in truth for i in fleet.rev_index.get(d, ())}
    bad = {i: (BOTH if i in fwd_hit and i in rev_hit else FWD if i in fwd_hit else REV)
           for i in fwd_hit | rev_hit}
    hosts = fleet.model.hosts
    for host in rng.sample(hosts, max(1, round(NOISY_SHARE * len(hosts)))):
        for i in fleet.paths_of_host[host]:
            if i in bad:
                if rng.random() < NOISE_FLIP:
                    del bad[i]
            elif rng.random() < NOISE_BAD:
                bad[i] = rng.choice(NOISE_DIRECTIONS)
    return bad


def run_trials(fleet: TrialFleet, rng: random.Random, trials: int, faults: int, label: str) -> dict:
    out = {"latency_ms": [], "precision": [], "recall": [], "update_us": [], "update_ms": [], "tp": 0, "fp": 0, "fn": 0,
           "root_ms": [], "places": [], "serial_ms": []}
    loc = fleet.localizer
    # places timed each on its own (in this process), or elsewhere: then the wall time is the latency
    sharded = isinstance(loc, ShardedLocalizer) and isinstance(loc.parts, LocalParts)
    for t in range(trials):
        truth = random_faults(fleet, rng, faults)
        bad = verdicts(fleet, rng, truth)
        t0 = time.perf_counter()
        for i, direction in bad.items():
            loc.update(fleet.observation(i, True, direction))
        if isinstance(loc, ShardedLocalizer):
            # the root sends the evidence as it arrives (each tick); the parts take it in
            loc.send()
            if not sharded:  # parts elsewhere: wait until each has (a question answered after it)
                loc.parts.run({p: ([], "count", ()) for p in range(loc.map.shards)}, 0)
        t1 = time.perf_counter()
        if sharded:
            found = loc.findings()
            # the places explain in parallel, each round
            latency_ms = sum(max((t[k] for t in loc.took.values()), default=0.0) for k in (0, 1, 2)) * 1e3
            out["root_ms"].append(sum(loc.took.get(ROOT, ())) * 1e3)
            out["serial_ms"].append(sum(map(sum, loc.took.values())) * 1e3)  # every place in one process
            out["places"].append(len(loc.took))
        else:
            found = loc.findings()
            latency_ms = (time.perf_counter() - t1) * 1e3
        t2 = time.perf_counter()
        for i in bad:  # back to the healthy fleet for the next trial
            loc.update(fleet.observation(i, False, None))
        t3 = time.perf_counter()
        if isinstance(loc, ShardedLocalizer):
            loc.findings()  # each place's first round on the healthy fleet again (not timed)
        got = {f.directed for f in found}
        tp, fp, fn = len(got & truth), len(got - truth), len(truth - got)
        out["tp"] += tp
        out["fp"] += fp
        out["fn"] += fn
        out["latency_ms"].append(latency_ms)
        out["precision"].append(100.0 * tp / len(got) if got else 100.0 if not truth else 0.0)
        out["recall"].append(100.0 * tp / len(truth))
        out["update_us"].append(((t1 - t0) + (t3 - t2)) / (2 * len(bad)) * 1e6 if bad else 0.0)
        out["update_ms"].append((t1 - t0) * 1e3)  # the trial's reports into the localizer, before findings()
        if fp or fn:
            progress(f"{label} trial {t + 1}: truth {sorted(truth)} found {sorted(got)}")
    return out


def localize_rows(case: str, res: dict) -> list[dict]:
    tp, fp, fn = res["tp"], res["fp"], res["fn"]
    overall_p = round(100.0 * tp / (tp + fp), 3) if tp + fp else None
    overall_r = round(100.0 * tp / (tp + fn), 3) if tp + fn else None
    return [row(case, "latency", "ms", [round(v, 3) for v in res["latency_ms"]], target_max=100),
            # a precision or recall's bad tail is its low end
            row(case, "precision", "pct", res["precision"], q=0.01, overall=overall_p, true_positives=tp,
                false_positives=fp, target_min=99),
            row(case, "recall", "pct", res["recall"], q=0.01, overall=overall_r, true_positives=tp,
                false_negatives=fn, target_min=99)]


