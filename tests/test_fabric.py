"""The fleet topology model (pure): generated and testbed fabrics, paths from discovery hops."""
from __future__ import annotations

import json

import pytest

from linkpass.core import fabric as F
from linkpass.testbed.topology import make_fabric, preset

pytestmark = pytest.mark.unit


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
        F.FabricModel(["h0"], 1, [F.FleetLink("x", "spine-core", 0, "a", "b")])
    dup = F.FabricModel(["h0", "h1"], 1, [F.FleetLink("h0-p0l0", "host-leaf", 0, "h0", "p0l0", "10.0.0.1", "10.0.0.0"),
                                         F.FleetLink("h1-p0l0", "host-leaf", 0, "h1", "p0l0", "10.0.0.1", "10.0.0.2")])
    with pytest.raises(F.FabricError, match="both"):
        dup.owner("10.0.0.1")
