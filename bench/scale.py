#!/usr/bin/env python3
"""Scale: the coordinator's fabric logic and the fleet simulator at 131 072 GPUs on a 3-tier fabric.

    python bench/scale.py [--quick] [--trials N] [--seeds N] [--seed S] [--json FILE] [--only CASE]

Fleet: 16 384 hosts x 8 rails, radix-64 switches (`Shape.for_gpus(131072)`): per plane 512
leaves of 32 hosts, 16 pods of 32 leaves and 32 spines, 32 core groups of 32 cores; 393 216
physical links. The peer of every row is the 16 384-GPU 2-tier fleet of today's benchmarks
(`Shape.for_gpus(16384)`), measured the same way in the same run; the ratio is how many times
the 131k figure is better (below 1: worse), so it reads as the cost of 8x the fleet.

Rows:
  plan-131k               wall (s) of `plan_probes` for the whole fleet; extras: paths, paths per
                          host, the fewest reporters on any directed link of each tier (coverage
                          checked independently of the planner, target >= 2).
  localize-131k-single    findings() latency (ms) after one fault's reports arrive, precision and
  localize-131k-double    recall (pct) over directed links (a cut is two); faults on random links
                          of any tier, 1 % noisy agents (sim/linkpass_sim/localize_trials.py).
                          Replies are not traced, as in the coordinator: each path's replies take
                          their own ECMP route and a lost one blames every link it may have
                          crossed. Targets: <= 100 ms, >= 99 %.
  sim-131k-day            wall (s) of one simulated day (scenario clockwork), fabric, plan and
                          every probed path built inside; target <= 60 s.
  ingest-shards-S         rate (reports/s, all shards together) the coordinator takes through its
                          real endpoints (local Ray, HTTPS, token auth, SQLite) from agents sending
                          what they send every second when nothing changed, a digest of their
                          verdicts; the 16k fleet registered; S = 1 (one actor), 2, 4 (a root and
                          S shard actors, each agent reporting to its shard). On this 2-core
                          machine the client, the root and every shard share the cores: the
                          figure per shard is the point (a shard has a core of its own on a cluster).
                          Extra changes_per_s: reports that each carry one change, which the
                          shards forward to the root (the root's own ingest bounds them);
                          cpu_s_per_report: each shard's (or the one actor's) CPU seconds per
                          digest report (process_cpu_seconds_total), cpu_s_root the root's meanwhile.
  localize-131k-sS-single the 131k trials again with the evidence split over S shards and a root
  localize-131k-sS-double (core/shards.py), S = 4, 16, 64, all in this process: latency (ms: the
                          slowest place, per round, as if each ran in its own process;
                          serial_ms: one after another), precision, recall; peer: one shard.
  localize-131k-s16-ray-* the same with the 16 parts in real shard actors on local Ray, this
                          process the root: latency (ms, the wall time of findings(): the rounds'
                          calls, the shards' work, the root's; after the shards took the trial's
                          reports in, as one localizer's latency is after its updates: both in
                          update_ms), precision, recall; peer: one localizer in the same run. On
                          2 cores the 16 shards share them.
  shard-load-131k-S       per shard, its agents' reports/s (each agent reports at least every
                          REPORT_HEARTBEAT_S) against ingest-shards-1's median, pct, S = 1, 4, 16,
                          64; target <= 50 % for the S the docs recommend. Extra cpu_share_pct:
                          the share of a core those reports take at the one actor's CPU per report.
  sim-131k-day-s16        wall (s) of the same simulated day with the agents' evidence split over
                          16 shards and a root; peer: one shard, interleaved.
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/core/localize.py",
    "linkpass/core/fabric.py",
    "linkpass/core/plan.py",
    "linkpass/core/shards.py",
    "linkpass/kernel/heap.py",
    "linkpass/coordinator/shard.py",
    "linkpass/coordinator/coordinator.py",
    "sim/linkpass_sim",
    "bench/scale.py",
)


import argparse
import contextlib
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import fleet as fleet_sim  # noqa: E402
from linkpass_sim import report  # noqa: E402
from linkpass_sim.failures import Shape  # noqa: E402
from linkpass_sim.localize_trials import NOISY_SHARE, TrialFleet, run_trials  # noqa: E402
from linkpass.core.constants import REPORT_HEARTBEAT_S  # noqa: E402
from linkpass_sim.report import progress, row  # noqa: E402
from linkpass.core.fabric import generated  # noqa: E402
from linkpass.core.plan import coverage, plan_probes  # noqa: E402

BIG, PEER = 131_072, 16_384
DAY_TARGET_S = 60.0
LOCALIZE_TARGET_MS = 100.0
PR_TARGET_PCT = 99.0


def model_of(gpus: int):
    return generated(Shape.for_gpus(gpus).layout())


def case_plan(args, shared) -> list[dict]:
    out = {}
    for gpus in (BIG, PEER):
        model = shared.setdefault(("model", gpus), model_of(gpus))
        walls = []
        for _ in range(args.plan_trials):
            t = time.perf_counter()
            plan = plan_probes(model)
            walls.append(time.perf_counter() - t)
        cov = coverage(model, plan)
        fewest: dict[str, int] = {}
        for lk in model.links.values():
            for d in ("up", "down"):
                n = cov.get(f"{lk.name}:{d}", 0)
                fewest[lk.kind] = min(fewest.get(lk.kind, n), n)
        per_host = sorted(len(ps) for ps in plan.paths.values())
        out[gpus] = (walls, dict(paths=plan.total_paths, links=len(model.links),
                                 paths_per_host_min=per_host[0], paths_per_host_max=per_host[-1],
                                 fewest_reporters_by_tier=fewest, under_covered=len(plan.under_covered)))
        progress(f"plan {gpus} GPUs: {min(walls):.2f} s, {plan.total_paths} paths, fewest reporters {fewest}")
    walls, extra = out[BIG]
    return [row("plan-131k", "wall", "s", [round(w, 3) for w in walls], f"plan-{PEER // 1024}k",
                [round(w, 3) for w in out[PEER][0]], met=min(extra["fewest_reporters_by_tier"].values()) >= 2,
                peer_extra=out[PEER][1], **extra)]


def localize_case(args, shared, faults: int, case: str) -> list[dict]:
    res = {}
    for gpus in (BIG, PEER):
        key = ("trials", gpus)
        if key not in shared:
            shared[key] = TrialFleet(shared.get(("model", gpus)) or model_of(gpus), reverse_traced=False, seed=args.seed)
        res[gpus] = run_trials(shared[key], random.Random(args.seed + faults), args.trials, faults,
                               f"{case} {gpus // 1024}k")
    big, peer = res[BIG], res[PEER]

    def overall(r, wrong):
        tp = r["tp"]
        return round(100.0 * tp / (tp + r[wrong]), 3) if tp + r[wrong] else None

    tiers = sorted(t for t, links in shared[("trials", BIG)].tiers.items() if links)
    lat = [round(v, 3) for v in big["latency_ms"]]
    return [row(case, "latency", "ms", lat, f"localize-{PEER // 1024}k", [round(v, 3) for v in peer["latency_ms"]],
                max=max(lat), target_max=LOCALIZE_TARGET_MS, met=max(lat) <= LOCALIZE_TARGET_MS, tiers=tiers,
                reverse="untraced", noisy_share=NOISY_SHARE),
            row(case, "precision", "pct", big["precision"], f"localize-{PEER // 1024}k", peer["precision"],
                better="higher", q=0.01, overall=overall(big, "fp"), peer_overall=overall(peer, "fp"),
                true_positives=big["tp"], false_positives=big["fp"], target_min=PR_TARGET_PCT),
            row(case, "recall", "pct", big["recall"], f"localize-{PEER // 1024}k", peer["recall"],
                better="higher", q=0.01, overall=overall(big, "fn"), peer_overall=overall(peer, "fn"),
                true_positives=big["tp"], false_negatives=big["fn"], target_min=PR_TARGET_PCT)]


def case_localize_single(args, shared) -> list[dict]:
    return localize_case(args, shared, 1, "localize-131k-single")


def case_localize_double(args, shared) -> list[dict]:
    return localize_case(args, shared, 2, "localize-131k-double")


def case_sim_day(args, shared) -> list[dict]:
    walls = {BIG: [], PEER: []}
    kinds = {}
    for seed in range(1, args.seeds + 1):
        for gpus in (BIG, PEER):  # interleaved: the machine's mood touches both alike
            t = time.perf_counter()
            r = fleet_sim.run(gpus, 1.0, "clockwork", seed)
            walls[gpus].append(round(time.perf_counter() - t, 2))
            if gpus == BIG:
                for o in r.outcomes:
                    k = kinds.setdefault(o.kind, {"failures": 0, "localized": 0, "false_findings": 0})
                    k["failures"] += 1
                    k["localized"] += o.localized
                    k["false_findings"] += o.false_findings
            progress(f"day {seed}/{args.seeds} at {gpus} GPUs: {walls[gpus][-1]} s, {len(r.outcomes)} network "
                     f"failures, set-up {r.setup_s:.1f} s")
    return [row("sim-131k-day", "wall", "s", walls[BIG], f"sim-{PEER // 1024}k-day", walls[PEER],
                scenario="clockwork", target_s=DAY_TARGET_S, met=max(walls[BIG]) <= DAY_TARGET_S,
                outcomes_131k=kinds)]


INGEST_SHARDS = (1, 2, 4)


SIM_SHARDS = 16


def case_sim_day_sharded(args, shared) -> list[dict]:
    """The 131k simulated day with the agents' evidence split over SIM_SHARDS coordinator shards
    and a root (core/shards.py), against the same day with one localizer, interleaved."""
    walls = {1: [], SIM_SHARDS: []}
    outcomes = {}
    for seed in range(1, args.seeds + 1):
        for shards in (SIM_SHARDS, 1):
            t = time.perf_counter()
            r = fleet_sim.run(BIG, 1.0, "clockwork", seed, config=fleet_sim.SimConfig(shards=shards))
            walls[shards].append(round(time.perf_counter() - t, 2))
            k = outcomes.setdefault(shards, {"failures": 0, "localized": 0, "false_findings": 0})
            for o in r.outcomes:
                k["failures"] += 1
                k["localized"] += o.localized
                k["false_findings"] += o.false_findings
            progress(f"day {seed}/{args.seeds} at {BIG} GPUs, {shards} shard(s): {walls[shards][-1]} s, "
                     f"set-up {r.setup_s:.1f} s")
    return [row(f"sim-131k-day-s{SIM_SHARDS}", "wall", "s", walls[SIM_SHARDS], "one shard", walls[1],
                scenario="clockwork", target_s=DAY_TARGET_S, met=max(walls[SIM_SHARDS]) <= DAY_TARGET_S,
                outcomes=outcomes[SIM_SHARDS], peer_outcomes=outcomes[1])]


def case_ingest_shards(args, shared) -> list[dict]:
    """The coordinator's real endpoints on local Ray, the 16k fleet registered, every agent
    sending what it sends each second when nothing changed (its digest): one coordinator actor,
    then a root and 2 and 4 shard actors, each agent reporting to its shard."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("coordinator_bench", os.path.join(os.path.dirname(__file__),
                                                                                     "coordinator.py"))
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    fleet = shared.get(("trials", PEER)) or TrialFleet(model_of(PEER), reverse_traced=False, seed=args.seed)
    shared[("trials", PEER)] = fleet
    model = cb.rail_optimized(*cb.SHAPE, addressed=True)
    tables = cb.path_tables(fleet, model)
    out = []
    for shards in INGEST_SHARDS[:2] if args.quick else INGEST_SHARDS:
        rates, extra = ingest_through_shards(cb, model, tables, shards, 3 if args.quick else 10)
        r = row(f"ingest-shards-{shards}", "rate", "per_s", rates, q=0.01, clients=cb.INGEST_CLIENTS, body="digest",
                agents=len(tables), paths_per_agent=len(next(iter(tables.values()))), shards=shards,
                per_shard_median=round(statistics.median(rates) / shards, 1), **extra)
        out.append(r)
        if shards == 1:
            shared["capacity"] = r["median"]
            shared["cpu_s_per_report"] = extra["cpu_s_per_report"][0]
    return out


@contextlib.contextmanager
def coordinator_on_ray(model, shards: int):
    """The coordinator as real actors on a local Ray (a root and `shards` shards, or one actor),
    with `model`, in a temporary state directory; yields (settings, the endpoints agents use, the
    root's or the one actor's).
    Stopped, Ray shut down and the directory removed after."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import socket  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from linkpass.coordinator import ray_actor  # noqa: PLC0415

    def free_port() -> int:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            return sk.getsockname()[1]

    work = tempfile.mkdtemp(prefix="linkpass-bench-shards-")
    with open(os.path.join(work, "fabric.json"), "w") as f:
        json.dump(model.to_dict(), f)
    settings = {"state_dir": os.path.join(work, "state"), "listen": f"127.0.0.1:{free_port()}",
                "fabric": os.path.join(work, "fabric.json"), "agent_timeout_s": 3600}
    if shards > 1:
        settings.update(shards=shards, shard_listen=[f"127.0.0.1:{free_port()}" for _ in range(shards)])
    progress(f"starting Ray, the coordinator and {shards} shard(s)" if shards > 1 else "starting Ray and one actor")
    ray_actor.connect(num_cpus=2)
    try:
        _, root_url = ray_actor.ensure(settings, timeout_s=600)
        yield settings, [ray_actor.endpoint(h) for h in ray_actor.shards()] or [root_url], root_url
    finally:
        ray_actor.stop_all()
        ray_actor.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def cpu_seconds(urls: list[str], tls) -> dict[str, float]:
    """Each endpoint's process CPU seconds so far (its `process_cpu_seconds_total`)."""
    from linkpass.control.client import Client  # noqa: PLC0415

    out = {}
    for u in urls:
        with Client(u, None, tls=tls) as c:
            for line in c.get("/metrics").decode().splitlines():
                if line.startswith("process_cpu_seconds_total "):
                    out[u] = float(line.rsplit(" ", 1)[1])
        if u not in out:
            raise RuntimeError(f"{u}/metrics has no process_cpu_seconds_total")
    return out


def ingest_through_shards(cb, model, tables, shards: int, trials: int) -> tuple[list[float], dict]:
    import json  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from linkpass.coordinator.auth import agent_token, read_agent_secret  # noqa: PLC0415
    from linkpass.control.client import Client  # noqa: PLC0415
    from linkpass.control.tls import build_client_context, lab_dir, lab_paths  # noqa: PLC0415
    from linkpass.core.report_digest import table_digest  # noqa: PLC0415
    from linkpass.core.shards import ShardMap  # noqa: PLC0415

    hosts = sorted(tables)
    with coordinator_on_ray(model, shards) as (settings, urls, root_url):
        owner = ShardMap(model, shards)
        url_of = {h: urls[owner.shard_of(h) if shards > 1 else 0] for h in hosts}
        secret = read_agent_secret(os.path.join(settings["state_dir"], "agent.secret"))
        tls = build_client_context(lab_paths(lab_dir(settings["state_dir"]), "ca")[0])
        tokens = {h: agent_token(secret, h) for h in hosts}
        clients = {u: Client(u, None, timeout_s=120, tls=tls) for u in urls}
        for i, h in enumerate(hosts):
            clients[url_of[h]].post_raw("/v1/register", json.dumps(
                {"name": h, "agent_id": i + 1, "service": "198.18.0.1", "nics": {}, "paths": tables[h],
                 "digests": True}).encode(), token=tokens[h])
        # the plan version every agent then holds, once the plan has settled (the same on two
        # asks 1.5 s apart; the plan is revised at most once a second)
        seen = []
        while len(seen) < 2 or seen[-1] != seen[-2]:
            if len(seen) > 20:
                raise RuntimeError(f"the plan did not settle: versions {seen}")
            time.sleep(1.5)
            seen.append(clients[url_of[hosts[0]]].post_raw("/v1/report", json.dumps(
                {"name": hosts[0], "digests": True}).encode(), token=tokens[hosts[0]])["plan_version"])
        plan_version = seen[-1]
        for c in clients.values():
            c.close()
        digest = {h: table_digest((r["id"], r["state"], r["reason"]) for r in tables[h]) for h in hosts}
        # per host, the bodies it sends in turn: a heartbeat with its digest; or a change of one
        # path, down then up again (what a shard answers and queues for the root)
        mixes = {"digest": {h: [json.dumps({"name": h, "drain_version": 0, "plan_version": plan_version,
                                            "digests": True, "digest": digest[h]}).encode()] for h in hosts},
                 "changes": {h: [json.dumps({"name": h, "drain_version": 0, "plan_version": plan_version,
                                             "digests": True, "changes": [{"id": 1, "state": st, "reason": why}]}
                                            ).encode() for st, why in (("down", "hard_failure"), ("up", None))]
                             for h in hosts}}
        rates = {}
        cursor = [0]
        lock = threading.Lock()
        sent = dict.fromkeys(urls, 0)  # digest reports per endpoint
        endpoints = list(dict.fromkeys([*urls, root_url]))
        for mix, bodies in mixes.items():
            rates[mix] = []
            cpu_before = cpu_seconds(endpoints, tls)
            for trial in range(trials if mix == "digest" else max(2, trials // 3)):
                stop = time.perf_counter() + cb.INGEST_WINDOW_S
                done = [0] * cb.INGEST_CLIENTS

                def client_loop(k: int) -> None:
                    mine = {u: Client(u, None, timeout_s=60, tls=tls) for u in urls}
                    while time.perf_counter() < stop:
                        with lock:
                            i = cursor[0]
                            cursor[0] += 1
                        h = hosts[i % len(hosts)]
                        turn = bodies[h]
                        mine[url_of[h]].post_raw("/v1/report", turn[(i // len(hosts)) % len(turn)], token=tokens[h])
                        done[k] += 1
                        if mix == "digest":
                            with lock:
                                sent[url_of[h]] += 1
                    for c in mine.values():
                        c.close()

                t = time.perf_counter()
                threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(cb.INGEST_CLIENTS)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                rates[mix].append(round(sum(done) / (time.perf_counter() - t), 1))
                progress(f"ingest-shards-{shards} {mix} trial {trial + 1}: {rates[mix][-1]:.0f} reports/s")
            cursor[0] = 0  # the next mix starts at its first body (the changes mix: down)
            if mix == "digest":  # each process's CPU for the reports it took in
                cpu = {u: round(t - cpu_before[u], 3) for u, t in cpu_seconds(endpoints, tls).items()}
        extra = {}
        if shards > 1:
            answered = queued = forwarded = 0
            for u in urls:
                with Client(u, None, tls=tls) as c:
                    for line in c.get("/metrics").decode().splitlines():
                        if line.startswith("linkpass_coordinator_shard_reports_total"):
                            n = float(line.rsplit(" ", 1)[1])
                            answered += n if 'outcome="answered"' in line else 0
                            queued += n if 'outcome="queued"' in line else 0
                            forwarded += n if 'outcome="forwarded"' in line else 0
            extra = {"answered_by_shards": int(answered), "queued_for_root": int(queued),
                     "forwarded_to_root": int(forwarded)}
        # CPU seconds a shard (or the one actor) spent per digest report, and the root's meanwhile
        extra["cpu_s_per_report"] = [round(cpu[u] / sent[u], 9) if sent[u] else None for u in urls]
        extra["cpu_s_root"] = cpu[root_url] if shards > 1 else None
        extra["digest_reports"] = sum(sent.values())
        extra["changes_per_s"] = rates["changes"]
        extra["changes_median"] = statistics.median(rates["changes"])
    return rates["digest"], extra


SHARD_COUNTS = (1, 4, 16, 64)


def quality_rows(case: str, res: dict, peer_name: str, peer: dict | None) -> list[dict]:
    """Precision and recall rows of `res` (run_trials), overall and per trial, against `peer`."""
    tp = res["tp"]
    return [row(case, metric, "pct", res[metric], peer_name, peer and peer[metric], better="higher", q=0.01,
                overall=round(100.0 * tp / (tp + res[wrong]), 3) if tp + res[wrong] else None,
                true_positives=tp, target_min=PR_TARGET_PCT, **{label: res[wrong]})
            for metric, wrong, label in (("precision", "fp", "false_positives"), ("recall", "fn", "false_negatives"))]


def case_shards(args, shared) -> list[dict]:
    from linkpass.core.shards import ShardMap  # noqa: PLC0415

    model = shared.get(("model", BIG)) or model_of(BIG)
    shared[("model", BIG)] = model
    key = ("trials", BIG)
    if key not in shared:
        shared[key] = TrialFleet(model, reverse_traced=False, seed=args.seed)
    fleet = shared[key]
    capacity = shared.get("capacity")
    counts = SHARD_COUNTS[:2] if args.quick else SHARD_COUNTS
    trials = max(5, args.trials // 2)
    out, base = [], {}
    for shards in counts:
        fleet.use_shards(shards)
        held = fleet.localizer.held() if shards > 1 else [len(fleet.localizer), 0]
        for faults, kind in ((1, "single"), (2, "double")):
            res = run_trials(fleet, random.Random(args.seed + faults), trials, faults, f"{shards} shards {kind}")
            if shards == 1:
                base[faults] = res
                continue
            case, peer = f"localize-131k-s{shards}-{kind}", base.get(faults)
            lat = [round(v, 3) for v in res["latency_ms"]]
            out += [row(case, "latency", "ms", lat, "one shard", peer and [round(v, 3) for v in peer["latency_ms"]],
                        target_max=LOCALIZE_TARGET_MS, root_ms=[round(v, 3) for v in res["root_ms"]],
                        serial_ms_median=round(statistics.median(res["serial_ms"]), 3),
                        serial_ms_p99=report.tail(res["serial_ms"], 0.99), places_touched=res["places"]),
                    *quality_rows(case, res, "one shard", peer)]
        sizes = ShardMap(model, shards).sizes()
        reports = [n / REPORT_HEARTBEAT_S for n in sizes]
        extra = dict(hosts_per_shard=sizes, paths_held=held[:-1], root_paths_held=held[-1],
                     reports_per_s=reports, capacity_reports_per_s=capacity)
        cpu_per_report = shared.get("cpu_s_per_report")
        if cpu_per_report:  # the share of a core each shard's reports take, at the one actor's cost per report
            extra["cpu_share_pct"] = [round(100.0 * r * cpu_per_report, 2) for r in reports]
        if capacity:
            pct = [round(100.0 * r / capacity, 2) for r in reports]
            out.append(row(f"shard-load-131k-{shards}", "load", "pct", pct, target_max=50.0, max=max(pct),
                           met=max(pct) <= 50.0, **extra))
        progress(f"{shards} shards: hosts {min(sizes)}..{max(sizes)}, paths held {min(held[:-1])}..{max(held[:-1])}, "
                 f"root {held[-1]}")
    fleet.use_shards(1)
    return out


RAY_SHARDS = 16


def case_shards_ray(args, shared) -> list[dict]:
    """The 131k trials with the parts in real shard actors on local Ray (a root actor and 16
    shards started as `linkpass coordinator --shards 16` does); this process is the root's
    localizer (ShardParts over RayShards, as the root actor holds them). Peer: one localizer,
    the same trials in the same run."""
    from linkpass.coordinator import ray_actor  # noqa: PLC0415
    from linkpass.coordinator.ray_actor import RayShards  # noqa: PLC0415
    from linkpass.coordinator.shard import ShardParts  # noqa: PLC0415
    from linkpass.core.shards import ShardMap  # noqa: PLC0415

    model = shared.get(("model", BIG)) or model_of(BIG)
    shared[("model", BIG)] = model
    fleet = shared.get(("trials", BIG)) or TrialFleet(model, reverse_traced=False, seed=args.seed)
    shared[("trials", BIG)] = fleet
    trials = max(5, args.trials // 2)
    fleet.use_shards(1)
    peer = {faults: run_trials(fleet, random.Random(args.seed + faults), trials, faults, f"one localizer {kind}")
            for faults, kind in ((1, "single"), (2, "double"))}
    out = []
    with coordinator_on_ray(model, RAY_SHARDS) as (settings, _, _):
        parts = ShardParts(model, ShardMap(model, RAY_SHARDS), RayShards(ray_actor.actor_credential(settings)))
        t = time.perf_counter()
        fleet.use_shards(RAY_SHARDS, parts)
        progress(f"the healthy fleet's evidence to {RAY_SHARDS} shard actors: {time.perf_counter() - t:.1f} s")
        for faults, kind in ((1, "single"), (2, "double")):
            res = run_trials(fleet, random.Random(args.seed + faults), trials, faults, f"ray shards {kind}")
            case, base = f"localize-131k-s{RAY_SHARDS}-ray-{kind}", peer[faults]
            lat = [round(v, 3) for v in res["latency_ms"]]
            out += [row(case, "latency", "ms", lat, "one localizer", [round(v, 3) for v in base["latency_ms"]],
                        target_max=LOCALIZE_TARGET_MS, met=max(lat) <= LOCALIZE_TARGET_MS,
                        stood_in=sorted(parts.standing_in), sent_whole=parts.counters["parts_sent_whole"],
                        # both latencies leave out taking the reports in: one localizer's
                        # update(), the root's send to the shards and their taking them in
                        update_ms_median=round(statistics.median(res["update_ms"]), 3),
                        peer_update_ms_median=round(statistics.median(base["update_ms"]), 3)),
                    *quality_rows(case, res, "one localizer", base)]
            progress(f"ray shards {kind}: median {statistics.median(lat):.1f} ms (one localizer "
                     f"{statistics.median(base['latency_ms']):.1f} ms), stood in for {sorted(parts.standing_in)}")
        fleet.use_shards(1)
    return out


CASES = {"plan": case_plan, "localize_single": case_localize_single, "localize_double": case_localize_double,
         "sim_day": case_sim_day, "ingest_shards": case_ingest_shards, "shards": case_shards,
         "sim_day_sharded": case_sim_day_sharded, "shards_ray": case_shards_ray}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few trials per case (smoke test)")
    ap.add_argument("--trials", type=int, default=None, help="localization trials per case (default 100)")
    ap.add_argument("--seeds", type=int, default=None, help="simulated days per fleet (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--only", choices=sorted(CASES), action="append", help="run only this case (repeatable)")
    args = ap.parse_args()
    args.trials = args.trials or (10 if args.quick else 100)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.plan_trials = 1 if args.quick else 3
    shared: dict = {}
    rows: list[dict] = []
    for name in args.only or list(CASES):
        t = time.perf_counter()
        rows += CASES[name](args, shared)
        progress(f"case {name}: {time.perf_counter() - t:.0f} s")
    print(f"\n{'case':24} {'metric':10} {'n':>4} {'median':>9} {'p99':>9} {'peer median':>12} {'ratio':>6}  met")
    for x in rows:
        print(f"{x['case']:24} {x['metric']:10} {x['n']:>4} {str(x['median']):>9} {str(x['p99']):>9} "
              f"{str(x.get('peer_median')):>12} {str(x.get('ratio')):>6}  {x.get('met', '')}")
    shape = Shape.for_gpus(BIG)
    report.write(report.document("scale", rows, gpus=BIG, peer_gpus=PEER, shape=vars(shape),
                                 trials=args.trials, seeds=args.seeds, seed=args.seed), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
