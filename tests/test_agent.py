"""`linkpass agent` as a daemon on every testbed host: discovers, probes, serves `linkpass paths`;
SIGHUP reloads without dropping probe state; SIGTERM stops cleanly; bad config is refused."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml

from linkpass.agent.config import ConfigError, load_text, read_fleet_key
from linkpass.testbed.agents import write_agent_configs

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
    with pytest.raises(ConfigError, match="16..64 bytes"):
        read_fleet_key(b"abc", "k")


def paths_json(fab, host, port):
    out = subprocess.run(["ip", "netns", "exec", fab.netns(f"h{host}"), *LINKPASS, "paths", "--port", str(port),
                          "-o", "json"], capture_output=True, text=True, timeout=30)
    return out.returncode, json.loads(out.stdout) if out.stdout.startswith("[") else out.stdout


@pytest.mark.root
def test_agents_probe_the_fabric_reload_and_stop(clean_faults, tmp_path):
    fab = clean_faults
    port = 9481
    configs = write_agent_configs(fab, str(tmp_path), KEY, api_port=port, interval_ms=2)
    procs = {i: subprocess.Popen(["ip", "netns", "exec", fab.netns(f"h{i}"), *LINKPASS, "agent", "--config", path,
                                  "--max-seconds", "90"], stderr=subprocess.PIPE, text=True)
             for i, path in configs.items()}
    try:
        for i, p in procs.items():  # each logs a JSON line when it is up
            for line in p.stderr:
                if json.loads(line)["event"] == "started":
                    break
        time.sleep(1.5)
        # a path that went down while its peer was still starting needs its hold-down to be up again
        deadline = time.monotonic() + 10
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
        ids_of_h3 = sorted(r["path_id"] for r in by_peer["h3"])
        original = open(configs[0]).read()

        # reload without h3: its paths go, the others keep counting from where they were
        doc = yaml.safe_load(open(configs[0]))
        doc["peers"] = [p for p in doc["peers"] if p["name"] != "h3"]
        with open(configs[0], "w") as f:
            yaml.safe_dump(doc, f)
        procs[0].send_signal(signal.SIGHUP)
        time.sleep(1.0)
        code, rows = paths_json(fab, 0, port)
        assert {r["peer"] for r in rows} == {"h1", "h2"}
        assert all(r["sent"] > sent_before[(r["peer"], r["plane"], r["path"])] for r in rows)

        # h3 back: its new paths take the freed ids (h3's reflector keeps an entry per path id),
        # and h3 answers them at once although it saw those ids before
        with open(configs[0], "w") as f:
            f.write(original)
        procs[0].send_signal(signal.SIGHUP)
        time.sleep(2.5)
        code, rows = paths_json(fab, 0, port)
        again = [r for r in rows if r["peer"] == "h3"]
        assert sorted(r["path_id"] for r in again) == ids_of_h3
        assert all(r["replies"] > 100 and r["lost_fwd"] == 0 and r["lost_rev"] == 0 for r in again), again

        # a broken config on reload is refused and the agent runs on
        with open(configs[0], "w") as f:
            f.write("agent_id: zero\n")
        procs[0].send_signal(signal.SIGHUP)
        time.sleep(0.5)
        code, rows = paths_json(fab, 0, port)
        assert code == 0, [(r["peer"], r["plane"], r["path"], r["window"]) for r in rows]
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        logs = {i: p.communicate(timeout=10)[1] for i, p in procs.items()}
    for i, p in procs.items():
        assert p.returncode == 0, logs[i][-2000:]
    events = [json.loads(line)["event"] for line in logs[0].splitlines() if line.startswith("{")]
    assert "reloaded" in events and "reload_rejected" in events and events[-1] == "stopped", \
        [e for e in events if e != "path_state"]


@pytest.mark.root
def test_agent_refuses_a_bad_config_with_exit_2(tmp_path):
    bad = tmp_path / "agent.yaml"
    bad.write_text(GOOD.replace("agent_id: 1", "agent_id: -3"))
    out = subprocess.run([*LINKPASS, "agent", "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "agent_id: expected an integer" in out.stderr

