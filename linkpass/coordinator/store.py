"""The coordinator's memory: events, drains, agent inventory, last path verdicts, and the lowest
agent-token epoch each revoked host accepts; in SQLite (a file in the state directory, the
default) or PostgreSQL (a server any node of a Ray cluster reaches, so an actor Ray restarts
elsewhere finds its state).

Everything the coordinator knows that agents cannot simply tell it again lives here, so a
restarted coordinator (a new Ray actor process, or a new host) picks up where the last one
stopped. Path verdicts are stored too: a restarted coordinator shows the fleet at once instead of
waiting for every agent's next summary. Revocations are stored so that they outlive a restart;
`linkpass coordinator token HOST --revoke` writes them from another process on the coordinator's
host (SQLite serialises the two writers), and the running coordinator reads them every tick.

SQLite in WAL mode with synchronous=NORMAL: a committed transaction survives the process being
killed (the failure this store is for); only a power loss can drop the last few. PostgreSQL:
a commit is durable when it returns. What one request writes is one transaction
(`transaction()`), so a kill leaves a request's writes all there or none. One connection, used
under the caller's lock (the coordinator serialises calls). Both backends run the same queries
(`?` placeholders, upserts by ON CONFLICT); only connecting, the schema's column types, the
write lock of a read-then-write, and `written_elsewhere` differ (`_Sqlite`, `_Postgres`).
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import ssl
import struct
import time
import urllib.parse
from typing import Any, Callable, Iterable, NamedTuple

DB_FILE = "coordinator.db"  # in the state directory
SCHEMA_VERSION = 3  # 2: agent_epochs; 3: drains.until (older databases are upgraded in place)

POSTGRES_SCHEME = "postgresql://"
# every transaction that reads and then writes under the write lock takes this advisory lock on
# PostgreSQL (SQLite: BEGIN IMMEDIATE); the number is LinkPass's own, in no other table
_PG_WRITE_LOCK = 0x4C50_5354

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id {serial},
    ts {real} NOT NULL,            -- unix seconds
    kind TEXT NOT NULL,          -- one of EVENT_KINDS
    actor TEXT NOT NULL,         -- who: agent name, caller name, or "coordinator"
    subject TEXT NOT NULL,       -- what: a link, a path key, a host
    detail TEXT NOT NULL         -- JSON: why and the rest
);
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
CREATE INDEX IF NOT EXISTS events_kind ON events (kind, id);  -- retention keeps detections apart
CREATE TABLE IF NOT EXISTS drains (
    link TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    by TEXT NOT NULL,
    since {real} NOT NULL,
    until {real}                   -- a timed drain (`drain --for`) ends by itself then; NULL: until undrained
);
CREATE TABLE IF NOT EXISTS agents (
    name TEXT PRIMARY KEY,
    agent_id INTEGER NOT NULL,
    info TEXT NOT NULL,          -- JSON: service, nics, version, api port
    first_seen {real} NOT NULL,
    last_seen {real} NOT NULL
);
CREATE TABLE IF NOT EXISTS paths (
    key TEXT PRIMARY KEY,        -- reporter/path id
    reporter TEXT NOT NULL,
    info TEXT NOT NULL,          -- JSON: peer, plane, sport, hops, peer_addr
    state TEXT NOT NULL,
    reason TEXT,
    updated {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS paths_reporter ON paths (reporter);  -- a whole table replaces its reporter's rows
CREATE TABLE IF NOT EXISTS agent_epochs (
    host TEXT PRIMARY KEY,
    min_epoch INTEGER NOT NULL,  -- agent tokens of this host below this epoch are refused
    since {real} NOT NULL,
    by TEXT NOT NULL,
    reason TEXT NOT NULL
);
"""


EVENT_KINDS = ("detection", "recovery", "localization", "cleared", "drain", "undrain", "refused", "agent",
               "coordinator")
CHURN_KINDS_SQL = "kind IN ('detection', 'recovery')"  # what agents' path changes write: retained apart


class StoreError(RuntimeError):
    pass


def _statements(sql: str) -> list[str]:
    """A schema script's statements, one each (comments may hold a ';')."""
    lines = [line.split("--", 1)[0] for line in sql.splitlines()]
    return [stmt for stmt in "\n".join(lines).split(";") if stmt.strip()]


class _Sqlite:
    """A file (or ":memory:"); the default, in the coordinator's state directory."""

    kind = "sqlite"
    types = {"serial": "INTEGER PRIMARY KEY AUTOINCREMENT", "real": "REAL"}

    def __init__(self, path: str):
        self.where = path
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: cannot open the coordinator database ({exc}); move it aside to start "
                             "afresh (history is lost) or restore a backup") from None

    def execute(self, q: str, args=()):
        return self.db.execute(q, args)

    def executemany(self, q: str, rows) -> None:
        self.db.executemany(q, rows)

    def script(self, sql: str) -> None:
        try:
            for stmt in _statements(sql):  # not executescript: it would commit the open transaction
                self.db.execute(stmt)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.where}: cannot open the coordinator database ({exc}); move it aside to start "
                             "afresh (history is lost) or restore a backup") from None

    def begin(self, immediate: bool) -> None:
        self.db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}

    def end(self) -> None:
        pass

    def version(self) -> Any:
        """Changes when another connection commits (not for this one's own commits); a pragma."""
        return self.db.execute("PRAGMA data_version").fetchone()[0]

    def close(self) -> None:
        self.db.close()


class _Postgres:
    """A PostgreSQL server, `postgresql://USER@HOST[:PORT]/DATABASE`, its password from a file.

    Reached over TLS with the server's certificate verified and its name checked against the
    URL's host (libpq's sslmode=verify-full): `tls` is the context to verify with (None: the
    system's trust store), or False for no TLS at all, which only store_insecure_plaintext asks
    for. The user authenticates with SCRAM-SHA-256 only (`_scram_only`): a server that asks for
    the password in cleartext or as MD5, or lets the user in without a password, is refused
    before anything of the password is sent."""

    kind = "postgresql"
    types = {"serial": "BIGSERIAL PRIMARY KEY", "real": "DOUBLE PRECISION"}

    def __init__(self, url: str, password: str | None, tls: ssl.SSLContext | None | bool = None):
        import pg8000.dbapi  # only a coordinator that uses PostgreSQL needs the driver

        self._pg = pg8000.dbapi
        self._connection = _scram_only(pg8000.dbapi)
        self.params = parse_postgres_url(url)
        self.password = password
        self.tls = ssl.create_default_context() if tls is None else tls
        self.where = redacted(url)
        self.in_tx = False
        self.db = None
        self._connect()

    def _socket(self) -> socket.socket:
        """A connection to the server, over TLS unless self.tls is False. The TLS request is made
        here rather than by the driver, so that nothing but verified TLS (or plaintext asked for
        by name) ever carries the startup message."""
        host, port = self.params["host"], self.params["port"]
        sock = socket.create_connection((host, port), timeout=_PG_TIMEOUT_S)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self.tls is False:
                return sock
            sock.sendall(struct.pack("!ii", 8, _PG_SSL_REQUEST))
            answer = sock.recv(1)
            if not answer:
                raise ConnectionError("the server closed the connection at the TLS request")
            if answer != b"S":  # "N": no TLS here
                raise _Refused("the server does not offer TLS (ssl = off in its postgresql.conf); the coordinator "
                               "reaches PostgreSQL over verified TLS only: turn TLS on at the server (ssl = on, with "
                               "a certificate naming the URL's host) and give its CA in store_tls_ca_file "
                               "(--store-tls-ca; without it the system's trust store is used), or, on a network "
                               "that is yours alone, set store_insecure_plaintext (--store-insecure-plaintext)")
            return self.tls.wrap_socket(sock, server_hostname=host)  # the context checks the name
        except BaseException:
            sock.close()
            raise

    def _connect(self) -> None:
        sock = None
        try:
            sock = self._socket()
            # the driver is handed the connection made above and adds no TLS of its own
            self.db = self._connection(**self.params, password=self.password, sock=sock, ssl_context=_pg_no_tls(),
                                       application_name="linkpass-coordinator")
            if self.db.linkpass_auth != "scram":  # a driver that bypassed _scram_only's check
                self.db.close()
                raise _Refused("the PostgreSQL driver (pg8000) did not let the coordinator check how it "
                               "authenticates; install the pg8000 of the coordinator extra")
        except BaseException as exc:
            self.db = None
            if sock is not None:
                sock.close()
            refused = _refusal(exc)
            if refused is not None:
                raise StoreError(f"{self.where}: refused to connect to the coordinator's PostgreSQL store: "
                                 f"{refused}") from None
            if isinstance(exc, ssl.SSLCertVerificationError):
                raise StoreError(f"{self.where}: the PostgreSQL server's TLS certificate is not trusted "
                                 f"({exc.verify_message}): it must be signed by the CA of store_tls_ca_file "
                                 "(--store-tls-ca; without it the system's trust store) and name the URL's host "
                                 f"{self.params['host']}") from None
            if not isinstance(exc, (self._pg.Error, OSError)):
                raise
            tls = "" if self.tls is False else (" and its certificate is signed by the CA of store_tls_ca_file "
                                                "for the URL's host name")
            raise StoreError(f"{self.where}: cannot connect to the coordinator's PostgreSQL store ({_pg_message(exc)}); "
                             "check the server runs and is reachable from this node, the user and database "
                             f"exist, store_password_file holds that user's password{tls}") from None
        self.db.autocommit = True  # transactions are the explicit BEGIN ... COMMIT of _Tx

    def execute(self, q: str, args=()):
        """One statement. A connection the server dropped (a restart, a failover) is made again:
        at once for a statement outside a transaction, which is then run again; inside one the
        transaction is lost, so the statement fails and the next transaction reconnects."""
        for attempt in (0, 1):
            if self.db is None:
                self._connect()
            try:
                cur = self.db.cursor()
                cur.execute(q.replace("?", "%s"), tuple(args))
                return cur
            except (self._pg.InterfaceError, OSError) as exc:
                self.close()
                self.db = None
                if self.in_tx or attempt:
                    self.in_tx = False
                    raise StoreError(f"{self.where}: lost the connection to the PostgreSQL store ({_pg_message(exc)}); "
                                     "this change was not stored, the next one reconnects") from None
        raise AssertionError("unreachable")

    def executemany(self, q: str, rows) -> None:
        for row in rows:  # one round trip each: pg8000's executemany does the same
            self.execute(q, row)

    def script(self, sql: str) -> None:
        for stmt in _statements(sql):
            self.execute(stmt)

    def begin(self, immediate: bool) -> None:
        self.execute("BEGIN")
        self.in_tx = True
        if immediate:  # until COMMIT or ROLLBACK: two coordinators' or CLIs' read-then-writes queue
            self.execute("SELECT pg_advisory_xact_lock(?)", (_PG_WRITE_LOCK,))

    def columns(self, table: str) -> set[str]:
        return {r[0] for r in self.execute("SELECT column_name FROM information_schema.columns "
                                           "WHERE table_schema = current_schema() AND table_name = ?", (table,))}

    def version(self) -> Any:
        """Changes when a revocation is written (all that other processes write here): epochs
        only rise and hosts are only added, so the count and the sum say it in one small read."""
        return tuple(self.execute("SELECT COUNT(*), COALESCE(SUM(min_epoch), 0) FROM agent_epochs").fetchone())

    def end(self) -> None:
        self.in_tx = False

    def close(self) -> None:
        try:
            if self.db is not None:
                self.db.close()
        except (self._pg.Error, OSError):
            pass  # a connection the server already dropped


_PG_TIMEOUT_S = 30  # connecting, and every read and write after
_PG_SSL_REQUEST = 80877103  # the protocol's SSLRequest code

# what a PostgreSQL server may ask for (AuthenticationRequest codes); the coordinator answers SASL
# with SCRAM-SHA-256 and nothing else
_AUTH_OK, _AUTH_CLEARTEXT, _AUTH_MD5, _AUTH_SASL, _AUTH_SASL_CONTINUE, _AUTH_SASL_FINAL = 0, 3, 5, 10, 11, 12
_SCRAM = ("SCRAM-SHA-256", "SCRAM-SHA-256-PLUS")  # -PLUS: bound to the TLS channel
_SCRAM_ONLY = ("the coordinator authenticates with SCRAM-SHA-256 only and sent nothing of the password: on the "
               "server set password_encryption = scram-sha-256, set the user's password again (so that it is "
               "stored as SCRAM) and give the user the method scram-sha-256 in pg_hba.conf")


class _Refused(Exception):
    """What the server asked for is not what the coordinator does; nothing more was sent."""


def _refusal(exc: BaseException | None) -> _Refused | None:
    """The refusal behind `exc`: the driver may wrap it in an error of its own while it closes."""
    for _ in range(8):
        if exc is None or isinstance(exc, _Refused):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _pg_no_tls() -> Any:
    """pg8000's ssl_context for "add no TLS" to a socket it is given: False since pg8000 1.31
    (None there means "try TLS"), None before (where False is no value)."""
    import pg8000

    try:
        version = tuple(int(x) for x in pg8000.__version__.split(".")[:2])
    except (AttributeError, ValueError):
        version = (1, 31)
    return False if version >= (1, 31) else None


_SCRAM_ONLY_CLASS: dict = {}


def _scram_only(dbapi) -> type:
    """pg8000's connection, answering the server's authentication requests with SCRAM-SHA-256
    only. pg8000 itself answers a request for the password in cleartext (AuthenticationCleartext-
    Password) or as an MD5 hash (AuthenticationMD5Password) by sending it, which a server that
    is not the real one (or a server set up so) would read; here such a request is refused
    before anything is sent, and so is a server that lets the user in without a SCRAM exchange
    (its end of which proves it knows the password). `linkpass_auth` is "scram" once the
    exchange completed and the server proved itself."""
    if "class" in _SCRAM_ONLY_CLASS:
        return _SCRAM_ONLY_CLASS["class"]

    class ScramOnlyConnection(dbapi.Connection):
        def __init__(self, *args, **kwargs):
            self.linkpass_auth = None  # None, "sasl" (started), "scram" (the server's proof checked)
            super().__init__(*args, **kwargs)

        def handle_AUTHENTICATION_REQUEST(self, data, context):
            code = struct.unpack("!i", bytes(data[:4]))[0]
            if code == _AUTH_CLEARTEXT:
                raise _Refused(f"the server asked for the password in cleartext (pg_hba.conf method password); "
                               f"{_SCRAM_ONLY}")
            if code == _AUTH_MD5:
                raise _Refused(f"the server asked for the password as an MD5 hash (pg_hba.conf method md5, or "
                               f"the password stored as MD5); {_SCRAM_ONLY}")
            if code == _AUTH_SASL:
                offered = [m.decode("ascii", "replace") for m in bytes(data[4:]).split(b"\0") if m]
                if not set(offered) & set(_SCRAM):
                    raise _Refused(f"the server offers SASL mechanisms {', '.join(offered) or 'none'}, not "
                                   f"SCRAM-SHA-256; {_SCRAM_ONLY}")
                if self.password is None:
                    raise _Refused("the server asks for the user's password and store_password_file "
                                   "(--store-password-file) names none")
                self.linkpass_auth = "sasl"
            elif code in (_AUTH_SASL_CONTINUE, _AUTH_SASL_FINAL):
                if self.linkpass_auth != "sasl":
                    raise _Refused("the server continued a SCRAM exchange that had not begun")
            elif code == _AUTH_OK:
                if self.linkpass_auth != "scram":
                    raise _Refused("the server let the user in without a SCRAM-SHA-256 exchange (pg_hba.conf "
                                   "method trust, or another that asks for no password), so it proved nothing of "
                                   "itself; the coordinator authenticates with SCRAM-SHA-256 only: give the user a "
                                   "password (in store_password_file) and the method scram-sha-256 in pg_hba.conf")
            else:  # Kerberos, SCM credentials, GSSAPI, SSPI, or unknown
                raise _Refused(f"the server asked for authentication method {code}; {_SCRAM_ONLY}")
            try:
                super().handle_AUTHENTICATION_REQUEST(data, context)
            except (dbapi.Error, OSError):
                raise
            except Exception as exc:  # scramp's: the server's proof or a message that does not parse
                raise _Refused(f"the SCRAM-SHA-256 exchange failed ({exc}): the server did not prove it knows "
                               "the user's password") from None
            if code == _AUTH_SASL_FINAL:
                self.linkpass_auth = "scram"  # set_server_final checked the server's signature

    _SCRAM_ONLY_CLASS["class"] = ScramOnlyConnection
    return ScramOnlyConnection


def parse_postgres_url(url: str) -> dict:
    """pg8000's connect() arguments from `postgresql://USER@HOST[:PORT]/DATABASE`. A password in
    the URL is refused: URLs end up in logs and process lists (use a password file)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "postgresql":
        raise StoreError(f"store: {redacted(url)!r} is not a postgresql:// URL; use "
                         "postgresql://USER@HOST:PORT/DATABASE, or leave it out for SQLite in the state directory")
    if u.password is not None:
        raise StoreError("store: the URL carries a password; put it in a file (mode 0600) named by "
                         "store_password_file (--store-password-file) and leave it out of the URL, which is logged")
    database = u.path.lstrip("/")
    if not u.username or not u.hostname or not database or "/" in database or u.query or u.fragment:
        raise StoreError(f"store: {redacted(url)!r} needs a user, a host and a database and nothing more: "
                         "postgresql://USER@HOST:PORT/DATABASE")
    try:
        port = u.port or 5432
    except ValueError:
        raise StoreError(f"store: {redacted(url)!r} has a port that is not a number 1..65535") from None
    return {"user": urllib.parse.unquote(u.username), "host": u.hostname, "port": port,
            "database": urllib.parse.unquote(database)}


def redacted(url: str) -> str:
    """The URL with any password taken out, for messages."""
    u = urllib.parse.urlsplit(url)
    if u.password is None:
        return url
    netloc = u.netloc.replace(f":{u.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(u._replace(netloc=netloc))


def _pg_message(exc: BaseException) -> str:
    """pg8000 puts the server's message in a dict (M: the text)."""
    arg = exc.args[0] if exc.args else exc
    return str(arg.get("M", arg)) if isinstance(arg, dict) else str(arg)


class EventRow(NamedTuple):
    """One event of the history, as it is added."""
    ts: float
    kind: str  # one of EVENT_KINDS
    actor: str  # who did it or reported it
    subject: str  # what it is about: a path key, a link, a host
    detail: dict


class PathRow(NamedTuple):
    """A reported path, whole (a registration, a table)."""
    key: str
    reporter: str
    info: dict  # peer, plane, hops, links
    state: str
    reason: str | None
    updated: float


class StateRow(NamedTuple):
    """A stored path's new state (a change)."""
    key: str
    state: str
    reason: str | None
    updated: float


def open_store(url: str | None, password_file: str | None, state_dir: str,
               on_committed: Callable[[list[EventRow]], None] | None = None, tls_ca_file: str | None = None,
               insecure_plaintext: bool = False) -> Store:
    """The store a coordinator's settings name: `url` (settings.store, a postgresql:// URL) with
    its user's password in `password_file` (settings.store_password_file), over TLS with the
    server's certificate verified for the URL's host against `tls_ca_file`
    (settings.store_tls_ca_file; None: the system's trust store), or, only with
    `insecure_plaintext` (settings.store_insecure_plaintext), without TLS; or without a URL the
    SQLite file in `state_dir`."""
    if url is None:
        return Store(os.path.join(state_dir, DB_FILE), on_committed)
    parse_postgres_url(url)
    if insecure_plaintext and tls_ca_file is not None:
        raise StoreError("store_tls_ca_file: not used with store_insecure_plaintext (no TLS); remove one of the two")
    password = None
    if password_file is not None:
        try:
            with open(password_file) as f:
                password = f.read().rstrip("\n")
        except OSError as exc:
            raise StoreError(f"store_password_file: {password_file}: {exc.strerror}; it holds the password of "
                             "the store URL's user (one line, mode 0600)") from None
        if not password:
            raise StoreError(f"store_password_file: {password_file} is empty; it holds the password of the "
                             "store URL's user (one line)")
    tls: ssl.SSLContext | bool = False
    if not insecure_plaintext:
        try:  # verify-full: the chain to this CA (or the system's), the server's name against the URL's host
            tls = ssl.create_default_context(cafile=tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise StoreError(f"store_tls_ca_file: {tls_ca_file}: {getattr(exc, 'strerror', None) or exc}; it holds "
                             "the PEM certificate of the CA that signed the PostgreSQL server's") from None
    return Store(url, on_committed, password=password, tls=tls)


class Store:
    def __init__(self, path: str, on_committed: Callable[[list[EventRow]], None] | None = None,
                 password: str | None = None, tls: ssl.SSLContext | None | bool = None):
        """`path`: an SQLite file, or a `postgresql://USER@HOST[:PORT]/DATABASE` URL (`password`: its
        user's, `tls`: verify the server with it, None: with the system's trust store, False: no
        TLS). `on_committed(events)`: called with the events of each transaction once it has
        committed (never for one rolled back): what the coordinator's log shows of its history."""
        self.path = path
        self.on_committed = on_committed
        self._uncommitted: list[EventRow] = []  # events of the open transaction
        self._data_version: Any = None  # written_elsewhere's last look
        self._tx_depth = 0  # transactions open on the connection (an inner one joins the outer)
        # the backend: every query below goes through it, whichever database it is
        self.db = _Postgres(path, password, tls) if path.startswith(POSTGRES_SCHEME) else _Sqlite(path)
        with self._tx(immediate=True):  # two processes starting on one new database make one schema
            self.db.script(_SCHEMA.format(**self.db.types))
            row = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None or row[0] in ("1", "2"):
                # version 1 lacks agent_epochs, which the script above made, and versions 1 and 2 the
                # drains' until column, added here; an older coordinator then refuses this database
                # rather than accept tokens revoked here or keep a timed drain for ever
                if "until" not in self.db.columns("drains"):
                    self.db.execute(f"ALTER TABLE drains ADD COLUMN until {self.db.types['real']}")
                self._put_meta("schema", str(SCHEMA_VERSION))
            elif row[0] != str(SCHEMA_VERSION):
                raise StoreError(f"{self.db.where}: schema version {row[0]}, this coordinator reads {SCHEMA_VERSION}")

    @property
    def kind(self) -> str:
        """"sqlite" or "postgresql"."""
        return self.db.kind

    def close(self) -> None:
        self.db.close()

    # ---- events ------------------------------------------------------------------------
    def add_events(self, events: Iterable[EventRow]) -> None:
        events = [EventRow(*e) for e in events]  # a tuple in EventRow's order (from another actor) too
        rows = [(e.ts, e.kind, e.actor, e.subject, json.dumps(e.detail, sort_keys=True)) for e in events]
        if rows:
            with self._tx():
                self.db.executemany("INSERT INTO events (ts, kind, actor, subject, detail) VALUES (?,?,?,?,?)", rows)
                if self.on_committed is not None:
                    self._uncommitted.extend(events)

    def event(self, kind: str, actor: str, subject: str, **detail) -> None:
        self.add_events([EventRow(time.time(), kind, actor, subject, detail)])

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
        q = f"SELECT * FROM ({q} ORDER BY id DESC LIMIT ?) AS newest ORDER BY id"
        args.append(limit)
        return [{"id": i, "ts": ts, "kind": k, "actor": a, "subject": s, "detail": json.loads(d)}
                for i, ts, k, a, s, d in self.db.execute(q, args)]

    def prune_events(self, before_ts: float, keep: int) -> int:
        """Retention: delete events older than `before_ts`, then all but the newest `keep`
        detections and recoveries and, counted apart, all but the newest `keep` of the rest
        (drains, refusals, agents, localizations): however fast agents' paths change, their churn
        never pushes an operator's action out of the history. Returns how many went."""
        with self._tx():
            n = self.db.execute("DELETE FROM events WHERE ts < ?", (before_ts,)).rowcount
            for which in CHURN_KINDS_SQL, f"NOT {CHURN_KINDS_SQL}":
                row = self.db.execute(f"SELECT id FROM events WHERE {which} ORDER BY id DESC LIMIT 1 OFFSET ?",
                                      (keep,)).fetchone()
                if row is not None:
                    n += self.db.execute(f"DELETE FROM events WHERE {which} AND id <= ?", (row[0],)).rowcount
        return n

    def event_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM events").fetchone()[0]

    # ---- drains ------------------------------------------------------------------------
    def set_drain(self, link: str, reason: str, by: str, since: float, until: float | None = None) -> None:
        with self._tx():
            self.db.execute("INSERT INTO drains (link, reason, by, since, until) VALUES (?,?,?,?,?) ON CONFLICT(link) "
                            "DO UPDATE SET reason=excluded.reason, by=excluded.by, since=excluded.since, "
                            "until=excluded.until",
                            (link, reason, by, since, until))

    def clear_drain(self, link: str) -> None:
        with self._tx():
            self.db.execute("DELETE FROM drains WHERE link=?", (link,))

    def drains(self) -> dict[str, dict]:
        return {lk: {"reason": r, "by": b, "since": s, "until": u}
                for lk, r, b, s, u in self.db.execute("SELECT link, reason, by, since, until FROM drains")}

    # ---- agents ------------------------------------------------------------------------
    def upsert_agent(self, name: str, agent_id: int, info: dict, wall_s: float) -> None:
        with self._tx():
            self.db.execute("INSERT INTO agents VALUES (?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET "
                            "agent_id=excluded.agent_id, info=excluded.info, last_seen=excluded.last_seen",
                            (name, agent_id, json.dumps(info, sort_keys=True), wall_s, wall_s))

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
    def put_paths(self, rows: Iterable[PathRow]) -> None:
        rows = [(r.key, r.reporter, json.dumps(r.info, sort_keys=True), r.state, r.reason, r.updated) for r in rows]
        if rows:
            with self._tx():
                self.db.executemany("INSERT INTO paths VALUES (?,?,?,?,?,?) ON CONFLICT(key) DO UPDATE SET "
                                    "reporter=excluded.reporter, info=excluded.info, state=excluded.state, "
                                    "reason=excluded.reason, updated=excluded.updated", rows)

    def put_states(self, rows: Iterable[StateRow]) -> None:
        """New states of paths already stored."""
        rows = [(r.state, r.reason, r.updated, r.key) for r in rows]
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
        the last call; the first call says True. SQLite: costs a pragma, not a read of any table;
        PostgreSQL: whether the revocations changed (one small aggregate), the only thing other
        processes write."""
        version = self.db.version()
        changed, self._data_version = version != self._data_version, version
        return changed

    def agent_epochs(self) -> dict[str, int]:
        """host -> the lowest agent-token epoch accepted, for every host ever revoked."""
        return dict(self.db.execute("SELECT host, min_epoch FROM agent_epochs"))

    def revoke_agent(self, host: str, by: str, reason: str, wall_s: float, max_epoch: int) -> int:
        """Refuse every agent token of `host` issued so far: its lowest accepted epoch goes up by
        one, with an event saying who and why, in one transaction. Returns the new epoch."""
        with self._tx(immediate=True):  # read and raise under the write lock: two revokes make two epochs
            row = self.db.execute("SELECT min_epoch FROM agent_epochs WHERE host=?", (host,)).fetchone()
            epoch = (row[0] if row else 0) + 1
            if epoch > max_epoch:
                raise StoreError(f"{host}: its agent tokens were revoked {epoch - 1} times, the most there can be; "
                                 "rotate the agent secret instead (docs/security.md, Revocation)")
            self.db.execute("INSERT INTO agent_epochs VALUES (?,?,?,?,?) ON CONFLICT(host) DO UPDATE SET "
                            "min_epoch=excluded.min_epoch, since=excluded.since, by=excluded.by, reason=excluded.reason",
                            (host, epoch, wall_s, by, reason))
            self.db.execute("INSERT INTO events (ts, kind, actor, subject, detail) VALUES (?,?,?,?,?)",
                            (wall_s, "agent", by, host, json.dumps({"what": "token revoked", "epoch": epoch,
                                                                 "reason": reason}, sort_keys=True)))
        return epoch

    # ---- meta --------------------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        with self._tx():
            self._put_meta(key, value)

    def _put_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO meta VALUES (?,?) ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))

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
        self.immediate = immediate

    def __enter__(self):
        if self.store._tx_depth == 0:
            self.store.db.begin(self.immediate)
        self.store._tx_depth += 1

    def __exit__(self, exc_type, *_):
        self.store._tx_depth -= 1
        if self.store._tx_depth == 0:
            done, self.store._uncommitted = self.store._uncommitted, []  # gone with a failed COMMIT too
            try:
                self.store.db.execute("ROLLBACK" if exc_type else "COMMIT")
            finally:
                self.store.db.end()
            if done and not exc_type and self.store.on_committed is not None:
                self.store.on_committed(done)
