"""`linkpass agent` as a daemon on every testbed host: discovers, probes, serves `linkpass paths`;
SIGHUP reloads without dropping probe state; SIGTERM stops cleanly; bad config is refused."""
from __future__ import annotations

from collections import Counter
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml

from linkpass.agent.api import ProbeProgress
from linkpass.agent.config import ConfigError, load_text, read_fleet_key
from linkpass.agent.keyfile import load_fleet_key
from linkpass.core.constants import AGENT_API_PORT, AGENT_METRICS_PORT
from linkpass.testbed.agents import Agents, write_agent_configs

from support.fleet import FAB
from support.ports import free_port
from support.processes import LogDrain
from support.testbed import routes_of

LINKPASS = [sys.executable, "-m", "linkpass.cli"]
KEY = bytes(range(32))

GOOD = """
agent_id: 1
name: h0
fleet_key_file: /tmp/k
service: 198.18.0.1
nics: [{plane: 0, ifname: p0, addr: 198.18.64.1}]
peers: [{name: h1, agent_id: 2, service: 198.18.0.2, nics: {0: 198.18.64.3}}]
"""


@pytest.mark.unit
@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("agent_id"), "agent_id: required field is missing"),
    (lambda d: d.update(agent_id=0), "agent_id: expected an integer 1..4294967295"),
    (lambda d: d.update(service="nowhere"), "service: 'nowhere' is not an IP address"),
    (lambda d: d.update(probe={"interval_ms": 0}), "probe.interval_ms: expected a number 0.1..60000"),
    (lambda d: d.update(probe={"intervall_ms": 1}), "probe.intervall_ms: unknown field"),
    (lambda d: d["peers"][0].update(agent_id=1), "peers[0].agent_id: 1 is used twice"),
    (lambda d: d["nics"].append({"plane": 0, "ifname": "p9", "addr": "198.18.64.9"}), "nics: plane listed twice"),
    (lambda d: d.update(routes={"enabled": "yes"}), "routes.enabled: expected true or false"),
    (lambda d: d.update(routes={"enabled": True}), "nics[0].gateway: required when routes.enabled is true"),
    (lambda d: d.update(detect={"miss_threshold": 0}), "detect.miss_threshold: expected an integer 1..100"),
    (lambda d: d.update(detect={"hold_down": 5}), "detect.hold_down: unknown field"),
    (lambda d: d.update(probe={"rt_priority": 200}), "probe.rt_priority: expected an integer 0..99"),
    (lambda d: d.update(entropy={"enabled": 1}), "entropy.enabled: expected true or false"),
    (lambda d: d.update(probe={"engine": "dpdk"}), "probe.engine: 'dpdk' is not a probe engine; use one of auto, "),
    (lambda d: d.update(probe={"batch_ms": 0}), "probe.batch_ms: expected a number 1..1000"),
    (lambda d: d.update(detect={"timeout_ceiling_ms": 0}), "detect.timeout_ceiling_ms: expected an integer 1..10000"),
    (lambda d: d.update(detect={"gray_sensitive_loss_pct": 0.1}),
     "detect.gray_sensitive_loss_pct: expected a number 0.2..4.0"),
    (lambda d: d.update(detect={"gray_sensitive_loss_pct": "2%"}),
     "detect.gray_sensitive_loss_pct: expected a number 0.2..4.0"),
    (lambda d: d.update(metrics={"address": "mgmt0"}), "metrics.address: 'mgmt0' is not an IP address"),
    (lambda d: d.update(metrics={"port": 70000}), "metrics.port: expected an integer 0..65535"),
    (lambda d: d.update(metrics={"per_path": "yes"}), "metrics.per_path: expected true or false"),
])
def test_config_errors_name_the_field(edit, message):
    doc = yaml.safe_load(GOOD)
    edit(doc)
    with pytest.raises(ConfigError) as err:
        load_text(yaml.safe_dump(doc), "agent.yaml")
    assert str(err.value).startswith(f"agent.yaml: {message}"), str(err.value)


@pytest.mark.unit
def test_fleet_key_file_formats():
    assert read_fleet_key(KEY.hex().encode() + b"\n", "k") == KEY
    assert read_fleet_key(KEY, "k") == KEY
    assert read_fleet_key(bytes(64), "k") == bytes(64)
    for short in (b"abc", bytes(16), bytes(31), bytes(16).hex().encode(), bytes(65)):
        with pytest.raises(ConfigError, match="a fleet key is 32..64 bytes"):
            read_fleet_key(short, "k")


def key_file(tmp_path, mode, data=KEY.hex().encode()):
    path = tmp_path / "fleet.key"
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.unit
@pytest.mark.parametrize("mode, who", [(0o644, "its group and others"), (0o640, "its group"), (0o604, "others"),
                                       (0o660, "its group"), (0o606, "others"), (0o700 | 0o010, "its group")])
def test_a_fleet_key_file_others_can_read_is_refused_naming_the_file_and_the_fix(tmp_path, mode, who):
    path = key_file(tmp_path, mode)
    with pytest.raises(ConfigError) as err:
        load_fleet_key(path)
    msg = str(err.value)
    assert msg.startswith(f"fleet_key_file: {path} can be read or written by {who} (mode {mode:04o})"), msg
    assert msg.endswith(f"chmod 600 {path}"), msg


@pytest.mark.unit
def test_an_owner_only_fleet_key_file_is_read_also_through_a_symlink(tmp_path):
    assert load_fleet_key(key_file(tmp_path, 0o600)) == KEY
    assert load_fleet_key(key_file(tmp_path, 0o400)) == KEY
    link = tmp_path / "key-link"  # how secrets are often mounted: a symlink to the file
    link.symlink_to(tmp_path / "fleet.key")
    assert load_fleet_key(str(link)) == KEY
    with pytest.raises(ConfigError, match="a fleet key is 32..64 bytes"):
        load_fleet_key(key_file(tmp_path, 0o600, bytes(16)))
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_fleet_key(str(tmp_path))


@pytest.mark.unit
def test_a_missing_fleet_key_file_says_how_to_make_one_and_that_way_works(tmp_path):
    import re
    import subprocess

    path = str(tmp_path / "fleet.key")
    with pytest.raises(ConfigError) as err:
        load_fleet_key(path)
    msg = str(err.value)
    assert msg.startswith(f"fleet_key_file: {path} does not exist"), msg
    command = re.search(r"`([^`]+)`", msg).group(1)
    subprocess.run(["sh", "-c", command], check=True)  # what the message tells the reader to type
    assert len(load_fleet_key(path)) == 32


@pytest.mark.unit
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_fleet_key_file_of_another_user_is_refused(tmp_path):
    path = key_file(tmp_path, 0o600)
    os.chown(path, 4242, 4242)
    with pytest.raises(ConfigError, match="belongs to uid 4242"):
        load_fleet_key(path)


@pytest.mark.unit
def test_the_agent_exits_2_on_a_world_readable_key(tmp_path):
    path = key_file(tmp_path, 0o644)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(GOOD.replace("/tmp/k", path))
    out = subprocess.run([*LINKPASS, "agent", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"chmod 600 {path}" in out.stderr, out.stderr[-2000:]


@pytest.mark.unit
def test_the_testbed_writes_key_files_the_agent_accepts_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        (tmp_path / "fleet.key").write_text("left by an earlier run")
        os.chmod(tmp_path / "fleet.key", 0o666)
        configs = write_agent_configs(FAB, str(tmp_path), KEY, hosts=[0, 1])
    finally:
        os.umask(old)
    key_path = yaml.safe_load(open(configs[0]))["fleet_key_file"]
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600 and load_fleet_key(key_path) == KEY


class FlakyEngine:
    """Stands in for the C probe engine: no events, and poll() raises on the calls named."""

    def __init__(self, fail_on=(2,)):
        self.polls, self.fail_on = 0, set(fail_on)

    def wait(self, timeout_s):
        time.sleep(max(0.0, min(timeout_s, 0.002)))

    def poll(self, batch):
        self.polls += 1
        if self.polls in self.fail_on:
            raise OSError(5, "recvmmsg failed")
        return [], self.polls * 1_000_000


def loop_under_test(engine, logs):
    """An Agent's main loop over a stand-in engine: its config, failover and step guard are real."""
    from linkpass.agent import daemon as D
    from linkpass.core.failover import Failover
    from linkpass.core.detector import Detector, DetectorConfig

    agent = D.Agent.__new__(D.Agent)
    agent.cfg = load_text(GOOD, "agent.yaml")
    agent.engine, agent.entropy, agent.link, agent.routes = engine, None, None, None
    agent.failover = Failover(Detector(DetectorConfig()), lambda pid: None, lambda *a, **k: None)
    agent.errors = D.LoopErrors(lambda ev, **f: logs.append((ev, f)))
    agent.stopping = threading.Event()
    agent.reload_requested, agent.pending_plan, agent.pending_drains = False, None, None
    agent.config_peers = {p.name: p for p in agent.cfg.peers}
    agent.paths_of_peer, agent.drain_addrs = {}, ()
    agent.rates = D.Rates(lambda: agent.cfg, engine, {}, lambda peer: True, agent.errors, agent.stopping, True,
                          lambda *a, **k: None)
    agent.rates.activity = None  # rates off: the loop's other steps are under test
    return agent


@pytest.mark.unit
def test_healthz_says_503_when_the_probe_thread_stops_moving():
    class Engine:  # stands in for the probe engine: only its counters and path table are read
        stats = {"sent": 0, "received": 0, "reflected": 0}
        paths = {1: object()}

    now = [100.0]
    progress = ProbeProgress(Engine, stall_s=3.0, clock=lambda: now[0])
    for step in range(5):  # counters moving: healthy
        Engine.stats = {**Engine.stats, "sent": step}
        progress.tick()
        now[0] += 1.0
        assert progress.health() == (200, b"ok\n")
    now[0] += 3.5  # no progress for 4.5 s
    progress.tick()
    status, body = progress.health()
    assert status == 503 and b"probe thread stalled" in body and b"for 4 s while 1 paths" in body
    Engine.paths = {}  # nothing to probe: nothing to expect
    assert progress.health()[0] == 200


@pytest.mark.unit
def test_the_main_loop_survives_any_one_step_raising(monkeypatch):
    from linkpass.agent import daemon as D
    from linkpass.control.answers import Drain, PlanAnswer
    from linkpass.agent.config import Peer

    logs = []
    engine = FlakyEngine(fail_on=(2, 3))  # the same fault twice in a row: logged once, counted twice
    agent = loop_under_test(engine, logs)
    steps = []
    real_step = agent.failover.step

    def step(events, evidence, mono_ns):
        steps.append(evidence)
        if len(steps) == 2:
            raise KeyError("path 7")
        return real_step(events, evidence, mono_ns)

    agent.failover.step = step
    monkeypatch.setattr(D.Agent, "add_peers", lambda self, peers: (_ for _ in ()).throw(RuntimeError("discovery")))
    agent.pending_plan = PlanAnswer(3, (Peer("h5", 6, "198.18.0.6", {0: "198.18.64.11"}),))
    agent.pending_drains = (Drain("p0l0-p0s1", ("198.18.128.0",)),)
    monkeypatch.setattr(agent.failover, "set_drained", lambda *a: (_ for _ in ()).throw(ValueError("drain")))
    agent.run("/nonexistent.yaml", max_seconds=0.3)
    assert engine.polls > 10 and len(steps) > 5  # it went on polling and deciding after each fault
    assert {k: v for k, v in agent.errors.counts.items() if v} == {"plan": 1, "drains": 1, "poll": 2, "decide": 1}
    logged = [(f["step"], f["error"]) for ev, f in logs if ev == "loop_error"]
    assert logged == [("plan", "RuntimeError('discovery')"), ("drains", "ValueError('drain')"),
                      ("poll", "OSError(5, 'recvmmsg failed')"), ("decide", "KeyError('path 7')")]
    assert [p.name for p in agent.cfg.peers] == ["h1"]  # the failed plan left the peers as they were


def paths_json(fab, host, port):
    out = subprocess.run(["ip", "netns", "exec", fab.netns(f"h{host}"), *LINKPASS, "paths", "--port", str(port),
                          "-o", "json"], capture_output=True, text=True, timeout=30)
    return out.returncode, json.loads(out.stdout) if out.stdout.startswith("[") else out.stdout


def path_rows(fab, host, port) -> list[dict]:
    """The agent's path rows, or none while it cannot answer."""
    rows = paths_json(fab, host, port)[1]
    return rows if isinstance(rows, list) else []


@pytest.mark.root
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


@pytest.mark.root
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


@pytest.mark.root
def test_agent_refuses_a_bad_config_with_exit_2(tmp_path):
    bad = tmp_path / "agent.yaml"
    bad.write_text(GOOD.replace("agent_id: 1", "agent_id: -3"))
    out = subprocess.run([*LINKPASS, "agent", "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "agent_id: expected an integer" in out.stderr



@pytest.mark.unit
def test_a_raised_timeout_floor_moves_the_first_timeout_with_it():
    """Slow round trips (emulated RDMA hosts) need a floor above the default first timeout; the
    agent moves the first timeout into [floor, ceiling] rather than refusing the file."""
    doc = yaml.safe_load(GOOD)
    doc["detect"] = {"timeout_floor_us": 100_000, "timeout_ceiling_ms": 400}
    cfg = load_text(yaml.safe_dump(doc), "agent.yaml")
    assert cfg.detect["initial_timeout_ns"] == 100_000_000
    assert cfg.detect["timeout_ceiling_ns"] == 400_000_000


@pytest.mark.unit
def test_the_sensitive_loss_rate_is_given_in_percent():
    doc = yaml.safe_load(GOOD)
    doc["detect"] = {"gray_sensitive_loss_pct": 2}
    assert load_text(yaml.safe_dump(doc), "agent.yaml").detect["gray_p1_slow"] == pytest.approx(0.02)


@pytest.mark.unit
def test_a_slow_interval_carries_the_slower_rates_left_out_with_it():
    """A host probed every 200 ms (emulated, or a cost cap) names only interval_ms: the idle,
    standby and progress rates it left out follow it up instead of refusing the file; rates it
    does give are still checked against it."""
    doc = yaml.safe_load(GOOD)
    doc["probe"] = {"interval_ms": 200}
    cfg = load_text(yaml.safe_dump(doc), "agent.yaml")
    assert (cfg.idle_interval_ms, cfg.standby_interval_ms, cfg.progress_interval_ms) == (200, 200, 200)
    doc["probe"] = {"interval_ms": 10, "idle_interval_ms": 40}  # standby's default 50 comes down to idle
    cfg = load_text(yaml.safe_dump(doc), "agent.yaml")
    assert (cfg.idle_interval_ms, cfg.standby_interval_ms, cfg.progress_interval_ms) == (40, 40, 50)
    doc["probe"] = {"interval_ms": 200, "standby_interval_ms": 50}
    with pytest.raises(ConfigError, match="probe.standby_interval_ms: 50 is below probe.interval_ms"):
        load_text(yaml.safe_dump(doc), "agent.yaml")


@pytest.mark.unit
def test_the_probe_engine_is_sockets_where_no_nic_has_an_rdma_device(monkeypatch):
    from linkpass.agent import daemon
    from linkpass.kernel import rdma

    cfg = load_text(GOOD, "agent.yaml")
    assert cfg.engine == "auto"
    def no_device(addr, sysfs=rdma.SYSFS):
        raise rdma.RdmaUnavailable(f"no RDMA device has a RoCE v2 GID for {addr}")

    monkeypatch.setattr(daemon.Device, "for_address", no_device)
    assert daemon.probe_engine_kind(cfg) == "sockets"
    doc = yaml.safe_load(GOOD)
    doc["probe"] = {"engine": "verbs"}
    assert daemon.probe_engine_kind(load_text(yaml.safe_dump(doc), "agent.yaml")) == "verbs"


@pytest.mark.root
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
