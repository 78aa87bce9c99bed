"""The systemd integration without a running systemd: the notify protocol against a real datagram
socket (READY, STATUS, RELOADING, STOPPING, WATCHDOG, the abstract namespace, $WATCHDOG_PID), the
agent's watchdog going quiet while its probe thread stalls, the coordinator's foreground wait, the
agent's capability check, and the files in deploy/systemd/: both units pass `systemd-analyze
verify` and stay within their exposure budgets (`systemd-analyze security --offline`), the sysusers
file makes the user they run as, and the sysctl.d file is what `linkpass doctor` asks for.
The real agent and coordinator speaking to a socket: tests/root/test_systemd_notify.py."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from linkpass.agent import daemon as D
from linkpass.agent.api import ProbeProgress
from linkpass.agent.config import load_text
from linkpass.coordinator import foreground as F
from linkpass.core.states import State
from linkpass.doctor import checks as DC
from linkpass.doctor import gather as DG
from linkpass.kernel import caps
from linkpass.observe import sdnotify as N

from support.doctor import healthy


ROOT = Path(__file__).parents[2]
UNITS = ROOT / "deploy" / "systemd"
ANALYZE = shutil.which("systemd-analyze")
BUDGET = {"linkpass-agent": 3.0, "linkpass-coordinator": 4.0}  # systemd-analyze security's exposure, at most

CONFIG = """
agent_id: 1
name: h0
fleet_key_file: /etc/linkpass/fleet.key
service: 198.18.0.1
nics: [{plane: 0, ifname: p0, addr: 198.18.64.1, gateway: 198.18.64.0}]
peers: [{name: h1, agent_id: 2, service: 198.18.0.2, nics: {0: 198.18.64.3}}]
"""


@pytest.fixture
def notify_socket(tmp_path):
    """A datagram socket bound where $NOTIFY_SOCKET points, as systemd binds its own."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(path)
        yield sock, path
    finally:
        sock.close()


def received(sock: socket.socket) -> list[str]:
    """Every datagram waiting on `sock`, in order."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out


def unit_text(name: str) -> str:
    return (UNITS / f"{name}.service").read_text()


def directive(text: str, key: str) -> list[str]:
    """Every value of `key=` in a unit's text, in order."""
    return re.findall(rf"^{key}=(.*)$", text, re.M)


# ---- the protocol ---------------------------------------------------------------------------

def test_the_notifier_speaks_to_a_real_socket_and_is_silent_without_one(notify_socket):
    sock, path = notify_socket
    n = N.Notifier({"NOTIFY_SOCKET": path}, pid=123, monotonic_ns=lambda: 5_000_123_456)
    assert n.enabled and n.watchdog_s is None  # no WatchdogSec=: no watchdog
    assert n.ready("probing 2 paths") and n.status("a\nb") and n.reloading() and n.stopping() and n.ping()
    assert received(sock) == ["READY=1\nSTATUS=probing 2 paths", "STATUS=a b", "RELOADING=1\nMONOTONIC_USEC=5000123",
                              "STOPPING=1", "WATCHDOG=1"]
    n.close()
    quiet = N.Notifier({}, pid=123)
    assert not quiet.enabled and not quiet.ready() and not quiet.ping() and quiet.sent == 0
    # a socket that went away: counted, never raised
    gone = N.Notifier({"NOTIFY_SOCKET": path + ".gone"})
    assert not gone.ready() and gone.failed == 1


def test_an_abstract_namespace_socket_is_reached_through_its_at_sign():
    name = f"linkpass-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(b"\0" + name.encode())
        n = N.Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert received(sock) == ["READY=1"]
        n.close()
    finally:
        sock.close()
    assert N.socket_address("vsock:2:1234") is None and N.socket_address("relative/path") is None


@pytest.mark.parametrize("env, pid, want", [
    ({"WATCHDOG_USEC": "15000000"}, 7, 15_000_000),
    ({"WATCHDOG_USEC": "15000000", "WATCHDOG_PID": "7"}, 7, 15_000_000),
    ({"WATCHDOG_USEC": "15000000", "WATCHDOG_PID": "8"}, 7, None),  # the parent's watchdog, inherited
    ({"WATCHDOG_USEC": "0"}, 7, None),
    ({"WATCHDOG_USEC": "soon"}, 7, None),
    ({}, 7, None),
])
def test_the_watchdog_timeout_belongs_to_the_process_it_names(env, pid, want):
    assert N.watchdog_usec(env, pid) == want
    n = N.Notifier({"NOTIFY_SOCKET": "/nonexistent/notify", **env}, pid=pid)
    assert n.watchdog_usec == want


class FakeEngine:
    """What ProbeProgress and the status line read of a probe engine."""

    def __init__(self, paths: int):
        self.stats = {"sent": 0, "received": 0, "reflected": 0}
        self.paths = dict.fromkeys(range(1, paths + 1))


def test_the_agent_pings_only_while_its_probe_thread_moves(notify_socket, monkeypatch):
    """WATCHDOG=1 every half timeout from the main loop while the probe counters move; a stall of
    ProbeProgress.stall_s stops the pings (systemd then restarts the agent), and they resume if
    the thread moves again before that. Real socket, fake clock, the real ProbeProgress."""
    sock, path = notify_socket
    logged = []
    monkeypatch.setattr(D, "log", lambda event, **f: logged.append(event))
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    engine = FakeEngine(paths=3)
    progress = ProbeProgress(engine, stall_s=3.0, clock=clock)
    paths = {1: SimpleNamespace(state=State.UP), 2: SimpleNamespace(state=State.DOWN),
             3: SimpleNamespace(state=State.RECOVERING)}
    agent = SimpleNamespace(progress=progress, engine=engine, labels=dict.fromkeys(paths),
                            paths_of_peer={"h1": [1, 2], "h2": [3], "h3": []}, dry_run=False,
                            failover=SimpleNamespace(detector=SimpleNamespace(paths=paths)))
    service = D.AgentService(agent, N.Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}, pid=1), clock=clock)
    service.ready()
    assert received(sock) == ["READY=1\nSTATUS=probing 3 paths to 2 peers, 1 down, 1 held out"]

    def run(seconds: float, moving: bool) -> list[str]:
        """The main loop's passes every 0.1 s (and the API's progress sampling every 1 s)."""
        for step in range(int(seconds * 10)):
            now[0] += 0.1
            if moving:
                engine.stats = {**engine.stats, "sent": engine.stats["sent"] + 1}
            if step % 10 == 9:
                progress.tick()
            service.tick()
        return [m for m in received(sock) if m == "WATCHDOG=1"]

    assert len(run(5.0, moving=True)) == 5  # every 1 s: half of WatchdogSec=2
    assert logged == []
    stalled = run(10.0, moving=False)
    assert 2 <= len(stalled) <= 4  # until the stall is seen (3 s, sampled every 1 s), then none
    assert logged == ["watchdog_withheld"] and service.watchdog.withheld.startswith("probe thread stalled")
    assert run(3.0, moving=False) == []
    assert len(run(3.0, moving=True)) >= 1 and logged == ["watchdog_withheld", "watchdog_resumed"]
    engine.paths = {}  # nothing to probe: nothing to expect of the thread
    assert len(run(3.0, moving=False)) == 3
    service.stopping()
    assert received(sock)[-1].startswith("STOPPING=1\nSTATUS=stopping")


def test_without_a_notify_socket_the_agent_service_does_nothing(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    service = D.AgentService(SimpleNamespace(), N.Notifier())  # the agent is never read: nobody to tell
    for call in (service.ready, service.tick, service.reloading, service.stopping):
        call()
    assert not service.watchdog.enabled and service.notifier.sent == service.notifier.failed == 0


# ---- the coordinator's foreground wait --------------------------------------------------------

def test_the_coordinator_is_ready_once_its_endpoint_answers_and_pings_while_it_does(notify_socket):
    sock, path = notify_socket
    now = [0.0]
    answers = iter([("down", 3), (None, 3), ("wedged", 2), (None, 2)])  # (problem, how many checks in a row)
    plan = [p for p, k in answers for _ in range(k)]
    checks = []

    def problem(url, settings):
        checks.append(now[0])
        return plan[len(checks) - 1] if len(checks) <= len(plan) else None

    got = []

    def sleep(s):
        got.extend(received(sock))  # as systemd reads them: a datagram socket queues only a few
        now[0] += s
        if now[0] > 60:
            raise KeyboardInterrupt  # SIGTERM, as the CLI's handler turns it

    n = N.Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"}, pid=1)
    F.hold("https://0.0.0.0:9470", {}, None, notifier=n, problem=problem, clock=lambda: now[0], sleep=sleep)
    got.extend(received(sock))
    assert n.failed == 0
    assert got[0] == "READY=1\nSTATUS=serving https://0.0.0.0:9470", got
    assert checks[:4] == [0.0, 0.5, 1.0, 1.5]  # every 0.5 s until it answers, then a sixth of the timeout
    assert 10.0 / 6 <= checks[4] - checks[3] <= 10.0 / 6 + F.SLICE_S  # seen at the wait's next slice
    assert got.count("STATUS=endpoint not answering: wedged; watchdog pings withheld") == 1
    pings = [m for m in got if m == "WATCHDOG=1"]
    assert len(pings) == len(checks) - 3 - 2  # one per healthy check, none while it failed
    assert got[-1] == "STOPPING=1\nSTATUS=stopping: the actor and the local Ray instance"


def _ping_gaps(notify_socket, failing: set[int], watchdog_s: float = 60.0, until_s: float = 400.0) -> list[float]:
    """The coordinator's foreground under a watchdog of `watchdog_s`, its endpoint failing the
    checks numbered in `failing` (each failure a timed-out check: the clock moves by the check's
    timeout); the gaps between READY and the WATCHDOG pings, in simulated seconds."""
    sock, path = notify_socket
    now = [0.0]
    checks = [0]
    sent_at = []

    def problem(url, settings):
        checks[0] += 1
        if checks[0] in failing:
            now[0] += F.CHECK_TIMEOUT_S
            return "timed out"
        return None

    def sleep(s):
        sent_at.extend(now[0] for m in received(sock) if m == "WATCHDOG=1" or m.startswith("READY=1"))
        now[0] += s
        if now[0] > until_s:
            raise KeyboardInterrupt

    n = N.Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}, pid=1)
    F.hold("https://0.0.0.0:9470", {}, None, notifier=n, problem=problem, clock=lambda: now[0], sleep=sleep)
    return [b - a for a, b in zip(sent_at, sent_at[1:])] + [until_s - sent_at[-1]]


def test_one_slow_failed_check_of_a_busy_coordinator_does_not_let_the_watchdog_fire(notify_socket):
    """systemd kills the unit when WatchdogSec (60 s) passes without a ping. A single health check
    that times out (5 s) on a busy host must leave the next ping well inside that; so must two in
    a row. Checking every half timeout, one such check put the next ping at 65 s: a restart."""
    for failing in ({5}, {5, 6}, {9, 10}):
        gaps = _ping_gaps(notify_socket, failing)
        assert max(gaps) < 60.0 - F.CHECK_TIMEOUT_S, (failing, gaps)


def test_an_endpoint_that_keeps_failing_stops_the_pings_for_the_watchdog_timeout(notify_socket):
    gaps = _ping_gaps(notify_socket, set(range(5, 1000)), until_s=200.0)
    assert gaps[-1] >= 60.0, gaps  # the last ping was before the failures began: systemd restarts it
    assert max(gaps[:-1]) <= 10.0 + 1e-9, gaps  # while it answered: a ping every sixth of the timeout


def test_the_coordinator_without_a_service_manager_just_waits(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    now = [0.0]
    F.hold("https://127.0.0.1:1", {}, end=3.0, problem=lambda u, s: pytest.fail("no manager: no checks"),
           clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert now[0] == pytest.approx(3.0)


def test_the_endpoint_check_reaches_a_wildcard_listener_on_loopback_and_names_a_dead_one():
    assert F.local_target("https://0.0.0.0:9470") == ("https", "127.0.0.1", 9470)
    assert F.local_target("https://[::]:9470") == ("https", "::1", 9470)
    assert F.local_target("http://10.0.0.5:80") == ("http", "10.0.0.5", 80)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    why = F.endpoint_problem(f"https://0.0.0.0:{port}", {"state_dir": "/nonexistent"}, timeout_s=2)
    assert why is not None and f"127.0.0.1:{port} does not answer" in why


# ---- capabilities -----------------------------------------------------------------------------

RAW, ADMIN, NICE = 1 << caps.CAP_NET_RAW, 1 << caps.CAP_NET_ADMIN, 1 << caps.CAP_SYS_NICE


@pytest.mark.parametrize("cap_eff, routes, dry_run, engine, missing", [
    (RAW | ADMIN, True, False, "sockets", []),
    (RAW | ADMIN | NICE, True, False, "sockets", []),
    (None, True, False, "sockets", []),  # unreadable: the kernel will say
    (ADMIN, True, False, "sockets", ["CAP_NET_RAW (raw probe sockets)"]),
    (RAW, False, False, "sockets", ["CAP_NET_ADMIN (probe receive buffers)"]),
    (RAW, True, False, "sockets", ["CAP_NET_ADMIN (probe receive buffers and route changes)"]),
    (RAW, True, False, "verbs", ["CAP_NET_ADMIN (route changes)"]),
    (RAW, True, True, "verbs", []),  # a dry run changes no route; the verbs engine sizes no socket buffer
    (RAW, False, False, "verbs", []),
    (0, True, False, "sockets", ["CAP_NET_RAW (raw probe sockets)",
                                 "CAP_NET_ADMIN (probe receive buffers and route changes)"]),
])
def test_the_agent_names_the_capabilities_it_lacks_and_how_to_grant_them(cap_eff, routes, dry_run, engine, missing):
    cfg = load_text(CONFIG.replace("peers:", f"routes: {{enabled: {str(routes).lower()}}}\npeers:"), "agent.yaml")
    why = D.capability_refusal(cfg, dry_run, cap_eff, engine)
    if not missing:
        assert why is None
        return
    assert why.startswith(f"missing {', '.join(missing)}: ") and "\n" not in why
    assert "linkpass-agent.service" in why and "--ambient-caps=" in why
    assert "CAP_SYS_NICE" not in why  # never required: without it the probe thread runs at normal priority


def test_cap_eff_is_read_from_proc_status_text():
    assert caps.cap_eff_of("Name:\tx\nCapEff:\t0000000000003000\n") == RAW | ADMIN
    assert caps.cap_eff_of("Name:\tx\n") is None and caps.read_cap_eff("/nonexistent") is None
    assert caps.read_cap_eff() is not None and caps.rtprio_limit() >= 0


def test_the_unit_grants_what_the_agent_asks_for_and_the_doctor_agrees():
    """The capabilities the agent can ask for are the unit's, no more; its real-time limit covers
    the default probe priority, so doctor finds nothing missing in a process the unit starts."""
    text = unit_text("linkpass-agent")
    granted = set(directive(text, "AmbientCapabilities")[0].split())
    assert set(directive(text, "CapabilityBoundingSet")[0].split()) == granted == {"CAP_NET_RAW", "CAP_NET_ADMIN"}
    cfg = load_text(CONFIG.replace("peers:", "routes: {enabled: true}\npeers:"), "agent.yaml")
    asked = D.capability_refusal(cfg, False, 0, "sockets")
    assert {c for c in caps.NAMES.values() if c in asked} == granted
    rtprio = int(directive(text, "LimitRTPRIO")[0])
    assert rtprio >= cfg.rt_priority and directive(text, "RestrictRealtime") == ["no"]
    facts = healthy()
    facts.cap_eff, facts.rtprio, facts.rt_priority, facts.uid = RAW | ADMIN, rtprio, cfg.rt_priority, 999
    assert {c.name: c.status for c in DC.check_caps(facts)} == {
        "cap.net_admin": DC.OK, "cap.net_raw": DC.OK, "cap.sys_nice": DC.OK}
    facts.rtprio = 0  # neither the capability nor the limit: SCHED_FIFO is refused, a warning
    sys_nice = DC.check_caps(facts)[2]
    assert sys_nice.status == DC.WARN and "LimitRTPRIO=10" in sys_nice.fix


def test_the_agent_unit_raises_the_descriptor_limit():
    """The agent's HTTP servers are capped (agent/api.py HttpLimits), but probes, netlink and the
    journal need descriptors too: the unit lifts the soft limit of 1024 well clear of all of them."""
    text = unit_text("linkpass-agent")
    nofile = directive(text, "LimitNOFILE")
    assert len(nofile) == 1 and int(nofile[0]) >= 65536


# ---- the files in deploy/systemd ---------------------------------------------------------------

@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", sorted(BUDGET))
def test_each_unit_stays_within_its_exposure_budget(name):
    out = subprocess.run([ANALYZE, "security", "--offline=true", "--no-pager", str(UNITS / f"{name}.service")],
                         capture_output=True, text=True, timeout=60)
    found = re.search(rf"Overall exposure level for {name}\.service: (\d+\.\d+)", out.stdout)
    assert found, out.stdout + out.stderr
    assert float(found.group(1)) <= BUDGET[name], out.stdout


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name, command", [("linkpass-agent", "agent --config"),
                                           ("linkpass-coordinator", "coordinator --fabric")])
def test_each_unit_verifies_and_runs_a_command_the_cli_has(tmp_path, name, command):
    """`systemd-analyze verify` wants ExecStart= to exist: the copy checked names this venv's
    linkpass instead of the package's /opt/linkpass/bin/linkpass."""
    unit = unit_text(name)
    assert f"ExecStart=/opt/linkpass/bin/linkpass {command}" in unit
    assert all(d.startswith("https://github.com/linkpass/linkpass/blob/main/docs/") and
               (ROOT / "docs" / d.rsplit("/", 1)[1]).is_file() for d in directive(unit, "Documentation"))
    linkpass = os.path.join(os.path.dirname(sys.executable), "linkpass")
    path = tmp_path / f"{name}.service"
    path.write_text(unit.replace("/opt/linkpass/bin/linkpass", linkpass))
    out = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if f"{name}.service" in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
    args = directive(unit, "ExecStart")[0].split()[1:]
    help_text = subprocess.run([linkpass, args[0], "--help"], capture_output=True, text=True, timeout=60).stdout
    assert all(a in help_text for a in args if a.startswith("--")), (args, help_text)
    assert directive(unit, "Type") == ["notify"] and int(directive(unit, "WatchdogSec")[0]) > 0


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_the_sysusers_file_makes_the_user_the_units_run_as(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "usr/lib/sysusers.d").mkdir(parents=True)
    shutil.copy(UNITS / "linkpass.sysusers", root / "usr/lib/sysusers.d/linkpass.conf")
    out = subprocess.run(["systemd-sysusers", f"--root={root}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    users = {f[0]: f for f in (line.split(":") for line in (root / "etc/passwd").read_text().splitlines())}
    groups = {line.split(":")[0] for line in (root / "etc/group").read_text().splitlines()}
    assert all(int(u[2]) < 1000 and u[6].endswith("nologin") for u in users.values()), users
    runs_as = {name: directive(unit_text(name), "User") for name in BUDGET}
    assert runs_as == {"linkpass-agent": ["linkpass"], "linkpass-coordinator": ["linkpass-coordinator"]}
    for name in BUDGET:
        text = unit_text(name)
        assert directive(text, "User")[0] in users and directive(text, "Group") == directive(text, "User")
        assert set(" ".join(directive(text, "SupplementaryGroups")).split()) <= groups


def sysctl_file() -> dict[str, str]:
    out = {}
    for line in (UNITS / "90-linkpass.conf").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_the_sysctl_file_and_the_doctors_lines_for_the_host_are_what_the_doctor_asks_for():
    """A host as distributions leave it fails or warns on every sysctl check; with the shipped
    file's values and the lines the doctor prints for this host's own settings (its fabric NICs'
    rp_filter, its whole reserved-ports list) the checks all pass. The file itself sets nothing
    for every interface and replaces no list the host may have."""
    shipped = sysctl_file()
    assert set(shipped) <= set(DG.SYSCTLS), "every key the file sets is one the doctor reads"
    assert not any("rp_filter" in k for k in shipped), "rp_filter is loosened on the fabric NICs only"
    assert "net.ipv4.ip_local_reserved_ports" not in shipped, "the reserved ports are one list: the host's"
    stock = {"net.ipv4.fib_multipath_hash_policy": "0", "net.ipv4.conf.all.rp_filter": "1",
             "net.ipv4.conf.default.rp_filter": "1", "net.ipv4.conf.p0.rp_filter": "1",
             "net.ipv4.conf.p1.rp_filter": "1", "net.ipv4.icmp_errors_use_inbound_ifaddr": "0",
             "net.ipv4.ip_forward": "1", "net.ipv4.ip_local_port_range": "32768\t60999",
             "net.ipv4.ip_local_reserved_ports": "8000-8010,50000"}

    def sysctl_rows(values):
        facts = healthy()
        facts.sysctl = values
        return {c.name: c for c in DC.run_checks(facts) if c.name.startswith("sysctl.")}

    before = sysctl_rows(stock)
    assert all(c.status != DC.OK for c in before.values()), before
    host_lines = {}
    for c in sysctl_rows({**stock, **shipped}).values():  # what is left is the host's own: the doctor says it
        if c.status != DC.OK:
            for kv in c.fix.split("sysctl -w ", 1)[1].split("  (")[0].split():
                key, _, value = kv.partition("=")
                host_lines[key] = value.strip('"')
    assert set(host_lines) == {"net.ipv4.conf.p0.rp_filter", "net.ipv4.conf.p1.rp_filter",
                               "net.ipv4.ip_local_reserved_ports"}, host_lines
    from linkpass.core.constants import DISCOVERY_PORTS, PROBE_PORT_BASE

    ours = f"{PROBE_PORT_BASE}-{PROBE_PORT_BASE + DISCOVERY_PORTS - 1}"
    assert host_lines["net.ipv4.ip_local_reserved_ports"] == f"8000-8010,{ours},50000"  # the host's kept
    after = sysctl_rows({**stock, **shipped, **host_lines})
    assert set(after) == set(before) and all(c.status == DC.OK for c in after.values()), after


def test_only_the_files_the_package_knows_are_shipped():
    """deploy/package.py installs units, the sysusers file and sysctl.d files by suffix."""
    assert sorted(p.name for p in UNITS.iterdir()) == ["90-linkpass.conf", "linkpass-agent.service",
                                                       "linkpass-coordinator.service", "linkpass.sysusers"]
