"""The NCCL plugin's ring all-reduce between two Soft-RoCE guests, with a fault under it.

`rdma/nccl/build/lp_allreduce` (a ring on nothing but the plugin's API, every byte checked) runs
in each guest, rank 0 in `a` and rank 1 in `b`, over the plugin's verbs lanes: RC queue pairs on
the guests' rxe devices whose RoCEv2 packets cross the fabric's leaves and spines. The two ranks
meet through files, and the guests share no directory, so this host copies each rank's listen
handles from its share into the other's. While the ring runs, a's leaves' spine ports are
captured in every plane (each RoCEv2 packet's source port and destination QP), then a fault is
applied, held, cleared, and the ring is told to stop.

The parsing below is pure: the plugin's lane lines, the ring's steps, and the wire's data packets
by path are what tests and the RDMA benchmark judge a run by.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ..core.names import host_name
from .capture import ROCE_V2_DPORT, Capture, UdpPacket
from .faults import FaultSpec
from .guests import Control, guest_dir
from .roce_paths import spine_of_if, spine_ports, wait_until
from .topology import Fabric, nic_ifname

PLUGIN = "/opt/linkpass/rdma/nccl/build/libnccl-net-linkpass.so"  # the source tree, shared read-only
ALLREDUCE = "/opt/linkpass/rdma/nccl/build/lp_allreduce"
DATA_BYTES = 200  # an RC packet with more IP bytes than this carries a chunk, not a control frame

# Under TCG a round trip takes 10-100 ms and stalls of hundreds of ms are ordinary: the lanes'
# own stuck bound is raised accordingly (the entropy table still moves them at once).
GUEST_PLUGIN_ENV = {"LINKPASS_TRANSPORT": "verbs", "LINKPASS_LANES": "2", "LINKPASS_STANDBY_LANES": "1",
                    "LINKPASS_CHUNK_KB": "64", "LINKPASS_STUCK_MS": "1000", "LINKPASS_QP_TIMEOUT": "14",
                    "LINKPASS_QP_RETRY": "7", "LINKPASS_GIVEUP_MS": "120000"}

LANE_LINE = re.compile(r"^\[(?P<t>[0-9.]+)\] NCCL INFO NET/LinkPass : lane (?P<plane>\d+)\.(?P<lane>\d+) "
                       r"\(QP (?P<qpn>\d+), RoCE source port (?P<sport>\d+)\) to (?P<peer>[0-9.]+) on plane \d+ "
                       r"(?P<what>is up|is back|down|is re-made)(?:: | \()(?P<why>.*)$")


@dataclass(frozen=True)
class LaneEvent:
    t: float  # the guest's CLOCK_MONOTONIC seconds
    plane: int
    lane: int
    qpn: int
    sport: int
    peer: str
    what: str  # "is up", "is back", "down", "is re-made"
    why: str


def lane_events(log: str) -> list[LaneEvent]:
    """The plugin's lane lines in a rank's log, in order."""
    out = []
    for line in log.splitlines():
        m = LANE_LINE.match(line.strip())
        if m:
            out.append(LaneEvent(float(m["t"]), int(m["plane"]), int(m["lane"]), int(m["qpn"]), int(m["sport"]),
                                 m["peer"], m["what"], m["why"].rstrip(")")))
    return out


def move_cause(ev: LaneEvent) -> str:
    """Which detector took a lane down: "table" (the agent's entropy table: its port left the healthy
    set, or its plane was marked), "stuck" (the lane's own progress bound), "qp-error" (a failed
    completion after the QP's own timeout), or "other" (the socket closed, a handshake timed out)."""
    if "entropy table" in ev.why:
        return "table"
    if ev.why.startswith("stuck"):
        return "stuck"
    if ev.why.startswith("QP "):
        return "qp-error"
    return "other"


def summary_of(log: str) -> dict | None:
    """A rank's last line, '# rank R: errors E wrong W iterations I k=v ...', as a dict."""
    for line in reversed(log.splitlines()):
        m = re.match(r"^# rank (\d+): errors (\d+) wrong (\d+) iterations (\d+)(.*)$", line.strip())
        if m:
            out = {"rank": int(m[1]), "errors": int(m[2]), "wrong": int(m[3]), "iterations": int(m[4])}
            for kv in m[5].split():
                k, _, v = kv.partition("=")
                out[k] = int(v) if v.isdigit() else v
            return out
    return None


def longest_gap_ms(steps: list[dict], skip: int = 0) -> float:
    """The longest time between two consecutive steps' ends (the ring stalled), after `skip` steps."""
    ends = [s["end_ns"] for s in steps if "step" in s][skip:]
    return max((b - a for a, b in zip(ends, ends[1:])), default=0) / 1e6


RC_OPCODES = range(0x00, 0x20)  # reliable connected; the agents' probes are UD SENDs (0x64)


def data_paths(packets: list[UdpPacket], src: str, dst: str, t0: float, t1: float) -> Counter:
    """Chunk-carrying RC packets from src to dst between host times t0 and t1, per (spine port,
    source port, destination QP): which queue pairs carried data, on which path."""
    return Counter((p.ifname, p.sport, p.qpn) for p in packets
                   if p.src == src and p.dst == dst and p.length > DATA_BYTES and p.opcode in RC_OPCODES
                   and t0 <= p.t < t1)


def busiest_port(packets: list[UdpPacket], src: str, dst: str) -> str | None:
    """The spine port that carried the most chunks from src to dst: where a fault hurts the ring."""
    per = Counter()
    for (ifname, _, _), n in data_paths(packets, src, dst, 0.0, float("inf")).items():
        per[ifname] += n
    return per.most_common(1)[0][0] if per else None


def data_qps(paths: Counter, ifname: str | None = None) -> set[int]:
    """The destination QPs in data_paths() (on one spine port, if given)."""
    return {q for (i, _, q) in paths if ifname is None or i == ifname}


FAULT_KINDS = ("uplink-cut", "spine-link-down", "loss-30pct-one-way")


def fault_of(fab: Fabric, host: int, kind: str, plane: int, spine: int = 0) -> FaultSpec:
    """A fault of `kind` at `host`: its plane-`plane` uplink cut, or the link from its plane-`plane`
    leaf to spine `spine` down, or 30 % loss leaving that leaf towards the spine."""
    if kind == "uplink-cut":
        return FaultSpec("down", fab.uplink(host_name(host), plane).name)
    leaf, _ = spine_ports(fab, host, plane)
    link = fab.leaf_spine(leaf, spine).name
    return FaultSpec("down", link) if kind == "spine-link-down" else FaultSpec("loss", link, leaf, {"pct": 30.0})


class AimedFault:
    """The fault of `kind` aimed at what the ring between a and b uses, for ring_under_fault: a's
    plane-1 uplink, or the link from a's plane-0 leaf to the spine its chunks to b crossed most
    before the fault. `plane` is the plane it breaks; `victim` the leaf port it hit (None for the
    uplink); `seen` whether the wire showed chunks to aim at (else spine 0 was taken)."""

    def __init__(self, fab: Fabric, a: int, b: int, kind: str):
        self.fab, self.a, self.b, self.kind = fab, a, b, kind
        self.plane = 1 if kind == "uplink-cut" else 0
        self.victim: str | None = None
        self.seen = False

    def __call__(self, packets: list[UdpPacket]) -> FaultSpec:
        if self.kind == "uplink-cut":
            return fault_of(self.fab, self.a, self.kind, self.plane)
        _, ports = spine_ports(self.fab, self.a, self.plane)
        port = busiest_port(packets, self.fab.nic_addr(self.a, self.plane), self.fab.nic_addr(self.b, self.plane))
        self.seen = port is not None
        self.victim = port or ports[0]
        return fault_of(self.fab, self.a, self.kind, self.plane, spine_of_if(self.victim))


@dataclass(frozen=True)
class WireVerdict:
    moved: bool  # late in the fault, no chunk crossed the broken path and a QP that had carried none did
    back: bool   # once healed, chunks crossed the broken path again
    detail: str


def wire_verdict(run: "RingRun", addrs: dict, plane: int, victim: str | None) -> WireVerdict:
    """What a's leaves saw of a fault on `plane` (addrs[p] = (a's address, b's address) on plane p):
    with `victim` (a's leaf's spine port on a broken leaf-spine link) the path is that port, else
    the whole plane (its uplink) and the chunks must move to another plane. "Late" is the second
    half of the fault, when the agents have judged the path."""
    t0, t1 = run.phases["fault"]
    late = (t0 + (t1 - t0) / 2, t1)
    src, dst = addrs[plane]
    before = data_paths(run.packets, src, dst, *run.phases["before"])
    during = data_paths(run.packets, src, dst, *late)
    after = data_paths(run.packets, src, dst, *run.phases["after"])
    if victim is None:
        other = next(p for p in addrs if p != plane)
        new = data_qps(data_paths(run.packets, *addrs[other], *late)) - \
            data_qps(data_paths(run.packets, *addrs[other], *run.phases["before"]))
        moved = bool(before) and not during and bool(new)
        back = bool(after)
    else:
        new = data_qps(during) - data_qps(before)
        moved = bool(data_qps(before, victim)) and not data_qps(during, victim) and bool(new)
        back = bool(data_qps(after, victim))
    detail = f"before {dict(before)}; late in the fault {dict(during)} (new QPs {sorted(new)}); after {dict(after)}"
    return WireVerdict(moved, back, detail)


@dataclass
class RingRun:
    rc: list  # each rank's exit code (None: did not finish)
    summary: list  # each rank's summary_of(), or None
    steps: list  # each rank's trace records
    log: list  # each rank's output
    packets: list  # RoCE packets from a on a's leaves' spine ports (every plane), with host times
    phases: dict = field(default_factory=dict)  # "before", "fault", "healing", "after": (t0, t1), host monotonic

    def lanes(self, rank: int = 0) -> list[LaneEvent]:
        return lane_events(self.log[rank])


def _relay(dirs: dict, stop: threading.Event) -> None:
    """Copy every rank's handle files into the other guest's ring directory, atomically."""
    while not stop.is_set():
        for src, dst in ((0, 1), (1, 0)):
            try:
                names = os.listdir(dirs[src])
            except FileNotFoundError:
                continue
            for name in names:
                target = os.path.join(dirs[dst], name)
                if name.startswith("handle.") and not os.path.exists(target):
                    tmp = os.path.join(dirs[dst], "." + name + ".relay")
                    shutil.copyfile(os.path.join(dirs[src], name), tmp)
                    os.rename(tmp, target)
        stop.wait(0.05)


def _read_trace(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out


def ring_under_fault(fab: Fabric, a: int, b: int, ctl_a: Control, ctl_b: Control, fault=None, lead_s: float = 5.0,
                     hold_s: float = 20.0, healed=None, heal_timeout_s: float = 120.0, healing=lambda: "",
                     after_s: float = 10.0,
                     size: str = "256K", warm_steps: int = 20, compute_ms: float = 20.0, env: dict | None = None,
                     tag: str = "ring") -> RingRun:
    """Run the ring between guests a and b; after `warm_steps` steps and `lead_s` ("before"), apply
    `fault` (a faults.FaultSpec, a function of the packets captured so far that returns one, or
    None for a fault-free run) for `hold_s` ("fault"), clear it,
    wait until `healed()` is true (e.g. the agents use the path again; "healing", at most
    `heal_timeout_s`; `healing()` says what the agents saw if it never is), run `after_s` more
    ("after"), stop the ring and collect everything. The fault is cleared whatever happens.
    `compute_ms` between iterations stands for a training step's compute; under emulation it also
    leaves the guest's one CPU to the agent, whose probes must not be starved into false verdicts."""
    from . import faults

    ctls = (ctl_a, ctl_b)
    hosts = (a, b)
    dirs = {r: os.path.join(guest_dir(fab.prefix, h), "lp", tag) for r, h in enumerate(hosts)}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    stop = threading.Event()
    relay = threading.Thread(target=_relay, args=(dirs, stop), daemon=True, name="ring-relay")
    relay.start()
    plugin_env = {"LINKPASS_NICS": ",".join(nic_ifname(p) for p in range(fab.spec.planes)), **GUEST_PLUGIN_ENV,
                  **(env or {})}
    name = f"{tag}-rank"
    phases: dict = {}
    captures = []
    try:
        for r, (h, ctl) in enumerate(zip(hosts, ctls)):
            ctl.spawn(name, [ALLREDUCE, "--plugin", PLUGIN, "--rank", str(r), "--nranks", "2", "--dir", f"/lp/{tag}",
                             "--sizes", size, "--stop-file", f"/lp/{tag}/stop", "--trace", f"/lp/{tag}/trace",
                             "--timeout-ms", "120000", "--compute-ms", f"{compute_ms:g}"], env=plugin_env)
        wait_until(lambda: len(_read_trace(os.path.join(dirs[0], "trace"))) >= warm_steps or
              any(ctl.kill(name, 0) is not None for ctl in ctls), 180, f"{warm_steps} steps of the ring",
              lambda: ctl_a.log(name)[-1500:] + ctl_b.log(name)[-800:])
        for p in range(fab.spec.planes):
            leaf = fab.leaf_of(a, p)
            ifs = [fab.leaf_spine(leaf, s).a_if for s in range(fab.spec.spines_per_plane)]
            captures.append(Capture(fab.netns(leaf), ifs, ROCE_V2_DPORT, limit=1_000_000,
                                    sources={fab.nic_addr(a, q) for q in range(fab.spec.planes)}).start())
        t = time.monotonic()
        time.sleep(lead_s)
        phases["before"] = (t, time.monotonic())
        if callable(fault):  # aimed at what the ring uses: chosen from the wire so far
            fault = fault([p for cap in captures for p in list(cap.packets)])
        if fault is not None:
            faults.apply(fab.prefix, fault)
        t = time.monotonic()
        time.sleep(hold_s)
        phases["fault"] = (t, time.monotonic())
    finally:
        faults.clear(fab.prefix)
    try:
        t = time.monotonic()
        if healed is not None:
            wait_until(healed, heal_timeout_s, "the fabric healing", healing, poll_s=2.0)
        phases["healing"] = (t, time.monotonic())
        t = time.monotonic()
        time.sleep(after_s)
        phases["after"] = (t, time.monotonic())
        open(os.path.join(dirs[0], "stop"), "w").close()
        wait_until(lambda: all(ctl.kill(name, 0) is not None for ctl in ctls), 120, "the ring stopping",
              lambda: ctl_a.log(name)[-800:])
    finally:
        stop.set()
        for cap in captures:
            cap.stop()
        for ctl in ctls:
            if ctl.kill(name, 0) is None:
                ctl.kill(name, 9)
    logs = [ctl.log(name) for ctl in ctls]
    return RingRun(rc=[ctl.kill(name, 0) for ctl in ctls], summary=[summary_of(lg) for lg in logs],
                   steps=[_read_trace(os.path.join(dirs[r], "trace")) for r in (0, 1)], log=logs,
                   packets=[p for cap in captures for p in cap.packets], phases=phases)


def describe(run: RingRun) -> str:
    """A few lines for an assertion message."""
    return (f"rc={run.rc} summary={run.summary} phases={run.phases}\n" +
            "\n".join(f"{e.t:.3f} lane {e.plane}.{e.lane} QP {e.qpn} port {e.sport} {e.what}: {e.why}"
                      for e in run.lanes(0)[-12:]) + "\n" +
            "\n".join(f"rank {r}'s log ends ({len(lg)} bytes):\n{lg[-600:]}" for r, lg in enumerate(run.log)))

