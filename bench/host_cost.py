#!/usr/bin/env python3
"""What the agent costs a host: its CPU with its rates off and on, the same host in one run, and
how fast it finds a failure under the job's traffic.

    python bench/host_cost.py [--quick] [--seconds S] [--json FILE]

The agent's whole process CPU (probe thread, decision loop, API, the traffic sampler, the lane
reports) from /proc/PID/stat, in windows of `seconds / 10` over `seconds` (60 s by default) per
run, once with `probe.idle_rates` off (every path at the active rate, no probe budget: the agent as
it was) and once with the rates on at their defaults. In both runs the host's job is the same:
lanes to its job peers on every plane (`linkpass.testbed.lanejob`: a TCP stream per lane, 16 KiB
every 2 ms, reported in a lane report as the NCCL plugin reports its lanes, its acknowledged bytes
the ones the peer's TCP acknowledged).

- (a) `testbed-h0`: the default testbed, four agents probing each other; h0 (10 paths) has lanes
  to h1 (its leaf) and h3 (across the spines: the one the cuts stall).
- (b) `rail8-h0`: the rail8 testbed (8 hosts x 8 planes, 2 leaves and 2 spines per plane): h0
  probes every other host on every plane, 88 paths, the share of the 16 384-GPU plan one host
  gets (~88 paths, docs/coordinator.md); its job peers are h1 and h7 (a ring's neighbours), a
  lane to each on every plane. The other hosts only reflect (no paths of their own), so the
  machine's two cores are not spent on their probing.

After the CPU windows, in the same run: `detect` trials. h0's plane-0 uplink is cut under the
running lanes (its lanes on that plane stall) and the time from the cut (the testbed's stamp of
the carrier change) to h0's first DOWN towards its far job peer on plane 0 is taken from its log;
then the cut is cleared and the paths recover (up, not damped) before the next trial.

- `sim-16384`, `sim-131072`: the fleet simulator's price at 16 384 and 131 072 GPUs (2-tier,
  rail-optimized; the job a ring over every rail, 4 ECMP paths per neighbour and rail, each a
  verbs lane), from the agent's own rate logic (`linkpass_sim.fleet.probe_cost`): CPU per host at
  the measured cost of an exchange, probe packets per NIC; with the job's lanes progressing
  (`sim-N`) and quiet between collectives (`sim-N-quiet`). `--sim-only` runs just these.

- `rail8-h0` also gets a cost model, from two more runs without a job, every path idle: probed at
  1 Hz and at 10 Hz. The 1 Hz run is the agent's cost that does not follow its probes (its loop,
  the sampler, the API), `cpu_fixed`; the difference between the two over the difference in
  probes is what one exchange costs the agent here, `cpu_per_probe` (µs of CPU per probe sent, with
  its reply and the kernel's forwarding of both through the testbed's software routers, which
  this VM charges to the sender).

Rows per case: `cpu` (pct of one core; peer = rates off, ratio = off/on), and of it
`cpu_main_thread` (the decision loop, Python: replies turned into verdicts, the lane reports'
looks, rates) and `cpu_probe_thread` (the C probe core: sends, receives, answers, the software
routers' forwarding charged to it; the rest is the API, the traffic sampler, metrics), `probes_sent` (per_s of
the host, from the probe core's own counter; `ring_full_drops`: replies the C core dropped because
the Python side fell behind, a sign the host is saturated), `paths_<rate>` (with rates on),
`detect` (ms, peer = rates off). Targets: case (b) <= 10 % of one core with rates on; detection
under the job's traffic p99 <= 10 ms.
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/probe/_probecore.c",
    "linkpass/probe/lane_watch.h",
    "linkpass/probe/engine.py",
    "linkpass/core/activity.py",
    "linkpass/core/budget.py",
    "linkpass/agent/daemon.py",
    "linkpass/agent/rates.py",
    "bench/host_cost.py",
)


import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import report  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.kernel import netns as ns_io  # noqa: E402
from linkpass.testbed import build, topology  # noqa: E402
from linkpass.testbed.agents import LINKPASS, write_agent_configs  # noqa: E402
from linkpass.testbed import faults  # noqa: E402
from linkpass.testbed.lanejob import LaneJob  # noqa: E402

KEY = bytes(range(32))
PROBE_THREAD = "lp-probe"  # the probe core's thread (linkpass/probe/_probecore.c names it)
TICK = os.sysconf("SC_CLK_TCK")
RATES_ON = {"idle_rates": True}  # and every other rate setting at its default
RATES_OFF = {"idle_rates": False, "budget_pps": 0, "budget_cpu_pct": 0}
COST_MODEL = {f"cost-{1000 // ms}hz": {"idle_rates": True, "idle_interval_ms": ms, "standby_interval_ms": ms,
                                        "progress_interval_ms": ms} for ms in (1000, 100)}  # no job: every path idle
CASES = {  # case -> (preset, agents that probe (all other agents only reflect), job peers of h0, the far one)
    "testbed-h0": ("default", "all", [1, 3], 3),
    "rail8-h0": ("rail8", [0], [1, 7], 7),
}
TRIALS = 5


def _stat_cpu_s(stat: str) -> float:
    """utime + stime, in seconds, of a /proc/.../stat line."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        return _stat_cpu_s(f.read())


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the agent's main thread (the decision loop: Python) and of its probe
    thread (the C probe core, named PROBE_THREAD)."""
    main = probe = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue  # a thread that ended meanwhile
        name = text[text.index("(") + 1:text.rindex(")")]
        seconds = _stat_cpu_s(text)
        if int(tid) == pid:
            main = seconds
        elif name == PROBE_THREAD:
            probe = seconds
    return main, probe


def api_json(fab, host: int, port: int, path: str):
    """GET from an agent's local API, over a socket made in its host's namespace (no process
    started: that would cost the CPU being measured)."""
    s = ns_io.socket_in_netns(fab.netns(host_name(host)), socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(15)
        s.connect(("127.0.0.1", port))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
        conn.sock = s
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        s.close()


def events(workdir: str, host: int, kind: str) -> list[dict]:
    out = []
    with open(os.path.join(workdir, f"agent-{host}.log")) as f:
        for line in f:
            if f'"event": "{kind}"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


SLOW_CUT_MS = 10.0  # a cut found later than the target: its paths' changes are printed


def detect_trials(fab, workdir: str, far: int, trials: int) -> list[float]:
    """Cut h0's plane-0 uplink (carrier down), `trials` times: ms from the cut to h0's first DOWN
    towards `far` on plane 0. Each cut waits until those paths are up again (not held down, not
    damped by the previous cuts' flaps), up to a minute."""
    out = []
    for _ in range(trials):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = [r for r in api_json(fab, 0, 9471, "/v1/state") if r.get("peer") == host_name(far)
                    and r.get("plane") == 0]
            if rows and all(r.get("state") == "up" for r in rows):
                break
            time.sleep(0.5)
        time.sleep(2)  # the lanes back at their steady rate
        before = len(events(workdir, 0, "path_state"))
        t_fault = faults.apply(fab.prefix, faults.FaultSpec("down", "h0-p0l0"))["effective_mono_ns"]
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            time.sleep(0.05)
            got = next((e for e in events(workdir, 0, "path_state")[before:]
                        if e.get("new") == "down" and e.get("peer") == host_name(far) and e.get("plane") == 0
                        and e["mono_ns"] >= t_fault), None)  # not a line a saturated agent logged late
        faults.clear(fab.prefix)
        # what those paths did, so a slow verdict or a miss can be told apart: (sport, old, new,
        # reason, ms after the cut) of each change, and the detail (probes missed, timeout) of the DOWN
        seen = [(e.get("sport"), e.get("old"), e.get("new"), e.get("reason"), round((e["mono_ns"] - t_fault) / 1e6, 1))
                for e in events(workdir, 0, "path_state")[before:]
                if e.get("peer") == host_name(far) and e.get("plane") == 0]
        if got is not None:
            out.append(round((got["mono_ns"] - t_fault) / 1e6, 2))
            slow = f"; slower than {SLOW_CUT_MS} ms: {seen[:6]}, {got.get('detail')}" if out[-1] > SLOW_CUT_MS else ""
            report.progress(f"  cut at mono {t_fault}: {out[-1]} ms{slow}")
        else:
            report.progress(f"  cut at mono {t_fault}: no DOWN within 10 s; those paths' changes "
                            f"(sport, old, new, reason, ms after the cut): {seen[:6] or 'none'}")
    return out


def run_case(fab, probers, job_peers: list[int], far: int | None, rates_on: bool, seconds: float,
             workdir: str, trials: int, probe: dict | None = None) -> dict:
    """Start the agents and the job (none without `job_peers`); measure h0's agent; cut and time
    detection; stop everything. `probe`: the agents' probe settings, instead of rates on or off."""
    import subprocess

    probe = dict(probe) if probe is not None else dict(RATES_ON) if rates_on else dict(RATES_OFF)
    configs = write_agent_configs(fab, workdir, KEY, interval_ms=1.0, routes=False, entropy=False, probe=probe)
    lanes_dir = yaml.safe_load(open(configs[0]))["probe"]["lanes_dir"]
    hosts = range(fab.spec.hosts)
    for h in hosts:
        if probers != "all" and h not in probers:
            doc = yaml.safe_load(open(configs[h]))
            doc["peers"] = []  # reflects only
            with open(configs[h], "w") as f:
                yaml.safe_dump(doc, f)
    procs, job = {}, None
    try:
        for h in hosts:
            log = open(os.path.join(workdir, f"agent-{h}.log"), "w")
            procs[h] = subprocess.Popen(["ip", "netns", "exec", fab.netns(host_name(h)), *LINKPASS, "agent", "--config",
                                         configs[h], "--max-seconds", str(seconds + 300)],
                                        stdout=subprocess.DEVNULL, stderr=log)
            log.close()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if all('"event": "started"' in open(os.path.join(workdir, f"agent-{h}.log")).read() for h in hosts):
                break
            if any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"an agent exited: {open(os.path.join(workdir, 'agent-0.log')).read()[-1500:]}")
            time.sleep(0.2)
        else:
            raise RuntimeError("agents did not start within 90 s")
        os.makedirs(lanes_dir, exist_ok=True)  # the agent makes it when rates are on; the job reports either way
        if job_peers:
            job = LaneJob(fab, 0, job_peers, list(range(fab.spec.planes)), lanes_dir, max_seconds=seconds + 240).start()
        time.sleep(3 if rates_on else 1)  # rates settle, discovery's bursts pass
        pid = procs[0].pid
        windows, sent, main_thread, probe_thread = [], [], [], []
        step = seconds / 10
        for _ in range(10):
            (m0, p0), c0, t0 = thread_cpu_s(pid), cpu_s(pid), time.monotonic()
            s0, ts0 = api_json(fab, 0, 9471, "/v1/counters")["stats"]["sent"], time.monotonic()
            time.sleep(step)
            (m1, p1), c1, t1 = thread_cpu_s(pid), cpu_s(pid), time.monotonic()
            s1, ts1 = api_json(fab, 0, 9471, "/v1/counters")["stats"]["sent"], time.monotonic()
            windows.append(100.0 * (c1 - c0) / (t1 - t0))
            main_thread.append(100.0 * (m1 - m0) / (t1 - t0))
            probe_thread.append(100.0 * (p1 - p0) / (t1 - t0))
            # timed by when each answer came back: a saturated agent's API can answer seconds late
            sent.append((s1 - s0) / (ts1 - ts0))
        rows = api_json(fab, 0, 9471, "/v1/paths")
        rates = {}
        for r in rows:
            rates[r.get("rate", "active")] = rates.get(r.get("rate", "active"), 0) + 1
        drops = api_json(fab, 0, 9471, "/v1/counters")["drops"]
        detect = detect_trials(fab, workdir, far, trials) if far is not None and trials else []
        return {"cpu": windows, "cpu_main_thread": main_thread, "cpu_probe_thread": probe_thread,
                "sent": sent, "rates": rates, "paths": len(rows), "ring_full": drops.get("ring_full", 0),
                "detect": detect}
    finally:
        if job is not None:
            job.stop()
        faults.clear(fab.prefix)
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def cost_rows(case: str, slow: dict, fast: dict) -> list[dict]:
    """The agent's CPU that does not follow its probes (every path at 1 Hz), and what one probe
    costs (the 10 Hz run's extra CPU over its extra probes), window by window."""
    per_probe = [1e4 * (f - s) / (fs - ss) for f, s, fs, ss in zip(fast["cpu"], slow["cpu"], fast["sent"], slow["sent"])
                 if fs > ss]
    return [report.row(case, "cpu_fixed", "pct", slow["cpu"], probes_per_s=round(statistics.median(slow["sent"]))),
            report.row(case, "cpu_per_probe", "us", per_probe, probes_per_s=round(statistics.median(fast["sent"])))]


def sim_rows(gpus_list: list[int]) -> list[dict]:
    """The simulator's price of a fleet host, rates on (peer: off), from the agent's rate logic."""
    from linkpass_sim.failures import Shape
    from linkpass_sim.fleet import Fleet, probe_cost

    rows = []
    for gpus in gpus_list:
        report.progress(f"sim-{gpus}: building the simulated fleet ({gpus} GPUs)")
        fleet = Fleet(Shape.for_gpus(gpus))
        off = probe_cost(fleet, idle_rates=False)
        for case, progressing in ((f"sim-{gpus}", True), (f"sim-{gpus}-quiet", False)):
            on = probe_cost(fleet, idle_rates=True, progressing=progressing)
            rows.append(report.row(case, "cpu", "pct", on["cpu_pct_per_host"], peer="rates-off",
                                   peer_values=off["cpu_pct_per_host"], paths=on["paths"],
                                   **{k: v for k, v in on.items() if k.startswith("paths_")}, note=on["note"]))
            rows.append(report.row(case, "probes_per_nic", "per_s", on["tx_pps_per_nic"], peer="rates-off",
                                   peer_values=off["tx_pps_per_nic"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 s per run instead of 60")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sim-only", action="store_true", help="only the simulator's price (no root, no testbed)")
    args = ap.parse_args()
    if not args.sim_only and not report.require_root():
        return 2
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    rows = []
    trials = 2 if args.quick else TRIALS
    for case, (preset, probers, job, far) in ({} if args.sim_only else CASES).items():
        prefix = "hc"
        build.clean(prefix)
        report.progress(f"{case}: building the {preset} testbed")
        fab = build.up(topology.preset(preset), prefix)
        try:
            got = {}
            for on in (False, True):
                report.progress(f"{case}: rates {'on' if on else 'off'}, {seconds:.0f} s"
                                + (f", then {trials} cuts" if far is not None else ""))
                with tempfile.TemporaryDirectory(prefix="host-cost-") as d:
                    got[on] = run_case(fab, probers, job, far, on, seconds, d, trials)
            if case == "rail8-h0":
                for name, probe in COST_MODEL.items():
                    report.progress(f"{case}: cost model, no job, every path idle at {name[5:]}, {seconds / 2:.0f} s")
                    with tempfile.TemporaryDirectory(prefix="host-cost-") as d:
                        got[name] = run_case(fab, probers, [], None, True, seconds / 2, d, 0, probe=probe)
        finally:
            build.down(prefix)
        rows.append(report.row(case, "cpu", "pct", got[True]["cpu"], peer="rates-off",
                               peer_values=got[False]["cpu"], paths=got[True]["paths"]))
        for thread in ("cpu_main_thread", "cpu_probe_thread"):
            rows.append(report.row(case, thread, "pct", got[True][thread], peer="rates-off",
                                   peer_values=got[False][thread]))
        rows.append(report.row(case, "probes_sent", "per_s", got[True]["sent"], peer="rates-off",
                               peer_values=got[False]["sent"],
                               ring_full_drops=got[True]["ring_full"], peer_ring_full_drops=got[False]["ring_full"]))
        for rate, n in sorted(got[True]["rates"].items()):
            rows.append(report.row(case, f"paths_{rate}", "paths", [n]))
        if "cost-1hz" in got:
            rows += cost_rows(case, got["cost-1hz"], got["cost-10hz"])
        on, off = got[True]["detect"], got[False]["detect"]
        counts = dict(trials=trials, found_on=len(on), found_off=len(off))
        if on and off:
            rows.append(report.row(case, "detect", "ms", on, peer="rates-off", peer_values=off, **counts))
        elif on or off:  # one side found no DOWN within 10 s of any cut: no ratio to give
            side = "rates off" if on else "rates on"
            rows.append(report.row(case, "detect" if on else "detect-rates-off", "ms", on or off, **counts,
                                   note=f"{side}: no DOWN within 10 s of any of the {trials} cuts"))
    rows += sim_rows([16_384] if args.quick else [16_384, 131_072])
    print(f"{'case':<16} {'metric':<13} {'unit':<6} {'median':>9} {'p99':>9} {'rates off':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:<16} {r['metric']:<13} {r['unit']:<6} {r['median']!s:>9} {r['p99']!s:>9} "
              f"{r.get('peer_median', '')!s:>10} {r.get('ratio', '')!s:>6}")
    report.write(report.document("host_cost", rows, seconds_per_run=seconds), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
