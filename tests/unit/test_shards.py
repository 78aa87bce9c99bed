"""The fleet split over coordinator shards and a root (pure): the map, who owns which link,
where a path's evidence goes, and localization split that way against one localizer."""
from __future__ import annotations

import random

import pytest

from support.localize import untraced_observations

from linkpass.core.fabric import rail_optimized, three_tier
from linkpass.core.localize import Localizer, Observation, localize
from linkpass.core.plan import plan_probes
from linkpass.coordinator.shard import PartHost, PartLost, ShardParts, ShardUnreachable
from linkpass.core.shards import ROOT, LocalParts, ShardedLocalizer, ShardError, ShardMap, merge_findings


MODEL2 = rail_optimized(64, 2, 8, 4)  # 8 leaves of 8 hosts per plane, 4 spines, one pod
MODEL3 = three_tier(256, 2, 4, 4, 4, 4)  # per plane 64 leaves, 16 pods of 4 leaves and 4 spines
PLAN3 = plan_probes(MODEL3)


def test_one_shard_holds_the_whole_fleet():
    m = ShardMap(MODEL3, 1)
    assert m.sizes() == [256] and m.by_pod
    assert {m.owner(f"{n}:{d}") for n in MODEL3.links for d in ("up", "down")} == {0}


@pytest.mark.parametrize("shards", [2, 3, 4, 16])
def test_shards_own_whole_pods_while_there_are_enough(shards):
    m = ShardMap(MODEL3, shards)
    assert m.by_pod
    assert sum(m.sizes()) == 256 and max(m.sizes()) - min(m.sizes()) <= 16  # a pod is 16 hosts
    for plane in range(2):
        for leaf in {MODEL3.leaf_of(h, plane) for h in MODEL3.hosts}:
            pod = MODEL3.pod_of(leaf)
            mates = [h for h in MODEL3.hosts if MODEL3.pod_of(MODEL3.leaf_of(h, plane)) == pod]
            assert len({m.shard_of(h) for h in mates}) == 1, (leaf, pod)
    # every link has a shard for owner, none the root: no pod is split
    assert ROOT not in {m.owner(f"{n}:up") for n in MODEL3.links}


def test_more_shards_than_pods_split_pods_and_the_root_owns_their_core_links():
    m = ShardMap(MODEL3, 32)  # 16 pods per plane
    assert not m.by_pod and m.sizes() == [8] * 32  # two leaves of 4 hosts each
    owners = {MODEL3.link(n).kind: set() for n in MODEL3.links}
    for n, lk in MODEL3.links.items():
        owners[lk.kind].add(m.owner(f"{n}:down"))
    assert owners["spine-core"] == {ROOT}
    assert ROOT not in owners["host-leaf"] | owners["leaf-spine"]


@pytest.mark.parametrize("model,shards", [(MODEL3, 4), (MODEL3, 16), (MODEL3, 32), (MODEL2, 3)])
def test_places_are_the_owners_of_what_a_path_may_cross(model, shards):
    m = ShardMap(model, shards)
    rng = random.Random(shards)
    for _ in range(300):
        a, b = rng.sample(model.hosts, 2)
        plane = rng.randrange(model.planes)
        owners = {m.shard_of(a), m.shard_of(b)}
        for spine in range(model.spines_per_pod(plane)):
            for core in range(max(1, model.cores_per_group(plane))):
                for d in model.node_path(a, b, plane, spine, core) + model.node_path(b, a, plane, spine, core):
                    owners.add(m.owner(d))
        assert set(m.places(a, plane, b)) == owners and len(m.places(a, plane, b)) == len(owners)
        assert m.places(a, plane, b)[0] == m.shard_of(a)  # the reporter's own shard first


def test_the_map_is_the_same_wherever_it_is_built():
    a, b = ShardMap(MODEL3, 5), ShardMap(three_tier(256, 2, 4, 4, 4, 4), 5)
    assert a.digest() == b.digest() and [a.hosts_of(k) for k in range(5)] == [b.hosts_of(k) for k in range(5)]
    assert ShardMap(MODEL3, 4).digest() != a.digest()


def test_bad_shard_counts_are_refused_by_name():
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ShardError, match="shards: expected a whole number"):
            ShardMap(MODEL2, bad)
    with pytest.raises(ShardError, match="more than the fabric's 8 leaves"):
        ShardMap(MODEL2, 9)
    with pytest.raises(ShardError, match="belongs to no shard"):
        ShardMap(MODEL2, 2).shard_of("h999")


def test_a_path_goes_to_the_owner_of_every_link_it_may_cross():
    m = ShardMap(MODEL3, 16)  # one pod each
    a, b = "h0", "h255"  # first and last pod
    assert m.shard_of(a) == 0 and m.shard_of(b) == 15
    assert m.places(a, 0, "h1") == (0,)  # same leaf
    assert m.places(a, 0, b) == (0, 15)  # the core links of both pods are theirs
    split = ShardMap(MODEL3, 32)
    assert split.places(a, 0, b) == (0, 31, ROOT)  # pods split: the root holds paths between them
    assert split.places(a, 0, "h8") == (0, 1)  # the same pod, another shard: no core link
    assert split.places(a, 0, None) == (0,)


def sharded_found(loc, obs):
    for o in obs:
        loc.update(o)
    return {f.directed for f in loc.findings()}


@pytest.mark.parametrize("shards", [1, 4, 32])
@pytest.mark.parametrize("tier", ["host-leaf", "leaf-spine", "spine-core"])
def test_sharded_localization_finds_what_one_localizer_finds(shards, tier):
    rng = random.Random(f"{shards}{tier}")
    noisy = set(rng.sample(sorted(MODEL3.hosts), 3))  # ~1 %
    for name in rng.sample(sorted(MODEL3.links_by_tier()[tier]), 4):
        truth = {f"{name}:up", f"{name}:down"} if rng.random() < 0.5 else {f"{name}:{rng.choice(('up', 'down'))}"}
        obs = untraced_observations(MODEL3, PLAN3, truth, noisy=noisy, seed=rng.randrange(100))
        one = {f.directed for f in localize(MODEL3, obs)}
        loc = ShardedLocalizer(MODEL3, ShardMap(MODEL3, shards))
        assert sharded_found(loc, obs) == one == truth, (shards, truth)


def test_one_shard_decides_as_one_localizer_does():
    rng = random.Random(3)
    for _ in range(5):
        truth = {f"{rng.choice(sorted(MODEL3.links))}:{rng.choice(('up', 'down'))}" for _ in range(2)}
        obs = untraced_observations(MODEL3, PLAN3, truth, noisy=set(rng.sample(sorted(MODEL3.hosts), 3)))
        loc = ShardedLocalizer(MODEL3, ShardMap(MODEL3, 1))
        for o in obs:
            loc.update(o)
        assert [f.as_dict() for f in loc.findings()] == [f.as_dict() for f in localize(MODEL3, obs)]
        assert loc.held() == [len(obs), 0]


def test_a_noisy_agent_is_judged_by_all_of_its_paths():
    # h6 (shard 0) and h238 (shard 3) are noisy; claims of both name p1s18-p1c10:up, owned by
    # shard 1, beside one true claim over it (h78's). Shard 1 sees too few of their paths to
    # suspect them: on its own evidence, three reporters name that link. Judged by all of their
    # paths, the places that hold the rest, they are suspects and their claims go.
    truth = {"p1l35-p1s34:down"}
    obs = untraced_observations(MODEL3, PLAN3, truth, noisy={"h6", "h37", "h238"}, seed=37)
    loc = ShardedLocalizer(MODEL3, ShardMap(MODEL3, 4))
    assert sharded_found(loc, obs) == truth
    owner = loc.map.owner("p1s18-p1c10:up")
    assert owner == 1 and {loc.map.shard_of("h6"), loc.map.shard_of("h238")} == {0, 3}
    alone = loc.explain_at(owner, reporter_claims=loc.reporter_claims())[1]
    assert [sorted(f.reporters) for f in alone if f.directed == "p1s18-p1c10:up"] == [["h238", "h6", "h78"]]


def test_a_fault_seen_by_another_shard_is_named_by_its_owner_only():
    # paths from pod 0 into pod 1 cross pod 1's links; pod 0's shard sees part of their evidence,
    # which, before the second round, made one of its own links look guilty
    m = ShardMap(MODEL3, 16)
    truth = {"p0l4-p0s4:down", "p0l4-p0s4:up"}  # pod 1's leaf 4 to its first spine, cut
    obs = untraced_observations(MODEL3, PLAN3, truth, seed=5)
    loc = ShardedLocalizer(MODEL3, m)
    assert sharded_found(loc, obs) == truth
    owner = m.owner("p0l4-p0s4:up")
    assert {f.directed for f in loc.explain_at(owner)[1]} == truth
    assert all(loc.explain_at(p)[1] == [] for p in loc.places() if p != owner)


def test_update_moves_a_path_and_forget_takes_it_back():
    m = ShardMap(MODEL3, 16)
    loc = ShardedLocalizer(MODEL3, m)
    near = Observation("h0", "h0/1", MODEL3.node_path("h0", "h1", 0, None), None, False)
    far = Observation("h0", "h0/1", MODEL3.node_path("h0", "h255", 0, 1, 2), None, True, "forward")
    assert loc.update(near) == (0,)
    assert loc.held()[0] == 1 and sum(loc.held()) == 1
    assert loc.update(far) == (0, 15)  # the same path, now to another pod: both ends' shards
    assert loc.held()[0] == 1 and loc.held()[15] == 1 and len(loc) == 1
    loc.forget("h0/1")
    assert sum(loc.held()) == 0 and len(loc) == 0


def test_localizer_known_links_explain_their_claims():
    obs = untraced_observations(MODEL3, PLAN3, {"p0s2-p0c8:up"})
    loc = Localizer(MODEL3)
    for o in obs:
        loc.update(o)
    assert [f.directed for f in loc.findings()] == ["p0s2-p0c8:up"]
    assert loc.explain(known={"p0s2-p0c8:up"})[1] == []  # its claims are explained by the known fault


def test_merge_keeps_one_finding_per_link_most_confident_first():
    obs = untraced_observations(MODEL3, PLAN3, {"h3-p0l0:up", "p0s2-p0c8:up"})
    fs = localize(MODEL3, obs)
    assert [f.directed for f in merge_findings([fs, fs[:1]])] == [f.directed for f in fs]


def test_only_the_places_whose_evidence_changed_explain_again():
    m = ShardMap(MODEL3, 16)
    loc = ShardedLocalizer(MODEL3, m)
    ticks = iter(range(10**6))
    loc.parts.clock = lambda: float(next(ticks))
    for o in untraced_observations(MODEL3, PLAN3, set()):
        loc.update(o)
    assert loc.findings() == [] and set(loc.took) == set(loc.places())  # the first time: every place
    loc.update(Observation("h0", "h0/x", MODEL3.node_path("h0", "h1", 0, None), None, True, "forward"))
    loc.findings()
    assert set(loc.took) == {0}  # a path inside shard 0: only shard 0 explains again
    loc.findings()
    assert loc.took == {}


class CountingParts(LocalParts):
    def __init__(self, *a):
        super().__init__(*a)
        self.sent = 0

    def run(self, calls, round_):
        self.sent += sum(len(changes) for changes, _, _ in calls.values())
        return super().run(calls, round_)


def test_a_place_told_nothing_for_long_gets_each_path_once():
    m = ShardMap(MODEL3, 4)
    parts = CountingParts(MODEL3, m)
    loc = ShardedLocalizer(MODEL3, m, parts)
    obs = untraced_observations(MODEL3, PLAN3, {"p0s32-p0c1:down"})
    for _ in range(20):  # every path reported twenty times over before the places are asked
        for o in obs:
            loc.update(o)
    gone = loc.update(obs[0])
    loc.forget(obs[0].key)
    assert {f.directed for f in loc.findings()} == {"p0s32-p0c1:down"}
    assert parts.sent == sum(loc.held()) + len(gone)  # each path once, the forgotten one's key once


def sharded_via(link_factory, obs, shards=4):
    m = ShardMap(MODEL3, shards)
    hosts = [PartHost(m, k) for k in range(shards)]
    parts = ShardParts(MODEL3, m, link_factory(hosts))
    loc = ShardedLocalizer(MODEL3, m, parts)
    for o in obs:
        loc.update(o)
    return loc, parts, hosts


class InProcess:
    """ShardLink to PartHosts in this process; `away`: shards that do not answer."""

    def __init__(self, hosts):
        self.hosts, self.away, self.asked, self.timeouts = hosts, set(), [], []
        self.lose_sends = False

    def parts(self, calls, timeout_s=0.0):
        self.timeouts.append(timeout_s)
        out = {}
        for k, call in calls.items():
            self.asked.append(k)
            try:
                if k in self.away:
                    raise ShardUnreachable(f"shard {k} is away")
                out[k] = self.hosts[k].call(*call)
            except (PartLost, ShardUnreachable) as exc:
                out[k] = exc
        return out

    def send(self, calls):
        if not self.lose_sends:
            self.parts(calls)


def test_parts_in_their_shards_find_what_parts_in_one_process_find():
    truth = {"p0s32-p0c1:down", "p1l6-p1s6:up"}
    obs = untraced_observations(MODEL3, PLAN3, truth, noisy={"h7", "h200"}, seed=4)
    loc, parts, hosts = sharded_via(InProcess, obs)
    assert sharded_found(loc, []) == truth == {f.directed for f in localize(MODEL3, obs)}
    assert sum(len(h) for h in hosts) == sum(loc.held()[:4]) and len(parts.root) == loc.held()[4]
    assert parts.counters["parts_sent_whole"] == 4 and parts.standing_in == {}


def test_a_part_that_lost_its_evidence_gets_it_whole_and_answers_the_same():
    truth = {"p0s32-p0c1:down"}
    obs = untraced_observations(MODEL3, PLAN3, truth, seed=5)
    loc, parts, hosts = sharded_via(InProcess, obs)
    assert sharded_found(loc, []) == truth
    owner = loc.map.owner("p0s32-p0c1:down")
    held = len(hosts[owner])
    hosts[owner].__init__(loc.map, owner)  # the shard restarted: its part is empty
    loc.update(next(o for o in obs if owner in loc.places_of(o)))  # news for it
    assert {f.directed for f in loc.findings()} == truth
    assert len(hosts[owner]) == held and parts.counters["parts_sent_whole"] == 5


def test_the_root_stands_in_for_a_shard_that_does_not_answer_and_gives_it_back():
    truth = {"p1l6-p1s6:up"}
    obs = untraced_observations(MODEL3, PLAN3, truth, seed=6)
    now = [0.0]
    loc, parts, hosts = sharded_via(InProcess, [])
    parts.clock = lambda: now[0]
    owner = loc.map.owner("p1l6-p1s6:up")
    parts.link.away.add(owner)
    for o in obs:
        loc.update(o)
    assert {f.directed for f in loc.findings()} == truth and set(parts.standing_in) == {owner}
    news = next(o for o in obs if owner in loc.places_of(o))

    def asked_after(seconds: float) -> bool:
        """News for the shard's part `seconds` later: was the shard asked (or its stand-in)?"""
        now[0] += seconds
        before = len(parts.link.asked)
        loc.update(news)
        assert {f.directed for f in loc.findings()} == truth
        return owner in parts.link.asked[before:]

    r = parts.RETRY_S
    assert not asked_after(r - 1) and asked_after(1)  # failed at 0: tried again at RETRY_S
    assert not asked_after(2 * r - 1) and asked_after(1)  # failed again: twice as long
    assert set(parts.standing_in) == {owner}
    parts.link.away.clear()
    assert asked_after(4 * r)
    assert parts.standing_in == {}
    assert len(hosts[owner]) == len(parts.held[owner]) > 0


def test_a_part_answers_only_the_root_that_fed_it_and_only_its_questions():
    m = ShardMap(MODEL3, 4)
    host = PartHost(m, 1)
    assert host.call("a", None, 1, [], "cleared", ()) == (set(), set(), {})
    with pytest.raises(PartLost):
        host.call("b", 1, 1, [], "cleared", ())  # another root's session
    with pytest.raises(PartLost):
        host.call("a", 3, 3, [], "cleared", ())  # changes it never got
    with pytest.raises(ValueError, match="no part method"):
        host.call("a", 1, 1, [], "apply", ([],))


def test_evidence_sent_ahead_is_taken_in_before_the_question_and_a_lost_send_heals():
    truth = {"p0s32-p0c1:down"}
    obs = untraced_observations(MODEL3, PLAN3, truth, seed=7)
    loc, parts, hosts = sharded_via(InProcess, obs)
    assert {f.directed for f in loc.findings()} == truth
    owner = loc.map.owner("p0s32-p0c1:down")
    bad = next(o for o in obs if o.bad and owner in loc.places_of(o))
    loc.update(Observation(bad.reporter, bad.key, bad.forward, None, False))
    asked = len(parts.link.asked)
    loc.send()
    assert hosts[owner].generation == parts.generation[owner] and len(parts.link.asked) > asked
    assert not hosts[owner].part.loc._entries[bad.key].obs.bad  # taken in, nothing asked
    whole = parts.counters["parts_sent_whole"]
    parts.link.lose_sends = True  # the next send never arrives
    loc.update(bad)
    loc.send()
    parts.link.lose_sends = False
    assert {f.directed for f in loc.findings()} == truth
    behind = [p for p in loc.places_of(bad) if p != ROOT]  # each part the lost send was for
    assert parts.counters["parts_sent_whole"] == whole + len(behind) and owner in behind


def test_a_shard_has_time_for_the_evidence_it_takes_in_first():
    obs = untraced_observations(MODEL3, PLAN3, {"p0s32-p0c1:down"}, seed=8)
    loc, parts, hosts = sharded_via(InProcess, obs)
    loc.findings()  # each part got all of its evidence: its timeout grew with it
    biggest = max(len(h) for h in hosts)
    assert parts.link.timeouts[0] == pytest.approx(parts.TIMEOUT_S + parts.PER_CHANGE_S * biggest)
    assert parts.link.timeouts[-1] == pytest.approx(parts.TIMEOUT_S)  # later rounds: nothing to take in
    for o in obs:  # a storm sent ahead and not yet confirmed: the next question waits for it too
        loc.update(Observation(o.reporter, o.key, o.forward, None, True))
    sent = {p: len(c) for p, c in loc._changes.items() if c and p != ROOT}
    loc.send()
    loc.findings()
    assert parts.link.timeouts[-3] == pytest.approx(parts.TIMEOUT_S + parts.PER_CHANGE_S * max(sent.values()))
    assert parts.link.timeouts[-1] == pytest.approx(parts.TIMEOUT_S)  # answered: nothing outstanding
