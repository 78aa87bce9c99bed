"""The coordinator commands' output (status, links, paths HOST, events, drain) against golden
files, from documents a real Coordinator produced, with colour off; and their exit codes.

Regenerate after an intended change: LINKPASS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_fleet_cli.py
"""
from __future__ import annotations

import json

import pytest

from linkpass.cli import fleet as fleet_cli
from linkpass.cli import drains as drains_cli, times as times_cli
from linkpass.cli.coordinator_client import Usage
from linkpass.coordinator.coordinator import Coordinator, CoordinatorConfig
from linkpass.coordinator.store import Store

from support.fleet import MODEL, fail_paths, identity, table_of
from support.golden import check_golden


NOW = 1_796_000_000.0


@pytest.fixture
def fleet_with_a_fault(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, MODEL, CoordinatorConfig(), wall_s=NOW - 3600)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, NOW - 3600)
    c.drain("h2-p1l1", "replace optic, ticket NET-1234", "alice", NOW - 600)
    fail_paths(c, NOW - 60, {"h1-p0l0:up", "h1-p0l0:down"})
    c.relocalize(NOW - 60)
    yield c
    store.close()


def test_status_golden(fleet_with_a_fault):
    doc = json.loads(json.dumps(fleet_with_a_fault.status(NOW)))
    check_golden("status_table.txt", fleet_cli.render_status(doc, NOW) + "\n")
    check_golden("status_wide.txt", fleet_cli.render_status(doc, NOW, wide=True) + "\n")
    assert doc["health"] == "critical"


def test_links_golden_and_exit(fleet_with_a_fault):
    rows = fleet_with_a_fault.links()
    check_golden("links_table.txt", fleet_cli.render_links(rows, NOW) + "\n")
    check_golden("links_wide.txt", fleet_cli.render_links(rows, NOW, wide=True) + "\n")
    assert fleet_cli.links_exit(rows) == 2
    assert fleet_cli.links_exit([r for r in rows if r["health"] != "faulty"]) == 1  # a drain is a warning
    assert fleet_cli.links_exit([r for r in rows if r["health"] == "ok"]) == 0


def test_paths_golden(fleet_with_a_fault):
    rows = fleet_with_a_fault.path_rows("h1", "h2")
    check_golden("paths_host_table.txt", fleet_cli.render_paths(rows, NOW) + "\n")
    check_golden("paths_host_wide.txt", fleet_cli.render_paths(rows, NOW, wide=True) + "\n")


def test_events_golden(fleet_with_a_fault):
    rows = [dict(e, ts=NOW - 100 + i) for i, e in enumerate(fleet_with_a_fault.store.events(kinds=["drain", "localization", "refused"]))]
    check_golden("events_table.txt", fleet_cli.render_events(rows) + "\n")


def test_drain_what_if_golden(fleet_with_a_fault):
    doc = json.loads(json.dumps(fleet_with_a_fault.drain("p0l0-p0s1", "maintenance", "bob", NOW, dry_run=True)))
    check_golden("drain_dry_run.txt", drains_cli.render_drain(doc, "drain") + "\n")
    fleet_with_a_fault.drain("p0l0-p0s1", "maintenance", "bob", NOW)
    doc = json.loads(json.dumps(fleet_with_a_fault.drain("p0l1-p0s0", "more", "bob", NOW, dry_run=True)))
    text = drains_cli.render_drain(doc, "drain")
    check_golden("drain_refused.txt", text + "\n")
    assert "REFUSED: blast-radius guard" in text


@pytest.mark.parametrize("text,ago", [("30s", 30), ("15m", 900), ("2h", 7200), ("7d", 604800)])
def test_since(text, ago):
    assert times_cli.parse_since(text, NOW) == NOW - ago


def test_since_iso_and_garbage():
    assert times_cli.parse_since("2026-11-30T14:00", NOW) == 1796047200.0
    with pytest.raises(Usage, match="use 30s, 15m"):
        times_cli.parse_since("yesterday", NOW)
    with pytest.raises(Usage, match="use 30s, 15m"):
        times_cli.parse_since("²m", NOW)  # a Unicode digit float() refuses
