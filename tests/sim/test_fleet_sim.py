"""The fleet simulator (sim/linkpass_sim): known answers, the job model, the shared decision code,
calibration against the testbed. No root needed; everything runs on virtual time."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from linkpass.core import decide, failover
from linkpass.coordinator import coordinator as service
from linkpass.core import detector, localize, plan
from linkpass_sim import calibration, failures, fleet, jobmodel, virtual
from linkpass_sim.failures import Failure, Shape


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIM = os.path.join(ROOT, "sim", "linkpass_sim")


@pytest.fixture(scope="module")
def small():
    """64 hosts x 8 rails (512 GPUs): 2 leaves and 2 spines per plane, a sparse probe plan."""
    return fleet.Fleet(Shape.for_gpus(512))


# ---- known answers -----------------------------------------------------------------------------

def test_a_single_cut_cable_is_detected_rerouted_and_found(small):
    o = fleet.simulate(small, Failure(10.0, "cable", ("h5", 3)), np.random.default_rng(3))
    assert o.paths > 0 and o.agents >= 3  # h5 and the hosts probing it
    assert len(o.detect_ms) == o.paths  # every path across the cable called bad
    # the first lost probe within a probe interval (1 ms) of the cut, then 3 misses a timeout
    # (>= 250 us) apart, each miss's confirmation round sending the next probe at once
    assert all(0.5 <= d <= 2.5 for d in o.detect_ms), o.detect_ms
    assert not o.unrecovered
    # the job's flows: stalled only until the move, plus the transport's resume (35 ms)
    assert small.config.resume_ms < o.stall_ms < small.config.resume_ms + 10
    assert o.localized and o.false_findings == 0
    assert o.localized_ms <= small.config.report_ns / 1e6 + 2 * small.config.tick_ns / 1e6 + 5


def test_a_cut_leaves_the_localizer_as_it_found_it(small):
    before = small.localizer.findings()
    fleet.simulate(small, Failure(10.0, "nic", ("h40", 0)), np.random.default_rng(4))
    assert small.localizer.findings() == before == []


def test_a_dead_leaf_switch_moves_every_host_under_it(small):
    o = fleet.simulate(small, Failure(10.0, "switch", ("p6l1",)), np.random.default_rng(5))
    assert o.agents >= 32 and not o.unrecovered
    assert o.stall_ms < small.config.resume_ms + 10 and o.localized


def test_light_gray_loss_below_the_detectors_floor_is_left_alone(small):
    # 0.01 % loss is below the SPRT's H0 (0.1 %): LinkPass must not move traffic for it
    o = fleet.simulate(small, Failure(10.0, "gray", ("h7-p2l0", "up"), loss=1e-4), np.random.default_rng(6))
    assert o.detect_ms == [] and o.false_findings == 0


def test_heavy_gray_loss_is_found_and_left(small):
    o = fleet.simulate(small, Failure(10.0, "gray", ("h7-p2l0", "up"), loss=0.05), np.random.default_rng(6))
    # 5 % one way: the fast SPRT needs ~93-124 probes from a fresh start; every crossing path gets there
    assert len(o.detect_ms) == o.paths and sorted(o.detect_ms)[len(o.detect_ms) // 2] < 200
    assert max(o.detect_ms) < 600
    assert o.exposed_ms < 600 and not o.exposed_at_end and o.localized


def test_goodput_without_failures_is_100_percent(small):
    r = fleet.run(512, 0.0005, "llama3", seed=2, fleet=small)  # 43 s: no failure drawn
    assert r.failures == {}
    assert r.with_linkpass.goodput == r.without.goodput == 1.0
    assert jobmodel.run([], 86_400.0, jobmodel.JobParams()).goodput == 1.0


def test_runs_are_reproducible_with_a_seed(small):
    a = fleet.summary(fleet.run(512, 2.0, "clockwork", seed=9, fleet=small))
    b = fleet.summary(fleet.run(512, 2.0, "clockwork", seed=9, fleet=small))
    for s in (a, b):  # wall-clock figures aside
        s.pop("sim_wall_s"), s.pop("setup_s")
        s["coordinator_load"].pop("findings_ms_median"), s["coordinator_load"].pop("findings_ms_max")
    assert a == b
    assert sum(a["failures"].values()) > 0


def test_runs_are_reproducible_across_processes():
    # str hashes differ between processes: nothing may depend on set order
    def once(hashseed):
        env = {**os.environ, "PYTHONHASHSEED": str(hashseed)}
        out = subprocess.run([sys.executable, "-m", "linkpass_sim.fleet", "--gpus", "512", "--days", "4",
                              "--scenario", "stress", "--seed", "4", "-o", "json"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert out.returncode == 0, out.stderr
        s = json.loads(out.stdout)
        s.pop("sim_wall_s"), s.pop("setup_s")
        s["coordinator_load"].pop("findings_ms_median"), s["coordinator_load"].pop("findings_ms_max")
        return s

    a = once(1)
    assert a["per_kind"] and a == once(2)


# ---- the job model, by hand --------------------------------------------------------------------

def test_job_model_reproduces_a_hand_computed_case():
    p = jobmodel.JobParams(checkpoint_s=3600, restart_s=600, nccl_timeout_s=30, comm_fraction=0.3)
    hits = [
        # 2.5 h in: 0.5 h since the 2 h checkpoint + 30 s timeout + 600 s restart = 2430 s
        jobmodel.Hit(2.5 * 3600, "restart", detect_s=30),
        # lands while the job restarts: absorbed
        jobmodel.Hit(2.5 * 3600 + 100, "restart", detect_s=30),
        # a 40 ms stall, and 1 h at 10 % slower: 360 s
        jobmodel.Hit(5 * 3600, "stall", stall_s=0.04),
        jobmodel.Hit(6 * 3600, "slowdown", slow_fraction=0.1, slow_s=3600),
        # checkpoints count from the restart (back at 9630 s): (25200 - 9630) mod 3600 = 1170 s to redo
        jobmodel.Hit(7 * 3600, "restart", detect_s=0),
    ]
    res = jobmodel.run(hits, 10 * 3600, p)
    expected = 2430 + 0.04 + 360 + (1170 + 600)
    assert res.restarts == 2
    assert res.lost_s == pytest.approx(expected)
    assert res.goodput == pytest.approx((36000 - expected) / 36000)
    assert res.lost_by["recompute"] == pytest.approx(1800 + 1170)


def test_job_model_rejects_nonsense():
    with pytest.raises(ValueError, match="checkpoint_s"):
        jobmodel.JobParams(checkpoint_s=0)
    with pytest.raises(ValueError, match="comm_fraction"):
        jobmodel.JobParams(comm_fraction=2)
    with pytest.raises(ValueError, match="kind"):
        jobmodel.run([jobmodel.Hit(1.0, "nap")], 10.0, jobmodel.JobParams())


def test_losing_one_plane_of_eight_slows_the_network_share_by_a_seventh():
    p = jobmodel.JobParams(comm_fraction=0.3)
    assert jobmodel.degraded_fraction(p, 1 / 8) == pytest.approx(0.3 / 7)


# ---- failure models ----------------------------------------------------------------------------

def test_the_16k_fabric_is_2048_hosts_of_8_rails():
    s = Shape.for_gpus(16_384)
    assert (s.hosts, s.rails, s.hosts_per_leaf, s.spines_per_pod, s.tiers) == (2048, 8, 32, 32, 2)
    with pytest.raises(ValueError, match="gpus"):
        Shape.for_gpus(100)


def test_the_131k_fabric_is_3_tier_radix_64():
    s = Shape.for_gpus(131_072)
    assert (s.hosts, s.tiers, s.leaves_per_pod, s.spines_per_pod, s.cores_per_group) == (16384, 3, 32, 32, 32)
    layout = s.layout()
    assert (layout.pods, layout.cores_per_plane) == (16, 1024)


# ---- 3-tier fabrics ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def three():
    """256 hosts x 2 rails: 16 leaves, 4 pods of 4 leaves and 4 spines, 4 cores per group."""
    return fleet.Fleet(Shape(256, 2, 16, 4, leaves_per_pod=4, cores_per_group=4))


def test_three_tier_fleet_paths_climb_to_the_core(three):
    assert three.model.pods(0) == 4
    cross = [sp for sp in three.paths if sp.core is not None]
    assert cross and all(len(sp.forward) == 6 for sp in cross)
    assert any(sp.job for sp in cross)  # the ring crosses pods at their edges


@pytest.mark.parametrize("link", ["p1s5-p1c7:up", "p0s14-p0c9:down", "p1l6-p1s6:up"])
def test_three_tier_gray_loss_above_the_leaf_is_found_and_left(three, link):
    name, direction = link.split(":")
    o = fleet.simulate(three, Failure(10.0, "gray", (name, direction), loss=0.05), np.random.default_rng(6))
    assert o.paths > 0 and len(o.detect_ms) == o.paths
    assert o.localized and o.false_findings == 0 and not o.exposed_at_end


def test_a_sharded_coordinator_finds_the_same_faults():
    # the evidence split over 4 coordinator shards (one pod each) and a root, as core/shards.py does
    sharded = fleet.Fleet(Shape(256, 2, 16, 4, leaves_per_pod=4, cores_per_group=4), fleet.SimConfig(shards=4))
    assert sharded.localizer.map.shards == 4
    for link in ("p1s5-p1c7:up", "p0l6-p0s6:down"):
        name, direction = link.split(":")
        o = fleet.simulate(sharded, Failure(10.0, "gray", (name, direction), loss=0.05), np.random.default_rng(6))
        assert o.localized and o.false_findings == 0, link
    r = fleet.run(4096, 1.0, "stress", 3, config=fleet.SimConfig(shards=2))
    assert r.outcomes and all(o.localized for o in r.outcomes if o.kind == "cable")


def test_stress_draws_gray_links_on_every_tier_of_a_3_tier_fabric():
    shape = Shape.for_gpus(131_072)
    fs = [f for f in failures.draw("stress", shape, 2, np.random.default_rng(2)) if f.kind == "gray"]
    model_tiers = {("h" if n.startswith("h") else "c" if "c" in n.split("-")[1] else "s") for n, _ in (f.target for f in fs)}
    assert model_tiers == {"h", "s", "c"}, model_tiers


def test_llama3_rates_come_back_over_a_long_horizon():
    shape = Shape.for_gpus(16_384)
    fs = failures.draw("llama3", shape, 54 * 40, np.random.default_rng(1))
    per_54_days = len(fs) / 40
    assert per_54_days == pytest.approx(failures.LLAMA3_TOTAL, rel=0.05)
    network = sum(f.kind in ("cable", "switch") for f in fs) / 40
    assert network == pytest.approx(failures.LLAMA3_SWITCH_CABLE, rel=0.15)
    assert sum(f.kind == "nic" for f in fs) / 40 == pytest.approx(failures.LLAMA3_NIC, rel=0.3)


def test_clockwork_rate_is_a_5_year_mttf_per_nic_link():
    shape = Shape.for_gpus(16_384)
    fs = failures.draw("clockwork", shape, 100, np.random.default_rng(2))
    cables = sum(f.kind == "cable" for f in fs) / 100
    assert cables == pytest.approx(16_384 / (5 * 365), rel=0.1)  # ~9 a day
    # Clockwork's own arithmetic: 100 000 such links fail first after 26.28 min on average
    assert failures.CLOCKWORK_LINK_MTTF_S / 100_000 / 60 == pytest.approx(26.28, abs=0.01)


def test_draws_are_seeded():
    shape = Shape.for_gpus(1024)
    a = failures.draw("stress", shape, 3, np.random.default_rng(5))
    b = failures.draw("stress", shape, 3, np.random.default_rng(5))
    assert a == b and {f.kind for f in a} >= {"flap", "gray", "other"}
    with pytest.raises(ValueError, match="scenario"):
        failures.draw("meteor", shape, 1, np.random.default_rng(0))


# ---- the simulator runs the agent's and the coordinator's code, not copies -------------------

DECISION_NAMES = {"PathDetector", "Detector", "Sprt", "Failover", "usable_planes", "entropy_entry",
                  "silence_confirmed", "Localizer", "localize", "plan_probes", "path_evidence", "LossCounters"}


def test_the_simulator_defines_none_of_the_decision_code():
    for name in os.listdir(SIM):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(SIM, name)).read())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & DECISION_NAMES, f"{name} redefines {defined & DECISION_NAMES}"


def test_the_simulator_and_the_agent_share_one_decision_code():
    assert virtual.Failover is failover.Failover
    assert failover.Detector is detector.Detector
    assert failover.usable_planes is decide.usable_planes and failover.entropy_entry is decide.entropy_entry
    assert fleet.Localizer is localize.Localizer and service.Localizer is localize.Localizer
    assert fleet.plan_probes is plan.plan_probes and service.plan_probes is plan.plan_probes
    assert fleet.path_evidence is service.path_evidence


def test_the_simulator_hands_failover_the_agents_event_type_through_the_agents_feed(monkeypatch):
    from linkpass.core import probe_event, telemetry
    from linkpass.probe import engine

    assert virtual.ProbeEvent is probe_event.ProbeEvent and virtual.feed_events is telemetry.feed_events
    assert engine.ProbeEvent is probe_event.ProbeEvent and engine.feed_events is telemetry.feed_events
    seen, fed = [], []
    real_step, real_feed = failover.Failover.step, telemetry.feed_events
    monkeypatch.setattr(failover.Failover, "step", lambda self, ev, *a: seen.extend(ev) or real_step(self, ev, *a))
    monkeypatch.setattr(virtual, "feed_events", lambda ev, t: fed.extend(ev) or real_feed(ev, t))
    calibration.trial(calibration.CASES[0], np.random.default_rng(1))
    assert seen and {type(e) for e in seen} == {probe_event.ProbeEvent}
    assert {e.kind for e in seen} >= {probe_event.EV_ANSWERED, probe_event.EV_MISS}
    assert sorted(fed) == sorted(seen)  # every event Failover saw went through the feed first


def test_changing_the_real_detector_changes_the_simulation(small, monkeypatch):
    # If the simulator ran a copy, a change to the agent's detector would not reach it.
    calls = []
    real = detector.PathDetector._t_down

    def spy(self, reason, now_ns):
        calls.append(now_ns)
        return real(self, reason, now_ns)

    monkeypatch.setattr(detector.PathDetector, "_t_down", spy)
    o = fleet.simulate(small, Failure(10.0, "cable", ("h9", 1)), np.random.default_rng(8))
    assert len(calls) >= len(o.detect_ms) > 0
    # and one threshold of the agent's config is the simulation's: 5 misses instead of 3, two
    # more misses a timeout (>= 250 us) or less apart (each miss's confirmation round probes the
    # path at once, and so do the rounds of the peer's other paths' misses)
    slow = fleet.Fleet(Shape.for_gpus(512), fleet.SimConfig(detector=detector.DetectorConfig(miss_threshold=5)))
    o5 = fleet.simulate(slow, Failure(10.0, "cable", ("h9", 1)), np.random.default_rng(8))
    assert np.median(o5.detect_ms) > np.median(o.detect_ms) + 0.2, (o.detect_ms, o5.detect_ms)
    assert min(o5.detect_ms) > min(o.detect_ms)


def test_changing_the_real_localizer_changes_the_simulation(small, monkeypatch):
    monkeypatch.setattr(localize.Localizer, "findings", lambda self: [])
    o = fleet.simulate(small, Failure(10.0, "cable", ("h11", 2)), np.random.default_rng(9))
    assert not o.localized


# ---- calibration against the testbed ----------------------------------------------------------

def test_simulated_detection_times_match_the_testbeds_within_20_percent():
    got = calibration.calibrate(trials=200)  # ~20 s; fewer trials leave the simulated median ±10 %
    assert {c["case"] for c in got} == {c.name for c in calibration.CASES}
    for c in got:
        assert c["sim_missed"] == 0, c
        assert c["error_pct"] <= calibration.TOLERANCE_PCT, c


# ---- the command ------------------------------------------------------------------------------

def test_the_command_writes_a_report(tmp_path):
    out = subprocess.run([sys.executable, "-m", "linkpass_sim.fleet", "--gpus", "512", "--days", "1",
                          "--scenario", "clockwork", "--seed", "3", "--report", str(tmp_path), "-o", "json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert 0 < s["without_linkpass"]["goodput_pct"] <= s["with_linkpass"]["goodput_pct"] <= 100
    for name in ("summary.json", "report.md", "lost-gpu-hours.png", "goodput-vs-checkpoint.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text()) == s


def test_the_command_names_a_bad_option():
    out = subprocess.run([sys.executable, "-m", "linkpass_sim.fleet", "--gpus", "100"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "gpus" in out.stderr and "multiple of 8" in out.stderr


def test_the_simulator_prices_the_rates_with_the_agents_own_rate_logic(small, monkeypatch):
    from linkpass.core import activity

    assert fleet.Activity is activity.Activity  # the agent's class, not a copy
    off = fleet.probe_cost(small, idle_rates=False)
    busy, quiet = fleet.probe_cost(small, idle_rates=True), fleet.probe_cost(small, idle_rates=True, progressing=False)
    job = sum(sp.job for sp in small.paths)
    assert off["paths_active"] == len(small.paths) and off["paths_idle"] == 0
    # the job's lanes name its paths: progressing while a collective is in flight, standby between
    assert busy["paths_progressing"] == job and quiet["paths_standby"] >= job
    assert busy["paths_active"] == quiet["paths_active"] == 0
    # the plan's paths to other peers are idle (to the job's peers, standby)
    others = len(small.paths) - job
    assert busy["paths_idle"] + busy["paths_standby"] == others and busy["paths_idle"] > 0
    for on in (busy, quiet):
        assert on["sent_per_host_median"] < off["sent_per_host_median"] / 10
        assert on["cpu_pct_per_host_median"] < off["cpu_pct_per_host_median"] / 10
    # and a change to the agent's rule reaches the price: nothing ever progresses (the rule runs
    # for every path of a peer some lane names; the plan's other peers are idle or standby without it)
    monkeypatch.setattr(activity.Activity, "classify", lambda self, key, now_ns, busy: activity.ACTIVE)
    job_peers = {(sp.reporter, sp.peer) for sp in small.paths if sp.job}
    named = sum((sp.reporter, sp.peer) in job_peers for sp in small.paths)
    assert named >= job > 0 and fleet.probe_cost(small, idle_rates=True)["paths_active"] == named
