"""`linkpass paths`: the probed paths of the agent on this host, from its local query API."""
from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

from .output import EXIT_CRITICAL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING, FORMATS, emit, paint, table
from ..core.constants import AGENT_API_PORT


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("paths", help="probed paths: this host's (local agent) or any host's (coordinator)",
                       description="`linkpass paths [--peer PEER]` reads the local agent's per-path telemetry "
                                   "(127.0.0.1:PORT/v1/paths); `linkpass paths HOST [PEER]` asks the coordinator "
                                   "for HOST's paths and the links they cross. A single PEER with --port or "
                                   "--local is read as a peer of the local agent. "
                                   "Exit 0 ok, 1 if a path lost > 1 %% in the window or is degraded / "
                                   "recovering, 2 if a path is dark, down or damped, 3 if nothing answers.")
    p.add_argument("host", nargs="?", help="a host of the fleet (asks the coordinator)")
    p.add_argument("peer", nargs="?", help="only paths to this peer")
    p.add_argument("--local", action="store_true", help="the local agent, whatever the arguments")
    p.add_argument("--peer", dest="peer_opt", help="only paths to this peer (local agent)")
    p.add_argument("--port", type=int, default=None, help=f"local agent's API port (default {AGENT_API_PORT})")
    p.add_argument("-o", "--output", choices=FORMATS, default="table")
    from .coordinator import add_coordinator_paths_args

    add_coordinator_paths_args(p)
    p.set_defaults(func=dispatch)


def dispatch(args) -> int:
    if args.host and not (args.local or args.port is not None):
        from .coordinator import paths_from_coordinator

        return paths_from_coordinator(args)
    args.peer = args.peer_opt or args.host
    args.port = AGENT_API_PORT if args.port is None else args.port
    return run(args)


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def run(args) -> int:
    url = f"http://127.0.0.1:{args.port}/v1/paths"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            rows = json.load(resp)
    except (urllib.error.URLError, OSError) as exc:
        print(f"linkpass: no agent answers on {url} ({getattr(exc, 'reason', exc)}); is the LinkPass agent running "
              "on this host (in this network namespace)?")
        return EXIT_UNKNOWN
    if args.peer:
        rows = [r for r in rows if r["peer"] == args.peer]
    dark = [r for r in rows if (r["window"]["sent"] > 0 and r["window"]["replies"] == 0)
            or r.get("state") in ("down", "damped")]
    lossy = [r for r in rows if (r["window"]["loss_pct"] or 0) > 1 or r.get("state") in ("degraded", "recovering")]

    def render(rs) -> str:
        wide = args.output == "wide"
        headers = ["peer", "plane", "path", "state", "loss %", "fwd %", "rev %", "rtt p50 ms", "rtt p99 ms",
                   "owd fwd p50 ms", "owd rev p50 ms"] + (["reason", "sport", "sent", "replies", "jitter ms"] if wide else [])
        lines = []
        for r in rs:
            w = r["window"]
            bad = (w["loss_pct"] or 0) > 1
            state = r.get("state") or "-"
            colour = {"up": "green", "suspect": "yellow", "degraded": "yellow", "recovering": "yellow"}.get(state, "red")
            cells = [r["peer"], r["plane"], r["path"], paint(state, colour) if state != "-" else state,
                     _pct(w["loss_pct"]), _pct(w["loss_fwd_pct"]),
                     _pct(w["loss_rev_pct"]),
                     _ms((r["rtt_ns"] or {}).get("p50")), _ms((r["rtt_ns"] or {}).get("p99")),
                     _ms((r["owd_fwd_ns"] or {}).get("p50")), _ms((r["owd_rev_ns"] or {}).get("p50"))]
            if wide:
                cells += [r.get("reason") or "-", r["sport"], r["sent"], r["replies"], _ms(r["jitter_ns"])]
            if bad:
                cells[0] = paint(str(cells[0]), "red")
            lines.append(cells)
        window = rs[0]["window_s"] if rs else 0
        summary = f"{len(rs)} paths, window {window:g} s: {len(lossy)} lossy or degraded, {len(dark)} dark or down"
        return table(headers, lines) + "\n" + summary

    emit(rows, args.output, render)
    return EXIT_CRITICAL if dark else EXIT_WARNING if lossy else EXIT_OK
