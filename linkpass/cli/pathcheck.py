"""`linkpass probe` and `linkpass trace`: the commands of the path checks (linkpass/probe/pathcheck.py)
from one host to a peer.

Two forms:

- `linkpass probe DST` / `linkpass trace DST --sport N` on any host: the local agent runs the
  check from its own NICs (127.0.0.1:PORT/v1/probe, /v1/trace; linkpass/agent/pathcheck_routes.py) and
  joins in what its authenticated probes see on the same paths. No root needed: the agent holds
  the capabilities. On the testbed, run it inside SRC's namespace (`ip netns exec`).
- `linkpass probe SRC DST` / `linkpass trace SRC DST --sport N` on the testbed: the CLI sweeps
  from SRC's namespace itself (root), no agent needed, routers and links named
  (linkpass/testbed/pathcheck_hosts.py).

`probe` sweeps source ports 31000-31031 (`--base-port`, `--ports`) on every plane and lists
every distinct ECMP path found: the ports that take it, the routers on the way, whether DST
answered, an RTT. `trace` follows exactly one 5-tuple per plane (this host's NIC address,
`--sport`, DST's NIC address, `--dport`, UDP). The default sweep lies below Linux's ephemeral
range (32768-60999) and the agent's own probe ports (49152 and up); `trace --sport` of a port
the agent probes shows exactly the route of that probe flow, with the agent's state of it.

Exit: 0 every plane (and every path found) reaches DST; 1 some plane or path does not; 2 no
plane reaches DST; 3 usage or environment problems (no agent, no testbed, unknown host, port
in use).
"""
from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.parse
import urllib.request

from ..core.constants import AGENT_API_PORT, PROBE_PORT_BASE, ROCE_PORT
from ..probe.pathcheck import MAX_PORTS, PROBE_BASE_PORT, PROBE_PORTS, health, unprobed_planes
from ..console.output import EXIT_OF_LEVEL, FORMATS, emit, error, paint, table
from .paths import no_agent

AGENT_TIMEOUT_S = 30.0  # a sweep takes up to 5 s, and RTTs up to ~1 s per path
SILENT_HINT = ("an agent listening there swallows them; retry with a closed --dport (e.g. 4793), "
               "or ask SRC's agent (`linkpass probe DST` on SRC), whose probes DST answers")


def exit_code(doc: dict) -> int:
    return EXIT_OF_LEVEL[health(doc)]


# ---- rendering --------------------------------------------------------------------------------

def _where(doc: dict) -> str:
    return f"on testbed {doc['testbed']}" if "testbed" in doc else f"through {doc['agent']}'s agent"


def _ports_text(ports: list[int], seen: int, wide: bool) -> str:
    shown = ports if wide else ports[:4]
    more = seen - len(shown)
    return ",".join(map(str, shown)) + (f" +{more}" if more > 0 else "")


def _end_cell(path: dict) -> str:
    if path.get("reached_by") == "agent":
        return paint("reached*", "green")
    return paint(path["end"], "green" if path["end"] == "reached" else "red")


def _rtt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _agent_cell(agent: dict | None) -> str:
    if not agent:
        return "-"
    return f"{'/'.join(agent['states'])} ({len(agent['ports'])} port{'s' if len(agent['ports']) != 1 else ''})"


def hops_text(hops: list[dict]) -> str:
    return " > ".join("*" if not h["addr"] else h["addr"] + (f" ({h['node']} via {h['link']})" if h["node"] else "")
                      for h in hops) or "-"


def _footnotes(doc: dict, paths: list[dict]) -> list[str]:
    lines = []
    if any(p.get("reached_by") == "agent" for p in paths):
        lines.append(f"  * {doc['dst']} answers the agent's own probes over this path; the sweep's datagrams end "
                     f"silent there (its agent listens on udp {doc['dport']})")
    if any(p.get("dst_silent") for p in paths):
        lines.append(f"  note: probes reached {doc['dst']}'s leaf but {doc['dst']} did not answer on udp "
                     f"{doc['dport']}: {SILENT_HINT}")
    return lines


def render_probe(doc: dict, wide: bool = False) -> str:
    lines = [f"probe {doc['src']} → {doc['dst']} {_where(doc)}: udp dport {doc['dport']}, source ports {doc['ports']}"]
    agent = "agent" in doc
    headers = (["plane", "path", "end", "ports", "route", "rtt ms"] + (["agent's probes"] if agent else [])
               + (["hops (address, node via link)"] if wide else []))
    rows = []
    for pl in doc["planes"]:
        if not pl["paths"]:
            rows.append([f"p{pl['plane']}", "-", paint("not probed", "red"), "-", "-", "-"] + (["-"] if agent else [])
                        + (["-"] if wide else []))
        for path in pl["paths"]:
            row = [f"p{pl['plane']}", path["id"], _end_cell(path), _ports_text(path["ports"], path["seen"], wide),
                   path["route"], _rtt(path["rtt_ms"])]
            if agent:
                row.append(_agent_cell(path.get("agent")))
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
    lines += _footnotes(doc, [p for pl in doc["planes"] for p in pl["paths"]])
    return "\n".join(lines)


def render_trace(doc: dict, wide: bool = False) -> str:
    lines = [f"trace {doc['src']} → {doc['dst']} {_where(doc)}: udp sport {doc['sport']} → dport {doc['dport']}"]
    agent = "agent" in doc
    headers = (["plane", "flow", "path", "end", "route", "rtt ms"] + (["agent's probe"] if agent else [])
               + (["hops (address, node via link)"] if wide else []))
    rows = []
    for r in doc["planes"]:
        f = r["flow"]
        row = [f"p{r['plane']}", f"{f['src']}:{f['sport']} → {f['dst']}:{f['dport']}", r["path_id"] or "-",
               _end_cell(r), r["route"], _rtt(r["rtt_ms"])]
        if agent:
            row.append(_agent_cell(r.get("agent")))
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
    lines += _footnotes(doc, doc["planes"])
    return "\n".join(lines)


# ---- running ----------------------------------------------------------------------------------

def _hosts(args) -> tuple[str | None, str]:
    if len(args.hosts) > 2:
        raise ValueError(f"at most two hosts, [SRC] DST; got {' '.join(args.hosts)}")
    return (None, args.hosts[0]) if len(args.hosts) == 1 else (args.hosts[0], args.hosts[1])


def _ask_agent(args, route: str, query: dict) -> int:
    if args.testbed:
        return error(f"--testbed goes with SRC DST (the CLI sweeps from SRC's namespace); `linkpass {args.command} "
                     f"{args.hosts[0]}` alone asks this host's agent")
    port = AGENT_API_PORT if args.port is None else args.port
    url = f"http://127.0.0.1:{port}/v1/{route}?" + urllib.parse.urlencode(query)
    try:
        with urllib.request.urlopen(url, timeout=AGENT_TIMEOUT_S) as resp:
            doc = json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            why = json.load(exc).get("error") or exc.reason
        except (ValueError, AttributeError):
            why = exc.reason
        return error(f"the agent refused the {route}: {why}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return no_agent(f"127.0.0.1:{port}", exc,
                        f"; on the testbed, `linkpass {args.command} SRC DST` sweeps without an agent")
    render = render_probe if route == "probe" else render_trace
    emit(doc, args.output, lambda d: render(d, wide=args.output == "wide"))
    return exit_code(doc)


def _on_testbed(args, src: str, dst: str, check) -> int:
    from ..testbed import pathcheck_hosts as TP

    if os.geteuid() != 0:
        return error(f"`linkpass {args.command} SRC DST` sweeps inside the testbed's namespaces and needs root; run "
                     f"it with sudo (or `linkpass {args.command} {dst}` on SRC, which asks its agent)")
    try:
        fab = TP.load_testbed(args.testbed)
        s, d, legs = TP.setup(fab, src, dst, getattr(args, "plane", None))
    except TP.UsageError as exc:
        return error(str(exc))
    return check(TP, fab, s, d, legs)


def run_probe(args) -> int:
    try:
        src, dst = _hosts(args)
    except ValueError as exc:
        return error(str(exc))
    if not 1 <= args.ports <= MAX_PORTS or not 1 <= args.base_port <= 65536 - args.ports:
        return error(f"--base-port {args.base_port} --ports {args.ports}: ports must fit in 1..65535 "
                     f"(and at most {MAX_PORTS} of them)")
    if not 1 <= args.dport <= 65535:
        return error(f"--dport {args.dport}: a UDP port is 1..65535")
    if src is None:
        query = {"peer": dst, "base_port": args.base_port, "ports": args.ports, "dport": args.dport}
        return _ask_agent(args, "probe", query)

    def check(TP, fab, s, d, legs):
        ports = tuple(range(args.base_port, args.base_port + args.ports))
        doc = TP.probe(fab, s, d, legs, ports, args.dport)
        if doc is None:
            return error(f"could not bind any probe socket on {src} (ports {ports[0]}-{ports[-1]} in use?); "
                         "try another --base-port")
        emit(doc, args.output, lambda x: render_probe(x, wide=args.output == "wide"))
        return exit_code(doc)
    return _on_testbed(args, src, dst, check)


def run_trace(args) -> int:
    try:
        src, dst = _hosts(args)
    except ValueError as exc:
        return error(str(exc))
    if not 1 <= args.sport <= 65535 or not 1 <= args.dport <= 65535:
        return error(f"--sport {args.sport} --dport {args.dport}: a UDP port is 1..65535")
    if src is None:
        query = {"peer": dst, "sport": args.sport, "dport": args.dport,
                 **({"plane": args.plane} if args.plane is not None else {})}
        return _ask_agent(args, "trace", query)

    def check(TP, fab, s, d, legs):
        doc = TP.trace(fab, s, d, legs, args.sport, args.dport)
        unprobed = unprobed_planes(doc)
        if unprobed:
            return error(f"could not trace sport {args.sport} from {src} on plane(s) {unprobed}: the port is in use "
                         f"on that NIC (an agent's probe socket? its ports start at {PROBE_PORT_BASE}); pick another "
                         "--sport")
        emit(doc, args.output, lambda x: render_trace(x, wide=args.output == "wide"))
        return exit_code(doc)
    return _on_testbed(args, src, dst, check)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("hosts", nargs="+", metavar="[SRC] DST",
                   help="DST alone: the local agent checks its paths to that peer; SRC DST: two testbed hosts "
                        "(e.g. h0 h3), swept from SRC's namespace").complete = "hosts"
    p.add_argument("--port", type=int, default=None,
                   help=f"the local agent's API port (default {AGENT_API_PORT}; DST form)")
    p.add_argument("--testbed", metavar="PREFIX", default=None,
                   help="the testbed's prefix (SRC DST form; default: the only testbed running)")
    p.add_argument("--dport", type=int, default=ROCE_PORT, help=f"UDP destination port (default {ROCE_PORT}, "
                                                                "RoCEv2's, so probes hash like RDMA traffic)")
    p.add_argument("-o", "--output", choices=FORMATS, default="table")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="one-shot check of every plane and ECMP path to a peer",
                       description="Sweep source ports towards DST over every plane (Paris-style traces) and list "
                                   "each distinct path: ports, routers and links, reached, RTT. `probe DST` asks "
                                   "this host's agent, which adds what its own probes see on each path; `probe "
                                   "SRC DST` sweeps between two testbed hosts. Exit 0 all reached, 1 some plane "
                                   "or path not, 2 no plane, 3 usage/no agent/no testbed.")
    _common(p)
    p.add_argument("--base-port", type=int, default=PROBE_BASE_PORT,
                   help=f"first source port swept (default {PROBE_BASE_PORT}: clear of ephemeral ports and the "
                        f"agent's {PROBE_PORT_BASE}+)")
    p.add_argument("--ports", type=int, default=PROBE_PORTS, help=f"source ports swept per plane (default {PROBE_PORTS})")
    p.set_defaults(func=run_probe)

    p = sub.add_parser("trace", help="which path one flow (5-tuple) to a peer takes, per plane",
                       description="Paris-trace the UDP flow NIC:SPORT → DST-NIC:DPORT on each plane (or --plane) "
                                   "and name the routers and links it crosses. `trace DST` asks this host's agent "
                                   "(a --sport the agent probes shows that probe flow's route and state); `trace "
                                   "SRC DST` traces between two testbed hosts. Exit 0 all planes reach DST, 1 some "
                                   "do not, 2 none, 3 usage/no agent/no testbed/port in use.")
    _common(p)
    p.add_argument("--sport", type=int, required=True, metavar="N", help="UDP source port of the flow")
    p.add_argument("--plane", type=int, default=None, metavar="P", help="only this plane")
    p.set_defaults(func=run_trace)
