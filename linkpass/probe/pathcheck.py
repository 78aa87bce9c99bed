"""Path checks from one host to one peer: every ECMP path (`probe`) or the path of one flow
(`trace`), on each plane, run once and answered as a JSON-ready document. This module is the
check itself (the sweep, its timing and its documents); the agent's API and the testbed run it.

Both run the agent's own Paris-style discovery (discovery.py) from the host's NIC on each plane
towards the peer's address there, UDP destination port 4791 by default (RoCEv2's, so the
probes hash like RDMA traffic), then time each path that reached the peer to the peer's ICMP
port unreachable (`measure_rtt`; software timestamps, tens of microseconds of noise).

Who runs them:

- the local agent, for `linkpass probe DST` on any host (its API's /v1/probe and /v1/trace:
  linkpass/agent/pathcheck_routes.py). It joins in what its own authenticated probes see on the same
  paths (`Live`): a peer running an agent listens on 4791 and answers no stray datagram, so
  the sweep ends silent after the peer's leaf while the agent's probes over that very path are
  answered;
- the CLI itself inside a testbed host's namespace (`linkpass probe SRC DST`,
  linkpass/testbed/pathcheck_hosts.py), which names every router and link (`Namer`).

On a real fabric hops are router interface addresses (what the routers' ICMP names).
"""
from __future__ import annotations

import select
import socket
import statistics
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

from ..core.paths import PathTable
from ..core.states import DARK, Level, State
from .discovery import IP_RECVERR, MSG_ERRQUEUE, SO_BINDTODEVICE, DiscoveryConfig, Target, discover

PROBE_BASE_PORT = 31000  # below Linux's ephemeral range and the agent's own probe ports (49152+)
PROBE_PORTS = 32
MAX_PORTS = 1024
RTT_SAMPLES = 3
RTT_TIMEOUT_S = 0.3
_EE = struct.Struct("=IBBBBII")  # struct sock_extended_err


@dataclass(frozen=True)
class Leg:
    """One plane of a check: from this host's NIC `ifname` (address `src`) to the peer's `dst`."""

    plane: int
    ifname: str
    src: str
    dst: str


class Namer:
    """Names for what a sweep found. This one knows no names: hops are router addresses."""

    def hop(self, addr: str) -> tuple[str | None, str | None]:
        """(router, link) of the interface `addr`, whose router answered the probe."""
        return None, None

    def dst_link(self, plane: int) -> str | None:
        """DST's own uplink on `plane`, the last link of a path that reached it."""
        return None

    def dst_leaf(self, plane: int) -> str | None:
        """The router DST hangs off on `plane`."""
        return None


@dataclass(frozen=True)
class LivePath:
    """What the agent's own probes see on one of its paths to DST."""

    sport: int
    hops: tuple
    state: str | None
    rtt_ms: float | None
    loss_pct: float | None


@dataclass
class Live:
    """The agent's probed paths to DST, by plane (empty when no agent joins in)."""

    paths: dict[int, list[LivePath]] = field(default_factory=dict)

    def on(self, plane: int, hops: tuple | None = None, sport: int | None = None) -> list[LivePath]:
        """The agent's paths on `plane` with exactly these hops, or with this source port."""
        return [lp for lp in self.paths.get(plane, ())
                if (hops is None or lp.hops == hops) and (sport is None or lp.sport == sport)]


ANSWERING = tuple(s.value for s in State if s not in DARK)  # the agent's probes get replies over it


# ---- documents (pure, given the sweep's results) -----------------------------------------------

def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def describe_hops(hops, namer: Namer) -> list[dict]:
    out = []
    for ttl, addr in enumerate(hops, start=1):
        node, link = namer.hop(addr) if addr else (None, None)
        out.append({"ttl": ttl, "addr": addr, "node": node, "link": link})
    return out


def route_text(hops: list[dict], end: str, dst: str) -> str:
    parts = [h["node"] or h["addr"] or "*" for h in hops]
    if end == "reached":
        parts.append(dst)
    elif end == "unreachable":
        parts[-1:] = [f"{parts[-1] if parts else '?'} ✗ no route"]
    else:
        parts.append("✗")
    return " > ".join(parts)


def _links(hops: list[dict], reached: bool, namer: Namer, plane: int) -> list[str]:
    """Link names the flow crossed, in order (DST's uplink last when DST answered)."""
    out = [h["link"] for h in hops if h["link"]]
    last = namer.dst_link(plane) if reached else None
    return out + [last] if last else out


def _dst_silent(hops: list[dict], end: str, namer: Namer, plane: int) -> bool:
    """Lost right after DST's own leaf: the network delivered, DST did not answer (an agent on dport?)."""
    last = next((h for h in reversed(hops) if h["addr"]), None)
    leaf = namer.dst_leaf(plane)
    return end == "lost" and last is not None and last is hops[-1] and leaf is not None and last["node"] == leaf


def _live_doc(paths: list[LivePath]) -> dict | None:
    """The agent's view of one swept path: its probed ports there, their states, RTT and loss."""
    if not paths:
        return None
    rtts = [lp.rtt_ms for lp in paths if lp.rtt_ms is not None]
    losses = [lp.loss_pct for lp in paths if lp.loss_pct is not None]
    return {"ports": sorted(lp.sport for lp in paths), "states": sorted({lp.state or "unknown" for lp in paths}),
            "answering": any(lp.state in ANSWERING for lp in paths),
            "rtt_ms": round(statistics.median(rtts), 3) if rtts else None,
            "loss_pct": round(max(losses), 3) if losses else None}


def _path_doc(path, plane: int, dst: str, namer: Namer, samples: list[float], live: list[LivePath]) -> dict:
    hops = describe_hops(path.hops, namer)
    agent = _live_doc(live)
    reached_by = "icmp" if path.reached else "agent" if agent and agent["answering"] else None
    return {"id": path.id, "end": path.end, "reached": reached_by is not None, "reached_by": reached_by,
            "ports": list(path.ports), "seen": path.seen, "hops": hops, "route": route_text(hops, path.end, dst),
            "links": _links(hops, path.reached, namer, plane),
            "dst_silent": _dst_silent(hops, path.end, namer, plane) and reached_by is None,
            "rtt_ms": _median(samples) if samples else agent["rtt_ms"] if agent else None,
            "rtt_samples_ms": [round(x, 3) for x in samples], "agent": agent}


def probe_doc(src: str, dst: str, where: dict, table: PathTable, legs: list[Leg], ports: tuple[int, ...], dport: int,
              rtts: dict[tuple[int, str], list[float]], namer: Namer | None = None, live: Live | None = None) -> dict:
    """What `probe` prints: every distinct path on every leg. `where` says who ran the sweep
    ({"testbed": prefix} or {"agent": name})."""
    namer, live = namer or Namer(), live or Live()
    out_planes = []
    for leg in legs:
        entry = table.get(leg.dst, leg.ifname)
        paths = [_path_doc(path, leg.plane, dst, namer, rtts.get((leg.plane, path.id), []),
                           live.on(leg.plane, hops=tuple(path.hops)))
                 for path in (entry.paths.values() if entry else [])]
        out_planes.append({"plane": leg.plane, "src_addr": leg.src, "dst_addr": leg.dst,
                           "reached": any(x["reached"] for x in paths), "swept": len(entry.ports) if entry else 0,
                           "paths": paths})
    n_paths = sum(len(x["paths"]) for x in out_planes)
    return {**where, "src": src, "dst": dst, "dport": dport,
            "ports": f"{min(ports)}-{max(ports)}" if len(ports) > 1 else str(ports[0]),
            "planes": out_planes,
            "summary": {"planes": len(out_planes), "planes_reached": sum(x["reached"] for x in out_planes),
                        "paths": n_paths,
                        "paths_reached": sum(y["reached"] for x in out_planes for y in x["paths"])},
            "stats": dict(table.stats)}


def trace_doc(src: str, dst: str, where: dict, table: PathTable, legs: list[Leg], sport: int, dport: int,
              rtts: dict[tuple[int, str], list[float]], namer: Namer | None = None, live: Live | None = None) -> dict:
    """What `trace` prints: the path of one 5-tuple on each leg."""
    namer, live = namer or Namer(), live or Live()
    rows = []
    for leg in legs:
        entry = table.get(leg.dst, leg.ifname)
        path = entry.path_of(sport) if entry else None
        flow = {"proto": "udp", "src": leg.src, "sport": sport, "dst": leg.dst, "dport": dport}
        if path is None:
            rows.append({"plane": leg.plane, "flow": flow, "path_id": None, "end": "not probed", "reached": False,
                         "reached_by": None, "hops": [], "route": "-", "links": [], "rtt_ms": None,
                         "rtt_samples_ms": [], "agent": None})
            continue
        doc = _path_doc(path, leg.plane, dst, namer, rtts.get((leg.plane, path.id), []),
                        live.on(leg.plane, sport=sport))
        rows.append({"plane": leg.plane, "flow": flow, "path_id": path.id,
                     **{k: v for k, v in doc.items() if k not in ("id", "ports", "seen")}})
    return {**where, "src": src, "dst": dst, "sport": sport, "dport": dport, "planes": rows,
            "summary": {"planes": len(rows), "planes_reached": sum(r["reached"] for r in rows)},
            "stats": dict(table.stats)}


def health(doc: dict) -> Level:
    """How a `probe` or `trace` document judges the peer's reachability: critical when no plane
    reaches it, a warning when some plane or some path does not, ok otherwise."""
    s = doc["summary"]
    if s["planes_reached"] == 0:
        return Level.CRITICAL
    if s["planes_reached"] < s["planes"] or s.get("paths_reached", 0) < s.get("paths", 0):
        return Level.WARNING
    return Level.OK


def unprobed_planes(doc: dict) -> list[int]:
    """The planes of a `trace` document whose flow could not be sent (its source port in use there)."""
    return [r["plane"] for r in doc["planes"] if r["end"] == "not probed"]


# ---- running ----------------------------------------------------------------------------------

def probe(netns: str | None, host: str, dst: str, where: dict, legs: list[Leg], ports: tuple[int, ...], dport: int,
          namer: Namer | None = None, live: Callable[[], Live] | None = None) -> dict | None:
    """The `probe` document of a sweep from `host` (inside `netns`, if given) to `dst`; None if
    not one probe socket could be bound. `live` gives the agent's own view, once the sweep is done."""
    table = sweep(netns, host, legs, ports, dport)
    if bound_nothing(table, legs, ports):
        return None
    return probe_doc(host, dst, where, table, legs, ports, dport, path_rtts(netns, table, legs, dport), namer,
                     live() if live else None)


def trace(netns: str | None, host: str, dst: str, where: dict, legs: list[Leg], sport: int, dport: int,
          namer: Namer | None = None, live: Callable[[], Live] | None = None) -> dict:
    """The `trace` document of the flow from `sport`, swept from `host` (inside `netns`, if given)."""
    table = sweep(netns, host, legs, (sport,), dport)
    return trace_doc(host, dst, where, table, legs, sport, dport, path_rtts(netns, table, legs, dport, sport=sport),
                     namer, live() if live else None)


def sweep(netns: str | None, host: str, legs: list[Leg], ports: tuple[int, ...], dport: int) -> PathTable:
    """Discover the paths of every leg over `ports` (all of them kept per path)."""
    cfg = DiscoveryConfig(ports=ports, k=len(ports), dport=dport)
    return discover(netns, [Target(leg.ifname, leg.src, leg.dst) for leg in legs], cfg, host=host)


def bound_nothing(table: PathTable, legs: list[Leg], ports: tuple[int, ...]) -> bool:
    """Not one probe socket could be bound (the ports are in use on every NIC)."""
    return table.stats.get("socket_errors", 0) >= len(ports) * len(legs)


def path_rtts(netns: str | None, table: PathTable, legs: list[Leg], dport: int,
              sport: int | None = None) -> dict[tuple[int, str], list[float]]:
    """RTT samples (ms) of every path that reached DST, with its first port (or `sport`)."""
    out = {}
    for leg in legs:
        entry = table.get(leg.dst, leg.ifname)
        for path in (entry.paths.values() if entry else ()):
            if path.reached:
                port = sport if sport is not None else path.ports[0]
                out[(leg.plane, path.id)] = measure_rtt(netns, leg.ifname, leg.src, port, leg.dst, dport)
    return out


def measure_rtt(netns: str | None, local: str, src: str, sport: int, dst: str, dport: int,
                count: int = RTT_SAMPLES, timeout_s: float = RTT_TIMEOUT_S) -> list[float]:
    """RTTs (ms) of `count` datagrams of one 5-tuple to DST, timed to its ICMP port unreachable."""
    from ..kernel import netns as ns_io

    make = lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # noqa: E731
    s = ns_io.run_in_netns(netns, make) if netns else make()
    out: list[float] = []
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, local.encode())
        s.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
        s.setblocking(False)
        s.bind((src, sport))
        poller = select.poll()
        poller.register(s.fileno(), select.POLLERR)
        for n in range(count):
            s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # an earlier error must not fail this send
            t0 = time.perf_counter_ns()
            try:
                s.sendto(b"LPRTT\0" + bytes([n]), (dst, dport))
            except OSError:
                continue
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(left * 1000):
                    break
                try:
                    data, anc, _fl, addr = s.recvmsg(512, 512, MSG_ERRQUEUE)
                except BlockingIOError:
                    s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    continue
                t1 = time.perf_counter_ns()
                ee = next((c for lvl, typ, c in anc if lvl == socket.IPPROTO_IP and typ == IP_RECVERR), b"")
                if len(ee) >= _EE.size + 8 and data.endswith(bytes([n])):
                    _e, origin, itype, _c, _p, _i, _d = _EE.unpack_from(ee)
                    offender = socket.inet_ntoa(ee[_EE.size + 4:_EE.size + 8])
                    if origin == 2 and itype == 3 and offender == dst:
                        out.append((t1 - t0) / 1e6)
                        break
    except OSError:
        return out
    finally:
        s.close()
    return out

