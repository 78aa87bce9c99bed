"""A part of the chaos soak (bench/reliability.py --rows chaos) that its figures rest on: a
Prometheus killed and started again keeps what it recorded before (the alerts' history the soak
reports)."""
from __future__ import annotations

import os
import time

import pytest

ALWAYS = "groups:\n- name: t\n  rules:\n  - alert: Always\n    expr: vector(1)\n"


def test_a_restarted_prometheus_keeps_its_alert_history():
    from linkpass.testbed.prometheus import Prometheus, PrometheusMissing

    try:
        prom = Prometheus({"none": ["127.0.0.1:9"]}, ALWAYS, scrape_s=0.5, eval_s=0.5)
    except PrometheusMissing as exc:
        pytest.skip(f"no Prometheus here: {exc}")
    try:
        start = time.time()
        deadline = time.monotonic() + 30
        while "Always" not in prom.firing():
            assert time.monotonic() < deadline, "the always-firing alert never fired"
            time.sleep(0.2)
        time.sleep(2)
        first = prom.firing_spans(start, time.time(), step_s=0.5)["Always"][0][0]
        pid = prom.proc.pid
        prom.restart()
        assert prom.proc.pid != pid and prom.proc.poll() is None
        # what it recorded before the kill is still there (its write-ahead log replayed)
        assert prom.firing_spans(start, time.time(), step_s=0.5)["Always"][0][0] == first
    finally:
        prom.close()
    assert not os.path.exists(prom.dir)
