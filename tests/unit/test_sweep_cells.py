"""Simulator sweeps: cells are every combination in a fixed order."""
from __future__ import annotations

import pytest

from linkpass_sim import sweep

SMALL = dict(gpus=[512], days=1.0, scenarios=["clockwork", "stress"], checkpoint_mins=[15, 60], seeds=[1, 2])


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
