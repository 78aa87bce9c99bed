"""`linkpass paths`: the probed paths of the agent on this host, from its local query API.

A row's health is its state's (`core.states.HEALTH`, as for `linkpass paths HOST`), made worse by
what its window shows: nothing answered is critical, more than 1 % lost a warning. A DOWN the
agent holds back from the data path (`held`: the host's own replies are late, or no other path of
the peer confirms the silence) reads "down (held)" and is a warning: traffic has not moved."""
from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

from ..console.output import EXIT_OF_LEVEL, FORMATS, emit, error, paint, paint_level, table
from ..core.constants import AGENT_API_PORT
from ..core.states import DARK, HELD_OUT, Level, State, health_of, state_of, worst

LOSSY_PCT = 1.0  # a window losing more than this is a warning, whatever the state says


def _any_of(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


def _states_at(level: Level) -> list[str]:
    return [s.value for s in State if s.health is level]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("paths", help="probed paths: this host's (local agent) or any host's (coordinator)",
                       description="`linkpass paths [--peer PEER]` reads the local agent's per-path telemetry "
                                   "(127.0.0.1:PORT/v1/paths); `linkpass paths HOST [PEER]` asks the coordinator "
                                   "for HOST's paths and the links they cross. A single PEER with --port or "
                                   "--local is read as a peer of the local agent. "
                                   f"Exit 0 ok, 1 if a path lost more than {LOSSY_PCT:g}% in the window or is "
                                   f"{_any_of(_states_at(Level.WARNING))}, 2 if a path is "
                                   f"{_any_of(['dark', *_states_at(Level.CRITICAL)])}, 3 if nothing answers "
                                   "(or the coordinator refuses the token).")
    p.add_argument("host", nargs="?", help="a host of the fleet (asks the coordinator)").complete = "hosts"
    p.add_argument("peer", nargs="?", help="only paths to this peer").complete = "hosts"
    p.add_argument("--local", action="store_true", help="the local agent, whatever the arguments")
    p.add_argument("--peer", dest="peer_opt", metavar="PEER", help="only paths to this peer (local agent)"
                   ).complete = "hosts"
    p.add_argument("--port", type=int, default=None, help=f"local agent's API port (default {AGENT_API_PORT})")
    p.add_argument("-o", "--output", choices=FORMATS, default="table", metavar="FORMAT",
                   help="table (default), wide (more columns), json or yaml: a document on stdout, errors "
                        "on stderr")
    from .fleet import add_coordinator_paths_args

    add_coordinator_paths_args(p)
    p.set_defaults(func=dispatch)


def dispatch(args) -> int:
    if args.host and not (args.local or args.port is not None):
        from .fleet import paths_from_coordinator

        return paths_from_coordinator(args)
    args.peer = args.peer_opt or args.host
    args.port = AGENT_API_PORT if args.port is None else args.port
    return run(args)


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def no_agent(where: str, exc: Exception, more: str = "") -> int:
    """The one-line error (exit 3) when the local agent's API does not answer on `where`."""
    return error(f"no agent answers on {where} ({getattr(exc, 'reason', exc)}); is the LinkPass agent running "
                 f"on this host (in this network namespace)? `linkpass doctor` checks it{more}")


def run(args) -> int:
    url = f"http://127.0.0.1:{args.port}/v1/paths"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            rows = json.load(resp)
    except (urllib.error.URLError, OSError) as exc:
        return no_agent(url, exc)
    if args.peer:
        rows = [r for r in rows if r["peer"] == args.peer]
    emit(rows, args.output, lambda rs: render(rs, args.output == "wide"))
    return paths_exit(rows)


def _window_dark(r: dict) -> bool:
    return r["window"]["sent"] > 0 and r["window"]["replies"] == 0


def _window_lossy(r: dict) -> bool:
    return (r["window"]["loss_pct"] or 0) > LOSSY_PCT


def _state_health(r: dict) -> Level | None:
    if r.get("held") and state_of(r.get("state")) in DARK:
        return Level.WARNING
    return health_of(r.get("state"))


def _state_text(r: dict) -> str:
    state = r.get("state") or "-"
    return f"{state} (held)" if r.get("held") and state_of(state) in DARK else state


def row_health(r: dict) -> Level:
    """A row's health: its state's (a held DOWN a warning), or worse if the window shows nothing
    answered or heavy loss."""
    window = Level.CRITICAL if _window_dark(r) else Level.WARNING if _window_lossy(r) else Level.OK
    return worst((_state_health(r), window))


def paths_exit(rows: list[dict]) -> int:
    return EXIT_OF_LEVEL[worst(row_health(r) for r in rows)]


def render(rows: list[dict], wide: bool = False) -> str:
    headers = ["peer", "plane", "path", "state", "loss %", "fwd %", "rev %", "rtt p50 ms", "rtt p99 ms",
               "owd fwd p50 ms", "owd rev p50 ms"] + (["reason", "sport", "sent", "replies", "jitter ms"] if wide else [])
    lines = []
    for r in rows:
        w = r["window"]
        state = _state_text(r)
        cells = [r["peer"], r["plane"], r["path"], paint_level(state, _state_health(r)) if state != "-" else state,
                 _pct(w["loss_pct"]), _pct(w["loss_fwd_pct"]),
                 _pct(w["loss_rev_pct"]),
                 _ms((r["rtt_ns"] or {}).get("p50")), _ms((r["rtt_ns"] or {}).get("p99")),
                 _ms((r["owd_fwd_ns"] or {}).get("p50")), _ms((r["owd_rev_ns"] or {}).get("p50"))]
        if wide:
            # a recovering path says what it still waits for: "why is the repaired link not in use?"
            why = "waiting for " + "; ".join(r["waiting_for"]) if r.get("waiting_for") else r.get("reason") or "-"
            cells += [why, r["sport"], r["sent"], r["replies"], _ms(r["jitter_ns"])]
        if _window_lossy(r):
            cells[0] = paint(str(cells[0]), "red")
        lines.append(cells)
    dark = [r for r in rows if _window_dark(r) or (state_of(r.get("state")) in DARK and not r.get("held"))]
    lossy = [r for r in rows if _window_lossy(r) or state_of(r.get("state")) in HELD_OUT]
    window = rows[0]["window_s"] if rows else 0
    held = sum(1 for r in rows if r.get("held") and state_of(r.get("state")) in DARK)
    summary = (f"{len(rows)} paths, window {window:g} s: {len(lossy)} lossy or degraded, {len(dark)} dark or down"
               + (f", {held} down but held (traffic not moved)" if held else ""))
    return table(headers, lines) + "\n" + summary
