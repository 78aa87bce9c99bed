"""Probe plans (pure): full mesh when small, O(N) sparse plans with every link watched twice."""
from __future__ import annotations

import json
import time

import pytest

from linkpass.core.fabric import FabricError, rail_optimized, three_tier
from linkpass.core.localize import Observation, localize
from linkpass.core.plan import PlannedPath, coverage, plan_cap, plan_probes, planned_links


def coverable(model, hosts):
    """Directed links a probe between `hosts` can cross: their uplinks, the leaf-spine links of
    leaves with a present host when a plane has at least two such leaves, and the spine-core
    links of pods with a present host when a plane has at least two such pods."""
    out = set()
    for plane in range(model.planes):
        leaves = {model.leaf_of(h, plane) for h in hosts}
        pods = {model.pod_of(leaf) for leaf in leaves} if len(leaves) > 1 else set()
        for h in hosts:
            name = model.uplink(h, plane).name
            out |= {name + ":up", name + ":down"}
        for lk in model.links.values():
            if lk.plane != plane:
                continue
            if (lk.kind == "leaf-spine" and len(leaves) > 1 and lk.a in leaves) or (
                    lk.kind == "spine-core" and len(pods) > 1 and model.pod_of(lk.a) in pods):
                out |= {lk.name + ":up", lk.name + ":down"}
    return out


def min_coverage(model, plan, hosts=None):
    cov = coverage(model, plan)
    return min(cov.get(d, 0) for d in coverable(model, hosts or model.hosts))


def test_small_fleet_gets_a_full_mesh():
    m = rail_optimized(8, 2, 4, 2)
    plan = plan_probes(m)
    assert plan.full_mesh
    # per plane: 3 rack mates (no spine) + 4 hosts on the other leaf x 2 spines
    assert all(len(ps) == 2 * (3 + 4 * 2) for ps in plan.paths.values())
    assert PlannedPath("h1", 0, None) in plan.paths["h0"] and PlannedPath("h5", 1, 1) in plan.paths["h0"]
    assert plan.peers_of("h0") == ["h1", "h2", "h3", "h4", "h5", "h6", "h7"]
    cov = coverage(m, plan)
    assert min(cov.values()) == 8 and set(cov) == coverable(m, m.hosts)


@pytest.mark.parametrize("shape", [(64, 2, 8, 4), (37, 3, 5, 3), (100, 2, 32, 32), (20, 2, 3, 7),
                                   (17, 1, 16, 2), (33, 2, 33, 3), (18, 1, 9, 1), (255, 1, 16, 16)])
def test_sparse_plan_covers_every_directed_link_twice(shape):
    m = rail_optimized(*shape)
    plan = plan_probes(m)
    assert not plan.full_mesh
    assert min_coverage(m, plan) >= 2 and plan.under_covered == []


def test_sparse_plan_is_constant_per_host_and_plane_on_regular_shapes():
    m = rail_optimized(64, 2, 8, 4)
    plan = plan_probes(m)
    assert all(len(ps) == 3 * 2 for ps in plan.paths.values())
    assert plan.total_paths == 64 * 2 * 3
    for host, ps in plan.paths.items():
        assert all(p.peer != host for p in ps)
        assert len(set(ps)) == len(ps)


def test_total_paths_grow_linearly():
    small = plan_probes(rail_optimized(128, 2, 8, 4)).total_paths
    large = plan_probes(rail_optimized(256, 2, 8, 4)).total_paths
    assert 1.9 <= large / small <= 2.1


def test_plan_is_deterministic_and_seed_varies_it():
    m = rail_optimized(64, 2, 8, 4)
    assert plan_probes(m).paths == plan_probes(m).paths
    assert plan_probes(m, seed=1).paths != plan_probes(m).paths
    assert min_coverage(m, plan_probes(m, seed=5)) >= 2


def test_hosts_joining_and_leaving_is_a_replan():
    m = rail_optimized(64, 2, 8, 4)
    present = [h for h in m.hosts if h not in {"h3", "h17", "h40", "h41", "h42", "h43", "h44", "h45", "h46", "h47"}]
    plan = plan_probes(m, hosts=present)  # leaf 5 is empty now
    assert set(plan.paths) == set(present)
    assert all(p.peer in present for ps in plan.paths.values() for p in ps)
    assert min_coverage(m, plan, present) >= 2
    assert not any(d.startswith("p0l5-") for d in coverage(m, plan))
    with pytest.raises(FabricError, match="h999"):
        plan_probes(m, hosts=["h1", "h999"])
    tiny = plan_probes(m, hosts=["h0", "h1"])  # two rack mates: a full mesh without spines
    assert tiny.paths == {"h0": [PlannedPath("h1", 0, None), PlannedPath("h1", 1, None)],
                          "h1": [PlannedPath("h0", 0, None), PlannedPath("h0", 1, None)]}


def test_planned_links_without_a_spine_are_the_definite_ones():
    m = rail_optimized(8, 1, 4, 2)
    assert planned_links(m, "h0", PlannedPath("h5", 0, None)) == (("h0-p0l0:up", "h5-p0l1:down"),
                                                                  ("h5-p0l1:up", "h0-p0l0:down"))
    assert planned_links(m, "h0", PlannedPath("h5", 0, 1))[1] == m.node_path("h5", "h0", 0, 1)


def test_plan_to_dict_is_json():
    plan = plan_probes(rail_optimized(20, 2, 4, 2))
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["total_paths"] == plan.total_paths and len(d["paths"]) == 20


def test_16k_gpu_plan_is_fast_and_covers_everything():
    m = rail_optimized(2048, 8, 32, 32)
    t = time.perf_counter()
    plan = plan_probes(m)
    elapsed = time.perf_counter() - t
    # ~1 s on this machine; a timed test is no benchmark: the bound only catches a planner gone quadratic
    assert elapsed < 20.0, f"planning the 16k fleet took {elapsed:.2f} s"
    assert plan.total_paths == 2048 * 8 * 3
    cov = coverage(m, plan)
    assert len(cov) == 2 * len(m.links) and min(cov.values()) >= 2


# ---- 3-tier fabrics -------------------------------------------------------------------------
THREE_TIER_SHAPES = [(64, 2, 4, 4, 2, 3), (100, 2, 4, 3, 3, 5), (37, 1, 3, 2, 4, 4), (200, 2, 8, 4, 4, 4),
                     (300, 1, 4, 4, 2, 40), (33, 2, 2, 16, 2, 2)]


@pytest.mark.parametrize("shape", THREE_TIER_SHAPES)
def test_three_tier_plan_covers_every_directed_link_of_every_tier_twice(shape):
    m = three_tier(*shape)
    plan = plan_probes(m)
    assert min_coverage(m, plan) >= 2 and plan.under_covered == []
    assert any(p.core is not None for ps in plan.paths.values() for p in ps)
    # the links the plan is checked on include the core tier's, both ways
    assert any(d.startswith("p0s") and "-p0c" in d for d in coverable(m, m.hosts))


def test_three_tier_plan_is_constant_per_host_and_crosses_pods():
    m = three_tier(1024, 2, 16, 8, 8, 8)  # 64 leaves, 8 pods of 8 leaves and 8 spines, 8 cores a group
    plan = plan_probes(m)
    assert all(len(ps) == (3 + 1) * 2 for ps in plan.paths.values())
    # per plane, a host's first paths leave its pod (the core tier is watched by the plan itself, not
    # by repairs) and its last stays in it, to another leaf (its lost replies name few links)
    for h, ps in plan.paths.items():
        for plane in (0, 1):
            *out, home = [p for p in ps if p.plane == plane]
            assert all(not m.same_pod(h, p.peer, plane) and p.core is not None for p in out)
            assert m.same_pod(h, home.peer, plane) and home.core is None and home.spine is not None
    inbound = {}
    for h, ps in plan.paths.items():
        for p in ps:
            if m.same_pod(h, p.peer, p.plane):
                inbound[(p.peer, p.plane)] = inbound.get((p.peer, p.plane), 0) + 1
    assert set(inbound.values()) == {1} and len(inbound) == 1024 * 2  # every host probed by one pod-mate
    assert min_coverage(m, plan) >= 2
    assert plan_probes(m).paths == plan.paths and plan_probes(m, seed=1).paths != plan.paths


def test_three_tier_planned_links_and_plan_document():
    m = three_tier(16, 1, 2, 2, 2, 3)
    path = PlannedPath("h9", 0, 1, 2)
    assert planned_links(m, "h0", path) == (m.node_path("h0", "h9", 0, 1, 2), m.node_path("h9", "h0", 0, 1, 2))
    plan = plan_probes(m, full_mesh_max=4)
    rows = json.loads(json.dumps(plan.to_dict()))["paths"]["h0"]
    assert all(len(r) == (4 if not m.same_pod("h0", r[0], 0) else 3) for r in rows)


def test_small_three_tier_fleet_full_mesh_takes_every_spine_and_core():
    m = three_tier(8, 1, 2, 2, 2, 3)  # 4 leaves, 2 pods: a peer in the other pod has 2 x 3 paths
    plan = plan_probes(m)
    assert plan.full_mesh
    assert len(plan.paths["h0"]) == 1 + 2 * 2 + 4 * 6
    assert min_coverage(m, plan) >= 2


@pytest.mark.parametrize("shape", [(200, 2, 8, 4, 4, 4), (37, 1, 3, 2, 4, 4)])
def test_three_tier_caps_move_probes_and_report_what_stays_short(shape):
    m = three_tier(*shape)
    caps = {h: i % 3 for i, h in enumerate(m.hosts) if i % 2}
    plan = plan_probes(m, caps=caps)
    assert all(len(plan.paths[h]) <= c for h, c in caps.items())
    assert min_coverage(m, plan) >= 2 and plan.under_covered == []
    tight = plan_probes(m, caps={h: 1 for h in m.hosts})
    assert all(len(ps) <= 1 for ps in tight.paths.values())
    assert tight.under_covered == short_links(m, tight)


def test_32k_gpu_three_tier_plan_covers_everything():
    m = three_tier(4096, 8, 32, 16, 16, 16)  # 128 leaves, 8 pods, 256 cores per plane
    plan = plan_probes(m)
    assert plan.total_paths == 4096 * 8 * (3 + 1)
    cov = coverage(m, plan)
    assert len(cov) == 2 * len(m.links) and min(cov.values()) >= 2
    assert min(probe_reporters(m, plan, "spine-core").values()) >= 3


def probe_reporters(model, plan, kind):
    """Distinct reporters whose probes (not replies) cross each directed link of `kind`."""
    out = {f"{lk.name}:{d}": set() for lk in model.links.values() if lk.kind == kind for d in ("up", "down")}
    for h, ps in plan.paths.items():
        for p in ps:
            for d in model.node_path(h, p.peer, p.plane, p.spine, p.core):
                if d in out:
                    out[d].add(h)
    return {d: len(r) for d, r in out.items()}


@pytest.mark.parametrize("shape", [(128, 1, 4, 4, 4, 4), (2048, 1, 8, 8, 8, 8), (200, 2, 8, 4, 4, 4)])
def test_three_tier_probes_into_a_pod_through_one_core_come_from_different_spine_core_links(shape):
    """Two probes through one (spine, core) pair from one pod into another would witness that
    pod's core-spine link and this pod's spine-core link alike: a fault on one reads as the other."""
    m = three_tier(*shape)
    plan = plan_probes(m)
    came_by: dict[str, list[str]] = {}
    for h, ps in plan.paths.items():
        for p in ps:
            if p.core is not None:
                up, down = [d for d in m.node_path(h, p.peer, p.plane, p.spine, p.core)
                            if m.links[d.rsplit(":", 1)[0]].kind == "spine-core"]
                came_by.setdefault(down, []).append(up)
    assert came_by and all(len(set(ups)) == len(ups) for ups in came_by.values())


def test_three_tier_core_links_have_three_probing_reporters_so_one_noisy_agent_cannot_hide_a_cut():
    """Replies between pods are not traced, so a spine-core link's probes are its only witnesses:
    with 3 reporters each way, one of them saying good (a noisy agent) still leaves 2 that say bad,
    and the localizer names the link."""
    # the 131 072-GPU fabric's proportions: a pod has as many hosts as (spine, core) pairs
    m = three_tier(128, 1, 4, 4, 4, 4)
    plan = plan_probes(m)
    counts = probe_reporters(m, plan, "spine-core")
    assert min(counts.values()) >= 3
    keys = [(h, n, p) for h, ps in plan.paths.items() for n, p in enumerate(ps)]
    forward = [m.node_path(h, p.peer, p.plane, p.spine, p.core) for h, _, p in keys]
    for d in sorted(d for d in counts if d.startswith("p0s")):
        crossing = sorted({h for (h, _, _), fwd in zip(keys, forward) if d in fwd})
        for noisy in crossing:
            obs = [Observation(h, f"{h}/{n}", fwd, None, d in fwd and h != noisy, "forward" if d in fwd and h != noisy else None)
                   for (h, n, _), fwd in zip(keys, forward)]
            assert d in {f.directed for f in localize(m, obs)}, (d, noisy)


# ---- caps: the probe budgets agents report --------------------------------------------------
def short_links(model, plan, hosts=None):
    """Coverable directed links with fewer than 2 reporters, as coverage() counts them."""
    cov = coverage(model, plan)
    return sorted(d for d in coverable(model, hosts or model.hosts) if cov.get(d, 0) < 2)


def test_plan_cap_is_half_the_budget_at_the_idle_rate():
    assert plan_cap(20000, 100) == 1000  # the defaults: 10 000 pps for the plan, a path costs 10 pps
    assert plan_cap(100, 100) == 5 and plan_cap(15, 100) == 0 and plan_cap(333, 10) == 1
    assert plan_cap(0, 100) is None  # no ceiling, no cap


def test_caps_that_bind_nothing_change_nothing():
    m = rail_optimized(64, 2, 8, 4)
    assert plan_probes(m, caps={h: 6 for h in m.hosts}).paths == plan_probes(m).paths
    small = rail_optimized(8, 2, 4, 2)  # full mesh: 22 paths a host
    assert plan_probes(small, caps={"h0": 22}).full_mesh


@pytest.mark.parametrize("shape", [(64, 2, 8, 4), (37, 3, 5, 3), (20, 2, 3, 7), (17, 1, 16, 2)])
def test_capped_hosts_probes_move_to_hosts_with_room_and_coverage_is_kept(shape):
    m = rail_optimized(*shape)
    caps = {h: i % 3 for i, h in enumerate(m.hosts) if i % 2}  # half the hosts take 0, 1 or 2 paths
    plan = plan_probes(m, caps=caps)
    assert all(len(plan.paths[h]) <= c for h, c in caps.items())
    assert min_coverage(m, plan) >= 2 and plan.under_covered == []
    free = [h for h in m.hosts if h not in caps]
    uncapped = plan_probes(m)
    assert sum(len(plan.paths[h]) for h in free) > sum(len(uncapped.paths[h]) for h in free)  # they took over


def test_uniform_caps_that_leave_room_keep_coverage_with_fewer_paths():
    m = rail_optimized(64, 2, 8, 4)
    plan = plan_probes(m, caps={h: 3 for h in m.hosts})  # half of the 6 uncapped
    assert max(len(ps) for ps in plan.paths.values()) <= 3
    assert min_coverage(m, plan) >= 2 and plan.under_covered == []


def test_a_small_fleet_over_its_caps_leaves_the_full_mesh():
    m = rail_optimized(8, 2, 4, 2)
    plan = plan_probes(m, caps={h: 2 for h in m.hosts})
    assert not plan.full_mesh and all(len(ps) <= 2 for ps in plan.paths.values())
    assert min_coverage(m, plan) >= 2 and plan.under_covered == []


@pytest.mark.parametrize("shape,cap", [((64, 2, 8, 4), 1), ((37, 3, 5, 3), 2), ((20, 2, 3, 7), 0)])
def test_links_caps_leave_short_are_reported_exactly(shape, cap):
    m = rail_optimized(*shape)
    plan = plan_probes(m, caps={h: cap for h in m.hosts})
    assert all(len(ps) <= cap for ps in plan.paths.values())
    assert plan.under_covered and plan.under_covered == short_links(m, plan)
    assert json.loads(json.dumps(plan.to_dict()))["under_covered"] == plan.under_covered


def test_under_coverage_is_reported_when_only_a_few_hosts_have_room():
    m = rail_optimized(64, 2, 8, 4)
    present = [h for h in m.hosts if h not in {"h8", "h9"}]
    caps = {h: 0 for h in present[1:]}  # one host may probe: it alone cannot be 2 reporters anywhere
    plan = plan_probes(m, hosts=present, caps=caps)
    assert plan.total_paths == len(plan.paths[present[0]]) > 0
    assert plan.under_covered == short_links(m, plan, present)
    assert len(plan.under_covered) == len(coverable(m, present))  # no link has 2 reporters
    # every host but 2 at cap 0: those 2 cover what 2 reporters can
    caps = {h: 0 for h in present[2:]}
    plan = plan_probes(m, hosts=present, caps=caps)
    assert plan.under_covered == short_links(m, plan, present) and len(plan.under_covered) < len(coverable(m, present))


def test_capped_plans_are_deterministic_and_fast():
    m = rail_optimized(2048, 8, 32, 32)
    caps = {h: 12 for h in m.hosts}  # half the uncapped 24
    t = time.perf_counter()
    plan = plan_probes(m, caps=caps)
    elapsed = time.perf_counter() - t
    assert elapsed < 30.0, f"planning the capped 16k fleet took {elapsed:.2f} s"
    assert max(len(ps) for ps in plan.paths.values()) <= 12
    assert plan.under_covered == [] and min_coverage(m, plan) >= 2
    assert plan_probes(m, caps=caps).paths == plan.paths
