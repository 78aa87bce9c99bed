"""The digest of an agent's path verdicts: what an agent sends now and then instead of its whole
table, and what the coordinator compares with the verdicts it holds for that agent. Pure.

An agent reports each verdict change once; a report lost on the way (a coordinator restart, a
refused answer, a network cut between the two) would leave the coordinator's copy wrong until
the agent's next full table. Full tables every few seconds from every agent were most of what
the coordinator ingested at fleet size; a digest is one short string per agent, and only an
agent whose digest does not match is asked for its table (`send_paths` in the answer).

The digest covers each path's id, state and reason: what reports change. A path added, removed
or re-routed (its peer, plane, port, hops) is the agent's own news: it sends the whole table then.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

DIGEST_CHARS = 32  # hex characters sent (128 bits: a chance match is never the explanation)


def table_digest(rows: Iterable[tuple[int, str, str | None]]) -> str:
    """The digest of (path id, state, reason) rows, in any order; ids are unique per agent."""
    h = hashlib.sha256()
    for pid, state, reason in sorted(rows, key=lambda r: r[0]):
        h.update(f"{pid}\t{state}\t{reason or ''}\n".encode())
    return h.hexdigest()[:DIGEST_CHARS]
