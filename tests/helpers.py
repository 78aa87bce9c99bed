"""What more than one test module needs, in one place: test modules import from here, never from
each other (tests/test_layout.py checks).

- prefix_for: testbed prefixes unique to this pytest run (conftest's fixtures use them too);
- check_golden: golden-file comparison for the CLI's renderings (files in tests/golden/);
- free_port, wait_until: a free TCP port; polling a condition with a deadline;
- LogDrain: reads a process's log pipe for the whole run (a full pipe would block its writer);
- routes_of, A, B: LinkPass's routes in a testbed host's namespace; the failover tests' two hosts;
- FAB, MODEL, table_of, identity, fail_paths: the coordinator tests' fabric and what its agents report;
- coordinator_client, lab_ca_file: a client of a real coordinator over HTTPS, trusting the lab CA
  it made in its state dir;
- healthy (NICS, PEERS, BASELINE, ...): doctor's facts of a host where every check passes;
- four_agents_registered: a Coordinator with h0..h3 registered (no Ray, no sockets);
- stop_processes: SIGTERM processes, then kill what does not exit;
- signed_probe: a probe's bytes signed with a key, whatever its padding (encoders refuse > MAX_PAD);
- nccl_build, nccl_harness, harness_fields, HarnessRun: the NCCL plugin and its harness, built where
  the project's build puts them (rdma/nccl/build/), the harness run with LinkPass's variables, and a
  transfer that runs until the test has seen what it waits for.

Regenerate golden files after an intended change:
LINKPASS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/...
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import TYPE_CHECKING

from linkpass.core.fabric import from_testbed
from linkpass.doctor import checks as D
from linkpass.testbed.topology import make_fabric, preset

if TYPE_CHECKING:
    from linkpass.coordinator.coordinator import Coordinator

# ---- testbed prefixes ---------------------------------------------------------------------------

RUN_TAG = f"{os.getpid() % 10000:04d}"


def prefix_for(letter: str) -> str:
    """A testbed prefix unique to this run: one letter + 4 digits (e.g. 'd0412')."""
    return f"{letter}{RUN_TAG}"


# ---- golden files -------------------------------------------------------------------------------

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/<name>; LINKPASS_UPDATE_GOLDEN=1 rewrites it instead."""
    path = os.path.join(GOLDEN, name)
    if os.environ.get("LINKPASS_UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return
    assert os.path.exists(path), f"{path} is missing: run with LINKPASS_UPDATE_GOLDEN=1 once to write it"
    with open(path) as f:
        want = f.read()
    assert text == want, f"output differs from {path} (LINKPASS_UPDATE_GOLDEN=1 rewrites it if intended)"


# ---- ports and polling --------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port free on every address right now: on loopback, and on the management address
    the testbed's namespaces reach. Below the ephemeral range, as the demo picks the
    coordinator's: one the kernel hands out (bind to 0) can be taken by Ray's own outgoing
    connections before the actor that is given it binds it."""
    from linkpass.testbed.ports import free_port as lab_port

    return lab_port()


class LogDrain:
    """Reads a child's text pipe line by line in a thread for as long as the child runs, so the
    child never blocks on a full pipe; `lines` holds everything read, `wait_for` waits for a
    line containing a string."""

    def __init__(self, pipe):
        import threading
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: any(text in ln for ln in self.lines), timeout_s)

    def text(self, join_s: float = 5.0) -> str:
        self._thread.join(join_s)
        with self._cond:
            return "".join(self.lines)


def wait_until(pred, timeout_s: float, what: str, detail=None):
    """pred()'s first truthy value, polled every 20 ms; after timeout_s an AssertionError names
    `what` and, if given, detail()."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f": {detail()}" if detail else ""))


# ---- the testbed's routes -----------------------------------------------------------------------

A, B = 0, 2  # the failover tests' hosts: different leaves, so every link kind lies on some path between them


def routes_of(fab, host: int) -> dict[str, tuple[int, ...]]:
    """LinkPass's routes in a host's namespace: service address -> planes (by device)."""
    from pyroute2 import IPRoute

    from linkpass.agent.routes import RTPROT_LINKPASS

    with IPRoute(netns=fab.netns(f"h{host}")) as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        out = {}
        for r in ipr.get_routes(family=2, proto=RTPROT_LINKPASS):
            mp = r.get_attr("RTA_MULTIPATH")
            oifs = [h["oif"] for h in mp] if mp else [r.get_attr("RTA_OIF")]
            out[r.get_attr("RTA_DST")] = tuple(sorted(int(names[o][1:]) for o in oifs))
        return out


# ---- the coordinator's fabric and its agents' reports --------------------------------------------

FAB = make_fabric(preset("default"), "lpc", "198.19.250.0/24")  # 4 hosts, 2 planes, 2 leaves and 2 spines each
MODEL = from_testbed(FAB)


def bare(addr: str) -> str:
    return addr.split("/")[0]


def hops(src: int, dst: int, plane: int, spine: int) -> tuple[list[str], str]:
    """The routers a probe src -> dst crosses through `spine`, as discovery reports them: each
    hop is the address of the interface the probe came in on; and the peer's NIC address."""
    up = FAB.uplink(f"h{src}", plane)
    src_leaf, dst_leaf = FAB.leaf_of(src, plane), FAB.leaf_of(dst, plane)
    out = [bare(up.b_addr)]
    if src_leaf != dst_leaf:
        out.append(bare(FAB.links[f"{src_leaf}-p{plane}s{spine}"].b_addr))
        out.append(bare(FAB.links[f"{dst_leaf}-p{plane}s{spine}"].a_addr))
    return out, FAB.nic_addr(dst, plane)


def table_of(src: int) -> list[dict]:
    """Host h<src>'s path table as its agent registers it: every peer, plane and spine, all up."""
    rows, pid = [], 1
    for dst in range(4):
        if dst == src:
            continue
        for plane in range(2):
            same_leaf = FAB.leaf_of(src, plane) == FAB.leaf_of(dst, plane)
            for spine in range(1 if same_leaf else 2):  # a same-leaf peer has one path per plane
                h, addr = hops(src, dst, plane, spine)
                rows.append({"id": pid, "peer": f"h{dst}", "plane": plane, "sport": 49152 + pid, "hops": h,
                             "peer_addr": addr, "state": "up", "reason": None})
                pid += 1
    return rows


def identity(i: int) -> dict:
    return {"name": f"h{i}", "agent_id": i + 1, "service": FAB.service_addr(i),
            "nics": {str(p): FAB.nic_addr(i, p) for p in range(2)}, "version": "test"}


def agent_tokens(state_dir, hosts=range(4)) -> dict[str, str]:
    """Each host's own agent token, derived from the coordinator's agent secret in `state_dir`."""
    import os

    from linkpass.coordinator.auth import agent_token, read_agent_secret

    secret = read_agent_secret(os.path.join(str(state_dir), "agent.secret"))
    return {f"h{i}": agent_token(secret, f"h{i}") for i in hosts}


def fail_paths(c: Coordinator, now: float, crossing: set[str], reason="hard_failure", state="down") -> int:
    """Every agent reports its paths that cross any of these directed links as failed."""
    n = 0
    for i in range(4):
        changes = [{"id": int(k.split("/")[1]), "state": state, "reason": reason}
                   for k, rec in c.paths.items() if rec.reporter == f"h{i}" and set(rec.links) & crossing]
        n += len(changes)
        c.report({"name": f"h{i}", "changes": changes}, now)
    return n


# ---- a real coordinator over HTTPS --------------------------------------------------------------

def lab_ca_file(state_dir) -> str:
    """The CA certificate of the lab CA a coordinator made in its state dir on first start."""
    from linkpass.control.tls import lab_dir, lab_paths

    return lab_paths(lab_dir(str(state_dir)), "ca")[0]


def coordinator_on_testbed(fabric, state_dir: str, port: int) -> tuple[dict, dict]:
    """(settings, the agents' `coordinator:` section) of a coordinator for the testbed's agents:
    HTTPS with mutual TLS, the certificate naming the address the namespaced agents use, the
    fabric's model; each agent gets its own token derived from the agent secret."""
    settings = {"state_dir": state_dir, "listen": f"0.0.0.0:{port}", "fabric_model": from_testbed(fabric).to_dict(),
                "tls_san": [fabric.mgmt_root_addr], "require_client_cert": True}
    link = {"url": f"https://{fabric.mgmt_root_addr}:{port}", "report_ms": 100, "summary_s": 5,
            "agent_secret_file": os.path.join(state_dir, "agent.secret")}
    return settings, link


def coordinator_client(url: str, token: str | None, state_dir, client_cert: str | None = None, **kw):
    """A client of the coordinator at `url` that verifies it against its lab CA, as agents and the
    CLI do; `client_cert`: the name of a lab client certificate to show (mutual TLS)."""
    from linkpass.control.client import Client
    from linkpass.control.tls import build_client_context, lab_dir, lab_paths

    cert = lab_paths(lab_dir(str(state_dir)), client_cert) if client_cert else (None, None)
    return Client(url, token, tls=build_client_context(lab_ca_file(state_dir), *cert), **kw)


# ---- doctor: the facts of a host where every check passes ------------------------------------

NICS = (D.NicCfg(0, "p0", "198.18.64.1", "198.18.64.0"), D.NicCfg(1, "p1", "198.18.72.1", "198.18.72.0"))
PEERS = (D.PeerCfg("h1", "198.18.0.2"), D.PeerCfg("h2", "198.18.0.3"))
ALL_CAPS = (1 << D.CAP_NET_ADMIN) | (1 << D.CAP_NET_RAW) | (1 << D.CAP_SYS_NICE)
BASELINE = {"dst": "198.18.0.0/20", "protocol": "static", "flags": [],
            "nexthops": [{"gateway": "198.18.64.0", "dev": "p0", "flags": []},
                         {"gateway": "198.18.72.0", "dev": "p1", "flags": []}]}
DEFAULT_ROUTE = {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0", "flags": []}


def healthy() -> D.Facts:
    """A host where every check passes."""
    return D.Facts(
        netns=None,
        sysctl={"net.ipv4.fib_multipath_hash_policy": "1", "net.ipv4.conf.all.rp_filter": "0",
                "net.ipv4.conf.default.rp_filter": "0", "net.ipv4.conf.p0.rp_filter": "2",
                "net.ipv4.conf.p1.rp_filter": "0", "net.ipv4.icmp_errors_use_inbound_ifaddr": "1",
                "net.ipv4.ip_forward": "0", "net.ipv4.ip_local_port_range": "32768 49151",
                "net.ipv4.ip_local_reserved_ports": ""},
        cap_eff=ALL_CAPS, uid=0, config_path="/etc/linkpass/agent.yaml", nics=NICS, peers=PEERS,
        links={"p0": {"operstate": "UP", "flags": ["UP", "LOWER_UP"], "addrs": ["198.18.64.1/31"]},
               "p1": {"operstate": "UP", "flags": ["UP", "LOWER_UP"], "addrs": ["198.18.72.1/31"]}},
        neigh={"p0": {"198.18.64.0": ["REACHABLE"]}, "p1": {"198.18.72.0": ["PERMANENT"]}},
        peer_routes={"198.18.0.2": [DEFAULT_ROUTE, BASELINE], "198.18.0.3": [BASELINE]},
        rdma=[{"name": "mlx5_0", "ports": {"1": "4: ACTIVE"}, "netdevs": ["p0"]},
              {"name": "mlx5_1", "ports": {"1": "4: ACTIVE"}, "netdevs": ["p1"]}],
        clock={"state": 0, "status": 0x2001, "esterror_us": 12, "maxerror_us": 40},
        agent_rows=[{"peer": "h1", "plane": 0, "state": "up"}, {"peer": "h1", "plane": 1, "state": "up"}],
        coordinator_url="https://198.19.0.1:9470", coordinator_whoami={"name": "fleet-agents", "role": "agent"},
    )


# ---- probes the encoders refuse to build --------------------------------------------------------

def signed_probe(key: bytes, p, src: bytes, dst: bytes, sport: int, dport: int = 4791) -> bytes:
    """The UDP payload of probe `p` (a wire.Probe) with a valid tag and ICRC under `key`, built
    without the encoder's bounds: what a peer holding the key could send."""
    import hashlib

    from linkpass.core import wire as W

    bth = W._BTH.pack(W.BTH_OPCODE_RC_SEND_ONLY, 0, W.PKEY_DEFAULT, W.LINKPASS_QPN, p.seq & 0xFFFFFF)
    body = W._HDR.pack(W.MAGIC, W.VERSION, p.kind, p.flags, 0, p.pad, p.sender, p.reflector, p.path, p.rx_count,
                       p.seq, p.t1, p.t2, p.t3, p.t4) + bytes(p.pad)
    roce = bth + body + hashlib.blake2b(body, key=key, digest_size=W.TAG_LEN).digest()
    return roce + W.icrc(src, dst, sport, dport, roce)


# ---- the NCCL net plugin and its harness --------------------------------------------------------

NCCL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rdma", "nccl")
NCCL_PLUGIN = os.path.join(NCCL_DIR, "build", "libnccl-net-linkpass.so")
NCCL_HARNESS = os.path.join(NCCL_DIR, "build", "lp_harness")


def nccl_build() -> tuple[str, str]:
    """(plugin .so, harness) as `make deps` builds them; make is a no-op when they are up to date."""
    import subprocess

    subprocess.run(["make", "-s", "-C", NCCL_DIR], check=True, capture_output=True)
    return NCCL_PLUGIN, NCCL_HARNESS


def nccl_harness(*args: str, env: dict | None = None, timeout: float = 120, netns: str | None = None):
    """Run the harness on the plugin with LINKPASS_NICS on two loopback planes (127.0.0.1, .2) and no
    entropy table unless `env` says otherwise; returns the CompletedProcess (text)."""
    import subprocess

    plugin, harness = nccl_build()
    e = dict(os.environ)
    e.update({"LINKPASS_NICS": "127.0.0.1,127.0.0.2", "LINKPASS_ENTROPY_TABLE": "/nonexistent/linkpass-entropy"})
    e.update(env or {})
    cmd = [harness, "-l", plugin, *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)


def harness_fields(out: str, first: str) -> dict[str, str]:
    """key=value pairs of the harness's output line that starts with `first` (e.g. "transfer", "stats")."""
    for line in out.splitlines():
        if line.startswith(first + " "):
            return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    raise AssertionError(f"no {first!r} line in the harness output:\n{out}")


class HarnessRun:
    """A harness transfer in the background that runs until stop() (its -S file): wait_for(text)
    polls its log lines, so a test acts on what the plugin did, not on how long it took."""

    def __init__(self, stop_dir, *args: str, env: dict | None = None, netns: str | None = None):
        import subprocess
        import threading

        plugin, harness = nccl_build()
        self.stop_file = os.path.join(str(stop_dir), "stop-harness")
        e = dict(os.environ)
        e.update({"LINKPASS_NICS": "127.0.0.1,127.0.0.2", "LINKPASS_ENTROPY_TABLE": "/nonexistent/linkpass-entropy"})
        e.update(env or {})
        cmd = [harness, "-l", plugin, "transfer", "-n", "100000000", "-S", self.stop_file, "-T", "300", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")),
                                        daemon=True)
        self._reader.start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def wait_for(self, text: str, times: int = 1, timeout_s: float = 60) -> None:
        wait_until(lambda: self.count(text) >= times or self.proc.poll() is not None, timeout_s, repr(text))
        assert self.count(text) >= times, f"the harness ended before {text!r}:\n{self.log[-3000:]}"

    def stop(self, timeout_s: float = 120) -> tuple[int, str, str]:
        """Stop posting, let the posted messages finish; (exit code, stdout, log)."""
        with open(self.stop_file, "w"):
            pass
        try:
            out = self.proc.stdout.read()
            self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()
        self._reader.join(timeout=10)
        return self.proc.returncode, out, self.log

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def stop_processes(procs) -> None:
    """SIGTERM every process (agents: a clean stop), then wait; kill what has not exited in 20 s."""
    import subprocess

    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def four_agents_registered(db_path: str):
    """A Coordinator (no Ray, no sockets) on the shared model with h0..h3 registered at t=1000,
    and its Store, which the caller closes."""
    from linkpass.coordinator.coordinator import Coordinator, CoordinatorConfig
    from linkpass.coordinator.store import Store

    store = Store(db_path)
    c = Coordinator(store, MODEL, CoordinatorConfig(max_drain_share=0.05), wall_s=1000.0)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, 1000.0)
    return c, store


def send_json(handler, code: int, doc) -> None:
    """Answer a stub HTTP server's request (a BaseHTTPRequestHandler) with `doc` as JSON."""
    data = json.dumps(doc).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def untraced_observations(model, plan, truth, *, noisy=(), seed=0):
    """Per planned path: bad where its probes or its replies cross a directed link of `truth`,
    with the direction it breaks. Replies take a route of ECMP's choosing (not the probes'), and
    are not traced: the observation carries no reverse links, as the coordinator's do. Noisy
    agents call half their paths bad at random and their truly bad ones good half the time."""
    import random  # noqa: PLC0415

    from linkpass.core.localize import Observation  # noqa: PLC0415

    rng = random.Random(seed)
    out = []
    for host, paths in plan.paths.items():
        for n, p in enumerate(paths):
            fwd = model.node_path(host, p.peer, p.plane, p.spine, p.core)
            spines, cores = model.spines_per_pod(p.plane), model.cores_per_group(p.plane)
            rev = model.node_path(p.peer, host, p.plane, rng.randrange(spines) if spines else None,
                                  rng.randrange(cores) if cores else None)
            f, r = any(d in truth for d in fwd), any(d in truth for d in rev)
            bad, direction = f or r, ("both" if f and r else "forward" if f else "reverse" if r else None)
            if host in noisy:
                if bad and rng.random() < 0.5:
                    bad, direction = False, None
                elif not bad and rng.random() < 0.5:
                    bad, direction = True, rng.choice(("forward", "reverse", "both", None))
            out.append(Observation(host, f"{host}/{n}", fwd, None, bad, direction))
    return out


def role_token(settings, role):
    """The token the coordinator made for `role` (reader, operator) in its state directory."""
    with open(os.path.join(settings["state_dir"], f"{role}.token")) as f:
        return f.read().strip()


def wait_answering(client, timeout_s: float = 60.0) -> dict:
    """The coordinator's status, once its endpoint answers again (after a restart)."""
    from linkpass.control.client import Unreachable

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.get("/v1/status")
        except Unreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def ray_coordinator(directory, store: str, **settings):
    """The coordinator as Ray actors on a local Ray (the root and its shards with `shards`), with
    the helpers' fleet model and the given store ("sqlite", or "postgresql": a real server,
    started and removed here); yields (handle, url, settings). Stopped and Ray shut down after."""
    from linkpass.coordinator import ray_actor
    from pgserver import PostgresServer

    (directory / "fabric.json").write_text(json.dumps(MODEL.to_dict()))
    settings = {"state_dir": str(directory / "state"), "listen": f"127.0.0.1:{free_port()}",
                "fabric": str(directory / "fabric.json"), **settings}
    with contextlib.ExitStack() as stack:
        if store == "postgresql":
            pg = stack.enter_context(PostgresServer(tls=True))
            settings.update(pg.settings)
        ray_actor.connect(num_cpus=2)
        try:
            handle, url = ray_actor.ensure(settings)
            yield handle, url, settings
        finally:
            ray_actor.stop_all()
            ray_actor.shutdown()
