"""The demo's parts that need no root: the timeline analysis (hand-computed cases), the fault
script, the aim at the busiest link, and the pictures (the training job itself on loopback:
tests/service/test_demo_job.py)."""
from __future__ import annotations

import json
import os

import pytest

from linkpass.demo import timeline

from collections import Counter

from linkpass.demo.aim import busiest
from linkpass.demo.plot import sparkline, write_png
from linkpass.demo.script import KINDS, SCRIPT, select
from linkpass.demo.timeline import Fault
from linkpass.testbed.topology import make_fabric, preset

MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000  # a wall-clock instant, in ns


def steady_steps(n: int, period_ms: float = 30, allreduce_ms: float = 20, start_ns: int = T0) -> list[dict]:
    """n steps: compute, then a 20 ms all-reduce, one every 30 ms."""
    out = []
    for i in range(n):
        end = start_ns + int((i + 1) * period_ms * MS)
        out.append({"step": i, "start_ns": end - int(allreduce_ms * MS), "end_ns": end, "ok": True})
    return out


def stalled(steps: list[dict], at_ns: int, extra_ms: float) -> list[dict]:
    """The step running at `at_ns` takes `extra_ms` longer; every later step shifts by as much."""
    out, shift = [], 0
    for s in steps:
        s = dict(s)
        s["start_ns"] += shift
        s["end_ns"] += shift
        if not shift and s["end_ns"] > at_ns:
            shift = int(extra_ms * MS)
            s["end_ns"] += shift
        out.append(s)
    return out


def fault(at_ms: float, hold_ms: float = 2000, severity: str = "hard", link: str = "h1-p0l0") -> Fault:
    return Fault(index=1, kind="uplink-cut", label="host uplink cut", link=link, direction=None, severity=severity,
                 load_mbps=200.0, injected_ns=T0 + int(at_ms * MS), cleared_ns=T0 + int((at_ms + hold_ms) * MS))


def test_a_fault_that_costs_nothing_has_no_stall_and_full_speed_at_once():
    steps = steady_steps(300)
    f = fault(4000)
    r = timeline.analyse_fault(f, steps, [], [], planes=2)
    assert r.stall_ms == 0.0 and r.longest_step_ms == 20.0
    # the first window holds the step that was running when the fault came: full speed at once
    assert r.recovered_s == 0.0
    assert r.detect_ms is None and r.reroute_ms is None and r.localized_ms is None
    assert r.met  # nothing happened, so nothing missed


def test_stall_is_the_longest_allreduce_beyond_the_pre_fault_median():
    f = fault(4000)
    steps = stalled(steady_steps(300), f.injected_ns + 5 * MS, 80)
    r = timeline.analyse_fault(f, steps, [], [], planes=2)
    assert r.longest_step_ms == 100.0 and r.stall_ms == 80.0
    # 10-step windows: one holding the stalled step (3.990 -> 4.100 s) runs 10 steps in 380 ms,
    # 79 % of 33.3 steps/s; the first clean window starts where that step ends: 0.1 s after the fault
    assert r.recovered_s == pytest.approx(0.1, abs=1e-6)
    assert r.met


def test_a_hard_stall_over_100_ms_misses_its_target_a_gray_one_does_not():
    f = fault(4000)
    steps = stalled(steady_steps(300), f.injected_ns + 5 * MS, 150)
    assert not timeline.analyse_fault(f, steps, [], [], planes=2).met
    assert timeline.analyse_fault(fault(4000, severity="gray"), steps, [], [], planes=2).met


def test_throughput_that_stays_low_is_not_recovered():
    steps = steady_steps(130)  # 3.9 s at full speed ...
    slow = steady_steps(100, period_ms=60, start_ns=steps[-1]["end_ns"])  # ... then half speed to the end
    f = fault(3950)
    r = timeline.analyse_fault(f, steps + slow, [], [], planes=2)
    assert r.recovered_s is None and not r.met


def test_detect_reroute_and_localize_come_from_the_first_matching_events():
    f = fault(4000)
    s = lambda ms: (T0 + ms * MS) / 1e9  # noqa: E731
    agent = [
        {"event": "path_state", "new": "down", "ts": s(3990)},  # before the fault: not this one's
        {"event": "path_state", "new": "recovering", "ts": s(4005)},  # not a bad state
        {"event": "path_state", "new": "down", "ts": s(4012)},
        {"event": "route_change", "planes": [0, 1], "ts": s(4013)},  # every plane: not a reroute
        {"event": "route_change", "planes": [1], "ts": s(4015), "dry_run": True},  # touched nothing
        {"event": "route_change", "planes": [1], "ts": s(4016)},
        {"event": "path_state", "new": "down", "ts": s(6500)},  # after it was cleared
    ]
    coord = [
        {"kind": "localization", "subject": "p0l0-p0s1:up", "ts": s(4050), "detail": {}},
        {"kind": "localization", "subject": "h0-p0l0:up", "ts": s(4080),
         "detail": {"alternatives": ["h1-p0l0:up"]}},  # names it as the twin
        {"kind": "localization", "subject": "h1-p0l0:either", "ts": s(4100), "detail": {}},
    ]
    r = timeline.analyse_fault(f, steady_steps(300), agent, coord, planes=2)
    assert (r.detect_ms, r.reroute_ms) == (12.0, 16.0)
    assert (r.localized_ms, r.localized_as) == (80.0, "h0-p0l0:up")


def test_the_alert_column_is_the_first_of_the_faults_alerts_to_fire_in_its_window():
    f = fault(1000, hold_ms=2000)
    f.alerts = ("LinkPassPlaneDown", "LinkPassPathDown")
    at = lambda ms: (T0 + ms * MS) / 1e9  # noqa: E731 - epoch seconds, as Prometheus says them
    spans = {"LinkPassPathDown": [(at(3500), at(6000))], "LinkPassPlaneDown": [(at(500), at(900)), (at(3900), at(5000))],
             "LinkPassGrayLoss": [(at(1100), at(2000))]}
    # PlaneDown's first span came before the fault: not this fault's; GrayLoss is not its alert
    assert timeline.first_alert(f, spans) == (2500.0, "LinkPassPathDown")
    assert timeline.first_alert(f, {"LinkPassPathDown": [(at(14000), at(15000))]}) == (None, None)  # too late
    # another instance (another peer or plane) firing since before the fault does not hide this one's start
    assert timeline.first_alert(f, {"LinkPassPathDown": [(at(0), at(9000)), (at(3500), at(6000))]}) == \
        (2500.0, "LinkPassPathDown")
    r = timeline.analyse_fault(f, steady_steps(200), [], [], 2, spans)
    assert (r.alert_ms, r.alert) == (2500.0, "LinkPassPathDown")


def test_summary_counts_and_the_verdict():
    steps = steady_steps(200)
    seen = [{"event": "path_state", "new": "down", "ts": (T0 + 4010 * MS) / 1e9},
            {"event": "route_change", "planes": [1], "ts": (T0 + 4011 * MS) / 1e9}]
    run = timeline.summarise("linkpass", steps, 0, 0, [fault(4000)], seen, [], 2)
    assert run.steps == 200 and run.step_ms_p50 == 20.0 and timeline.targets_met(run)
    assert timeline.job_unharmed(run)
    assert not timeline.targets_met(timeline.summarise("linkpass", steps, 1, 0, [], [], [], 2))  # a wrong result
    assert not timeline.targets_met(timeline.summarise("linkpass", steps, 0, 1, [], [], [], 2))  # a restart
    # a fault nobody saw or routed around harms the job, whatever its timings
    unseen = timeline.summarise("linkpass", steps, 0, 0, [fault(4000)], [], [], 2)
    assert not timeline.job_unharmed(unseen) and not timeline.targets_met(unseen)
    doc = json.loads(json.dumps(run.as_dict()))
    assert {"kind", "detect_ms", "reroute_ms", "stall_ms", "recovered_s"} <= set(doc["faults"][0])


def test_the_script_has_the_six_faults_the_issue_asks_for_in_order():
    assert KINDS == ("uplink-cut", "link-down", "gray-loss", "flap", "one-way-loss", "mtu-blackhole")
    assert [s.kind for s in select("mtu-blackhole,uplink-cut")] == ["uplink-cut", "mtu-blackhole"]
    assert select(None) == SCRIPT
    with pytest.raises(ValueError, match="unknown fault kind cut.*choose from uplink-cut"):
        select("cut")


def test_aim_picks_the_link_of_the_tier_with_the_most_bytes_and_the_busier_direction():
    fab = make_fabric(preset("default"), "lpa", "198.19.250.0/24")
    load = Counter({("p0l0-p0s1", "p0l0"): 200e6, ("p0l0-p0s1", "p0s1"): 150e6, ("p1l1-p1s0", "p1s0"): 300e6,
                    ("h1-p0l0", "h1"): 100e6, ("h3-p0l1", "p0l1"): 100e6})
    assert busiest(fab, load, "leaf-spine", directed=False) == ("p0l0-p0s1", None, 350e6)
    assert busiest(fab, load, "leaf-spine", directed=True) == ("p1l1-p1s0", "p1s0", 300e6)
    # h1-p0l0 and h3-p0l1 carry as much: the first name wins
    assert busiest(fab, load, "host-leaf", directed=False) == ("h1-p0l0", None, 100e6)


def test_sparkline_marks_each_fault_where_it_came():
    steps = stalled(steady_steps(200), T0 + 3000 * MS, 200)
    bars, marks = sparkline(steps, [fault(3000)], width=60)
    assert len(bars) == len(marks) == 60
    assert bars.count("█") == 1 and marks.strip() == "1"
    # bars go by when a step ended: the stalled step ends 200 ms (two buckets) after the fault
    assert 0 <= bars.index("█") - marks.index("1") <= 3


def test_png_is_written(tmp_path):
    steps = steady_steps(100)
    path = write_png(str(tmp_path / "t.png"), [("on", steps, [fault(1000)], []), ("off", steps, [], [T0 + 2 * 10**9])],
                     "test")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_noise_stalls_measure_fault_free_windows_only():
    steps = steady_steps(600)  # 18 s
    steps = stalled(steps, T0 + 2000 * MS, 30)  # noise: a 30 ms hiccup far from the fault
    f = fault(8000, hold_ms=1000)
    steps = stalled(steps, f.injected_ns + 5 * MS, 500)  # the fault's own stall must not count
    noise = timeline.noise_stalls(steps, [f], window_s=2.5, margin_s=1.0)
    assert noise and max(noise) == 30.0 and min(noise) == 0.0
    run = timeline.summarise("linkpass", steps, 0, 0, [f], [], [], 2)
    assert run.noise_stall_ms["median"] == 0.0 and run.faults[0].stall_ms == 500.0
