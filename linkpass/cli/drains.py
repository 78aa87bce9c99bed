"""What operators change: `linkpass drain` / `undrain` a link and `linkpass coordinator decommission`
a host. Exit 0 done, 1 a dry run found it would be refused, 2 refused by the coordinator's guard,
3 unreachable, token refused or unknown name.
"""
from __future__ import annotations

import argparse

from ..console.output import EXIT_OK, EXIT_WARNING, emit, error, paint
from .coordinator_client import call, output_args
from .times import parse_duration, when


def register(sub: argparse._SubParsersAction) -> None:
    """drain, undrain."""
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
        output_args(d, watch=False)
        d.set_defaults(func=_drain, verb=verb)


def add_decommission(actions: argparse._SubParsersAction) -> None:
    """`linkpass coordinator decommission HOST`."""
    dc = actions.add_parser("decommission", help="forget an agent and its paths (operators only)",
                            description="Removes HOST's agent and the paths it reported from the coordinator (a host "
                                        "that still runs an agent registers again). Exit 0 done, 3 coordinator "
                                        "unreachable, token refused (an operator's is needed) or unknown host.")
    dc.add_argument("host", help="the agent's name (`linkpass agents --lost` lists lost agents)").complete = "hosts"
    dc.add_argument("--reason", required=True, help="why (recorded with your name)")
    dc.add_argument("--dry-run", action="store_true", help="show what would be removed; change nothing")
    output_args(dc, watch=False)
    dc.set_defaults(func=_decommission)


# ---- drain / undrain --------------------------------------------------------------------
def render_drain(doc: dict, verb: str) -> str:
    imp = doc.get("impact", {})
    head = (f"{'would ' if doc.get('dry_run') else ''}{verb} {doc['link']}" if doc.get("changed", doc.get("dry_run"))
            else f"{doc['link']}: nothing to do (already {'drained' if verb == 'drain' else 'in use'})")
    lines = [head + (f", until {when(doc['until'])} (then undrained by itself)" if doc.get("until") else "")]
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
    return call(args, run, write=True)


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
    return call(args, run, write=True)
