#!/usr/bin/env python3
"""Reliability of the agent's routes across SIGKILL: kill `linkpass agent` at random moments of
route changes, restart it, and count stale or missing routes right after its reconcile.

    python sim/bench/reliability_agent.py [--quick] [--trials N] [--json FILE]

Agents run on h0 and h2 of the default testbed, each with every other host as a peer (the peers
without an agent keep their routes: they are never heard). While h0's agent runs, h0's plane-0
uplink goes down and up in turn (down 120 ms, up 250 ms; the agents' hold-down is cut to 50 ms),
so its route to h2 moves between (1,) and (0, 1) about every 185 ms; h0's agent is killed at a
uniformly random moment 0.3..1.5 s after it started probing, the toggling stops where it is
(the plane left up or down), and the agent is started again on the same journal. Once it logs
`routes_reconciled`, the kernel's routes of ours in h0 are read and compared:

- missing: a configured peer without a route of ours, or with a route of no plane;
- stale: a route to a destination that is no peer's, or whose planes are neither what the
  reconcile says it installed nor what a route change the new agent logged since then says.

The row counts both per trial (`stale_or_missing_routes`, median and p99 over trials), with how
many kills came within 200 ms after a route change and how many routes the reconciles had to
fix (a kill between the journal write and the kernel change leaves one behind).

Its function `row_agent_sigkill(quick)` is the reliability benchmark's `agent-sigkill` row.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.benchkit import A, B  # noqa: E402
from linkpass_sim.report import progress, row  # noqa: E402
from linkpass.core.constants import RTPROT_LINKPASS  # noqa: E402
from linkpass.core.names import host_name, leaf_name, link_name  # noqa: E402
from linkpass.testbed import build, faults, topology  # noqa: E402
from linkpass.testbed.agents import LINKPASS, write_agent_configs  # noqa: E402
from linkpass.testbed.faults import FaultSpec  # noqa: E402

TRIALS, QUICK_TRIALS = 100, 10
DOWN_S, UP_S = 0.12, 0.25  # the toggled uplink's down and up times
KILL_AFTER_S = (0.3, 1.5)  # the kill's moment after the agent started probing (uniform)
NEAR_CHANGE_NS = 200_000_000
DETECT = {"hold_down_ms": 50, "recovery_good_probes": 20, "flap_half_life_ms": 100}
UPLINK = link_name(host_name(A), leaf_name(0, 0))  # A's plane-0 uplink (A hangs off leaf 0)


class Toggler:
    """Takes A's plane-0 uplink down and up in turn until stopped (a thread of this process)."""

    def __init__(self, prefix: str):
        self.prefix, self._stop = prefix, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Toggler":
        self._thread.start()
        return self

    def _run(self) -> None:
        faults.clear(self.prefix, UPLINK)  # the last trial may have left it down
        down = False
        while not self._stop.is_set():
            if down:
                faults.clear(self.prefix, UPLINK)
            else:
                faults.apply(self.prefix, FaultSpec("down", UPLINK))
            down = not down
            self._stop.wait(DOWN_S if down else UP_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def events(path: str, kind: str | None = None) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if kind is None or ev.get("event") == kind:
                    out.append(ev)
    except FileNotFoundError:
        pass
    return out


def start_agent(fab, host: int, config: str, log_path: str) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(["ip", "netns", "exec", fab.netns(host_name(host)), *LINKPASS, "agent",
                                 "--config", config], stdout=subprocess.DEVNULL, stderr=log)


def wait_event(proc: subprocess.Popen, log_path: str, kind: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = events(log_path, kind)
        if got:
            return got[0]
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited with {proc.returncode}: {open(log_path).read()[-1500:]}")
        time.sleep(0.005)
    raise RuntimeError(f"no {kind!r} from the agent within {timeout_s} s")


def kernel_routes(fab, host: int) -> dict[str, tuple[int, ...]]:
    """Our routes in a host's namespace: destination -> planes (by device), as the kernel has them."""
    from pyroute2 import IPRoute

    with IPRoute(netns=fab.netns(host_name(host))) as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        out = {}
        for r in ipr.get_routes(family=2, proto=RTPROT_LINKPASS):
            mp = r.get_attr("RTA_MULTIPATH")
            oifs = [h["oif"] for h in mp] if mp else [r.get_attr("RTA_OIF")]
            out[r.get_attr("RTA_DST")] = tuple(sorted(int(names[o][1:]) for o in oifs if o in names))
        return out


def judge(fab, kernel: dict, installed: dict, changes: list[dict]) -> tuple[int, int]:
    """(stale, missing) routes of A after a reconcile (see the module doc)."""
    service = {host_name(j): fab.service_addr(j) for j in range(fab.spec.hosts) if j != A}
    missing = sum(1 for name, addr in service.items() if not kernel.get(addr))
    stale = sum(1 for addr in kernel if addr not in service.values())
    for name, addr in service.items():
        planes = kernel.get(addr)
        if not planes:
            continue
        allowed = {tuple(installed.get(name, ()))} | {tuple(c["planes"]) for c in changes if c["peer"] == name}
        stale += planes not in allowed
    return stale, missing


def row_agent_sigkill(quick: bool) -> dict:
    """The `agent-sigkill` row: stale or missing routes after SIGKILL + restart + reconcile."""
    trials = QUICK_TRIALS if quick else TRIALS
    prefix = f"rk{os.getpid() % 10000}"
    rng = random.Random(1)
    fab = build.up(topology.preset("default"), prefix)
    work = tempfile.mkdtemp(prefix="linkpass-bench-sigkill-")
    procs: dict[int, subprocess.Popen] = {}
    per_trial, stale_total, missing_total, near, fixes, restart_ms = [], 0, 0, 0, 0, []
    try:
        configs = write_agent_configs(fab, work, bytes(range(32)), interval_ms=1.0, routes=True, entropy=True,
                                      detect=DETECT)
        procs[B] = start_agent(fab, B, configs[B], os.path.join(work, "agent-b.log"))
        wait_event(procs[B], os.path.join(work, "agent-b.log"), "started", 30)
        log = os.path.join(work, "agent-a-0.log")
        procs[A] = start_agent(fab, A, configs[A], log)
        wait_event(procs[A], log, "started", 30)
        for k in range(trials):
            toggler = Toggler(prefix).start()
            time.sleep(rng.uniform(*KILL_AFTER_S))
            procs[A].send_signal(signal.SIGKILL)
            killed_ns = time.monotonic_ns()
            procs[A].wait(timeout=10)
            toggler.stop()
            near += any(0 <= killed_ns - c["mono_ns"] <= NEAR_CHANGE_NS for c in events(log, "route_change"))
            log = os.path.join(work, f"agent-a-{k + 1}.log")
            t0 = time.monotonic()
            procs[A] = start_agent(fab, A, configs[A], log)
            rec = wait_event(procs[A], log, "routes_reconciled", 30)
            kernel = kernel_routes(fab, A)
            restart_ms.append((time.monotonic() - t0) * 1000)
            stale, missing = judge(fab, kernel, rec["installed"], events(log, "route_change"))
            per_trial.append(stale + missing)
            stale_total, missing_total, fixes = stale_total + stale, missing_total + missing, fixes + rec["reconciled"]
            if stale or missing:
                progress(f"trial {k}: stale {stale}, missing {missing}: kernel {kernel}, installed {rec['installed']}")
            wait_event(procs[A], log, "started", 30)
            if k % 10 == 9:
                progress(f"{k + 1}/{trials} kills: stale {stale_total}, missing {missing_total}, "
                         f"within 200 ms of a change {near}, reconcile fixes {fixes}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        faults.clear(prefix)
        build.down(prefix)
        shutil.rmtree(work, ignore_errors=True)
    restart_ms.sort()
    return row("agent-sigkill", "stale_or_missing_routes", "count", per_trial, trials=trials, stale=stale_total,
               missing=missing_total, kills_within_200ms_of_a_route_change=near, reconcile_fixes=fixes,
               restart_to_reconciled_ms_median=round(restart_ms[len(restart_ms) // 2], 1) if restart_ms else None,
               routes_checked_per_trial=fab.spec.hosts - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_TRIALS} kills instead of {TRIALS}")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if not report.require_root():
        return 2
    r = row_agent_sigkill(args.quick)
    print(f"\n{'case':16} {'metric':26} {'n':>4} {'median':>7} {'p99':>5}  stale missing near-change fixes")
    print(f"{r['case']:16} {r['metric']:26} {r['n']:>4} {str(r['median']):>7} {str(r['p99']):>5}  "
          f"{r['stale']:>5} {r['missing']:>7} {r['kills_within_200ms_of_a_route_change']:>11} {r['reconcile_fixes']:>5}")
    report.write(report.document("reliability", [r]), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
