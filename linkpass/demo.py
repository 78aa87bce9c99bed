"""`linkpass demo`: the main job on the embedded default.

Foundation stage: the collective job, agents and coordinator are not built yet (issues
"host agent", "coordinator" and "main job"). Until they are, the demo shows the part that
exists: it builds the default testbed, prints it, proves every host reaches every other host
over every plane and through the service addresses, breaks a link to show a fault taking
effect, and tears everything down again, also on Ctrl-C or a crash.
"""
from __future__ import annotations

import argparse
import sys
import time

from .output import EXIT_CRITICAL, EXIT_OK, paint


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded default (foundation stage: testbed only)")
    p.add_argument("--prefix", default="lpdemo", help="name prefix of the demo testbed (default lpdemo)")
    p.add_argument("--keep", action="store_true", help="leave the testbed up at the end")
    p.set_defaults(func=run, needs_root=True)


def _step(n: int, total: int, text: str) -> None:
    print(paint(f"[{n}/{total}] {text}", "bold"), flush=True)


def run(args) -> int:
    from .testbed import build, faults, traffic
    from .testbed.cli import _progress, _show
    from .testbed.topology import preset

    print("LinkPass demo — foundation stage: the fabric only. The training job, agents and "
          "coordinator arrive with later issues; this run shows the testbed they will run on.\n")
    steps = 5
    t0 = time.perf_counter()
    build.clean(args.prefix)  # a previous run killed with SIGKILL may have left objects behind
    _step(1, steps, "building the default testbed (4 hosts × 2 planes, 2 leaves + 2 spines per plane)")
    fab = build.up(preset("default"), args.prefix, _progress)
    ok = False
    try:
        _step(2, steps, "the fabric")
        _show(fab, "table")
        _step(3, steps, "reachability: every host → every host, every plane, NIC and service addresses")
        rows = traffic.reachability(fab)
        bad = [r for r in rows if not r["ok"]]
        print(f"  {len(rows) - len(bad)}/{len(rows)} paths deliver"
              + (paint("  ✓", "green") if not bad else paint(f"  ✗ {len(bad)} failed", "red")))
        for r in bad:
            print(f"  ✗ {r['src']} → {r['dst']} plane {r['plane']} {r['target']}")
        _step(4, steps, "a fault: leaf–spine link p0l0-p0s0 goes down; which source ports does it black-hole?")
        ports = range(50000, 50016)
        spines = {sp: traffic.spine_for_sport(fab, 0, fab.spec.hosts - 1, 0, sp) for sp in ports}
        rec = faults.apply(args.prefix, faults.FaultSpec("down", "p0l0-p0s0"))
        lost = {sp: traffic.send_flow(fab, 0, fab.spec.hosts - 1, plane=0, sport=sp, count=20).loss_pct for sp in ports}
        faults.clear(args.prefix)
        print(f"  down at {rec['effective_at']} (applied in {rec['apply_ms']:.1f} ms); h0 → h{fab.spec.hosts - 1} on plane 0:")
        for sp in ports:
            mark = paint("black-holed", "red") if lost[sp] == 100 else paint("delivers", "green")
            print(f"    sport {sp} → {spines[sp]}: {lost[sp]:5.1f} % lost  {mark}")
        expected = {sp for sp in ports if spines[sp] == "p0s0"}
        holed = {sp for sp in ports if lost[sp] == 100}
        print("  nothing reroutes yet: that is the host agent's job (next issue)."
              if holed == expected else paint("  unexpected: loss does not follow the spine choice", "red"))
        ok = not bad and holed == expected
    finally:
        if args.keep:
            print(f"testbed left up (prefix {args.prefix}); remove it with `linkpass testbed down --prefix {args.prefix}`")
        else:
            _step(5, steps, "tearing down")
            build.down(args.prefix, _progress)
    print(f"\ndemo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    return EXIT_OK if ok else EXIT_CRITICAL


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(prefix="lpdemo", keep=False)))
