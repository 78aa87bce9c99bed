"""`linkpass agent` daemons on testbed hosts, for tests, benchmarks and the demo.

Each agent is a real process in its host's namespace with its own config (written by
`write_agent_configs` below), its structured log in a file, and its route journal and entropy
table in the run directory. `events()` reads the logs back; `stop()` sends SIGTERM (a clean stop
leaves the routes as decided, planes known bad out) and kills what does not exit.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..core.constants import AGENT_API_PORT, AGENT_METRICS_PORT
from ..core.names import host_name
from ..core.states import USABLE, state_of
from .topology import Fabric, nic_ifname

LINKPASS = [sys.executable, "-m", "linkpass.cli"]
# the lab's agents' probe interval (demo, `testbed up --agents`): four at 1 ms saturate a 2-core machine
LAB_INTERVAL_MS = 5.0


@dataclass
class Agents:
    fab: Fabric
    directory: str
    hosts: list[int]
    key: bytes = bytes(range(32))
    interval_ms: float = 1.0
    routes: bool = True
    entropy: bool = True
    detect: dict | None = None
    extra_args: tuple[str, ...] = ()
    coordinator: dict | None = None  # the agents' `coordinator:` config section (see write_agent_configs)
    tls_dir: str | None = None  # the coordinator's lab CA: each agent gets its CA and a client certificate
    probe: dict | None = None  # more of the agents' `probe:` config section
    route_options: dict | None = None  # more of the agents' `routes:` config section
    detach: bool = False  # own sessions: they outlive the process that started them (`testbed up --agents`)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    configs: dict[int, str] = field(default_factory=dict)  # host -> its config file, once started

    def start(self, wait_s: float = 30.0) -> "Agents":
        """Start every agent and wait until each has logged `started`."""
        self.configs = write_agent_configs(self.fab, self.directory, self.key, interval_ms=self.interval_ms,
                                           routes=self.routes, entropy=self.entropy, detect=self.detect,
                                           hosts=self.hosts, coordinator=self.coordinator, probe=self.probe,
                                           route_options=self.route_options, tls_dir=self.tls_dir)
        for h in self.hosts:
            self._spawn(h, "w")
        deadline = time.monotonic() + wait_s
        for h in self.hosts:
            self._wait_started(h, 1, deadline, wait_s)
        return self

    def _spawn(self, h: int, mode: str) -> None:
        log = open(self.log_path(h), mode)
        self.procs[h] = subprocess.Popen(["ip", "netns", "exec", self.fab.netns(host_name(h)), *LINKPASS, "agent",
                                          "--config", self.configs[h], *self.extra_args],
                                         stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=self.detach)
        log.close()

    def _wait_started(self, h: int, count: int, deadline: float, wait_s: float) -> None:
        """Until the agent on h has logged `started` `count` times in all (its log spans restarts)."""
        while len(self.events(h, "started")) < count:
            if self.procs[h].poll() is not None:
                raise RuntimeError(f"agent on {host_name(h)} exited with {self.procs[h].returncode}: "
                                   f"{open(self.log_path(h)).read()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent on {host_name(h)} did not start within {wait_s} s")
            time.sleep(0.05)

    def kill(self, host: int) -> int:
        """SIGKILL the agent on `host`, as a crash or the OOM killer would: nothing of it runs after
        (no route clean-up, no goodbye to the coordinator). Returns when it is gone: CLOCK_MONOTONIC
        ns of the kill."""
        p = self.procs[host]
        p.send_signal(signal.SIGKILL)
        killed = time.monotonic_ns()
        p.wait(timeout=10)
        return killed

    def restart(self, host: int, wait_s: float = 30.0) -> None:
        """Start the agent on `host` again on its config, its log continued (a path's state in
        path_states() starts afresh from there), and wait until it has logged `started`."""
        before = len(self.events(host, "started"))
        self._spawn(host, "a")
        self._wait_started(host, before + 1, time.monotonic() + wait_s, wait_s)

    def log_path(self, host: int) -> str:
        return os.path.join(self.directory, f"agent-{host_name(host)}.log")

    def events(self, host: int, kind: str | None = None) -> list[dict]:
        out = []
        try:
            with open(self.log_path(host)) as f:
                for line in f:
                    try:
                        ev = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line being written, or a traceback
                    if kind is None or ev.get("event") == kind:
                        out.append(ev)
        except FileNotFoundError:
            pass
        return out

    def wait_for(self, host: int, kind: str, pred=lambda ev: True, timeout_s: float = 5.0) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.events(host, kind):
                if pred(ev):
                    return ev
            time.sleep(0.02)
        return None

    def path_states(self, host: int) -> dict[int, str]:
        """Each path's latest state as the agent logged it (paths never logged are up; a path
        that only went SUSPECT is not logged and counts as up too). An agent that started again
        starts its paths afresh: only what it logged since its last `started` counts."""
        states: dict[int, str] = {}
        for ev in self.events(host):
            if ev.get("event") == "started":
                states.clear()
            elif ev.get("event") == "path_state":
                states[ev["path"]] = ev["new"]
        return states

    def wait_healthy(self, hosts=None, timeout_s: float = 60.0) -> bool:
        """Until every path the agents on `hosts` logged is back to up (or suspect)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(state_of(s) in USABLE for h in (hosts or self.hosts) for s in self.path_states(h).values()):
                return True
            time.sleep(0.2)
        return False

    def not_up(self, hosts=None) -> dict[str, list[dict]]:
        """Per host, the paths its agent does not have UP, as `linkpass paths --local -o json` in
        the host's namespace shows them (state, reason, what a recovering one waits for): the
        detail a test prints when paths do not come back."""
        out: dict[str, list[dict]] = {}
        for h in hosts or self.hosts:
            got = subprocess.run(["ip", "netns", "exec", self.fab.netns(host_name(h)), *LINKPASS, "paths", "--local",
                                  "-o", "json"], capture_output=True, text=True, timeout=30)
            try:
                rows = json.loads(got.stdout)
            except json.JSONDecodeError:
                out[host_name(h)] = [{"error": (got.stdout + got.stderr)[-300:]}]
                continue
            out[host_name(h)] = [{k: r.get(k) for k in ("peer", "plane", "path", "state", "reason", "waiting_for",
                                                         "window")}
                                 for r in rows if r.get("state") != "up"]
        return out

    def stop(self, timeout_s: float = 15.0) -> dict[int, int | None]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        deadline = time.monotonic() + timeout_s
        for h, p in self.procs.items():
            try:
                codes[h] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                codes[h] = p.wait()
        self.procs.clear()
        return codes

    def remove_routes(self) -> None:
        """Remove the routes the agents own. A clean stop leaves them installed as decided, as on a
        real host; a testbed shared with runs without LinkPass wants none."""
        from ..core.constants import RTPROT_LINKPASS

        for h in self.hosts:
            subprocess.run(["ip", "-n", self.fab.netns(host_name(h)), "route", "flush", "proto", str(RTPROT_LINKPASS)],
                           check=False, capture_output=True)

    def __enter__(self) -> "Agents":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def peer_routes(fab: Fabric, host: int):
    """What the route actuator of `host` needs: every other host's service address and, per
    plane, the gateway (the leaf end of our uplink) and device."""
    from ..agent.routes import PeerRoutes
    from .topology import host_link_addrs

    hops = {p: (str(host_link_addrs(p, host)[0]), nic_ifname(p)) for p in range(fab.spec.planes)}
    return {host_name(j): PeerRoutes(host_name(j), fab.service_addr(j), hops)
            for j in range(fab.spec.hosts) if j != host}


def write_agent_configs(fab: Fabric, directory: str, key: bytes, api_port: int = AGENT_API_PORT,
                        interval_ms: float = 1.0, routes: bool = False, entropy: bool = False,
                        detect: dict | None = None, hosts=None, coordinator: dict | None = None,
                        probe: dict | None = None, route_options: dict | None = None,
                        tls_dir: str | None = None) -> dict[int, str]:
    """One `linkpass agent` config per host in `hosts` (default: all), whose peers are the other
    hosts in it, every plane; plus the fleet key file. Route journals and entropy tables go into
    `directory` too (one per host).

    `coordinator` is the agents' `coordinator:` section. With `agent_secret_file` (the
    coordinator's agent secret) in place of `token_file`, each agent gets its own token, derived
    for its host and written to `directory/agent-<host>.token`: an agent speaks for itself only.
    With `tls_dir` (a lab CA, e.g. the coordinator's <state_dir>/tls) and an https coordinator,
    each host's section names the CA and a client certificate of its own, made there if missing
    (mutual TLS works either way): the token says which host an agent speaks for, the
    certificate that it holds a key the CA vouched for."""
    import os

    from ..formats import yaml_doc as yaml

    from .topology import host_link_addrs

    os.makedirs(directory, exist_ok=True)
    key_file = os.path.join(directory, "fleet.key")
    # created owner-only, never readable by others even for a moment (the agent refuses a key
    # file its group or others can read)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(key.hex())
    secret = None
    if coordinator and "agent_secret_file" in coordinator:
        from ..coordinator.auth import read_agent_secret

        secret = read_agent_secret(coordinator["agent_secret_file"])
    out = {}
    planes = range(fab.spec.planes)
    chosen = list(range(fab.spec.hosts) if hosts is None else hosts)  # agents run here; they are each other's peers
    tls = bool(tls_dir and coordinator and str(coordinator.get("url", "")).startswith("https://"))
    if tls:
        from ..coordinator import lab_ca
        from ..control.tls import lab_paths

        lab_ca.ensure(tls_dir, clients=[host_name(i) for i in chosen])
    for i in chosen:
        doc = {
            "agent_id": i + 1, "name": host_name(i), "fleet_key_file": key_file, "service": fab.service_addr(i),
            "nics": [{"plane": p, "ifname": nic_ifname(p), "addr": fab.nic_addr(i, p),
                      "gateway": str(host_link_addrs(p, i)[0])} for p in planes],
            "peers": [{"name": host_name(j), "agent_id": j + 1, "service": fab.service_addr(j),
                       "nics": {p: fab.nic_addr(j, p) for p in planes}} for j in chosen if j != i],
            # rates off unless a test asks: the testbed's tests expect millisecond detection on
            # paths no traffic uses
            "probe": {"interval_ms": interval_ms, "idle_rates": False,
                      "lanes_dir": os.path.join(directory, f"lanes-{host_name(i)}"), **(probe or {})},
            "api": {"port": api_port},
            # Prometheus scrapes over the management network, as in a fleet
            "metrics": {"address": fab.mgmt_addr(i), "port": AGENT_METRICS_PORT},
            "routes": {"enabled": routes, "journal": os.path.join(directory, f"routes-{host_name(i)}.journal"),
                       **(route_options or {})},
            "entropy": {"enabled": entropy, "path": os.path.join(directory, f"entropy-{host_name(i)}")},
        }
        if detect:
            doc["detect"] = dict(detect)
        if coordinator:
            doc["coordinator"] = {k: v for k, v in coordinator.items() if k != "agent_secret_file"}
            if secret is not None:
                from ..coordinator.auth import agent_token, write_private

                token_file = os.path.join(directory, f"agent-{host_name(i)}.token")
                write_private(token_file, agent_token(secret, host_name(i)) + "\n")
                doc["coordinator"]["token_file"] = token_file
            if tls:
                cert, key = lab_paths(tls_dir, host_name(i))
                doc["coordinator"].update(ca_file=lab_paths(tls_dir, "ca")[0], cert_file=cert, key_file=key)
        path = os.path.join(directory, f"agent-{host_name(i)}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        out[i] = path
    return out


GUEST_AGENT_DIR = "/lp/agent"  # inside a guest: its share of the run directory (guests.guest_dir(...)/lp/agent)
GUEST_RUN_DIR = "/run/linkpass"  # the guest's own tmpfs: the entropy table (shared memory) and route journal
GUEST_TABLE = f"{GUEST_RUN_DIR}/entropy"  # where the guest's RDMA applications and the NCCL plugin read it


@dataclass
class GuestAgents:
    """`linkpass agent` inside Soft-RoCE guests (`Spec.rdma_hosts`): the same daemon, started
    through each guest's control port from the project's read-only share, probing through verbs
    (probe.engine: verbs: on rxe, as on a RoCE NIC, sockets never see a RoCEv2 packet). Each
    guest's config, key, token, certificates and log live in its 9p share (the host reads the log
    there); its entropy table is in the guest's own /run, where the guest's RDMA applications
    read it. With `coordinator`, the agents report over the management network."""

    fab: Fabric
    hosts: list[int]
    key: bytes = bytes(range(32))
    interval_ms: float = 10.0
    detect: dict | None = None
    probe: dict | None = None
    coordinator: dict | None = None  # the agents' `coordinator:` section, as `Agents` takes it
    tls_dir: str | None = None  # the coordinator's lab CA (see write_agent_configs)
    controls: dict = field(default_factory=dict)  # host -> guests.Control: pass the caller's (one per guest at a time)
    _own: set = field(default_factory=set)

    PYTHONPATH = "/opt/linkpass/rdma:/opt/linkpass"

    def _dir(self, host: int) -> str:
        from .guests import guest_dir

        return os.path.join(guest_dir(self.fab.prefix, host), "lp", "agent")

    def start(self, wait_s: float = 120.0) -> "GuestAgents":
        """Write each guest's config, start its agent and wait until every one has logged `started`
        (discovery under emulation takes seconds)."""
        from ..formats import yaml_doc as yaml

        from .guests import Control

        probe = {"engine": "verbs", "rt_priority": 0, "size_probe_every": 0, "idle_interval_ms": self.interval_ms,
                 **(self.probe or {})}
        pids = {}
        for h in self.hosts:
            d = self._dir(h)
            os.makedirs(d, mode=0o700, exist_ok=True)
            cfg = write_agent_configs(self.fab, d, self.key, interval_ms=self.interval_ms, detect=self.detect,
                                      hosts=self.hosts, probe=probe, entropy=True, coordinator=self.coordinator,
                                      tls_dir=self.tls_dir)[h]
            with open(cfg) as f:
                text = f.read().replace(d, GUEST_AGENT_DIR)
            doc = yaml.safe_load(text)
            for k in ("ca_file", "cert_file", "key_file"):  # the lab CA's files, into the guest's share
                src = (doc.get("coordinator") or {}).get(k)
                if src and not src.startswith(GUEST_AGENT_DIR):
                    dst = os.path.join(d, os.path.basename(src))
                    shutil.copyfile(src, dst)
                    os.chmod(dst, 0o600)
                    doc["coordinator"][k] = f"{GUEST_AGENT_DIR}/{os.path.basename(src)}"
            doc["entropy"]["path"] = GUEST_TABLE
            doc["probe"]["lanes_dir"] = f"{GUEST_RUN_DIR}/lanes"  # beside the table, as the plugin expects
            doc["routes"]["journal"] = f"{GUEST_RUN_DIR}/routes.journal"
            with open(os.path.join(d, "agent.yaml"), "w") as f:
                yaml.safe_dump(doc, f, sort_keys=False)
            ctl = self.controls.get(h)
            if ctl is None:
                ctl = self.controls[h] = Control(self.fab.prefix, h)
                self._own.add(h)
            ctl.check(["mkdir", "-p", GUEST_RUN_DIR])
            pids[h] = ctl.spawn("agent", ["python3", "-m", "linkpass.cli", "agent", "--config", f"{GUEST_AGENT_DIR}/agent.yaml"],
                      env={"PYTHONPATH": self.PYTHONPATH, "PYTHONDONTWRITEBYTECODE": "1"})
        deadline = time.monotonic() + wait_s
        for h in self.hosts:
            while not self.events(h, "started"):
                gone = self.controls[h].run(["sh", "-c", f"kill -0 {pids[h]}"]).rc != 0
                if gone or time.monotonic() > deadline:
                    why = "exited" if gone else f"did not start within {wait_s} s"
                    raise RuntimeError(f"agent in guest {host_name(h)} {why}: {self.log(h)[-2000:]}")
                time.sleep(0.5)
        return self

    def log(self, host: int) -> str:
        from .guests import guest_dir

        try:
            with open(os.path.join(guest_dir(self.fab.prefix, host), "lp", "agent.log")) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def events(self, host: int, kind: str | None = None) -> list[dict]:
        out = []
        for line in self.log(host).splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(ev, dict) and (kind is None or ev.get("event") == kind):
                out.append(ev)
        return out

    def wait_for(self, host: int, kind: str, pred=lambda ev: True, timeout_s: float = 10.0) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.events(host, kind):
                if pred(ev):
                    return ev
            time.sleep(0.05)
        return None

    def stop(self) -> None:
        """SIGTERM each agent (a clean stop withdraws its entropy table); the controls stay open."""
        for ctl in self.controls.values():
            try:
                ctl.kill("agent")
            except Exception:  # noqa: BLE001 - a guest already gone has no agent left to stop
                pass

    def close(self) -> None:
        """Stop the agents; close the control connections this object opened."""
        self.stop()
        for h in self._own:
            self.controls.pop(h).close()
        self._own.clear()

    def __enter__(self) -> "GuestAgents":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

