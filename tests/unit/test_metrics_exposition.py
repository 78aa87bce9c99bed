"""The agent's exposition, byte for byte against a golden file (names, types, help texts and
label sets are an interface: dashboards and alert rules depend on them), and through
`promtool check metrics`, the linter Prometheus ships."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from linkpass import __version__
from linkpass.agent.api import PathLabels, TelemetryView, metrics_registry
from linkpass.agent.daemon import LOOP_STEPS
from linkpass.core.decide import PathInfo
from linkpass.core.failover import Failover
from linkpass.core.budget import apportion
from linkpass.agent.metrics import SPECS, AgentCollector, DecisionCollector, HttpCollector, TelemetryCollector
from linkpass.core.detector import Detector, DetectorConfig
from linkpass.core.telemetry import PathTelemetry
from linkpass.testbed.prometheus import promtool
from linkpass.probe.common import PathSpec, ProbedPath

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "agent_metrics.txt")


class Engine:
    """Stands in for the probe engine: what TelemetryView and the collectors read of it."""

    def __init__(self):
        self.paths: dict[int, ProbedPath] = {}
        self.stats = {"sent": 40, "reflected": 38, "replies": 36, "received": 74, "confirm_rounds": 3, "confirm_refused": 1}
        self.drops = {"replay": 2, "bad_tag": 1}


def agent_exposition(per_path: bool, layout=(("h1", 0, 0), ("h1", 0, 1), ("h1", 1, 0), ("h2", 0, 0), ("h2", 1, 0)),
                     process: bool = False) -> str:
    """An agent's /metrics over `layout` (peer, plane, path index) — by default two peers x two
    planes, two paths on one of them — fed with replies of known delays and losses; with
    `process`, the process and runtime collectors too (not golden: their values vary)."""
    engine, labels = Engine(), {}
    fo = Failover(Detector(DetectorConfig()), lambda pid: engine.paths[pid].telemetry.loss)
    for pid, (peer, plane, path) in enumerate(layout, start=1):
        tel = PathTelemetry()
        for seq in range(10):
            tel.on_sent()
            if seq in (3, 7) and pid == 2:  # path 2 loses two replies on the way back
                continue
            t1 = 1_000_000 * seq
            # reflector clock 500 ns ahead; 10 µs out, 12 µs back (+1 µs per path)
            t2 = t1 + 10_000 + 500 + 1_000 * pid
            t3 = t2 + 2_000
            t4 = t3 - 500 + 12_000 + 1_000 * pid
            tel.on_reply(seq, t1, t2, t3, t4, rx_count=seq + 1)
        spec = PathSpec(pid, f"p{plane}", 2 if peer == "h1" else 3, "198.18.64.9", 49152 + path)
        engine.paths[pid] = ProbedPath(spec, tel)
        labels[pid] = PathLabels(peer, plane, path, 49152 + path)
        fo.add_path(PathInfo(pid, peer, plane, 49152 + path, "198.18.64.9"))
    view = TelemetryView(engine, labels, offset_ns=lambda peer_id: 500.0)
    agent = AgentCollector(lambda: {"loop_errors": dict.fromkeys(LOOP_STEPS, 0), "answers_rejected": 0,
                                    "probe_thread_up": True, "coordinator_up": True, "engine": "sockets",
                                    "paths_by_rate": {"active": 1, "progressing": 1, "standby": 1, "idle": 1},
                                    "lanes": {"reports_live": 1, "reports_stale": 0, "reports_bad": 2, "lanes": 5,
                                              "lanes_unknown": 7},
                                    "rdma_unreported_planes": 1,
                                    "budget": apportion({1: ("active", 0.001), 2: ("coverage", 0.1)}, 505.0)})
    http = HttpCollector(lambda: [
        SimpleNamespace(label="local-api", stats={"accepted": 40, "refused": 1, "evicted": 3, "timed_out": 2,
                                                  "accept_failed": 0}),
        SimpleNamespace(label="metrics", stats={"accepted": 9, "refused": 0, "evicted": 0, "timed_out": 0,
                                                "accept_failed": 0})])
    decisions = DecisionCollector(lambda: fo, lambda: per_path)
    if process:
        registry = metrics_registry(view, [decisions, agent], lambda: per_path, http=http)
    else:
        registry = CollectorRegistry(auto_describe=False)
        for c in (TelemetryCollector(view, lambda: per_path), decisions, agent, http):
            registry.register(c)
    return generate_latest(registry).decode().replace(f'version="{__version__}"', 'version="VERSION"')


def test_the_agent_exposition_matches_the_golden_file():
    text = agent_exposition(per_path=True)
    if os.environ.get("LINKPASS_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        assert text == f.read(), "exposition changed: review, then rerun with LINKPASS_UPDATE_GOLDEN=1"


def test_every_family_of_specs_is_exported_with_per_path_detail():
    text = agent_exposition(per_path=True)
    missing = [n for n in SPECS if f"# TYPE {n} " not in text and f"# TYPE {n}_total " not in text]
    assert not missing


def test_default_exposition_has_no_per_path_series_and_fewer_of_them():
    default, detail = agent_exposition(per_path=False), agent_exposition(per_path=True)
    series = lambda t: [ln for ln in t.splitlines() if ln and not ln.startswith("#")]  # noqa: E731
    per_path = [n for n, spec in SPECS.items() if "path" in spec.labels]
    assert per_path and not [n for n in per_path if f"# TYPE {n}" in default] and 'path="' not in default
    assert len(series(default)) < len(series(detail))


@pytest.mark.parametrize("per_path", [False, True])
def test_promtool_check_metrics_passes(per_path):
    out = promtool("check", "metrics", stdin=agent_exposition(per_path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_would_catch_a_quantile_label_on_a_gauge():
    """The linter is live: the mistake this exposition used to make is reported."""
    bad = '# HELP x_seconds d\n# TYPE x_seconds gauge\nx_seconds{quantile="0.5"} 1\n'
    out = promtool("check", "metrics", stdin=bad)
    assert out.returncode != 0 and "quantile" in out.stdout + out.stderr


def series(text: str) -> int:
    return sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))


def fleet_host(ecmp_paths: int) -> list[tuple[str, int, int]]:
    """A host of the 16 384-GPU simulation: its 2 ring neighbours on 8 planes over `ecmp_paths`
    ports each, plus the coordinator's plan (3 peers per plane, one path each)."""
    ring = [(peer, plane, k) for peer in ("r1", "r2") for plane in range(8) for k in range(ecmp_paths)]
    return ring + [(f"c{plane}-{i}", plane, 0) for plane in range(8) for i in range(3)]


def test_default_series_grow_with_peer_planes_not_with_paths():
    """What docs/observability.md counts: per agent ~17 series per (peer, plane) plus ~20 per
    plane and the process's, whatever the number of ECMP paths; each path adds 37 with per_path."""
    one, four = (agent_exposition(False, fleet_host(k), process=True) for k in (1, 4))
    assert series(one) == series(four)
    peer_planes, planes, peers = 2 * 8 + 24, 8, 2 + 24
    fixed = series(agent_exposition(False, (), process=True))
    # per peer: the lateness allowance (and, once routes are decided, the planes it uses: one more)
    assert series(four) - fixed == 17 * peer_planes + 20 * planes + peers
    detail = agent_exposition(True, fleet_host(4), process=True)
    assert series(detail) - series(four) == 37 * len(fleet_host(4))
    assert series(four) < 1100 and fixed < 100, (series(four), fixed)
