"""`linkpass testbed ...`: build, inspect, break and remove the namespace fabric."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from ..console.output import EXIT_CRITICAL, EXIT_OK, FORMATS, emit, paint, table
from . import build, faults, traffic
from ..core.names import host_name
from .topology import Fabric, load_spec_text, parse_rdma_hosts, preset, check_prefix, PRESETS
from ..console.files import absolute

DEFAULT_PREFIX = os.environ.get("LINKPASS_PREFIX", "lp")


def _progress(msg: str) -> None:
    print(f"  {paint('…', 'dim', sys.stderr)} {msg}", file=sys.stderr, flush=True)


def register(sub: argparse._SubParsersAction) -> None:
    tb = sub.add_parser("testbed", help="a real multi-plane leaf-spine fabric in network namespaces",
                        description="Build, inspect, break and remove the namespace testbed.")
    tsub = tb.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser, output: bool = True) -> None:
        p.add_argument("--prefix", default=DEFAULT_PREFIX,
                       help=f"name prefix of every object of this testbed (default {DEFAULT_PREFIX}; env LINKPASS_PREFIX)")
        if output:
            p.add_argument("-o", "--output", choices=FORMATS, default="table")
        p.set_defaults(needs_root=True)

    p = tsub.add_parser("up", help="build a testbed")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--topology", metavar="FILE", type=absolute, help="YAML topology file")
    src.add_argument("--preset", default=None, choices=sorted(PRESETS), help="named topology (default: default)")
    p.add_argument("--rdma-hosts", metavar="LIST", default=None,
                   help="hosts to run as Soft-RoCE guests (QEMU, real verbs), e.g. 0,3; overrides the topology's "
                        "rdma_hosts; the guest image is built on first use (minutes) and cached")
    p.add_argument("--agents", action="store_true",
                   help="also start `linkpass agent` on every host (probes every 5 ms, routes and entropy table "
                        "on; logs and configs in the testbed's state folder); `testbed down` stops them")
    common(p)
    p.set_defaults(func=cmd_up)

    p = tsub.add_parser("show", help="hosts, links, addresses and active faults")
    common(p)
    p.set_defaults(func=cmd_show)

    p = tsub.add_parser("check", help="reachability: every host to every host over every plane")
    common(p)
    p.set_defaults(func=cmd_check)

    p = tsub.add_parser("fault", help="break a link (down, flap, loss, mtu, congest) or --clear",
                        description="Apply a fault to one link (and, for loss/mtu/congest, optionally one "
                                    "direction with --from NODE), or remove faults with --clear [LINK].")
    common(p)
    p.add_argument("--clear", nargs="?", const="*", metavar="LINK",
                   help="remove every fault, or only those on LINK")
    fsub = p.add_subparsers(dest="kind", metavar="KIND")
    # the kind's own parser also takes --prefix/-o, so they may come last on the line;
    # SUPPRESS keeps the parent's value when they are not repeated there
    kind_common = argparse.ArgumentParser(add_help=False)
    kind_common.add_argument("--prefix", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    kind_common.add_argument("-o", "--output", choices=FORMATS, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    fsub_add = fsub.add_parser
    fsub.add_parser = lambda *a, **k: fsub_add(*a, parents=[kind_common], **k)
    f = fsub.add_parser("down", help="take the link down (carrier loss)")
    f.add_argument("link")
    f = fsub.add_parser("up", help="bring a link back up (clears its down/flap)")
    f.add_argument("link")
    f = fsub.add_parser("flap", help="take the link down and up every --period")
    f.add_argument("link")
    f.add_argument("--period", default="1s", help="down+up cycle, e.g. 200ms (default 1s)")
    f.add_argument("--duration", default="600s", help="stop flapping after this long (default 600s)")
    f = fsub.add_parser("loss", help="drop PCT %% of packets at random")
    f.add_argument("link")
    f.add_argument("pct", type=float, metavar="PCT")
    f.add_argument("--from", dest="direction", metavar="NODE", help="only traffic leaving NODE on this link")
    f = fsub.add_parser("mtu", help="drop IP packets larger than BYTES (MTU black hole)")
    f.add_argument("link")
    f.add_argument("bytes", type=int, metavar="BYTES")
    f.add_argument("--from", dest="direction", metavar="NODE", help="only traffic leaving NODE on this link")
    f = fsub.add_parser("congest", help="rate-limit the link with a queue (tbf)")
    f.add_argument("link")
    f.add_argument("--rate", default="100mbit", help="e.g. 10mbit (default 100mbit)")
    f.add_argument("--queue", default="20ms", help="queue depth as time at --rate (default 20ms)")
    f.add_argument("--from", dest="direction", metavar="NODE", help="only traffic leaving NODE on this link")
    p.set_defaults(func=cmd_fault)

    p = tsub.add_parser("down", help="tear the testbed down")
    common(p, output=False)
    p.set_defaults(func=cmd_down)

    p = tsub.add_parser("clean", help="reap leftovers of crashed runs (by prefix)")
    common(p, output=False)
    p.add_argument("--all", action="store_true", help="every testbed found on this machine")
    p.set_defaults(func=cmd_clean)


def _load_spec(args):
    if args.topology:
        try:
            with open(args.topology) as fh:
                text = fh.read()
        except OSError as exc:
            raise build.TestbedError(f"--topology {args.topology}: cannot read it ({exc.strerror})") from None
        return load_spec_text(text, args.topology)
    return preset(args.preset or "default")


def cmd_up(args) -> int:
    check_prefix(args.prefix)
    spec = _load_spec(args)
    if args.rdma_hosts is not None:
        spec = dataclasses.replace(spec, rdma_hosts=parse_rdma_hosts(args.rdma_hosts, spec.hosts, "--rdma-hosts"))
    t0 = time.perf_counter()
    print(f"building testbed {args.prefix!r}: {spec.hosts} hosts × {spec.planes} planes, "
          f"{spec.leaves_per_plane} leaves + {spec.spines_per_plane} spines per plane", file=sys.stderr)
    fab = build.up(spec, args.prefix, _progress)
    print(f"  {paint('✓', 'green', sys.stderr)} up in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    if args.agents:
        _start_agents(fab)
    _show(fab, args.output)
    return EXIT_OK


def _start_agents(fab: Fabric) -> None:
    """An agent per host (Soft-RoCE guests excepted), detached: they run until `testbed down`."""
    from . import state
    from .agents import LAB_INTERVAL_MS, Agents

    hosts = [h for h in range(fab.spec.hosts) if not fab.is_guest(host_name(h))]
    directory = state.agents_dir(fab.prefix)
    _progress(f"starting an agent on {len(hosts)} hosts (every {LAB_INTERVAL_MS:g} ms on every path; "
              f"logs in {directory})")
    Agents(fab, directory, hosts, interval_ms=LAB_INTERVAL_MS, detach=True).start()
    ns = fab.netns(host_name(hosts[0]))
    _progress(f"each agent's view: `ip netns exec {ns} linkpass paths --local` (its first 10 s window counts "
              "the probes sent before every peer's agent had started as lost)")


def _show(fab: Fabric, fmt: str) -> None:
    doc = fab.as_dict()
    doc["faults"] = faults.active(fab.prefix)
    emit(doc, fmt, lambda d: _render_show(d, wide=fmt == "wide"))


def _render_show(d: dict, wide: bool) -> str:
    planes = d["planes"]
    out = [f"testbed {d['prefix']} ({d['name']}): {d['hosts']} hosts, {planes} planes, "
           f"{d['leaves_per_plane']} leaves + {d['spines_per_plane']} spines per plane, MTU {d['mtu']}",
           f"management: {d['management']['subnet']} on bridge {d['management']['bridge']} "
           f"(root namespace {d['management']['root_addr']})", ""]
    headers = ["host", "netns", "service", *[f"nic p{p}" for p in range(planes)], "mgmt", "leaves"]
    rows = [[h["name"], h["netns"] or "(soft-roce guest)", h["service"], *h["nics"].values(), h["mgmt"],
             ",".join(h["leaves"])]
            for h in d["host_list"]]
    out += [table(headers, rows), ""]
    link_rows = [[lk["name"], lk["kind"], f"{lk['a']}:{lk['a_if']} {lk['a_addr']}",
                  f"{lk['b']}:{lk['b_if']} {lk['b_addr']}"] for lk in d["links"]]
    if wide or len(link_rows) <= 48:
        out += [table(["link", "kind", "lower end", "upper end"], link_rows), ""]
    else:
        out += [f"{len(link_rows)} links (-o wide lists them)", ""]
    out.append(_render_faults(d["faults"]))
    return "\n".join(out)


def _render_faults(fs: list[dict]) -> str:
    if not fs:
        return "faults: none"
    rows = []
    for f in fs:
        p = f["params"]
        what = {"loss": lambda: f"{p['pct']} %", "mtu": lambda: f"> {p['bytes']} B dropped",
                "congest": lambda: f"{p['rate_bps'] / 1e6:g} Mbit/s, {p['queue_s'] * 1e3:g} ms queue",
                "flap": lambda: f"period {p['period_s'] * 1e3:g} ms" + ("" if f.get("running", True) else " (ended)"),
                "down": lambda: ""}[f["kind"]]()
        rows.append([f["id"], f["kind"], f["link"], f"from {f['direction']}" if f.get("direction") else "both",
                     what, f["effective_at"], f"{f['apply_ms']:.1f}"])
    return "faults:\n" + table(["id", "kind", "link", "direction", "detail", "effective at (UTC)", "apply ms"], rows)


def cmd_show(args) -> int:
    _show(build.load_fabric(args.prefix), args.output)
    return EXIT_OK


def cmd_check(args) -> int:
    fab = build.load_fabric(args.prefix)
    t0 = time.perf_counter()
    rows = traffic.reachability(fab)
    bad = [r for r in rows if not r["ok"]]
    doc = {"prefix": fab.prefix, "checked": len(rows), "failed": len(bad), "seconds": round(time.perf_counter() - t0, 3),
           "rows": rows}

    def render(d: dict) -> str:
        H, P = fab.spec.hosts, fab.spec.planes
        lines = [f"reachability of testbed {fab.prefix}: each cell is NIC/service over each plane "
                 f"({'✓' if not bad else '✗'} {d['checked'] - d['failed']}/{d['checked']} ok in {d['seconds']:.2f} s)"]
        index = {(r["src"], r["dst"], r["plane"], r["target"]): r["ok"] for r in rows}
        hdr = ["from \\ to"] + [host_name(j) for j in range(H)]
        grid = []
        for i in range(H):
            cells = [host_name(i)]
            for j in range(H):
                if i == j:
                    cells.append("-")
                    continue
                if fab.is_guest(i) or fab.is_guest(j):
                    cells.append(paint("guest", "dim"))  # not checked from here
                    continue
                marks = "".join("✓" if index[(host_name(i), host_name(j), p, t)] else "✗"
                                for p in range(P) for t in ("nic", "service"))
                cells.append(paint(marks, "green" if "✗" not in marks else "red"))
            grid.append(cells)
        lines.append(table(hdr, grid))
        if fab.spec.rdma_hosts:
            lines.append(f"  (Soft-RoCE guests {', '.join(host_name(h) for h in fab.spec.rdma_hosts)} are not "
                         f"checked from here: they have no namespace to send from)")
        for r in bad:
            lines.append(f"  ✗ {r['src']} → {r['dst']} plane {r['plane']} {r['target']}: "
                         f"{r['received']}/{r['sent']} received, ingress {r['ingress'] or 'none'}")
        return "\n".join(lines)

    emit(doc, args.output, render)
    return EXIT_CRITICAL if bad else EXIT_OK


def cmd_fault(args) -> int:
    if args.clear is not None:
        if args.kind:
            raise build.TestbedError("use either --clear [LINK] or a fault KIND, not both")
        gone = faults.clear(args.prefix, None if args.clear == "*" else args.clear)
        for f in gone:
            f["cleared_at"] = _mono_to_iso(f.get("cleared_mono_ns"))
        emit({"cleared": gone}, args.output,
             lambda d: f"cleared {len(gone)} fault(s)" + "".join(
                 f"\n  {f['id']} {f['kind']} {f['link']}: gone at {f['cleared_at']}" for f in gone))
        return EXIT_OK
    if not args.kind:
        raise build.TestbedError("name a fault KIND (down, up, flap, loss, mtu, congest) or use --clear [LINK]; "
                                 "see `linkpass testbed fault --help`")
    if args.kind == "up":
        fab = build.load_fabric(args.prefix)
        name = fab.link(args.link).name
        mine = [f for f in faults.active(args.prefix) if f["link"] == name and f["kind"] in ("down", "flap")]
        if not mine:
            raise build.TestbedError(f"link {name} is not down or flapping; nothing to bring up")
        gone = faults.clear_ids(args.prefix, [f["id"] for f in mine])
        emit({"cleared": gone}, args.output, lambda d: f"link {name} is up")
        return EXIT_OK
    params = {
        "down": lambda: {},
        "flap": lambda: {"period": args.period, "duration": args.duration},
        "loss": lambda: {"pct": args.pct},
        "mtu": lambda: {"bytes": args.bytes},
        "congest": lambda: {"rate": args.rate, "queue": args.queue},
    }[args.kind]()
    rec = faults.apply(args.prefix, faults.FaultSpec(args.kind, args.link, getattr(args, "direction", None), params))
    emit(rec, args.output,
         lambda r: f"fault {r['id']}: {r['kind']} on {r['link']}"
                   f"{' from ' + r['direction'] if r.get('direction') else ''} in effect at {r['effective_at']} "
                   f"(applied in {r['apply_ms']:.1f} ms)")
    return EXIT_OK


def _mono_to_iso(mono_ns: int | None) -> str | None:
    if mono_ns is None:
        return None
    import datetime as dt

    wall = mono_ns + time.time_ns() - time.monotonic_ns()
    return dt.datetime.fromtimestamp(wall / 1e9, dt.timezone.utc).isoformat(timespec="microseconds")


def cmd_down(args) -> int:
    counts = build.down(args.prefix, _progress)
    print(f"testbed {args.prefix!r} removed ({counts['namespaces']} namespaces)", file=sys.stderr)
    return EXIT_OK


def cmd_clean(args) -> int:
    results = build.clean(None if args.all else args.prefix)
    total = sum(c["namespaces"] + c["links"] + c["processes"] for c in results.values())
    for p, c in results.items():
        print(f"{p}: removed {c['namespaces']} namespaces, {c['links']} root links, {c['processes']} processes")
    if not total:
        print("nothing to clean")
    return EXIT_OK
