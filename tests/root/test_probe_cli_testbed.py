"""`linkpass probe` / `linkpass trace`: real runs on the shared testbed, including a cut link and a
port in use (documents, rendering and usage errors: tests/unit/test_probe_cli.py)."""
from __future__ import annotations

import argparse
import json

from linkpass.cli import pathcheck as CP
from linkpass.probe import pathcheck as PC


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    CP.register(ap.add_subparsers(dest="command"))
    return ap


def run_json(argv: list[str], capsys) -> tuple[int, dict]:
    args = parser().parse_args(argv + ["-o", "json"])
    code = args.func(args)
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out.strip() else {"stderr": out.err}


def test_probe_finds_two_planes_times_two_spines(fabric, capsys):
    code, doc = run_json(["probe", "h0", "h3", "--testbed", fabric.prefix], capsys)
    assert code == 0, doc
    assert doc["summary"] == {"planes": 2, "planes_reached": 2, "paths": 4, "paths_reached": 4}
    for pl in doc["planes"]:
        p = pl["plane"]
        routes = sorted(x["route"] for x in pl["paths"])
        assert routes == [f"p{p}l0 > p{p}s{s} > p{p}l1 > h3" for s in (0, 1)]
        assert sum(x["seen"] for x in pl["paths"]) == PC.PROBE_PORTS == pl["swept"]
        assert all(min(x["ports"]) >= PC.PROBE_BASE_PORT for x in pl["paths"])
        assert all(x["rtt_ms"] is not None and x["rtt_ms"] < 50 for x in pl["paths"])
        assert all(x["links"][0] == f"h0-p{p}l0" and x["links"][-1] == f"h3-p{p}l1" for x in pl["paths"])


def test_trace_the_same_sport_twice_takes_the_same_path(fabric, capsys):
    argv = ["trace", "h0", "h3", "--sport", "31005", "--testbed", fabric.prefix]
    code1, first = run_json(argv, capsys)
    code2, second = run_json(argv, capsys)
    assert code1 == code2 == 0
    assert [r["path_id"] for r in first["planes"]] == [r["path_id"] for r in second["planes"]]
    assert all(r["reached"] and len(r["hops"]) == 3 for r in first["planes"])
    # and the probe sweep agrees: port 31005 is listed under that very path
    _, probe = run_json(["probe", "h0", "h3", "--testbed", fabric.prefix], capsys)
    for r, pl in zip(first["planes"], probe["planes"]):
        assert 31005 in {port for x in pl["paths"] if x["id"] == r["path_id"] for port in x["ports"]}
    code, one = run_json(argv + ["--plane", "1"], capsys)
    assert code == 0 and [r["plane"] for r in one["planes"]] == [1]


def test_a_cut_link_shows_as_an_unreached_path_and_exit_1(clean_faults, capsys):
    from linkpass.testbed import faults

    fab = clean_faults
    faults.apply(fab.prefix, faults.FaultSpec("down", "p0l0-p0s1"))  # cleared by the fixture, pass or fail
    code, doc = run_json(["probe", "h0", "h3", "--testbed", fab.prefix], capsys)
    assert code == 1, doc
    p0, p1 = doc["planes"]
    assert all(x["reached"] for x in p1["paths"]) and len(p1["paths"]) == 2
    dead = [x for x in p0["paths"] if not x["reached"]]
    # the path into the cut dies right after the leaf: the last answer came in over h0's uplink
    assert any(x["route"] == "p0l0 > ✗" and x["links"] == ["h0-p0l0"] for x in dead), p0
    args = parser().parse_args(["probe", "h0", "h3", "--testbed", fab.prefix])
    assert args.func(args) == 1
    text = capsys.readouterr().out
    assert "✗ plane 0" in text and "lost after p0l0 (came in over h0-p0l0)" in text


def test_a_port_in_use_is_exit_3(fabric, capsys):
    from linkpass.kernel import netns as ns_io

    sock = ns_io.socket_in_netns(fabric.netns("h0"))
    try:
        sock.bind((fabric.nic_addr(0, 0), 31999))
        args = parser().parse_args(["trace", "h0", "h3", "--sport", "31999", "--testbed", fabric.prefix])
        assert args.func(args) == 3
    finally:
        sock.close()
    assert "in use" in capsys.readouterr().err
