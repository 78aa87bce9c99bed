"""The fleet topology model (pure): generated and testbed fabrics, paths from discovery hops."""
from __future__ import annotations

import json

import pytest

from linkpass.core import fabric as F
from linkpass.testbed.topology import make_fabric, preset


@pytest.fixture(scope="module")
def testbed_model():
    # default preset: h0, h1 under p*l0; h2, h3 under p*l1; 2 planes, 2 spines per plane
    return F.from_testbed(make_fabric(preset("default"), "lpx", "198.19.200.0/24"))


def test_directed_names_round_trip_and_reject_junk():
    assert F.directed("h0-p0l0", "up") == "h0-p0l0:up"
    assert F.split_directed("p0l0-p0s1:down") == ("p0l0-p0s1", "down")
    for bad in ("h0-p0l0", "h0-p0l0:sideways", ":up"):
        with pytest.raises(F.FabricError):
            F.split_directed(bad)
    with pytest.raises(F.FabricError):
        F.directed("h0-p0l0", "left")


def test_rail_optimized_shape_and_names():
    m = F.rail_optimized(10, 2, 4, 3)  # 3 leaves per plane, the last with 2 hosts
    assert m.hosts[:2] == ["h0", "h1"] and m.planes == 2
    assert m.uplink("h9", 1).name == "h9-p1l2" and m.leaf_of("h4", 0) == "p0l1"
    assert m.spines(1) == ["p1s0", "p1s1", "p1s2"]
    tiers = m.links_by_tier()
    assert len(tiers["host-leaf"]) == 20 and len(tiers["leaf-spine"]) == 2 * 3 * 3
    assert m.tier("p0l2-p0s1") == "leaf-spine" and m.tier("h3-p0l0") == "host-leaf"
    assert m.hosts_of_leaf("p0l2") == ["h8", "h9"]


def test_16k_gpu_fleet_builds_with_every_link():
    # how fast it builds is the fleet benchmark's business, not a test's (a shared machine's timing)
    m = F.rail_optimized(2048, 8, 32, 32)
    assert len(m.links) == 32768
    assert m.node_path("h0", "h2047", 7, 31) == ("h0-p7l0:up", "p7l0-p7s31:up", "p7l63-p7s31:down", "h2047-p7l63:down")


def test_node_path_and_reverse_definite():
    m = F.rail_optimized(8, 2, 4, 2)
    assert m.node_path("h1", "h6", 0, 1) == ("h1-p0l0:up", "p0l0-p0s1:up", "p0l1-p0s1:down", "h6-p0l1:down")
    assert m.node_path("h1", "h2", 1, None) == ("h1-p1l0:up", "h2-p1l0:down")
    assert m.node_path("h1", "h2", 1, 1) == ("h1-p1l0:up", "h2-p1l0:down")  # no spine between rack mates
    with pytest.raises(F.FabricError, match="needs a spine"):
        m.node_path("h1", "h6", 0, None)
    # replies h6 -> h1: whatever spine, they leave through h6's uplink and arrive through h1's
    assert m.reverse_definite("h1", 0, "h6") == ("h6-p0l1:up", "h1-p0l0:down")
    assert m.reverse_definite("h1", 0, "h2") == m.node_path("h2", "h1", 0, None)
    # ... and may cross either spine: every link of every reply path, each once
    possible = m.reverse_possible("h1", 0, "h6")
    assert set(possible) == {d for s in (0, 1) for d in m.node_path("h6", "h1", 0, s)} and len(set(possible)) == len(possible)
    assert m.reverse_possible("h1", 0, "h2") == m.reverse_definite("h1", 0, "h2")
    with pytest.raises(F.FabricError, match="no uplink"):
        m.uplink("h99", 0)


@pytest.mark.parametrize("make", [lambda: F.rail_optimized(64, 2, 8, 4), lambda: F.three_tier(256, 2, 4, 4, 4, 4)])
def test_reversed_path_is_the_node_path_back_and_shares_its_names(make):
    model = make()
    hosts = model.hosts
    for n, (a, b) in enumerate([(hosts[0], hosts[1]), (hosts[0], hosts[9]), (hosts[3], hosts[-1]), (hosts[-2], hosts[5])]):
        plane, spine, core = n % 2, n % 4, (n + 1) % 4
        fwd = model.node_path(a, b, plane, spine, core)
        back = model.node_path(b, a, plane, spine, core)
        assert model.reversed_path(fwd) == back
        # made once per link: two paths over one link hold the same string, not copies
        assert all(x is y for x, y in zip(model.reversed_path(fwd), back))
        # a path the model has not made itself (its names new to it): the same answer
        assert make().reversed_path(fwd) == back


def test_links_of_path_from_real_hops(testbed_model):
    m = testbed_model
    # h0 -> h2 on plane 0 through spine 1: leaf p0l0 answers on its h0 side, the spine on its
    # p0l0 side, leaf p0l1 on its spine-1 side; h2's NIC is the destination
    hops = ["198.18.64.0", "198.18.128.3", "198.18.128.6"]
    want = ("h0-p0l0:up", "p0l0-p0s1:up", "p0l1-p0s1:down", "h2-p0l1:down")
    assert m.links_of_path("h0", 0, hops, "198.18.64.5") == want
    # same-leaf peer: one router
    assert m.links_of_path("h0", 0, ["198.18.64.0"], "198.18.64.3") == ("h0-p0l0:up", "h1-p0l0:down")
    # plane 1, reverse direction h3 -> h1 through spine 0
    assert m.links_of_path("h3", 1, ["198.18.72.6", "198.18.144.5", "198.18.144.0"], "198.18.72.3") == (
        "h3-p1l1:up", "p1l1-p1s0:up", "p1l0-p1s0:down", "h1-p1l0:down")


def test_links_of_path_fills_unambiguous_gaps(testbed_model):
    m = testbed_model
    want = ("h0-p0l0:up", "p0l0-p0s1:up", "p0l1-p0s1:down", "h2-p0l1:down")
    assert m.links_of_path("h0", 0, [None, "198.18.128.3", None], "198.18.64.5") == want  # spine said which
    assert m.links_of_path("h0", 0, [None, None, "198.18.128.6"], "198.18.64.5") == want  # far leaf said which
    assert m.links_of_path("h0", 0, [None], "198.18.64.3") == ("h0-p0l0:up", "h1-p0l0:down")
    with pytest.raises(F.FabricError, match="ambiguous"):
        m.links_of_path("h0", 0, ["198.18.64.0", None, None], "198.18.64.5")  # two spines, neither answered


def test_links_of_path_gap_with_one_spine_is_filled():
    m = F.from_testbed(make_fabric(preset("tiny"), "lpy", "198.19.201.0/24"))  # 1 spine per plane
    assert m.links_of_path("h0", 0, [None, None, None], "198.18.64.3") == (
        "h0-p0l0:up", "p0l0-p0s0:up", "p0l1-p0s0:down", "h1-p0l1:down")


def test_links_of_path_rejects_inconsistent_hops(testbed_model):
    m = testbed_model
    with pytest.raises(F.FabricError, match="hop 1"):  # h1's leaf-side address, not h0's
        m.links_of_path("h0", 0, ["198.18.64.2"], "198.18.64.3")
    with pytest.raises(F.FabricError, match="different spines"):
        m.links_of_path("h0", 0, ["198.18.64.0", "198.18.128.1", "198.18.128.6"], "198.18.64.5")
    with pytest.raises(F.FabricError, match="routers"):
        m.links_of_path("h0", 0, ["198.18.64.0", "198.18.128.3"], "198.18.64.5")
    with pytest.raises(F.FabricError, match="no link"):
        m.links_of_path("h0", 0, ["10.9.9.9"], "198.18.64.3")
    with pytest.raises(F.FabricError, match="plane 1"):
        m.links_of_path("h0", 0, ["198.18.64.0"], "198.18.72.3")
    with pytest.raises(F.FabricError, match="not a host NIC"):
        m.links_of_path("h0", 0, ["198.18.64.0"], "198.18.64.2")


def test_round_trip_through_json(testbed_model):
    for m in (testbed_model, F.rail_optimized(12, 3, 5, 2)):
        back = F.FabricModel.from_dict(json.loads(json.dumps(m.to_dict())))
        assert back.links == m.links and back.hosts == m.hosts and back.planes == m.planes
        assert back.spines(1) == m.spines(1)
    assert F.FabricModel.from_dict(testbed_model.to_dict()).links_of_path(
        "h0", 0, ["198.18.64.0", "198.18.128.3", None], "198.18.64.5")[2] == "p0l1-p0s1:down"
    with pytest.raises(F.FabricError):
        F.FabricModel.from_dict({"hosts": []})


def test_model_rejects_inconsistent_links():
    with pytest.raises(F.FabricError, match="two uplinks"):
        F.FabricModel(["h0"], 1, [F.FleetLink("h0-p0l0", "host-leaf", 0, "h0", "p0l0"),
                                 F.FleetLink("h0-p0l1", "host-leaf", 0, "h0", "p0l1")])
    with pytest.raises(F.FabricError, match="not a host"):
        F.FabricModel(["h0"], 1, [F.FleetLink("h7-p0l0", "host-leaf", 0, "h7", "p0l0")])
    with pytest.raises(F.FabricError, match="kind"):
        F.FabricModel(["h0"], 1, [F.FleetLink("x", "core-superspine", 0, "a", "b")])
    with pytest.raises(F.FabricError, match="meets no leaf"):
        F.FabricModel(["h0"], 1, [F.FleetLink("p0s0-p0c0", "spine-core", 0, "p0s0", "p0c0")])
    dup = F.FabricModel(["h0", "h1"], 1, [F.FleetLink("h0-p0l0", "host-leaf", 0, "h0", "p0l0", "10.0.0.1", "10.0.0.0"),
                                         F.FleetLink("h1-p0l0", "host-leaf", 0, "h1", "p0l0", "10.0.0.1", "10.0.0.2")])
    with pytest.raises(F.FabricError, match="both"):
        dup.owner("10.0.0.1")


# ---- 3-tier fabrics --------------------------------------------------------------------------

def small_three_tier(addressed=False):
    # 16 hosts, 2 planes; racks of 2 -> 8 leaves per plane; pods of 2 leaves -> 4 pods with 2
    # spines each; 3 cores per group -> 6 cores per plane
    return F.three_tier(16, 2, 2, 2, 2, 3, addressed=addressed)


def test_three_tier_shape_pods_and_groups():
    m = small_three_tier()
    tiers = m.links_by_tier()
    assert len(tiers["host-leaf"]) == 32 and len(tiers["leaf-spine"]) == 2 * 8 * 2
    assert len(tiers["spine-core"]) == 2 * 8 * 3
    assert m.pods(0) == 4 and m.spines_per_pod(1) == 2 and m.cores_per_group(1) == 3
    assert m.pod_of("p0l3") == 1 and m.pod_of("p0s3") == 1 and m.pod_of("p1l7") == 3
    assert m.spine_of_pod(0, 2, 1) == "p0s5"
    # spine j of every pod meets the cores of group j: spine index 1 meets cores 3..5
    assert m.spine_core("p0s5", 0).name == "p0s5-p0c3" and m.spine_core("p0s1", 2).name == "p0s1-p0c5"
    assert m.same_pod("h0", "h3", 0) and not m.same_pod("h0", "h4", 0)
    # a 2-tier plane is one pod with no cores
    two = F.rail_optimized(8, 1, 4, 2)
    assert two.pods(0) == 1 and two.cores_per_group(0) == 0 and two.spines_per_pod(0) == 2


def test_three_tier_paths_climb_to_the_core_between_pods_only():
    m = small_three_tier()
    assert m.node_path("h0", "h1", 0, None) == ("h0-p0l0:up", "h1-p0l0:down")
    # same pod, other leaf: through a spine, core ignored
    assert m.node_path("h0", "h2", 0, 1, 2) == m.node_path("h0", "h2", 0, 1) == (
        "h0-p0l0:up", "p0l0-p0s1:up", "p0l1-p0s1:down", "h2-p0l1:down")
    # other pod: spine index 1 of pod 0 (p0s1), core 2 of group 1 (p0c5), spine index 1 of pod 2 (p0s5)
    assert m.node_path("h0", "h9", 0, 1, 2) == (
        "h0-p0l0:up", "p0l0-p0s1:up", "p0s1-p0c5:up", "p0s5-p0c5:down", "p0l4-p0s5:down", "h9-p0l4:down")
    with pytest.raises(F.FabricError, match="needs a core"):
        m.node_path("h0", "h9", 0, 1)
    assert m.reverse_definite("h0", 0, "h9") == ("h9-p0l4:up", "h0-p0l0:down")
    possible = m.reverse_possible("h0", 0, "h9")
    every = {d for s in range(2) for c in range(3) for d in m.node_path("h9", "h0", 0, s, c)}
    assert set(possible) == every and len(possible) == len(every) == 2 + 2 * 2 + 2 * 2 * 3
    assert set(m.reverse_possible("h0", 0, "h2")) == {d for s in range(2) for d in m.node_path("h2", "h0", 0, s)}


def test_three_tier_links_of_path_from_hops_with_gaps():
    m = small_three_tier(addressed=True)
    hops, dst = m.hops_of("h0", "h9", 1, 1, 2)
    assert len(hops) == 5
    want = m.node_path("h0", "h9", 1, 1, 2)
    assert m.links_of_path("h0", 1, hops, dst) == want
    # only the core answered: it names spine index and core, the rest is filled in
    assert m.links_of_path("h0", 1, [None, None, hops[2], None, None], dst) == want
    # only the far spine answered (the link into it from the core): it names both too
    assert m.links_of_path("h0", 1, [None, None, None, hops[3], None], dst) == want
    # only a spine answered: the core is ambiguous (3 per group)
    with pytest.raises(F.FabricError, match="no core answered"):
        m.links_of_path("h0", 1, [None, hops[1], None, None, None], dst)
    # a core of another path's choice next to this path's spine-core hop
    other, _ = m.hops_of("h0", "h9", 1, 1, 0)
    with pytest.raises(F.FabricError, match="different cores"):
        m.links_of_path("h0", 1, [None, None, hops[2], other[3], None], dst)
    other, _ = m.hops_of("h0", "h9", 1, 0, 2)
    with pytest.raises(F.FabricError, match="different spines"):
        m.links_of_path("h0", 1, [None, hops[1], other[2], None, None], dst)
    with pytest.raises(F.FabricError, match="5 routers"):
        m.links_of_path("h0", 1, hops[:3], dst)
    # within a pod the path has 3 routers, as in a 2-tier fabric
    hops, dst = m.hops_of("h0", "h3", 1, 0)
    assert len(hops) == 3 and m.links_of_path("h0", 1, hops, dst) == m.node_path("h0", "h3", 1, 0)


def test_three_tier_round_trips_and_rejects_a_core_shared_by_spine_indexes():
    m = small_three_tier()
    back = F.FabricModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back.node_path("h0", "h9", 0, 1, 2) == m.node_path("h0", "h9", 0, 1, 2) and back.pods(1) == 4
    links = [F.FleetLink(*row) for row in m.to_dict()["links"]]
    bad = links + [F.FleetLink("p0s0-p0c5", "spine-core", 0, "p0s0", "p0c5")]  # spine index 0 to group 1's core
    with pytest.raises(F.FabricError, match="one spine index of every pod"):
        F.FabricModel(m.hosts, 2, bad)
    cut = [lk for lk in links if not (lk.kind == "spine-core" and lk.plane == 0 and lk.b in ("p0c3", "p0c4", "p0c5"))]
    with pytest.raises(F.FabricError, match="cut off"):
        F.FabricModel(m.hosts, 2, cut)
    cross = links + [F.FleetLink("p0l0-p0s2", "leaf-spine", 0, "p0l0", "p0s2")]  # a leaf into another pod's spine
    with pytest.raises(F.FabricError, match="one pod only"):
        F.FabricModel(m.hosts, 2, cross)
    with pytest.raises(F.FabricError, match="cores_per_group >= 1"):
        F.three_tier(16, 2, 2, 2, 2, 0)


def test_131k_gpu_three_tier_fleet_builds():
    # 16 384 hosts x 8 rails, radix-64 switches: 512 leaves, 16 pods of 32 leaves and 32 spines,
    # 32 groups of 32 cores per plane
    m = F.three_tier(16384, 8, 32, 32, 32, 32)
    assert len(m.links) == 8 * 3 * 16384 and m.pods(7) == 16
    assert m.node_path("h0", "h16383", 7, 31, 31) == (
        "h0-p7l0:up", "p7l0-p7s31:up", "p7s31-p7c1023:up", "p7s511-p7c1023:down", "p7l511-p7s511:down",
        "h16383-p7l511:down")


def test_reverse_possible_with_a_limit_lists_them_or_none():
    three = F.three_tier(64, 2, 4, 4, 2, 4)
    for src, dst in (("h0", "h1"), ("h0", "h5"), ("h0", "h40")):  # same leaf, same pod, between pods
        for plane in range(2):
            every = three.reverse_possible(src, plane, dst)
            assert three.reverse_possible(src, plane, dst, len(every)) == every
            assert three.reverse_possible(src, plane, dst, len(every) - 1) == ()
