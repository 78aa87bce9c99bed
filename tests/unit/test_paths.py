"""The path table (pure): traces, grouping of ports by path, stable ids, diffs. No root needed."""
from __future__ import annotations

import json

import pytest

from linkpass.core import paths as P
from linkpass.probe import discovery as D


def te(ttl, addr):
    return P.Answer(ttl, P.TIME_EXCEEDED, addr)


def trace(sport, hops, end=P.END_REACHED, peer="10.0.0.9", local="p0", src="10.0.0.1"):
    return P.Trace(local, src, peer, sport, tuple(hops), end)


def test_make_trace_reached_ignores_answers_past_the_end():
    answers = [P.Answer(5, P.REACHED, "9.9.9.9"), te(2, "b"), P.Answer(4, P.REACHED, "9.9.9.9"), te(1, "a"),
               te(3, "c"), te(6, "zz")]
    t = P.make_trace("p0", "1.1.1.1", "9.9.9.9", 50000, answers, probes=6)
    assert (t.hops, t.end, t.end_ttl, t.reached, t.probes) == (("a", "b", "c"), P.END_REACHED, 4, True, 6)


def test_make_trace_gap_unreachable_and_lost():
    gap = P.make_trace("p0", "s", "d", 1, [te(1, "a"), te(3, "c"), P.Answer(4, P.REACHED, "d")])
    assert gap.hops == ("a", None, "c") and gap.reached
    unreach = P.make_trace("p0", "s", "d", 1, [te(1, "a"), P.Answer(2, P.UNREACHABLE, "b"),
                                               P.Answer(3, P.UNREACHABLE, "b")])
    assert (unreach.hops, unreach.end, unreach.end_ttl) == (("a", "b"), P.END_UNREACHABLE, 2)
    lost = P.make_trace("p0", "s", "d", 1, [te(1, "a")], lost=3)
    assert (lost.hops, lost.end, lost.end_ttl, lost.lost) == (("a",), P.END_LOST, None, 3)
    silent = P.make_trace("p0", "s", "d", 1, [])
    assert (silent.hops, silent.end) == ((), P.END_LOST)
    with pytest.raises(P.PathError):
        P.Answer(1, "echo", "a")


def test_build_table_groups_ports_by_path_and_keeps_k():
    via_x, via_y = ("l0", "x", "l1"), ("l0", "y", "l1")
    traces = [trace(s, via_x if s % 3 else via_y) for s in range(100, 120)]
    traces += [trace(s, ("l0",), peer="10.0.0.2") for s in range(100, 120)]
    table = P.build_table(reversed(traces), k=3, host="h0")
    entry = table.get("10.0.0.9", "p0")
    assert [p.hops for p in entry.paths.values()] == [via_x, via_y]
    x, y = entry.paths.values()
    assert x.ports == (100, 101, 103) and x.seen == 14
    assert y.ports == (102, 105, 108) and y.seen == 6
    assert entry.path_of(104) == x and entry.path_of(105) == y and entry.path_of(999) is None
    assert len(table) == 2 and len(table.paths("10.0.0.2", "p0")) == 1
    doc = json.loads(json.dumps(table.to_dict(all_ports=True)))
    assert doc["host"] == "h0" and doc["entries"][1]["paths"][0]["ports"] == [100, 101, 103]
    assert doc["entries"][1]["ports"]["102"] == y.id
    with pytest.raises(P.PathError):
        P.build_table([trace(1, via_x), trace(1, via_y)])
    with pytest.raises(P.PathError):
        P.build_table([trace(1, via_x)], k=0)


def test_path_ids_are_stable_and_depend_on_hops_and_end():
    a = P.path_id(("l0", "x", "l1"), P.END_REACHED)
    assert a == P.path_id(["l0", "x", "l1"], "reached") and len(a) == 8
    assert a != P.path_id(("l0", "x", "l1"), P.END_LOST)
    assert a != P.path_id(("l0", "y", "l1"), P.END_REACHED)
    assert P.path_id(("l0", None), P.END_LOST) != P.path_id(("l0",), P.END_LOST)
    t1 = P.build_table([trace(s, ("l0", "x", "l1")) for s in (1, 2)], host="h0")
    t2 = P.build_table([trace(s, ("l0", "x", "l1"), local="p1", src="7.7.7.7") for s in (9, 8)], host="h5")
    assert list(t1.get("10.0.0.9", "p0").paths) == list(t2.get("10.0.0.9", "p1").paths) == [a]


def test_diff_reports_new_and_removed_paths_and_moved_ports():
    via_x, via_y = ("l0", "x", "l1"), ("l0", "y", "l1")
    old = P.build_table([trace(s, via_x if s < 4 else via_y) for s in range(8)]
                        + [trace(s, ("l0",), peer="10.0.0.2") for s in range(8)])
    assert not P.diff_tables(old, old).changed
    new = P.build_table([trace(s, via_x if s < 4 else ("l0",), end=P.END_REACHED if s < 4 else P.END_LOST)
                         for s in range(8)] + [trace(s, ("l0",), peer="10.0.0.3") for s in range(8)])
    d = P.diff_tables(old, new)
    assert d.changed and d.new_pairs == (("10.0.0.3", "p0"),) and d.gone_pairs == (("10.0.0.2", "p0"),)
    e = d.get("10.0.0.9", "p0")
    assert [p.hops for p in e.removed] == [via_y]
    assert [(p.hops, p.end) for p in e.added] == [(("l0",), P.END_LOST)]
    assert [m.sport for m in e.moved] == [4, 5, 6, 7]
    assert {(m.old, m.new) for m in e.moved} == {(e.removed[0].id, e.added[0].id)}
    json.dumps(d.to_dict())


def test_config_is_validated():
    with pytest.raises(ValueError):
        D.DiscoveryConfig(ports=(1, 1))
    with pytest.raises(ValueError):
        D.DiscoveryConfig(window=0)
    with pytest.raises(ValueError):
        D.DiscoveryConfig(timeout_s=0)
    assert D.default_payload(D.Probe("p0", "a", "b", 49152, 4791, 3, 1)) != \
        D.default_payload(D.Probe("p0", "a", "b", 49152, 4791, 3, 2))


def test_targets_bind_to_each_nics_own_interface_name():
    """A production NIC is ens1f0np0, not the testbed's p0: the sockets bind to that device and
    the table is keyed by it, on the planes both ends have."""
    from linkpass.agent.config import Nic, Peer

    nics = [Nic(0, "ens1f0np0", "198.18.0.1"), Nic(1, "ens2f0np0", "198.18.1.1")]
    peers = [Peer("h3", 4, "198.19.0.7", {0: "198.18.0.7", 1: "198.18.1.7"}),
             Peer("h5", 6, "198.19.0.9", {1: "198.18.1.9", 2: "198.18.2.9"})]
    assert D.discovery_targets(nics, peers) == [
        D.Target("ens1f0np0", "198.18.0.1", "198.18.0.7"), D.Target("ens2f0np0", "198.18.1.1", "198.18.1.7"),
        D.Target("ens2f0np0", "198.18.1.1", "198.18.1.9")]
