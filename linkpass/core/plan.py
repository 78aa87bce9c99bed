"""Probe plans: which paths every host probes, so that every link is watched by several hosts.

Pure: no sockets, no files, no clock reads; deterministic for a given model, host set and seed.

A planned path is (peer, plane, spine index). It covers, for its reporter, the directed links
of its probes (`node_path(host, peer, plane, spine)`) and of their replies, assumed to return
through the same spine (`node_path(peer, host, plane, spine)`). So one path covers both
directions of the 2 or 4 physical links it crosses, and localization (`localize.py`) needs each
directed link covered by >= 2 distinct reporters before a fault there can be called.

Small fleets (<= `full_mesh_max` hosts) get a full mesh: every peer, every plane, every spine.
Larger ones get a sparse plan with `paths_per_plane` (default 3) paths per (host, plane): the
hosts of leaf i probe hosts of the next leaves (i+1, i+2, ... around the ring of leaves that
have hosts), spreading over the spines in turn, so each leaf-spine link gets its own leaf's
probes and the probes arriving from other leaves. A repair pass then adds the few paths that
uneven shapes (a short last leaf, more spines than a leaf's probes) need to reach 2 reporters
everywhere. Total paths grow linearly with the fleet.

Hosts not in `hosts` are neither probed from nor used as peers: when hosts join or leave, call
`plan_probes` again with the new set. Links that no probe between present hosts can cross (a
leaf with no present host, spines when only one leaf has hosts) cannot be covered.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from linkpass.core.fabric import FabricError, FabricModel


@dataclass(frozen=True)
class PlannedPath:
    peer: str
    plane: int
    spine: int | None  # spine index; None: same-leaf pair, or whichever path discovery finds


@dataclass
class ProbePlan:
    paths: dict[str, list[PlannedPath]] = field(default_factory=dict)  # host -> its paths
    full_mesh: bool = False

    def peers_of(self, host: str) -> list[str]:
        return sorted({p.peer for p in self.paths.get(host, ())})

    @property
    def total_paths(self) -> int:
        return sum(len(v) for v in self.paths.values())

    def to_dict(self) -> dict:
        return {"full_mesh": self.full_mesh, "total_paths": self.total_paths,
                "paths": {h: [[p.peer, p.plane, p.spine] for p in ps] for h, ps in self.paths.items()}}


def planned_links(model: FabricModel, host: str, path: PlannedPath) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forward, reverse) directed links of a planned path; with no spine between two leaves,
    only the links every path must cross."""
    if path.spine is None and model.leaf_of(host, path.plane) != model.leaf_of(path.peer, path.plane):
        forward = (model.uplink(host, path.plane).name + ":up", model.uplink(path.peer, path.plane).name + ":down")
        return forward, model.reverse_definite(host, path.plane, path.peer)
    return (model.node_path(host, path.peer, path.plane, path.spine),
            model.node_path(path.peer, host, path.plane, path.spine))


def coverage(model: FabricModel, plan: ProbePlan) -> dict[str, int]:
    """Distinct reporters per directed link (links no path crosses are absent)."""
    reporters: dict[str, set[str]] = {}
    for host, paths in plan.paths.items():
        for path in paths:
            forward, reverse = planned_links(model, host, path)
            for d in forward + reverse:
                s = reporters.get(d)
                if s is None:
                    s = reporters[d] = set()
                s.add(host)
    return {d: len(s) for d, s in reporters.items()}


def plan_probes(model: FabricModel, hosts: Iterable[str] | None = None, full_mesh_max: int = 16,
                seed: int = 0, paths_per_plane: int = 3) -> ProbePlan:
    """The probe plan for `hosts` (default: every host of the model); see the module doc."""
    if hosts is None:
        present = list(model.hosts)
    else:
        wanted = set(hosts)
        unknown = sorted(wanted - set(model.hosts))
        if unknown:
            raise FabricError(f"hosts not in the fleet model: {', '.join(unknown[:5])}")
        present = [h for h in model.hosts if h in wanted]  # model order: deterministic
    plan = ProbePlan({h: [] for h in present}, full_mesh=len(present) <= full_mesh_max)
    for plane in range(model.planes):
        on_plane = [h for h in present if _has_uplink(model, h, plane)]
        if plan.full_mesh:
            _full_mesh(model, plane, on_plane, plan)
        else:
            _Sparse(model, plane, on_plane, seed, paths_per_plane, plan).build()
    return plan


def _has_uplink(model: FabricModel, host: str, plane: int) -> bool:
    try:
        model.uplink(host, plane)
        return True
    except FabricError:
        return False


def _full_mesh(model: FabricModel, plane: int, hosts: list[str], plan: ProbePlan) -> None:
    spines = range(len(model.spines(plane)))
    leaf = {h: model.leaf_of(h, plane) for h in hosts}
    for h in hosts:
        out = plan.paths[h]
        for peer in hosts:
            if peer == h:
                continue
            if leaf[peer] == leaf[h]:
                out.append(PlannedPath(peer, plane, None))
            else:
                out.extend(PlannedPath(peer, plane, s) for s in spines)


class _Sparse:
    """One plane's sparse plan, with coverage tracked on (group, spine) and host keys for speed."""

    def __init__(self, model, plane, hosts, seed, per_host, plan):
        self.plane, self.per_host, self.seed, self.plan = plane, per_host, seed, plan
        self.spines = len(model.spines(plane))
        groups: dict[str, list[str]] = {}
        for h in hosts:
            groups.setdefault(model.leaf_of(h, plane), []).append(h)
        self.groups = list(groups.values())
        self.group_of = {h: i for i, g in enumerate(self.groups) for h in g}
        self.hosts = hosts
        self.cov_host: dict[str, set[str]] = {h: set() for h in hosts}  # host uplink -> reporters
        self.cov_ls: dict[tuple[int, int], set[str]] = {}  # (group, spine) -> reporters
        self.planned: set[tuple[str, str, int | None]] = set()

    def add(self, reporter: str, peer: str, spine: int | None) -> None:
        if reporter == peer or (reporter, peer, spine) in self.planned:
            return
        self.planned.add((reporter, peer, spine))
        self.plan.paths[reporter].append(PlannedPath(peer, self.plane, spine))
        self.cov_host[reporter].add(reporter)
        self.cov_host[peer].add(reporter)
        if spine is not None:
            for g in (self.group_of[reporter], self.group_of[peer]):
                self.cov_ls.setdefault((g, spine), set()).add(reporter)

    def build(self) -> None:
        groups, m, c = self.groups, len(self.groups), self.per_host
        if m == 1:  # one rack: a ring of rack mates, no spine involved
            g = groups[0]
            for j, h in enumerate(g):
                for k in range(1, min(c, len(g) - 1) + 1):
                    self.add(h, g[(j + k) % len(g)], None)
        elif m > 1:
            for i, g in enumerate(groups):
                offset = i * c + self.seed
                for j, h in enumerate(g):
                    for k in range(c):
                        slot = offset + j * c + k
                        # hosts sharing a spine (slot one round of spines apart) head for
                        # different leaves, so no two hosts watch exactly the same links
                        hop = 1 + (k + slot // self.spines) % (m - 1)
                        target = groups[(i + hop) % m]
                        self.add(h, target[(j + k) % len(target)], slot % self.spines)
        self.repair()

    def repair(self) -> None:
        order = {h: n for n, h in enumerate(self.hosts)}
        for h in self.hosts:  # every uplink: its host and one more, or two others
            start = order[h] + 1
            for n in range(len(self.hosts) - 1):
                if len(self.cov_host[h]) >= 2:
                    break
                prober = self.hosts[(start + n) % len(self.hosts)]
                if prober not in self.cov_host[h]:
                    self.add(prober, h, self._least_covered_spine(prober, h))
        m = len(self.groups)
        if m < 2:
            return
        for i, g in enumerate(self.groups):
            for s in range(self.spines):
                covered = self.cov_ls.setdefault((i, s), set())
                if len(covered) >= 2:
                    continue
                # reporters: this leaf's hosts probing out, then other leaves' hosts probing in
                for other in [(i + k) % m for k in range(1, m)]:
                    for reporter in g:
                        if len(covered) >= 2:
                            break
                        if reporter not in covered:
                            peers = self.groups[other]
                            self.add(reporter, peers[s % len(peers)], s)
                    for reporter in self.groups[other]:
                        if len(covered) >= 2:
                            break
                        if reporter not in covered:
                            self.add(reporter, g[s % len(g)], s)
                    if len(covered) >= 2:
                        break

    def _least_covered_spine(self, reporter: str, peer: str) -> int | None:
        a, b = self.group_of[reporter], self.group_of[peer]
        if a == b:
            return None
        return min(range(self.spines), key=lambda s: (len(self.cov_ls.get((a, s), ())) + len(self.cov_ls.get((b, s), ())), s))
