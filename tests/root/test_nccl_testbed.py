"""The NCCL net plugin on the testbed, under the demo's six faults, during a 4-rank ring all-reduce
that uses only the plugin's API (rdma/nccl/allreduce.c, every byte checked): with an agent per
host writing the entropy table the plugin reads, and with the plugin alone. Whatever breaks, no
error reaches the ring and no byte is wrong; a plane cut under a rank is left and taken again
once healed. With every plane to a peer cut past the give-up bound: one clean error, with a
message that names the peer. The plugin never touches a route."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from contextlib import ExitStack

from linkpass.core.names import host_name, link_ends
from linkpass.demo.run import HOSTS, PLUGIN, Demo
from linkpass.testbed import faults
from linkpass.testbed.agents import Agents
from linkpass_rdma import nccl


def demo_on(fab, out: str, stack: ExitStack) -> Demo:
    """The demo's fault machinery on the shared testbed (no coordinator: the plugin does not need one)."""
    args = argparse.Namespace(prefix=fab.prefix, keep=True, out=out, output="json", faults=None, size_mb=1.0,
                              compute_ms=5.0, job_timeout_s=30.0, interval_ms=5.0, compare=False, rto_min_ms=10,
                              job="nccl-plugin")
    demo = Demo(args, stack)
    demo.fab = fab
    return demo


def counters(step: dict) -> dict[str, int]:
    """The plugin's counters a ring step logged: lanes_down=.. chunks_plane0=.. and so on."""
    return {k: int(v) for k, v in (kv.split("=") for kv in step.get("plugin", "").split()) if v.isdigit()}


def plane_sent(job, rank: int, plane: int, t0_ns: int, t1_ns: int) -> int:
    """Chunks `rank` sent on `plane` between two wall-clock times (its steps' counters)."""
    steps = [s for s in job.records(rank) if "step" in s]
    at = [counters(s).get(f"chunks_plane{plane}", 0) for s in steps if t0_ns <= s["end_ns"] <= t1_ns]
    return at[-1] - at[0] if len(at) > 1 else 0


def routes(fab) -> dict[str, str]:
    return {h: subprocess.run(["ip", "-n", fab.netns(h), "route", "show", "table", "all"], capture_output=True,
                              text=True, check=True).stdout for h in fab.hosts}


def run_script_checked(demo: Demo, linkpass: bool) -> None:
    jobs = demo.start_jobs("with-agents" if linkpass else "alone", linkpass)
    job = jobs[PLUGIN]
    summary = demo.finish_run("run", jobs, demo.run_script(jobs, linkpass), linkpass)[PLUGIN]
    log = "".join(open(os.path.join(job.dir, f"rank{r}.stderr")).read()[-1500:] for r in range(len(HOSTS)))
    assert summary.restarts == 0, f"the plugin returned an error to the ring: {log}"
    assert summary.wrong_results == 0 and summary.steps > 100, (summary.steps, log)
    assert [f.kind for f in summary.faults] == [s.kind for s in demo.script]
    for f in summary.faults:
        assert f.stall_ms is not None and f.stall_ms < 10_000, f  # the ring kept going through every fault
        a, b = link_ends(f.link)
        if f.kind in ("uplink-cut", "flap") and a.startswith("h"):
            host, plane = int(a[1:]), int(b[1])
            rank = HOSTS.index(host)
            during = plane_sent(job, rank, plane, f.injected_ns + int(0.5e9), f.cleared_ns)
            other = plane_sent(job, rank, 1 - plane, f.injected_ns + int(0.5e9), f.cleared_ns)
            assert other > 0, (f, "the other plane carried nothing during the fault")
            if f.kind == "uplink-cut":
                assert during == 0, (f, f"{during} chunks still sent on the cut plane")
    # and back: the last fault's plane carries traffic again by the end of the run
    last_cut = next(f for f in summary.faults if f.kind == "uplink-cut")
    a, b = link_ends(last_cut.link)
    end = max(s["end_ns"] for s in job.records(0) if "step" in s)
    assert plane_sent(job, HOSTS.index(int(a[1:])), int(b[1]), last_cut.cleared_ns, end) > 0, last_cut


def test_six_faults_with_agents_no_error_no_wrong_byte(clean_faults, tmp_path):
    fab = clean_faults
    with ExitStack() as stack:
        demo = demo_on(fab, str(tmp_path), stack)
        demo.agents = Agents(fab, str(tmp_path / "agents"), HOSTS, interval_ms=5.0, detect={"flap_half_life_ms": 1000},
                             probe={"size_probe_every": 10}, route_options={"rto_min_ms": 10})
        stack.callback(demo.stop_agents)
        demo.agents.start()
        assert demo.agents.wait_healthy(timeout_s=60)
        run_script_checked(demo, linkpass=True)
        assert all(os.path.exists(tmp_path / "agents" / f"entropy-{host_name(h)}") for h in HOSTS)


def test_six_faults_with_the_plugin_alone_and_no_route_touched(clean_faults, tmp_path):
    fab = clean_faults
    before = routes(fab)
    with ExitStack() as stack:
        demo = demo_on(fab, str(tmp_path), stack)
        run_script_checked(demo, linkpass=False)
    assert routes(fab) == before  # the plugin moves lanes, never a route


def test_every_plane_to_a_peer_cut_past_the_give_up_bound_is_one_clean_error(clean_faults, tmp_path):
    fab = clean_faults
    exe, plugin = nccl.allreduce(), nccl.plugin()
    procs = []
    for r, h in enumerate(HOSTS):
        env = {**os.environ, "LINKPASS_NICS": ",".join(fab.nic_addr(h, p) for p in range(fab.spec.planes)),
               "LINKPASS_ENTROPY_TABLE": "/nonexistent/linkpass-entropy", "LINKPASS_GIVEUP_MS": "2000"}
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", fab.netns(host_name(h)), exe, "--plugin", plugin, "--rank", str(r),
             "--nranks", str(len(HOSTS)), "--dir", str(tmp_path), "--sizes", "1M", "--seconds", "60",
             "--trace", str(tmp_path / f"trace{r}")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "trace1").exists() or len(open(tmp_path / "trace1").readlines()) < 20:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the ring did not start"
            time.sleep(0.2)
        cut_at = time.monotonic()
        for p in range(fab.spec.planes):  # h1 loses both uplinks: nothing can reach it
            faults.apply(fab.prefix, faults.FaultSpec("down", fab.uplink(host_name(1), p).name))
        outs = [p.communicate(timeout=90) for p in procs]
        took = time.monotonic() - cut_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        faults.clear(fab.prefix)
    codes = [p.returncode for p in procs]
    assert 3 in codes, (codes, [e[-1000:] for _, e in outs])  # 3: the plugin returned an error
    assert took < 30, took  # the 2 s give-up bound, not NCCL's 30 s
    warn = "".join(e for _, e in outs)
    lines = [ln for ln in warn.splitlines() if "NCCL WARN" in ln and "NET/LinkPass" in ln]
    assert lines and any(fab.nic_addr(1, 0) in ln or "h1" in ln or fab.nic_addr(1, 1) in ln for ln in lines), warn[-3000:]
    # one error per communicator that lost its peer, not one per request
    errors = [json.loads(ln) for r in range(len(HOSTS)) for ln in open(tmp_path / f"trace{r}") if '"error"' in ln]
    assert 1 <= len(errors) <= len(HOSTS), errors
