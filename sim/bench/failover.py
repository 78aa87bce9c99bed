#!/usr/bin/env python3
"""Failover: from a fault on the testbed to the route rewritten, LinkPass against FRR bfdd
(10 ms × 3) driving the same route change, measured in the same run on the same fabric.

    python sim/bench/failover.py [--quick] [--trials N] [--soak-s S] [--json FILE]

Agents run on h0 and h2 (different leaves, so every fault kind has a path through it); on this
2-core machine four agents plus the software fabric's forwarding (every probe crosses four
namespaces in the sender's softirq) saturate both cores before any competing load, which is an
artifact of simulating the fabric, not of the agent. Hard faults alternate between the two
planes, 6 s apart; the agents' flap-damping half-life is 1 s instead of 10 s so that repeated
trials on the same link are not (rightly) damped as flapping; the flap case shows damping.

Cases (issue 4): host-uplink-down, leaf-spine-down (metrics detect, fault_to_reroute; peer BFD),
flap, gray-loss-10, gray-loss-1, one-direction-loss, mtu-blackhole (detect; what BFD did under
the same fault), tcp-flow-plane-down (stall; peer: the same flow without LinkPass),
healthy-saturated (false_positives under two CPU burners), route_ops (per_s; peer pyroute2).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.report import row  # noqa: E402
from linkpass.core.constants import RTPROT_LINKPASS  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.testbed import build, faults, frr, tcpflow, topology  # noqa: E402
from linkpass.testbed.agents import Agents  # noqa: E402
from linkpass.testbed.bfd_hook import BfdRouteHook  # noqa: E402
from linkpass.testbed.faults import FaultSpec  # noqa: E402

A, B = 0, 2  # the two hosts with agents (leaf 0 and leaf 1)
FLAP_HALF_LIFE_MS = 1000
windows: dict[str, list[float]] = {}  # kernel-call durations of the faults applied (stamp bounds)
PEER_BFD = "frr-bfdd-10msx3"
MONO_TO_WALL = time.time_ns() - time.monotonic_ns()


def ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def progress(msg: str) -> None:
    print(f"  {time.strftime('%H:%M:%S')} {msg}", flush=True)


# ---- LinkPass --------------------------------------------------------------------------------

def first(events, pred):
    return next((e for e in events if pred(e)), None)


def linkpass_hard(prefix, agents, links, trials, spacing_s):
    """Down one link per trial (alternating planes); fault -> DOWN verdict and -> route rewritten at A."""
    detect, reroute = [], []
    windows.setdefault("hard", [])
    for i in range(trials):
        if not agents.wait_healthy(timeout_s=60):  # each trial starts from a healthy fabric
            progress("paths not all up after 60 s; measuring anyway")
        link = links[i % len(links)]
        plane = int(re.search(r"p(\d+)l", link).group(1))
        rec = faults.apply(prefix, FaultSpec("down", link))
        t0 = rec["effective_mono_ns"]
        windows["hard"].append(ms(rec["effective_window_ns"][1] - rec["effective_window_ns"][0]))
        ev = agents.wait_for(A, "route_change", lambda e: e["mono_ns"] >= t0 and e["peer"] == host_name(B)
                             and plane not in e["planes"], 2.0)
        down = first(agents.events(A, "path_state"),
                     lambda e: e["mono_ns"] >= t0 and e["new"] == "down" and e["peer"] == host_name(B)
                     and e["plane"] == plane)
        time.sleep(0.2)
        faults.clear(prefix)
        if ev is not None and down is not None:
            reroute.append(ms(ev["mono_ns"] - t0))
            detect.append(ms(down["at_ns"] - MONO_TO_WALL - t0))
        progress(f"linkpass {links[i % len(links)]} trial {i + 1}/{trials}: "
                 f"reroute {reroute[-1] if ev else 'none'} ms")
        time.sleep(spacing_s)
    return detect, reroute


def linkpass_gray(prefix, agents, spec, reasons, window_s):
    """Apply a gray fault; time to the first DEGRADED with one of `reasons` on a path to B."""
    agents.wait_healthy(timeout_s=60)
    rec = faults.apply(prefix, spec)
    t0 = rec["effective_mono_ns"]
    windows.setdefault("nft", []).append(ms(rec["effective_window_ns"][1] - rec["effective_window_ns"][0]))
    ev = agents.wait_for(A, "path_state", lambda e: e["mono_ns"] >= t0 and e["new"] == "degraded"
                         and e["reason"] in reasons, window_s)
    wrong = [e for e in agents.events(A, "path_state") if e["mono_ns"] >= t0 and e["new"] == "degraded"
             and e["reason"] not in reasons]
    faults.clear(prefix)
    return (ms(ev["at_ns"] - MONO_TO_WALL - t0) if ev else None), (ev or {}).get("reason"), len(wrong)


def soak(agents, seconds, burners):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    t0 = time.monotonic_ns()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(min(30.0, max(0.0, end - time.monotonic())))
            progress(f"healthy soak: {int(seconds - (end - time.monotonic()))}/{int(seconds)} s")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = {}
    for h in (A, B):
        evs = agents.events(h)
        out[h] = {"downs": sum(1 for e in evs if e.get("event") == "path_state" and e["mono_ns"] > t0
                               and e["new"] == "down"),
                  "spurious_undone": sum(1 for e in evs if e.get("event") == "path_state" and e["mono_ns"] > t0
                                         and e["reason"] == "spurious_down"),
                  "reroutes": sum(1 for e in evs if e.get("event") == "route_change" and e["mono_ns"] > t0)}
    return out


def tcp_across_cut(fab, prefix, uplink):
    """A TCP flow A -> B hashed onto plane 0; `uplink` (A's, plane 0) down for 2 s mid-flow."""
    flow = tcpflow.TcpFlow(fab, A, B, sport=tcpflow.sport_for_plane(fab, A, B, 0)).start()
    time.sleep(1)
    faults.apply(prefix, FaultSpec("down", uplink))
    time.sleep(2)
    faults.clear(prefix)
    time.sleep(1)
    return flow.stop()


# ---- BFD -------------------------------------------------------------------------------------

def bfd_hard(fab, prefix, hook, links, trials):
    reroute, missed = [], 0
    for i in range(trials):
        n0 = len(hook.records())
        link = links[i % len(links)]
        plane = int(re.search(r"p(\d+)l", link).group(1))
        rec = faults.apply(prefix, FaultSpec("down", link))
        t0 = rec["effective_mono_ns"]
        deadline = time.monotonic() + 1.0
        change = None
        while time.monotonic() < deadline and change is None:
            change = first(hook.records()[n0:], lambda c: c.mono_ns >= t0 and c.peer == host_name(B)
                           and plane not in c.planes)
            time.sleep(0.005)
        faults.clear(prefix)
        if change is None:
            missed += 1
        else:
            reroute.append(ms(change.mono_ns - t0))
        progress(f"bfd {links[i % len(links)]} trial {i + 1}/{trials}: reroute {reroute[-1] if change else 'none'} ms")
        _wait_sessions_up(hook.bfd, 5.0)
    return reroute, missed


def _wait_sessions_up(bfd, timeout_s):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(s == "up" for h in (A, B) for s in bfd.session_states(h).values()):
            return
        time.sleep(0.1)


def bfd_under(fab, prefix, bfd, spec, window_s):
    """How many BFD session-down events a gray fault caused over `window_s`."""
    n0 = len([c for c in bfd.changes(A) if c.new == "down"])
    faults.apply(prefix, spec)
    time.sleep(window_s)
    faults.clear(prefix)
    _wait_sessions_up(bfd, 5.0)
    return len([c for c in bfd.changes(A) if c.new == "down"]) - n0


# ---- route operations --------------------------------------------------------------------------

def route_ops(fab, n):
    """Route changes per second: LinkPass's actuator (own netlink message) vs pyroute2's replace."""
    from linkpass.agent.routes import RouteActuator
    from linkpass.testbed.agents import peer_routes

    with tempfile.TemporaryDirectory() as d:
        act = RouteActuator(fab.netns(host_name(A)), fab.service_addr(A), peer_routes(fab, A), f"{d}/journal",
                            max_changes_per_s=1e9, burst=10**9)
        act.reconcile()
        peer = host_name(B)
        t = time.perf_counter()
        for i in range(n):
            act.set_usable(peer, {1} if i % 2 else {0, 1})
        ours = n / (time.perf_counter() - t)
        ipr = act._open()
        pr = act.peers[peer]
        t = time.perf_counter()
        for i in range(n):
            planes = (1,) if i % 2 else (0, 1)
            hops = [{"gateway": pr.hops[p][0], "oif": act._index[pr.hops[p][1]]} for p in planes]
            kw = dict(dst=pr.service, dst_len=32, proto=RTPROT_LINKPASS, prefsrc=act.own_service,
                      metrics={"RTAX_RTO_MIN": 10})
            kw.update(multipath=hops) if len(hops) > 1 else kw.update(gateway=hops[0]["gateway"], oif=hops[0]["oif"])
            ipr.route("replace", **kw)
        theirs = n / (time.perf_counter() - t)
        act.remove_all()
        act.close()
    return ours, theirs


def flush_routes(fab, proto):
    for h in (A, B):
        subprocess.run(["ip", "-n", fab.netns(host_name(h)), "route", "flush", "proto", str(proto)], check=False)


class _DetectDone(Exception):
    """--detect-only: the detection cases are measured; skip the rest (cleanup still runs)."""


def _write_detect_only(args, lp, gray, trials) -> int:
    # the fault is stamped inside the kernel call that makes it (faults.LINK_DOWN_SHARE,
    # NFT_COMMIT_SHARE); the call's duration bounds how far off that stamp can be
    hard_w = statistics.median(windows["hard"]) if windows.get("hard") else None
    nft_w = statistics.median(windows["nft"]) if windows.get("nft") else None
    rows = []
    for case in ("host-uplink-down", "leaf-spine-down"):
        rows.append(row(case, "detect", "ms", lp[case][0], trials=trials, stamp_call_ms_median=hard_w))
        rows.append(row(case, "fault_to_reroute", "ms", lp[case][1], trials=trials, rerouted=len(lp[case][1])))
    for case, results in gray.items():
        times = [t for t, _, _ in results if t is not None]
        rows.append(row(case, "detect", "ms", times, trials=len(results), detected=len(times),
                        reasons=sorted({r for _, r, _ in results if r}), stamp_call_ms_median=nft_w))
    for r in rows:
        print(f"{r['case']:22} {r['metric']:8} {r['n']:>3} {str(r['median']):>10} {str(r['p99']):>8}")
    report.write(report.document("failover", rows, mode="detect-only", agents=[host_name(A), host_name(B)],
                                 probe_interval_ms=1.0, flap_half_life_ms=FLAP_HALF_LIFE_MS), args.json)
    return 0


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few trials, short soak (smoke test)")
    ap.add_argument("--trials", type=int, default=None, help="hard-fault trials per case and side (default 20)")
    ap.add_argument("--soak-s", type=float, default=None, help="healthy-saturated duration (default 600 s)")
    ap.add_argument("--gray-trials", type=int, default=None, help="trials per gray case (default 5)")
    ap.add_argument("--detect-only", action="store_true",
                    help="only LinkPass's detection cases (the simulator's calibration reference)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--keep-logs", action="store_true", help="keep the agents' logs (path printed at the end)")
    args = ap.parse_args()
    if not report.require_root():
        return 2
    trials = args.trials or (4 if args.quick else 20)
    soak_s = args.soak_s or (20 if args.quick else 600)
    spacing = 6.0  # hold-downs (0.5 s) long over, timeouts settled
    prefix = f"fb{os.getpid() % 10000}"
    rows: list[dict] = []
    fab = build.up(topology.preset("default"), prefix)
    workdir = tempfile.mkdtemp(prefix="linkpass-failover-")
    uplinks = [fab.uplink(host_name(A), p).name for p in (0, 1)]
    spine_links = [fab.leaf_spine(fab.leaf_of(A, p), 0).name for p in (0, 1)]
    try:
        # -- LinkPass
        print("LinkPass agents on h0 and h2, 1 ms probes")
        # Flap damping with its default 10 s half-life would (rightly) call a link that fails every
        # few seconds flapping and keep it out; trials are that link. The agents here use a 1 s
        # half-life so every trial starts undamped; the flap case measures damping itself.
        agents = Agents(fab, workdir, [A, B], detect={"flap_half_life_ms": FLAP_HALF_LIFE_MS}).start()
        try:
            progress("agents warming up (10 s): RTTs learned, start-up lateness faded")
            time.sleep(10)
            lp = {}
            for case, links in (("host-uplink-down", uplinks), ("leaf-spine-down", spine_links)):
                lp[case] = linkpass_hard(prefix, agents, links, trials, spacing)
                progress("letting the flap penalties of these DOWNs fade (20 s)")
                time.sleep(20)
            gray = {}
            gray_cases = [("gray-loss-10", FaultSpec("loss", uplinks[0], params={"pct": 10.0}), ("gray_loss_fwd", "gray_loss_rev"), 2),
                          ("gray-loss-1", FaultSpec("loss", uplinks[0], params={"pct": 1.0}), ("gray_loss_fwd", "gray_loss_rev"), 10),
                          ("one-direction-loss", FaultSpec("loss", uplinks[0], host_name(A), {"pct": 10.0}),
                           ("gray_loss_fwd",), 2),
                          ("mtu-blackhole", FaultSpec("mtu", uplinks[0], params={"bytes": 1400}), ("mtu_blackhole",), 5)]
            gray_trials = args.gray_trials or (2 if args.quick else 5)
            for case, spec, reasons, window in gray_cases:
                gray[case] = []
                for k in range(gray_trials):
                    gray[case].append(linkpass_gray(prefix, agents, spec, reasons, window))
                    progress(f"{case} trial {k + 1}/{gray_trials}: {gray[case][-1]}")
                    time.sleep(spacing)
            if args.detect_only:
                raise _DetectDone
            # TCP across a plane failure (from a healthy fabric: both planes in the route)
            agents.wait_healthy(timeout_s=60)
            time.sleep(1)
            stall_lp = tcp_across_cut(fab, prefix, uplinks[0])
            progress(f"tcp with linkpass: longest gap {stall_lp.max_gap_ms} ms")
            time.sleep(spacing)
            print(f"healthy soak with 2 CPU burners, {soak_s:.0f} s")
            fp = soak(agents, soak_s, 2)
            # flap: down/up every 50 ms for 3 s; LinkPass should move off and stay off (damping)
            n0 = len(agents.events(A, "route_change"))
            rec = faults.apply(prefix, FaultSpec("flap", uplinks[0], params={"period": "50ms", "duration": "3s"}))
            t0 = rec["effective_mono_ns"]
            time.sleep(3)
            faults.clear(prefix)
            flap_down = first(agents.events(A, "path_state"), lambda e: e["mono_ns"] >= t0 and e["new"] == "down")
            flap_changes = len(agents.events(A, "route_change")) - n0
        finally:
            agents.stop()
            faults.clear(prefix)
        flush_routes(fab, RTPROT_LINKPASS)
        # -- without LinkPass: the same TCP flow
        stall_none = tcp_across_cut(fab, prefix, uplinks[0])
        progress(f"tcp without linkpass: longest gap {stall_none.max_gap_ms} ms")
        # -- BFD
        bfd_rows = {}
        bfd_gray = {}
        if frr.available():
            print("FRR bfdd 10 ms x 3 on h0 and h2, one session per plane, route hook on h0")
            bfd = frr.Bfd(fab, [A, B])
            bfd.start([(A, B, 0), (A, B, 1)])
            hook = BfdRouteHook(bfd, A)
            hook.start()
            try:
                for case, links in (("host-uplink-down", uplinks), ("leaf-spine-down", spine_links)):
                    bfd_rows[case] = bfd_hard(fab, prefix, hook, links, trials)
                for case, spec, _, window in gray_cases:
                    bfd_gray[case] = bfd_under(fab, prefix, bfd, spec, min(window, 3))
                    progress(f"bfd under {case}: {bfd_gray[case]} session downs")
            finally:
                hook.stop()
                bfd.stop()
                faults.clear(prefix)
        ours, theirs = route_ops(fab, 200 if args.quick else 2000)
    except _DetectDone:
        pass
    finally:
        faults.clear(prefix)
        build.down(prefix)
        if args.keep_logs:
            print(f"agent logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    if args.detect_only:
        return _write_detect_only(args, lp, gray, trials)
    for case in ("host-uplink-down", "leaf-spine-down"):
        detect, reroute = lp[case]
        b_reroute, b_missed = bfd_rows.get(case, ([], None))
        rows.append(row(case, "detect", "ms", detect))
        rows.append(row(case, "fault_to_reroute", "ms", reroute, PEER_BFD, b_reroute,
                        trials=trials, rerouted=len(reroute), peer_rerouted=len(b_reroute),
                        note=None if case == "host-uplink-down" else
                        "a multihop BFD session follows one ECMP path: a spine link it does not cross goes unseen"))
    for case, results in gray.items():
        times = [t for t, _, _ in results if t is not None]
        rows.append(row(case, "detect", "ms", times, trials=len(results), detected=len(times),
                        reasons=sorted({r for _, r, _ in results if r}),
                        wrong_reason_transitions=sum(w for _, _, w in results),
                        peer=PEER_BFD, peer_session_downs=bfd_gray.get(case)))
    rows.append(row("flap", "detect", "ms", [ms(flap_down["at_ns"] - MONO_TO_WALL - t0)] if flap_down else [],
                    route_changes_during_3s_of_flapping=flap_changes))
    rows.append(row("tcp-flow-plane-down", "stall", "ms", [stall_lp.max_gap_ms], "no-linkpass", [stall_none.max_gap_ms],
                    lost=stall_lp.lost, peer_lost=stall_none.lost))
    rows.append(row("healthy-saturated", "false_positives", "count", [fp[A]["downs"] + fp[B]["downs"]],
                    seconds=soak_s, burners=2, per_host=fp))
    rows.append(row("route-ops", "route_ops", "per_s", [round(ours)], "pyroute2-route-replace", [round(theirs)],
                    better="higher"))
    print(f"\n{'case':22} {'metric':18} {'n':>3} {'median':>10} {'p99':>8} {'peer median':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:22} {r['metric']:18} {r['n']:>3} {str(r['median']):>10} {str(r['p99']):>8} "
              f"{str(r.get('peer_median')):>12} {str(r.get('ratio')):>6}")
    report.write(report.document("failover", rows, agents=[host_name(A), host_name(B)], probe_interval_ms=1.0,
                                 flap_half_life_ms=FLAP_HALF_LIFE_MS), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
