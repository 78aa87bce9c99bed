#!/usr/bin/env python3
"""RDMA on Soft-RoCE guests: does a steered QP carry its port, and how long does a QP's traffic
stall when its path dies — LinkPass's channel (standby QP, short QP timeout) against a QP with
NCCL's defaults (timeout 20, retry count 7) on the same fault in the same run.

    python bench/rdma.py [--quick] [--trials N] [--json FILE]

Two hosts of the default testbed are QEMU guests with rdma_rxe (TCG emulation: every time here
is guest time under emulation, far slower than a real NIC; the rows say so). Rows:
  port-choice   QPs whose packets carried exactly the port they were steered to (capture on the
                leaf), n of n, both directions
  spine-cut     longest gap between two acknowledged messages of a stream whose active QP's
                spine link is taken down: LinkPass channel vs NCCL-default QP (peer)
  spine-cut-agents  the same fault with LinkPass agents in both guests (probing through UD QPs):
                a channel whose QPs keep NCCL's timeouts but follow the agent's entropy table,
                vs the NCCL-default QP of the same run; and how long after the agent's verdict
                the channel moved (detect-to-move)
  ring-*        the NCCL plugin's ring all-reduce between the guests on verbs lanes (RC QPs on
                ports from the agents' tables) under an uplink cut, a leaf-spine link down and
                30 % one-way loss on the spine the ring uses: the ring's longest stall, vs a QP
                with NCCL's defaults on the same fault in the same run; whether the wire showed
                the chunks on another QP and back after the fault; which detector moved the
                lane first; and the ring's longest stall without a fault (ring-no-fault)
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "rdma/linkpass_rdma",
    "rdma/guest",
    "linkpass/testbed/guests.py",
    "bench/rdma.py",
)


import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "rdma"))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.report import row  # noqa: E402
from linkpass.console.output import table  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.testbed import agents, build, guest_ring, guests, roce_paths, topology  # noqa: E402
from linkpass_rdma import channel  # noqa: E402

A, B = 0, 3
PEER = f"nccl-default-qp (timeout {channel.NCCL_TIMEOUT}, retry {channel.NCCL_RETRY})"
STUCK_S = 60.0  # a message stuck this long ends the trial (NCCL's QP takes longer than that to give up here)
EMULATED = "guest time under QEMU TCG emulation with rdma_rxe; a real NIC is orders of magnitude faster"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 trial each, 8 ports")
    ap.add_argument("--trials", type=int, default=None, help="fault trials per side (default 5; quick 1)")
    ap.add_argument("--ring-trials", type=int, default=None, help="ring trials per fault (default 3; quick 1)")
    ap.add_argument("--prefix", default="rb")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if not report.require_root():
        return 2
    trials = args.trials or (1 if args.quick else 5)
    ports = list(range(49152, 49152 + (8 if args.quick else 24)))
    t0 = time.monotonic()
    build.clean(args.prefix)
    spec = topology.preset("default")
    spec = type(spec)(**{**spec.__dict__, "rdma_hosts": (A, B)})
    report.progress(f"testbed {args.prefix} with Soft-RoCE guests {host_name(A)}, {host_name(B)}")
    fab = build.up(spec, args.prefix, progress=report.progress)
    rows = []
    try:
        ca, cb = guests.Control(fab.prefix, A), guests.Control(fab.prefix, B)
        report.progress(f"steering {len(ports)} QPs, one per port, captured on both leaves")
        paths = roce_paths.map_ports(fab, A, B, ports, ca, cb)
        good = [p for p, pp in paths.items() if pp.reported == p and len(pp.forward) == 1 and len(pp.reverse) == 1
                and not pp.foreign]
        rows.append({"case": "port-choice", "metric": "qps_on_their_port", "unit": "count", "n": len(paths),
                     "median": len(good), "p99": None, "note": "n of n: every packet of the QP (both directions) "
                     "carried the steered port and stayed on one spine", "emulated": EMULATED})
        via = {p: pp.forward[0] for p, pp in paths.items() if p in good and pp.forward == pp.reverse}
        s0 = [p for p, s in via.items() if s == "s0"]
        s1 = [p for p, s in via.items() if s == "s1"]
        leaf_a, _ = roce_paths.spine_ports(fab, A, 0)
        cut = fab.leaf_spine(leaf_a, 0).name
        ours, peer, moved_ok = [], [], 0
        stuck = {"linkpass": 0, "nccl-default": 0}
        for i in range(trials):
            use = [s0[i % len(s0)]] + s1
            for side, knobs, out in (("linkpass", {}, ours),
                                     ("nccl-default", {"timeout": channel.NCCL_TIMEOUT, "retry": channel.NCCL_RETRY},
                                      peer)):
                report.progress(f"trial {i + 1}/{trials} {side}: active port {use[0]} via s0, cut {cut}")
                run = roce_paths.channel_under_fault(fab, A, B, ca, cb, use, cut, count=200, limit_s=STUCK_S + 60,
                                                     deadline_s=STUCK_S, **knobs)
                out.append(run.result["longest_gap_ms"])
                stuck[side] += bool(run.result.get("stuck"))
                moves = [e for e in run.result["events"] if e["event"] == "moved"]
                if side == "linkpass" and moves and moves[0]["from"] == use[0] and via.get(moves[0]["to"]) == "s1" \
                        and run.served.get("delivered") == 200:
                    moved_ok += 1
                report.progress(f"  longest gap {run.result['longest_gap_ms']} ms, moves {run.result['moves']}")
        rows.append({**row("spine-cut", "longest_gap", "ms", ours, PEER, peer), "emulated": EMULATED,
                     "moved_to_other_spine": f"{moved_ok} of {trials}",
                     "stuck": stuck, "stuck_note": f"a stuck stream gave up after {STUCK_S:.0f} s without its QP "
                     "erroring or moving: its gap is a lower bound",
                     "settings": f"timeout {channel.FAST_TIMEOUT}, retry {channel.FAST_RETRY}, standby QP"})
        rows += agents_phase(fab, ca, cb, trials, peer, {**via, **{p: pp.forward[0] for p, pp in paths.items()}})
        rows += ring_phase(fab, ca, cb, args.ring_trials or (1 if args.quick else 3), s0, s1)
    finally:
        build.down(args.prefix)
    doc = report.document("rdma", rows, trials=trials, ports=len(ports), seconds=round(time.monotonic() - t0))
    report.write(doc, args.json)
    print(table(["CASE", "METRIC", "N", "MEDIAN", "P99", "PEER", "PEER MEDIAN", "RATIO"],
                [[r["case"], f"{r['metric']} ({r['unit']})", r["n"], r["median"], r["p99"], r.get("peer", ""),
                  r.get("peer_median", ""), r.get("ratio", "")] for r in rows]))
    return 0


AGENT_INTERVAL_MS = 50
# one-way delays are judged only beyond 50 ms of noise: an emulated NIC carrying the ring queues that much
AGENT_DETECT = {"timeout_floor_us": 100_000, "timeout_ceiling_ms": 400, "latency_floor_us": 50_000}
TABLE = agents.GUEST_TABLE


def agents_phase(fab, ca, cb, trials: int, peer: list, spine_of: dict) -> list[dict]:
    """Agents in both guests; per trial, a table-following channel (NCCL's QP timeouts) under the
    cut of its active port's spine link."""
    gaps, detect_to_move, moved_ok = [], [], 0
    addr_b = fab.nic_addr(B, 0)
    report.progress(f"agents in {host_name(A)} and {host_name(B)}: probes through UD QPs every {AGENT_INTERVAL_MS} ms")
    with agents.GuestAgents(fab, [A, B], interval_ms=AGENT_INTERVAL_MS, probe={"batch_ms": 50},
                            detect=AGENT_DETECT, controls={A: ca, B: cb}) as ga:
        leaf_a, _ = roce_paths.spine_ports(fab, A, 0)
        for i in range(trials):
            deadline = time.monotonic() + 120
            while len(ports := roce_paths.healthy_ports(ca, addr_b)) < 2:  # both spines healthy again
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the table never listed both spines' ports: {ga.log(A)[-1500:]}")
                time.sleep(1)
            missing = [p for p in ports if p not in spine_of]
            if missing:
                spine_of.update({p: pp.forward[0] for p, pp in roce_paths.map_ports(fab, A, B, missing, ca, cb).items()})
            active = ports[0]  # the channel starts on the table's first healthy port
            cut = fab.leaf_spine(leaf_a, roce_paths.spine_of_if(spine_of[active])).name
            report.progress(f"trial {i + 1}/{trials} agents: active port {active} via {spine_of[active]}, cut {cut}")
            run = roce_paths.channel_under_fault(fab, A, B, ca, cb, ports, cut, count=200, limit_s=STUCK_S + 60,
                                                 deadline_s=STUCK_S, timeout=channel.NCCL_TIMEOUT,
                                                 retry=channel.NCCL_RETRY, table=TABLE, lead_s=2.0)
            gaps.append(run.result["longest_gap_ms"])
            moves = [e for e in run.result["events"] if e["event"] == "moved"]
            downs = [e for e in ga.events(A, "path_state") if e["plane"] == 0 and e["sport"] == active
                     and e["new"] == "down" and moves and e["mono_ns"] / 1e9 <= moves[0]["t"]]
            if moves and moves[0]["why"] == "port left the healthy set" and \
                    spine_of.get(moves[0]["to"]) != spine_of[active] and run.served.get("delivered") == 200:
                moved_ok += 1
            if moves and downs:
                detect_to_move.append((moves[0]["t"] - downs[-1]["mono_ns"] / 1e9) * 1e3)
            report.progress(f"  longest gap {run.result['longest_gap_ms']} ms, moves {run.result['moves']}")
    return [{**row("spine-cut-agents", "longest_gap", "ms", gaps, PEER, peer), "emulated": EMULATED,
             "moved_by_table": f"{moved_ok} of {trials}",
             "settings": f"QP timeout {channel.NCCL_TIMEOUT}, retry {channel.NCCL_RETRY} (NCCL's), following the "
             f"agent's entropy table; agents probe every {AGENT_INTERVAL_MS} ms through UD QPs, software stamps"},
            {**row("detect-to-move", "agent_down_to_channel_move", "ms", detect_to_move), "emulated": EMULATED,
             "note": "from the agent's DOWN verdict to the channel's move, both on the guest's monotonic clock"}]


def ring_phase(fab, ca, cb, trials: int, s0: list[int], s1: list[int]) -> list[dict]:
    """The plugin's ring between the guests, agents in both, per fault kind `trials` times; beside
    each trial a stream on a QP with NCCL's defaults (no table) under the same fault."""
    addrs = {p: (fab.nic_addr(A, p), fab.nic_addr(B, p)) for p in range(fab.spec.planes)}
    _, ports = roce_paths.spine_ports(fab, A, 0)
    rows = []
    report.progress(f"the NCCL plugin's ring between {host_name(A)} and {host_name(B)} on verbs lanes, agents in both")
    with agents.GuestAgents(fab, [A, B], interval_ms=AGENT_INTERVAL_MS, probe={"batch_ms": 50},
                            detect=AGENT_DETECT, controls={A: ca, B: cb}):
        def healed(plane):
            return lambda: len(roce_paths.healthy_ports(ca, addrs[plane][1], plane)) >= 2

        for plane in (0, 1):
            roce_paths.wait_until(healed(plane), 120, "the agents listing both spines", poll_s=2.0)
        base = guest_ring.ring_under_fault(fab, A, B, ca, cb, None, lead_s=5, hold_s=20, after_s=5, tag="ring-base")
        rows.append({**row("ring-no-fault", "longest_stall", "ms", [guest_ring.longest_gap_ms(base.steps[0], 5)]),
                     "emulated": EMULATED, "iterations": base.summary[0]["iterations"] if base.summary[0] else None,
                     "note": "the same ring for 30 s without a fault: the stalls this emulated host has anyway"})
        for kind in guest_ring.FAULT_KINDS:
            plane = guest_ring.AimedFault(fab, A, B, kind).plane
            stalls, peer_gaps, moved, back, ok, causes, peer_stuck, peer_unfinished = [], [], 0, 0, 0, {}, 0, 0
            for i in range(trials):
                roce_paths.wait_until(healed(plane), 150, "the agents listing both spines again", poll_s=2.0)
                aim = guest_ring.AimedFault(fab, A, B, kind)
                report.progress(f"ring {kind} trial {i + 1}/{trials}")
                run = guest_ring.ring_under_fault(fab, A, B, ca, cb, aim, lead_s=5, hold_s=20, after_s=10, healed=healed(plane),
                                                  heal_timeout_s=150, tag=f"ring-{kind}")
                stalls.append(guest_ring.longest_gap_ms(run.steps[0], 5))
                ok += run.rc == [0, 0] and all(s and s["errors"] == 0 and s["wrong"] == 0 for s in run.summary)
                wire = guest_ring.wire_verdict(run, addrs, plane, aim.victim)
                moved += wire.moved
                back += wire.back
                downs = [e for e in run.lanes(0) if e.what == "down"]
                cause = guest_ring.move_cause(downs[0]) if downs else "none"
                causes[cause] = causes.get(cause, 0) + 1
                report.progress(f"  longest stall {stalls[-1]:.0f} ms, moved on the wire {wire.moved}, back {wire.back}, "
                                f"first move by {cause}")
                # the peer: a stream on a QP with NCCL's defaults, no table, under the same fault on plane 0
                spine = ports.index(aim.victim) if aim.victim else 0
                use = ([s0[i % len(s0)]] + s1) if spine == 0 else ([s1[i % len(s1)]] + s0)
                # under loss the peer's stream crawls rather than stops (every lost packet waits for the
                # QP's 4.3 s timeout): fewer messages, the fault right after the stream is up; one that
                # does not finish in time has no gap to report (counted as unfinished)
                lossy = kind.startswith("loss")
                count, limit, lead = (60, STUCK_S + 240, 0.3) if lossy else (200, STUCK_S + 60, 2.0)
                report.progress(f"  peer: a QP with NCCL's defaults on port {use[0]}, {count} messages")
                try:
                    pr = roce_paths.channel_under_fault(fab, A, B, ca, cb, use, guest_ring.fault_of(fab, A, kind, 0, spine),
                                                        count=count, limit_s=limit, deadline_s=STUCK_S,
                                                        timeout=channel.NCCL_TIMEOUT, retry=channel.NCCL_RETRY,
                                                        lead_s=lead)
                    peer_gaps.append(pr.result["longest_gap_ms"])
                    peer_stuck += bool(pr.result.get("stuck"))
                except RuntimeError as exc:
                    peer_unfinished += 1
                    report.progress(f"  peer did not finish: {exc}")
                    continue
                report.progress(f"  peer longest gap {peer_gaps[-1]} ms")
            rows.append({**row(f"ring-{kind}", "longest_stall", "ms", stalls, PEER, peer_gaps), "emulated": EMULATED,
                         "no_error_no_wrong_byte": f"{ok} of {trials}", "moved_to_another_qp_on_the_wire":
                         f"{moved} of {trials}", "back_on_the_path_after": f"{back} of {trials}",
                         "first_move_by": causes, "peer_stuck": f"{peer_stuck} of {trials}",
                         "peer_unfinished": f"{peer_unfinished} of {trials}",
                         "peer_note": f"a stuck peer gave up after {STUCK_S:.0f} s without its QP erroring: its gap "
                         "is a lower bound; an unfinished one (no gap) did not deliver its messages in time",
                         "settings": "verbs lanes (2 per plane + 1 standby), ports from the agents' entropy tables, "
                         f"lane stuck bound {guest_ring.GUEST_PLUGIN_ENV['LINKPASS_STUCK_MS']} ms, QP timeout "
                         f"{guest_ring.GUEST_PLUGIN_ENV['LINKPASS_QP_TIMEOUT']}; 256 KiB all-reduce, 20 ms compute "
                         "per step; peer: a stream on one RC QP with timeout 20, retry 7, no table"})
    return rows


if __name__ == "__main__":
    sys.exit(main())
