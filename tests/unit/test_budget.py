"""The probe budget (pure): rates degrade by priority within the pps ceiling; the CPU governor."""
from __future__ import annotations

import math
import random
import time

import pytest

from linkpass.core.budget import ACTIVE, CLASSES, COVERAGE, REST, STANDBY, CpuGovernor, apportion


def fleet(active=0, standby=0, coverage=0, rest=0):
    """Path ids numbered in class order: active at 1 ms, standby 10 ms, coverage and rest 100 ms."""
    wanted, pid = {}, 0
    for cls, n, t in ((ACTIVE, active, 0.001), (STANDBY, standby, 0.010), (COVERAGE, coverage, 0.1), (REST, rest, 0.1)):
        for _ in range(n):
            wanted[pid] = (cls, t)
            pid += 1
    return wanted


def total(result):
    return sum(1.0 / t for t in result.intervals.values())


def test_classes_are_ordered_highest_first():
    assert CLASSES == (ACTIVE, STANDBY, COVERAGE, REST)


def test_wanted_rates_that_fit_are_given_unchanged():
    wanted = fleet(active=4, standby=12, coverage=50, rest=20)  # 4000 + 1200 + 500 + 200
    for pps in (5900, 20000, 0):  # 0: no ceiling
        r = apportion(wanted, pps)
        assert r.intervals == {pid: t for pid, (_, t) in wanted.items()}
        assert r.degraded == () and r.overflow == 1.0
        assert r.pps == pytest.approx(5900) and r.wanted_pps == pytest.approx(5900)
        assert all(s.granted_pps == s.wanted_pps for s in r.classes.values())
    assert apportion({}, 100).intervals == {}


def test_over_budget_degrades_the_lowest_class_first_and_leaves_the_others():
    wanted = fleet(active=4, standby=12, coverage=50, rest=20)  # 5900 wanted
    r = apportion(wanted, 5750)  # rest (200 pps) gives up 150 alone
    assert r.degraded == (REST,)
    assert total(r) <= 5750 and total(r) == pytest.approx(5750)
    for pid, (cls, t) in wanted.items():
        if cls == REST:
            assert r.intervals[pid] == pytest.approx(0.4)  # one common factor: 4x
        else:
            assert r.intervals[pid] == t
    assert r.classes[REST].granted_pps == pytest.approx(50)
    assert r.classes[ACTIVE].granted_pps == r.classes[ACTIVE].wanted_pps


def test_slowest_is_reached_before_a_higher_class_is_touched():
    wanted = fleet(active=4, standby=12, coverage=50, rest=20)
    r = apportion(wanted, 5650)  # rest at 1 s gives 180 of the 250 needed; coverage the other 70
    assert r.degraded == (COVERAGE, REST)
    assert all(r.intervals[pid] == 1.0 for pid, (c, _) in wanted.items() if c == REST)
    cov = {r.intervals[pid] for pid, (c, _) in wanted.items() if c == COVERAGE}
    assert len(cov) == 1 and 0.1 < cov.pop() < 1.0  # stretched uniformly, not to the floor
    assert all(r.intervals[pid] == t for pid, (c, t) in wanted.items() if c in (ACTIVE, STANDBY))
    assert total(r) <= 5650 and total(r) == pytest.approx(5650)
    # rest must give up 190 pps: not enough at a floor of 1 s (180), enough at 10 s (198)
    assert apportion(wanted, 5710).degraded == (COVERAGE, REST)
    assert apportion(wanted, 5710, slowest_s=10.0).degraded == (REST,)


def test_active_is_degraded_last_and_only_when_the_rest_is_at_its_floor():
    wanted = fleet(active=4, standby=12, coverage=50, rest=20)  # floors: 12 + 50 + 20 = 82 pps
    r = apportion(wanted, 2082)  # active gets 2000 of its 4000
    assert r.degraded == (ACTIVE, STANDBY, COVERAGE, REST)
    assert all(r.intervals[pid] == 1.0 for pid, (c, _) in wanted.items() if c != ACTIVE)
    assert all(r.intervals[pid] == pytest.approx(0.002) for pid, (c, _) in wanted.items() if c == ACTIVE)
    assert total(r) <= 2082


def test_every_path_is_stretched_by_one_factor_when_even_the_floors_do_not_fit():
    wanted = fleet(active=10, standby=10, coverage=10, rest=10)  # 40 paths: 40 pps at the floor
    r = apportion(wanted, 8)
    assert r.overflow == pytest.approx(5)
    assert all(t == pytest.approx(5.0) for t in r.intervals.values())
    assert total(r) <= 8 and r.pps == pytest.approx(8)
    # a path that asked for slower than slowest_s keeps its proportion
    r = apportion({1: (ACTIVE, 0.001), 2: (REST, 4.0)}, 0.5)
    assert r.intervals[2] / r.intervals[1] == pytest.approx(4.0) and total(r) <= 0.5


def test_intervals_asked_for_slower_than_slowest_stay_as_asked():
    r = apportion({1: (REST, 5.0), 2: (REST, 0.01), 3: (ACTIVE, 0.001)}, 1050)
    assert r.intervals[1] == 5.0 and r.intervals[3] == 0.001 and r.degraded == (REST,)


def test_total_never_exceeds_the_budget_and_degradation_goes_by_priority():
    rng = random.Random(20240611)
    for case in range(400):
        n = rng.choice((1, 2, 5, 30, 200))
        wanted = {rng.randrange(10**6): (rng.choice(CLASSES), rng.choice((0.001, 0.01, 0.02, 0.1, 2.0))
                                          * rng.uniform(0.5, 2)) for _ in range(n)}
        asked = sum(1 / t for _, t in wanted.values())
        pps = rng.choice((0.01, 1, 10, 100, 1000, 10_000)) * rng.uniform(0.3, 3)
        slowest = rng.choice((0.5, 1.0, 3.0))
        r = apportion(wanted, pps, slowest)
        assert set(r.intervals) == set(wanted)
        assert total(r) <= pps or (asked <= pps and r.intervals == {p: t for p, (_, t) in wanted.items()}), case
        assert all(r.intervals[p] >= t for p, (_, t) in wanted.items()), case  # never faster than asked
        # a class is degraded only if every class below it is at its floor
        degraded = r.degraded
        for hi, cls in enumerate(CLASSES):
            if cls in degraded:
                for below in CLASSES[hi + 1:]:
                    for p, (c, t) in wanted.items():
                        if c == below:
                            assert r.intervals[p] >= max(t, slowest) * (1 - 1e-12), case
        if r.overflow == 1.0:
            assert all(r.intervals[p] <= max(t, slowest) * (1 + 1e-12) for p, (_, t) in wanted.items()), case
        assert apportion(dict(reversed(list(wanted.items()))), pps, slowest).intervals == r.intervals, case


def test_ten_thousand_paths_are_quick():
    rng = random.Random(7)
    wanted = {i: (rng.choice(CLASSES), rng.choice((0.001, 0.01, 0.1))) for i in range(10_000)}
    t = time.perf_counter()
    r = apportion(wanted, 20_000)
    assert time.perf_counter() - t < 2.0  # ~20 ms; the bound only catches a quadratic turn
    assert total(r) <= 20_000


def test_bad_inputs_are_refused():
    for wanted, pps in (({1: ("gold", 0.1)}, 10), ({1: (REST, 0)}, 10), ({1: (REST, math.inf)}, 10),
                        ({1: (REST, 0.1)}, -1), ({1: (REST, 0.1)}, math.nan)):
        with pytest.raises(ValueError):
            apportion(wanted, pps)
    with pytest.raises(ValueError):
        apportion({}, 10, slowest_s=0)


def cpu_model(base: float, per_pps: float, ceiling: float):
    """A synthetic process: CPU share = base + per_pps x the pps it is allowed."""
    return lambda factor: base + per_pps * ceiling * factor


def test_governor_without_a_share_is_always_one():
    g = CpuGovernor(0)
    assert g.update(5.0, 1.0) == 1.0 and g.update(0.0, 1.0) == 1.0


def test_governor_converges_below_the_share_and_recovers_when_load_drops():
    share, ceiling = 0.10, 20_000
    g = CpuGovernor(share)
    load = cpu_model(0.01, 0.3 / ceiling, ceiling)  # at the full ceiling: 31 % of a core
    factor, seen = 1.0, []
    for _ in range(60):
        used = load(factor)
        seen.append(used)
        factor = g.update(used * 2.0, 2.0)  # 2 s windows
        assert 0 < factor <= 1
    assert seen[0] > 3 * share
    settled = seen[10:]
    assert max(settled) <= share * 1.05  # within 5 % of the share once settled
    assert sum(settled) / len(settled) >= 0.8 * share  # and not far below it
    assert seen[3] <= share * 1.05  # a few windows to back off
    # the job's load drops (probes cost a tenth): back to the full ceiling, step by step
    load = cpu_model(0.01, 0.03 / ceiling, ceiling)
    trace = []
    for _ in range(40):
        factor = g.update(load(factor) * 2.0, 2.0)
        trace.append(factor)
    assert trace[-1] == 1.0
    assert all(b - a <= 0.05 + 1e-12 for a, b in zip(trace, trace[1:]))  # additive, not a jump


def test_governor_ignores_windows_without_a_measurement():
    g = CpuGovernor(0.05)
    assert g.update(1.0, 1.0) == pytest.approx(0.05)
    assert g.update(1.0, 0.0) == pytest.approx(0.05) and g.update(math.nan, 1.0) == pytest.approx(0.05)
    assert CpuGovernor(0.05, least=0.1).update(1000.0, 1.0) == 0.1  # never 0: probing never stops
    with pytest.raises(ValueError):
        CpuGovernor(-0.1)
