"""The fleet split over S coordinator shards and a root, and localization split the same way.

Pure: no sockets, no Ray, no clock. The coordinator uses the shard map (which shard takes which
agent) and the split localization: a sharded coordinator's root holds a ShardedLocalizer whose
parts run in its shards (coordinator/shard.py, ShardParts); the simulator and the scale benchmark
run every part in one process (LocalParts).

Shard map
---------
A shard owns whole leaves, and whole pods while there are at least as many pods as shards: a
host belongs to the shard of its leaf on the lowest plane it has an uplink on (hosts of a
rail-optimized fleet sit under the same leaf position in every plane, so that one choice puts
a host's every uplink in its shard). Leaves are taken in pod order and dealt in contiguous runs
of about equal host counts; with S no more than the pods, the runs end on pod boundaries. Hosts
with no uplink at all go to the last shard. The map is deterministic: every actor that builds
it from the same model and S gets the same one (`digest` says so in one string).

Localization
------------
Every directed link has one owner: a host's uplink the host's shard, a leaf's links to its
spines the leaf's shard, a spine's links to the cores the shard of the spine's pod; a leaf or
pod whose hosts are in several shards (more shards than pods: pods are split) has its links
owned by the root. A path's evidence goes to the owner of every link it crosses or, its
replies being untraced, may cross: the shards of its two ends, and the root when it runs
between pods and one of them is split. So each owner holds every path over each link it owns,
the same evidence one fleet-wide localizer would weigh there, and names only its own links
(a fault on another's link is that one's to name, from the whole of its evidence). Findings are
the union. With one shard, it owns every link and holds every path: today's fleet-wide
localizer, decision for decision. The work divides by the shards: a shard holds its hosts'
paths, a path between shards is held by both, the root holds what crosses split pods.

A place learns its evidence when it is next asked (`Parts.run`), or sooner when it is sent
(`send`): the changes since, the last word per path, so a part in another process gets each
change once.

Why whole paths and not per-link counts go to each owner: explaining a bad path needs to know
which other links it crossed (a spine link is told from the leaf link before it by paths that
cross one and not the other); a count of bad paths per link cannot tell them apart. A path is
sent once with its links and afterwards only when its verdict changes, which is compact.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Protocol

from .fabric import HOST_LEAF, LEAF_SPINE, FabricError, FabricModel, split_directed
from .localize import Finding, Localizer, Observation

ROOT = -1  # the place of a path between shards


class ShardError(ValueError):
    pass


class ShardMap:
    """Which shard each host belongs to (see the module doc)."""

    def __init__(self, model: FabricModel, shards: int):
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ShardError(f"shards: expected a whole number of at least 1, got {shards!r}")
        units = _leaf_units(model)  # [(pod key, hosts)] in pod order, unattached hosts last
        if shards > max(1, len(units)):
            raise ShardError(f"shards: {shards} is more than the fabric's {len(units)} leaves; a shard owns at "
                             f"least one leaf (use at most {max(1, len(units))})")
        self.shards = shards
        self.model = model
        pods = {pod for pod, _ in units}
        self.by_pod = shards <= len(pods)
        self._shard: dict[str, int] = {}
        self._hosts: list[list[str]] = [[] for _ in range(shards)]
        for k, run in enumerate(_runs(units, shards, whole_pods=self.by_pod)):
            for _, hosts in run:
                for h in hosts:
                    self._shard[h] = k
                    self._hosts[k].append(h)
        # the owners of switches' links: a leaf's (a pod's) shard when all its hosts are in one,
        # else the root
        self._leaf_owner: dict[str, int] = {}
        self._pod_owner: dict[tuple[int, int], int] = {}  # (plane, pod) -> owner
        self._pod: dict[str, tuple[int, int]] = {}  # leaf -> (plane, pod)
        for lk in model.links.values():
            if lk.kind != HOST_LEAF:
                continue
            k = self._shard[lk.a]
            self._leaf_owner[lk.b] = k if self._leaf_owner.get(lk.b, k) == k else ROOT
            if lk.b not in self._pod:
                try:
                    self._pod[lk.b] = (lk.plane, model.pod_of(lk.b))
                except FabricError:  # a leaf meeting no spine: no links above it
                    pass
        for leaf, k in self._leaf_owner.items():
            pod = self._pod.get(leaf)
            if pod is not None:
                self._pod_owner[pod] = k if self._pod_owner.get(pod, k) == k else ROOT
        # no switch link left to the root: a path's places are its two ends' shards, nothing more
        self._ends_only = ROOT not in self._leaf_owner.values() and ROOT not in self._pod_owner.values()
        self._spine_pod: dict[str, tuple[int, int]] = {}  # spine -> (plane, pod)
        for lk in model.links.values():
            if lk.kind == LEAF_SPINE and lk.a in self._pod:
                self._spine_pod[lk.b] = self._pod[lk.a]

    def shard_of(self, host: str) -> int:
        try:
            return self._shard[host]
        except KeyError:
            raise ShardError(f"host {host!r} is not in the fabric model, so it belongs to no shard") from None

    def hosts_of(self, shard: int) -> list[str]:
        return list(self._hosts[shard])

    def sizes(self) -> list[int]:
        return [len(h) for h in self._hosts]

    def owner(self, directed_link: str) -> int:
        """The shard (or ROOT) that names faults on this directed link (see the module doc)."""
        lk = self.model.link(split_directed(directed_link)[0])
        if lk.kind == HOST_LEAF:
            return self._shard[lk.a]
        if lk.kind == LEAF_SPINE:
            return self._leaf_owner.get(lk.a, ROOT)
        pod = self._spine_pod.get(lk.a)
        return ROOT if pod is None else self._pod_owner.get(pod, ROOT)

    def places(self, reporter: str, plane: int, peer: str | None) -> tuple[int, ...]:
        """The owners of the links a path from `reporter` to `peer` on `plane` crosses or may
        cross (its replies'), each once: where its evidence goes. A path to no known host goes
        to the reporter's shard."""
        out = [self._shard.get(reporter, ROOT)]
        if peer is None or peer not in self._shard:
            return tuple(out)
        out.append(self._shard[peer])
        if self._ends_only:  # (every leaf's and pod's links are its hosts' shard's)
            return tuple(out) if out[0] != out[1] else (out[0],)
        try:
            ends = (self.model.leaf_of(reporter, plane), self.model.leaf_of(peer, plane))
        except FabricError:
            return tuple(dict.fromkeys(out))
        out += (self._leaf_owner.get(ends[0], ROOT), self._leaf_owner.get(ends[1], ROOT))
        pods = (self._pod.get(ends[0]), self._pod.get(ends[1]))
        if pods[0] != pods[1]:  # between pods: the spine-core links of both
            out += (self._pod_owner.get(pods[0], ROOT), self._pod_owner.get(pods[1], ROOT))
        return tuple(dict.fromkeys(out))

    def digest(self) -> str:
        """One string naming this exact assignment (equal maps, equal digests)."""
        h = hashlib.sha256(str(self.shards).encode())
        for k, hosts in enumerate(self._hosts):
            h.update(f"|{k}:".encode() + ",".join(hosts).encode())
        return h.hexdigest()[:16]


def _leaf_units(model: FabricModel) -> list[tuple[tuple, list[str]]]:
    """Hosts grouped by their leaf on their lowest plane, leaves in (plane, pod, first seen) order."""
    by_leaf: dict[str, list[str]] = {}
    order: dict[str, tuple] = {}
    unattached: list[str] = []
    for host in model.hosts:
        for plane in range(model.planes):
            try:
                leaf = model.leaf_of(host, plane)
            except FabricError:
                continue
            if leaf not in by_leaf:
                try:
                    pod = model.pod_of(leaf)
                except FabricError:  # a leaf meeting no spine: a pod of its own
                    pod = -1
                order[leaf] = (plane, pod, len(order))
                by_leaf[leaf] = []
            by_leaf[leaf].append(host)
            break
        else:
            unattached.append(host)
    units = [((order[leaf][0], order[leaf][1]), by_leaf[leaf]) for leaf in sorted(by_leaf, key=order.__getitem__)]
    if unattached:
        if units:
            units[-1] = (units[-1][0], units[-1][1] + unattached)
        else:
            units = [((0, 0), unattached)]
    return units


def _runs(units: list[tuple[tuple, list[str]]], shards: int, whole_pods: bool) -> list[list]:
    """`units` dealt into `shards` contiguous runs of about equal host counts; with `whole_pods`
    a run only ends where a pod does."""
    if whole_pods:
        groups: list[list] = []
        for unit in units:
            if groups and groups[-1][0][0] == unit[0]:
                groups[-1].append(unit)
            else:
                groups.append([unit])
    else:
        groups = [[u] for u in units]
    total = sum(len(h) for g in groups for _, h in g)
    runs: list[list] = [[] for _ in range(shards)]
    k, taken = 0, 0
    for i, g in enumerate(groups):
        size = sum(len(h) for _, h in g)
        left = len(groups) - i  # groups still to deal, this one included
        # move on when this run has its share, as long as every later run can still get a group
        if runs[k] and k < shards - 1 and (taken + size / 2 > total * (k + 1) / shards or left <= shards - 1 - k):
            k += 1
        runs[k].extend(g)
        taken += size
    return runs


class Part:
    """One place's share of split localization: the evidence of the paths that may cross its
    links, and its answers in the rounds (`ShardedLocalizer.findings`). The root runs one for
    itself; a shard actor runs its own (coordinator/shard.py, PartHost)."""

    def __init__(self, model: FabricModel, shard_map: ShardMap, place: int, **localizer_options):
        self.map = shard_map
        self.place = place
        self.loc = Localizer(model, **localizer_options)

    def apply(self, changes: Iterable[Observation | str]) -> None:
        """An Observation records (or replaces) its path; a key alone forgets that path."""
        for c in changes:
            if isinstance(c, str):
                self.loc.forget(c)
            else:
                self.loc.update(c)

    def __len__(self) -> int:
        return len(self.loc)

    def count(self) -> int:
        """The paths held (a question that costs nothing: whatever came before it is applied)."""
        return len(self.loc)

    def cleared(self) -> tuple[set[str], set[str], dict[str, int]]:
        """The first round: the links the bad paths held here name, those of them this place owns
        and its evidence exonerates, and each reporter's claims here."""
        with self.loc.pause():  # as in Localizer.explain
            named = self.loc.named()
            return named, self.loc.cleared(d for d in named if self.map.owner(d) == self.place), self.loc.claim_counts()

    def explain(self, known: frozenset[str] | set[str] = frozenset(), reporter_claims: dict[str, int] | None = None,
                suspects: frozenset[str] | set[str] = frozenset(),
                cleared: frozenset[str] | set[str] = frozenset()) -> tuple[set[str], list[Finding]]:
        """The later rounds: this place's suspects and its findings on the links it owns, given
        what the others know (Localizer.explain)."""
        found, fs = self.loc.explain(known, reporter_claims, suspects, cleared)
        return found, [f for f in fs if self.map.owner(f.directed) == self.place]


# what a place is asked in one round: (its evidence changes since the last call, the Part method, its arguments)
Call = tuple[list, str, tuple]


class Parts(Protocol):
    """Where the places' Parts run: `run` gives each place in `calls` its changes, calls the
    method and returns the answers by place (all of them: a place it cannot reach it answers
    some other way, as LocalParts does in one process). `round_`: which of findings()' three."""

    def run(self, calls: dict[int, Call], round_: int) -> dict[int, object]: ...

    def send(self, changes: dict[int, list]) -> None:
        """Each place's evidence changes now, no question asked and no answer awaited."""


class LocalParts:
    """Every place's Part in this process, asked one after another (the simulator, the benchmark
    and the tests). With `clock` set, `took` says per place how long each round took."""

    def __init__(self, model: FabricModel, shard_map: ShardMap, **localizer_options):
        self.parts = {p: Part(model, shard_map, p, **localizer_options) for p in (*range(shard_map.shards), ROOT)}
        self.clock = None  # seconds (the benchmark's); None: not timed
        self.took: dict[int, list[float]] = {}

    def run(self, calls: dict[int, Call], round_: int) -> dict[int, object]:
        out = {}
        for p, (changes, method, args) in calls.items():
            t = self.clock() if self.clock is not None else 0.0
            part = self.parts[p]
            part.apply(changes)
            out[p] = getattr(part, method)(*args)
            if self.clock is not None:
                self.took.setdefault(p, [0.0, 0.0, 0.0])[round_] += self.clock() - t
        return out

    def send(self, changes: dict[int, list]) -> None:
        for p, c in changes.items():
            self.parts[p].apply(c)


class ShardedLocalizer:
    """Localization split over the shards and the root as the module doc says, with the same
    update / forget / findings as one Localizer. The places' Parts run where `parts` puts them:
    all in this process by default, in the shard actors at a sharded coordinator's root."""

    def __init__(self, model: FabricModel, shard_map: ShardMap, parts: Parts | None = None, **localizer_options):
        self.model = model
        self.map = shard_map
        self.parts = parts if parts is not None else LocalParts(model, shard_map, **localizer_options)
        # path key -> (the links its places were found from, the places holding it)
        self._where: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}
        # not yet sent to each place: path key -> its Observation, or the key to forget it (the
        # last word per path: a place told nothing for hours gets each path once, not its history)
        self._changes: dict[int, dict[str, Observation | str]] = {p: {} for p in self.places()}
        # each place's first round, kept until its evidence changes: place -> (named, cleared, claims)
        self._cleared: dict[int, tuple[set[str], set[str], dict[str, int]]] = {}
        # place -> (the cleared links its claims named, (its suspects, its findings))
        self._first: dict[int, tuple[frozenset[str], tuple[set[str], list[Finding]]]] = {}

    @property
    def took(self) -> dict[int, list[float]]:
        """Per place explained in the last findings(), seconds per round (LocalParts with a clock)."""
        return self.parts.took if isinstance(self.parts, LocalParts) else {}

    def places_of(self, obs: Observation) -> tuple[int, ...]:
        ends = [None, None]
        for n, d in enumerate((obs.forward[:1] + obs.forward[-1:]) if obs.forward else ()):
            lk = self.model.link_at(d)
            if lk is not None and lk.kind == HOST_LEAF:
                ends[n] = lk
        if ends[0] is None:
            return (self.map.shard_of(obs.reporter),)
        return self.map.places(obs.reporter, ends[0].plane, None if ends[1] is None else ends[1].a)

    def update(self, obs: Observation) -> tuple[int, ...]:
        """Record `obs` with every place it belongs to (replacing the path's earlier observation,
        wherever that was); returns those places. They learn it at the next send() or findings()."""
        seen, was = self._where.get(obs.key, (None, None))
        # the same links as before: the same places (the common case: a verdict changed)
        places = was if seen == obs.forward else self.places_of(obs)
        if was is not None and was != places:
            for p in set(was) - set(places):
                self._changes[p][obs.key] = obs.key
                self._stale(p)
        self._where[obs.key] = (obs.forward, places)
        for p in places:
            self._changes[p][obs.key] = obs
            self._stale(p)
        return places

    def _stale(self, place: int) -> None:
        self._first.pop(place, None)
        self._cleared.pop(place, None)

    def forget(self, key: str) -> None:
        for p in self._where.pop(key, ((), ()))[1]:
            self._changes[p][key] = key
            self._stale(p)

    def __len__(self) -> int:
        return len(self._where)

    def held(self) -> list[int]:
        """Observations each place holds, the shards' then the root's."""
        out = [0] * (self.map.shards + 1)
        for _, places in self._where.values():
            for p in places:
                out[p] += 1  # ROOT (-1) counts last
        return out

    def places(self) -> tuple[int, ...]:
        return (*range(self.map.shards), ROOT)

    def send(self) -> None:
        """Hand every place its evidence changes now, asking nothing: a sharded coordinator's root
        does it each tick, so its shards take reports in as they arrive (side by side, outside
        the root) rather than within the next findings()."""
        batch = {p: list(c.values()) for p, c in self._changes.items() if c}
        for p in batch:
            self._changes[p] = {}
        if batch:
            self.parts.send(batch)

    def _ask(self, round_: int, calls: dict[int, tuple[str, tuple]]) -> dict[int, object]:
        """One round: each place in `calls` gets its changes with its question, all at once."""
        batch = {}
        for p, (method, args) in calls.items():
            batch[p] = (list(self._changes[p].values()), method, args)
            self._changes[p] = {}
        return self.parts.run(batch, round_) if batch else {}

    def cleared_at(self, place: int) -> tuple[set[str], set[str], dict[str, int]]:
        """Part.cleared at `place`, now."""
        return self._ask(0, {place: ("cleared", ())})[place]

    def explain_at(self, place: int, known: frozenset[str] | set[str] = frozenset(),
                   reporter_claims: dict[str, int] | None = None,
                   suspects: frozenset[str] | set[str] = frozenset(),
                   cleared: frozenset[str] | set[str] = frozenset()) -> tuple[set[str], list[Finding]]:
        """Part.explain at `place`, now."""
        return self._ask(1, {place: ("explain", (known, reporter_claims, suspects, cleared))})[place]

    def reporter_claims(self) -> dict[str, int]:
        """Reporter -> its claims over all its paths: its own shard holds every one of them."""
        self._first_round()
        out: dict[str, int] = {}
        for p, (_, _, claims) in self._cleared.items():
            if p != ROOT:
                for r, n in claims.items():
                    out[r] = max(out.get(r, 0), n)
        return out

    def _first_round(self) -> None:
        if isinstance(self.parts, LocalParts):
            self.parts.took = {}  # what this findings() call explains
        stale = {p: ("cleared", ()) for p in self.places() if p not in self._cleared}
        self._cleared.update(self._ask(0, stale))

    def findings(self) -> list[Finding]:
        """Three rounds, each asking the places it needs at once. First each place says
        which of its links the bad paths name are exonerated by its evidence (the whole of theirs).
        Then each names its links and its suspects, those links counting as exonerated everywhere
        and each reporter's claims counted over all its paths (its home shard's count). Then the
        places that named any explain again, given the suspects found anywhere and the faults the
        others named on more bad paths: a noisy agent seen here by one path is judged by all of
        it, and a claim shared with another owner's fault does not make one of this place's links
        look guilty (its view of the other's link is partial, the owner's whole). A place takes
        the first two rounds again only when its evidence, or what the others cleared of the links
        its claims name, changed."""
        counts = self.reporter_claims()  # the first round
        cleared = frozenset().union(*(c for _, c, _ in self._cleared.values()))
        second = {}
        for p in self.places():
            mine = cleared & self._cleared[p][0]  # what of it this place's claims name
            if p not in self._first or self._first[p][0] != mine:
                second[p] = mine
        answers = self._ask(1, {p: ("explain", (frozenset(), counts, frozenset(), mine))
                                for p, mine in second.items()})
        for p, mine in second.items():
            self._first[p] = (mine, answers[p])
        suspects = frozenset().union(*(s for _, (s, _) in self._first.values()))
        named = {p: fs for p, (_, (_, fs)) in self._first.items()}
        third = self._ask(2, {p: ("explain", (named_elsewhere(named, p), counts, suspects, cleared))
                              for p in self.places() if named[p]})
        return merge_findings(fs for _, fs in third.values())


def named_elsewhere(named: dict[int, list[Finding]], place: int) -> frozenset[str]:
    """The directed links (with their alternatives) other places named on more bad paths than
    the weakest finding of `place`: the whole evidence of a fault's owner outweighs the share of
    it another place saw (an owner seeing less than a link it owns would not give way)."""
    own = named.get(place) or []
    if not own:
        return frozenset()
    weakest = min(f.bad_paths for f in own)
    return frozenset(d for p, fs in named.items() if p != place for f in fs if f.bad_paths > weakest
                     for d in (f.directed, *f.alternatives))


def merge_findings(parts: Iterable[list[Finding]]) -> list[Finding]:
    """The shards' and the root's findings as one list, most confident first as Localizer gives
    (a directed link has one owner; were it named twice, the finding with more bad paths stays)."""
    best: dict[str, Finding] = {}
    for findings in parts:
        for f in findings:
            held = best.get(f.directed)
            if held is None or (f.bad_paths, f.confidence) > (held.bad_paths, held.confidence):
                best[f.directed] = f
    return sorted(best.values(), key=lambda f: (-f.confidence, -f.bad_paths, f.directed))
