"""The on-call commands that ask the coordinator: status, agents, links, paths HOST, events, drain,
undrain, and `linkpass coordinator` itself.

Every command: `-o table|wide|json|yaml`, `--coordinator URL`, `--token-file FILE`, `--ca-file`
and, for mutual TLS, `--cert-file`/`--key-file`, each also from the environment and a context of
the CLI's config file (`--context`, `--config-file`; settings.py has the precedence), and
`--insecure-http` to allow an http:// URL. Drains need an operator token. Exit codes: 0 ok,
1 warning, 2 critical (a write the coordinator's guard refused, too), 3 unknown (coordinator
unreachable, TLS or token refused, bad usage or config).
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
from .output import (EXIT_CRITICAL, EXIT_OF_LEVEL, EXIT_OK, EXIT_UNKNOWN, EXIT_WARNING, FORMATS, CliError, emit,
                     error, paint, paint_level, printable_doc, table, warn)
from ..core.fabric import DOWN, UP
from ..core.states import BAD, Level, health_of, state_of, worst
from ..observe.log import RANK
from .files import absolute

# a link's health (the coordinator's `links` rows) as a level, like a path's state
_LINK_HEALTH = {"ok": Level.OK, "drained": Level.WARNING, "unwatched": Level.WARNING, "faulty": Level.CRITICAL}


def _level(word: str) -> Level | None:
    try:
        return Level(word)
    except ValueError:
        return None


def register(sub: argparse._SubParsersAction) -> None:
    def common(p, watch: bool = True):
        p.add_argument("-o", "--output", choices=FORMATS, default="table", metavar="FORMAT",
                       help="table (default), wide (more columns), json or yaml: a document on stdout, "
                            "errors on stderr")
        client_args(p)
        if watch:
            p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                           help="redraw every SECONDS (default 2) until Ctrl-C")

    co = sub.add_parser("coordinator", help="run the coordinator (a Ray actor) that sees the whole fleet",
                        description="Start the coordinator as a detached, named Ray actor. Without --address it "
                                    "starts a local Ray instance and stays in the foreground until Ctrl-C; with "
                                    "--address it joins that Ray cluster, makes sure the actor runs, and returns.")
    co.add_argument("--address", help="Ray cluster to join (auto: this node's; HOST:6379 from a Ray node; ray://HOST:10001 "
                    "with ray[client]); default: a local Ray")
    co.add_argument("--listen", default=None, help=f"HOST:PORT of the endpoint (default {COORDINATOR_LISTEN}; "
                                                   f"0.0.0.0:{COORDINATOR_PORT} with --testbed, so namespaced agents reach it)")
    co.add_argument("--state-dir", default=None, type=absolute, help="SQLite database and tokens (default /var/lib/linkpass/coordinator)")
    co.add_argument("--shards", type=int, default=None, metavar="S",
                    help="coordinator shards agents report to (default 1). With S > 1 a root actor and S shard "
                         "actors, each with its own endpoint (ports after --listen's, or --shard-listen); agents "
                         "configured with the root's address are sent to their shard. Needs a fabric model")
    co.add_argument("--shard-listen", action="append", default=None, metavar="HOST:PORT",
                    help="a shard's endpoint, once per shard in order (default: the root's host, the ports after its own)")
    co.add_argument("--store", metavar="URL", default=None,
                    help="keep the state in PostgreSQL instead of SQLite in --state-dir: postgresql://USER@HOST:PORT/DB "
                         "(a server every Ray node reaches, so a restarted actor finds its state anywhere)")
    co.add_argument("--store-password-file", metavar="FILE", type=absolute, default=None,
                    help="the --store user's password (one line, mode 0600; never in the URL)")
    co.add_argument("--store-tls-ca", metavar="FILE", type=absolute, default=None,
                    help="the CA (PEM) that signed the --store server's TLS certificate (default: the system's "
                         "trust store); the store is reached over TLS only, its certificate checked against the "
                         "CA and the URL's host")
    co.add_argument("--store-insecure-plaintext", action="store_true",
                    help="reach the --store server without TLS: the state crosses the network unencrypted, to a "
                         "server no certificate vouches for (a warning is logged)")
    src = co.add_mutually_exclusive_group()
    src.add_argument("--testbed", metavar="PREFIX", help="use this running testbed's fabric as the fleet model")
    src.add_argument("--fabric", metavar="FILE", type=absolute, help="fleet model JSON (links, hosts, addresses)")
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
    tls.add_argument("--tls-cert", metavar="FILE", type=absolute, help="the endpoint's certificate (PEM; with --tls-key)")
    tls.add_argument("--tls-key", metavar="FILE", type=absolute, help="its private key (PEM)")
    tls.add_argument("--tls-ca", metavar="FILE", type=absolute, help="CA of client certificates (default: the lab CA's)")
    tls.add_argument("--tls-san", metavar="NAMES", help="more names/addresses for the lab CA's coordinator "
                                                      "certificate, comma-separated (--testbed adds its address)")
    tls.add_argument("--require-client-cert", action="store_true",
                     help="mutual TLS: refuse clients without a certificate the CA signed")
    tls.add_argument("--insecure-http", action="store_true",
                     help="serve plain HTTP: tokens cross the network in cleartext (a warning is logged)")
    co.set_defaults(func=run_coordinator)
    actions = co.add_subparsers(dest="coordinator_action", metavar="ACTION",
                                title="actions (without one, the coordinator itself runs)")
    tk = actions.add_parser("token", help="tokens: an agent host's (token HOST), people's and systems' "
                                          "(token create NAME --role R | list | revoke NAME)",
                            usage="linkpass coordinator token HOST [--out FILE] [--revoke [--reason R]]\n"
                                  "       linkpass coordinator token create NAME --role reader|operator [--out FILE]\n"
                                  "       linkpass coordinator token list [-o table|json]\n"
                                  "       linkpass coordinator token revoke NAME",
                            description="Run where the coordinator's state directory is (--state-dir); works with "
                                        "the coordinator down. `token HOST` derives HOST's agent token from the "
                                        "fleet's agent secret, at HOST's current epoch: it speaks for HOST only; put "
                                        "it in that host's agent token_file, mode 0600. With --revoke every token "
                                        "HOST had so far is refused from now on (the running coordinator within a "
                                        "second) and the new one printed. `token create NAME --role operator` makes "
                                        "a token for a person (or a system, role reader), listed in tokens.yaml by "
                                        "its hash, printed once: drains and decommissions are recorded with NAME. "
                                        "`token list` shows the listed tokens and revoked hosts; `token revoke NAME` "
                                        "removes a listed token (refused from the coordinator's next tick). Exit 0 "
                                        "done, 3 no state, bad name or usage.")
    tk.add_argument("target", nargs="+", metavar="HOST | create NAME | list | revoke NAME",
                    help="an agent host (e.g. h3), or an action on listed tokens").complete = "hosts"
    tk.add_argument("--role", choices=("reader", "operator"), help="with create: what the token may do")
    tk.add_argument("-o", "--output", choices=("table", "json"), default="table", help="with list")
    tk.add_argument("--state-dir", default=None, type=absolute, help="the coordinator's state (default /var/lib/linkpass/coordinator)")
    tk.add_argument("--store", metavar="URL", default=None,
                    help="the coordinator's PostgreSQL store, when it keeps its state there (as its --store)")
    tk.add_argument("--store-password-file", metavar="FILE", type=absolute, default=None, help="that store user's password")
    tk.add_argument("--store-tls-ca", metavar="FILE", type=absolute, default=None, help="that store server's CA (as the coordinator's)")
    tk.add_argument("--store-insecure-plaintext", action="store_true",
                    help="reach that store without TLS (as the coordinator's)")
    tk.add_argument("--out", metavar="FILE", type=absolute, help="write the token to FILE (mode 0600) instead of printing it")
    tk.add_argument("--revoke", action="store_true",
                    help="refuse every earlier token of HOST (stolen, leaked, host rebuilt) and print the new one")
    tk.add_argument("--reason", help="why you revoke (recorded in the history with your user name)")
    tk.set_defaults(func=_token)
    oa = actions.add_parser("openapi", help="print the coordinator's HTTP API as OpenAPI 3.1 (JSON)",
                            description="The same document the coordinator serves at /v1/openapi.json, made from "
                                        "its route table; needs no coordinator. Exit 0.")
    oa.set_defaults(func=_openapi)
    dc = actions.add_parser("decommission", help="forget an agent and its paths (operators only)",
                            description="Removes HOST's agent and the paths it reported from the coordinator (a host "
                                        "that still runs an agent registers again). Exit 0 done, 3 coordinator "
                                        "unreachable, token refused (an operator's is needed) or unknown host.")
    dc.add_argument("host", help="the agent's name (`linkpass agents --lost` lists lost agents)").complete = "hosts"
    dc.add_argument("--reason", required=True, help="why (recorded with your name)")
    dc.add_argument("--dry-run", action="store_true", help="show what would be removed; change nothing")
    common(dc, watch=False)
    dc.set_defaults(func=_decommission)

    st = sub.add_parser("status", help="fleet health at a glance (from the coordinator)",
                        description="Agents, paths by state, localized faults, drains. Exit 0 healthy, 1 degraded, "
                                    "2 a localized fault or a lost agent, 3 coordinator unreachable or token refused.")
    common(st)
    st.set_defaults(func=lambda a: _watch(a, _status))

    ag = sub.add_parser("agents", help="every agent the coordinator knows: up or lost, last report, paths, version",
                        description="One row per registered agent. An agent is lost when it has not reported for "
                                    "the coordinator's --agent-timeout-s (it keeps failing over locally if it runs, "
                                    "but the coordinator no longer sees its paths). Exit 0 every agent up, 2 an agent "
                                    "lost (as `linkpass status` counts it), 3 coordinator unreachable or token "
                                    "refused.")
    common(ag)
    ag.add_argument("--lost", action="store_true", help="only lost agents")
    ag.set_defaults(func=lambda a: _watch(a, _agents))

    lk = sub.add_parser("links", help="per fabric link: health, localized faults (with direction), drains",
                        description="Exit 2 if a link is localized as faulty, 1 if one is drained or not watched "
                                    "by any probe in some direction, 3 coordinator unreachable or token refused.")
    common(lk)
    lk.add_argument("--problems", action="store_true", help="only links that are not ok")
    lk.set_defaults(func=lambda a: _watch(a, _links))

    ev = sub.add_parser("events", help="history: detections, localizations, drains, refusals (who, why, when)",
                        description="The coordinator's history, oldest first. Exit 0, or 3 coordinator unreachable, "
                                    "token refused or a bad --since.")
    common(ev, watch=False)
    ev.add_argument("--since", default="1h", help="how far back: 30s, 15m, 2h, 7d, or an ISO time (default 1h)")
    ev.add_argument("--kind", default="", help="only these kinds, comma-separated (detection, recovery, "
                                               "localization, cleared, drain, undrain, refused, agent, coordinator)")
    ev.add_argument("--link", help="only events about this link (e.g. p0l0-p0s1)").complete = "links"
    ev.add_argument("--host", help="only events by or about this host and its paths (e.g. h3)").complete = "hosts"
    ev.add_argument("--limit", type=int, default=200)
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
    ev.set_defaults(func=_events)

    for verb in ("drain", "undrain"):
        d = sub.add_parser(verb, help=("steer every agent away from a link (operators only; guarded)" if verb == "drain"
                                       else "let agents use a drained link again (operators only)"),
                           description="Exit 0 done, 1 --dry-run found it would be refused, 2 refused by the "
                                       "coordinator's guard (blast radius, a host pair left without a path), "
                                       "3 coordinator unreachable, token refused (an operator's is needed) or "
                                       "unknown link.")
        d.add_argument("link", help="link name, e.g. p0l0-p0s1 or h3-p1l1 (`linkpass links` lists them)"
                       ).complete = "links"
        if verb == "drain":
            d.add_argument("--reason", required=True, help="why (recorded with your name; on-call reads it later)")
            d.add_argument("--force", action="store_true",
                           help="record the drain even if some host pair would be left without a usable path")
            d.add_argument("--for", dest="for_", metavar="DURATION",
                           help="undrain by itself after this long: 30m, 4h, 2d (1 minute to 30 days); the "
                                "coordinator records the undrain")
        d.add_argument("--dry-run", action="store_true", help="show which hosts and paths would move; change nothing")
        common(d, watch=False)
        d.set_defaults(func=_drain, verb=verb)


def add_coordinator_paths_args(p: argparse.ArgumentParser) -> None:
    """`linkpass paths HOST [PEER]` asks the coordinator (the local form is `linkpass paths [--peer]`)."""
    client_args(p, for_what=" (for `paths HOST`)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS", help="redraw every SECONDS")


def client_args(p: argparse.ArgumentParser, for_what: str = "") -> None:
    """Where the coordinator is and who you are to it: flag, else environment, else the config
    file's context, else the default (settings.py)."""
    p.add_argument("--coordinator", metavar="URL", help=f"coordinator endpoint{for_what} (default "
                                                        "$LINKPASS_COORDINATOR, the context's, or "
                                                        f"{COORDINATOR_URL})")
    p.add_argument("--token-file", metavar="FILE", type=absolute, help="file holding your token (default: $LINKPASS_TOKEN, "
                                                        "the context's token-file, ~/.config/linkpass/token, or on "
                                                        "the coordinator's host its reader.token)")
    p.add_argument("--context", metavar="NAME", help="a context of the config file: its coordinator, token and "
                                                     "TLS files (default $LINKPASS_CONTEXT or current-context)")
    p.add_argument("--config-file", metavar="FILE", type=absolute, help="the CLI's config file (default $LINKPASS_CONFIG or "
                                                         "~/.config/linkpass/config.yaml)")
    tls_args(p)


def tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca-file", metavar="FILE", type=absolute, help="CA the coordinator's certificate must chain to (default "
                                                     "$LINKPASS_CA_FILE, the context's; on its host its lab CA; "
                                                     "else the system's)")
    p.add_argument("--cert-file", metavar="FILE", type=absolute, help="your client certificate, for mutual TLS (default "
                                                       "$LINKPASS_CERT_FILE, the context's)")
    p.add_argument("--key-file", metavar="FILE", type=absolute, help="its private key (default $LINKPASS_KEY_FILE, the context's)")
    p.add_argument("--insecure-http", action="store_true",
                   help="allow an http:// coordinator URL (your token crosses the network in cleartext)")


# ---- plumbing ---------------------------------------------------------------------------
def _client(args, timeout_s: float = 5.0):
    """A client for the coordinator the settings name (flag > environment > context > default);
    raises ValueError (settings.ConfigError, tls.TlsError, _Usage) with a one-line reason."""
    from ..control.tokens import read_token
    from ..control.client import Client
    from ..control.tls import build_client_context
    from .settings import from_args

    s = from_args(args)
    token = s.token.value
    if s.token_file.value:
        try:
            token = read_token(s.token_file.value)
        except OSError as exc:
            raise _Usage(f"{_label(s.token_file, '--token-file')} {s.token_file.value}: cannot read it "
                         f"({exc.strerror})") from None
    url = s.coordinator.value
    insecure = bool(getattr(args, "insecure_http", False))
    tls = None
    if not url.startswith("http://"):
        tls = build_client_context(s.ca_file.value, s.cert_file.value, s.key_file.value,
                                   names=(_label(s.ca_file, "--ca-file"), _label(s.cert_file, "--cert-file"),
                                          _label(s.key_file, "--key-file")))
    client = Client(url, token, timeout_s=timeout_s, tls=tls, insecure_http=insecure)
    client.settings = s  # where each setting came from, for the hints of a failure
    if client.tls is None:
        warn(f"plain HTTP to {url} (--insecure-http): your token crosses the network in cleartext")
    return client


def _label(setting, flag: str) -> str:
    """How a message names a setting: the flag, the variable or the context it came from."""
    return flag if setting.source in (flag, "default") else setting.source


class _Usage(ValueError):
    pass


def _call(args, fn, write: bool = False):
    """Run fn(client) -> exit code, turning the usual failures into one line on stderr each.
    Whatever fails, the fleet's health is unknown (3); only a write (`write`) the coordinator
    refused on purpose (409: its blast-radius guard, a stranded host pair) is critical (2): what
    on-call asked for did not happen, for a reason about the fleet."""
    from ..control.client import AnswerTooLarge, Refusal, TlsFailure, Unreachable

    try:
        client = _client(args)
    except ValueError as exc:  # settings.ConfigError, tls.TlsError, _Usage, a malformed URL
        return error(str(exc))
    try:
        return fn(client)
    except (TlsFailure, AnswerTooLarge) as exc:
        return error(str(exc))
    except Unreachable as exc:
        return error(f"{exc}; {_where_hint(client.settings)}")
    except Refusal as exc:
        if exc.status in (401, 403):
            return error(f"refused (HTTP {exc.status}): {exc}{_auth_hint(exc, client.settings)}")
        if write and exc.status == 409:
            return error(f"{paint('refused:', 'red', sys.stderr)} {exc} (HTTP 409)", EXIT_CRITICAL)
        return error(f"{exc} (HTTP {exc.status})")
    finally:
        client.close()


def _where_hint(s) -> str:
    source = ("the default address" if s.coordinator.source == "default"
              else f"the address is from {s.coordinator.source}")
    return (f"{source}. Is the coordinator running (`linkpass coordinator`)? Point at it with --coordinator, "
            "$LINKPASS_COORDINATOR or a context (--context)")


def _auth_hint(exc, s) -> str:
    """What to do about a refused token, naming where this one came from and files that exist."""
    reader, operator = os.path.join(s.state_dir, "reader.token"), os.path.join(s.state_dir, "operator.token")
    if exc.status == 403 and "needs role 'operator'" in str(exc):
        return (f"; {s.token_source()}; this needs an operator token: --token-file {operator} on the "
                "coordinator's host, or an operator entry of its tokens.yaml (docs/security.md, Roles and tokens)")
    if exc.status == 401:
        return (f"; {s.token_source()}; give a valid one with --token-file FILE, $LINKPASS_TOKEN or a context's "
                f"token-file: on the coordinator's host, {reader} (reads) or {operator} (drain, undrain, "
                "decommission)")
    return ""


def _watch(args, fn) -> int:
    if not getattr(args, "watch", None):
        return _call(args, lambda c: fn(args, c, time.time()))
    code = EXIT_UNKNOWN
    try:
        while True:
            if sys.stdout.isatty():
                print("\033[2J\033[H", end="")
            code = _call(args, lambda c: fn(args, c, time.time()))
            if args.output in ("table", "wide"):  # JSON and YAML stay documents only
                print(paint(f"every {args.watch:g} s, Ctrl-C to stop - {time.strftime('%H:%M:%S')}", "dim"))
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return code


def _age(now: float, ts: float | None) -> str:
    return "-" if ts is None else _span(now - ts)


def _span(seconds: float) -> str:
    s = max(0.0, seconds)
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
    if doc.get("shards"):
        away = [x for x in doc["shards"] if x["away"]]
        lines.append(f"coordinator shards: {len(doc['shards'])}" + (", all answering" if not away else ""))
        for x in away:
            since = "never heard from" if x["heard_s"] is None else f"not heard from for {_span(x['heard_s'])}"
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


# ---- agents -----------------------------------------------------------------------------
def render_agents(rows: list[dict], wide: bool = False) -> str:
    """The coordinator's /v1/agents rows; `last_seen_s` is already an age (the coordinator's clock)."""
    headers = ["host", "state", "last seen", "paths", "version"] + (["agent id", "service"] if wide else [])
    out = []
    for r in rows:
        state = paint("lost", "red") if r["lost"] else paint("up", "green")
        cells = [r["name"], state, _span(r["last_seen_s"]) + " ago", r["paths"], r.get("version") or "-"]
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
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float | None:
    """Seconds in `30s`, `15m`, `2h`, `7d` (a decimal number and one unit), or None."""
    if text and text[-1] in _UNITS and text.isascii() and text[:-1].replace(".", "", 1).isdigit():
        return float(text[:-1]) * _UNITS[text[-1]]
    return None


def parse_since(text: str, now: float) -> float:
    ago = parse_duration(text)
    if ago is not None:
        return now - ago
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
    if k == "detection" and d.get("summary"):
        return (f"{d.get('detections')} detections and {d.get('recoveries')} recoveries more in "
                f"{d.get('window_s'):g} s, counted together")
    if k in ("detection", "recovery"):
        return f"{d.get('state')} {d.get('reason') or ''} (peer {d.get('peer')}, plane {d.get('plane')})".replace("  ", " ")
    if k == "localization":
        return f"faulty {_arrow(d)}, confidence {d.get('confidence', 0):.2f}, {d.get('bad_paths')} bad paths " \
               f"from {len(d.get('reporters', ()))} reporters" + (f"; {d['note']}" if d.get("note") else "")
    if k == "drain":
        timed = f", for {_span(d['for_s'])}" if d.get("for_s") else ""
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
    return table(headers, [[_when(e["ts"]), paint(e["kind"], "red" if e["kind"] in ("localization", "refused")
                                                   else "dim" if e["kind"] == "recovery" else "bold"),
                            e["actor"], e["subject"], _summary(e) if not wide else json.dumps(e["detail"], sort_keys=True)]
                           for e in rows])


def _events(args) -> int:
    try:
        since = parse_since(args.since, time.time())
    except _Usage as exc:
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
    return _call(args, run)


def _print_stream(rows, fmt, header: bool) -> None:
    if fmt in ("json", "yaml"):
        for e in rows:  # one JSON document per line: `| jq` friendly
            print(json.dumps(e, default=str))
        return
    text = render_events(printable_doc(rows), fmt == "wide")
    lines = text.splitlines()
    print("\n".join(lines if header else lines[1:]))


# ---- drain / undrain --------------------------------------------------------------------
def render_drain(doc: dict, verb: str) -> str:
    imp = doc.get("impact", {})
    head = (f"{'would ' if doc.get('dry_run') else ''}{verb} {doc['link']}" if doc.get("changed", doc.get("dry_run"))
            else f"{doc['link']}: nothing to do (already {'drained' if verb == 'drain' else 'in use'})")
    lines = [head + (f", until {_when(doc['until'])} (then undrained by itself)" if doc.get("until") else "")]
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
        if args.for_ is not None:
            for_s = parse_duration(args.for_)
            if for_s is None:
                return error(f"--for {args.for_!r}: use a duration such as 30m, 4h or 2d")
            body["for_s"] = for_s

    def run(client):
        doc = client.post(f"/v1/{args.verb}", body)
        emit(doc, args.output, lambda d: render_drain(d, args.verb))
        return EXIT_WARNING if doc.get("refused") else EXIT_OK
    return _call(args, run, write=True)


# ---- decommission, agent tokens ----------------------------------------------------------
def render_decommission(doc: dict) -> str:
    verb = "would forget" if doc.get("dry_run") else "forgot"
    return (f"{verb} agent {doc['host']} and the {doc['paths']} paths it reported"
            + (" (it was lost)" if doc.get("was_lost") else " (it was still reporting: if it runs, it registers again)"))


def _openapi(args) -> int:
    from ..coordinator.openapi import spec

    print(json.dumps(spec(), indent=2))
    return EXIT_OK


def _decommission(args) -> int:
    body = {"host": args.host, "reason": args.reason, "dry_run": args.dry_run}

    def run(client):
        doc = client.post("/v1/decommission", body)
        emit(doc, args.output, render_decommission)
        return EXIT_OK
    return _call(args, run, write=True)


def _token(args) -> int:
    """`token HOST`, or the listed tokens' actions (create, list, revoke)."""
    words = args.target
    for flag, given in (("--store-password-file", args.store_password_file), ("--store-tls-ca", args.store_tls_ca),
                        ("--store-insecure-plaintext", args.store_insecure_plaintext or None)):
        if given is not None and args.store is None:
            return error(f"{flag}: only with --store (the SQLite store in --state-dir has no password and no "
                         "connection)")
    if args.store_insecure_plaintext:
        if args.store_tls_ca is not None:
            return error("--store-tls-ca: not used with --store-insecure-plaintext (no TLS to verify); remove one "
                         "of the two")
        warn("PostgreSQL store without TLS (--store-insecure-plaintext): the store's traffic crosses the network "
             "unencrypted")
    if words[0] in ("create", "list", "revoke"):
        return _listed_token(args, words[0], words[1:])
    if len(words) != 1:
        return error(f"token: {' '.join(words)!r}: give one HOST, or `create NAME --role R`, `list`, `revoke NAME`")
    if args.role is not None:
        return error("--role: only with `token create NAME` (an agent host's token has no role to choose)")
    args.host = words[0]
    return _agent_token(args)


def _listed_token(args, action: str, rest: list[str]) -> int:
    from ..coordinator.auth import (AuthError, create_listed_token, listed_tokens, remove_listed_token,
                                    write_private)
    from ..coordinator.runner import DEFAULT_STATE_DIR
    from ..coordinator.store import DB_FILE, StoreError, open_store

    want = {"create": 1, "list": 0, "revoke": 1}[action]
    if len(rest) != want:
        return error(f"token {action}: expected {'NAME' if want else 'no argument'}, got {' '.join(rest) or 'none'}")
    if args.revoke or args.reason:
        return error(f"--revoke/--reason: for an agent host's tokens (`token HOST --revoke`); `token {action}` "
                     "takes neither")
    if action == "create" and args.role is None:
        return error("token create: --role reader or --role operator is required")
    state = args.state_dir or DEFAULT_STATE_DIR
    path = os.path.join(state, "tokens.yaml")
    try:
        if action == "create":
            token = create_listed_token(path, rest[0], args.role)
            if args.out:
                write_private(args.out, token + "\n")
                print(f"wrote {rest[0]}'s {args.role} token to {args.out}")
            else:
                print(token)
            print(f"{rest[0]} may act as {args.role} from the coordinator's next tick; the token is shown once "
                  "(only its hash is kept)", file=sys.stderr)
        elif action == "revoke":
            gone = remove_listed_token(path, rest[0])
            print(f"revoked {gone['name']}'s {gone['role']} token: refused from the coordinator's next tick")
        else:
            rows = listed_tokens(path)
            revoked = {}
            if args.store is not None or os.path.exists(os.path.join(state, DB_FILE)):
                store = open_store(args.store, args.store_password_file, state, tls_ca_file=args.store_tls_ca,
                                   insecure_plaintext=args.store_insecure_plaintext)
                try:
                    revoked = store.agent_epochs()
                finally:
                    store.close()
            doc = {"listed": rows, "agent_hosts_revoked": revoked}
            if args.output == "json":
                print(json.dumps(doc, indent=2))
            else:
                print(table(["name", "role", "host"], [[r["name"], r["role"], r["host"] or "-"] for r in rows]))
                print(f"agent tokens are derived per host; {len(revoked)} host(s) had theirs revoked"
                      + (f": {', '.join(f'{h} (epoch {e})' for h, e in sorted(revoked.items()))}" if revoked else ""))
    except OSError as exc:
        return error(f"{exc.filename or path}: {exc.strerror}; run this where the coordinator keeps its state "
                     "(--state-dir), after it has started once")
    except (AuthError, StoreError) as exc:
        return error(str(exc))
    return EXIT_OK


def _agent_token(args) -> int:
    """Local to the coordinator's host, like issuing: who may revoke is who holds the state
    directory (and so the secret that mints every token), and it works with the coordinator down.
    The revocation goes into the coordinator's store, which the running coordinator reads every
    tick; the token printed is of the host's current epoch."""
    from ..coordinator.auth import MAX_EPOCH, SECRET_FILE, AuthError, agent_token, read_agent_secret, write_private
    from ..coordinator.runner import DEFAULT_STATE_DIR
    from ..coordinator.store import DB_FILE, StoreError, open_store

    if args.reason is not None and not args.revoke:
        return error("--reason: only with --revoke (it says why the host's tokens were revoked)")
    state = args.state_dir or DEFAULT_STATE_DIR
    path, db = os.path.join(state, SECRET_FILE), os.path.join(state, DB_FILE)
    store = None
    try:
        secret = read_agent_secret(path)
        agent_token(secret, args.host)  # the host name is checked before anything is written
        if args.revoke or args.store is not None or os.path.exists(db):
            store = open_store(args.store, args.store_password_file, state, tls_ca_file=args.store_tls_ca,
                               insecure_plaintext=args.store_insecure_plaintext)
        if args.revoke:
            epoch = store.revoke_agent(args.host, _local_user(), args.reason or "revoked by `linkpass coordinator "
                                       "token HOST --revoke`", time.time(), MAX_EPOCH)
        else:
            epoch = store.agent_epochs().get(args.host, 0) if store is not None else 0
        token = agent_token(secret, args.host, epoch)
    except OSError as exc:
        return error(f"{exc.filename or path}: {exc.strerror}; run this where the coordinator keeps its state "
                     "(--state-dir), after it has started once")
    except (AuthError, StoreError) as exc:
        return error(str(exc))
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


def _join_ray(address: str | None) -> None:
    """Join the Ray cluster at `address` (or start a local Ray); a failure is one line naming the
    address and what to check, never Ray's traceback."""
    from ..coordinator import ray_actor

    if address:
        _ray_answers(address)
    try:
        ray_actor.connect(address)
    except Exception as exc:  # Ray raises ValueError, ConnectionError, RuntimeError, ... by case
        text = str(exc)
        if not address:
            why = (f"could not start a local Ray instance ({_first_line(exc)}): check free memory and disk in "
                   "/tmp/ray, and that no stale Ray runs (`ray stop` ends it)")
        elif "ray[client]" in text:
            why = (f"--address {address}: a ray:// address needs the Ray Client (pip install 'ray[client]'); on a "
                   "node of the cluster, give the head's GCS address HOST:6379 instead")
        elif "Could not find any running Ray instance" in text:
            why = (f"--address {address}: no Ray instance runs on this host; start one (`ray start --head`) or "
                   "give the head's address, HOST:6379")
        else:
            why = (f"could not join Ray at {address} ({_first_line(exc)}): check the address (HOST:6379, "
                   "ray://HOST:10001 or auto) and that the Ray head runs (`ray status` on it)")
        raise CliError(why) from exc


def _ray_answers(address: str, timeout_s: float = 3.0) -> None:
    """Something listens at a HOST:PORT or ray://HOST:PORT address: Ray itself would retry an
    address nobody answers on for minutes, printing its own warnings."""
    import socket
    from urllib.parse import urlparse

    if "://" in address:
        u = urlparse(address)
        host, port = u.hostname, (u.port if u.netloc.rpartition(":")[2].isdigit() else None)
    else:
        host, _, port_text = address.rpartition(":")
        host, port = host.strip("[]"), int(port_text) if port_text.isdigit() else None
    if not host or port is None:
        return  # auto, local, or a form Ray itself will judge
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise CliError(f"--address {address}: nothing answers at {host}:{port} ({why}); check that the Ray "
                       "head runs there (`ray status` on it) and that this is its GCS port (6379 by default), "
                       "or its Ray Client port (10001) for ray://") from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0][:200] if lines else "") or type(exc).__name__


def run_coordinator(args) -> int:
    from ..coordinator import ray_actor
    from ..coordinator.runner import DEFAULT_STATE_DIR, log_path
    from ..control.tls import SERVER, lab_dir, lab_paths
    from ..observe.log import Follower, level_from_env

    try:
        tls = _tls_settings(args)
        log_level = level_from_env(args.log_level)  # resolved here: the actor's process has another environment
    except ValueError as exc:  # _Usage, a bad --log-level in the environment
        return error(str(exc))
    settings = {"state_dir": args.state_dir or DEFAULT_STATE_DIR, "fabric": args.fabric,
                "fabric_model": _testbed_model(args.testbed) if args.testbed else None,
                "listen": args.listen or (f"0.0.0.0:{COORDINATOR_PORT}" if args.testbed else COORDINATOR_LISTEN),
                "max_drain_share": args.max_drain_share, "log_level": log_level, **tls}
    if args.store_insecure_plaintext and args.store_tls_ca is not None:
        return error("--store-tls-ca: not used with --store-insecure-plaintext (no TLS to verify); remove one of "
                     "the two")
    if (args.store is not None or args.store_password_file is not None or args.store_tls_ca is not None
            or args.store_insecure_plaintext):
        settings.update(store=args.store, store_password_file=args.store_password_file,
                        store_tls_ca_file=args.store_tls_ca)
        if args.store_insecure_plaintext:
            settings["store_insecure_plaintext"] = True
    for name in ("agent_timeout_s", "agent_expire_s", "event_retention_count", "max_body_bytes", "shards",
                 "shard_listen"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if args.event_retention_days is not None:
        settings["event_retention_s"] = args.event_retention_days * 86400
    from ..coordinator.runner import check_settings
    from ..control.errors import CoordinatorError

    try:
        check_settings(settings)  # refused here, by name, rather than inside the Ray actor
    except CoordinatorError as exc:
        return error(str(exc))
    print(f"starting {'a local Ray instance' if not args.address else 'on Ray at ' + args.address} ...", flush=True)
    _join_ray(args.address)
    follower = None
    try:
        if args.stop:
            if ray_actor.existing() is None and not ray_actor.shards():
                print("no coordinator actor is running")
                return EXIT_WARNING
            ray_actor.stop_all()
            print("coordinator stopped")
            return EXIT_OK
        if not args.address:
            # the actor's log lines from now on, copied to this process's stderr (under systemd, its
            # journal); detached on a cluster (--address), they stay in that file on the actor's node
            follower = Follower(log_path(settings)).start()
        try:
            handle, url = ray_actor.ensure(settings)
        except Exception as exc:  # Ray's own errors, a timeout: the actor's log says more
            raise CliError(f"the coordinator actor did not come up ({_first_line(exc)}); its log: "
                           f"{log_path(settings)}") from exc
        print(f"coordinator up: {url} (Ray actor {ray_actor.NAMESPACE}/{ray_actor.ACTOR_NAME}, pid "
              f"{ray_actor.actor_pid(handle)})")
        for k, h in enumerate(ray_actor.shards()):
            print(f"  shard {k}: {ray_actor.endpoint(h)} (Ray actor {ray_actor.NAMESPACE}/"
                  f"{ray_actor.SHARD_NAME.format(k)}); agents given the root's address are sent there")
        print(f"tokens: {settings['state_dir']}/{{reader,operator}}.token; agents: `linkpass coordinator token "
              f"HOST --state-dir {settings['state_dir']}` (one each); database: {settings['state_dir']}/coordinator.db")
        if args.insecure_http:
            print(paint("warning: plain HTTP (--insecure-http): tokens cross the network in cleartext", "yellow"))
        if args.store_insecure_plaintext:
            print(paint("warning: PostgreSQL store without TLS (--store-insecure-plaintext): the fleet's state "
                        "crosses the network unencrypted", "yellow"))
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
        from ..coordinator.foreground import hold  # READY=1, WATCHDOG=1, STOPPING=1 under systemd

        hold(url, settings, end)  # until `end`, SIGTERM or Ctrl-C
        ray_actor.stop_all()
        return EXIT_OK
    finally:
        if follower is not None:
            follower.stop()  # after the actor stopped: its last lines too
        if not args.address:
            ray_actor.shutdown()
