"""The local query API and Prometheus exposition of an agent's probes, read as the CLI and a
scraper would: from inside the host's namespace."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from linkpass.agent.api import LocalApi, PathLabels, TelemetryView, metrics_registry
from linkpass.testbed import faults
from linkpass.testbed.faults import FaultSpec
from linkpass.testbed.mesh import Mesh

KEY = bytes(range(32))
LINKPASS = [sys.executable, "-m", "linkpass.cli"]


@pytest.fixture
def h0_api(clean_faults):
    fab = clean_faults
    paths = [(0, b, p, sp) for b in (1, 2, 3) for p in (0, 1) for sp in (50000, 50001)]
    mesh = Mesh.start(fab, paths, KEY, interval_s=0.002)
    view = TelemetryView(mesh.engines[0], labels_of(mesh), offset_ns=lambda peer: 0.0, window_s=0.5)
    api = LocalApi(view, netns=fab.netns("h0"), port=0)
    try:
        yield fab, mesh, api
    finally:
        api.close()
        mesh.close()


def labels_of(mesh) -> dict[int, PathLabels]:
    return {pid: PathLabels(f"h{mp.dst}", mp.plane, mp.sport - 50000, mp.sport) for pid, mp in mesh.paths.items()}


def cli(fab, *args):
    return subprocess.run(["ip", "netns", "exec", fab.netns("h0"), *LINKPASS, *args], capture_output=True, text=True,
                          timeout=30)


def test_paths_json_and_exit_codes_follow_the_fabric(h0_api):
    fab, mesh, api = h0_api
    runner = threading.Thread(target=mesh.run, args=(5.0,))  # the agent keeps probing while we ask
    runner.start()
    time.sleep(1.5)
    out = cli(fab, "paths", "--port", str(api.port), "-o", "json")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 12 and {r["peer"] for r in rows} == {"h1", "h2", "h3"}
    for r in rows:
        assert r["replies"] > 200 and r["lost_fwd"] == 0 and r["lost_rev"] == 0
        assert 0 < r["rtt_ns"]["p50"] < 5e6 and r["owd_fwd_ns"]["p50"] > 0
    # a dark plane towards h1: exit code 2 and the table names it
    faults.apply(fab.prefix, FaultSpec("down", "h1-p0l0"))
    time.sleep(1.5)
    out = cli(fab, "paths", "h1", "--port", str(api.port))
    runner.join()
    assert out.returncode == 2, out.stdout
    assert "4 paths" in out.stdout and "2 dark or down" in out.stdout


def test_no_agent_is_exit_3_with_a_hint(fabric):
    out = subprocess.run(["ip", "netns", "exec", fabric.netns("h3"), *LINKPASS, "paths", "--port", "9"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and "no agent answers" in out.stderr and out.stdout == ""


def test_prometheus_exposition_is_per_peer_and_plane_by_default(h0_api):
    fab, mesh, api = h0_api
    mesh.run(0.5)
    text = cli_get(fab, api.port, "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("linkpass_probe_requests", "linkpass_probe_replies", "linkpass_probe_lost",
                 "linkpass_peer_loss_ratio", "linkpass_probe_rtt_seconds", "linkpass_peer_one_way_delay_p99_seconds",
                 "process_cpu_seconds", "process_resident_memory_bytes", "python_info"):
        assert name in families, sorted(families)
    assert not [n for n in families if n.startswith("linkpass_path_")], "per-path series without metrics.per_path"
    allowed = {"peer", "plane", "direction", "le", "reason", "kind", "result", "server", "outcome"}  # each a bounded set
    for fam in families.values():
        if fam.name.startswith("linkpass_"):
            for s in fam.samples:
                assert set(s.labels) <= allowed, (fam.name, s.labels)
    # 12 paths (3 peers x 2 planes x 2 ports): 6 series, each the sum of its plane's two paths
    reqs = [s for s in families["linkpass_probe_requests"].samples if s.name.endswith("_total")]
    assert len(reqs) == 6 and all(s.value > 100 for s in reqs)
    per_path = sum(r["sent"] for r in api.view.rows() if r["peer"] == "h1" and r["plane"] == 0)
    got = next(s.value for s in reqs if s.labels == {"peer": "h1", "plane": "0"})
    assert abs(got - per_path) <= 0.05 * per_path + 10  # probes keep going between the two reads
    buckets = [s for s in families["linkpass_probe_rtt_seconds"].samples if s.name.endswith("_bucket")]
    assert {b.labels["plane"] for b in buckets} == {"0", "1"} and all(b.labels["le"] for b in buckets)
    owd = families["linkpass_peer_one_way_delay_p99_seconds"].samples
    assert {(s.labels["peer"], s.labels["direction"]) for s in owd} >= {("h1", "forward"), ("h3", "reverse")}


def test_per_path_series_come_on_request(h0_api):
    fab, mesh, _ = h0_api
    mesh.run(0.5)
    view = TelemetryView(mesh.engines[0], labels_of(mesh), offset_ns=lambda peer: 0.0)
    api = LocalApi(view, netns=fab.netns("h0"), port=0, registry=metrics_registry(view, per_path=lambda: True))
    try:
        families = {f.name: f for f in text_string_to_metric_families(cli_get(fab, api.port, "/metrics"))}
    finally:
        api.close()
    reqs = [s for s in families["linkpass_path_probe_requests"].samples if s.name.endswith("_total")]
    assert len(reqs) == 12 and {s.labels["path"] for s in reqs} == {"0", "1"}
    assert "linkpass_path_rtt_seconds" in families and "linkpass_probe_requests" in families


def cli_get(fab, port, path):
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}{path}').read().decode())"
    out = subprocess.run(["ip", "netns", "exec", fab.netns("h0"), sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout
