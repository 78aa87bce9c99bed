"""What an agent reports next (control/reports.py): every row of the module's table."""
from __future__ import annotations

import pytest

from linkpass.control.reports import layout, mark, next_report
from linkpass.core.report_digest import table_digest


def row(pid: int, state: str = "up", reason: str | None = None, hops=("r1",)) -> dict:
    return {"id": pid, "state": state, "reason": reason, "peer": "h1", "plane": pid % 2, "sport": 49152 + pid,
            "hops": list(hops), "peer_addr": "198.18.64.2"}


ROWS = [row(1), row(2)]
SENT = {r["id"]: mark(r) for r in ROWS}
LAID = {r["id"]: layout(r) for r in ROWS}
BUDGET = {"pps": 1000, "idle_interval_ms": 100.0}


def report(rows=ROWS, sent=SENT, laid=LAID, **kw):
    args = dict(send_table=False, digests=True, summary_due=False, heartbeat_due=False, budget=BUDGET,
                budget_sent=BUDGET)
    return next_report(rows, sent, laid, **{**args, **kw})


def test_nothing_changed_and_nothing_due_sends_nothing():
    assert report() is None


def test_a_heartbeat_is_an_empty_report():
    r = report(heartbeat_due=True)
    assert r.body == {} and r.sent == () and not r.whole and not r.summary and not r.digest


def test_changed_states_go_as_changes_and_only_they_are_marked_sent():
    rows = [row(1, "down", "hard_failure"), row(2)]
    r = report(rows)
    assert r.body == {"changes": [{"id": 1, "state": "down", "reason": "hard_failure"}]}
    assert [x["id"] for x in r.sent] == [1] and not r.whole and not r.summary


def test_a_summary_sends_the_digest_with_any_changes():
    rows = [row(1, "down", "hard_failure"), row(2)]
    r = report(rows, summary_due=True)
    assert r.body["digest"] == table_digest((x["id"], x["state"], x["reason"]) for x in rows)
    assert r.body["changes"] == [{"id": 1, "state": "down", "reason": "hard_failure"}]
    assert r.digest and r.summary and not r.whole


@pytest.mark.parametrize("rows", [[row(1, hops=("r9",)), row(2)], [row(1)], [row(1), row(2), row(3)]],
                         ids=["re-routed", "removed", "added"])
def test_a_summary_sends_the_whole_table_when_the_layout_changed(rows):
    r = report(rows, summary_due=True)
    assert r.body == {"paths": rows} and r.whole and r.summary and not r.digest
    assert r.layout == {x["id"]: layout(x) for x in rows} and list(r.sent) == rows


def test_a_layout_change_waits_for_the_summary():
    rows = [row(1, hops=("r9",)), row(2)]
    assert report(rows) is None


def test_the_table_goes_whole_when_the_coordinator_asked_whatever_is_due():
    r = report(send_table=True)
    assert r.body == {"paths": ROWS} and r.whole and r.summary


def test_a_coordinator_without_digests_gets_the_whole_table_at_each_summary():
    r = report(summary_due=True, digests=False)
    assert r.whole and "digest" not in r.body


def test_a_changed_probe_budget_goes_alone_and_is_marked_sent():
    fresh = {"pps": 500, "idle_interval_ms": 100.0}
    r = report(budget=fresh)
    assert r.body == {"probe_budget": fresh} and r.budget == fresh


def test_an_unchanged_or_absent_budget_is_not_sent():
    assert report(heartbeat_due=True).budget is None
    r = report(heartbeat_due=True, budget=None, budget_sent=None)
    assert "probe_budget" not in r.body and r.budget is None
