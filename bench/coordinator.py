#!/usr/bin/env python3
"""Coordinator: fault localization over a 16 384-GPU fleet model, without a testbed.

    python bench/coordinator.py [--quick] [--trials N] [--seed S] [--json FILE]

Fleet: rail_optimized(2048 hosts, 8 rails, 32 hosts per leaf, 32 spines per plane), 32 768
physical links; the probe plan of `linkpass.core.plan` (3 paths per host and plane, 49 152
paths); one Observation per planned path, probes and replies through the planned spine.

Per trial (sim/linkpass_sim/localize_trials.py, with replies traced): random faults on random
links of either tier, 1 % of the agents noisy; only the observations that changed are
update()'d into a Localizer that already holds the healthy fleet, then findings() is timed.

Rows: localize-16k-single (latency ms of findings(); precision, recall pct over directed
links, a cut being two), localize-16k-double (two concurrent faults: latency, precision,
recall), localize-16k-update (latency us per update() call, the trial's bad and restoring
ones; the initial ingest of the healthy fleet is in `initial_ingest_us`).
ingest (rate, path reports per second through the real endpoint: the coordinator as a Ray actor,
HTTP/JSON, token auth, SQLite; a rate's bad tail is its low end, so "p99" is the 1 % quantile).
plan-round (ms to answer every agent once after one joined, no fabric model so each probes every
other, 1 000 agents, in-process: agents that take plan deltas, against the same with whole plans).
summary-round (ms for every agent of the 16k fleet to send its periodic check once, in-process, the
body decoded from JSON as the endpoint does: the digest of its verdicts, against the same agents
sending their whole tables as before digests).
failover-coordinator-away (fault_to_reroute ms at h0 with the coordinator gone, against the same
agents with a live coordinator actor in the same run; root, testbed; --no-failover skips it).
Targets: findings() <= 100 ms, precision and recall >= 99 %, ingest >= 20 000 reports/s.
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/core/localize.py",
    "linkpass/core/fabric.py",
    "linkpass/core/plan.py",
    "linkpass/coordinator/coordinator.py",
    "linkpass/coordinator/http.py",
    "linkpass/coordinator/store.py",
    "linkpass/coordinator/shard.py",
    "sim/linkpass_sim/localize_trials.py",
    "bench/coordinator.py",
)


import argparse
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.benchkit import A, B, FLAP_HALF_LIFE_MS  # noqa: E402
from linkpass_sim.localize_trials import NOISY_SHARE, TrialFleet, localize_rows, run_trials  # noqa: E402
from linkpass_sim.report import progress, row  # noqa: E402
from linkpass.core.fabric import from_testbed, rail_optimized  # noqa: E402
from linkpass.core.constants import PROBE_PORT_BASE  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.core.detector import Reason  # noqa: E402
from linkpass.core.states import State  # noqa: E402
from linkpass.coordinator import ray_actor  # noqa: E402
from linkpass.coordinator.auth import agent_token, read_agent_secret  # noqa: E402
from linkpass.control.client import Client  # noqa: E402
from linkpass.control.tls import build_client_context, lab_dir, lab_paths  # noqa: E402
from linkpass.testbed import build, faults, topology  # noqa: E402
from linkpass.testbed.agents import Agents  # noqa: E402
from linkpass.testbed.trials import linkpass_hard  # noqa: E402

SHAPE = (2048, 8, 32, 32)  # hosts, rails, hosts per leaf, spines per plane: 16 384 GPUs
def free_port(host: str) -> int:
    with socket.socket() as sk:
        sk.bind((host, 0))
        return sk.getsockname()[1]


# ---- cases: each takes (fleet, args, shared results) and returns rows --------------------------

def case_localize_single(fleet: TrialFleet, args, shared: dict) -> list[dict]:
    res = run_trials(fleet, random.Random(args.seed), args.trials, 1, "single")
    shared["update_us"] = shared.get("update_us", []) + res["update_us"]
    return localize_rows("localize-16k-single", res)


def case_localize_double(fleet: TrialFleet, args, shared: dict) -> list[dict]:
    res = run_trials(fleet, random.Random(args.seed + 1), args.trials, 2, "double")
    shared["update_us"] = shared.get("update_us", []) + res["update_us"]
    return localize_rows("localize-16k-double", res)


def case_localize_update(fleet: TrialFleet, args, shared: dict) -> list[dict]:
    """update() cost per observation, from the trials the cases before it ran."""
    values = [round(v, 3) for v in shared.get("update_us", [])]
    return [row("localize-16k-update", "latency", "us", values,
                initial_ingest_us=round(fleet.initial_ingest_us, 3))]


INGEST_CLIENTS = 4
INGEST_WINDOW_S = 2.0


def case_ingest(fleet: TrialFleet, args, shared: dict) -> list[dict]:
    """Path reports through the real endpoint: the coordinator as a Ray actor (its own process)
    with the addressed 16k model; every planned path registered with its hops (mapped onto
    links); then INGEST_CLIENTS threads post one agent's report per request (all its paths) over
    keep-alive connections, for INGEST_WINDOW_S per trial: rows `ingest` (steady mix) and
    `ingest-storm` (every path going down and up: detection events and localization running)."""
    model = rail_optimized(*SHAPE, addressed=True)
    tables = path_tables(fleet, model)
    work = tempfile.mkdtemp(prefix="linkpass-bench-coord-")
    with open(os.path.join(work, "fabric.json"), "w") as f:
        json.dump(model.to_dict(), f)
    port = free_port("127.0.0.1")
    settings = {"state_dir": os.path.join(work, "state"), "listen": f"127.0.0.1:{port}",
                "fabric": os.path.join(work, "fabric.json"), "agent_timeout_s": 3600}
    progress("starting Ray and the coordinator actor")
    ray_actor.connect(num_cpus=2)
    rows_out: list[dict] = []
    try:
        _, url = ray_actor.ensure(settings)
        secret = read_agent_secret(os.path.join(settings["state_dir"], "agent.secret"))
        tls = build_client_context(lab_paths(lab_dir(settings["state_dir"]), "ca")[0])  # HTTPS, as agents report
        hosts = sorted(tables)
        tokens = {h: agent_token(secret, h) for h in hosts}  # each agent speaks for itself only
        reg_s, n_paths, plan_version = register_all(url, tokens, hosts, tables, tls)
        for case, (bodies, per_host) in report_mixes(hosts, tables, plan_version).items():
            rates = ingest_rates(url, tokens, case, hosts, tables, bodies, per_host, args.ingest_trials, tls)
            rows_out.append(row(case, "rate", "per_s", rates, q=0.01, target_min=20000 if case == "ingest" else None,
                                clients=INGEST_CLIENTS, batch=len(next(iter(tables.values()))),
                                registration_paths_per_s=round(n_paths / reg_s, 1)))
    finally:
        h = ray_actor.existing()
        if h is not None:
            ray_actor.stop(h)
        ray_actor.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return rows_out


def path_tables(fleet: TrialFleet, model) -> dict[str, list[dict]]:
    """host -> its path table as the agent registers it: every planned path with its hops."""
    tables: dict[str, list[dict]] = {}
    for host, paths in fleet.plan.paths.items():
        rows = tables.setdefault(host, [])
        for n, p in enumerate(paths):
            hops, dst = model.hops_of(host, p.peer, p.plane, p.spine)
            rows.append({"id": n + 1, "peer": p.peer, "plane": p.plane, "sport": PROBE_PORT_BASE + n, "hops": hops,
                         "peer_addr": dst, "state": State.UP.value, "reason": None})
    return tables


def register_all(url: str, tokens: dict[str, str], hosts: list[str], tables: dict[str, list[dict]],
                 tls) -> tuple[float, int, int]:
    """Register every agent with its paths: seconds taken, paths registered, and the plan version
    the coordinator then holds (what agents hold once their plan arrived)."""
    t0 = time.perf_counter()
    c = Client(url, tokens[hosts[0]], timeout_s=120, tls=tls)
    for i, h in enumerate(hosts):
        c.post_raw("/v1/register", json.dumps({"name": h, "agent_id": i + 1, "service": "198.18.0.1", "nics": {},
                                               "paths": tables[h]}).encode(), token=tokens[h])
    reg_s = time.perf_counter() - t0
    n_paths = sum(len(v) for v in tables.values())
    status = c.get("/v1/status")
    c.close()
    progress(f"registered {len(hosts)} agents, {n_paths} paths in {reg_s:.1f} s "
             f"({n_paths / reg_s:.0f} paths/s); coordinator sees {status['paths']}")
    return reg_s, n_paths, status["plan_version"]


def report_mixes(hosts: list[str], tables: dict[str, list[dict]], plan_version: int) -> dict[str, tuple[list[bytes], int]]:
    """case -> (request bodies, host-major, and how many per host). Steady: what a healthy fleet
    sends (single late probes: up <-> suspect; every tenth request a whole-table summary); storm:
    every path of every reporter down, then up again. Bodies are encoded before the clock runs:
    the agents are elsewhere in a real fleet, and their JSON encoding should not compete with the
    coordinator for this machine's 2 cores."""
    def body(h: str, state: str, summary: bool = False) -> bytes:
        doc = {"name": h, "drain_version": 0, "plan_version": plan_version}
        if summary:
            doc["paths"] = [dict(r, state=state) for r in tables[h]]
        else:
            doc["changes"] = [{"id": r["id"], "state": state, "reason": Reason.HARD_FAILURE.value if state == State.DOWN.value else None}
                              for r in tables[h]]
        return json.dumps(doc).encode()

    return {"ingest": ([body(h, s, summary=(k == 9)) for h in hosts for k, s in enumerate((State.SUSPECT.value, State.UP.value) * 5)], 10),
            "ingest-storm": ([body(h, s) for h in hosts for s in (State.DOWN.value, State.UP.value)], 2)}


def ingest_rates(url: str, tokens: dict[str, str], case: str, hosts: list[str], tables: dict[str, list[dict]],
                 bodies: list[bytes], per_host: int, trials: int, tls) -> list[float]:
    """Path reports per second, one figure per trial: INGEST_CLIENTS threads posting for
    INGEST_WINDOW_S. The bodies are taken round-robin over hosts (a shared cursor across trials),
    each host's in their own order."""
    rates = []
    cursor = [0]
    lock = threading.Lock()
    for trial in range(trials):
        stop = time.perf_counter() + INGEST_WINDOW_S
        done = [0] * INGEST_CLIENTS

        def client_loop(k: int) -> None:
            cl = Client(url, None, timeout_s=60, tls=tls)
            while time.perf_counter() < stop:
                with lock:
                    i = cursor[0]
                    cursor[0] += 1
                hi, si = i % len(hosts), (i // len(hosts)) % per_host
                cl.post_raw("/v1/report", bodies[hi * per_host + si], token=tokens[hosts[hi]])
                done[k] += len(tables[hosts[hi]])
            cl.close()

        t = time.perf_counter()
        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(INGEST_CLIENTS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        rate = sum(done) / (time.perf_counter() - t)
        rates.append(round(rate, 1))
        progress(f"{case} trial {trial + 1}/{trials}: {rate:.0f} path reports/s")
    return rates


PLAN_ROUND_AGENTS = 1000


def case_plan_round(fleet: TrialFleet, args, shared: dict) -> list[dict]:
    """A report round after a plan change: every agent reports once, holding the previous plan.
    Without a fabric model every agent probes every other, so a whole plan per answer makes the
    round O(N^2); deltas make it O(changes)."""
    from linkpass.coordinator.coordinator import Coordinator
    from linkpass.coordinator.store import Store

    def ident(i: int) -> dict:
        return {"name": host_name(i), "agent_id": i + 1, "service": f"198.18.{i // 250}.{i % 250 + 1}",
                "nics": {"0": f"198.19.{i // 250}.{i % 250 + 1}"}, "paths": []}

    def rounds(deltas: bool, trials: int) -> list[float]:
        work = tempfile.mkdtemp(prefix="linkpass-bench-plan-")
        store = Store(os.path.join(work, "c.db"))
        c = Coordinator(store, None, wall_s=0.0)
        for i in range(PLAN_ROUND_AGENTS):
            c.register(ident(i), 0.0)
        now = 2.0
        c.tick(now)
        held = {host_name(i): c.report({"name": host_name(i), "plan_deltas": deltas}, now)["plan_version"]
                for i in range(PLAN_ROUND_AGENTS)}
        out = []
        for k in range(trials):
            c.register(ident(PLAN_ROUND_AGENTS + k), now)  # one joins
            now += 2.0
            c.tick(now)
            t = time.perf_counter()
            for h in held:
                a = c.report({"name": h, "plan_version": held[h], "drain_version": 0, "plan_deltas": deltas}, now)
                json.dumps(a)  # what the endpoint then encodes
                held[h] = a["plan_version"]
            out.append(round((time.perf_counter() - t) * 1000, 3))
            progress(f"plan round {'deltas' if deltas else 'whole plans'} {k + 1}/{trials}: {out[-1]:.0f} ms")
        store.close()
        shutil.rmtree(work, ignore_errors=True)
        return out

    fast = rounds(True, 5 if args.quick else 20)
    slow = rounds(False, 1 if args.quick else 3)
    return [row("plan-round", "round", "ms", fast, "whole plans", slow, agents=PLAN_ROUND_AGENTS)]


def case_summary_round(fleet: TrialFleet, args, shared: dict) -> list[dict]:
    """Every agent's periodic check once: a digest of its verdicts (what agents send now) against
    its whole table (what they sent every summary_s before), through Coordinator.report in
    process, each body decoded from JSON first as the endpoint does."""
    from linkpass.coordinator.coordinator import Coordinator
    from linkpass.coordinator.store import Store
    from linkpass.core.report_digest import table_digest

    model = rail_optimized(*SHAPE, addressed=True)
    tables = path_tables(fleet, model)
    hosts = sorted(tables)
    work = tempfile.mkdtemp(prefix="linkpass-bench-summary-")
    store = Store(os.path.join(work, "c.db"))
    try:
        c = Coordinator(store, model, wall_s=0.0)
        for i, h in enumerate(hosts):
            c.register({"name": h, "agent_id": i + 1, "service": "198.18.0.1", "nics": {}, "paths": tables[h],
                        "digests": True}, 0.0)
        progress(f"summary round: {len(hosts)} agents registered, {sum(map(len, tables.values()))} paths")
        bodies = {
            "digest": [json.dumps({"name": h, "drain_version": 0, "plan_version": None, "digests": True,
                                   "digest": table_digest((r["id"], r["state"], r["reason"]) for r in tables[h])}
                                  ).encode() for h in hosts],
            "whole": [json.dumps({"name": h, "drain_version": 0, "plan_version": None, "paths": tables[h]}).encode()
                      for h in hosts]}
        times: dict[str, list[float]] = {"digest": [], "whole": []}
        trials = 3 if args.quick else 15
        for k in range(trials):
            for kind in ("digest", "whole") if k % 2 == 0 else ("whole", "digest"):
                t = time.perf_counter()
                for b in bodies[kind]:
                    answer = c.report(json.loads(b), 1.0 + k)
                    assert "send_paths" not in answer, answer  # nothing was lost: every digest matches
                times[kind].append(round((time.perf_counter() - t) * 1000, 3))
            progress(f"summary round {k + 1}/{trials}: digests {times['digest'][-1]:.0f} ms, "
                     f"whole tables {times['whole'][-1]:.0f} ms")
        bytes_per = {kind: round(sum(map(len, bodies[kind])) / len(hosts)) for kind in bodies}
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    return [row("summary-round", "round", "ms", times["digest"], "whole tables", times["whole"], agents=len(hosts),
                paths_per_agent=len(tables[hosts[0]]), body_bytes=bytes_per["digest"],
                peer_body_bytes=bytes_per["whole"])]


def case_failover_coordinator_away(fleet: TrialFleet, args, shared: dict) -> list[dict]:
    """Agents fail over alone: fault -> route at h0 with the coordinator gone (agents configured
    for one that does not answer) against the same agents reporting to a live coordinator actor,
    in the same run, on the testbed (root). Trials alternate the two planes' uplinks of h0."""
    if not args.failover:
        return []
    if os.geteuid() != 0:
        progress("failover case skipped: needs root (namespaces)")
        return []
    trials = 3 if args.quick else 10
    prefix = f"cb{os.getpid() % 10000}"
    work = tempfile.mkdtemp(prefix="linkpass-bench-away-")
    fab = build.up(topology.preset("default"), prefix)
    out = {}
    try:
        port = free_port("0.0.0.0")
        settings = {"state_dir": os.path.join(work, "state"), "listen": f"0.0.0.0:{port}",
                    "fabric_model": from_testbed(fab).to_dict(), "tls_san": [fab.mgmt_root_addr]}
        for mode in ("up", "away"):
            if mode == "up":
                ray_actor.connect(num_cpus=2)
                ray_actor.ensure(settings)
            link = {"url": f"https://{fab.mgmt_root_addr}:{port}",
                    "agent_secret_file": os.path.join(work, "state", "agent.secret")}
            agents = Agents(fab, os.path.join(work, mode), [A, B], detect={"flap_half_life_ms": FLAP_HALF_LIFE_MS},
                            coordinator=link, tls_dir=lab_dir(settings["state_dir"])).start()
            try:
                progress(f"coordinator {mode}: agents warming up (10 s)")
                time.sleep(10)
                if mode == "away":
                    assert agents.events(A, "coordinator_unreachable"), "agents did not notice the coordinator gone"
                uplinks = [fab.uplink(host_name(A), p).name for p in (0, 1)]
                _, out[mode] = linkpass_hard(prefix, agents, A, B, uplinks, trials, 6.0, progress)
            finally:
                agents.stop()
                faults.clear(prefix)
                if mode == "up":
                    h = ray_actor.existing()
                    if h is not None:
                        ray_actor.stop(h)
                    ray_actor.shutdown()
    finally:
        build.down(prefix)
        shutil.rmtree(work, ignore_errors=True)
    away, up = out.get("away", []), out.get("up", [])
    r = row("failover-coordinator-away", "fault_to_reroute", "ms", away, "same agents, coordinator up", up,
            trials_rerouted=f"{len(away)}/{trials}")
    return [r]


CASES = [
    case_localize_single,
    case_localize_double,
    case_localize_update,
    case_ingest,
    case_plan_round,
    case_summary_round,
    case_failover_coordinator_away,
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few trials (smoke test)")
    ap.add_argument("--trials", type=int, default=None, help="trials per case (default 1000, quick 20)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--only", metavar="CASE", help="run only the case(s) whose function name contains CASE "
                                                  "(e.g. summary_round)")
    ap.add_argument("--no-failover", dest="failover", action="store_false",
                    help="skip the testbed case (fault -> route with the coordinator gone; needs root)")
    args = ap.parse_args()
    args.trials = args.trials or (20 if args.quick else 1000)
    args.ingest_trials = 3 if args.quick else 20
    print(f"coordinator localization, rail_optimized{SHAPE}, {args.trials} trials per case")
    fleet = TrialFleet(rail_optimized(*SHAPE))
    rows: list[dict] = []
    shared: dict = {}
    for case in CASES:
        if args.only and args.only not in case.__name__:
            continue
        t = time.perf_counter()
        rows.extend(case(fleet, args, shared))
        progress(f"{case.__name__}: {time.perf_counter() - t:.1f} s")
    print(f"\n{'case':22} {'metric':10} {'unit':5} {'n':>4} {'median':>9} {'p99':>9} {'overall':>8}")
    for r in rows:
        print(f"{r['case']:22} {r['metric']:10} {r['unit']:5} {r['n']:>4} {str(r['median']):>9} "
              f"{str(r['p99']):>9} {str(r.get('overall', '')):>8}")
    report.write(report.document("coordinator", rows, fleet={"hosts": SHAPE[0], "rails": SHAPE[1],
                                                              "hosts_per_leaf": SHAPE[2], "spines_per_plane": SHAPE[3],
                                                              "links": len(fleet.model.links),
                                                              "planned_paths": len(fleet.keys)},
                                 noisy_share=NOISY_SHARE, seed=args.seed, setup_s=round(fleet.setup_s, 2)),
                 args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
