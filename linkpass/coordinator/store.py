"""The coordinator's memory in SQLite: events, drains, agent inventory, last path verdicts, and
the lowest agent-token epoch each revoked host accepts.

Everything the coordinator knows that agents cannot simply tell it again lives here, so a
restarted coordinator (a new Ray actor process, or a new host) picks up where the last one
stopped. Path verdicts are stored too: a restarted coordinator shows the fleet at once instead of
waiting for every agent's next summary. Revocations are stored so that they outlive a restart;
`linkpass coordinator token HOST --revoke` writes them from another process on the coordinator's
host (SQLite serialises the two writers), and the running coordinator reads them every tick.

WAL mode with synchronous=NORMAL: a committed transaction survives the process being killed (the
failure this store is for); only a power loss can drop the last few. What one request writes is
one transaction (`transaction()`), so a kill leaves a request's writes all there or none. One
connection, used under the caller's lock (the coordinator serialises calls).
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from typing import Any, Callable, Iterable

DB_FILE = "coordinator.db"  # in the state directory
SCHEMA_VERSION = 3  # 2: agent_epochs; 3: drains.until (older databases are upgraded in place)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,            -- unix seconds
    kind TEXT NOT NULL,          -- one of EVENT_KINDS
    actor TEXT NOT NULL,         -- who: agent name, caller name, or "coordinator"
    subject TEXT NOT NULL,       -- what: a link, a path key, a host
    detail TEXT NOT NULL         -- JSON: why and the rest
);
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
CREATE TABLE IF NOT EXISTS drains (
    link TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    by TEXT NOT NULL,
    since REAL NOT NULL,
    until REAL                   -- a timed drain (`drain --for`) ends by itself then; NULL: until undrained
);
CREATE TABLE IF NOT EXISTS agents (
    name TEXT PRIMARY KEY,
    agent_id INTEGER NOT NULL,
    info TEXT NOT NULL,          -- JSON: service, nics, version, api port
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS paths (
    key TEXT PRIMARY KEY,        -- reporter/path id
    reporter TEXT NOT NULL,
    info TEXT NOT NULL,          -- JSON: peer, plane, sport, hops, peer_addr
    state TEXT NOT NULL,
    reason TEXT,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS agent_epochs (
    host TEXT PRIMARY KEY,
    min_epoch INTEGER NOT NULL,  -- agent tokens of this host below this epoch are refused
    since REAL NOT NULL,
    by TEXT NOT NULL,
    reason TEXT NOT NULL
);
"""


EVENT_KINDS = ("detection", "recovery", "localization", "cleared", "drain", "undrain", "refused", "agent",
               "coordinator")


class StoreError(RuntimeError):
    pass


class Store:
    def __init__(self, path: str, on_committed: Callable[[list[tuple]], None] | None = None):
        """`on_committed(events)`: called with the events of each transaction once it has committed
        (never for one rolled back): what the coordinator's log shows of its history."""
        self.path = path
        self.on_committed = on_committed
        self._uncommitted: list[tuple] = []  # events of the open transaction
        self._data_version: int | None = None  # written_elsewhere's last look
        self._tx_depth = 0  # transactions open on the connection (an inner one joins the outer)
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: cannot open the coordinator database ({exc}); move it aside to start "
                             "afresh (history is lost) or restore a backup") from None
        row = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None or row[0] in ("1", "2"):
            # version 1 lacks agent_epochs, which the script above made, and versions 1 and 2 the
            # drains' until column, added here; an older coordinator then refuses this database
            # rather than accept tokens revoked here or keep a timed drain for ever
            if "until" not in {r[1] for r in self.db.execute("PRAGMA table_info(drains)")}:
                self.db.execute("ALTER TABLE drains ADD COLUMN until REAL")
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif row[0] != str(SCHEMA_VERSION):
            raise StoreError(f"{path}: schema version {row[0]}, this coordinator reads {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    # ---- events ------------------------------------------------------------------------
    def add_events(self, events: Iterable[tuple[float, str, str, str, dict]]) -> None:
        events = list(events)
        rows = [(ts, kind, actor, subject, json.dumps(detail, sort_keys=True)) for ts, kind, actor, subject, detail in events]
        if rows:
            with self._tx():
                self.db.executemany("INSERT INTO events (ts, kind, actor, subject, detail) VALUES (?,?,?,?,?)", rows)
                if self.on_committed is not None:
                    self._uncommitted.extend(events)

    def event(self, kind: str, actor: str, subject: str, **detail) -> None:
        self.add_events([(time.time(), kind, actor, subject, detail)])

    def events(self, since: float = 0.0, after_id: int = 0, limit: int = 1000, kinds: Iterable[str] | None = None,
               link: str | None = None, host: str | None = None) -> list[dict]:
        """The newest `limit` events matching, oldest first. `link`: about that link; `host`: by that
        host (its agent) or about it or one of its paths (subject `host/<path id>`)."""
        q = "SELECT id, ts, kind, actor, subject, detail FROM events WHERE ts >= ? AND id > ?"
        args: list[Any] = [since, after_id]
        kinds = list(kinds or ())
        if kinds:
            q += f" AND kind IN ({','.join('?' * len(kinds))})"
            args += kinds
        if link:
            q += " AND subject = ?"
            args.append(link)
        if host:
            q += " AND (actor = ? OR subject = ? OR substr(subject, 1, ?) = ?)"
            args += [host, host, len(host) + 1, host + "/"]
        # the newest `limit`, returned oldest first
        q = f"SELECT * FROM ({q} ORDER BY id DESC LIMIT ?) ORDER BY id"
        args.append(limit)
        return [{"id": i, "ts": ts, "kind": k, "actor": a, "subject": s, "detail": json.loads(d)}
                for i, ts, k, a, s, d in self.db.execute(q, args)]

    def prune_events(self, before_ts: float, keep: int) -> int:
        """Retention: delete events older than `before_ts`, then all but the newest `keep`;
        returns how many went."""
        with self._tx():
            n = self.db.execute("DELETE FROM events WHERE ts < ?", (before_ts,)).rowcount
            row = self.db.execute("SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?", (keep,)).fetchone()
            if row is not None:
                n += self.db.execute("DELETE FROM events WHERE id <= ?", (row[0],)).rowcount
        return n

    def event_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM events").fetchone()[0]

    # ---- drains ------------------------------------------------------------------------
    def set_drain(self, link: str, reason: str, by: str, since: float, until: float | None = None) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO drains (link, reason, by, since, until) VALUES (?,?,?,?,?)",
                            (link, reason, by, since, until))

    def clear_drain(self, link: str) -> None:
        with self._tx():
            self.db.execute("DELETE FROM drains WHERE link=?", (link,))

    def drains(self) -> dict[str, dict]:
        return {lk: {"reason": r, "by": b, "since": s, "until": u}
                for lk, r, b, s, u in self.db.execute("SELECT link, reason, by, since, until FROM drains")}

    # ---- agents ------------------------------------------------------------------------
    def upsert_agent(self, name: str, agent_id: int, info: dict, now: float) -> None:
        with self._tx():
            self.db.execute("INSERT INTO agents VALUES (?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET "
                            "agent_id=excluded.agent_id, info=excluded.info, last_seen=excluded.last_seen",
                            (name, agent_id, json.dumps(info, sort_keys=True), now, now))

    def touch_agents(self, seen: dict[str, float]) -> None:
        if seen:
            with self._tx():
                self.db.executemany("UPDATE agents SET last_seen=? WHERE name=?", [(t, n) for n, t in seen.items()])

    def forget_agent(self, name: str) -> None:
        """Decommission: the agent and the paths it reported."""
        with self._tx():
            self.db.execute("DELETE FROM agents WHERE name=?", (name,))
            self.db.execute("DELETE FROM paths WHERE reporter=?", (name,))

    def agents(self) -> dict[str, dict]:
        return {n: {"agent_id": i, **json.loads(info), "first_seen": f, "last_seen": ls}
                for n, i, info, f, ls in self.db.execute("SELECT * FROM agents")}

    # ---- paths -------------------------------------------------------------------------
    def put_paths(self, rows: Iterable[tuple[str, str, dict, str, str | None, float]]) -> None:
        rows = [(k, r, json.dumps(i, sort_keys=True), s, rsn, t) for k, r, i, s, rsn, t in rows]
        if rows:
            with self._tx():
                self.db.executemany("INSERT OR REPLACE INTO paths VALUES (?,?,?,?,?,?)", rows)

    def put_states(self, rows: Iterable[tuple[str, str | None, float, str]]) -> None:
        """(state, reason, updated, key) for paths already stored."""
        rows = list(rows)
        if rows:
            with self._tx():
                self.db.executemany("UPDATE paths SET state=?, reason=?, updated=? WHERE key=?", rows)

    def drop_paths(self, reporter: str, keep: Iterable[str] = ()) -> None:
        keep = set(keep)
        with self._tx():
            for (k,) in self.db.execute("SELECT key FROM paths WHERE reporter=?", (reporter,)).fetchall():
                if k not in keep:
                    self.db.execute("DELETE FROM paths WHERE key=?", (k,))

    def paths(self) -> list[dict]:
        return [{"key": k, "reporter": r, **json.loads(i), "state": s, "reason": rsn, "updated": t}
                for k, r, i, s, rsn, t in self.db.execute("SELECT * FROM paths")]

    # ---- agent token epochs ------------------------------------------------------------
    def written_elsewhere(self) -> bool:
        """Whether another connection (another process: the CLI revoking a token) committed since
        the last call; the first call says True. Costs a pragma, not a read of any table."""
        version = self.db.execute("PRAGMA data_version").fetchone()[0]
        changed, self._data_version = version != self._data_version, version
        return changed

    def agent_epochs(self) -> dict[str, int]:
        """host -> the lowest agent-token epoch accepted, for every host ever revoked."""
        return dict(self.db.execute("SELECT host, min_epoch FROM agent_epochs"))

    def revoke_agent(self, host: str, by: str, reason: str, now: float, max_epoch: int) -> int:
        """Refuse every agent token of `host` issued so far: its lowest accepted epoch goes up by
        one, with an event saying who and why, in one transaction. Returns the new epoch."""
        with self._tx(immediate=True):  # read and raise under the write lock: two revokes make two epochs
            row = self.db.execute("SELECT min_epoch FROM agent_epochs WHERE host=?", (host,)).fetchone()
            epoch = (row[0] if row else 0) + 1
            if epoch > max_epoch:
                raise StoreError(f"{host}: its agent tokens were revoked {epoch - 1} times, the most there can be; "
                                 "rotate the agent secret instead (docs/security.md, Revocation)")
            self.db.execute("INSERT OR REPLACE INTO agent_epochs VALUES (?,?,?,?,?)", (host, epoch, now, by, reason))
            self.db.execute("INSERT INTO events (ts, kind, actor, subject, detail) VALUES (?,?,?,?,?)",
                            (now, "agent", by, host, json.dumps({"what": "token revoked", "epoch": epoch,
                                                                 "reason": reason}, sort_keys=True)))
        return epoch

    # ---- meta --------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, value))

    def transaction(self) -> "_Tx":
        """Several writes that commit together or not at all: what one request changes, so a
        process killed between them leaves none, and the client's retry finds nothing half done
        (a retried change that found its state stored would write no event). Writes inside join
        it; an exception that leaves the outermost rolls all of them back."""
        return _Tx(self)

    def _tx(self, immediate: bool = False) -> "_Tx":
        return _Tx(self, immediate)


class _Tx:
    """BEGIN ... COMMIT, or ROLLBACK on an exception (autocommit connection); inside another, it
    is part of that one. `immediate`: take the write lock at BEGIN, for a read-then-write that
    another process may run at once."""

    def __init__(self, store: Store, immediate: bool = False):
        self.store = store
        self.begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    def __enter__(self):
        if self.store._tx_depth == 0:
            self.store.db.execute(self.begin)
        self.store._tx_depth += 1

    def __exit__(self, exc_type, *_):
        self.store._tx_depth -= 1
        if self.store._tx_depth == 0:
            self.store.db.execute("ROLLBACK" if exc_type else "COMMIT")
            done, self.store._uncommitted = self.store._uncommitted, []
            if done and not exc_type and self.store.on_committed is not None:
                self.store.on_committed(done)
