"""Simulator sweeps: a cell's seeded result is the same twice and reads no wall clock, and the
command prints JSON and names a bad option (cells: tests/unit/test_sweep_cells.py; on Ray:
tests/service/test_sweep_ray.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from linkpass_sim import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_cell_gives_the_same_result_twice_and_no_wall_clock():
    cell = sweep.Cell(512, 2.0, "stress", 30, 4)
    a, b = sweep.run_cell(cell), sweep.run_cell(cell)
    assert a == b and a["cell"]["seed"] == 4
    assert "sim_wall_s" not in a["summary"] and "findings_ms_max" not in a["summary"]["coordinator_load"]
    # the checkpoint interval reaches the job model: a longer one loses more to each restart
    longer = sweep.run_cell(sweep.Cell(512, 2.0, "stress", 240, 4))
    assert longer["summary"]["failures"] == a["summary"]["failures"]
    assert longer["summary"]["without_linkpass"]["goodput_pct"] < a["summary"]["without_linkpass"]["goodput_pct"]


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
