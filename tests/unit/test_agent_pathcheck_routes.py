"""`linkpass probe DST` / `trace DST` through the local agent's API: the query's checks and the
join with the agent's own probes (the real thing on the testbed:
tests/root/test_agent_oneshot_testbed.py)."""
from __future__ import annotations

import json

import pytest

from linkpass.agent.config import Nic, Peer
from linkpass.agent.pathcheck_routes import PathCheckRoutes, live_paths
from linkpass.core import paths as P
from linkpass.probe import pathcheck as PC

NICS = (Nic(0, "ens1f0np0", "198.18.0.1"), Nic(1, "ens2f0np0", "198.18.1.1"))
PEERS = {"h3": Peer("h3", 4, "198.19.0.7", {0: "198.18.0.7", 1: "198.18.1.7"}),
         "h5": Peer("h5", 6, "198.19.0.9", {2: "198.18.2.9"})}


def routes(monkeypatch) -> PathCheckRoutes:
    def no_sweep(*_a):
        raise AssertionError("a refused query must not sweep")

    monkeypatch.setattr(PC, "sweep", no_sweep)
    return PathCheckRoutes("h0", lambda: NICS, lambda: PEERS, lambda peer: PC.Live())


@pytest.mark.parametrize("route, query, status, field, says", [
    ("probe", "", 400, "peer", "peer is required"),
    ("probe", "peer=h9", 404, "peer", "unknown peer 'h9': this agent probes h3, h5"),
    ("probe", "peer=h5", 404, "peer", "h5 has no plane in common with this host"),
    ("probe", "peer=h3&plane=2", 400, "plane", "h3 and this host share planes [0, 1]"),
    ("probe", "peer=h3&ports=0", 400, "ports", "ports=0 is outside 1..256"),
    ("probe", "peer=h3&ports=300", 400, "ports", "ports=300 is outside 1..256"),
    ("probe", "peer=h3&base_port=80", 400, "base_port", "base_port=80 is outside 1024..65504"),
    ("probe", "peer=h3&dport=x", 400, "dport", "dport='x' is not a number"),
    ("trace", "peer=h3", 400, "sport", "sport is required"),
    ("trace", "peer=h3&sport=70000", 400, "sport", "sport=70000 is outside 1024..65535"),
])
def test_a_bad_query_is_refused_naming_the_field_and_sends_nothing(route, query, status, field, says, monkeypatch):
    code, body, ctype = getattr(routes(monkeypatch), route)(query)
    doc = json.loads(body)
    assert (code, ctype, doc.get("field")) == (status, "application/json", field), doc
    assert says in doc["error"]


def test_one_check_at_a_time(monkeypatch):
    shot = routes(monkeypatch)
    assert shot._busy.acquire(blocking=False)  # another request's check is running
    try:
        code, body, _ = shot.probe("peer=h3")
    finally:
        shot._busy.release()
    assert code == 429 and "retry in a few seconds" in json.loads(body)["error"]


def test_a_check_that_raises_is_a_500_and_a_journal_line(monkeypatch):
    def broken(*_a):
        raise RuntimeError("boom")

    logged = []
    monkeypatch.setattr(PC, "sweep", broken)
    shot = PathCheckRoutes("h0", lambda: NICS, lambda: PEERS, lambda peer: PC.Live(),
                           log=lambda event, **kw: logged.append((event, kw)))
    code, body, _ = shot.probe("peer=h3")
    assert code == 500 and "RuntimeError: boom" in json.loads(body)["error"]
    assert logged == [("path_check_failed", {"kind": "probe", "query": "peer=h3", "error": "RuntimeError: boom"})]
    assert shot._busy.acquire(blocking=False)  # the next check may run
    shot._busy.release()


def _table(hops_of_port: dict[int, tuple], end: str) -> P.PathTable:
    traces = [P.Trace("ens1f0np0", "198.18.0.1", "198.18.0.7", sport, hops, end, 4 if end == P.END_REACHED else None)
              for sport, hops in hops_of_port.items()]
    return P.build_table(traces, k=8, host="h0")


def test_a_path_the_agents_probes_get_answers_over_counts_as_reached():
    """DST's agent swallows the sweep on 4791 (it ends silent after DST's leaf); the agent's own
    probes over the same hops are answered: reached, by the agent, with the agent's RTT."""
    via_a, via_b = ("198.18.64.2", "198.18.66.1", "198.18.66.6"), ("198.18.64.2", "198.18.67.1", "198.18.67.6")
    table = _table({31000: via_a, 31001: via_b, 31002: via_a}, P.END_LOST)
    rows = [{"path_id": 1, "peer": "h3", "plane": 0, "sport": 49152, "state": "up", "rtt_ns": {"p50": 80_000, "p99": 95_000},
             "window": {"loss_pct": 0.0}},
            {"path_id": 2, "peer": "h3", "plane": 0, "sport": 49153, "state": "down", "rtt_ns": None,
             "window": {"loss_pct": 100.0}},
            {"path_id": 3, "peer": "h2", "plane": 0, "sport": 49154, "state": "up", "rtt_ns": {"p50": 1}, "window": {}}]
    live = live_paths(rows, {1: via_a, 2: via_b, 3: via_a}, "h3")
    legs = [PC.Leg(0, "ens1f0np0", "198.18.0.1", "198.18.0.7")]
    doc = PC.probe_doc("h0", "h3", {"agent": "h0"}, table, legs, (31000, 31001, 31002), 4791, {}, live=live)
    by_hops = {tuple(h["addr"] for h in p["hops"]): p for p in doc["planes"][0]["paths"]}
    a, b = by_hops[via_a], by_hops[via_b]
    assert (a["reached"], a["reached_by"], a["rtt_ms"]) == (True, "agent", 0.08)
    assert a["agent"] == {"ports": [49152], "states": ["up"], "answering": True, "rtt_ms": 0.08, "loss_pct": 0.0}
    assert (b["reached"], b["reached_by"], b["agent"]["states"]) == (False, None, ["down"])
    assert doc["summary"] == {"planes": 1, "planes_reached": 1, "paths": 2, "paths_reached": 1}
    # trace joins by the flow's own source port
    one = _table({49153: via_b}, P.END_LOST)
    tr = PC.trace_doc("h0", "h3", {"agent": "h0"}, one, legs, 49153, 4791, {}, live=live)
    assert tr["planes"][0]["agent"]["ports"] == [49153] and not tr["planes"][0]["reached"]


def test_rendering_says_who_answered(monkeypatch):
    from linkpass.cli import pathcheck as CP

    monkeypatch.setenv("NO_COLOR", "1")
    via = ("198.18.64.2", "198.18.66.1", "198.18.66.6")
    live = live_paths([{"path_id": 1, "peer": "h3", "plane": 0, "sport": 49152, "state": "up", "rtt_ns": {"p50": 80_000, "p99": 95_000},
                        "window": {"loss_pct": 0.0}}], {1: via}, "h3")
    legs = [PC.Leg(0, "ens1f0np0", "198.18.0.1", "198.18.0.7")]
    doc = PC.probe_doc("h0", "h3", {"agent": "h0"}, _table({31000: via}, P.END_LOST), legs, (31000,), 4791, {},
                       live=live)
    text = CP.render_probe(doc)
    assert text.startswith("probe h0 → h3 through h0's agent: udp dport 4791")
    assert "reached*" in text and "up (1 port)" in text and "198.18.64.2 > 198.18.66.1 > 198.18.66.6 > ✗" in text
    assert "h3 answers the agent's own probes over this path" in text
    assert CP.exit_code(doc) == 0
