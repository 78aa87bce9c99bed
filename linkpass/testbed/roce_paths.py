"""Which spine each RoCEv2 source port takes between two Soft-RoCE guests, read off the wire.

The fabric's leaves hash a packet's 5-tuple onto a spine, so a source port is a path. On guests
without a LinkPass agent there is no discovery to ask, so this asks the wire instead: one RC QP
per port (both directions steered to that port) while the two leaves' spine ports are captured,
and each port's packets are grouped by the spine port they left on. It also shows whether each
QP's packets carried exactly the port it was steered to.
"""
from __future__ import annotations

import json
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
