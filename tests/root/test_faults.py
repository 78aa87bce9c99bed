"""Every fault kind, measured on the real kernel: its effect within a stated tolerance, on
the stated direction only, and gone after --clear.

Paths: h0 (leaf p0l0) <-> h3 (leaf p0l1) on plane 0 cross a spine chosen by the source port;
`ports` finds, per direction, a source port through each spine.
"""
from __future__ import annotations

import datetime as dt
import statistics
import time

import pytest

from linkpass.testbed import faults, traffic
from linkpass.testbed.faults import FaultSpec

N = 3000  # packets per loss measurement: sd of a 30 % estimate is 0.8 points


@pytest.fixture(scope="module")
def ports(fabric):
    """{(src, dst, spine): sport} for h0<->h3 on plane 0, both spines, both directions."""
    found = {}
    for src, dst in ((0, 3), (3, 0)):
        for sport in range(50000, 50064):
            spine = traffic.spine_for_sport(fabric, src, dst, 0, sport)
            found.setdefault((src, dst, spine), sport)
    assert len(found) == 4, found
    return found


def loss(fab, src, dst, sport, count=N, size=128, plane=0):
    return traffic.send_flow(fab, src, dst, plane=plane, sport=sport, count=count, size=size).loss_pct


def test_loss_one_direction_on_a_host_uplink(clean_faults, ports):
    fab = clean_faults
    before = time.monotonic_ns()
    rec = faults.apply(fab.prefix, FaultSpec("loss", "h0-p0l0", "h0", {"pct": 30}))
    after = time.monotonic_ns()
    assert before <= rec["effective_mono_ns"] <= after
    assert dt.datetime.fromisoformat(rec["effective_at"]).tzinfo is not None
    sport = ports[(0, 3, "p0s0")]
    assert loss(fab, 0, 3, sport) == pytest.approx(30, abs=5)
    assert loss(fab, 3, 0, ports[(3, 0, "p0s0")]) < 1  # the other direction is untouched
    assert loss(fab, 0, 3, sport, plane=1) < 1  # and so is the other plane
    faults.clear(fab.prefix)
    assert loss(fab, 0, 3, sport, count=1000) == 0


def test_loss_both_directions_on_a_leaf_spine_link(clean_faults, ports):
    fab = clean_faults
    faults.apply(fab.prefix, FaultSpec("loss", "p0l0-p0s0", None, {"pct": 20}))
    assert loss(fab, 0, 3, ports[(0, 3, "p0s0")]) == pytest.approx(20, abs=5)
    assert loss(fab, 3, 0, ports[(3, 0, "p0s0")]) == pytest.approx(20, abs=5)
    assert loss(fab, 0, 3, ports[(0, 3, "p0s1")]) < 1  # same leaf, other spine
    faults.clear(fab.prefix, "p0l0-p0s0")
    assert loss(fab, 3, 0, ports[(3, 0, "p0s0")], count=1000) == 0


def test_one_direction_black_hole_on_a_spine_downlink(clean_faults, ports):
    fab = clean_faults
    faults.apply(fab.prefix, FaultSpec("loss", "p0l1-p0s0", "p0s0", {"pct": 100}))
    assert loss(fab, 0, 3, ports[(0, 3, "p0s0")], count=500) == 100  # spine -> leaf 1: dropped
    assert loss(fab, 3, 0, ports[(3, 0, "p0s0")], count=500) == 0  # leaf 1 -> spine: passes
    faults.clear(fab.prefix)
    assert loss(fab, 0, 3, ports[(0, 3, "p0s0")], count=500) == 0


def test_mtu_black_hole_drops_only_large_packets(clean_faults, ports):
    fab = clean_faults
    faults.apply(fab.prefix, FaultSpec("mtu", "p0l0-p0s0", None, {"bytes": 1200}))
    via_s0, back_s0 = ports[(0, 3, "p0s0")], ports[(3, 0, "p0s0")]
    assert loss(fab, 0, 3, via_s0, count=300, size=1200) == 0
    assert loss(fab, 0, 3, via_s0, count=300, size=1201) == 100
    assert loss(fab, 3, 0, back_s0, count=300, size=1400) == 100
    assert loss(fab, 0, 3, ports[(0, 3, "p0s1")], count=300, size=1400) == 0
    faults.clear(fab.prefix)
    assert loss(fab, 0, 3, via_s0, count=300, size=1400) == 0


def test_mtu_black_hole_in_one_direction(clean_faults, ports):
    fab = clean_faults
    faults.apply(fab.prefix, FaultSpec("mtu", "h0-p0l0", "h0", {"bytes": 1000}))
    assert loss(fab, 0, 3, ports[(0, 3, "p0s0")], count=300, size=1400) == 100
    assert loss(fab, 3, 0, ports[(3, 0, "p0s0")], count=300, size=1400) == 0
    assert loss(fab, 0, 3, ports[(0, 3, "p0s0")], count=300, size=1000) == 0


def test_congestion_caps_rate_and_adds_queueing_delay(clean_faults, ports):
    fab = clean_faults
    faults.apply(fab.prefix, FaultSpec("congest", "p0l0-p0s0", "p0l0", {"rate": "10mbit", "queue": "50ms"}))
    res = traffic.send_flow(fab, 0, 3, plane=0, sport=ports[(0, 3, "p0s0")], count=1000, size=1000)
    assert res.rate_bps() == pytest.approx(10e6, rel=0.2)
    assert 35 <= max(res.one_way_ms) <= 75  # a full 50 ms queue (+ ~4 ms of burst) at 10 Mbit/s
    back = traffic.send_flow(fab, 3, 0, plane=0, sport=ports[(3, 0, "p0s0")], count=1000, size=1000)
    assert back.loss_pct == 0 and back.rate_bps() > 50e6  # the reverse direction is not shaped
    other = traffic.send_flow(fab, 0, 3, plane=0, sport=ports[(0, 3, "p0s1")], count=1000, size=1000)
    assert other.loss_pct == 0 and other.rate_bps() > 50e6
    faults.clear(fab.prefix)
    res = traffic.send_flow(fab, 0, 3, plane=0, sport=ports[(0, 3, "p0s0")], count=1000, size=1000)
    assert res.loss_pct == 0 and statistics.median(res.one_way_ms) < 10


def test_down_host_uplink_cuts_only_that_plane(clean_faults):
    fab = clean_faults
    rec = faults.apply(fab.prefix, FaultSpec("down", "h1-p0l0"))
    assert rec["apply_ms"] < 1000
    assert traffic.send_flow(fab, 1, 2, plane=0, count=200).loss_pct == 100
    assert traffic.send_flow(fab, 2, 1, plane=0, count=200).loss_pct == 100
    assert traffic.send_flow(fab, 1, 2, plane=1, count=200).loss_pct == 0
    assert traffic.send_flow(fab, 1, 2, plane=1, target="service", count=200).loss_pct == 0
    faults.clear(fab.prefix)
    assert traffic.send_flow(fab, 1, 2, plane=0, count=200).loss_pct == 0
    assert traffic.send_flow(fab, 2, 1, plane=0, target="service", count=200).loss_pct == 0


def test_down_leaf_spine_link_black_holes_the_ports_that_hash_onto_it(clean_faults, ports):
    fab = clean_faults
    faults.apply(fab.prefix, FaultSpec("down", "p0l0-p0s1"))
    assert loss(fab, 0, 3, ports[(0, 3, "p0s1")], count=200) == 100
    assert loss(fab, 0, 3, ports[(0, 3, "p0s0")], count=200) == 0
    faults.clear(fab.prefix)
    assert loss(fab, 0, 3, ports[(0, 3, "p0s1")], count=200) == 0
    assert all(r["ok"] for r in traffic.reachability(fab, tries=2))  # every route came back


def test_flap_alternates_and_stops_on_clear(clean_faults):
    fab = clean_faults
    rec = faults.apply(fab.prefix, FaultSpec("flap", "h2-p1l1", None, {"period": "200ms", "duration": "30s"}))
    res = traffic.send_flow(fab, 2, 0, plane=1, count=2000, interval_s=0.001)
    # half of each period down: about half the packets lost, in runs, not at random
    assert res.loss_pct == pytest.approx(50, abs=20)
    got = set(res.seqs)
    runs, last, length = [], None, 0
    for seq in range(res.sent):
        state = seq in got
        if state == last:
            length += 1
        else:
            if last is not None:
                runs.append((last, length))
            last, length = state, 1
    assert max(n for ok, n in runs if not ok) >= 40 and max(n for ok, n in runs if ok) >= 40
    from linkpass.testbed import state as st
    log = open(st.flap_log_path(fab.prefix, rec["id"])).read().split("\n")
    transitions = [line.split()[1] for line in log if line]
    assert len(transitions) >= 6 and transitions[:2] == ["down", "up"]
    faults.clear(fab.prefix)
    assert faults.active(fab.prefix) == []
    assert traffic.send_flow(fab, 2, 0, plane=1, count=500, interval_s=0.0005).loss_pct == 0


@pytest.mark.parametrize("order", ["all-at-once", "first-then-second", "second-then-first"])
def test_both_links_of_one_spine_down_clear_in_any_order(clean_faults, ports, order):
    """Both leaf links of spine p0s0 down: bringing one back must not need the other's port (the
    spine's routes through a port still down are left for when it comes up)."""
    fab = clean_faults
    links = ["p0l0-p0s0", "p0l1-p0s0"]
    for link in links:
        faults.apply(fab.prefix, FaultSpec("down", link))
    assert loss(fab, 0, 3, ports[(0, 3, "p0s0")], count=100) == 100
    if order == "all-at-once":
        assert {f["link"] for f in faults.clear(fab.prefix)} == set(links)
    else:
        first, second = links if order == "first-then-second" else links[::-1]
        assert [f["link"] for f in faults.clear(fab.prefix, first)] == [first]
        assert [f["link"] for f in faults.active(fab.prefix)] == [second]
        assert loss(fab, 0, 3, ports[(0, 3, "p0s0")], count=100) == 100  # the other link is still down
        assert [f["link"] for f in faults.clear(fab.prefix, second)] == [second]
    assert faults.active(fab.prefix) == []
    assert loss(fab, 0, 3, ports[(0, 3, "p0s0")], count=200) == 0
    assert loss(fab, 3, 0, ports[(3, 0, "p0s0")], count=200) == 0
    assert all(r["ok"] for r in traffic.reachability(fab, tries=2))  # every route came back
