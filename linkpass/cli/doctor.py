"""`linkpass doctor`: is this host (or this network namespace) ready for the LinkPass agent?
The checks and what each reads are in the doctor package."""
from __future__ import annotations

import argparse
import os
import socket

from ..core.constants import AGENT_API_PORT
from ..core.states import worst
from ..doctor.checks import FAIL, LEVEL_OF_STATUS, OK, SKIP, STATUSES, WARN, Check, health, report, run_checks
from ..doctor.gather import gather
from ..console.output import EXIT_OF_LEVEL, FORMATS, emit, error, paint, paint_level, table
from ..console.files import absolute


def exit_code(checks: list[Check]) -> int:
    return EXIT_OF_LEVEL[health(checks)]


def _paint_status(status: str) -> str:
    """A status in its level's colour; a skipped check, which told nothing, dim."""
    return paint(status, "dim") if status == SKIP else paint_level(status, LEVEL_OF_STATUS[status])


def render(doc: dict, wide: bool = False) -> str:
    where = doc["host"] + (f" (netns {doc['netns']})" if doc.get("netns") else "")
    lines = [f"linkpass doctor: {where}" + (f", config {doc['config']}" if doc.get("config") else "")]
    headers = ["check", "status", "detail"] + (["reads", "fix"] if wide else [])
    rows = []
    for c in doc["checks"]:
        row = [c["name"], _paint_status(c["status"]), c["detail"]]
        if wide:
            row += [c["reads"] or "-", c["fix"] or "-"]
        rows.append(row)
    lines.append(table(headers, rows))
    fixes = [c for c in doc["checks"] if c["status"] in (WARN, FAIL) and c["fix"]]
    if fixes and not wide:
        lines.append("")
        lines.append("to fix:")
        lines += [f"  {c['name']}: {c['fix']}" for c in fixes]
    n = doc["counts"]
    verdict = doc["verdict"]
    level = worst(LEVEL_OF_STATUS[s] for s in STATUSES if n[s])
    lines.append("")
    lines.append(f"{paint_level(verdict, level)}: {n[OK]} ok, {n[WARN]} warn, {n[FAIL]} fail, {n[SKIP]} skipped")
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="is this host ready for the LinkPass agent: kernel, NICs, routes, clock, agent",
                       description="Check this host (or --netns NAME) for the LinkPass agent: sysctls, capabilities, "
                                   "configured NICs and gateways, RDMA devices, routes to peers, clock sync and the "
                                   "local agent. Exit 0 all ok, 1 some warning, 2 some failure, 3 bad --netns.")
    p.add_argument("--config", metavar="FILE", type=absolute, help="the agent's YAML config: enables the NIC and route checks")
    p.add_argument("--netns", metavar="NAME", help="run every check inside this network namespace (e.g. lp-h0)")
    p.add_argument("--api-port", type=int, default=None, help=f"agent API port (default: the config's, else "
                                                             f"{AGENT_API_PORT})")
    p.add_argument("-o", "--output", choices=FORMATS, default="table", metavar="FORMAT",
                   help="table (default), wide (more columns), json or yaml: a document on stdout, errors "
                        "on stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.netns:
        from ..kernel import netns as ns_io

        if not os.path.exists(ns_io.netns_path(args.netns)):
            return error(f"no network namespace {args.netns!r} (`ip netns list` shows them)")
        if os.geteuid() != 0:
            return error("--netns needs root (entering a namespace needs CAP_SYS_ADMIN)")
    facts = gather(args.netns, args.config, args.api_port)
    checks = run_checks(facts)
    doc = report(checks, socket.gethostname(), args.netns, args.config)
    emit(doc, args.output, lambda d: render(d, wide=args.output == "wide"))
    return exit_code(checks)
