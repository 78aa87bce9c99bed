"""The Debian package under a booted systemd: host 0 of the default testbed is a QEMU guest whose
PID 1 is systemd (the `systemd` guest image: Debian 12's systemd 252, journald, D-Bus), host 2 a
namespace running an agent as its peer. In the guest the package is installed with apt, configured
as docs/install.md says and started with `systemctl enable --now linkpass-agent`; then, against
systemd's own view of the unit (its debug log names every notification it receives):

  * the unit turns active only after the agent's READY=1, and `systemctl reload` goes through
    RELOADING=1 to READY=1;
  * the process runs as `linkpass` with exactly CAP_NET_RAW and CAP_NET_ADMIN, no new privileges,
    a seccomp filter, and its probe thread gets SCHED_FIFO through LimitRTPRIO=;
  * `systemd-analyze security` of the running unit scores what the offline analysis scores;
  * the journal holds the agent's JSON lines with each line's syslog priority;
  * a probe thread stopped (ptrace-stopped, the rest of the process running) makes the agent
    withhold its pings: systemd kills it by the watchdog (SIGABRT: every thread's stack in the
    journal) and starts it again;
  * `apt remove` stops the unit and takes the code, `apt purge` keeps /etc/linkpass.

Times are under TCG emulation: the guest boots in about 25 s, the agent is ready in about 10."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import time

import pytest

from linkpass.formats import yaml_doc as yaml
from linkpass.testbed import build, guests, topology
from linkpass.testbed.agents import LINKPASS, write_agent_configs

from support.processes import stop_processes
from support.testbed import prefix_for

GUEST, PEER = 0, 2  # on different leaves: probes cross the spines
KEY = bytes(range(32))
UNIT = "linkpass-agent"
# what docs/systemd.md measured offline for the agent's unit, and tests/unit/test_systemd.py bounds
OFFLINE_EXPOSURE_MAX = 3.0
# a slow guest: probes every 100 ms, round trips of up to 1.5 s are no failure (tests/root/test_rdma_guests.py)
GUEST_DETECT = {"timeout_floor_us": 100_000, "timeout_ceiling_ms": 1500, "latency_floor_us": 50_000,
                "recovery_good_probes": 50}
# Stops one thread of a process and keeps it stopped (ptrace: the other threads run on), reaping
# it when the process dies: the thread's zombie would otherwise keep the whole process around.
STALL = """
import ctypes, os, sys
SEIZE, INTERRUPT, WALL = 0x4206, 0x4207, 0x40000000
libc = ctypes.CDLL(None, use_errno=True)
pid, name = int(sys.argv[1]), sys.argv[2]
tid = next(int(t) for t in os.listdir(f"/proc/{pid}/task")
           if open(f"/proc/{pid}/task/{t}/comm").read().strip() == name)
for req in (SEIZE, INTERRUPT):
    if libc.ptrace(req, tid, None, None) != 0:
        sys.exit(f"ptrace {req:#x} {tid}: {os.strerror(ctypes.get_errno())}")
print("stopped", tid, flush=True)
while True:
    _, status = os.waitpid(tid, WALL)
    if os.WIFEXITED(status) or os.WIFSIGNALED(status):
        break
print("gone", flush=True)
"""


@pytest.fixture(scope="module")
def sfab():
    prefix = prefix_for("s")
    build.clean(prefix)
    spec = dataclasses.replace(topology.preset("default"), rdma_hosts=(GUEST,), guest_image="systemd")
    fab = build.up(spec, prefix, progress=print)
    try:
        yield fab
    finally:
        build.down(prefix)
        left = subprocess.run(["pgrep", "-f", f"-name {prefix}-h"], capture_output=True, text=True).stdout.split()
        assert not left, left


@pytest.fixture(scope="module")
def guest(sfab):
    with guests.Control(sfab.prefix, GUEST) as ctl:
        yield ctl


def sh(ctl: guests.Control, script: str, timeout_s: float = 120.0) -> str:
    """A shell script in the guest, which must exit 0; its stdout."""
    return ctl.check(["sh", "-c", script], timeout_s=timeout_s)


def show(ctl: guests.Control, *props: str) -> dict[str, str]:
    out = sh(ctl, f"systemctl show -p {','.join(props)} {UNIT}")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_show(ctl: guests.Control, want: dict[str, str], timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = show(ctl, *want, "MainPID", "NRestarts")
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return got
        time.sleep(1)


def journal(ctl: guests.Control, since_cursor: str | None = None, **match: str) -> list[dict]:
    """The unit's journal entries (JSON), optionally after a cursor and matching fields."""
    args = " ".join(f"{k}={v}" for k, v in match.items())
    after = f"--after-cursor='{since_cursor}'" if since_cursor else ""
    out = sh(ctl, f"journalctl -u {UNIT} -o json --no-pager {after} {args}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def cursor(ctl: guests.Control) -> str:
    return json.loads(sh(ctl, "journalctl -n 1 -o json --no-pager").splitlines()[-1])["__CURSOR"]


def manager_lines(entries: list[dict]) -> list[str]:
    """What systemd itself said about the unit, in order."""
    return [e["MESSAGE"] for e in entries if e.get("_PID") == "1" and isinstance(e.get("MESSAGE"), str)]


def agent_events(entries: list[dict]) -> list[tuple[dict, int]]:
    """The agent's JSON log lines from the journal, each with the priority journald gave it."""
    out = []
    for e in entries:
        msg = e.get("MESSAGE")
        if e.get("_TRANSPORT") == "stdout" and isinstance(msg, str) and msg.startswith("{"):
            out.append((json.loads(msg), int(e["PRIORITY"])))
    return out


@pytest.fixture(scope="module")
def peer(sfab, tmp_path_factory):
    """The guest's config (as the docs would have an operator write it) and an agent on the peer."""
    d = tmp_path_factory.mktemp("systemd-guest")
    configs = write_agent_configs(sfab, str(d), KEY, interval_ms=100, routes=True, entropy=True,
                                  detect=GUEST_DETECT, hosts=[GUEST, PEER], probe={"batch_ms": 50})
    doc = yaml.safe_load(open(configs[GUEST]).read())
    # the packaged defaults, as on a host: the key in /etc/linkpass, journal, table and lanes in /run/linkpass
    doc["fleet_key_file"] = "/etc/linkpass/fleet.key"
    for section, key in (("probe", "lanes_dir"), ("routes", "journal"), ("entropy", "path")):
        doc[section].pop(key)
    lp = f"{guests.guest_dir(sfab.prefix, GUEST)}/lp"
    with open(f"{lp}/agent.yaml", "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    with open(f"{lp}/fleet.key", "w") as f:
        f.write(KEY.hex() + "\n")
    with open(f"{lp}/stall.py", "w") as f:
        f.write(STALL)
    log = open(d / "peer.log", "w")
    proc = subprocess.Popen(["ip", "netns", "exec", sfab.netns(f"h{PEER}"), *LINKPASS, "agent", "--config",
                             configs[PEER]], stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
    try:
        yield doc
    finally:
        stop_processes([proc])
        log.close()


@pytest.fixture(scope="module")
def installed(sfab, guest, dist, peer):
    """The package installed with apt in the guest, key and config in place, the unit enabled and
    started; systemd logging at debug level, so the journal has every notification it receives.
    (apt's output, the cursor before the start, the time `enable --now` took)"""
    lp = f"{guests.guest_dir(sfab.prefix, GUEST)}/lp"
    shutil.copy(dist["deb"], lp)
    apt = sh(guest, f"DEBIAN_FRONTEND=noninteractive apt-get install -y /lp/{dist['deb'].name} 2>&1", 300)
    sh(guest, "install -o linkpass -g linkpass -m 0600 /lp/fleet.key /etc/linkpass/fleet.key && "
              "install -o root -g linkpass -m 0640 /lp/agent.yaml /etc/linkpass/agent.yaml && "
              "systemd-analyze log-level debug")
    before = cursor(guest)
    t0 = time.monotonic()
    sh(guest, f"systemctl enable --now {UNIT}", 180)
    return apt, before, time.monotonic() - t0


def test_apt_installs_the_package_its_users_units_and_sysctls(guest, installed):
    apt, _, _ = installed
    assert "Setting up linkpass" in apt and "linkpass: installed. Next:" in apt, apt
    assert "could not apply" not in apt, apt  # systemd-sysctl applied the package's file
    assert sh(guest, "cat /proc/sys/net/ipv4/fib_multipath_hash_policy").strip() == "1"
    users = sh(guest, "getent passwd linkpass linkpass-coordinator")
    assert users.count("/usr/sbin/nologin") == 2, users
    assert sh(guest, f"systemctl is-enabled {UNIT}").strip() == "enabled"


def test_the_unit_turns_active_only_after_the_agents_ready(guest, installed):
    _, before, took = installed
    props = show(guest, "ActiveState", "SubState", "MainPID", "StatusText", "ExecMainStartTimestampMonotonic",
                 "ActiveEnterTimestampMonotonic")
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    assert re.fullmatch(r"probing \d+ paths to 1 peer, \d+ down.*", props["StatusText"]), props
    entries = journal(guest, before)
    said = [str(e.get("MESSAGE")) if e.get("_PID") == "1" else "" for e in entries]
    pid = props["MainPID"]
    ready = next(i for i, m in enumerate(said) if f"notification message from PID {pid}" in m and "READY=1" in m)
    running = next(i for i, m in enumerate(said) if "Changed start -> running" in m)
    assert ready < running, said[ready - 2:running + 2]
    # the agent's own `started` line (its peers discovered, its API listening) comes before READY=1
    started = next(i for i, e in enumerate(entries) if e.get("_TRANSPORT") == "stdout"
                   and '"event": "started"' in str(e.get("MESSAGE")))
    assert started < ready
    start, active = int(props["ExecMainStartTimestampMonotonic"]), int(props["ActiveEnterTimestampMonotonic"])
    assert active > start, props
    print(f"enable --now returned after {took:.1f} s; active {(active - start) / 1e6:.1f} s after exec")


def test_the_agent_runs_as_its_unit_says(guest, installed, peer):
    pid = show(guest, "MainPID")["MainPID"]
    status = dict(line.split(":", 1) for line in sh(guest, f"cat /proc/{pid}/status").splitlines() if ":" in line)
    uid = sh(guest, "id -u linkpass").strip()
    assert status["Uid"].split() == [uid] * 4
    two = 1 << 12 | 1 << 13  # CAP_NET_ADMIN, CAP_NET_RAW
    for field in ("CapPrm", "CapEff", "CapAmb", "CapBnd"):
        assert int(status[field], 16) == two, (field, status[field])
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    # per thread: name, scheduling policy (1: SCHED_FIFO) and real-time priority (stat fields 41, 40)
    threads = sh(guest, f'for t in /proc/{pid}/task/*; do echo "$(cat $t/comm) $(cut -d" " -f40,41 $t/stat)"; done')
    rows = [line.split() for line in threads.splitlines()]
    probe = [r for r in rows if r[0] == "lp-probe"]
    assert probe and probe[0][2] == "1" and probe[0][1] == str(10), rows  # probe.rt_priority's default
    limits = sh(guest, f"grep 'Max realtime priority' /proc/{pid}/limits").split()
    assert limits[3:5] == ["20", "20"], limits  # LimitRTPRIO=20


def test_security_of_the_running_unit_is_what_the_offline_analysis_says(guest, installed):
    def exposure(out: str) -> float:
        return float(re.search(r"Overall exposure level for \S+: ([\d.]+)", out).group(1))

    online = exposure(sh(guest, f"systemd-analyze security --no-pager {UNIT}"))
    offline = exposure(sh(guest, f"systemd-analyze security --no-pager --offline=true /lib/systemd/system/{UNIT}.service"))
    assert online <= offline <= OFFLINE_EXPOSURE_MAX, (online, offline)
    print(f"systemd-analyze security: {online} online, {offline} offline")


def test_reload_goes_through_reloading_to_ready(guest, installed):
    before = cursor(guest)
    pid = show(guest, "MainPID")["MainPID"]
    sh(guest, f"systemctl reload {UNIT}")
    deadline = time.monotonic() + 60
    while True:
        entries = journal(guest, before)
        notes = [m for m in manager_lines(entries) if f"notification message from PID {pid}" in m]
        reloading = [i for i, m in enumerate(notes) if "RELOADING=1" in m]
        if reloading and any("READY=1" in m for m in notes[reloading[0]:]) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert reloading and any("READY=1" in m for m in notes[reloading[0]:]), notes
    assert any(e["event"] == "reloaded" for e, _ in agent_events(entries)), agent_events(entries)
    assert show(guest, "MainPID", "SubState") == {"MainPID": pid, "SubState": "running"}


def test_the_journal_holds_the_agents_json_lines_with_their_priorities(guest, installed):
    events = agent_events(journal(guest, installed[1]))
    assert len(events) >= 3, events
    level = {"info": 6, "warning": 4, "error": 3, "debug": 7}
    wrong = [(e["event"], e["level"], prio) for e, prio in events if level[e["level"]] != prio]
    assert not wrong, wrong


def test_a_stalled_probe_thread_gets_the_agent_restarted_by_the_watchdog(guest, installed):
    before = cursor(guest)
    first = show(guest, "MainPID", "NRestarts")
    guest.spawn("stall", ["python3", "/lp/stall.py", first["MainPID"], "lp-probe"])
    # WatchdogSec=15: the pings stop within 3 s of the stall, systemd acts 15 s after the last one
    after = wait_show(guest, {"NRestarts": str(int(first["NRestarts"]) + 1), "SubState": "running"}, 120)
    assert "stopped" in guest.log("stall"), guest.log("stall")
    assert after["SubState"] == "running" and after["MainPID"] != first["MainPID"], (first, after)
    entries = journal(guest, before)
    said = manager_lines(entries)
    assert any("Watchdog timeout" in m for m in said), said[-20:]
    assert any("code=killed, status=6/ABRT" in m for m in said), said[-20:]
    withheld = [(e, prio) for e, prio in agent_events(entries) if e["event"] == "watchdog_withheld"]
    assert withheld and withheld[0][1] == 3 and "probe thread" in withheld[0][0]["reason"], withheld
    # faulthandler's dump of every thread, from the process the watchdog killed
    stacks = [e["MESSAGE"] for e in entries if e.get("_PID") == first["MainPID"] and "most recent call first" in
              str(e.get("MESSAGE"))]
    assert any(m.startswith("Current thread") for m in stacks), stacks
    assert "gone" in guest.log("stall")
    # the new agent takes its routes back from its journal
    deadline = time.monotonic() + 60
    while not any(e["event"] == "started" and e.get("agent_id") == 1 for e, _ in
                  agent_events(journal(guest, before, _PID=after["MainPID"]))):
        assert time.monotonic() < deadline, "the restarted agent never logged `started`"
        time.sleep(1)


def test_apt_remove_stops_the_unit_and_purge_keeps_the_operators_files(guest, installed):
    sh(guest, "DEBIAN_FRONTEND=noninteractive apt-get remove -y linkpass 2>&1", 300)
    assert show(guest, "ActiveState")["ActiveState"] in ("inactive", "failed")
    assert sh(guest, "pgrep -u linkpass -c . || true").strip() == "0"
    gone = sh(guest, "for p in /opt/linkpass/venv /usr/bin/linkpass /lib/systemd/system/linkpass-agent.service; "
                     "do [ -e $p ] && echo $p; done; true")
    assert gone.strip() == "", gone
    sh(guest, "DEBIAN_FRONTEND=noninteractive apt-get purge -y linkpass 2>&1", 300)
    assert sh(guest, "ls /etc/linkpass").split() == ["agent.yaml", "fleet.key"]
    assert guest.run(["dpkg", "-s", "linkpass"]).rc != 0
