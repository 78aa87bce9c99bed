"""The on-call reads of the fleet: `linkpass status`, `agents`, `links`, `paths HOST`, `events`.
Renderers are pure functions of the coordinator's JSON documents (and `now`), checked against
golden files; each command's exit code is the worst level its rows show (docs/cli.md).
"""
from __future__ import annotations

import argparse
import json
import time

from ..console.output import (EXIT_CRITICAL, EXIT_OF_LEVEL, EXIT_OK, EXIT_UNKNOWN, emit, error, paint, paint_level,
                     printable_doc, table)
from ..core.fabric import DOWN, UP
from ..core.states import BAD, Level, health_of, state_of, worst
from .coordinator_client import Usage, call, client_args, output_args, watch
from .times import age, parse_since, span, when


def register(sub: argparse._SubParsersAction) -> None:
    """status, agents, links, events (`paths HOST` is registered by paths.py)."""
    st = sub.add_parser("status", help="fleet health at a glance (from the coordinator)",
                        description="Agents, paths by state, localized faults, drains. Exit 0 healthy, 1 degraded, "
                                    "2 a localized fault or a lost agent, 3 coordinator unreachable or token refused.")
    output_args(st)
    st.set_defaults(func=lambda a: watch(a, _status))

    ag = sub.add_parser("agents", help="every agent the coordinator knows: up or lost, last report, paths, version",
                        description="One row per registered agent. An agent is lost when it has not reported for "
                                    "the coordinator's --agent-timeout-s (it keeps failing over locally if it runs, "
                                    "but the coordinator no longer sees its paths). Exit 0 every agent up, 2 an agent "
                                    "lost (as `linkpass status` counts it), 3 coordinator unreachable or token "
                                    "refused.")
    output_args(ag)
    ag.add_argument("--lost", action="store_true", help="only lost agents")
    ag.set_defaults(func=lambda a: watch(a, _agents))

    lk = sub.add_parser("links", help="per fabric link: health, localized faults (with direction), drains",
                        description="Exit 2 if a link is localized as faulty, 1 if one is drained or not watched "
                                    "by any probe in some direction, 3 coordinator unreachable or token refused.")
    output_args(lk)
    lk.add_argument("--problems", action="store_true", help="only links that are not ok")
    lk.set_defaults(func=lambda a: watch(a, _links))

    ev = sub.add_parser("events", help="history: detections, localizations, drains, refusals (who, why, when)",
                        description="The coordinator's history, oldest first. Exit 0, or 3 coordinator unreachable, "
                                    "token refused or a bad --since.")
    output_args(ev, watch=False)
    ev.add_argument("--since", default="1h", help="how far back: 30s, 15m, 2h, 7d, or an ISO time (default 1h)")
    ev.add_argument("--kind", default="", help="only these kinds, comma-separated (detection, recovery, "
                                               "localization, cleared, drain, undrain, refused, agent, coordinator)")
    ev.add_argument("--link", help="only events about this link (e.g. p0l0-p0s1)").complete = "links"
    ev.add_argument("--host", help="only events by or about this host and its paths (e.g. h3)").complete = "hosts"
    ev.add_argument("--limit", type=int, default=200)
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
    ev.set_defaults(func=_events)


# a link's health (the coordinator's `links` rows) as a level, like a path's state
_LINK_HEALTH = {"ok": Level.OK, "drained": Level.WARNING, "unwatched": Level.WARNING, "faulty": Level.CRITICAL}


def _level(word: str) -> Level | None:
    try:
        return Level(word)
    except ValueError:
        return None


# ---- status -----------------------------------------------------------------------------
def render_status(doc: dict, now: float, wide: bool = False) -> str:
    lines = [f"fleet {paint_level(doc['health'], _level(doc['health']))}: {doc['agents']} agents ({len(doc['agents_lost'])} lost), "
             f"{doc['paths']} paths, localized faults: {len(doc['findings'])}, drained links: {len(doc['drains'])}"]
    if doc.get("fabric"):
        f = doc["fabric"]
        lines.append(f"fabric: {f['hosts']} hosts, {f['planes']} planes, {f['links']} links")
    else:
        lines.append("fabric: no model loaded (start the coordinator with --testbed or --fabric to localize faults)")
    lines.append("paths: " + (", ".join(f"{n} {s}" for s, n in doc["paths_by_state"].items()) or "none reported"))
    if doc.get("shards"):
        away = [x for x in doc["shards"] if x["away"]]
        lines.append(f"coordinator shards: {len(doc['shards'])}" + (", all answering" if not away else ""))
        for x in away:
            since = "never heard from" if x["heard_s"] is None else f"not heard from for {span(x['heard_s'])}"
            lines.append(paint(f"  shard {x['shard']} ({x['url']}, {x['hosts']} hosts) is away: {since}", "red") +
                         " (its agents fail over locally and report again when it is back)")
        by_root = [str(x["shard"]) for x in doc["shards"] if x.get("localized_by") == "root"]
        if by_root:
            lines.append(f"  the root localizes the part of shard(s) {', '.join(by_root)} itself until they answer "
                         "(slower, same findings)")
    if doc["agents_lost"]:
        lines.append(paint("lost agents: " + ", ".join(doc["agents_lost"]), "red") +
                     " (no report for a while; they keep failing over locally if they run)")
    if doc["findings"]:
        lines.append("")
        lines.append(table(["faulty link", "direction", "confidence", "bad paths", "reporters"] + (["note"] if wide else []),
                           [[f["link"], _arrow(f), f"{f['confidence']:.2f}", f["bad_paths"], _reporters(f, wide)]
                            + ([f.get("note", "")] if wide else []) for f in doc["findings"]]))
    if doc["drains"]:
        lines.append("")
        lines.append(table(["drained link", "by", "for", "reason"],
                           [[d["link"], d["by"], age(now, d["since"]), d["reason"]] for d in doc["drains"]]))
    return "\n".join(lines)


def _reporters(f: dict, wide: bool) -> str:
    r = f["reporters"]
    return ",".join(r) if wide else str(len(r))


def _arrow(f: dict) -> str:
    a, b = f.get("a"), f.get("b")
    if not (a and b):
        return f["direction"]
    d = f["direction"]
    text = f"{a}>{b}" if d == UP else f"{b}>{a}" if d == DOWN else f"{a}<>{b} (either way)"
    if f.get("alternatives"):  # the evidence cannot tell these apart
        text += " or " + " or ".join(f.get("alternatives"))
    return text


def _status(args, client, now: float) -> int:
    doc = client.get("/v1/status")
    emit(doc, args.output, lambda d: render_status(d, now, args.output == "wide"))
    level = _level(doc["health"])
    return EXIT_UNKNOWN if level is None else EXIT_OF_LEVEL[level]


# ---- agents -----------------------------------------------------------------------------
def render_agents(rows: list[dict], wide: bool = False) -> str:
    """The coordinator's /v1/agents rows; `last_seen_s` is already an age (the coordinator's clock)."""
    headers = ["host", "state", "last seen", "paths", "version"] + (["agent id", "service"] if wide else [])
    out = []
    for r in rows:
        state = paint("lost", "red") if r["lost"] else paint("up", "green")
        cells = [r["name"], state, span(r["last_seen_s"]) + " ago", r["paths"], r.get("version") or "-"]
        if wide:
            cells += [r.get("agent_id", "-"), r.get("service") or "-"]
        out.append(cells)
    lost = sum(1 for r in rows if r["lost"])
    summary = f"{len(rows)} agents, {lost} lost" if rows else "no agent has registered"
    return table(headers, out) + "\n" + summary


def agents_exit(rows: list[dict]) -> int:
    """A lost agent is critical, as for the fleet's health (`linkpass status`): the coordinator
    no longer sees that host's paths, so it can neither localize through them nor plan for it."""
    return EXIT_CRITICAL if any(r["lost"] for r in rows) else EXIT_OK


def _agents(args, client, now: float) -> int:
    rows = client.get("/v1/agents")
    if args.lost:
        rows = [r for r in rows if r["lost"]]
    emit(rows, args.output, lambda d: render_agents(d, args.output == "wide"))
    return agents_exit(rows)


# ---- links ------------------------------------------------------------------------------
def render_links(rows: list[dict], now: float, wide: bool = False) -> str:
    headers = ["link", "tier", "plane", "health", "fault", "drained"] + (["paths up good/bad", "paths down good/bad",
                                                                           "reason"] if wide else [])
    out = []
    for r in rows:
        fault = ", ".join(f"{_arrow({**f, 'a': r['a'], 'b': r['b']})} ({f['confidence']:.2f})"
                          for f in r["faults"]) or "-"
        drain = r["drain"]
        cells = [r["link"], r["tier"], r["plane"], paint_level(r["health"], _LINK_HEALTH.get(r["health"])), fault,
                 f"{drain['by']}, {age(now, drain['since'])}" if drain else "-"]
        if wide:
            cells += [f"{r['paths_up']['good']}/{r['paths_up']['bad']}", f"{r['paths_down']['good']}/{r['paths_down']['bad']}",
                      drain["reason"] if drain else "-"]
        out.append(cells)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["health"]] = counts.get(r["health"], 0) + 1
    return table(headers, out) + "\n" + f"{len(rows)} links: " + ", ".join(f"{n} {h}" for h, n in sorted(counts.items()))


def links_exit(rows: list[dict]) -> int:
    return EXIT_OF_LEVEL[worst(_LINK_HEALTH.get(r["health"]) for r in rows)]


def _links(args, client, now: float) -> int:
    rows = client.get("/v1/links", problems="1" if args.problems else None)
    emit(rows, args.output, lambda d: render_links(d, now, args.output == "wide"))
    return links_exit(rows)


def add_coordinator_paths_args(p: argparse.ArgumentParser) -> None:
    """`linkpass paths HOST [PEER]` asks the coordinator (the local form is `linkpass paths [--peer]`)."""
    client_args(p, for_what=" (for `paths HOST`)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS", help="redraw every SECONDS")


# ---- paths HOST [PEER] ------------------------------------------------------------------
def render_paths(rows: list[dict], now: float, wide: bool = False) -> str:
    headers = ["host", "peer", "plane", "sport", "state", "reason", "updated"] + (["links"] if wide else [])
    out = [[r["host"], r["peer"], r["plane"], r["sport"], paint_level(r["state"], health_of(r["state"])),
            r["reason"] or "-", age(now, r["updated"]) + " ago"] + ([" ".join(r["links"]) or "-"] if wide else [])
           for r in rows]
    bad = sum(state_of(r["state"]) in BAD for r in rows)
    return table(headers, out) + "\n" + f"{len(rows)} paths, {bad} down, damped or degraded"


def paths_exit(rows: list[dict]) -> int:
    """The worst state's health, as `linkpass paths` (local) judges the same states."""
    return EXIT_OF_LEVEL[worst(health_of(r["state"]) for r in rows)]


def paths_from_coordinator(args) -> int:
    def one(client, now):
        rows = client.get("/v1/paths", host=args.host, peer=args.peer)
        emit(rows, args.output, lambda d: render_paths(d, now, args.output == "wide"))
        return paths_exit(rows)
    return watch(args, lambda a, c, now: one(c, now))


def _summary(e: dict) -> str:
    d = e["detail"]
    k = e["kind"]
    if k == "detection" and d.get("summary"):
        return (f"{d.get('detections')} detections and {d.get('recoveries')} recoveries more in "
                f"{d.get('window_s'):g} s, counted together")
    if k in ("detection", "recovery"):
        return f"{d.get('state')} {d.get('reason') or ''} (peer {d.get('peer')}, plane {d.get('plane')})".replace("  ", " ")
    if k == "localization":
        return f"faulty {_arrow(d)}, confidence {d.get('confidence', 0):.2f}, {d.get('bad_paths')} bad paths " \
               f"from {len(d.get('reporters', ()))} reporters" + (f"; {d['note']}" if d.get("note") else "")
    if k == "drain":
        timed = f", for {span(d['for_s'])}" if d.get("for_s") else ""
        return (f"drained: {d.get('reason')} ({d.get('paths_moved')} paths on {len(d.get('hosts', []))} hosts "
                f"move{timed})")
    if k == "undrain":
        return (f"undrained after {d.get('drained_for_s')} s (drained by {d.get('drained_by')})"
                + (f"; {d['note']}" if d.get("note") else ""))
    if k == "refused":
        return f"{d.get('action')} refused: {d.get('why')}"
    return ", ".join(f"{a}={b}" for a, b in sorted(d.items()))


def render_events(rows: list[dict], wide: bool = False) -> str:
    headers = ["time (UTC)", "kind", "who", "what", "detail"]
    return table(headers, [[when(e["ts"]), paint(e["kind"], "red" if e["kind"] in ("localization", "refused")
                                                   else "dim" if e["kind"] == "recovery" else "bold"),
                            e["actor"], e["subject"], _summary(e) if not wide else json.dumps(e["detail"], sort_keys=True)]
                           for e in rows])


def _events(args) -> int:
    try:
        since = parse_since(args.since, time.time())
    except Usage as exc:
        return error(str(exc))

    def run(client):
        rows = client.get("/v1/events", since=since, limit=args.limit, kind=args.kind or None, link=args.link,
                          host=args.host)
        if not args.follow:
            emit(rows, args.output, lambda d: render_events(d, args.output == "wide"))
            return EXIT_OK
        last = rows[-1]["id"] if rows else 0
        _print_stream(rows, args.output, header=True)
        try:
            while True:
                time.sleep(1.0)
                new = client.get("/v1/events", after=last, limit=1000, kind=args.kind or None, link=args.link,
                                 host=args.host)
                if new:
                    last = new[-1]["id"]
                    _print_stream(new, args.output, header=False)
        except KeyboardInterrupt:
            return EXIT_OK
    return call(args, run)


def _print_stream(rows, fmt, header: bool) -> None:
    if fmt in ("json", "yaml"):
        for e in rows:  # one JSON document per line: `| jq` friendly
            print(json.dumps(e, default=str))
        return
    text = render_events(printable_doc(rows), fmt == "wide")
    lines = text.splitlines()
    print("\n".join(lines if header else lines[1:]))
