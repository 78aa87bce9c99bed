"""The demo's training job itself on loopback: gloo ranks all-reduce bit-exact and stop together,
and the check catches a wrong element."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from support.ports import free_port


def test_job_ranks_all_reduce_bit_exact_and_stop_together(tmp_path):
    """Two real gloo ranks on 127.0.0.1: every step checks out, and the stop flag rides in the
    all-reduce, so both ranks end after the same step."""
    pytest.importorskip("torch")
    port, stop = free_port(), tmp_path / "stop"
    procs = [subprocess.Popen([sys.executable, "-m", "linkpass.demo.job", "--rank", str(r), "--world", "2",
                               "--addr", "127.0.0.1", "--master", "127.0.0.1", "--port", str(port),
                               "--size-mb", "0.5", "--compute-ms", "5", "--timeout-s", "20",
                               "--stop-file", str(stop), "--out", str(tmp_path / f"r{r}.jsonl")],
                              stderr=subprocess.DEVNULL) for r in (0, 1)]
    try:
        logs = [tmp_path / f"r{r}.jsonl" for r in (0, 1)]
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end and (not logs[1].exists() or logs[1].read_text().count('"step"') < 10):
            time.sleep(0.1)
        stop.write_text("")
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    recs = [[json.loads(line) for line in log.read_text().splitlines()] for log in logs]
    steps = [[r for r in rs if "step" in r] for rs in recs]
    assert len(steps[0]) >= 10 and all(s["ok"] for rs in steps for s in rs)
    assert steps[0][-1]["step"] == steps[1][-1]["step"]
    assert recs[0][-1]["event"] == "done" and recs[1][-1]["event"] == "done"


def test_the_check_catches_a_wrong_element():
    torch = pytest.importorskip("torch")
    from linkpass.demo.job import PERIOD, expected_sum, pattern

    good = pattern(7, 0) + pattern(7, 1) + pattern(7, 2)
    assert torch.equal(good, expected_sum(7, 3))
    bad = good.clone()
    bad[PERIOD // 2] += 1
    assert not torch.equal(bad, expected_sum(7, 3))
    assert not torch.equal(good, expected_sum(8, 3))  # a stale step's result is caught too
