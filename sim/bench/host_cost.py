#!/usr/bin/env python3
"""What the agent costs a host: its CPU with idle rates off and on, the same host in one run.

    python sim/bench/host_cost.py [--quick] [--seconds S] [--json FILE]

The agent's whole process CPU (probe thread, decision loop, API, the traffic sampler) from
/proc/PID/stat, in windows of `seconds / 10` over `seconds` (60 s by default) per run, once with
`probe.idle_rates` off (every path at the active rate) and once on; in both runs the host's job
traffic is the same TCP flows (1 message a millisecond each), so the same peers are active.

- (a) `testbed-h0`: the default testbed, four agents probing each other at 1 kHz; h0 (10 paths)
  sends a flow to h1.
- (b) `rail8-h0`: the rail8 testbed (8 hosts x 8 planes, 2 leaves and 2 spines per plane): h0
  probes every other host on every plane, 88 paths, the share of the 16 384-GPU plan one host
  gets (~88 paths, docs/coordinator.md); its job peers are h1 and h7 (a ring's neighbours),
  one flow each. The other hosts only reflect (no paths of their own), so the machine's two
  cores are not spent on their probing.

- `sim-16384`, `sim-131072`: the fleet simulator's price at 16 384 and 131 072 GPUs (2-tier,
  rail-optimized; the job a ring over every rail, 4 ECMP paths per neighbour and rail), from the
  agent's own rate logic (`linkpass_sim.fleet.probe_cost`): CPU per host at the measured cost of
  an exchange (rows over every host), probe packets per NIC. `--sim-only` runs just these.

Rows per case: `cpu` (pct of one core; peer = rates off, ratio = off/on), `probes_sent` (per_s of
the host, from the probe core's own counter; `ring_full_drops`: replies the C core dropped because
the Python side fell behind, a sign the host is saturated), `paths_active` / `paths_idle` (with
rates on). Target (the issue's): case (b) <= 10 %
of one core with rates on. Detection on active paths is the same code at the same rate as with
rates off (sim/bench/failover.py measures it); a cut under idle paths is tested in
tests/test_idle_rates.py. Not measured here yet: RDMA traffic (it does not show as TCP).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from linkpass_sim import report  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.kernel import netns as ns_io  # noqa: E402
from linkpass.testbed import build, topology  # noqa: E402
from linkpass.testbed.agents import LINKPASS, write_agent_configs  # noqa: E402
from linkpass.testbed.tcpflow import TcpFlow  # noqa: E402

KEY = bytes(range(32))
TICK = os.sysconf("SC_CLK_TCK")
RATES_ON = {"idle_rates": True, "idle_interval_ms": 100, "idle_after_ms": 5000}
CASES = {  # case -> (preset, agents that probe (all other agents only reflect), job peers of h0)
    "testbed-h0": ("default", "all", [1]),
    "rail8-h0": ("rail8", [0], [1, 7]),
}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


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


def run_case(fab, probers, job_peers: list[int], rates_on: bool, seconds: float, workdir: str) -> dict:
    """Start the agents, the flows; measure h0's agent; stop everything."""
    import subprocess

    probe = dict(RATES_ON) if rates_on else {}
    configs = write_agent_configs(fab, workdir, KEY, interval_ms=1.0, routes=False, entropy=False, probe=probe)
    hosts = range(fab.spec.hosts)
    for h in hosts:
        if probers != "all" and h not in probers:
            doc = yaml.safe_load(open(configs[h]))
            doc["peers"] = []  # reflects only
            with open(configs[h], "w") as f:
                yaml.safe_dump(doc, f)
    procs, flows = {}, []
    try:
        for h in hosts:
            log = open(os.path.join(workdir, f"agent-{h}.log"), "w")
            procs[h] = subprocess.Popen(["ip", "netns", "exec", fab.netns(host_name(h)), *LINKPASS, "agent", "--config",
                                         configs[h], "--max-seconds", str(seconds + 120)],
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
        flows = [TcpFlow(fab, 0, j, max_seconds=seconds + 60).start() for j in job_peers]
        time.sleep(3 if rates_on else 1)  # idle rates settle (a sample per 100 ms), discovery's bursts pass
        pid = procs[0].pid
        windows, sent = [], []
        step = seconds / 10
        for _ in range(10):
            c0, t0 = cpu_s(pid), time.monotonic()
            s0 = api_json(fab, 0, 9471, "/v1/counters")["stats"]["sent"]
            time.sleep(step)
            c1, t1 = cpu_s(pid), time.monotonic()
            s1 = api_json(fab, 0, 9471, "/v1/counters")["stats"]["sent"]
            windows.append(100.0 * (c1 - c0) / (t1 - t0))
            sent.append((s1 - s0) / (t1 - t0))
        rows = api_json(fab, 0, 9471, "/v1/paths")
        rates = {"active": sum(r.get("rate") == "active" for r in rows), "idle": sum(r.get("rate") == "idle" for r in rows)}
        drops = api_json(fab, 0, 9471, "/v1/counters")["drops"]
        return {"cpu": windows, "sent": sent, "rates": rates, "paths": len(rows), "ring_full": drops.get("ring_full", 0)}
    finally:
        for f in flows:
            f.stop(drain_s=0.5)
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def sim_rows(gpus_list: list[int]) -> list[dict]:
    """The simulator's price of a fleet host, idle rates on (peer: off), from the agent's rate logic."""
    from linkpass_sim.failures import Shape
    from linkpass_sim.fleet import Fleet, probe_cost

    rows = []
    for gpus in gpus_list:
        case = f"sim-{gpus}"
        report.progress(f"{case}: building the simulated fleet ({gpus} GPUs)")
        fleet = Fleet(Shape.for_gpus(gpus))
        off, on = probe_cost(fleet, idle_rates=False), probe_cost(fleet, idle_rates=True)
        rows.append(report.row(case, "cpu", "pct", on["cpu_pct_per_host"], peer="idle-rates-off",
                               peer_values=off["cpu_pct_per_host"], paths=on["paths"],
                               paths_active=on["paths_active"], paths_idle=on["paths_idle"], note=on["note"]))
        rows.append(report.row(case, "probes_per_nic", "per_s", on["tx_pps_per_nic"], peer="idle-rates-off",
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
    for case, (preset, probers, job) in ({} if args.sim_only else CASES).items():
        prefix = "hc"
        build.clean(prefix)
        report.progress(f"{case}: building the {preset} testbed")
        fab = build.up(topology.preset(preset), prefix)
        try:
            got = {}
            for on in (False, True):
                report.progress(f"{case}: idle rates {'on' if on else 'off'}, {seconds:.0f} s")
                with tempfile.TemporaryDirectory(prefix="host-cost-") as d:
                    got[on] = run_case(fab, probers, job, on, seconds, d)
        finally:
            build.down(prefix)
        rows.append(report.row(case, "cpu", "pct", got[True]["cpu"], peer="idle-rates-off",
                               peer_values=got[False]["cpu"], paths=got[True]["paths"]))
        rows.append(report.row(case, "probes_sent", "per_s", got[True]["sent"], peer="idle-rates-off",
                               peer_values=got[False]["sent"],
                               ring_full_drops=got[True]["ring_full"], peer_ring_full_drops=got[False]["ring_full"]))
        rows.append(report.row(case, "paths_active", "paths", [got[True]["rates"]["active"]]))
        rows.append(report.row(case, "paths_idle", "paths", [got[True]["rates"]["idle"]]))
    rows += sim_rows([16_384] if args.quick else [16_384, 131_072])
    print(f"{'case':<12} {'metric':<13} {'unit':<6} {'median':>9} {'p99':>9} {'rates off':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:<12} {r['metric']:<13} {r['unit']:<6} {r['median']!s:>9} {r['p99']!s:>9} "
              f"{r.get('peer_median', '')!s:>10} {r.get('ratio', '')!s:>6}")
    report.write(report.document("host_cost", rows, seconds_per_run=seconds), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
