#!/usr/bin/env python3
"""Failover: from a fault on the testbed to the route rewritten, LinkPass against FRR bfdd
(10 ms × 3) driving the same route change, measured in the same run on the same fabric.

    python bench/failover.py [--quick] [--trials N] [--soak-s S] [--saturated-only] [--json FILE]

Agents run on h0 and h2 (different leaves, so every fault kind has a path through it); on this
2-core machine four agents plus the software fabric's forwarding (every probe crosses four
namespaces in the sender's softirq) saturate both cores before any competing load, which is an
artifact of simulating the fabric, not of the agent. Hard faults alternate between the two
planes, 6 s apart; the agents' flap-damping half-life is 1 s instead of 10 s so that repeated
trials on the same link are not (rightly) damped as flapping; the flap case shows damping.

Cases: host-uplink-down, leaf-spine-down (metrics detect, fault_to_reroute; peer BFD),
flap, gray-loss-10, gray-loss-1, one-direction-loss, mtu-blackhole (detect; what BFD did under
the same fault), tcp-flow-plane-down (stall; peer: the same flow without LinkPass),
healthy-saturated (false route changes under two CPU burners), cut-saturated (fault_to_reroute of
uplink cuts under the same load), route_ops (per_s; peer pyroute2).
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/core/detector.py",
    "linkpass/core/failover.py",
    "linkpass/core/decide.py",
    "linkpass/core/constants.py",
    "linkpass/agent/daemon.py",
    "linkpass/agent/data_path.py",
    "linkpass/agent/loop_priority.py",
    "linkpass/agent/rates.py",
    "linkpass/agent/routes.py",
    "linkpass/agent/netlink.py",
    "linkpass/probe/_probecore.c",
    "linkpass/probe/engine.py",
    "linkpass/testbed/faults.py",
    "bench/failover.py",
)


import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.benchkit import A, B, FLAP_HALF_LIFE_MS  # noqa: E402
from linkpass_sim.report import progress, row  # noqa: E402
from linkpass.core.constants import RTPROT_LINKPASS  # noqa: E402
from linkpass.core.names import host_name, leaf_name, link_name, spine_name  # noqa: E402
from linkpass.core.states import State  # noqa: E402
from linkpass.testbed import build, faults, frr, steal, tcpflow, topology  # noqa: E402
from linkpass.testbed.agents import Agents  # noqa: E402
from linkpass.testbed.bfd_hook import BfdRouteHook  # noqa: E402
from linkpass.testbed.faults import FaultSpec  # noqa: E402
from linkpass.testbed.trials import (  # noqa: E402
    MONO_TO_WALL, apply_fault, first, link_plane, linkpass_hard, ms)

PEER_BFD = "frr-bfdd-10msx3"
DOWN, DEGRADED = State.DOWN.value, State.DEGRADED.value  # as agents log path states
# A's uplinks on both planes (A hangs off leaf 0) and leaf 0's link to spine 0 on both planes
UPLINKS = [link_name(host_name(A), leaf_name(p, 0)) for p in (0, 1)]
SPINE_LINKS = [link_name(leaf_name(p, 0), spine_name(p, 0)) for p in (0, 1)]
HARD_CASES = (("host-uplink-down", UPLINKS), ("leaf-spine-down", SPINE_LINKS))
# case, fault, the reasons that count as detecting it, seconds to wait for the verdict
GRAY_CASES = [("gray-loss-10", FaultSpec("loss", UPLINKS[0], params={"pct": 10.0}), ("gray_loss_fwd", "gray_loss_rev"), 2),
              ("gray-loss-1", FaultSpec("loss", UPLINKS[0], params={"pct": 1.0}), ("gray_loss_fwd", "gray_loss_rev"), 10),
              ("one-direction-loss", FaultSpec("loss", UPLINKS[0], host_name(A), {"pct": 10.0}), ("gray_loss_fwd",), 2),
              ("mtu-blackhole", FaultSpec("mtu", UPLINKS[0], params={"bytes": 1400}), ("mtu_blackhole",), 5)]
SPACING_S = 6.0  # between trials: hold-downs (0.5 s) long over, timeouts settled
BURNERS = 2


@dataclass
class Settings:
    trials: int  # hard-fault trials per case and side
    gray_trials: int
    soak_s: float
    route_ops: int
    detect_only: bool
    saturated_only: bool = False

    @classmethod
    def from_args(cls, args) -> "Settings":
        return cls(trials=args.trials or (4 if args.quick else 20), gray_trials=args.gray_trials or (2 if args.quick else 5),
                   soak_s=args.soak_s or (20 if args.quick else 600), route_ops=200 if args.quick else 2000,
                   detect_only=args.detect_only, saturated_only=args.saturated_only)


@dataclass
class Measured:
    """Everything one run measured; the rows are made from it."""
    hard: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)  # case -> (detect, reroute) ms
    hard_steal: dict[str, list[tuple]] = field(default_factory=dict)  # case -> per trial (reroute ms | None, steal ms)
    gray: dict[str, list[tuple]] = field(default_factory=dict)  # case -> per trial (detect ms | None, reason, wrong)
    windows: dict[str, list[float]] = field(default_factory=lambda: {"hard": [], "nft": []})  # fault calls' ms
    stall_lp: tcpflow.StallResult | None = None
    stall_none: tcpflow.StallResult | None = None
    false_positives: dict = field(default_factory=dict)  # host -> counts
    cut_saturated: list[float] = field(default_factory=list)  # uplink cut -> reroute, ms, both cores saturated
    flap_detect: list[float] = field(default_factory=list)
    flap_changes: int = 0
    bfd_hard: dict[str, tuple[list[float], int]] = field(default_factory=dict)  # case -> (reroute ms, missed)
    bfd_steal: dict[str, list[tuple]] = field(default_factory=dict)  # case -> per trial (reroute ms | None, steal ms)
    bfd_gray: dict[str, int] = field(default_factory=dict)  # case -> session downs
    route_ops: tuple[float, float] = (0.0, 0.0)  # per second: ours, pyroute2's


# ---- LinkPass --------------------------------------------------------------------------------

def linkpass_gray(prefix, agents, spec, reasons, window_s, windows: list[float]):
    """Apply a gray fault; time to the first DEGRADED with one of `reasons` on a path to B."""
    agents.wait_healthy(timeout_s=60)
    rec = apply_fault(prefix, spec)
    t0 = rec["effective_mono_ns"]
    windows.append(ms(rec["effective_window_ns"][1] - rec["effective_window_ns"][0]))
    ev = agents.wait_for(A, "path_state", lambda e: e["mono_ns"] >= t0 and e["new"] == DEGRADED
                         and e["reason"] in reasons, window_s)
    wrong = [e for e in agents.events(A, "path_state") if e["mono_ns"] >= t0 and e["new"] == DEGRADED
             and e["reason"] not in reasons]
    faults.clear(prefix)
    return (ms(ev["at_ns"] - MONO_TO_WALL - t0) if ev else None), (ev or {}).get("reason"), len(wrong)


def soak(prefix, agents, seconds, burners, cut_trials):
    """Both cores saturated by `burners` busy loops: first `seconds` on a healthy fabric (every
    route change is a false one), then, under the same load, `cut_trials` uplink cuts (fault ->
    route rewritten). Returns per-host counts of the healthy part and the cuts' reroute times."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    t0 = time.monotonic_ns()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(min(30.0, max(0.0, end - time.monotonic())))
            progress(f"healthy soak: {int(seconds - (end - time.monotonic()))}/{int(seconds)} s")
        t1 = time.monotonic_ns()
        _, cuts = linkpass_hard(prefix, agents, A, B, UPLINKS, cut_trials, SPACING_S, progress)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = {}
    for h in (A, B):
        evs = [e for e in agents.events(h) if t0 < e.get("mono_ns", 0) < t1]
        out[h] = {"downs": sum(1 for e in evs if e.get("event") == "path_state" and e["new"] == DOWN),
                  "spurious_undone": sum(1 for e in evs if e.get("event") == "path_state"
                                         and e["reason"] == "spurious_down"),
                  "reroutes": sum(1 for e in evs if e.get("event") == "route_change"),
                  "lateness_raised": sum(1 for e in evs if e.get("event") == "host_lateness")}
    return out, cuts


def flap(prefix, agents) -> tuple[list[float], int]:
    """Down/up every 50 ms for 3 s: LinkPass should move off and stay off (damping). The DOWN
    verdict's time (ms) and how many route changes the 3 s caused."""
    n0 = len(agents.events(A, "route_change"))
    rec = apply_fault(prefix, FaultSpec("flap", UPLINKS[0], params={"period": "50ms", "duration": "3s"}))
    time.sleep(3)
    # from the flapper's first link-down, not its launch (a process start: tens of ms here)
    t0 = next((t for t, what in faults.flap_transitions(prefix, rec["id"]) if what == "down"),
              rec["effective_mono_ns"])
    faults.clear(prefix)
    down = first(agents.events(A, "path_state"), lambda e: e["mono_ns"] >= t0 and e["new"] == DOWN)
    detect = [ms(down["at_ns"] - MONO_TO_WALL - t0)] if down else []
    return detect, len(agents.events(A, "route_change")) - n0


def tcp_across_cut(fab, prefix, uplink):
    """A TCP flow A -> B hashed onto plane 0; `uplink` (A's, plane 0) down for 2 s mid-flow."""
    flow = tcpflow.TcpFlow(fab, A, B, sport=tcpflow.sport_for_plane(fab, A, B, 0)).start()
    time.sleep(1)
    faults.apply(prefix, FaultSpec("down", uplink))
    time.sleep(2)
    faults.clear(prefix)
    time.sleep(1)
    return flow.stop()


def measure_linkpass(fab, prefix, workdir, st: Settings, m: Measured) -> None:
    """Agents on A and B: the hard and gray cases; unless detect-only, then TCP across a cut, the
    healthy soak under CPU burners, and the flap."""
    print("LinkPass agents on h0 and h2, 1 ms probes")
    agents = Agents(fab, workdir, [A, B], detect={"flap_half_life_ms": FLAP_HALF_LIFE_MS}).start()
    try:
        progress("agents warming up (10 s): RTTs learned, start-up lateness faded")
        time.sleep(10)
        if st.saturated_only:
            agents.wait_healthy(timeout_s=60)
            print(f"healthy soak with {BURNERS} CPU burners, {st.soak_s:.0f} s, then {st.trials} uplink cuts under the same load")
            m.false_positives, m.cut_saturated = soak(prefix, agents, st.soak_s, BURNERS, st.trials)
            return
        for case, links in HARD_CASES:
            m.hard_steal[case] = []
            m.hard[case] = linkpass_hard(prefix, agents, A, B, links, st.trials, SPACING_S, progress, m.windows["hard"],
                                         m.hard_steal[case])
            progress("letting the flap penalties of these DOWNs fade (20 s)")
            time.sleep(20)
        for case, spec, reasons, window in GRAY_CASES:
            m.gray[case] = []
            for k in range(st.gray_trials):
                m.gray[case].append(linkpass_gray(prefix, agents, spec, reasons, window, m.windows["nft"]))
                progress(f"{case} trial {k + 1}/{st.gray_trials}: {m.gray[case][-1]}")
                time.sleep(SPACING_S)
        if st.detect_only:
            return
        # TCP across a plane failure (from a healthy fabric: both planes in the route)
        agents.wait_healthy(timeout_s=60)
        time.sleep(1)
        m.stall_lp = tcp_across_cut(fab, prefix, UPLINKS[0])
        progress(f"tcp with linkpass: longest gap {m.stall_lp.max_gap_ms} ms")
        time.sleep(SPACING_S)
        print(f"healthy soak with {BURNERS} CPU burners, {st.soak_s:.0f} s, then {st.trials} uplink cuts under the same load")
        m.false_positives, m.cut_saturated = soak(prefix, agents, st.soak_s, BURNERS, st.trials)
        m.flap_detect, m.flap_changes = flap(prefix, agents)
    finally:
        agents.stop()
        faults.clear(prefix)


# ---- BFD -------------------------------------------------------------------------------------

def bfd_hard(fab, prefix, hook, links, trials, stolen: list[tuple]):
    reroute, missed = [], 0
    for i in range(trials):
        n0 = len(hook.records())
        link = links[i % len(links)]
        plane = link_plane(link)
        steal_before = steal.sample()
        rec = apply_fault(prefix, FaultSpec("down", link))
        t0 = rec["effective_mono_ns"]
        deadline = time.monotonic() + 1.0
        change = None
        while time.monotonic() < deadline and change is None:
            change = first(hook.records()[n0:], lambda c: c.mono_ns >= t0 and c.peer == host_name(B)
                           and plane not in c.planes)
            time.sleep(0.005)
        took_steal = steal.stolen_ms(steal_before, steal.sample())
        faults.clear(prefix)
        stolen.append((None if change is None else ms(change.mono_ns - t0), took_steal))
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


def measure_bfd(fab, prefix, st: Settings, m: Measured) -> None:
    """FRR bfdd (when installed) under the same hard faults, and how it took the gray ones."""
    if not frr.available():
        return
    print("FRR bfdd 10 ms x 3 on h0 and h2, one session per plane, route hook on h0")
    bfd = frr.Bfd(fab, [A, B])
    bfd.start([(A, B, 0), (A, B, 1)])
    hook = BfdRouteHook(bfd, A)
    hook.start()
    try:
        for case, links in HARD_CASES:
            m.bfd_steal[case] = []
            m.bfd_hard[case] = bfd_hard(fab, prefix, hook, links, st.trials, m.bfd_steal[case])
        for case, spec, _, window in GRAY_CASES:
            m.bfd_gray[case] = bfd_under(fab, prefix, bfd, spec, min(window, 3))
            progress(f"bfd under {case}: {m.bfd_gray[case]} session downs")
    finally:
        hook.stop()
        bfd.stop()
        faults.clear(prefix)


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


# ---- the run -----------------------------------------------------------------------------------

def measure(st: Settings, keep_logs: bool) -> Measured:
    """Build the testbed, measure every case (LinkPass; then, unless detect-only, the same TCP flow
    without it, BFD and route operations), tear it down."""
    prefix = f"fb{os.getpid() % 10000}"
    m = Measured()
    fab = build.up(topology.preset("default"), prefix)
    workdir = tempfile.mkdtemp(prefix="linkpass-failover-")
    try:
        measure_linkpass(fab, prefix, workdir, st, m)
        if not st.detect_only and not st.saturated_only:
            flush_routes(fab, RTPROT_LINKPASS)
            m.stall_none = tcp_across_cut(fab, prefix, UPLINKS[0])
            progress(f"tcp without linkpass: longest gap {m.stall_none.max_gap_ms} ms")
            measure_bfd(fab, prefix, st, m)
            m.route_ops = route_ops(fab, st.route_ops)
    finally:
        faults.clear(prefix)
        build.down(prefix)
        if keep_logs:
            print(f"agent logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return m


def detect_only_rows(st: Settings, m: Measured) -> list[dict]:
    # the fault is stamped inside the kernel call that makes it (faults.LINK_DOWN_SHARE,
    # NFT_COMMIT_SHARE); the call's duration bounds how far off that stamp can be
    hard_w = statistics.median(m.windows["hard"]) if m.windows["hard"] else None
    nft_w = statistics.median(m.windows["nft"]) if m.windows["nft"] else None
    rows = []
    for case, _ in HARD_CASES:
        detect, reroute = m.hard[case]
        rows.append(row(case, "detect", "ms", detect, trials=st.trials, stamp_call_ms_median=hard_w))
        rows.append(row(case, "fault_to_reroute", "ms", reroute, trials=st.trials, rerouted=len(reroute)))
    for case, results in m.gray.items():
        times = [t for t, _, _ in results if t is not None]
        rows.append(row(case, "detect", "ms", times, trials=len(results), detected=len(times),
                        reasons=sorted({r for _, r, _ in results if r}), stamp_call_ms_median=nft_w))
    return rows


def steal_fields(trials: list[tuple]) -> dict:
    """What the hypervisor took during a case's trials (linkpass.testbed.steal): how many trials
    saw a CPU lose two ticks or more (at least one tick, 10 ms, stolen), the figures of the others,
    and the slowest trials with their steal."""
    timed = [(t, s) for t, s in trials if t is not None]
    if not timed:
        return {}
    tick_ms = steal.TICK_NS / 1e6
    calm = [t for t, s in timed if s < 2 * tick_ms]
    return {"host_steal_trials": len(timed) - len(calm), "without_steal_n": len(calm),
            "without_steal_median": round(statistics.median(calm), 3) if calm else None,
            "without_steal_max": max(calm) if calm else None,
            "slowest_with_steal_ms": sorted(timed, reverse=True)[:3]}


def rows_of(st: Settings, m: Measured) -> list[dict]:
    rows = []
    for case, _ in HARD_CASES:
        detect, reroute = m.hard[case]
        b_reroute, b_missed = m.bfd_hard.get(case, ([], None))
        rows.append(row(case, "detect", "ms", detect))
        rows.append(row(case, "fault_to_reroute", "ms", reroute, PEER_BFD, b_reroute,
                        trials=st.trials, rerouted=len(reroute), peer_rerouted=len(b_reroute),
                        **steal_fields(m.hard_steal.get(case, [])),
                        **{f"peer_{k}": v for k, v in steal_fields(m.bfd_steal.get(case, [])).items()},
                        note=None if case == "host-uplink-down" else
                        "a multihop BFD session follows one ECMP path: a spine link it does not cross goes unseen"))
    for case, results in m.gray.items():
        times = [t for t, _, _ in results if t is not None]
        rows.append(row(case, "detect", "ms", times, trials=len(results), detected=len(times),
                        reasons=sorted({r for _, r, _ in results if r}),
                        wrong_reason_transitions=sum(w for _, _, w in results),
                        peer=PEER_BFD, peer_session_downs=m.bfd_gray.get(case)))
    rows.append(row("flap", "detect", "ms", m.flap_detect, route_changes_during_3s_of_flapping=m.flap_changes))
    rows.append(row("tcp-flow-plane-down", "stall", "ms", [m.stall_lp.max_gap_ms], "no-linkpass",
                    [m.stall_none.max_gap_ms], lost=m.stall_lp.lost, peer_lost=m.stall_none.lost))
    rows += saturated_rows(st, m)
    ours, theirs = m.route_ops
    rows.append(row("route-ops", "route_ops", "per_s", [round(ours)], "pyroute2-route-replace", [round(theirs)],
                    better="higher"))
    return rows


def saturated_rows(st: Settings, m: Measured) -> list[dict]:
    rows = []
    fp = m.false_positives
    rows.append(row("healthy-saturated", "false_route_changes", "count", [fp[A]["reroutes"] + fp[B]["reroutes"]],
                    seconds=st.soak_s, burners=BURNERS, path_downs=fp[A]["downs"] + fp[B]["downs"],
                    downs_undone=fp[A]["spurious_undone"] + fp[B]["spurious_undone"], per_host=fp))
    rows.append(row("cut-saturated", "fault_to_reroute", "ms", m.cut_saturated, trials=st.trials,
                    rerouted=len(m.cut_saturated), burners=BURNERS,
                    note="host-uplink-down under the healthy soak's load; the calm figure is host-uplink-down's"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few trials, short soak (smoke test)")
    ap.add_argument("--trials", type=int, default=None, help="hard-fault trials per case and side (default 20)")
    ap.add_argument("--soak-s", type=float, default=None, help="healthy-saturated duration (default 600 s)")
    ap.add_argument("--gray-trials", type=int, default=None, help="trials per gray case (default 5)")
    ap.add_argument("--detect-only", action="store_true",
                    help="only LinkPass's detection cases (the simulator's calibration reference)")
    ap.add_argument("--saturated-only", action="store_true",
                    help="only the CPU-starvation cases: healthy-saturated and cut-saturated")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--keep-logs", action="store_true", help="keep the agents' logs (path printed at the end)")
    args = ap.parse_args()
    if not report.require_root():
        return 2
    st = Settings.from_args(args)
    m = measure(st, args.keep_logs)
    extra = dict(agents=[host_name(A), host_name(B)], probe_interval_ms=1.0, flap_half_life_ms=FLAP_HALF_LIFE_MS)
    if st.detect_only:
        rows = detect_only_rows(st, m)
        for r in rows:
            print(f"{r['case']:22} {r['metric']:8} {r['n']:>3} {str(r['median']):>10} {str(r['p99']):>8}")
        report.write(report.document("failover", rows, mode="detect-only", **extra), args.json)
        return 0
    rows = saturated_rows(st, m) if st.saturated_only else rows_of(st, m)
    print(f"\n{'case':22} {'metric':18} {'n':>3} {'median':>10} {'p99':>8} {'peer median':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:22} {r['metric']:18} {r['n']:>3} {str(r['median']):>10} {str(r['p99']):>8} "
              f"{str(r.get('peer_median')):>12} {str(r.get('ratio')):>6}")
    report.write(report.document("failover", rows, **extra), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
