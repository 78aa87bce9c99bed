"""The real `linkpass agent` against a real $NOTIFY_SOCKET, as systemd runs it (docs/systemd.md): READY=1 when up, WATCHDOG=1 at half of $WATCHDOG_USEC and only for
the process $WATCHDOG_PID names, RELOADING=1 with MONOTONIC_USEC then READY=1 around a SIGHUP,
STOPPING=1 on SIGTERM. The agent also runs as its unit runs it: an unprivileged user holding only
CAP_NET_RAW and CAP_NET_ADMIN, under a seccomp filter built from the unit's SystemCallFilter= and
RestrictAddressFamilies= lines and MemoryDenyWriteExecute='s rules, with routes and the entropy
table; it refuses, in one line, to start without its capabilities; and doctor, run as root,
accepts the key the unit gives it. The coordinator, under its own unit's filter with no
capabilities: tests/service/test_systemd_notify_coordinator.py.

What a stalled probe thread does to the pings, and the rest of the protocol in detail:
tests/unit/test_systemd.py."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

from linkpass.testbed.agents import write_agent_configs

from support.fleet import FAB
from support.ports import free_port
from support.processes import LogDrain
from support.testbed import routes_of
from support.systemd import EMULATE, LINKPASS, SANDBOX, NotifyListener, sandbox_spec

KEY = bytes(range(32))
NOBODY = 65534


def stop_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)


def python_for(uid: int) -> tuple[str, dict] | None:
    """An interpreter `uid` can run with LinkPass importable, and the environment it needs: this
    one, or else the system's of the same version given this one's import path (a venv whose
    interpreter lives under /root is out of other users' reach)."""
    import linkpass

    stdlib = os.path.realpath(sys.base_prefix)
    path = os.pathsep.join([os.path.dirname(os.path.dirname(linkpass.__file__))] + [
        p for p in sys.path if p and os.path.isdir(p) and not os.path.realpath(p).startswith(stdlib + os.sep)])
    for exe, extra in ((sys.executable, {}),
                       (f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}", {"PYTHONPATH": path})):
        if not os.path.exists(exe):
            continue
        # exec'd twice, as the sandbox does: setpriv's own exec still holds root's capabilities
        # (which reach into /root), the second one has none
        ok = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                             "--bounding-set=-all", exe, "-c", "import os, sys; os.execv(sys.argv[1], sys.argv[1:])",
                             exe, "-c", "import linkpass.agent.daemon, linkpass.probe._probecore"],
                            env={**os.environ, **extra}, capture_output=True, cwd="/", timeout=60)
        if ok.returncode == 0:
            return exe, extra
    return None


def delete_linkpass_routes(fab, host: int) -> None:
    """Remove the routes an agent left in a host's namespace (proto 176; the baseline stays)."""
    from pyroute2 import IPRoute

    from linkpass.agent.routes import RTPROT_LINKPASS

    with IPRoute(netns=fab.netns(f"h{host}")) as ipr:
        for r in ipr.get_routes(family=2, proto=RTPROT_LINKPASS):
            ipr.route("del", dst=r.get_attr("RTA_DST"), dst_len=r["dst_len"], proto=RTPROT_LINKPASS)


def test_the_agent_tells_systemd_it_is_ready_alive_reloading_and_stopping(clean_faults, tmp_path):
    """h0 under a watchdog meant for it ($WATCHDOG_PID is its pid: `ip netns exec` execs in
    place), h1 with one meant for another process: h1 says READY=1 but never pings."""
    fab = clean_faults
    port = free_port()
    configs = write_agent_configs(fab, str(tmp_path), KEY, api_port=port, hosts=[0, 1], interval_ms=2)
    listeners = {i: NotifyListener(str(tmp_path / f"notify-h{i}")) for i in (0, 1)}
    procs = {}
    try:
        for i, watchdog_pid in ((0, "$$"), (1, "1")):
            env = {**os.environ, "NOTIFY_SOCKET": listeners[i].path, "WATCHDOG_USEC": "1000000"}
            cmd = (f"WATCHDOG_PID={watchdog_pid} exec ip netns exec {fab.netns(f'h{i}')} {sys.executable} "
                   f"{' '.join(LINKPASS)} agent --config {configs[i]} --max-seconds 120")
            procs[i] = subprocess.Popen(["sh", "-c", cmd], env=env, stderr=subprocess.PIPE, text=True)
        logs = {i: LogDrain(p.stderr) for i, p in procs.items()}
        h0, h1 = listeners[0], listeners[1]
        ready = h0.wait_for(r"^READY=1\nSTATUS=probing 2 paths to 1 peer, \d+ down", 60)
        assert logs[0].wait_for('"event": "started"', 5) and '"watchdog_s": 1.0' in logs[0].text(0)
        h0.wait_for(r"^WATCHDOG=1$", 5, after=ready)
        time.sleep(2.0)
        assert 3 <= h0.count("WATCHDOG=1", after=ready) <= 6  # every 0.5 s: half of WATCHDOG_USEC
        h1.wait_for(r"^READY=1", 60)

        procs[0].send_signal(signal.SIGHUP)
        reloading = h0.wait_for(r"^RELOADING=1\nMONOTONIC_USEC=\d+$", 20)
        stamp = int(h0.messages[reloading].split("MONOTONIC_USEC=")[1])
        assert abs(stamp - time.monotonic_ns() // 1000) < 20_000_000  # CLOCK_MONOTONIC, as systemd reads it
        again = h0.wait_for(r"^READY=1\nSTATUS=probing 2 paths", 20, after=reloading)
        pings = h0.count("WATCHDOG=1", after=again)
        time.sleep(1.2)
        assert h0.count("WATCHDOG=1", after=again) > pings  # it pings on after the reload

        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) == 0, logs[0].text()[-2000:]
        h0.wait_for(r"^STOPPING=1", 5)
        assert h1.count("WATCHDOG=1") == 0, h1.messages  # $WATCHDOG_PID named another process
    finally:
        stop_all(procs.values())
        for listener in listeners.values():
            listener.close()


@pytest.mark.skipif(not EMULATE or shutil.which("setpriv") is None,
                    reason="needs libseccomp, systemd-analyze and setpriv")
def test_the_agent_runs_as_its_unit_runs_it(clean_faults):
    """As `nobody` with only CAP_NET_RAW and CAP_NET_ADMIN (ambient), under the unit's system call
    filter, address families and W^X: it starts, changes routes through netlink, writes the entropy
    table in a runtime directory it owns, pings its watchdog, and stops cleanly."""
    fab = clean_faults
    python = python_for(NOBODY)
    if python is None:
        pytest.skip("no interpreter that uid 65534 can run with LinkPass importable")
    exe, extra_env = python
    top = tempfile.mkdtemp(prefix="linkpass-unit-", dir="/tmp")
    procs, listener = [], None
    try:
        os.chmod(top, 0o755)
        run = os.path.join(top, "run")  # what RuntimeDirectory= makes: the agent's, 0755
        os.mkdir(run, 0o755)
        os.chown(run, NOBODY, NOBODY)
        configs = write_agent_configs(fab, top, KEY, api_port=free_port(), hosts=[0, 1], interval_ms=2)
        doc = yaml.safe_load(open(configs[0]))
        doc["routes"] = {"enabled": True, "journal": f"{run}/routes.journal"}
        doc["entropy"] = {"enabled": True, "path": f"{run}/entropy"}
        with open(configs[0], "w") as f:
            yaml.safe_dump(doc, f)
        # the unit's key is the agent's own, 0600; the peer, as root, keeps a root-owned copy
        peer = yaml.safe_load(open(configs[1]))
        peer["fleet_key_file"] = shutil.copy(doc["fleet_key_file"], os.path.join(top, "fleet-root.key"))
        with open(configs[1], "w") as f:
            yaml.safe_dump(peer, f)
        os.chown(doc["fleet_key_file"], NOBODY, NOBODY)
        for path in configs.values():
            os.chmod(path, 0o644)
        spec = os.path.join(top, "sandbox.json")
        with open(spec, "w") as f:
            json.dump(sandbox_spec("linkpass-agent"), f)
        listener = NotifyListener(os.path.join(top, "notify"))
        # the peer first (as root, as any agent may run), so h0's probes are answered from its start
        procs.append(subprocess.Popen(["ip", "netns", "exec", fab.netns("h1"), sys.executable, *LINKPASS, "agent",
                                       "--config", configs[1], "--max-seconds", "120"], stderr=subprocess.PIPE,
                                      text=True))
        assert LogDrain(procs[0].stderr).wait_for('"event": "started"', 60)
        caps = "-all,+net_raw,+net_admin"
        env = {**os.environ, **extra_env, "NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "1000000",
               "HOME": "/nonexistent"}
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", fab.netns("h0"), "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
             "--clear-groups", f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set={caps}",
             "--no-new-privs", exe, "-c", SANDBOX, spec, exe, *LINKPASS, "agent", "--config", configs[0],
             "--max-seconds", "120"], env=env, cwd="/", stderr=subprocess.PIPE, text=True))
        log = LogDrain(procs[1].stderr)
        ready = listener.wait_for(r"^READY=1\nSTATUS=probing 2 paths to 1 peer", 60)
        listener.wait_for(r"^WATCHDOG=1$", 5, after=ready)
        assert routes_of(fab, 0) == {fab.service_addr(1): (0, 1)}  # reconciled: both planes, through netlink
        st = os.stat(f"{run}/entropy")
        assert (st.st_uid, oct(st.st_mode & 0o777)) == (NOBODY, "0o644")  # the agent's, readable by every reader
        assert os.stat(f"{run}/routes.journal").st_uid == NOBODY
        started = json.loads(next(line for line in log.lines if '"event": "started"' in line))
        assert started["entropy"] and started["routes"] and started["probes"]["engine"] == "sockets"
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(timeout=30) == 0, log.text()[-3000:]
        listener.wait_for(r"^STOPPING=1", 5)
        assert not os.path.exists(f"{run}/entropy")  # withdrawn on a clean stop
        # a system call the filter refused would surface as a failed step of the main loop
        assert not any('"event": "loop_error"' in line for line in log.lines), log.text()[-3000:]
    finally:
        stop_all(procs)
        if listener is not None:
            listener.close()
        delete_linkpass_routes(fab, 0)
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_the_agent_refuses_in_one_line_to_start_without_its_capabilities(tmp_path):
    """Root with CAP_NET_RAW and CAP_NET_ADMIN taken out of the bounding set: no sockets opened,
    exit 2, one line naming both, what needs them and how to grant them."""
    configs = write_agent_configs(FAB, str(tmp_path), KEY, hosts=[0, 1], routes=True)  # no testbed needed
    out = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-net_raw,-net_admin", sys.executable,
                          *LINKPASS, "agent", "--config", configs[0], "--max-seconds", "5"],
                         capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("linkpass agent: missing CAP_NET_RAW (raw probe sockets), CAP_NET_ADMIN (probe "
                               "receive buffers and route changes): run it under the shipped unit"), lines[0]
    assert "--ambient-caps=+net_raw,+net_admin" in lines[0]
    # CAP_NET_RAW alone is still not enough for the socket engine, even in a dry run
    out = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-net_admin", sys.executable, *LINKPASS,
                          "agent", "--config", configs[0], "--dry-run", "--max-seconds", "5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "missing CAP_NET_ADMIN (probe receive buffers):" in out.stderr, out.stderr


def test_doctor_run_as_root_judges_the_agents_key_as_its_owner_reads_it(tmp_path):
    """Under the unit the fleet key belongs to the agent's user, 0600: root's doctor accepts it
    (the agent runs as its owner) and still refuses one the owner's group could read."""
    from linkpass.doctor.gather import fleet_key_problem

    key = tmp_path / "fleet.key"
    key.write_text(KEY.hex())
    os.chmod(key, 0o600)
    os.chown(key, NOBODY, NOBODY)
    assert fleet_key_problem(str(key)) is None
    os.chmod(key, 0o640)
    assert "can be read or written by its group" in fleet_key_problem(str(key))
    os.chown(key, 0, 0)  # root's own key: judged exactly as the agent's loader does
    assert "chmod 600" in fleet_key_problem(str(key))
