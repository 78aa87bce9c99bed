"""Parts of the chaos soak (bench/reliability.py --rows chaos) that its figures rest on: an
agent's bad intervals are read from its log across restarts, and every kind of strike has its kill
(a restarted Prometheus keeping its alert history: tests/service/test_chaos_prometheus.py)."""
from __future__ import annotations

import os
import sys


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def ev(kind: str, ts: float, **kw) -> dict:
    return {"event": kind, "ts": ts, **kw}


def test_bad_intervals_run_until_good_and_end_at_a_kill_and_at_the_end():
    from reliability import bad_intervals

    log = [ev("started", 0.0),
           ev("path_state", 1.0, path=1, peer="h1", new="down"),
           ev("path_state", 1.2, path=1, peer="h1", new="recovering"),  # passing: the evidence stands
           ev("path_state", 1.3, path=1, peer="h1", new="degraded"),  # the same interval
           ev("path_state", 1.4, path=1, peer="h1", new="recovering"),
           ev("path_state", 1.5, path=1, peer="h1", new="up"),  # good: ends it
           ev("path_state", 2.0, path=2, peer="h2", new="degraded"),
           ev("path_state", 2.5, path=2, peer="h2", new="down"),
           ev("path_state", 3.0, path=3, peer="h3", new="suspect"),  # never bad
           ev("path_state", 3.1, path=3, peer="h3", new="up"),
           ev("started", 9.0),  # killed at 4.0 with path 2 bad, started again at 9.0
           ev("path_state", 10.0, path=1, peer="h1", new="damped")]
    got = sorted(bad_intervals(log, kills=[4.0], until=20.0))
    assert got == [(1, "h1", 1.0, 1.5), (1, "h1", 10.0, 20.0), (2, "h2", 2.0, 4.0)]


def test_every_kind_of_strike_has_its_kill():
    from reliability import STRIKES, Chaos

    missing = [k for k in STRIKES if not callable(getattr(Chaos, f"_kill_{k}", None))]
    assert not missing, f"strikes the soak deals but cannot carry out: {missing}"
