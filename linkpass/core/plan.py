"""Probe plans: which paths every host probes, so that every link is watched by several hosts.

Pure: no sockets, no files, no clock reads; deterministic for a given model, host set and seed.

A planned path is (peer, plane, spine index, core index). It covers, for its reporter, the
directed links of its probes (`node_path(host, peer, plane, spine, core)`) and of their replies,
assumed to return through the same spine and core (`node_path(peer, host, ...)`). So one path
covers both directions of the 2, 4 or 6 physical links it crosses, and localization
(`localize.py`) needs each directed link covered by >= 2 distinct reporters before a fault there
can be called.

Small fleets (<= `full_mesh_max` hosts) get a full mesh: every peer, every plane, every spine.
Larger ones get a sparse plan with `paths_per_plane` (default 3) paths per (host, plane): the
hosts of leaf i probe hosts of the next leaves (i+1, i+2, ... around the ring of leaves that
have hosts), spreading over the spines in turn, so each leaf-spine link gets its own leaf's
probes and the probes arriving from other leaves. In a 3-tier plane the hosts of a pod probe the
hosts at the same place in other pods instead, their paths dealt over every (spine, core) pair of
the pod in turn, so every tier's links get the pod's own probes and the ones arriving from other
pods; each host there gets one path more, inside its pod (see `_Sparse._build_pods`). A repair
pass then adds the few paths that uneven shapes (a short last leaf or pod, more spines or cores
than a leaf's or pod's probes) need to reach 2 reporters everywhere. Total paths grow linearly
with the fleet.

Caps (`caps`: host -> most planned paths it may take, from the probe budget its agent reports,
`plan_cap`) bound what each reporter is given. A full mesh that would exceed one becomes a sparse
plan; the sparse plan splits each capped host's cap over its planes for the first pass, and the
repair pass moves the probes a capped host cannot take to hosts with room left (on any plane).
While links stay short, paths of hosts at their cap that no link needs are dropped and the repair
runs again (twice at most). Links still short of 2 reporters are listed in
`ProbePlan.under_covered`: caps are never exceeded for coverage.

Hosts not in `hosts` are neither probed from nor used as peers: when hosts join or leave, call
`plan_probes` again with the new set. Links that no probe between present hosts can cross (a
leaf with no present host, spines when only one leaf has hosts) cannot be covered.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from linkpass.core.fabric import DOWN, UP, FabricError, FabricModel, directed

# of an agent's probe budget, the share its plan may take; the rest is for its job's own paths
PLAN_BUDGET_SHARE = 0.5


def plan_cap(pps: float, idle_interval_ms: float) -> int | None:
    """The planned paths an agent may take: PLAN_BUDGET_SHARE of its budget's probes per second,
    each planned path probed at its idle rate. None: no cap (pps 0, no ceiling)."""
    if pps <= 0:
        return None
    # pps * ms / 1000 in one division, and a hair up, so 20000 x 100 ms is 1000, not 999
    return max(0, math.floor(PLAN_BUDGET_SHARE * pps * idle_interval_ms / 1000 + 1e-9))


@dataclass(frozen=True)
class PlannedPath:
    peer: str
    plane: int
    spine: int | None  # spine index; None: same-leaf pair, or whichever path discovery finds
    core: int | None = None  # core index in the spine's group, between pods of a 3-tier plane only


@dataclass
class ProbePlan:
    paths: dict[str, list[PlannedPath]] = field(default_factory=dict)  # host -> its paths
    full_mesh: bool = False
    # directed links a probe between present hosts could cross but fewer than 2 reporters do,
    # because caps left no host the room (empty without caps)
    under_covered: list[str] = field(default_factory=list)

    def peers_of(self, host: str) -> list[str]:
        return sorted({p.peer for p in self.paths.get(host, ())})

    @property
    def total_paths(self) -> int:
        return sum(len(v) for v in self.paths.values())

    def to_dict(self) -> dict:
        return {"full_mesh": self.full_mesh, "total_paths": self.total_paths, "under_covered": list(self.under_covered),
                "paths": {h: [[p.peer, p.plane, p.spine] + ([] if p.core is None else [p.core]) for p in ps]
                          for h, ps in self.paths.items()}}


def planned_links(model: FabricModel, host: str, path: PlannedPath) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forward, reverse) directed links of a planned path; with no spine between two leaves,
    only the links every path must cross."""
    if path.spine is None and model.leaf_of(host, path.plane) != model.leaf_of(path.peer, path.plane):
        forward = (model.uplink(host, path.plane).name + ":up", model.uplink(path.peer, path.plane).name + ":down")
        return forward, model.reverse_definite(host, path.plane, path.peer)
    return (model.node_path(host, path.peer, path.plane, path.spine, path.core),
            model.node_path(path.peer, host, path.plane, path.spine, path.core))


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
                seed: int = 0, paths_per_plane: int = 3, caps: Mapping[str, int] | None = None) -> ProbePlan:
    """The probe plan for `hosts` (default: every host of the model), each host given at most
    caps[host] paths (absent: no cap); see the module doc."""
    if hosts is None:
        present = list(model.hosts)
    else:
        wanted = set(hosts)
        unknown = sorted(wanted - set(model.hosts))
        if unknown:
            raise FabricError(f"hosts not in the fleet model: {', '.join(unknown[:5])}")
        present = [h for h in model.hosts if h in wanted]  # model order: deterministic
    present_set = set(present)
    caps = {h: max(0, int(c)) for h, c in (caps or {}).items() if h in present_set}
    on_plane = [[h for h in present if _has_uplink(model, h, plane)] for plane in range(model.planes)]
    if len(present) <= full_mesh_max:
        plan = ProbePlan({h: [] for h in present}, full_mesh=True)
        for plane in range(model.planes):
            _full_mesh(model, plane, on_plane[plane], plan)
        if all(len(plan.paths[h]) <= c for h, c in caps.items()):
            return plan
    plan = ProbePlan({h: [] for h in present}, full_mesh=False)
    used = {h: 0 for h in present}  # paths given so far, over every plane
    planes_of: dict[str, list[int]] = {}
    for plane, hs in enumerate(on_plane):
        for h in hs:
            planes_of.setdefault(h, []).append(plane)
    sparse = []
    for plane in range(model.planes):
        # the first pass gives a capped host an even split of its cap over its planes
        shares = {h: c // len(planes_of[h]) + (planes_of[h].index(plane) < c % len(planes_of[h]))
                  for h, c in caps.items() if plane in planes_of.get(h, ())}
        sp = _Sparse(model, plane, on_plane[plane], seed, paths_per_plane, plan, caps, used)
        sp.build(shares)
        sparse.append(sp)
    for sp in sparse:  # after every plane's first pass: room left on any plane can serve
        sp.repair()
    for _ in range(2):  # caps left links short: free what capped hosts hold for no link, repair again
        if not any(sp.under_covered() for sp in sparse) or not any([sp.prune() for sp in sparse]):
            break
        for sp in sparse:
            sp.repair()
    for ps in plan.paths.values():
        ps.sort(key=lambda p: p.plane)  # stable: per plane, first pass then repairs
    plan.under_covered = sorted(d for sp in sparse for d in sp.under_covered())
    return plan


def _has_uplink(model: FabricModel, host: str, plane: int) -> bool:
    try:
        model.uplink(host, plane)
        return True
    except FabricError:
        return False


def _full_mesh(model: FabricModel, plane: int, hosts: list[str], plan: ProbePlan) -> None:
    spines = range(model.spines_per_pod(plane))
    cores = range(model.cores_per_group(plane))
    leaf = {h: model.leaf_of(h, plane) for h in hosts}
    pod = {h: model.pod_of(leaf[h]) for h in hosts}
    for h in hosts:
        out = plan.paths[h]
        for peer in hosts:
            if peer == h:
                continue
            if leaf[peer] == leaf[h]:
                out.append(PlannedPath(peer, plane, None))
            elif pod[peer] == pod[h]:
                out.extend(PlannedPath(peer, plane, s) for s in spines)
            else:
                out.extend(PlannedPath(peer, plane, s, c) for s in spines for c in cores)


class _Ring:
    """Indices 0..n-1 that can be dropped, walked around from any start: a dropped index is
    skipped through pointers to the next one kept (path halving), so a walk costs what it yields."""

    def __init__(self, keep: list[bool]):
        self.n = len(keep)
        self.next = [i if k else i + 1 for i, k in enumerate(keep)] + [self.n]

    def _find(self, i: int) -> int:
        nxt = self.next
        while nxt[i] != i:
            nxt[i] = nxt[nxt[i]]
            i = nxt[i]
        return i

    def drop(self, i: int) -> None:
        self.next[i] = i + 1

    def around(self, start: int) -> Iterator[int]:
        """Kept indices from `start` to the end, then from 0 up to `start`; one dropped meanwhile
        is not yielded later."""
        for lo, hi in ((start, self.n), (0, start)):
            i = self._find(lo)
            while i < hi:
                yield i
                i = self._find(i + 1)


class _Sparse:
    """One plane's sparse plan, with coverage tracked on host, (group, spine) and (pod, spine,
    core) keys for speed. A group is a leaf with present hosts; a path is keyed (reporter, peer,
    spine, core), spine None within a leaf and core None within a pod."""

    def __init__(self, model, plane, hosts, seed, per_host, plan, caps, used):
        self.model, self.plane, self.per_host, self.seed, self.plan = model, plane, per_host, seed, plan
        self.caps, self.used = caps, used  # shared by every plane: a cap counts paths on all of them
        self.spines = model.spines_per_pod(plane)
        self.cores = model.cores_per_group(plane)
        groups: dict[str, list[str]] = {}
        for h in hosts:
            groups.setdefault(model.leaf_of(h, plane), []).append(h)
        self.leaves = list(groups)
        self.groups = list(groups.values())
        self.group_of = {h: i for i, g in enumerate(self.groups) for h in g}
        self.pod_of_group = [model.pod_of(leaf) if len(self.groups) > 1 else 0 for leaf in self.leaves]
        pods: dict[int, list[int]] = {}
        for i, pod in enumerate(self.pod_of_group):
            pods.setdefault(pod, []).append(i)
        self.pods = list(pods)  # pods with present hosts, in model order
        self.groups_of_pod = pods
        self.hosts = hosts
        # reporter -> how many of its paths cross: a host's uplink / a (group, spine) link /
        # a (pod, spine, core) link
        self.cov_host: dict[str, dict[str, int]] = {h: {} for h in hosts}
        self.cov_ls: dict[tuple[int, int], dict[str, int]] = {}
        self.cov_sc: dict[tuple[int, int, int], dict[str, int]] = {}
        self.planned: dict[tuple[str, str, int | None, int | None], None] = {}  # in the order added
        self.rings: list[_Ring] = []  # while repairing: hosts with room, in plane order, then per group

    def room(self, host: str) -> bool:
        cap = self.caps.get(host)
        return cap is None or self.used[host] < cap

    def add(self, reporter: str, peer: str, spine: int | None, core: int | None = None) -> bool:
        key = (reporter, peer, spine, core)
        if reporter == peer or key in self.planned or not self.room(reporter):
            return False
        self.planned[key] = None
        self.plan.paths[reporter].append(PlannedPath(peer, self.plane, spine, core))
        self.used[reporter] += 1
        if self.rings and not self.room(reporter):  # full now: repairs stop asking it
            self.rings[0].drop(self.order[reporter])
            self.rings[1 + self.group_of[reporter]].drop(self.index_in_group[reporter])
        for cov in self._crossed(reporter, peer, spine, core):
            cov[reporter] = cov.get(reporter, 0) + 1
        return True

    def _crossed(self, reporter: str, peer: str, spine: int | None, core: int | None) -> list[dict[str, int]]:
        out = [self.cov_host[reporter], self.cov_host[peer]]
        if spine is not None:
            ends = (self.group_of[reporter], self.group_of[peer])
            out += [self.cov_ls.setdefault((g, spine), {}) for g in ends]
            if core is not None:
                out += [self.cov_sc.setdefault((self.pod_of_group[g], spine, core), {}) for g in ends]
        return out

    def route(self, reporter: str, peer: str, spine: int) -> tuple[int | None, int | None]:
        """(spine, core) of a path that goes through spine index `spine`: None for what it does
        not reach (no spine within a leaf, no core within a pod); between pods the core whose
        links at both ends have the fewest reporters."""
        a, b = self.group_of[reporter], self.group_of[peer]
        if a == b:
            return None, None
        pa, pb = self.pod_of_group[a], self.pod_of_group[b]
        if pa == pb:
            return spine, None
        return spine, min(range(self.cores), key=lambda c: (len(self.cov_sc.get((pa, spine, c), ()))
                                                            + len(self.cov_sc.get((pb, spine, c), ())), c))

    def prune(self) -> bool:
        """Drop the paths of hosts at their cap that no link needs (each link they cross keeps 2
        reporters without them), so the next repair can give that room to a link short of them.
        Coverage never drops. True if any was dropped."""
        dropped = False
        for key in reversed(list(self.planned)):  # the last added first: repairs before the first pass
            reporter, peer, spine, core = key
            if self.room(reporter):
                continue
            crossed = self._crossed(reporter, peer, spine, core)
            if all(cov[reporter] > 1 or len(cov) > 2 for cov in crossed):
                del self.planned[key]
                self.plan.paths[reporter].remove(PlannedPath(peer, self.plane, spine, core))
                self.used[reporter] -= 1
                for cov in crossed:
                    cov[reporter] -= 1
                    if not cov[reporter]:
                        del cov[reporter]
                dropped = True
        return dropped

    def build(self, shares: Mapping[str, int]) -> None:
        """The first pass; a host in `shares` takes at most that many of its paths here."""
        groups, m, c = self.groups, len(self.groups), self.per_host
        if len(self.pods) > 1:
            self._build_pods(shares)
        elif m == 1:  # one rack: a ring of rack mates, no spine involved
            g = groups[0]
            for j, h in enumerate(g):
                share, added = shares.get(h), 0
                for k in range(1, min(c, len(g) - 1) + 1):
                    if share is not None and added >= share:
                        break
                    added += self.add(h, g[(j + k) % len(g)], None)
        elif m > 1:
            for i, g in enumerate(groups):
                offset = i * c + self.seed
                for j, h in enumerate(g):
                    share, added = shares.get(h), 0
                    for k in range(c):
                        if share is not None and added >= share:
                            break
                        slot = offset + j * c + k
                        # hosts sharing a spine (slot one round of spines apart) head for
                        # different leaves, so no two hosts watch exactly the same links
                        hop = 1 + (k + slot // self.spines) % (m - 1)
                        target = groups[(i + hop) % m]
                        added += self.add(h, target[(j + k) % len(target)], slot % self.spines)

    def _build_pods(self, shares: Mapping[str, int]) -> None:
        """The first pass of a plane of several pods: host x of a pod probes host x of other pods
        (so every host is probed about as often as it probes), its paths through the pod's next
        (spine, core) pair in turn (so every spine-core link of the pod carries its probes). Its
        last path stays in the pod, to the host at its place under the next leaf: the replies to
        it cross few links, so when they are lost the localizer can weigh them (a reply lost
        between pods may have crossed any of thousands of links, and is not weighed); that is
        what corroborates a host's uplink upwards, which its own probes alone cannot.

        That path comes on top of the host's `per_host` paths between pods: the replies between
        pods are not weighed, so the probes are a spine-core link's only witnesses. Each
        direction of one gets per_host x the pod's hosts / its (spine, core) pairs reporters: 3
        at 131 072 GPUs, so one noisy agent saying good still leaves 2 that say bad."""
        members = [[h for g in self.groups_of_pod[pod] for h in self.groups[g]] for pod in self.pods]
        n, c, width = len(self.pods), self.per_host + 1, self.spines * self.cores
        for o, hosts in enumerate(members):
            own = self.groups_of_pod[self.pods[o]]
            # each host's pod-mate: the host at its place under the pod's next leaf (one leaf: the next host on it)
            home = {}
            for gi, g in enumerate(own):
                nxt = self.groups[own[(gi + 1) % len(own)]]
                for j, h in enumerate(self.groups[g]):
                    home[h] = nxt[(j + (len(own) == 1)) % len(nxt)]
            q = self.seed  # the pod's paths between pods so far: its next (spine, core) pair
            # (pair, pod offset) taken: two of a pod's paths through one pair into one other pod
            # would make that pod's core-spine link and this pod's spine-core link share those
            # witnesses, and a fault on one could be read as the other
            taken: set[tuple[int, int]] = set()
            for x, h in enumerate(hosts):
                share, added = shares.get(h), 0
                for k in range(c):
                    if share is not None and added >= share:
                        break
                    if k == c - 1:
                        peer = home[h]
                        added += self.add(h, peer, *self.route(h, peer, (x + self.seed) % self.spines))
                        continue
                    pair = q % width
                    q += 1
                    # each k a different pod; a host's neighbours in the pod head for other pods still
                    off = (k + x // self.spines) % (n - 1)
                    for _ in range(n - 1):  # bounded: past that, every pod is taken for this pair
                        if (pair, off) not in taken:
                            break
                        off = (off + 1) % (n - 1)
                    taken.add((pair, off))
                    target = members[(o + 1 + off) % n]
                    added += self.add(h, target[x % len(target)], pair % self.spines, pair // self.spines)

    def repair(self) -> None:
        """Paths for every uplink, leaf-spine and spine-core link short of 2 reporters, from hosts
        with room (every host without caps): the first ones in turn after the link's own."""
        self.order = {h: n for n, h in enumerate(self.hosts)}
        self.index_in_group = {h: j for g in self.groups for j, h in enumerate(g)}
        self.rings = [_Ring([self.room(h) for h in self.hosts])] + [_Ring([self.room(h) for h in g])
                                                                   for g in self.groups]
        for h in self.hosts:  # every uplink: its host and one more, or two others
            if len(self.cov_host[h]) >= 2:
                continue
            for n in self.rings[0].around(self.order[h] + 1):
                if len(self.cov_host[h]) >= 2:
                    break
                prober = self.hosts[n]
                if prober != h and prober not in self.cov_host[h]:
                    self.add(prober, h, *self._least_covered_route(prober, h))
            if len(self.cov_host[h]) < 2 and h not in self.cov_host[h] and len(self.hosts) > 1:
                peer = self.hosts[(self.order[h] + 1) % len(self.hosts)]  # it probes out itself
                self.add(h, peer, *self._least_covered_route(h, peer))
        m = len(self.groups)
        if m < 2:
            return
        for i, g in enumerate(self.groups):
            for s in range(self.spines):
                covered = self.cov_ls.setdefault((i, s), {})
                if len(covered) >= 2:
                    continue
                # reporters: this leaf's hosts probing out, then other leaves' hosts probing in
                for other in [(i + k) % m for k in range(1, m)]:
                    for j in self.rings[1 + i].around(0):
                        if len(covered) >= 2:
                            break
                        reporter = g[j]
                        if reporter not in covered:
                            peers = self.groups[other]
                            peer = peers[s % len(peers)]
                            self.add(reporter, peer, *self.route(reporter, peer, s))
                    for j in self.rings[1 + other].around(0):
                        if len(covered) >= 2:
                            break
                        reporter = self.groups[other][j]
                        if reporter not in covered:
                            peer = g[s % len(g)]
                            self.add(reporter, peer, *self.route(reporter, peer, s))
                    if len(covered) >= 2:
                        break
        if len(self.pods) > 1:
            self._repair_cores()

    def _repair_cores(self) -> None:
        """Spine-core links short of 2 reporters: the pod's hosts with room probing out through
        them, then other pods' hosts probing in."""
        n = len(self.pods)
        for o, pod in enumerate(self.pods):
            own = self.groups_of_pod[pod]
            for s in range(self.spines):
                for core in range(self.cores):
                    covered = self.cov_sc.setdefault((pod, s, core), {})
                    if len(covered) >= 2:
                        continue
                    for k in range(1, n):
                        other = self.groups_of_pod[self.pods[(o + k) % n]]
                        turn = s * self.cores + core  # spread the repairs over the pod's hosts
                        for inside, outside in ((own, other), (other, own)):
                            for gi in inside[turn % len(inside):] + inside[:turn % len(inside)]:
                                for j in self.rings[1 + gi].around(turn // len(inside) % len(self.groups[gi])):
                                    if len(covered) >= 2:
                                        break
                                    reporter = self.groups[gi][j]
                                    if reporter not in covered:
                                        peers = self.groups[outside[(s + core) % len(outside)]]
                                        self.add(reporter, peers[(s + core) % len(peers)], s, core)
                                if len(covered) >= 2:
                                    break
                        if len(covered) >= 2:
                            break

    def under_covered(self) -> list[str]:
        """Directed links of this plane a probe between its hosts could cross, short of 2 reporters."""
        names = []
        if len(self.hosts) > 1:
            names += [self.model.uplink(h, self.plane).name for h in self.hosts if len(self.cov_host[h]) < 2]
        if len(self.groups) > 1:
            for i, leaf in enumerate(self.leaves):
                for s in range(self.spines):
                    if len(self.cov_ls.get((i, s), ())) < 2:
                        try:
                            names.append(self.model.leaf_spine(leaf, s).name)
                        except FabricError:
                            pass  # this leaf has no link to that spine
        if len(self.pods) > 1:
            for pod in self.pods:
                for s in range(self.spines):
                    spine = self.model.spine_of_pod(self.plane, pod, s)
                    for core in range(self.cores):
                        if len(self.cov_sc.get((pod, s, core), ())) < 2:
                            names.append(self.model.spine_core(spine, core).name)
        return [directed(n, d) for n in names for d in (UP, DOWN)]

    def _least_covered_route(self, reporter: str, peer: str) -> tuple[int | None, int | None]:
        a, b = self.group_of[reporter], self.group_of[peer]
        if a == b:
            return None, None
        spine = min(range(self.spines), key=lambda s: (len(self.cov_ls.get((a, s), ())) + len(self.cov_ls.get((b, s), ())), s))
        return self.route(reporter, peer, spine)
