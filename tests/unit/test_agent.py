"""`linkpass agent` without a testbed: bad config names the field, fleet key files (formats,
permissions, owner), /healthz when the probe thread stops moving, and a main loop that survives any
one step raising (the daemon on every testbed host: tests/root/test_agent_daemon.py)."""
from __future__ import annotations

import os
import stat
import subprocess
import threading
import time

import pytest
import yaml

from linkpass.agent.api import ProbeProgress
from linkpass.agent.config import ConfigError, load_text, read_fleet_key
from linkpass.agent.keyfile import load_fleet_key
from linkpass.testbed.agents import write_agent_configs

from support.agent_config import GOOD, KEY, LINKPASS
from support.fleet import FAB



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


@pytest.mark.parametrize("mode, who", [(0o644, "its group and others"), (0o640, "its group"), (0o604, "others"),
                                       (0o660, "its group"), (0o606, "others"), (0o700 | 0o010, "its group")])
def test_a_fleet_key_file_others_can_read_is_refused_naming_the_file_and_the_fix(tmp_path, mode, who):
    path = key_file(tmp_path, mode)
    with pytest.raises(ConfigError) as err:
        load_fleet_key(path)
    msg = str(err.value)
    assert msg.startswith(f"fleet_key_file: {path} can be read or written by {who} (mode {mode:04o})"), msg
    assert msg.endswith(f"chmod 600 {path}"), msg


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


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_fleet_key_file_of_another_user_is_refused(tmp_path):
    path = key_file(tmp_path, 0o600)
    os.chown(path, 4242, 4242)
    with pytest.raises(ConfigError, match="belongs to uid 4242"):
        load_fleet_key(path)


def test_the_agent_exits_2_on_a_world_readable_key(tmp_path):
    path = key_file(tmp_path, 0o644)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(GOOD.replace("/tmp/k", path))
    out = subprocess.run([*LINKPASS, "agent", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"chmod 600 {path}" in out.stderr, out.stderr[-2000:]


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
    agent.failover = Failover(Detector(DetectorConfig()), lambda pid: None)
    agent.data_path = D.DataPath(log=lambda *a, **k: None)
    agent.loop_priority = D.LoopPriority(0)  # scheduling is tested in test_loop_priority
    agent.errors = D.LoopErrors(lambda ev, **f: logs.append((ev, f)))
    agent.stopping = threading.Event()
    agent.reload_requested, agent.pending_plan, agent.pending_drains = False, None, None
    agent.config_peers = {p.name: p for p in agent.cfg.peers}
    agent.paths_of_peer, agent.drain_addrs = {}, ()
    agent.rates = D.Rates(lambda: agent.cfg, engine, {}, lambda peer: True, agent.errors, agent.stopping, True,
                          lambda *a, **k: None)
    agent.rates.activity = None  # rates off: the loop's other steps are under test
    return agent


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


def test_a_raised_timeout_floor_moves_the_first_timeout_with_it():
    """Slow round trips (emulated RDMA hosts) need a floor above the default first timeout; the
    agent moves the first timeout into [floor, ceiling] rather than refusing the file."""
    doc = yaml.safe_load(GOOD)
    doc["detect"] = {"timeout_floor_us": 100_000, "timeout_ceiling_ms": 400}
    cfg = load_text(yaml.safe_dump(doc), "agent.yaml")
    assert cfg.detect["initial_timeout_ns"] == 100_000_000
    assert cfg.detect["timeout_ceiling_ns"] == 400_000_000


def test_the_sensitive_loss_rate_is_given_in_percent():
    doc = yaml.safe_load(GOOD)
    doc["detect"] = {"gray_sensitive_loss_pct": 2}
    assert load_text(yaml.safe_dump(doc), "agent.yaml").detect["gray_p1_slow"] == pytest.approx(0.02)


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
