"""Fault localization (pure): faults on a generated fleet, verdicts from its probe plan."""
from __future__ import annotations

import json
import random

import pytest

from linkpass.core.fabric import rail_optimized
from linkpass.core.localize import Finding, Localizer, Observation, localize
from linkpass.core.plan import plan_probes

from support.localize import untraced_observations


MODEL = rail_optimized(64, 2, 8, 4)  # 8 leaves x 4 spines per plane, sparse plan (64 > 16 hosts)
PLAN = plan_probes(MODEL)


def observations(truth, *, known_reverse=True, liars=(), noisy=(), seed=0):
    """One observation per planned path, bad where it crosses a link of `truth` (directed),
    with the direction it breaks. Liars call every path bad; noisy agents call half their
    paths bad at random and their truly bad ones good half the time."""
    rng = random.Random(seed)
    out = []
    for host, paths in PLAN.paths.items():
        for n, p in enumerate(paths):
            fwd = MODEL.node_path(host, p.peer, p.plane, p.spine)
            rev = MODEL.node_path(p.peer, host, p.plane, p.spine)
            f, r = any(d in truth for d in fwd), any(d in truth for d in rev)
            bad, direction = f or r, ("both" if f and r else "forward" if f else "reverse" if r else None)
            if host in liars:
                bad, direction = True, "both"
            elif host in noisy:
                if bad and rng.random() < 0.5:
                    bad, direction = False, None
                elif not bad and rng.random() < 0.5:
                    bad, direction = True, rng.choice(("forward", "reverse", "both", None))
            out.append(Observation(host, f"{host}/{n}", fwd, rev if known_reverse else None, bad, direction))
    return out


def found(obs, **options):
    return {f.directed for f in localize(MODEL, obs, **options)}


def test_healthy_fleet_has_no_findings():
    assert found(observations(set())) == set()


def test_cut_host_uplink_is_both_directions():
    assert found(observations({"h3-p0l0:up", "h3-p0l0:down"})) == {"h3-p0l0:up", "h3-p0l0:down"}


def test_one_direction_of_a_host_uplink():
    # the up direction carries h3's probes and the replies to whoever probes h3
    assert found(observations({"h3-p1l0:up"})) == {"h3-p1l0:up"}
    assert found(observations({"h40-p0l5:down"})) == {"h40-p0l5:down"}


def test_leaf_spine_link_one_direction_only():
    assert found(observations({"p0l2-p0s1:down"})) == {"p0l2-p0s1:down"}
    assert found(observations({"p1l7-p1s3:up"})) == {"p1l7-p1s3:up"}


def test_two_concurrent_faults_are_both_found():
    truth = {"h10-p0l1:up", "p1l4-p1s2:up", "p1l4-p1s2:down"}
    assert found(observations(truth)) == truth
    # two faults on the same leaf and plane, overlapping paths
    truth = {"p0l3-p0s0:up", "h26-p0l3:down"}
    assert found(observations(truth)) == truth


def test_a_lying_agent_alone_produces_no_finding():
    loc = Localizer(MODEL)
    for o in observations(set(), liars={"h9"}):
        loc.update(o)
    assert loc.findings() == []
    assert "h9" in loc.suspects()


def test_two_liars_on_different_leaves_produce_no_finding():
    assert found(observations(set(), liars={"h9", "h50"})) == set()


def test_a_liar_does_not_hide_or_distort_a_real_fault():
    truth = {"p0l6-p0s2:up", "p0l6-p0s2:down"}
    assert found(observations(truth, liars={"h1"})) == truth


@pytest.mark.parametrize("seed", range(5))
def test_noisy_agent_plus_real_fault_finds_only_the_real_fault(seed):
    truth = {"h20-p1l2:down"}
    assert found(observations(truth, noisy={"h44"}, seed=seed)) == truth


def test_one_reporter_alone_is_not_believed_unless_allowed():
    # only h3 reports, every path bad: nothing contradicts it, but nobody corroborates it either
    alone = [o for o in observations(set(), liars={"h3"}) if o.reporter == "h3"]
    assert found(alone) == set()
    # two guards keep it out: a second reporter, and enough of the claims' weight on one link
    # (h3 spreads its claims over both planes' links: at most a quarter on any)
    assert found(alone, min_reporters=1) == set()
    assert found(alone, min_reporters=1, min_support=0.25) != set()


def test_unknown_reply_paths_use_the_links_every_reply_crosses():
    # reverse=None: the localizer uses reverse_definite (peer's uplink up, reporter's uplink down)
    truth = {"h3-p0l0:up"}  # h3's probes (forward) and replies to h3's probers (definite link)
    assert found(observations(truth, known_reverse=False)) == truth
    truth = {"h3-p0l0:up", "h3-p0l0:down"}
    assert found(observations(truth, known_reverse=False)) == truth
    # a spine link's up direction: seen forward by the leaf's own hosts; the replies crossing
    # it cannot be pinned on it, but nothing else is blamed either
    assert found(observations({"p0l2-p0s1:up"}, known_reverse=False)) == {"p0l2-p0s1:up"}


@pytest.mark.parametrize("seed", range(3))
def test_lost_replies_on_a_spine_link_blame_it_not_their_reporters(seed):
    """Two leaves per plane, one-way loss from spine p1s0 to leaf p1l1: probes from p1l0's hosts
    are lost on it (forward), and so are the replies to p1l1's hosts' probes whenever the
    peer's ECMP hash sends them through p1s0 (reverse, reply path not traced). Those reporters
    name host links that work for everyone else; blaming only the links every reply crosses
    made them liars (suspects) and once named a working host link."""
    model = rail_optimized(4, 2, 2, 2)
    plan = plan_probes(model)
    truth = "p1l1-p1s0:down"
    rng = random.Random(seed)
    loc = Localizer(model)
    for host, paths in plan.paths.items():
        for n, p in enumerate(paths):
            fwd = model.node_path(host, p.peer, p.plane, p.spine)
            same_leaf = model.leaf_of(host, p.plane) == model.leaf_of(p.peer, p.plane)
            rev = model.node_path(p.peer, host, p.plane, None if same_leaf else rng.randrange(2))
            f, r = truth in fwd, truth in rev
            loc.update(Observation(host, f"{host}/{n}", fwd, None, f or r, "forward" if f else "reverse" if r else None))
    fs = loc.findings()
    assert [(f.directed, f.alternatives) for f in fs] == [("p1l0-p1s0:up", ("p1l1-p1s0:down",))], fs
    assert loc.suspects() == set()


def test_update_replaces_by_key_and_forget_undoes():
    truth = {"h3-p0l0:up", "h3-p0l0:down"}
    healthy = observations(set())
    loc = Localizer(MODEL)
    for o in healthy:
        loc.update(o)
    baseline = (dict(loc._good_votes), {d: dict(v) for d, v in loc._good_by.items()})
    for o in observations(truth):
        loc.update(o)
    assert len(loc) == len(healthy)
    assert {f.directed for f in loc.findings()} == truth
    for o in healthy:  # the fault heals: the same keys, good again
        loc.update(o)
    assert loc.findings() == []
    assert (dict(loc._good_votes), {d: dict(v) for d, v in loc._good_by.items()}) == baseline
    assert loc._bad_by == {}
    for o in observations(truth):
        loc.update(o)
    bad_reporters = {o.reporter for o in observations(truth) if o.bad}
    for r in bad_reporters:
        loc.forget_reporter(r)
    assert loc.findings() == []
    loc.forget("no-such-key")
    for o in healthy:
        loc.forget(o.key)
    assert len(loc) == 0 and loc._good_votes == {} and loc._bad_votes == {} and loc._good_by == {} and loc._bad_by == {}


def test_findings_carry_their_evidence():
    findings = localize(MODEL, observations({"p1l7-p1s3:up"}))
    assert len(findings) == 1
    f = findings[0]
    assert isinstance(f, Finding)
    assert (f.link, f.direction, f.directed) == ("p1l7-p1s3", "up", "p1l7-p1s3:up")
    assert f.bad_paths >= 2 and len(f.reporters) >= 2 and f.good_paths == 0
    assert 0.5 < f.confidence <= 1.0
    d = json.loads(json.dumps(f.as_dict()))
    assert d["directed"] == "p1l7-p1s3:up" and d["reporters"] == list(f.reporters)


def test_findings_sorted_by_confidence():
    fs = localize(MODEL, observations({"h10-p0l1:up", "p1l4-p1s2:up", "p1l4-p1s2:down"}))
    assert [f.confidence for f in fs] == sorted((f.confidence for f in fs), reverse=True)


def test_bad_direction_is_rejected():
    with pytest.raises(ValueError, match="direction"):
        Localizer(MODEL).update(Observation("h0", "h0/0", ("h0-p0l0:up",), (), True, "sideways"))


def test_links_the_evidence_cannot_tell_apart_are_named_as_alternatives():
    # two leaves: leaf 0 -> spine 0 and spine 0 -> leaf 1 carry exactly the same probes and replies
    model = rail_optimized(8, 1, 4, 2)
    plan = plan_probes(model)  # full mesh
    obs = []
    for host, paths in plan.paths.items():
        for n, p in enumerate(paths):
            fwd = model.node_path(host, p.peer, p.plane, p.spine)
            rev = model.node_path(p.peer, host, p.plane, p.spine)
            f, r = "p0l1-p0s0:down" in fwd, "p0l1-p0s0:down" in rev
            obs.append(Observation(host, f"{host}/{n}", fwd, rev, f or r, "forward" if f else "reverse" if r else None))
    findings = localize(model, obs)
    assert len(findings) == 1
    f = findings[0]
    assert {f.directed, *f.alternatives} == {"p0l1-p0s0:down", "p0l0-p0s0:up"}
    assert f.confidence <= 0.5 and f.as_dict()["alternatives"] == list(f.alternatives)
    # the healthy spine's links are not alternatives: other probes exonerate them
    assert localize(MODEL, observations({"p1l7-p1s3:up"}))[0].alternatives == ()


# ---- 3-tier fabrics: faults on every tier, core links seen from many pods --------------------
from linkpass.core.fabric import three_tier  # noqa: E402

MODEL3 = three_tier(256, 2, 4, 4, 4, 4)  # 64 leaves, 16 pods of 4 leaves and 4 spines, 4 cores a group
PLAN3 = plan_probes(MODEL3)


def observations3(truth, *, noisy=(), seed=0):
    return untraced_observations(MODEL3, PLAN3, truth, noisy=noisy, seed=seed)


def named3(truth, **kw):
    """(findings, every directed link they name, alternatives included)."""
    fs = localize(MODEL3, observations3(truth, **kw))
    return fs, {d for f in fs for d in (f.directed, *f.alternatives)}


@pytest.mark.parametrize("tier", ["host-leaf", "leaf-spine", "spine-core"])
@pytest.mark.parametrize("direction", ["up", "down"])
def test_three_tier_single_fault_on_every_tier_is_found_alone(tier, direction):
    rng = random.Random(f"{tier}{direction}")
    links = sorted(MODEL3.links_by_tier()[tier])
    for name in rng.sample(links, 3):
        truth = {f"{name}:{direction}"}
        fs, names = named3(truth)
        assert [f.directed for f in fs] == sorted(truth) or (len(fs) == 1 and truth <= names), (truth, fs)


def test_three_tier_core_link_is_seen_from_many_pods():
    truth = "p1s6-p1c9:down"  # core 9 (group 2) down to spine 6 (pod 1): every pod's probes into pod 1
    fs = localize(MODEL3, observations3({truth}))
    assert [f.directed for f in fs] == [truth]
    pods = {MODEL3.pod_of(MODEL3.leaf_of(r, 1)) for r in fs[0].reporters}
    assert len(pods) >= 2, fs[0].reporters  # the reporters of a core link are spread over pods


@pytest.mark.parametrize("seed", range(4))
def test_three_tier_double_faults_on_different_tiers(seed):
    rng = random.Random(seed)
    tiers = MODEL3.links_by_tier()
    a, b = rng.sample(["host-leaf", "leaf-spine", "spine-core"], 2)
    truth = {f"{rng.choice(sorted(tiers[a]))}:{rng.choice(('up', 'down'))}",
             f"{rng.choice(sorted(tiers[b]))}:{rng.choice(('up', 'down'))}"}
    fs, names = named3(truth)
    assert truth <= names and len(fs) == 2, (truth, fs)


def test_three_tier_one_percent_noisy_agents_change_nothing():
    rng = random.Random(7)
    noisy = set(rng.sample(sorted(MODEL3.hosts), 3))  # ~1 % of 256
    assert localize(MODEL3, observations3(set(), noisy=noisy)) == []
    for truth in ({"p0s2-p0c8:up"}, {"h17-p1l4:down"}, {"p1l33-p1s33:up"}):
        fs, names = named3(truth, noisy=noisy)
        assert truth <= names and len(fs) == 1, (truth, fs)


def test_claims_naming_too_many_links_do_not_count():
    # a reply lost between pods may have crossed any of 2 + 2S + 2SC links (42 here); with the
    # limit under that, such claims are dropped and the fault is found from the probes alone
    def peer(o):
        return o.forward[-1].split("-")[0]

    for name in sorted(n for n in MODEL3.links_by_tier()["spine-core"] if n.startswith("p1")):
        truth = {f"{name}:up"}
        obs = observations3(truth)
        # replies that came up through it from another pod and were lost
        wide = [o for o in obs if o.bad and o.direction == "reverse" and not MODEL3.same_pod(o.reporter, peer(o), 1)]
        if wide:
            break
    assert wide
    loc = Localizer(MODEL3, max_candidates=2 + 2 * 4)  # in-pod reply claims still count
    for o in obs:
        loc.update(o)
    assert [f.directed for f in loc.findings()] == sorted(truth)
    assert all(loc._entries[o.key].claims == () for o in wide)
    # lost replies alone convict nothing once they are too vague
    only_replies = [o for o in obs if not o.bad or o.direction == "reverse"]
    assert localize(MODEL3, only_replies, max_candidates=10) == []


def test_noisy_agents_meeting_on_one_link_are_not_a_finding():
    """Two noisy agents under one leaf each call a few of their paths bad, one of them across the
    same leaf-spine link, which only one more path crosses: 2 bad against 1 good, 2 reporters.
    Each lends the link a tenth of its claims: not a finding; with no support required, it is."""
    model = three_tier(64, 1, 8, 2, 2, 2)
    leaf_spine = "p0l0-p0s0:up"
    a, b, c = "h0", "h1", "h2"
    peers = [h for h in model.hosts if not model.same_pod("h0", h, 0)]
    obs = []
    for r, bad_across in ((a, True), (b, True), (c, False)):
        obs.append(Observation(r, f"{r}/x", model.node_path(r, peers[0], 0, 0, 0), None, bad_across,
                               "forward" if bad_across else None))
    for n in range(9):  # their other claims: each on a different link of another spine
        for r in (a, b):
            obs.append(Observation(r, f"{r}/{n}", model.node_path(r, peers[n + 1], 0, 1, n % 2), None, True, "forward"))
    # good evidence on the other claims' links from other reporters, so only leaf_spine is open
    for n, h in enumerate(model.hosts[8:40]):
        obs.append(Observation(h, f"{h}/g{n}", model.node_path(h, peers[(n + 3) % len(peers)], 0, 1, n % 2),
                               model.node_path(peers[(n + 3) % len(peers)], h, 0, 1, n % 2), False))
    assert leaf_spine not in {f.directed for f in localize(model, obs)}
    assert leaf_spine in {d for f in localize(model, obs, min_support=0) for d in (f.directed, *f.alternatives)}


def test_vote_counts_kept_on_update_match_a_recount():
    rng = random.Random(11)
    loc = Localizer(MODEL)
    obs = observations({"p0l2-p0s1:up", "h3-p0l0:down"}, noisy={"h7", "h20"}, seed=3) + observations(set())
    for _ in range(3000):
        o = rng.choice(obs)
        if rng.random() < 0.2:
            loc.forget(o.key)
        else:
            loc.update(o)
    links = set(loc._good_by) | set(loc._bad_by)
    for ignore in (set(), {"h7"}, {"h7", "h3", "h20"}):
        for d in links:
            good_by, bad_by = loc._good_by.get(d, {}), loc._bad_by.get(d, {})
            good = sum(1 for r, n in good_by.items() if n > bad_by.get(r, 0) and r not in ignore)
            bad = sum(1 for r, n in bad_by.items() if n > good_by.get(r, 0) and r not in ignore)
            assert loc.exonerated(d, ignore) == (good >= 2 and good >= bad), (d, ignore)
    for o in obs:
        loc.forget(o.key)
    assert loc._good_votes == {} and loc._bad_votes == {}
