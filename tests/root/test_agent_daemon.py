"""`linkpass agent` as a daemon on every testbed host: discovers, probes, serves `linkpass paths`;
SIGHUP reloads without dropping probe state; SIGTERM stops cleanly; bad config is refused."""
from __future__ import annotations

from collections import Counter
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

from linkpass.core.constants import AGENT_API_PORT, AGENT_METRICS_PORT
from linkpass.testbed.agents import Agents, write_agent_configs

from support.ports import free_port
from support.processes import LogDrain
from support.agent_config import GOOD, KEY, LINKPASS
from support.testbed import routes_of



def paths_json(fab, host, port):
    out = subprocess.run(["ip", "netns", "exec", fab.netns(f"h{host}"), *LINKPASS, "paths", "--port", str(port),
                          "-o", "json"], capture_output=True, text=True, timeout=30)
    return out.returncode, json.loads(out.stdout) if out.stdout.startswith("[") else out.stdout


def path_rows(fab, host, port) -> list[dict]:
    """The agent's path rows, or none while it cannot answer."""
    rows = paths_json(fab, host, port)[1]
    return rows if isinstance(rows, list) else []


def test_agents_probe_the_fabric_reload_and_stop(clean_faults, tmp_path):
    fab = clean_faults
    port = 9481
    configs = write_agent_configs(fab, str(tmp_path), KEY, api_port=port, interval_ms=2)
    procs = {i: subprocess.Popen(["ip", "netns", "exec", fab.netns(f"h{i}"), *LINKPASS, "agent", "--config", path,
                                  "--max-seconds", "90"], stderr=subprocess.PIPE, text=True)
             for i, path in configs.items()}
    drains = {i: LogDrain(p.stderr) for i, p in procs.items()}
    try:
        for i, d in drains.items():  # each logs a JSON line when it is up
            assert d.wait_for('"event": "started"', 60), d.text(0)[-2000:]
        time.sleep(1.5)
        # a path whose peer started late is judged DOWN (never answered) and needs its hold-down
        # to be up again; on a loaded machine the four agents may start seconds apart
        deadline = time.monotonic() + 30
        while (code := paths_json(fab, 0, port))[0] != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        code, rows = code
        assert code == 0, rows
        by_peer = {}
        for r in rows:
            by_peer.setdefault(r["peer"], []).append(r)
        # h1 shares h0's leaves: one path per plane; h2 and h3 sit behind 2 spines per plane
        assert {k: len(v) for k, v in by_peer.items()} == {"h1": 2, "h2": 4, "h3": 4}
        assert all(r["replies"] > 300 and r["lost_fwd"] == 0 and r["lost_rev"] == 0 for r in rows)
        sent_before = {(r["peer"], r["plane"], r["path"]): r["sent"] for r in rows}
        # what Prometheus reads: /metrics and /healthz on the management address, from outside the host
        scrape = f"http://{fab.mgmt_addr(0)}:{AGENT_METRICS_PORT}"
        body = urllib.request.urlopen(f"{scrape}/metrics", timeout=5).read().decode()
        assert 'linkpass_build_info{engine="sockets"' in body and "process_cpu_seconds_total" in body, body[:2000]
        # h3's two paths on plane 1, counted by state: a path may read down for a few ms on this loaded
        # machine (see the end of this test), so the states are summed rather than all taken as up
        h3_plane1 = {ln.split('state="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
                     if ln.startswith('linkpass_peer_paths{peer="h3",plane="1",')}
        assert sum(h3_plane1.values()) == 2 and "up" in h3_plane1, h3_plane1
        assert urllib.request.urlopen(f"{scrape}/healthz", timeout=5).read() == b"ok\n"
        with pytest.raises(urllib.error.HTTPError, match="404"):  # the /v1 routes stay on 127.0.0.1
            urllib.request.urlopen(f"{scrape}/v1/paths", timeout=5)
        ids_of_h3 = sorted(r["path_id"] for r in by_peer["h3"])
        original = open(configs[0]).read()

        # reload without h3: its paths go, the others keep counting from where they were
        doc = yaml.safe_load(open(configs[0]))
        doc["peers"] = [p for p in doc["peers"] if p["name"] != "h3"]
        with open(configs[0], "w") as f:
            yaml.safe_dump(doc, f)
        procs[0].send_signal(signal.SIGHUP)
        # the reload runs in the agent's main loop: on a loaded machine it may take a moment
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            rows = path_rows(fab, 0, port)
            if {r["peer"] for r in rows} == {"h1", "h2"}:
                break
            time.sleep(0.25)
        assert {r["peer"] for r in rows} == {"h1", "h2"}, Counter(json.loads(ln)["event"] for ln in drains[0].lines
                                                                  if ln.startswith("{"))
        assert all(r["sent"] > sent_before[(r["peer"], r["plane"], r["path"])] for r in rows)

        # h3 back: its new paths take the freed ids (h3's reflector keeps an entry per path id),
        # and h3 answers them at once although it saw those ids before
        with open(configs[0], "w") as f:
            f.write(original)
        procs[0].send_signal(signal.SIGHUP)
        # discovery of h3's paths (a traceroute per plane) runs before they are probed
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            again = [r for r in path_rows(fab, 0, port) if r["peer"] == "h3"]
            if len(again) == len(ids_of_h3) and all(r["replies"] > 100 for r in again):
                break
            time.sleep(0.25)
        assert sorted(r["path_id"] for r in again) == ids_of_h3
        assert all(r["replies"] > 100 and r["lost_fwd"] == 0 and r["lost_rev"] == 0 for r in again), again

        # a broken config on reload is refused and the agent runs on
        with open(configs[0], "w") as f:
            f.write("agent_id: zero\n")
        procs[0].send_signal(signal.SIGHUP)
        time.sleep(0.5)
        # all paths up: the agent runs on. A path may read down for a few ms when this loaded
        # machine keeps a reflector waiting (undone as late, not lost), so a few looks are allowed
        for _ in range(5):
            code, rows = paths_json(fab, 0, port)
            if code == 0:
                break
            time.sleep(0.5)
        assert procs[0].poll() is None and code == 0, [(r["peer"], r["plane"], r["path"], r.get("state"))
                                                       for r in rows]
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(timeout=10)
        logs = {i: d.text() for i, d in drains.items()}
    for i, p in procs.items():
        assert p.returncode == 0, logs[i][-2000:]
    records = [json.loads(line) for line in logs[0].splitlines() if line.startswith("{")]
    events = [r["event"] for r in records]
    assert "reloaded" in events and "reload_rejected" in events and events[-1] == "stopped", \
        [e for e in events if e != "path_state"]
    assert {r["component"] for r in records} == {"agent"}
    assert [r["level"] for r in records if r["event"] == "reload_rejected"] == ["warning"]
    assert not any(KEY.hex() in text for text in logs.values())  # the fleet key never reaches a log line


class BadCoordinator:
    """An HTTP endpoint that answers each agent's register and reports with `bad` in turn, then
    with `good` for ever (its drains: none, its plan: no peers)."""

    def __init__(self, bad_for):
        import http.server

        self.bad_for, self.served = bad_for, {}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                k = outer.served[body["name"]] = outer.served.get(body["name"], -1) + 1
                bad = outer.bad_for(body["name"])
                answer = bad[k] if k < len(bad) else {"drain_version": 1, "plan_version": 1, "drains": [],
                                                      "plan": {"version": 1, "peers": []}}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("0.0.0.0", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def metrics_of(fab, host, port=AGENT_API_PORT) -> str:
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    return subprocess.run(["ip", "netns", "exec", fab.netns(f"h{host}"), sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=30, check=True).stdout


def test_agents_refuse_bad_coordinator_answers_and_run_on(clean_faults, tmp_path):
    fab = clean_faults
    A, B = 0, 2
    peer_of = {f"h{A}": B, f"h{B}": A}

    def bad_for(name):
        j = peer_of[name]
        peer = {"name": f"h{j}", "agent_id": j + 1, "service": fab.service_addr(j),
                "nics": {"0": fab.nic_addr(j, 0), "1": fab.nic_addr(j, 1)}}
        return [{"drain_version": 1, "drains": ["x"]},
                {"drain_version": 1, "drains": [{"link": "p0l0-p0s0", "addrs": None}]},
                ["x"],
                {"plan_version": 1, "plan": {"version": 1, "peers": [{**peer, "nics": {"0": "198.18.9.9"}}]}},
                {"plan_version": 1, "plan": {"version": 1, "peers": [{**peer, "name": "h9", "agent_id": 99,
                                                                      "service": "h9.example.com"}]}}]

    coord = BadCoordinator(bad_for)
    token = tmp_path / "agent.token"
    token.write_text("t0ken\n")
    link = {"url": f"http://{fab.mgmt_root_addr}:{coord.server.server_address[1]}", "token_file": str(token),
            "report_ms": 50, "insecure_http": True}  # a stand-in coordinator: the test is about answers
    ag = Agents(fab, str(tmp_path), [A, B], coordinator=link)
    try:
        ag.start()
        for h in (A, B):  # the good answer after the bad ones is applied
            assert ag.wait_for(h, "drains_applied", timeout_s=15) is not None, ag.events(h)[-10:]
        assert all(p.poll() is None for p in ag.procs.values())  # both still running
        rejected = [e["error"] for e in ag.events(A, "coordinator_answer_rejected")]
        assert [r.split(":")[0] for r in rejected] == ["drains[0]", "drains[0].addrs", "answer", "plan.peers[0]",
                                                       "plan.peers[0].service"], rejected
        assert "differs from the config file's peer 'h2'" in rejected[3] and "host names" in rejected[4]
        metrics = metrics_of(fab, A)
        assert "linkpass_agent_coordinator_answers_rejected_total 5.0" in metrics
        # its HTTP servers count their connections: this scrape's own among them
        assert re.search(r'linkpass_agent_http_connections_total\{outcome="accepted",server="(local-api|metrics)"\} [1-9]', metrics)
        # the data path never moved: both planes to the peer, its paths probed at the config's addresses
        assert routes_of(fab, A).get(fab.service_addr(B)) == (0, 1)
        assert not ag.events(A, "plan_applied") and not ag.events(A, "loop_error")
    finally:
        codes = ag.stop()
        ag.remove_routes()
        coord.close()
    assert codes == {A: 0, B: 0}, codes


def test_agent_refuses_a_bad_config_with_exit_2(tmp_path):
    bad = tmp_path / "agent.yaml"
    bad.write_text(GOOD.replace("agent_id: 1", "agent_id: -3"))
    out = subprocess.run([*LINKPASS, "agent", "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "agent_id: expected an integer" in out.stderr


def test_an_agent_told_to_probe_through_verbs_without_rdma_exits_2_saying_so(tmp_path):
    if os.path.exists("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices")
    key = tmp_path / "fleet.key"
    key.write_text(KEY.hex())
    os.chmod(key, 0o600)
    doc = yaml.safe_load(GOOD)
    doc.update(fleet_key_file=str(key), probe={"engine": "verbs"}, api={"port": free_port()})
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    out = subprocess.run([*LINKPASS, "agent", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    # no pyverbs here, or no RDMA device: either is named, with the way out
    assert "linkpass agent: probe engine: " in out.stderr and "probe.engine: sockets" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
