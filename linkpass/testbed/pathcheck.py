"""`linkpass probe SRC DST` and `linkpass trace SRC DST --sport N`: one-shot path checks on the testbed.

SRC and DST are host names (h0, h3, ...) of a running testbed (`--testbed PREFIX`; default: the
only one running). Both reuse the Paris-style discovery of linkpass/probe/discovery.py inside
SRC's namespace, towards DST's NIC address on each plane, UDP destination port 4791 (`--dport`):

- `probe` sweeps source ports 31000-31031 (`--base-port`, `--ports`) on every plane and lists
  every distinct ECMP path found: the ports that take it, the routers on the way (address, and
  the testbed node and link it belongs to), whether DST answered, and an RTT.
- `trace` follows exactly one 5-tuple per plane (SRC's NIC address, `--sport`, DST's NIC
  address, dport, UDP): which routers and links that flow crosses.

Ports: the default sweep 31000-31031 lies below Linux's default ephemeral range (32768-60999)
and below the agent's probe and discovery ports (49152 and up), so it never takes a port a
running agent holds. A `trace --sport` inside the agent's range fails to bind if the agent holds
that port on that NIC; the command then says so (exit 3). Note that an agent on DST listens on
4791 and answers no stray datagram, so traces to 4791 of a host running an agent end `lost`
after DST's leaf (the output then says so); pick a closed `--dport` then (the path it finds is
that dport's).

RTT: after discovery, three datagrams of the path's first port (full TTL) are sent to DST;
the time to DST's ICMP port unreachable is the RTT (median shown). Software timestamps: tens
of microseconds of noise.

Exit: 0 every plane (and every path found) reaches DST; 1 some plane or path does not; 2 no
plane reaches DST; 3 usage or environment problems (no testbed, unknown host, port in use).
"""
from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import struct
import sys
import time

from ..core import names
from ..core.constants import PROBE_PORT_BASE, ROCE_PORT
from ..core.names import host_name
from .topology import nic_ifname
from ..cli.output import EXIT_CRITICAL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING, FORMATS, emit, paint, table

PROBE_BASE_PORT = 31000
PROBE_PORTS = 32
DEFAULT_DPORT = ROCE_PORT
RTT_SAMPLES = 3
RTT_TIMEOUT_S = 0.3
_EE = struct.Struct("=IBBBBII")


class UsageError(Exception):
    """The command cannot run as asked (no testbed, unknown host, ...): exit 3."""


# ---- the testbed --------------------------------------------------------------------------

def pick_prefix(prefix: str | None, running: list[str]) -> str:
    """The testbed to use: the one named, else the only one running."""
    if prefix:
        if prefix not in running:
            have = f"running: {', '.join(running)}" if running else "none is running"
            raise UsageError(f"no testbed with prefix {prefix!r} is up ({have}); "
                             f"start one with `linkpass testbed up --prefix {prefix}`")
        return prefix
    if not running:
        raise UsageError("no testbed is running; start one with `linkpass testbed up`")
    if len(running) > 1:
        raise UsageError(f"{len(running)} testbeds are running ({', '.join(running)}); choose one with --testbed PREFIX")
    return running[0]


def load_testbed(prefix: str | None):
    from . import build, state
    from ..kernel import netns as ns_io

    chosen = pick_prefix(prefix, state.all_prefixes())
    try:
        fab = build.load_fabric(chosen)
    except (build.TestbedError, build.TopologyError) as exc:
        raise UsageError(str(exc)) from None
    if not os.path.exists(ns_io.netns_path(fab.netns(host_name(0)))):
        raise UsageError(f"testbed {chosen!r} has a state file but no namespaces (a crashed run?); "
                         f"`linkpass testbed clean --prefix {chosen}` removes it")
    return fab


def host_index(fab, name: str) -> int:
    hosts = fab.spec.hosts
    try:
        i = names.host_index(name)
    except ValueError:
        i = -1
    if not 0 <= i < hosts:
        raise UsageError(f"unknown host {name!r}: testbed {fab.prefix} has hosts "
                         f"{host_name(0)}..{host_name(hosts - 1)}")
    return i


def hop_index(fab) -> dict[str, tuple[str, str]]:
    """Interface address -> (node, link) for every fabric link end. A router's ICMP names the
    interface the probe came in on, so the link is the one that brought the probe to the node."""
    out = {}
    for lk in fab.links.values():
        out[lk.a_addr.split("/")[0]] = (lk.a, lk.name)
        out[lk.b_addr.split("/")[0]] = (lk.b, lk.name)
    return out


def describe_hops(hops, index: dict[str, tuple[str, str]]) -> list[dict]:
    out = []
    for ttl, addr in enumerate(hops, start=1):
        node, link = index.get(addr, (None, None)) if addr else (None, None)
        out.append({"ttl": ttl, "addr": addr, "node": node, "link": link})
    return out


def links_crossed(fab, hops: list[dict], reached: bool, dst: int, plane: int) -> list[str]:
    """Link names the flow crossed, in order (DST's uplink last when DST answered)."""
    out = [h["link"] for h in hops if h["link"]]
    if reached:
        out.append(fab.uplink(host_name(dst), plane).name)
    return out


def dst_silent(fab, hops: list[dict], end: str, dst: int, plane: int) -> bool:
    """Lost right after DST's own leaf: the network delivered, DST did not answer (an agent on dport?)."""
    last = next((h for h in reversed(hops) if h["addr"]), None)
    return end == "lost" and last is not None and last is hops[-1] and last["node"] == fab.leaf_of(dst, plane)


def route_text(hops: list[dict], end: str, dst: str) -> str:
    parts = [h["node"] or h["addr"] or "*" for h in hops]
    if end == "reached":
        parts.append(dst)
    elif end == "unreachable":
        parts[-1:] = [f"{parts[-1] if parts else '?'} ✗ no route"]
    else:
        parts.append("✗")
    return " > ".join(parts)


def hops_text(hops: list[dict]) -> str:
    return " > ".join("*" if not h["addr"] else h["addr"] + (f" ({h['node']} via {h['link']})" if h["node"] else "")
                      for h in hops) or "-"


# ---- RTT ----------------------------------------------------------------------------------

def measure_rtt(netns: str | None, local: str, src: str, sport: int, dst: str, dport: int,
                count: int = RTT_SAMPLES, timeout_s: float = RTT_TIMEOUT_S) -> list[float]:
    """RTTs (ms) of `count` datagrams of one 5-tuple to DST, timed to its ICMP port unreachable."""
    from ..kernel import netns as ns_io
    from ..probe.discovery import IP_RECVERR, MSG_ERRQUEUE, SO_BINDTODEVICE

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


# ---- documents (pure, given the discovery results) -------------------------------------------

def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def probe_doc(fab, src: int, dst: int, table_, planes: list[int], ports: tuple[int, ...], dport: int,
              rtts: dict[tuple[int, str], list[float]]) -> dict:
    """What `probe` prints, from a PathTable of SRC (pure: no sockets)."""
    index = hop_index(fab)
    dname = host_name(dst)
    out_planes = []
    for p in planes:
        daddr = fab.nic_addr(dst, p)
        entry = table_.get(daddr, f"p{p}")
        paths = []
        for path in (entry.paths.values() if entry else []):
            hops = describe_hops(path.hops, index)
            samples = rtts.get((p, path.id), [])
            paths.append({"id": path.id, "end": path.end, "reached": path.reached, "ports": list(path.ports),
                          "seen": path.seen, "hops": hops, "route": route_text(hops, path.end, dname),
                          "links": links_crossed(fab, hops, path.reached, dst, p),
                          "dst_silent": dst_silent(fab, hops, path.end, dst, p),
                          "rtt_ms": _median(samples), "rtt_samples_ms": [round(x, 3) for x in samples]})
        out_planes.append({"plane": p, "src_addr": fab.nic_addr(src, p), "dst_addr": daddr,
                           "reached": any(x["reached"] for x in paths), "swept": len(entry.ports) if entry else 0,
                           "paths": paths})
    n_paths = sum(len(x["paths"]) for x in out_planes)
    return {"testbed": fab.prefix, "src": host_name(src), "dst": dname, "dport": dport,
            "ports": f"{min(ports)}-{max(ports)}" if len(ports) > 1 else str(ports[0]),
            "planes": out_planes,
            "summary": {"planes": len(out_planes), "planes_reached": sum(x["reached"] for x in out_planes),
                        "paths": n_paths,
                        "paths_reached": sum(y["reached"] for x in out_planes for y in x["paths"])},
            "stats": {k: v for k, v in dict(table_.stats).items()}}


def trace_doc(fab, src: int, dst: int, table_, planes: list[int], sport: int, dport: int,
              rtts: dict[tuple[int, str], list[float]]) -> dict:
    """What `trace` prints: the path of one 5-tuple per plane (pure: no sockets)."""
    index = hop_index(fab)
    dname = host_name(dst)
    rows = []
    for p in planes:
        saddr, daddr = fab.nic_addr(src, p), fab.nic_addr(dst, p)
        entry = table_.get(daddr, f"p{p}")
        path = entry.path_of(sport) if entry else None
        flow = {"proto": "udp", "src": saddr, "sport": sport, "dst": daddr, "dport": dport}
        if path is None:
            rows.append({"plane": p, "flow": flow, "path_id": None, "end": "not probed", "reached": False,
                         "hops": [], "route": "-", "links": [], "rtt_ms": None, "rtt_samples_ms": []})
            continue
        hops = describe_hops(path.hops, index)
        samples = rtts.get((p, path.id), [])
        rows.append({"plane": p, "flow": flow, "path_id": path.id, "end": path.end, "reached": path.reached,
                     "hops": hops, "route": route_text(hops, path.end, dname),
                     "links": links_crossed(fab, hops, path.reached, dst, p),
                     "dst_silent": dst_silent(fab, hops, path.end, dst, p), "rtt_ms": _median(samples),
                     "rtt_samples_ms": [round(x, 3) for x in samples]})
    return {"testbed": fab.prefix, "src": host_name(src), "dst": dname, "sport": sport, "dport": dport, "planes": rows,
            "summary": {"planes": len(rows), "planes_reached": sum(r["reached"] for r in rows)},
            "stats": dict(table_.stats)}


def exit_code(doc: dict) -> int:
    s = doc["summary"]
    if s["planes_reached"] == 0:
        return EXIT_CRITICAL
    if s["planes_reached"] < s["planes"] or s.get("paths_reached", 0) < s.get("paths", 0):
        return EXIT_WARNING
    return EXIT_OK


def _ports_text(ports: list[int], seen: int, wide: bool) -> str:
    shown = ports if wide else ports[:4]
    more = seen - len(shown)
    return ",".join(map(str, shown)) + (f" +{more}" if more > 0 else "")


def _end_cell(end: str) -> str:
    return paint(end, "green" if end == "reached" else "red")


def _rtt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def render_probe(doc: dict, wide: bool = False) -> str:
    lines = [f"probe {doc['src']} → {doc['dst']} on testbed {doc['testbed']}: udp dport {doc['dport']}, "
             f"source ports {doc['ports']}"]
    headers = ["plane", "path", "end", "ports", "route", "rtt ms"] + (["hops (address, node via link)"] if wide else [])
    rows = []
    for pl in doc["planes"]:
        if not pl["paths"]:
            rows.append([f"p{pl['plane']}", "-", paint("not probed", "red"), "-", "-", "-"] + (["-"] if wide else []))
        for path in pl["paths"]:
            row = [f"p{pl['plane']}", path["id"], _end_cell(path["end"]), _ports_text(path["ports"], path["seen"], wide),
                   path["route"], _rtt(path["rtt_ms"])]
            if wide:
                row.append(hops_text(path["hops"]))
            rows.append(row)
    lines.append(table(headers, rows))
    s = doc["summary"]
    lines.append(f"{s['planes_reached']}/{s['planes']} planes reach {doc['dst']}; "
                 f"{s['paths_reached']}/{s['paths']} paths reached")
    for pl in doc["planes"]:
        bad = [p for p in pl["paths"] if not p["reached"]]
        if not pl["reached"]:
            lines.append(f"  ✗ plane {pl['plane']}: {doc['dst']} ({pl['dst_addr']}) not reached over any path")
        for p in bad:
            last = next((h for h in reversed(p["hops"]) if h["addr"]), None)
            where = f"after {last['node'] or last['addr']}" + (f" (came in over {last['link']})" if last["link"] else "") \
                if last else "at the first hop"
            lines.append(f"  ✗ plane {pl['plane']} path {p['id']} ({len(p['ports'])} ports, e.g. "
                         f"{p['ports'][0] if p['ports'] else '-'}): {p['end']} {where}")
    if any(p.get("dst_silent") for pl in doc["planes"] for p in pl.get("paths", [pl])):
        lines.append(f"  note: probes reached {doc['dst']}'s leaf but {doc['dst']} did not answer on udp {doc['dport']}: "
                     "an agent listening there swallows them; retry with a closed --dport (e.g. 4792)")
    return "\n".join(lines)


def render_trace(doc: dict, wide: bool = False) -> str:
    lines = [f"trace {doc['src']} → {doc['dst']} on testbed {doc['testbed']}: udp sport {doc['sport']} → "
             f"dport {doc['dport']}"]
    headers = ["plane", "flow", "path", "end", "route", "rtt ms"] + (["hops (address, node via link)"] if wide else [])
    rows = []
    for r in doc["planes"]:
        f = r["flow"]
        row = [f"p{r['plane']}", f"{f['src']}:{f['sport']} → {f['dst']}:{f['dport']}", r["path_id"] or "-",
               _end_cell(r["end"]), r["route"], _rtt(r["rtt_ms"])]
        if wide:
            row.append(hops_text(r["hops"]))
        rows.append(row)
    lines.append(table(headers, rows))
    for r in doc["planes"]:
        if r["links"]:
            tail = "" if r["reached"] else ", then no route" if r["end"] == "unreachable" else ", then no answer"
            lines.append(f"  p{r['plane']} links: {', '.join(r['links'])}{tail}")
    s = doc["summary"]
    lines.append(f"{s['planes_reached']}/{s['planes']} planes reach {doc['dst']}")
    if any(p.get("dst_silent") for pl in doc["planes"] for p in pl.get("paths", [pl])):
        lines.append(f"  note: probes reached {doc['dst']}'s leaf but {doc['dst']} did not answer on udp {doc['dport']}: "
                     "an agent listening there swallows them; retry with a closed --dport (e.g. 4792)")
    return "\n".join(lines)


# ---- running -------------------------------------------------------------------------------

def _setup(args):
    fab = load_testbed(args.testbed)
    src, dst = host_index(fab, args.src), host_index(fab, args.dst)
    if src == dst:
        raise UsageError(f"SRC and DST are both {args.src}; pick two hosts")
    planes = list(range(fab.spec.planes))
    if getattr(args, "plane", None) is not None:
        if args.plane not in planes:
            raise UsageError(f"--plane {args.plane}: testbed {fab.prefix} has planes 0..{fab.spec.planes - 1}")
        planes = [args.plane]
    if not 1 <= args.dport <= 65535:
        raise UsageError(f"--dport {args.dport}: a UDP port is 1..65535")
    return fab, src, dst, planes


def _discover(fab, src: int, dst: int, planes: list[int], ports: tuple[int, ...], dport: int):
    from ..probe.discovery import DiscoveryConfig, discover, fabric_targets

    cfg = DiscoveryConfig(ports=ports, k=len(ports), dport=dport)
    return discover(fab.netns(host_name(src)), fabric_targets(fab, src, planes, [dst]), cfg, host=host_name(src))


def _rtts(fab, src: int, dst: int, table_, planes: list[int], dport: int, sport: int | None = None):
    out = {}
    for p in planes:
        entry = table_.get(fab.nic_addr(dst, p), f"p{p}")
        if entry is None:
            continue
        for path in entry.paths.values():
            if not path.reached:
                continue
            port = sport if sport is not None else path.ports[0]
            out[(p, path.id)] = measure_rtt(fab.netns(host_name(src)), nic_ifname(p), fab.nic_addr(src, p), port,
                                            fab.nic_addr(dst, p), dport)
    return out


def _usage(message: str) -> int:
    print(f"{paint('linkpass: error:', 'red', sys.stderr)} {message}", file=sys.stderr)
    return EXIT_UNKNOWN


def run_probe(args) -> int:
    try:
        fab, src, dst, planes = _setup(args)
        if not 1 <= args.ports <= 1024 or not 1 <= args.base_port <= 65536 - args.ports:
            raise UsageError(f"--base-port {args.base_port} --ports {args.ports}: ports must fit in 1..65535 "
                             "(and at most 1024 of them)")
    except UsageError as exc:
        return _usage(str(exc))
    ports = tuple(range(args.base_port, args.base_port + args.ports))
    tbl = _discover(fab, src, dst, planes, ports, args.dport)
    if tbl.stats.get("socket_errors", 0) >= len(ports) * len(planes):
        return _usage(f"could not bind any probe socket on {host_name(src)} (ports {ports[0]}-{ports[-1]} in use?); "
                      "try another --base-port")
    doc = probe_doc(fab, src, dst, tbl, planes, ports, args.dport, _rtts(fab, src, dst, tbl, planes, args.dport))
    emit(doc, args.output, lambda d: render_probe(d, wide=args.output == "wide"))
    return exit_code(doc)


def run_trace(args) -> int:
    try:
        fab, src, dst, planes = _setup(args)
        if not 1 <= args.sport <= 65535:
            raise UsageError(f"--sport {args.sport}: a UDP port is 1..65535")
    except UsageError as exc:
        return _usage(str(exc))
    tbl = _discover(fab, src, dst, planes, (args.sport,), args.dport)
    doc = trace_doc(fab, src, dst, tbl, planes, args.sport, args.dport,
                    _rtts(fab, src, dst, tbl, planes, args.dport, sport=args.sport))
    unprobed = [r["plane"] for r in doc["planes"] if r["end"] == "not probed"]
    if unprobed:
        return _usage(f"could not trace sport {args.sport} from {host_name(src)} on plane(s) {unprobed}: the port is in use "
                      f"on that NIC (an agent's probe socket? its ports start at {PROBE_PORT_BASE}); pick another --sport")
    emit(doc, args.output, lambda d: render_trace(d, wide=args.output == "wide"))
    return exit_code(doc)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="source host of the testbed, e.g. h0")
    p.add_argument("dst", metavar="DST", help="destination host, e.g. h3")
    p.add_argument("--testbed", metavar="PREFIX", default=None,
                   help="the testbed's prefix (default: the only testbed running)")
    p.add_argument("--dport", type=int, default=DEFAULT_DPORT, help=f"UDP destination port (default {DEFAULT_DPORT}, "
                                                                  "RoCEv2's, so probes hash like RDMA traffic)")
    p.add_argument("-o", "--output", choices=FORMATS, default="table")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="one-shot test SRC → DST on the testbed: every plane, every ECMP path",
                       description="Sweep source ports from SRC to DST over every plane (Paris-style traces in SRC's "
                                   "namespace) and list each distinct path: ports, routers and links, reached, RTT. "
                                   "Exit 0 all reached, 1 some plane or path not, 2 no plane, 3 usage/no testbed.")
    _common(p)
    p.add_argument("--base-port", type=int, default=PROBE_BASE_PORT,
                   help=f"first source port swept (default {PROBE_BASE_PORT}: clear of ephemeral ports and the "
                        f"agent's {PROBE_PORT_BASE}+)")
    p.add_argument("--ports", type=int, default=PROBE_PORTS, help=f"source ports swept per plane (default {PROBE_PORTS})")
    p.set_defaults(func=run_probe, needs_root=True)

    p = sub.add_parser("trace", help="which path one flow (5-tuple) SRC → DST takes, per plane",
                       description="Paris-trace the UDP flow SRC-NIC:SPORT → DST-NIC:DPORT on each plane (or --plane) "
                                   "and name the routers and links it crosses. Exit 0 all planes reach DST, 1 some "
                                   "do not, 2 none, 3 usage/no testbed/port in use.")
    _common(p)
    p.add_argument("--sport", type=int, required=True, metavar="N", help="UDP source port of the flow")
    p.add_argument("--plane", type=int, default=None, metavar="P", help="only this plane")
    p.set_defaults(func=run_trace, needs_root=True)
