"""Timed drains (`linkpass drain --for`) and the history filtered by link or host: the drain ends
by itself at its time, recorded as the coordinator's with the original operator and reason; a
database made before timed drains is upgraded with its drains kept; bad durations are refused
naming the field."""
from __future__ import annotations

import sqlite3

import pytest

from linkpass.cli.drains import render_drain
from linkpass.cli.fleet import render_events
from linkpass.cli.times import parse_duration
from linkpass.coordinator.coordinator import Coordinator, CoordinatorConfig
from linkpass.control.errors import CoordinatorError
from linkpass.control.bodies import parse_drain, parse_events_query
from linkpass.coordinator.store import EVENT_KINDS, Store

from support.fleet import MODEL, fail_paths


def test_a_timed_drain_ends_by_itself_and_the_history_says_who_and_why(coord, tmp_path):
    v0 = coord.drain_version
    out = coord.drain("p0l0-p0s1", "optic swap", "alice", 1001.0, for_s=3600)
    assert out["changed"] and out["until"] == 4601.0
    assert "until" in render_drain(out, "drain") and "undrained by itself" in render_drain(out, "drain")
    coord.tick(4600.0)
    assert "p0l0-p0s1" in coord.drains  # not a second early
    coord.tick(4601.5)
    assert "p0l0-p0s1" not in coord.drains and coord.drain_version == v0 + 2 and coord.drain_addresses() == []
    undrain = [e for e in coord.store.events() if e["kind"] == "undrain"][-1]
    assert undrain["actor"] == "coordinator" and undrain["detail"]["drained_by"] == "alice"
    assert "drain --for ran out" in undrain["detail"]["note"] and "optic swap" in undrain["detail"]["note"]
    drain = [e for e in coord.store.events() if e["kind"] == "drain"][-1]
    assert drain["detail"]["for_s"] == 3600 and "for 60m" in render_events([drain])
    # a drain without --for stays until someone undrains it
    coord.drain("p1l0-p1s1", "bad port", "bob", 5000.0)
    coord.tick(5000.0 + 40 * 86400)
    assert "p1l0-p1s1" in coord.drains


def test_a_timed_drain_survives_a_restart_and_still_ends(coord, tmp_path):
    coord.drain("p0l0-p0s1", "optic swap", "alice", 1001.0, for_s=600)
    coord.store.close()
    store = Store(str(tmp_path / "c.db"))
    again = Coordinator(store, MODEL, CoordinatorConfig(max_drain_share=0.05), wall_s=1100.0)
    assert again.drains["p0l0-p0s1"]["until"] == 1601.0
    again.tick(1602.0)
    assert again.drains == {}
    store.close()


def test_a_database_from_before_timed_drains_is_upgraded_with_its_drains(tmp_path):
    path = tmp_path / "v2.db"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                     "INSERT INTO meta VALUES ('schema', '2');"
                     "CREATE TABLE drains (link TEXT PRIMARY KEY, reason TEXT NOT NULL, by TEXT NOT NULL,"
                     " since REAL NOT NULL);"
                     "INSERT INTO drains VALUES ('p0l0-p0s1', 'old drain', 'carol', 10.0);")
    db.close()
    s = Store(str(path))
    assert s.drains() == {"p0l0-p0s1": {"reason": "old drain", "by": "carol", "since": 10.0, "until": None}}
    assert s.get_meta("schema") == "3"
    s.close()


@pytest.mark.parametrize("value, words", [(30, "for_s: a timed drain lasts 60 s"), (31 * 86400, "30 days"),
                                          ("1h", "got '1h'"), (True, "got True"), (float("inf"), "got inf")])
def test_a_bad_duration_is_refused_naming_the_field(value, words):
    with pytest.raises(CoordinatorError, match=words):
        parse_drain({"link": "p0l0-p0s1", "reason": "x", "for_s": value})
    assert parse_drain({"link": "p0l0-p0s1", "reason": "x", "for_s": 600}).for_s == 600.0
    assert parse_drain({"link": "p0l0-p0s1", "reason": "x"}).for_s is None


def test_cli_durations():
    assert [parse_duration(t) for t in ("90s", "30m", "4h", "2d", "1.5h")] == [90, 1800, 14400, 172800, 5400]
    assert [parse_duration(t) for t in ("", "4", "h", "-1h", "1w", "²h")] == [None] * 6


def test_history_by_link_and_by_host(coord):
    coord.drain("p0l0-p0s1", "optic swap", "alice", 1001.0)
    fail_paths(coord, 1002.0, {"p1l0-p1s0:up", "p1l0-p1s0:down"})
    coord.relocalize(1002.0)
    by_link = coord.store.events(link="p0l0-p0s1")
    assert by_link and {e["subject"] for e in by_link} == {"p0l0-p0s1"}
    by_host = coord.store.events(host="h1")
    assert by_host and all(e["actor"] == "h1" or e["subject"] == "h1" or e["subject"].startswith("h1/")
                           for e in by_host)
    assert not any(e["subject"].startswith("h10/") for e in by_host)
    everything = coord.store.events()
    assert len(by_host) < len(everything) and len(by_link) < len(everything)
    q = parse_events_query({"link": "p0l0-p0s1", "host": "h1"}, EVENT_KINDS, 1000)
    assert (q.link, q.host) == ("p0l0-p0s1", "h1")
    with pytest.raises(CoordinatorError, match="host"):
        parse_events_query({"host": "../etc"}, EVENT_KINDS, 1000)
