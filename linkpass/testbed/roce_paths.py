"""Which spine each RoCEv2 source port takes between two Soft-RoCE guests, read off the wire.

The fabric's leaves hash a packet's 5-tuple onto a spine, so a source port is a path. On guests
without a LinkPass agent there is no discovery to ask, so this asks the wire instead: one RC QP
per port (both directions steered to that port) while the two leaves' spine ports are captured,
and each port's packets are grouped by the spine port they left on. It also shows whether each
QP's packets carried exactly the port it was steered to.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from ..core.names import host_name
from .agents import GUEST_TABLE
from .capture import Capture
from .guests import Control
from .topology import Fabric

GUEST_ENV = {"PYTHONPATH": "/opt/linkpass/rdma:/opt/linkpass"}  # the project's source, shared read-only
ROCE_V2_DPORT = 4791
RC_PORT = 18515


@dataclass(frozen=True)
class PortPath:
    sport: int
    forward: tuple[str, ...]  # spine ports of a's leaf the QP's packets left on (one, if the hash holds)
    reverse: tuple[str, ...]  # same at b's leaf for the peer QP's packets
    reported: int  # the port the QP said its packets carry
    foreign: tuple[int, ...]  # other ports seen from these QPs' addresses (must be none)


def spine_ports(fab: Fabric, host: int, plane: int) -> tuple[str, list[str]]:
    """(leaf, its ports towards the spines) of a host's leaf in a plane."""
    leaf = fab.leaf_of(host, plane)
    return leaf, [fab.leaf_spine(leaf, s).a_if for s in range(fab.spec.spines_per_plane)]


def spine_of_if(ifname: str) -> int:
    return int(ifname.lstrip("s"))


def map_ports(fab: Fabric, a: int, b: int, ports: list[int], ctl_a: Control, ctl_b: Control,
              plane: int = 0) -> dict[int, PortPath]:
    """One steered RC QP pair per port between guests a and b (plane `plane`), captured."""
    addr_a, addr_b = fab.nic_addr(a, plane), fab.nic_addr(b, plane)
    ctl_b.spawn("rc-map", ["python3", "-m", "linkpass_rdma.qp", "serve", "--addr", addr_b, "--port", str(RC_PORT),
                           "--connections", str(len(ports))], env=GUEST_ENV)
    leaf_a, ups_a = spine_ports(fab, a, plane)
    leaf_b, ups_b = spine_ports(fab, b, plane)
    try:
        wait_until(lambda: '"listening"' in ctl_b.log("rc-map") or "Error" in ctl_b.log("rc-map"), 120,
              "the RC server listening", lambda: ctl_b.log("rc-map")[-500:])
        with Capture(fab.netns(leaf_a), ups_a, ROCE_V2_DPORT) as cap_a, \
                Capture(fab.netns(leaf_b), ups_b, ROCE_V2_DPORT) as cap_b:
            out = ctl_a.check(["python3", "-m", "linkpass_rdma.qp", "ping", "--addr", addr_a, "--server",
                               f"{addr_b}:{RC_PORT}", "--sport", ",".join(map(str, ports)), "--reverse-sport", "same",
                               "--count", "3"], timeout_s=60 + 15 * len(ports), env=GUEST_ENV)
    finally:
        ctl_b.kill("rc-map")
    reported = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if len(reported) != len(ports):
        raise RuntimeError(f"{host_name(a)} reported {len(reported)} of {len(ports)} QPs: {out[-500:]}")
    fwd = cap_a.by_flow(outgoing=True)
    rev = cap_b.by_flow(outgoing=True)
    result = {}
    for sport, rep in zip(ports, reported):
        f = tuple(sorted({k[0] for k in fwd if k[1] == addr_a and k[2] == addr_b and k[3] == sport}))
        r = tuple(sorted({k[0] for k in rev if k[1] == addr_b and k[2] == addr_a and k[3] == sport}))
        result[sport] = PortPath(sport, f, r, rep["sport"], ())
    seen = {k[3] for k in fwd if k[1] == addr_a and k[2] == addr_b} | {k[3] for k in rev if k[1] == addr_b}
    stray = tuple(sorted(seen - set(ports)))
    if stray:  # packets on a port nobody asked for: the steering is wrong somewhere
        result = {p: PortPath(pp.sport, pp.forward, pp.reverse, pp.reported, stray) for p, pp in result.items()}
    return result


ENTROPY_READER = "/opt/linkpass/rdma/nccl/build/entropy_reader"  # C: milliseconds where Python takes seconds


def healthy_ports(ctl: Control, peer_addr: str, plane: int = 0, table: str = GUEST_TABLE) -> list[int]:
    """The healthy ports a guest's entropy table lists for (peer, plane): [] when the entry is
    missing, fail-static, or the table cannot be read (yet)."""
    res = ctl.run([ENTROPY_READER, "-p", table])
    for line in res.stdout.splitlines() if res.rc == 0 else []:
        f = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
        if line.startswith("entry ") and f.get("peer") == peer_addr and f.get("plane") == str(plane):
            return [int(p) for p in f["ports"].split(",") if p] if int(f["flags"], 16) == 0 else []
    return []


CHANNEL_PORT = 18520


@dataclass
class ChannelRun:
    """One stream over a `linkpass_rdma.channel` between two guests, with a link cut under it."""

    result: dict  # the stream's own report (moves, events, longest gap; guest time)
    served: dict  # the server's (messages delivered once each)
    packets: list  # A's leaf's captured RoCE packets (towards the spines) while it ran


def wait_until(pred, timeout_s: float, what: str, detail=lambda: "", poll_s: float = 0.1) -> None:
    """Poll pred() every poll_s until it is true; RuntimeError naming `what` (and detail()) after
    timeout_s. A pred that runs a command in a guest wants a poll_s of seconds: each costs the
    guest's one emulated CPU a process."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout_s:.0f} s: {detail()}")
        time.sleep(poll_s)


def channel_under_fault(fab: Fabric, a: int, b: int, ctl_a: Control, ctl_b: Control, ports: list[int], cut,
                        count: int = 300, timeout: int | None = None, retry: int | None = None,
                        lead_s: float = 1.0, limit_s: float = 180.0, deadline_s: float = 120.0,
                        table: str | None = None) -> ChannelRun:
    """Stream `count` messages from a to b over a channel on `ports` (first = active); `lead_s`
    after it is up, take link `cut` down (or apply `cut`, a faults.FaultSpec); wait for the stream
    to finish; clear the fault. With `table` (the guest's entropy table, written by its agent) the
    channel follows it, `ports` being only the fallback."""
    from . import faults
    from .faults import FaultSpec

    addr_a, addr_b = fab.nic_addr(a, 0), fab.nic_addr(b, 0)
    leaf_a, ups_a = spine_ports(fab, a, 0)
    knobs = (["--timeout", str(timeout)] if timeout is not None else []) + \
            (["--retry", str(retry)] if retry is not None else []) + ["--deadline", str(deadline_s)] + \
            (["--table", table, "--peer", addr_b, "--plane", "0"] if table else [])
    ctl_b.spawn("ch-serve", ["python3", "-m", "linkpass_rdma.channel", "serve", "--addr", addr_b,
                             "--port", str(CHANNEL_PORT)], env=GUEST_ENV)
    wait_until(lambda: '"listening"' in ctl_b.log("ch-serve") or "Error" in ctl_b.log("ch-serve"), 120,
          "the channel server listening", lambda: ctl_b.log("ch-serve")[-500:])
    ctl_a.spawn("ch-stream", ["python3", "-m", "linkpass_rdma.channel", "stream", "--addr", addr_a, "--server",
                              f"{fab.mgmt_addr(b)}:{CHANNEL_PORT}", "--ports", ",".join(map(str, ports)),
                              "--count", str(count), *knobs], env=GUEST_ENV)
    log = lambda: ctl_a.log("ch-stream")  # noqa: E731
    try:
        wait_until(lambda: '"up"' in log() or "Error" in log(), 120, "the channel coming up", lambda: log()[-500:])
        with Capture(fab.netns(leaf_a), ups_a, ROCE_V2_DPORT) as cap:
            time.sleep(lead_s)
            faults.apply(fab.prefix, cut if isinstance(cut, FaultSpec) else FaultSpec("down", cut))
            wait_until(lambda: '"count"' in log() or "Error" in log(), limit_s, "the stream finishing",
                  lambda: log()[-800:])
    finally:
        faults.clear(fab.prefix)
        ctl_a.kill("ch-stream")
        ctl_b.kill("ch-serve")
    done = [ln for ln in log().splitlines() if ln.startswith('{"count"')]
    if not done:
        raise RuntimeError(f"the stream failed: {log()[-800:]}")
    served = [ln for ln in ctl_b.log("ch-serve").splitlines() if ln.startswith('{"delivered"')]
    return ChannelRun(json.loads(done[-1]), json.loads(served[-1]) if served else {},
                      [p for p in cap.packets if p.outgoing and p.src == addr_a and p.dst == addr_b])


# ---- unmodified verbs programs under the steering shim (rdma/steer/) -------------------------------

STEER_SHIM = "/opt/linkpass/rdma/nccl/build/liblinkpass-steer.so"
WRITE_BW_PORT = 18600
RC_OPCODES = range(0x00, 0x20)  # the BTH opcodes of reliable-connected traffic (a UD probe is 0x64)


@dataclass(frozen=True)
class QpPath:
    """One RC QP's traffic as the wire saw it: the destination QP its packets named, the source
    ports they carried and the spine ports of the sender's leaf they left on."""

    dst_qpn: int
    sports: tuple[int, ...]
    spines: tuple[str, ...]
    packets: int


@dataclass
class WriteBwRun:
    rc: tuple[int, int]  # server's (-1: still running 30 s after the client), client's
    output: str  # the ends of the client's output and stderr, then of the server's
    steer_log: str  # both sides' shim lines (empty without the shim)
    forward: dict[int, QpPath]  # a -> b, by b's QP number
    reverse: dict[int, QpPath]  # b -> a, by a's QP number


def qp_paths(packets, src: str, dst: str) -> dict[int, QpPath]:
    """Per destination QP, the RC packets from src to dst that a leaf sent towards the spines."""
    by_qp: dict[int, list] = {}
    for p in packets:
        if p.outgoing and p.src == src and p.dst == dst and p.qpn is not None and p.opcode in RC_OPCODES:
            by_qp.setdefault(p.qpn, []).append(p)
    return {q: QpPath(q, tuple(sorted({p.sport for p in ps})), tuple(sorted({p.ifname for p in ps})), len(ps))
            for q, ps in sorted(by_qp.items())}


def rdma_device(ctl: Control, addr: str) -> tuple[str, str]:
    """(RDMA device, RoCE v2 GID index) of the guest NIC that has `addr`, as a verbs program's
    -d and -x/-g options take them."""
    name, gid_index = ctl.check(["python3", "-c", "import sys; from linkpass.kernel.rdma import Device; "
                                 "d = Device.for_address(sys.argv[1]); print(d.name, d.gid_index)", addr],
                                env=GUEST_ENV).split()
    return name, gid_index


def steer_env(table: str = GUEST_TABLE) -> dict[str, str]:
    """A guest program's environment with the steering shim preloaded, following `table`, its
    lines on stderr."""
    return {"LD_PRELOAD": STEER_SHIM, "LINKPASS_ENTROPY_TABLE": table, "LINKPASS_STEER_LOG": "stderr"}


def wait_listening(ctl: Control, port: int, what: str, detail=lambda: "", timeout_s: float = 60.0) -> None:
    """Until a TCP socket in the guest listens on `port` (a program that prints only when its
    output is flushed says nothing sooner)."""
    wait_until(lambda: ctl.run(["ss", "-Hltn", f"sport = :{port}"]).stdout.strip() != "", timeout_s,
               f"{what} listening on TCP port {port}", detail, poll_s=1.0)


def write_bw(fab: Fabric, a: int, b: int, ctl_a: Control, ctl_b: Control, qps: int, shim: bool, tag: str,
             table: str = GUEST_TABLE, iters: int = 200, size: int = 4096, plane: int = 0) -> WriteBwRun:
    """perftest's ib_write_bw from guest a to guest b with `qps` queue pairs on plane `plane`,
    both sides preloaded with the steering shim or not, while both leaves' spine ports are
    captured."""
    addr_a, addr_b = fab.nic_addr(a, plane), fab.nic_addr(b, plane)
    gid = {a: rdma_device(ctl_a, addr_a), b: rdma_device(ctl_b, addr_b)}
    env = steer_env(table) if shim else {}
    # -u 20: an ACK timeout of 4 s (perftest's default, 67 ms, is shorter than an emulated guest's
    # stalls beside an agent: the QPs would error out on a healthy path)
    common = ["-q", str(qps), "-s", str(size), "-n", str(iters), "-p", str(WRITE_BW_PORT), "-F", "-u", "20"]
    name = f"wbw-{tag}"
    ctl_b.spawn(name, ["ib_write_bw", "-d", gid[b][0], "-x", gid[b][1], *common], env=env)
    leaf_a, ups_a = spine_ports(fab, a, plane)
    leaf_b, ups_b = spine_ports(fab, b, plane)
    try:
        wait_listening(ctl_b, WRITE_BW_PORT, "ib_write_bw's server", lambda: ctl_b.log(name)[-500:])
        with Capture(fab.netns(leaf_a), ups_a, ROCE_V2_DPORT, limit=1_000_000) as cap_a, \
                Capture(fab.netns(leaf_b), ups_b, ROCE_V2_DPORT, limit=1_000_000) as cap_b:
            # the QPs' addresses travel over TCP to the management address: a fabric fault must not
            # cut the exchange that precedes the RDMA traffic under test
            res = ctl_a.run(["ib_write_bw", "-d", gid[a][0], "-x", gid[a][1], *common, fab.mgmt_addr(b)],
                            timeout_s=240, env=env)
        rc_b = None
        deadline = time.monotonic() + 30
        while rc_b is None and time.monotonic() < deadline:  # signal 0: its exit code, None while it runs
            rc_b = ctl_b.kill(name, 0)
            time.sleep(0.5 if rc_b is None else 0)
    finally:
        ctl_b.kill(name)
    server = ctl_b.log(name)
    # the shim's lines, also where one landed in the middle of a line of the program's buffered stdout
    steer = "\n".join(re.findall(r"linkpass-steer\[\d+\]: [^\n]*", res.stderr + "\n" + server))
    return WriteBwRun((-1 if rc_b is None else rc_b, res.rc),
                      f"{res.stdout[-1500:]}\n--- its stderr ---\n{res.stderr[-1500:]}\n--- server ---\n{server[-1500:]}",
                      steer,
                      qp_paths(cap_a.packets, addr_a, addr_b), qp_paths(cap_b.packets, addr_b, addr_a))
