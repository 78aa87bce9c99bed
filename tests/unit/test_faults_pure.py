"""Fault descriptions without the kernel: parsing, validation, the nft transaction text."""
from __future__ import annotations

import pytest

from linkpass.testbed import faults as F
from linkpass.testbed import topology as T
from linkpass.testbed.build import TestbedError


@pytest.fixture
def fab():
    return T.make_fabric(T.preset("default"), "lp", "198.19.0.0/24")


@pytest.mark.parametrize("text, seconds", [("200ms", 0.2), ("1.5s", 1.5), ("2", 2.0), ("750us", 0.00075), ("1m", 60.0)])
def test_parse_duration(text, seconds):
    assert F.parse_duration(text, "x") == pytest.approx(seconds)


@pytest.mark.parametrize("text, bps", [("10mbit", 10_000_000), ("1gbit", 10**9), ("64kbit", 64_000), ("500bit", 500)])
def test_parse_rate(text, bps):
    assert F.parse_rate(text, "x") == bps


def test_bad_units_say_what_is_expected():
    with pytest.raises(TestbedError, match="--period: 'soon' is not a duration; use e.g. 200ms"):
        F.parse_duration("soon", "flap --period")
    with pytest.raises(TestbedError, match="--rate: '10mb' is not a rate; use e.g. 10mbit"):
        F.parse_rate("10mb", "congest --rate")


@pytest.mark.parametrize("spec, message", [
    (F.FaultSpec("melt", "h0-p0l0"), "fault kind 'melt' is unknown"),
    (F.FaultSpec("loss", "h0-p0l0", None, {"pct": 0}), r"loss: PCT must be a number in \(0, 100\]"),
    (F.FaultSpec("loss", "h0-p0l0", None, {"pct": 101}), r"loss: PCT must be a number in \(0, 100\]"),
    (F.FaultSpec("loss", "h0-p0l0", "h3", {"pct": 5}), "--from 'h3': must be one end of h0-p0l0"),
    (F.FaultSpec("down", "h0-p0l0", "h0"), "--from applies to loss, mtu and congest"),
    (F.FaultSpec("mtu", "h0-p0l0", None, {"bytes": 1500}), "mtu: N must be an integer IP packet size 68..1499"),
    (F.FaultSpec("flap", "h0-p0l0", None, {"period": "1ms"}), "flap --period: must be between 10ms"),
    (F.FaultSpec("flap", "h0-p0l0", None, {"duration": "2h"}), "not a duration"),
    (F.FaultSpec("congest", "h0-p0l0", None, {"rate": "1bit"}), "congest --rate: must be between"),
    (F.FaultSpec("loss", "h0-p9l0", None, {"pct": 5}), "no link named 'h0-p9l0'"),
])
def test_validation_errors(fab, spec, message):
    with pytest.raises((TestbedError, T.TopologyError), match=message):
        F.validate(fab, spec)


def test_validate_canonicalises_link_name(fab):
    assert F.validate(fab, F.FaultSpec("loss", "p0l0-h0", "h0", {"pct": 5})).link == "h0-p0l0"


def test_nft_script_is_one_transaction_per_namespace(fab):
    fs = [
        {"id": 1, "kind": "loss", "link": "h0-p0l0", "direction": "h0", "params": {"pct": 12.5}},
        {"id": 2, "kind": "mtu", "link": "h0-p0l0", "direction": None, "params": {"bytes": 1000}},
        {"id": 3, "kind": "loss", "link": "p0l0-p0s0", "direction": None, "params": {"pct": 1}},  # lives on p0s0
        {"id": 4, "kind": "down", "link": "h1-p0l0", "direction": None, "params": {}},
    ]
    script = F.render_nft("lp", fab, fs, "p0l0")
    lines = script.splitlines()
    # add + delete + create: the kernel swaps the whole table atomically
    assert lines[:3] == ["table netdev lp_faults", "delete table netdev lp_faults", "table netdev lp_faults {"]
    assert "numgen random mod 1000000 < 125000 counter drop comment \"fault 1\"" in script
    # h0 -> p0l0 is the leaf's ingress; p0l0 -> h0 its egress, where `meta length` counts the L2 header
    chains = {block.split("{")[0].strip(): block for block in script.split(" chain ")[1:]}
    ingress, egress = chains["ingress_h0"], chains["egress_h0"]
    assert "meta length > 1000" in ingress and "fault 1" in ingress
    assert "meta length > 1014" in egress and "fault 1" not in egress
    assert "fault 3" not in script and "fault 4" not in script
    assert "fault 3" in F.render_nft("lp", fab, fs, "p0s0")


def test_nft_script_without_faults_only_removes_the_table(fab):
    assert F.render_nft("lp", fab, [], "p0l0").splitlines() == ["table netdev lp_faults", "delete table netdev lp_faults"]


def test_total_loss_is_a_plain_drop(fab):
    fs = [{"id": 7, "kind": "loss", "link": "h0-p0l0", "direction": None, "params": {"pct": 100}}]
    script = F.render_nft("lp", fab, fs, "p0l0")
    assert "numgen" not in script and script.count('counter drop comment "fault 7"') == 2


def test_congestion_leaving_a_soft_roce_guest_is_refused_and_the_other_direction_allowed():
    spec = T.Spec(hosts=4, planes=2, leaves_per_plane=2, spines_per_plane=2, rdma_hosts=(0,))
    gfab = T.make_fabric(spec, "g", "198.19.9.0/24")
    for direction in (None, "h0"):
        with pytest.raises(TestbedError, match="queues inside that Soft-RoCE guest.*--from p0l0"):
            F.validate(gfab, F.FaultSpec("congest", "h0-p0l0", direction, {"rate": "10mbit"}))
    assert F.validate(gfab, F.FaultSpec("congest", "h0-p0l0", "p0l0", {"rate": "10mbit"})).direction == "p0l0"
    assert F.validate(gfab, F.FaultSpec("congest", "h1-p0l0", None, {"rate": "10mbit"}))  # a namespace host


def test_restorable_keeps_only_hops_on_ports_that_are_up():
    single = T.Route("198.18.0.0/24", (("198.18.1.0", "l0"),))
    ecmp = T.Route("198.18.2.0/24", (("198.18.1.0", "l0"), ("198.18.1.2", "l1")), src="198.18.9.1")
    assert F.restorable([single, ecmp], {"l0", "l1"}) == [single, ecmp]
    assert F.restorable([single, ecmp], {"l1"}) == [T.Route("198.18.2.0/24", (("198.18.1.2", "l1"),), "198.18.9.1")]
    assert F.restorable([single, ecmp], set()) == []
    # a spine's baseline: every route has one hop, through one leaf port
    spine = T.make_fabric(T.preset("default"), "lp", "198.19.0.0/24").routes["p0s0"]
    ports = {hop[1] for r in spine for hop in r.via}
    assert len(ports) == 2
    one = sorted(ports)[0]
    assert F.restorable(spine, {one}) == [r for r in spine if r.via[0][1] == one] != []
