"""Simulator sweeps on Ray: the same sweep run serially gives the same results."""
from __future__ import annotations

from linkpass_sim import sweep

SMALL = dict(gpus=[512], days=1.0, scenarios=["clockwork", "stress"], checkpoint_mins=[15, 60], seeds=[1, 2])


def test_a_sweep_on_ray_equals_the_same_sweep_run_serially():
    todo = sweep.cells(**SMALL)
    seen = []
    on_ray = sweep.run_on_ray(todo, "local", cpus=2, progress=seen.append)
    assert on_ray == sweep.run_serial(todo)
    assert len(seen) == len(todo) and seen[-1].startswith("8/8 cells")
    rows = sweep.aggregate(on_ray)
    assert len(rows) == 4 and all(r["seeds"] == 2 for r in rows)
