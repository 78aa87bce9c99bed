"""What an agent reports to the coordinator next, decided from what it sent before. Pure: the
agent's link (agent/coordinator_link.py) sends the body and, once the coordinator took it,
marks what it carried as sent (`Report.sent`).

    the coordinator asked for the table (send_paths)           the whole table
    summary due, and paths added, removed or re-routed         the whole table (a digest covers
      since the last table (or the coordinator takes no           states only)
      digests)
    otherwise: states or reasons changed since last sent       those changes
               summary due                                     + the digest of every verdict
               nothing changed, no summary, no budget change,  nothing (None): the link waits
                 heartbeat not due
    the probe budget differs from the one last sent            + probe_budget (with any of the above)

A path's *mark* (state, reason) is what a change report carries; its *layout* (peer, plane,
port, hops, peer address) is what only a whole table tells the coordinator.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..core.report_digest import table_digest


def mark(row: dict) -> tuple:
    """What of a path a change report carries."""
    return row["state"], row["reason"]


def layout(row: dict) -> tuple:
    """What of a path only a whole table tells the coordinator (a digest covers the rest)."""
    return row["peer"], row["plane"], row["sport"], tuple(row["hops"] or ()), row["peer_addr"]


@dataclass(frozen=True)
class Report:
    """A report to send: its body beyond the versions, and what it carries."""
    body: dict
    sent: tuple[dict, ...]  # rows whose marks it carries: marked sent once the coordinator took it
    whole: bool  # the whole table (then `layout` is the layout sent)
    layout: dict
    digest: bool
    summary: bool  # the summary (table or digest) went: its clock starts again
    budget: dict | None  # the probe budget it carries, if any


def next_report(rows: list[dict], sent_marks: Mapping[int, tuple], sent_layout: Mapping[int, tuple], *,
                send_table: bool, digests: bool, summary_due: bool, heartbeat_due: bool,
                budget: dict | None, budget_sent: dict | None) -> Report | None:
    """The next report (module doc's table), or None when there is nothing to send yet."""
    changes = [r for r in rows if sent_marks.get(r["id"]) != mark(r)]
    laid = {r["id"]: layout(r) for r in rows}
    body: dict = {}
    whole = send_table or (summary_due and (not digests or laid != sent_layout))
    if whole:
        body["paths"] = rows
    else:
        if changes:
            body["changes"] = [{"id": r["id"], "state": r["state"], "reason": r["reason"]} for r in changes]
        if summary_due:
            body["digest"] = table_digest((r["id"], r["state"], r["reason"]) for r in rows)
        elif not changes and not heartbeat_due and budget == budget_sent:
            return None
    carried = budget is not None and budget != budget_sent
    if carried:
        body["probe_budget"] = budget  # a reload changed it: the coordinator re-plans
    return Report(body, tuple(rows if whole else changes), whole, laid, "digest" in body, whole or summary_due,
                  budget if carried else None)
