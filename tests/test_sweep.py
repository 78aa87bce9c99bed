"""Simulator sweeps: cells, their seeded results, and the same sweep on Ray equal to it run serially."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from linkpass_sim import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(gpus=[512], days=1.0, scenarios=["clockwork", "stress"], checkpoint_mins=[15, 60], seeds=[1, 2])


@pytest.mark.unit
def test_cells_are_every_combination_in_a_fixed_order():
    todo = sweep.cells(**SMALL)
    assert len(todo) == 8
    assert [(c.scenario, c.checkpoint_min, c.seed) for c in todo[:3]] == [("clockwork", 15, 1), ("clockwork", 15, 2),
                                                                          ("clockwork", 60, 1)]
    with pytest.raises(sweep.SweepError, match="--scenarios: 'lama3' is unknown"):
        sweep.cells([512], 1.0, ["lama3"], [30], [1])
    with pytest.raises(sweep.SweepError, match="gpus: 100"):
        sweep.cells([100], 1.0, ["llama3"], [30], [1])
    with pytest.raises(sweep.SweepError, match="checkpoint_s"):
        sweep.cells([512], 1.0, ["llama3"], [0], [1])
    assert sweep._ints("1-3,8", "--seeds") == [1, 2, 3, 8]
    with pytest.raises(sweep.SweepError, match="--seeds: 'a-b'"):
        sweep._ints("a-b", "--seeds")


@pytest.mark.sim
def test_a_cell_gives_the_same_result_twice_and_no_wall_clock():
    cell = sweep.Cell(512, 2.0, "stress", 30, 4)
    a, b = sweep.run_cell(cell), sweep.run_cell(cell)
    assert a == b and a["cell"]["seed"] == 4
    assert "sim_wall_s" not in a["summary"] and "findings_ms_max" not in a["summary"]["coordinator_load"]
    # the checkpoint interval reaches the job model: a longer one loses more to each restart
    longer = sweep.run_cell(sweep.Cell(512, 2.0, "stress", 240, 4))
    assert longer["summary"]["failures"] == a["summary"]["failures"]
    assert longer["summary"]["without_linkpass"]["goodput_pct"] < a["summary"]["without_linkpass"]["goodput_pct"]


@pytest.mark.service
def test_a_sweep_on_ray_equals_the_same_sweep_run_serially():
    todo = sweep.cells(**SMALL)
    seen = []
    on_ray = sweep.run_on_ray(todo, "local", cpus=2, progress=seen.append)
    assert on_ray == sweep.run_serial(todo)
    assert len(seen) == len(todo) and seen[-1].startswith("8/8 cells")
    rows = sweep.aggregate(on_ray)
    assert len(rows) == 4 and all(r["seeds"] == 2 for r in rows)


@pytest.mark.sim
def test_the_command_prints_json_and_names_a_bad_option():
    out = subprocess.run([sys.executable, "-m", "linkpass_sim.sweep", "--gpus", "512", "--days", "1", "--seeds", "1-2",
                          "--scenarios", "clockwork", "--checkpoint-min", "15,60", "-o", "json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["cells"]) == 4 and [r["checkpoint_min"] for r in doc["aggregate"]] == [15, 60]
    bad = subprocess.run([sys.executable, "-m", "linkpass_sim.sweep", "--seeds", "x"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--seeds: 'x'" in bad.stderr
