"""The on-call commands that ask the coordinator: status, links, paths HOST, events, drain, undrain,
and `linkpass coordinator` itself.

Every command: `-o table|wide|json|yaml`, `--coordinator URL` ($LINKPASS_COORDINATOR, default
https://127.0.0.1:9470), `--token-file` ($LINKPASS_TOKEN; on the coordinator's host the local
read-only token is used by default; drains need an operator token), `--ca-file` and, for mutual
TLS, `--cert-file`/`--key-file` (on the coordinator's host its lab CA's by default),
`--insecure-http` to allow an http:// URL. Exit codes: 0 ok, 1 warning, 2 critical or refused,
3 unknown (coordinator unreachable, TLS failed, bad usage).
Renderers are pure functions of the JSON documents (and `now`), checked against golden files.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sys
import time

from ..core.constants import COORDINATOR_LISTEN, COORDINATOR_PORT, COORDINATOR_URL
from .output import (EXIT_CRITICAL, EXIT_OF_LEVEL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING, FORMATS, emit, paint,
                     paint_level, table)
from ..core.fabric import DOWN, UP
from ..core.states import BAD, Level, health_of, state_of, worst
from ..observe.log import RANK

# a link's health (the coordinator's `links` rows) as a level, like a path's state
_LINK_HEALTH = {"ok": Level.OK, "drained": Level.WARNING, "unwatched": Level.WARNING, "faulty": Level.CRITICAL}


def _level(word: str) -> Level | None:
    try:
        return Level(word)
    except ValueError:
        return None


def register(sub: argparse._SubParsersAction) -> None:
    def common(p, watch: bool = True):
        p.add_argument("-o", "--output", choices=FORMATS, default="table")
        p.add_argument("--coordinator", metavar="URL", help="coordinator endpoint (default $LINKPASS_COORDINATOR "
                                                            f"or {COORDINATOR_URL})")
        p.add_argument("--token-file", help="file holding your token (default $LINKPASS_TOKEN)")
        tls_args(p)
        if watch:
            p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                           help="redraw every SECONDS (default 2) until Ctrl-C")

    co = sub.add_parser("coordinator", help="run the coordinator (a Ray actor) that sees the whole fleet",
                        description="Start the coordinator as a detached, named Ray actor. Without --address it "
                                    "starts a local Ray instance and stays in the foreground until Ctrl-C; with "
                                    "--address it joins that Ray cluster, makes sure the actor runs, and returns.")
    co.add_argument("--address", help="Ray cluster to join (e.g. ray://head:10001 or auto); default: a local Ray")
    co.add_argument("--listen", default=None, help=f"HOST:PORT of the endpoint (default {COORDINATOR_LISTEN}; "
                                                   f"0.0.0.0:{COORDINATOR_PORT} with --testbed, so namespaced agents reach it)")
    co.add_argument("--state-dir", default=None, help="SQLite database and tokens (default /var/lib/linkpass/coordinator)")
    src = co.add_mutually_exclusive_group()
    src.add_argument("--testbed", metavar="PREFIX", help="use this running testbed's fabric as the fleet model")
    src.add_argument("--fabric", metavar="FILE", help="fleet model JSON (links, hosts, addresses)")
    co.add_argument("--max-drain-share", type=float, default=0.05,
                    help="blast-radius guard: share of one tier's links in one plane that may be drained (default 0.05)")
    co.add_argument("--agent-timeout-s", type=float, default=None,
                    help="an agent silent this long is reported lost (default 10)")
    co.add_argument("--agent-expire-s", type=float, default=None,
                    help="an agent silent this long is forgotten, as by `decommission` (default 86400)")
    co.add_argument("--event-retention-days", type=float, default=None,
                    help="events older than this are deleted (default 90)")
    co.add_argument("--event-retention-count", type=int, default=None,
                    help="at most this many events are kept, the newest (default 1000000)")
    co.add_argument("--max-body-bytes", type=int, default=None,
                    help="largest request body accepted; larger ones get 413 (default 4194304)")
    co.add_argument("--stop", action="store_true", help="stop the running coordinator actor (with --address)")
    co.add_argument("--max-seconds", type=float, default=None, help="stop by itself after this long (foreground)")
    co.add_argument("--log-level", choices=tuple(RANK), default=None,
                    help="the coordinator writes log lines of this level and above (default $LINKPASS_LOG_LEVEL or "
                         "info); in the foreground they are copied from <state-dir>/coordinator.log to stderr")
    tls = co.add_argument_group("TLS", "HTTPS by default; without --tls-cert, a lab CA in <state-dir>/tls is made on "
                                       "first start (docs/security.md, TLS set-up)")
    tls.add_argument("--tls-cert", metavar="FILE", help="the endpoint's certificate (PEM; with --tls-key)")
    tls.add_argument("--tls-key", metavar="FILE", help="its private key (PEM)")
    tls.add_argument("--tls-ca", metavar="FILE", help="CA of client certificates (default: the lab CA's)")
    tls.add_argument("--tls-san", metavar="NAMES", help="more names/addresses for the lab CA's coordinator "
                                                      "certificate, comma-separated (--testbed adds its address)")
    tls.add_argument("--require-client-cert", action="store_true",
                     help="mutual TLS: refuse clients without a certificate the CA signed")
    tls.add_argument("--insecure-http", action="store_true",
                     help="serve plain HTTP: tokens cross the network in cleartext (a warning is logged)")
    co.set_defaults(func=run_coordinator)
    actions = co.add_subparsers(dest="coordinator_action", metavar="ACTION",
                                title="actions (without one, the coordinator itself runs)")
    tk = actions.add_parser("token", help="make the token that lets the agent on HOST register and report as HOST",
                            description="Derives HOST's agent token from the fleet's agent secret, at HOST's current "
                                        "epoch (run it where the coordinator's state directory is). The token speaks "
                                        "for HOST only: put it in that host's agent token_file, mode 0600. With "
                                        "--revoke, every token HOST had so far is refused from now on (the running "
                                        "coordinator within a second, a restarted one too) and the new one printed; "
                                        "an agent reads its token_file again when refused, so replacing the file is "
                                        "enough. Exit 0 done, 3 no secret, bad host name or usage.")
    tk.add_argument("host", help="the agent's name, as in its config (e.g. h3)")
    tk.add_argument("--state-dir", default=None, help="the coordinator's state (default /var/lib/linkpass/coordinator)")
    tk.add_argument("--out", metavar="FILE", help="write the token to FILE (mode 0600) instead of printing it")
    tk.add_argument("--revoke", action="store_true",
                    help="refuse every earlier token of HOST (stolen, leaked, host rebuilt) and print the new one")
    tk.add_argument("--reason", help="why you revoke (recorded in the history with your user name)")
    tk.set_defaults(func=_token)
    dc = actions.add_parser("decommission", help="forget an agent and its paths (operators only)",
                            description="Removes HOST's agent and the paths it reported from the coordinator (a host "
                                        "that still runs an agent registers again). Exit 0 done, 2 refused, "
                                        "3 unreachable or unknown host.")
    dc.add_argument("host", help="the agent's name (`linkpass status -o wide` lists lost agents)")
    dc.add_argument("--reason", required=True, help="why (recorded with your name)")
    dc.add_argument("--dry-run", action="store_true", help="show what would be removed; change nothing")
    common(dc, watch=False)
    dc.set_defaults(func=_decommission)

    st = sub.add_parser("status", help="fleet health at a glance (from the coordinator)",
                        description="Agents, paths by state, localized faults, drains. Exit 0 healthy, 1 degraded, "
                                    "2 a localized fault or a lost agent, 3 coordinator unreachable.")
    common(st)
    st.set_defaults(func=lambda a: _watch(a, _status))

    lk = sub.add_parser("links", help="per fabric link: health, localized faults (with direction), drains",
                        description="Exit 2 if a link is localized as faulty, 1 if one is drained or not watched "
                                    "by any probe in some direction.")
    common(lk)
    lk.add_argument("--problems", action="store_true", help="only links that are not ok")
    lk.set_defaults(func=lambda a: _watch(a, _links))

    ev = sub.add_parser("events", help="history: detections, localizations, drains, refusals (who, why, when)")
    common(ev, watch=False)
    ev.add_argument("--since", default="1h", help="how far back: 30s, 15m, 2h, 7d, or an ISO time (default 1h)")
    ev.add_argument("--kind", default="", help="only these kinds, comma-separated (detection, recovery, "
                                               "localization, cleared, drain, undrain, refused, agent, coordinator)")
    ev.add_argument("--limit", type=int, default=200)
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
    ev.set_defaults(func=_events)

    for verb in ("drain", "undrain"):
        d = sub.add_parser(verb, help=("steer every agent away from a link (operators only; guarded)" if verb == "drain"
                                       else "let agents use a drained link again (operators only)"),
                           description="Exit 0 done, 1 --dry-run found it would be refused, 2 refused (guard, role "
                                       "or token), 3 coordinator unreachable.")
        d.add_argument("link", help="link name, e.g. p0l0-p0s1 or h3-p1l1 (`linkpass links` lists them)")
        if verb == "drain":
            d.add_argument("--reason", required=True, help="why (recorded with your name; on-call reads it later)")
            d.add_argument("--force", action="store_true",
                           help="record the drain even if some host pair would be left without a usable path")
        d.add_argument("--dry-run", action="store_true", help="show which hosts and paths would move; change nothing")
        common(d, watch=False)
        d.set_defaults(func=_drain, verb=verb)


def add_coordinator_paths_args(p: argparse.ArgumentParser) -> None:
    """`linkpass paths HOST [PEER]` asks the coordinator (the local form is `linkpass paths [--peer]`)."""
    p.add_argument("--coordinator", metavar="URL", help="coordinator endpoint, for `paths HOST`")
    p.add_argument("--token-file", help="file holding your token (default $LINKPASS_TOKEN)")
    tls_args(p)
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS", help="redraw every SECONDS")


def tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca-file", help="CA the coordinator's certificate must chain to (default $LINKPASS_CA_FILE; on "
                                     "its host its lab CA; else the system's)")
    p.add_argument("--cert-file", help="your client certificate, for mutual TLS (default $LINKPASS_CERT_FILE)")
    p.add_argument("--key-file", help="its private key (default $LINKPASS_KEY_FILE)")
    p.add_argument("--insecure-http", action="store_true",
                   help="allow an http:// coordinator URL (your token crosses the network in cleartext)")


# ---- plumbing ---------------------------------------------------------------------------
def _client(args):
    from ..coordinator.client import Client, cli_tls, cli_token, cli_url

    token_file = getattr(args, "token_file", None)
    if token_file and not os.path.exists(token_file):
        raise _Usage(f"--token-file {token_file}: no such file")
    url = cli_url(getattr(args, "coordinator", None))
    insecure = bool(getattr(args, "insecure_http", False))
    tls = None if url.startswith("http://") else cli_tls(args.ca_file, args.cert_file, args.key_file)
    client = Client(url, cli_token(token_file), tls=tls, insecure_http=insecure)
    if client.tls is None:
        print(f"linkpass: {paint('warning:', 'yellow', sys.stderr)} plain HTTP to {url} (--insecure-http): your "
              "token crosses the network in cleartext", file=sys.stderr)
    return client


class _Usage(Exception):
    pass


def _call(args, fn):
    """Run fn(client) -> exit code, turning the usual failures into one clear line each."""
    from ..coordinator.client import Refusal, TlsFailure, Unreachable

    try:
        client = _client(args)
    except (_Usage, ValueError) as exc:  # tls.TlsError is a ValueError too
        print(f"linkpass: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN
    try:
        return fn(client)
    except TlsFailure as exc:
        print(f"linkpass: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN
    except Unreachable as exc:
        print(f"linkpass: {exc}. Is it running (`linkpass coordinator`)? Set --coordinator or $LINKPASS_COORDINATOR "
              "to its address.", file=sys.stderr)
        return EXIT_UNKNOWN
    except Refusal as exc:
        print(f"linkpass: {paint('refused:', 'red', sys.stderr)} {exc} (HTTP {exc.status})", file=sys.stderr)
        return EXIT_CRITICAL if exc.status in (401, 403, 409) else EXIT_UNKNOWN
    finally:
        client.close()


def _watch(args, fn) -> int:
    if not getattr(args, "watch", None):
        return _call(args, lambda c: fn(args, c, time.time()))
    code = EXIT_UNKNOWN
    try:
        while True:
            if sys.stdout.isatty():
                print("\033[2J\033[H", end="")
            code = _call(args, lambda c: fn(args, c, time.time()))
            print(paint(f"every {args.watch:g} s, Ctrl-C to stop - {time.strftime('%H:%M:%S')}", "dim"))
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return code


def _age(now: float, ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, now - ts)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h" if s < 172800 else f"{s / 86400:.0f}d"


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


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
                           [[d["link"], d["by"], _age(now, d["since"]), d["reason"]] for d in doc["drains"]]))
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
                 f"{drain['by']}, {_age(now, drain['since'])}" if drain else "-"]
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


# ---- paths HOST [PEER] ------------------------------------------------------------------
def render_paths(rows: list[dict], now: float, wide: bool = False) -> str:
    headers = ["host", "peer", "plane", "sport", "state", "reason", "updated"] + (["links"] if wide else [])
    out = [[r["host"], r["peer"], r["plane"], r["sport"], paint_level(r["state"], health_of(r["state"])),
            r["reason"] or "-", _age(now, r["updated"]) + " ago"] + ([" ".join(r["links"]) or "-"] if wide else [])
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
    return _watch(args, lambda a, c, now: one(c, now))


# ---- events -----------------------------------------------------------------------------
def parse_since(text: str, now: float) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text and text[-1] in units and text.isascii() and text[:-1].replace(".", "", 1).isdigit():
        return now - float(text[:-1]) * units[text[-1]]
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise _Usage(f"--since {text!r}: use 30s, 15m, 2h, 7d or an ISO time like 2026-11-30T14:00") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


def _summary(e: dict) -> str:
    d = e["detail"]
    k = e["kind"]
    if k in ("detection", "recovery"):
        return f"{d.get('state')} {d.get('reason') or ''} (peer {d.get('peer')}, plane {d.get('plane')})".replace("  ", " ")
    if k == "localization":
        return f"faulty {_arrow(d)}, confidence {d.get('confidence', 0):.2f}, {d.get('bad_paths')} bad paths " \
               f"from {len(d.get('reporters', ()))} reporters" + (f"; {d['note']}" if d.get("note") else "")
    if k == "drain":
        return f"drained: {d.get('reason')} ({d.get('paths_moved')} paths on {len(d.get('hosts', []))} hosts move)"
    if k == "undrain":
        return f"undrained after {d.get('drained_for_s')} s (drained by {d.get('drained_by')})"
    if k == "refused":
        return f"{d.get('action')} refused: {d.get('why')}"
    return ", ".join(f"{a}={b}" for a, b in sorted(d.items()))


def render_events(rows: list[dict], wide: bool = False) -> str:
    headers = ["time (UTC)", "kind", "who", "what", "detail"]
    return table(headers, [[_when(e["ts"]), paint(e["kind"], "red" if e["kind"] in ("localization", "refused")
                                                   else "dim" if e["kind"] == "recovery" else "bold"),
                            e["actor"], e["subject"], _summary(e) if not wide else json.dumps(e["detail"], sort_keys=True)]
                           for e in rows])


def _events(args) -> int:
    try:
        since = parse_since(args.since, time.time())
    except _Usage as exc:
        print(f"linkpass: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN

    def run(client):
        rows = client.get("/v1/events", since=since, limit=args.limit, kind=args.kind or None)
        if not args.follow:
            emit(rows, args.output, lambda d: render_events(d, args.output == "wide"))
            return EXIT_OK
        last = rows[-1]["id"] if rows else 0
        _print_stream(rows, args.output, header=True)
        try:
            while True:
                time.sleep(1.0)
                new = client.get("/v1/events", after=last, limit=1000, kind=args.kind or None)
                if new:
                    last = new[-1]["id"]
                    _print_stream(new, args.output, header=False)
        except KeyboardInterrupt:
            return EXIT_OK
    return _call(args, run)


def _print_stream(rows, fmt, header: bool) -> None:
    if fmt in ("json", "yaml"):
        for e in rows:  # one JSON document per line: `| jq` friendly
            print(json.dumps(e, default=str))
        return
    text = render_events(rows, fmt == "wide")
    lines = text.splitlines()
    print("\n".join(lines if header else lines[1:]))


# ---- drain / undrain --------------------------------------------------------------------
def render_drain(doc: dict, verb: str) -> str:
    imp = doc.get("impact", {})
    head = (f"{'would ' if doc.get('dry_run') else ''}{verb} {doc['link']}" if doc.get("changed", doc.get("dry_run"))
            else f"{doc['link']}: nothing to do (already {'drained' if verb == 'drain' else 'in use'})")
    lines = [head]
    if doc.get("refused"):
        lines = [paint(f"would be REFUSED: {doc['refused']}", "red")]
    if imp:
        lines.append(f"hosts whose paths move: {', '.join(imp.get('hosts', [])) or 'none'} "
                     f"({imp.get('paths_moved', 0)} paths)")
        stranded = imp.get("stranded", [])
        lines.append(paint(f"host pairs left without a usable path: {', '.join(stranded)}", "red") if stranded
                     else "every host pair keeps a usable path")
    return "\n".join(lines)


def _drain(args) -> int:
    body = {"link": args.link, "dry_run": args.dry_run}
    if args.verb == "drain":
        body.update(reason=args.reason, force=args.force)

    def run(client):
        doc = client.post(f"/v1/{args.verb}", body)
        emit(doc, args.output, lambda d: render_drain(d, args.verb))
        return EXIT_WARNING if doc.get("refused") else EXIT_OK
    return _call(args, run)


# ---- decommission, agent tokens ----------------------------------------------------------
def render_decommission(doc: dict) -> str:
    verb = "would forget" if doc.get("dry_run") else "forgot"
    return (f"{verb} agent {doc['host']} and the {doc['paths']} paths it reported"
            + (" (it was lost)" if doc.get("was_lost") else " (it was still reporting: if it runs, it registers again)"))


def _decommission(args) -> int:
    body = {"host": args.host, "reason": args.reason, "dry_run": args.dry_run}

    def run(client):
        doc = client.post("/v1/decommission", body)
        emit(doc, args.output, render_decommission)
        return EXIT_OK
    return _call(args, run)


def _token(args) -> int:
    """Local to the coordinator's host, like issuing: who may revoke is who holds the state
    directory (and so the secret that mints every token), and it works with the coordinator down.
    The revocation goes into the coordinator's store, which the running coordinator reads every
    tick; the token printed is of the host's current epoch."""
    from ..coordinator.auth import MAX_EPOCH, SECRET_FILE, AuthError, agent_token, read_agent_secret, write_private
    from ..coordinator.runner import DEFAULT_STATE_DIR
    from ..coordinator.store import DB_FILE, Store, StoreError

    if args.reason is not None and not args.revoke:
        print("linkpass: --reason: only with --revoke (it says why the host's tokens were revoked)", file=sys.stderr)
        return EXIT_UNKNOWN
    state = args.state_dir or DEFAULT_STATE_DIR
    path, db = os.path.join(state, SECRET_FILE), os.path.join(state, DB_FILE)
    store = None
    try:
        secret = read_agent_secret(path)
        agent_token(secret, args.host)  # the host name is checked before anything is written
        if args.revoke or os.path.exists(db):
            store = Store(db)
        if args.revoke:
            epoch = store.revoke_agent(args.host, _local_user(), args.reason or "revoked by `linkpass coordinator "
                                       "token HOST --revoke`", time.time(), MAX_EPOCH)
        else:
            epoch = store.agent_epochs().get(args.host, 0) if store is not None else 0
        token = agent_token(secret, args.host, epoch)
    except OSError as exc:
        print(f"linkpass: {exc.filename or path}: {exc.strerror}; run this where the coordinator keeps its state "
              "(--state-dir), after it has started once", file=sys.stderr)
        return EXIT_UNKNOWN
    except (AuthError, StoreError) as exc:
        print(f"linkpass: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN
    finally:
        if store is not None:
            store.close()
    if args.out:
        write_private(args.out, token + "\n")
        print(f"wrote the agent token for {args.host} to {args.out}")
    else:
        print(token)
    if args.revoke:
        print(f"revoked every earlier agent token of {args.host} (it is at epoch {epoch} now): the coordinator "
              f"refuses them within a second, and after restarts. Put the new token in {args.host}'s agent "
              "token_file (mode 0600); the agent takes it at its next retry, within 5 s", file=sys.stderr)
    return EXIT_OK


def _local_user() -> str:
    """Who revoked, for the history: the sudo caller if there is one, else this process's user."""
    import getpass

    try:
        user = os.environ.get("SUDO_USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, no login name
        user = f"uid {os.getuid()}"
    return f"{user} (local)"


# ---- the coordinator process -------------------------------------------------------------
def _testbed_model(prefix: str) -> dict:
    """`--testbed PREFIX`: that running testbed's fabric, as the coordinator's model."""
    from ..core.fabric import from_testbed
    from ..testbed.build import load_fabric  # the one testbed-facing option of a fleet command

    return from_testbed(load_fabric(prefix)).to_dict()


def _tls_settings(args) -> dict:
    """The TLS part of the coordinator's settings (runner.py); --testbed adds its management address."""
    if args.insecure_http:
        given = [flag for flag, v in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca),
                                      ("--tls-san", args.tls_san), ("--require-client-cert", args.require_client_cert)) if v]
        if given:
            raise _Usage(f"{given[0]}: not used with --insecure-http (plain HTTP); remove one of the two")
        return {"insecure_http": True}
    sans = [s for s in (args.tls_san or "").split(",") if s.strip()]
    if args.testbed:
        from ..testbed.build import load_fabric

        sans.append(load_fabric(args.testbed).mgmt_root_addr)
    return {"tls_cert_file": args.tls_cert, "tls_key_file": args.tls_key, "tls_ca_file": args.tls_ca,
            "tls_san": sans, "require_client_cert": args.require_client_cert}


def run_coordinator(args) -> int:
    from ..coordinator import ray_actor
    from ..coordinator.runner import DEFAULT_STATE_DIR, log_path
    from ..coordinator.tls import SERVER, lab_dir, lab_paths
    from ..observe.log import Follower, level_from_env

    try:
        tls = _tls_settings(args)
        log_level = level_from_env(args.log_level)  # resolved here: the actor's process has another environment
    except (_Usage, ValueError) as exc:
        print(f"linkpass: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN
    settings = {"state_dir": args.state_dir or DEFAULT_STATE_DIR, "fabric": args.fabric,
                "fabric_model": _testbed_model(args.testbed) if args.testbed else None,
                "listen": args.listen or (f"0.0.0.0:{COORDINATOR_PORT}" if args.testbed else COORDINATOR_LISTEN),
                "max_drain_share": args.max_drain_share, "log_level": log_level, **tls}
    for name in ("agent_timeout_s", "agent_expire_s", "event_retention_count", "max_body_bytes"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.event_retention_days is not None:
        settings["event_retention_s"] = args.event_retention_days * 86400
    from ..coordinator.runner import check_settings
    from ..coordinator.requests import CoordinatorError

    try:
        check_settings(settings)  # refused here, by name, rather than inside the Ray actor
    except CoordinatorError as exc:
        print(f"linkpass: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN
    print(f"starting {'a local Ray instance' if not args.address else 'on Ray at ' + args.address} ...", flush=True)
    ray_actor.connect(args.address)
    follower = None
    try:
        if args.stop:
            handle = ray_actor.existing()
            if handle is None:
                print("no coordinator actor is running")
                return EXIT_WARNING
            ray_actor.stop(handle)
            print("coordinator stopped")
            return EXIT_OK
        if not args.address:
            # the actor's log lines from now on, copied to this process's stderr (under systemd, its
            # journal); detached on a cluster (--address), they stay in that file on the actor's node
            follower = Follower(log_path(settings)).start()
        handle, url = ray_actor.ensure(settings)
        print(f"coordinator up: {url} (Ray actor {ray_actor.NAMESPACE}/{ray_actor.ACTOR_NAME}, pid "
              f"{ray_actor.actor_pid(handle)})")
        print(f"tokens: {settings['state_dir']}/{{reader,operator}}.token; agents: `linkpass coordinator token "
              f"HOST --state-dir {settings['state_dir']}` (one each); database: {settings['state_dir']}/coordinator.db")
        if args.insecure_http:
            print(paint("warning: plain HTTP (--insecure-http): tokens cross the network in cleartext", "yellow"))
        else:
            print(f"TLS: certificate {settings.get('tls_cert_file') or lab_paths(lab_dir(settings['state_dir']), SERVER)[0]}"
                  f"; clients verify it with {settings.get('tls_ca_file') or lab_paths(lab_dir(settings['state_dir']), 'ca')[0]}"
                  + ("; client certificates required" if args.require_client_cert else ""))
        if args.address:
            return EXIT_OK  # detached: it lives on in the cluster
        end = None if args.max_seconds is None else time.monotonic() + args.max_seconds
        print("running; Ctrl-C stops it", flush=True)
        def on_term(_sig, _frame):  # ray.init replaced the CLI's handler: a stop is a Ctrl-C
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_term)
        try:
            while end is None or time.monotonic() < end:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        ray_actor.stop(handle)
        return EXIT_OK
    finally:
        if follower is not None:
            follower.stop()  # after the actor stopped: its last lines too
        if not args.address:
            ray_actor.shutdown()
