#!/usr/bin/env python3
"""Reliability of the agent's routes across SIGKILL: kill `linkpass agent` at random moments of
route changes, restart it, and count stale or missing routes right after its reconcile.

    python sim/bench/reliability_agent.py [--quick] [--json FILE]

Agents run on h0 and h2 of the default testbed, each with every other host as a peer (the peers
without an agent keep their routes: they are never heard). While they run, h0's plane-0 uplink
goes down and up in turn (down 120 ms, up 250 ms; the agents' hold-down is cut to 50 ms), so
their routes to each other move between (1,) and (0, 1) several times a second. Both agents are
killed (SIGKILL) at one uniformly random moment 0.3..1.5 s after they started probing, the
toggling stops where it is (the plane left up or down), and both are started again on their
journals. Both, not one: a peer that keeps running drops a restarted agent's probes as replays
until the new incarnation's sequence numbers pass the old one's (its reflector's replay window
is per sender and path id, and both restart from the same values), so a lone restarted agent
would see no answers and make no route changes to be killed in. Once each logs
`routes_reconciled`, the kernel's routes of ours in its host are read and compared:

- missing: a configured peer without a route of ours, or with a route of no plane;
- stale: a route to a destination that is no peer's, or whose planes are neither what the
  reconcile says it installed nor what a route change the new agent logged since then says.

The row counts both per trial (`stale_or_missing_routes`, median and p99 over trials), with the
route changes made before the kills, how many kills came within 200 ms after one, and how many
routes the reconciles had to fix (a kill between the journal write and the kernel change leaves
one behind).

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
        self.toggles, self.errors = 0, []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Toggler":
        self._thread.start()
        return self

    def _run(self) -> None:
        down = False
        while not self._stop.is_set():
            try:
                faults.clear(self.prefix, UPLINK)  # also what the last trial may have left down
                if not down:
                    faults.apply(self.prefix, FaultSpec("down", UPLINK))
            except Exception as exc:  # noqa: BLE001 - counted and reported, the trial goes on
                self.errors.append(repr(exc))
            down = not down
            self.toggles += 1
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


def judge(fab, host: int, kernel: dict, installed: dict, changes: list[dict]) -> tuple[int, int]:
    """(stale, missing) routes of `host` after a reconcile (see the module doc)."""
    service = {host_name(j): fab.service_addr(j) for j in range(fab.spec.hosts) if j != host}
    missing = sum(1 for name, addr in service.items() if not kernel.get(addr))
    stale = sum(1 for addr in kernel if addr not in service.values())
    for name, addr in service.items():
        planes = kernel.get(addr)
        if not planes:
            continue
        allowed = {tuple(installed.get(name, ()))} | {tuple(c["planes"]) for c in changes if c["peer"] == name}
        stale += planes not in allowed
    return stale, missing


class Run:
    """Both agents of the run: their configs, processes and the log of each incarnation."""

    def __init__(self, fab, work: str):
        self.fab, self.work = fab, work
        self.configs = write_agent_configs(fab, work, bytes(range(32)), interval_ms=1.0, routes=True, entropy=True,
                                           detect=DETECT)
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, str] = {}
        self.incarnation = 0

    def start(self) -> dict[int, dict]:
        """Start both agents; their `routes_reconciled` events and, read right after each, the
        kernel's routes."""
        self.incarnation += 1
        got = {}
        for h in (A, B):
            self.logs[h] = os.path.join(self.work, f"agent-{host_name(h)}-{self.incarnation}.log")
            self.procs[h] = start_agent(self.fab, h, self.configs[h], self.logs[h])
        for h in (A, B):
            rec = wait_event(self.procs[h], self.logs[h], "routes_reconciled", 30)
            got[h] = {"reconciled": rec, "kernel": kernel_routes(self.fab, h)}
        for h in (A, B):
            wait_event(self.procs[h], self.logs[h], "started", 30)
        return got

    def kill(self) -> int:
        for h in (A, B):
            self.procs[h].send_signal(signal.SIGKILL)
        killed_ns = time.monotonic_ns()
        for h in (A, B):
            self.procs[h].wait(timeout=10)
        return killed_ns

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def row_agent_sigkill(quick: bool) -> dict:
    """The `agent-sigkill` row: stale or missing routes after SIGKILL + restart + reconcile."""
    trials = QUICK_TRIALS if quick else TRIALS
    prefix = f"rk{os.getpid() % 10000}"
    rng = random.Random(1)
    fab = build.up(topology.preset("default"), prefix)
    work = tempfile.mkdtemp(prefix="linkpass-bench-sigkill-")
    run = Run(fab, work)
    per_trial, stale_total, missing_total, near, fixes, seen, toggles, restart_ms = [], 0, 0, 0, 0, 0, 0, []
    try:
        run.start()
        for k in range(trials):
            toggler = Toggler(prefix).start()
            time.sleep(rng.uniform(*KILL_AFTER_S))
            killed_ns = run.kill()
            toggler.stop()
            toggles += toggler.toggles
            if toggler.errors:
                progress(f"trial {k}: the uplink toggler failed: {toggler.errors[:3]}")
            for h in (A, B):
                changed = events(run.logs[h], "route_change")
                seen += len(changed)
                near += any(0 <= killed_ns - c["mono_ns"] <= NEAR_CHANGE_NS for c in changed)
            t0 = time.monotonic()
            after = run.start()
            restart_ms.append((time.monotonic() - t0) * 1000)
            bad = 0
            for h, got in after.items():
                rec = got["reconciled"]
                stale, missing = judge(fab, h, got["kernel"], rec["installed"], events(run.logs[h], "route_change"))
                stale_total, missing_total, fixes = stale_total + stale, missing_total + missing, fixes + rec["reconciled"]
                bad += stale + missing
                if stale or missing:
                    progress(f"trial {k}, {host_name(h)}: stale {stale}, missing {missing}: kernel {got['kernel']}, "
                             f"installed {rec['installed']}")
            per_trial.append(bad)
            if k % 10 == 9:
                progress(f"{k + 1}/{trials} kills: stale {stale_total}, missing {missing_total}, route changes "
                         f"before the kills {seen}, kills within 200 ms after one {near}, reconcile fixes {fixes}")
    finally:
        run.stop()
        faults.clear(prefix)
        build.down(prefix)
        if os.environ.get("LINKPASS_BENCH_KEEP"):
            progress(f"agent logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    restart_ms.sort()
    return row("agent-sigkill", "stale_or_missing_routes", "count", per_trial, trials=trials, stale=stale_total,
               missing=missing_total, route_changes_before_kills=seen, kills_within_200ms_after_a_route_change=near,
               uplink_toggles=toggles, reconcile_fixes=fixes, hosts_killed_per_trial=2,
               routes_checked_per_trial=2 * (fab.spec.hosts - 1),
               restart_to_started_ms_median=round(restart_ms[len(restart_ms) // 2], 1) if restart_ms else None)


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
          f"{r['stale']:>5} {r['missing']:>7} {r['kills_within_200ms_after_a_route_change']:>11} {r['reconcile_fixes']:>5}")
    report.write(report.document("reliability", [r]), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
