"""`linkpass probe DST` / `trace DST` through the local agent's API, the real thing on the testbed
(the query's checks and the join with the agent's own probes: tests/unit/test_agent_pathcheck_routes.py)."""
from __future__ import annotations

import json
import subprocess

from linkpass.core.names import host_name
from linkpass.testbed.agents import LINKPASS, Agents

A, B = 0, 3


def cli_in(fab, host: int, *argv: str) -> tuple[int, dict | str]:
    got = subprocess.run(["ip", "netns", "exec", fab.netns(host_name(host)), *LINKPASS, *argv],
                         capture_output=True, text=True, timeout=60)
    try:
        return got.returncode, json.loads(got.stdout)
    except json.JSONDecodeError:
        return got.returncode, got.stderr


def test_probe_and_trace_through_the_agent(clean_faults, tmp_path):
    from linkpass.testbed import faults

    fab = clean_faults
    with Agents(fab, str(tmp_path), [A, B], interval_ms=10.0) as ag:
        assert ag.wait_healthy(timeout_s=30), ag.not_up()
        code, doc = cli_in(fab, A, "probe", "h3", "-o", "json")
        assert code == 0, (doc, open(ag.log_path(A)).read()[-3000:])
        assert doc["agent"] == "h0" and doc["summary"] == {"planes": 2, "planes_reached": 2, "paths": 4,
                                                           "paths_reached": 4}
        for pl in doc["planes"]:
            assert pl["src_addr"] == fab.nic_addr(A, pl["plane"]) and pl["dst_addr"] == fab.nic_addr(B, pl["plane"])
            for path in pl["paths"]:
                # h3's agent swallows the sweep on 4791: what answers is the agents' own probes
                assert path["reached_by"] == "agent" and "up" in path["agent"]["states"], path
                assert path["rtt_ms"] is not None and len(path["hops"]) == 3
        # the route of a flow the agent probes, with the agent's state of exactly that flow
        code, rows = cli_in(fab, A, "paths", "--local", "-o", "json")
        sport = next(r["sport"] for r in rows if r["peer"] == "h3" and r["plane"] == 1)
        code, tr = cli_in(fab, A, "trace", "h3", "--sport", str(sport), "--plane", "1", "-o", "json")
        assert code == 0, tr
        assert [r["plane"] for r in tr["planes"]] == [1] and tr["planes"][0]["agent"]["ports"] == [sport]
        # a peer the agent does not probe is refused, naming those it does
        code, err = cli_in(fab, A, "probe", "h1")
        assert code == 3 and "unknown peer 'h1': this agent probes h3" in err, err
        # a cut spine link: its path ends at the leaf, not reached, and the command says so (exit 1)
        faults.apply(fab.prefix, faults.FaultSpec("down", "p0l0-p0s1"))  # cleared by the fixture
        code, doc = cli_in(fab, A, "probe", "h3", "-o", "json")
        assert code == 1, doc
        p0 = doc["planes"][0]
        dead = [x for x in p0["paths"] if not x["reached"]]
        assert len(dead) == 1 and dead[0]["end"] == "lost" and len(dead[0]["hops"]) >= 1, p0
        assert all(x["reached"] for x in doc["planes"][1]["paths"])
