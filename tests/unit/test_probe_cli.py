"""`linkpass probe` / `linkpass trace`: documents and rendering from fake path tables (golden
files) and usage errors (real runs on the shared testbed: tests/root/test_probe_cli_testbed.py).

Golden files live in tests/golden/{probe,trace}_*.txt; regenerate them after an intended change with

    LINKPASS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_probe_cli.py -k golden
"""
from __future__ import annotations

import argparse
import socket

import pytest

from linkpass.cli import pathcheck as CP
from linkpass.core import paths as P
from linkpass.probe import pathcheck as PC
from linkpass.testbed import pathcheck_hosts as TP
from linkpass.testbed import topology

from support.golden import check_golden


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    CP.register(ap.add_subparsers(dest="command"))
    return ap


def ip(addr: str) -> str:
    return addr.split("/")[0]


def fake_fabric():
    return topology.make_fabric(topology.preset("default"), "t", "198.19.200.0/24")


def fake_table(fab, ports, broken_plane: int | None = None):
    """h0 -> h3 traces: port parity picks the spine; on `broken_plane` the spine-1 path dies after the leaf."""
    traces = []
    for p in range(fab.spec.planes):
        for sport in ports:
            s = sport % 2
            hops = (ip(fab.uplink("h0", p).b_addr), ip(fab.links[f"p{p}l0-p{p}s{s}"].b_addr),
                    ip(fab.links[f"p{p}l1-p{p}s{s}"].a_addr))
            if p == broken_plane and s == 1:
                traces.append(P.Trace(f"p{p}", fab.nic_addr(0, p), fab.nic_addr(3, p), sport, hops[:1], P.END_LOST))
            else:
                traces.append(P.Trace(f"p{p}", fab.nic_addr(0, p), fab.nic_addr(3, p), sport, hops, P.END_REACHED, 4))
    return P.build_table(traces, k=len(ports), host="h0")


def probe_doc(fab, src, dst, table, planes, ports, dport, rtts):
    return PC.probe_doc(f"h{src}", f"h{dst}", {"testbed": fab.prefix}, table, TP.legs(fab, src, dst, planes), ports,
                        dport, rtts, TP.FabricNamer(fab, dst))


def trace_doc(fab, src, dst, table, planes, sport, dport, rtts):
    return PC.trace_doc(f"h{src}", f"h{dst}", {"testbed": fab.prefix}, table, TP.legs(fab, src, dst, planes), sport,
                        dport, rtts, TP.FabricNamer(fab, dst))


def fake_rtts(table):
    out, n = {}, 0
    for (_peer, local), e in sorted(table.entries.items()):
        for path in e.paths.values():
            if path.reached:
                n += 1
                out[(int(local[1:]), path.id)] = [0.010 * n, 0.012 * n, 0.011 * n]
    return out


PORTS = tuple(range(31000, 31008))


def test_probe_doc_names_routers_and_links():
    fab = fake_fabric()
    table = fake_table(fab, PORTS)
    doc = probe_doc(fab, 0, 3, table, [0, 1], PORTS, 4791, fake_rtts(table))
    assert doc["summary"] == {"planes": 2, "planes_reached": 2, "paths": 4, "paths_reached": 4}
    assert CP.exit_code(doc) == 0
    p0 = doc["planes"][0]
    routes = sorted(x["route"] for x in p0["paths"])
    assert routes == ["p0l0 > p0s0 > p0l1 > h3", "p0l0 > p0s1 > p0l1 > h3"]
    by_route = {x["route"]: x for x in p0["paths"]}
    via_s1 = by_route["p0l0 > p0s1 > p0l1 > h3"]
    assert via_s1["ports"] == [31001, 31003, 31005, 31007]
    assert via_s1["links"] == ["h0-p0l0", "p0l0-p0s1", "p0l1-p0s1", "h3-p0l1"]
    assert [h["node"] for h in via_s1["hops"]] == ["p0l0", "p0s1", "p0l1"]


def test_probe_doc_with_a_dead_path_warns_and_a_dead_fabric_is_critical():
    fab = fake_fabric()
    table = fake_table(fab, PORTS, broken_plane=0)
    doc = probe_doc(fab, 0, 3, table, [0, 1], PORTS, 4791, fake_rtts(table))
    assert doc["summary"]["paths_reached"] == 3 and doc["summary"]["planes_reached"] == 2
    assert CP.exit_code(doc) == 1
    assert CP.exit_code({"summary": {"planes": 2, "planes_reached": 1, "paths": 2, "paths_reached": 1}}) == 1
    assert CP.exit_code({"summary": {"planes": 2, "planes_reached": 0, "paths": 2, "paths_reached": 0}}) == 2


def test_trace_doc_follows_one_port():
    fab = fake_fabric()
    table = fake_table(fab, (31003,))
    doc = trace_doc(fab, 0, 3, table, [0, 1], 31003, 4791, fake_rtts(table))
    assert [r["route"] for r in doc["planes"]] == ["p0l0 > p0s1 > p0l1 > h3", "p1l0 > p1s1 > p1l1 > h3"]
    assert doc["planes"][0]["flow"] == {"proto": "udp", "src": "198.18.64.1", "sport": 31003,
                                        "dst": "198.18.64.7", "dport": 4791}
    missing = trace_doc(fab, 0, 3, P.build_table([], host="h0"), [0], 31003, 4791, {})
    assert missing["planes"][0]["end"] == "not probed" and CP.exit_code(missing) == 2


@pytest.mark.parametrize("fmt", ["table", "wide"])
def test_probe_rendering_matches_golden(fmt, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    fab = fake_fabric()
    table = fake_table(fab, PORTS, broken_plane=0)
    doc = probe_doc(fab, 0, 3, table, [0, 1], PORTS, 4791, fake_rtts(table))
    check_golden(f"probe_{fmt}.txt", CP.render_probe(doc, wide=fmt == "wide") + "\n")


@pytest.mark.parametrize("fmt", ["table", "wide"])
def test_trace_rendering_matches_golden(fmt, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    fab = fake_fabric()
    table = fake_table(fab, (31001,), broken_plane=1)
    doc = trace_doc(fab, 0, 3, table, [0, 1], 31001, 4791, fake_rtts(table))
    check_golden(f"trace_{fmt}.txt", CP.render_trace(doc, wide=fmt == "wide") + "\n")


def test_choosing_the_testbed():
    assert TP.pick_prefix(None, ["lp"]) == "lp"
    assert TP.pick_prefix("b", ["a", "b"]) == "b"
    with pytest.raises(TP.UsageError, match="no testbed is running"):
        TP.pick_prefix(None, [])
    with pytest.raises(TP.UsageError, match=r"2 testbeds are running \(a, b\); choose one with --testbed"):
        TP.pick_prefix(None, ["a", "b"])
    with pytest.raises(TP.UsageError, match="no testbed with prefix 'c' is up"):
        TP.pick_prefix("c", ["a", "b"])
    fab = fake_fabric()
    assert TP.host_index(fab, "h3") == 3
    for bad in ("h4", "x1", "h", "p0l0"):
        with pytest.raises(TP.UsageError, match="has hosts h0..h3"):
            TP.host_index(fab, bad)


def test_no_testbed_is_exit_3(monkeypatch, tmp_path, capsys):
    from linkpass.testbed import state

    monkeypatch.setattr(state, "STATE_DIR", str(tmp_path))  # an empty state directory: nothing runs
    monkeypatch.setattr(CP.os, "geteuid", lambda: 0)
    for argv in (["probe", "h0", "h3"], ["trace", "h0", "h3", "--sport", "31000"]):
        args = parser().parse_args(argv)
        assert args.func(args) == 3
        assert "no testbed is running" in capsys.readouterr().err


def test_the_testbed_form_needs_root_and_the_agent_form_needs_an_agent(monkeypatch, capsys):
    monkeypatch.setattr(CP.os, "geteuid", lambda: 1000)
    args = parser().parse_args(["probe", "h0", "h3"])
    assert args.func(args) == 3
    assert "needs root" in capsys.readouterr().err
    # DST alone asks the local agent; nothing listens on this port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for argv in (["probe", "h3", "--port", str(port)], ["trace", "h3", "--sport", "49152", "--port", str(port)]):
        args = parser().parse_args(argv)
        assert args.func(args) == 3
        err = capsys.readouterr().err
        assert f"no agent answers on 127.0.0.1:{port}" in err and "\n" not in err.strip()
    for argv, why in ((["probe", "h0", "h1", "h3"], "at most two hosts"),
                      (["probe", "h3", "--testbed", "t"], "--testbed goes with SRC DST"),
                      (["probe", "h3", "--ports", "0"], "ports must fit"),
                      (["trace", "h3", "--sport", "70000"], "a UDP port is 1..65535")):
        args = parser().parse_args(argv)
        assert args.func(args) == 3, argv
        assert why in capsys.readouterr().err


def test_a_silent_dst_behind_its_leaf_gets_a_hint(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    fab = fake_fabric()
    hops = (ip(fab.uplink("h0", 0).b_addr), ip(fab.links["p0l0-p0s0"].b_addr), ip(fab.links["p0l1-p0s0"].a_addr))
    table = P.build_table([P.Trace("p0", fab.nic_addr(0, 0), fab.nic_addr(3, 0), 31000, hops, P.END_LOST)], host="h0")
    doc = trace_doc(fab, 0, 3, table, [0], 31000, 4791, {})
    assert doc["planes"][0]["dst_silent"] and CP.exit_code(doc) == 2
    assert "an agent listening there swallows them" in CP.render_trace(doc)


@pytest.mark.unit
def test_the_exit_code_derives_from_the_checks_health_level(monkeypatch):
    """A path check judges a health level (core/states.py); its exit code is the CLI's one for
    that level (console/output.py). Changing that table changes `probe` and `trace`, so no copy of
    it can hide here."""
    from linkpass.console import output
    from linkpass.core.states import Level

    for level, code in zip(Level, (97, 98, 99)):
        monkeypatch.setitem(output.EXIT_OF_LEVEL, level, code)
    for summary, level in [({"planes": 2, "planes_reached": 2, "paths": 3, "paths_reached": 3}, Level.OK),
                           ({"planes": 2, "planes_reached": 2, "paths": 3, "paths_reached": 2}, Level.WARNING),
                           ({"planes": 2, "planes_reached": 1}, Level.WARNING),
                           ({"planes": 2, "planes_reached": 0}, Level.CRITICAL)]:
        assert PC.health({"summary": summary}) is level
        assert CP.exit_code({"summary": summary}) == output.EXIT_OF_LEVEL[level]
