"""`linkpass demo`: the main job on the embedded default.

The collective job and the coordinator are not built yet (issues "coordinator" and "main job").
Until they are, the demo shows the parts that exist: it builds the default testbed, prints it,
proves every host reaches every other host over every plane and through the service addresses,
breaks a link to show which source ports it black-holes, runs the probe mesh (discovery, 1 kHz
probes) and shows a one-direction loss landing on exactly the paths and the direction it
affects, then runs two host agents and cuts an uplink under a TCP flow: the agents detect it,
move the routes at both ends, and the flow stalls for milliseconds instead of seconds. It tears
everything down again, also on Ctrl-C or a crash.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

from .output import EXIT_CRITICAL, EXIT_OK, paint


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded default (for now: fabric, probe mesh, agents)")
    p.add_argument("--prefix", default="lpdemo", help="name prefix of the demo testbed (default lpdemo)")
    p.add_argument("--keep", action="store_true", help="leave the testbed up at the end")
    p.set_defaults(func=run, needs_root=True)


def _probe_mesh(prefix: str, fab) -> bool:
    """Discover h0's paths to the last host on plane 0, probe one port per path, then drop 30 %
    of p0l0 -> p0s0 and show that exactly the paths through it lose, forward only."""
    from .probe.discovery import Target, discover
    from .testbed import faults
    from .testbed.mesh import Mesh

    last = fab.spec.hosts - 1
    table = discover(fab.netns("h0"), [Target("p0", fab.nic_addr(0, 0), fab.nic_addr(last, 0))])
    paths = table.paths(fab.nic_addr(last, 0), "p0")
    spine_of = {lk.b_addr.split("/")[0]: lk.b for lk in fab.links.values() if lk.kind == "leaf-spine"}
    chosen = sorted((p.ports[0], next((spine_of[h] for h in p.hops if h in spine_of), "?")) for p in paths)
    print(f"  discovered {len(chosen)} paths h0 → h{last} on plane 0: "
          + ", ".join(f"sport {sp} via {spine}" for sp, spine in chosen))
    mesh = Mesh.start(fab, [(0, last, 0, sp) for sp, _ in chosen], bytes(32), interval_s=0.001)
    try:
        faults.apply(prefix, faults.FaultSpec("loss", "p0l0-p0s0", "p0l0", {"pct": 30}))
        mesh.run(1.5)
        faults.clear(prefix)
        ok = True
        print("  30 % loss on p0l0 → p0s0 only, 1.5 s of probes:")
        for pid, (sp, spine) in zip(sorted(mesh.paths), chosen):
            loss = mesh.telemetry(pid).loss
            fwd = 100 * loss.lost_fwd / max(1, loss.answered)
            rev = 100 * loss.lost_rev / max(1, loss.arrived)
            rtt = mesh.telemetry(pid).window(0)["rtt_ns"]["p50"]
            hit = spine == "p0s0"
            ok &= (fwd > 15) == hit and rev < 3
            print(f"    sport {sp} via {spine}: {loss.answered} probes, forward loss {fwd:4.1f} %, "
                  f"reverse loss {rev:4.1f} %, rtt p50 {rtt / 1e3:.0f} µs  "
                  + (paint("lossy link, forward", "red") if fwd > 15 else paint("clean", "green")))
        return ok
    finally:
        mesh.close()


def _failover(prefix: str, fab, workdir: str) -> bool:
    """Agents on h0 and the last host; a TCP flow between them on plane 0; h0's plane-0 uplink
    goes down for 1.5 s. Shows the verdict, the route change at both ends and the flow's stall."""
    from .testbed import faults, tcpflow
    from .testbed.agents import Agents

    last = fab.spec.hosts - 1
    agents = Agents(fab, workdir, [0, last]).start()
    try:
        # every path answered and up (a start-up burst of lateness can leave one damped a while)
        agents.wait_healthy(timeout_s=30)
        time.sleep(1)
        sport = tcpflow.sport_for_plane(fab, 0, last, 0)
        flow = tcpflow.TcpFlow(fab, 0, last, sport=sport).start()
        time.sleep(0.5)
        rec = faults.apply(prefix, faults.FaultSpec("down", "h0-p0l0"))
        t0 = rec["effective_mono_ns"]
        time.sleep(1.5)
        faults.clear(prefix)
        time.sleep(0.5)
        stall = flow.stop()
        print(f"  h0's uplink in plane 0 down at {rec['effective_at']}, a TCP flow h0 → h{last} on it:")
        wall_minus_mono = time.time_ns() - time.monotonic_ns()  # verdicts carry the agent's (wall) clock
        ok = True
        for h, peer in ((0, last), (last, 0)):
            down = next((e for e in agents.events(h, "path_state") if e["mono_ns"] >= t0 and e["new"] == "down"), None)
            route = next((e for e in agents.events(h, "route_change")
                          if e["mono_ns"] >= t0 and e["peer"] == f"h{peer}"), None)
            ok &= route is not None and route["planes"] == [1]
            print(f"    agent h{h}: paths to h{peer} in plane 0 "
                  + (f"judged down after {(down['at_ns'] - wall_minus_mono - t0) / 1e6:.1f} ms, " if down
                     else "not seen down, ")
                  + (f"route to h{peer} moved to plane {route['planes']} after {(route['mono_ns'] - t0) / 1e6:.1f} ms"
                     if route else paint("route not moved", "red")))
        print(f"    TCP flow: longest stall {stall.max_gap_ms:.0f} ms, {stall.lost} messages lost"
              + (paint("  ✓", "green") if not stall.broken else paint("  connection broke", "red")))
        back = agents.wait_for(0, "route_change", lambda e: e["mono_ns"] > t0 and e["planes"] == [0, 1], 10)
        print("    link back: " + (f"h0 uses both planes again after {(back['mono_ns'] - t0) / 1e9 - 1.5:.1f} s "
                                   "(hold-down: 0.5 s and 100 good probes)" if back else paint("not restored", "red")))
        return ok and back is not None and not stall.broken
    finally:
        agents.stop()
        faults.clear(prefix)


def _step(n: int, total: int, text: str) -> None:
    print(paint(f"[{n}/{total}] {text}", "bold"), flush=True)


def run(args) -> int:
    from .testbed import build, faults, traffic
    from .testbed.cli import _progress, _show
    from .testbed.topology import preset

    print("LinkPass demo — the fabric, the probe mesh and host agents failing over. The training job "
          "and the coordinator arrive with later issues.\n")
    steps = 7
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
        if holed != expected:
            print(paint("  unexpected: loss does not follow the spine choice", "red"))
        _step(5, steps, "the probe mesh: discover h0's paths, probe each at 1 kHz, break a link direction")
        mesh_ok = _probe_mesh(args.prefix, fab)
        _step(6, steps, "host agents: an uplink fails under a TCP flow")
        with tempfile.TemporaryDirectory(prefix="linkpass-demo-") as workdir:
            failover_ok = _failover(args.prefix, fab, workdir)
        ok = not bad and holed == expected and mesh_ok and failover_ok
    finally:
        if args.keep:
            print(f"testbed left up (prefix {args.prefix}); remove it with `linkpass testbed down --prefix {args.prefix}`")
        else:
            _step(steps, steps, "tearing down")
            build.down(args.prefix, _progress)
    print(f"\ndemo {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    return EXIT_OK if ok else EXIT_CRITICAL


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(prefix="lpdemo", keep=False)))
