"""The digest of an agent's path verdicts: what an agent sends now and then instead of its whole
table, and what the coordinator compares with the verdicts it holds for that agent. Pure.

An agent reports each verdict change once; a report lost on the way (a coordinator restart, a
refused answer, a network cut between the two) would leave the coordinator's copy wrong until
the agent's next full table. Full tables every few seconds from every agent were most of what
the coordinator ingested at fleet size; a digest is one short string per agent, and only an
agent whose digest does not match is asked for its table (`send_paths` in the answer).

The digest covers each path's id, state and reason: what reports change. A path added, removed
or re-routed (its peer, plane, port, hops) is the agent's own news: it sends the whole table then.

The digest is the sum, modulo 2^128, of a 128-bit hash of each row: the same for the rows in
any order, and kept as rows change (RunningDigest) at the cost of the rows that changed, so a
report's check costs the coordinator its changes, never a pass over the agent's whole table.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

DIGEST_CHARS = 32  # hex characters sent (128 bits: a chance match is never the explanation)
_MASK = (1 << 128) - 1


def row_hash(pid: int, state: str, reason: str | None) -> int:
    """One row's share of the digest."""
    return int.from_bytes(hashlib.blake2b(f"{pid}\t{state}\t{reason or ''}".encode(), digest_size=16).digest(),
                          "little")


def digest_of(total: int) -> str:
    """The digest text of a sum of row hashes."""
    return f"{total & _MASK:0{DIGEST_CHARS}x}"


def table_digest(rows: Iterable[tuple[int, str, str | None]]) -> str:
    """The digest of (path id, state, reason) rows, in any order; ids are unique per agent."""
    return digest_of(sum(row_hash(pid, state, reason) for pid, state, reason in rows))


class RunningDigest:
    """An agent's verdicts (path id -> (state, reason)) and their digest, kept as they change."""

    __slots__ = ("rows", "total")

    def __init__(self, rows: Iterable[tuple[int, str, str | None]] = ()):
        self.rows: dict[int, tuple[str, str | None]] = {}
        self.total = 0
        for pid, state, reason in rows:
            self.set(pid, state, reason)

    def __contains__(self, pid: int) -> bool:
        return pid in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, pid: int) -> tuple[str, str | None]:
        return self.rows[pid]

    def set(self, pid: int, state: str, reason: str | None) -> None:
        old = self.rows.get(pid)
        if old is not None:
            self.total -= row_hash(pid, *old)
        self.rows[pid] = (state, reason)
        self.total = (self.total + row_hash(pid, state, reason)) & _MASK

    def digest(self) -> str:
        return digest_of(self.total)

    def digest_after(self, changes: Iterable[tuple[int, str, str | None]]) -> str:
        """The digest once `changes` (rows of ids it holds; the last of an id wins) are applied,
        without applying them."""
        final = {pid: (state, reason) for pid, state, reason in changes}
        total = self.total
        for pid, row in final.items():
            total += row_hash(pid, *row) - row_hash(pid, *self.rows[pid])
        return digest_of(total)
