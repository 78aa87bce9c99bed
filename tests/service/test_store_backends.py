"""The coordinator's store on both backends: SQLite (a file, the default) and PostgreSQL (a real
server, started and removed here). The same calls must keep the same state on either, a
transaction must commit whole or not at all, the schema makes itself, and another process's
revocation must be seen. PostgreSQL is reached over verified TLS only (plaintext when asked for
by name) and its user authenticates with SCRAM-SHA-256 only."""
from __future__ import annotations

import io
import json
import socket
import ssl
import struct
import threading

import pytest

from linkpass.coordinator.auth import MAX_EPOCH
from linkpass.coordinator.store import PathRow, StateRow, StoreError, open_store

from support.pgserver import PostgresServer


@pytest.fixture(scope="module")
def pg():
    with PostgresServer(tls=True) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def opener(request, tmp_path):
    """Opens a new connection to one store (several may be open at once, as the coordinator's and
    the CLI's); every table is emptied first, so each test starts from nothing."""
    if request.param == "sqlite":
        def open_one():
            return open_store(None, None, str(tmp_path / "state"))
    else:
        server = request.getfixturevalue("pg")

        def open_one():
            return open_store(server.url, server.password_file, str(tmp_path / "unused"), tls_ca_file=server.ca_file)
        s = open_one()
        for table in ("events", "drains", "agents", "paths", "agent_epochs"):
            s.db.execute(f"DELETE FROM {table}")
        s.close()
    opened = []

    def track():
        opened.append(open_one())
        return opened[-1]
    yield track
    for s in opened:
        s.close()


def test_both_backends_keep_the_same_state(opener):
    s = opener()
    s.event("drain", "alice", "p0l0-p0s0", reason="optic")
    s.add_events([(10.5, "detection", "h1", "h1/3", {"state": "down"}), (11.0, "recovery", "h1", "h1/3", {})])
    s.set_drain("p0l0-p0s0", "optic", "alice", 100.25)
    s.set_drain("p0l0-p0s0", "optic swapped", "bob", 101.5, until=200.0)  # an upsert, not a second row
    s.upsert_agent("h1", 1, {"version": "1"}, 50.0)
    s.upsert_agent("h1", 7, {"version": "2"}, 60.0)
    s.put_paths([PathRow("h1/1", "h1", {"peer": "h2", "plane": 0}, "up", None, 70.0),
                 PathRow("h1/2", "h1", {"peer": "h3", "plane": 1}, "up", None, 70.0)])
    s.put_paths([PathRow("h1/1", "h1", {"peer": "h2", "plane": 0}, "down", "hard_failure", 71.0)])
    s.put_states([StateRow(key="h1/2", state="degraded", reason="gray_loss_fwd", updated=72.0)])
    assert s.drains() == {"p0l0-p0s0": {"reason": "optic swapped", "by": "bob", "since": 101.5, "until": 200.0}}
    assert s.agents() == {"h1": {"agent_id": 7, "version": "2", "first_seen": 50.0, "last_seen": 60.0}}
    assert sorted((p["key"], p["state"], p["reason"], p["updated"]) for p in s.paths()) == [
        ("h1/1", "down", "hard_failure", 71.0), ("h1/2", "degraded", "gray_loss_fwd", 72.0)]
    evs = s.events()
    assert [(e["kind"], e["subject"]) for e in evs] == [("drain", "p0l0-p0s0"), ("detection", "h1/3"),
                                                        ("recovery", "h1/3")]
    assert [e["kind"] for e in s.events(host="h1")] == ["detection", "recovery"]
    assert [e["kind"] for e in s.events(kinds=["recovery", "drain"], limit=1)] == ["recovery"]  # the newest
    assert s.events(after_id=evs[1]["id"])[0]["kind"] == "recovery"
    assert s.prune_events(before_ts=11.0, keep=10) == 1 and s.event_count() == 2
    s.drop_paths("h1", keep=["h1/2"])
    assert [p["key"] for p in s.paths()] == ["h1/2"]
    s.clear_drain("p0l0-p0s0")
    assert s.drains() == {}
    again = opener()  # another connection (a restarted coordinator) reads what the first wrote
    assert again.agents() == s.agents() and again.paths() == s.paths() and again.events() == s.events()


def test_a_transaction_commits_whole_or_not_at_all(opener):
    s = opener()
    with pytest.raises(RuntimeError):
        with s.transaction():
            s.set_drain("p1l1-p1s1", "x", "alice", 1.0)
            s.event("drain", "alice", "p1l1-p1s1")
            raise RuntimeError("killed between the writes")
    assert s.drains() == {} and s.event_count() == 0
    with s.transaction():
        s.set_drain("p1l1-p1s1", "x", "alice", 1.0)
        s.event("drain", "alice", "p1l1-p1s1")
    assert list(s.drains()) == ["p1l1-p1s1"] and opener().event_count() == 1


def test_another_processes_revocation_is_seen_and_epochs_rise_one_at_a_time(opener):
    coordinator, cli = opener(), opener()
    assert coordinator.written_elsewhere() and not coordinator.written_elsewhere()
    coordinator.set_drain("p0l0-p0s0", "x", "alice", 1.0)  # its own writes are not news to it
    assert not coordinator.written_elsewhere()
    assert cli.revoke_agent("h1", "bob (local)", "leaked", 1.0, MAX_EPOCH) == 1
    assert coordinator.written_elsewhere() and coordinator.agent_epochs() == {"h1": 1}
    assert not coordinator.written_elsewhere()
    assert cli.revoke_agent("h1", "bob (local)", "again", 2.0, MAX_EPOCH) == 2
    with pytest.raises(StoreError, match="rotate the agent secret"):
        cli.revoke_agent("h1", "bob (local)", "too many", 3.0, max_epoch=2)
    assert coordinator.agent_epochs() == {"h1": 2}
    assert [e["detail"]["epoch"] for e in coordinator.events(kinds=["agent"])] == [1, 2]


def test_a_store_of_a_newer_schema_is_refused(opener):
    s = opener()
    s.set_meta("schema", "99")
    with pytest.raises(StoreError, match="schema version 99, this coordinator reads 3"):
        opener()
    s.set_meta("schema", "3")


def test_the_token_cli_revokes_into_the_postgresql_store_the_coordinator_reads(pg, tmp_path):
    import json
    import os
    import subprocess

    from linkpass.coordinator.auth import SECRET_FILE, ensure_secret, ensure_tokens
    from linkpass.testbed.agents import LINKPASS

    state = tmp_path / "state"
    ensure_secret(str(state / SECRET_FILE))
    ensure_tokens(str(state))
    coordinator = open_store(pg.url, pg.password_file, str(state), tls_ca_file=pg.ca_file)
    for table in ("events", "agent_epochs"):
        coordinator.db.execute(f"DELETE FROM {table}")
    coordinator.written_elsewhere()

    def cli(*args):
        return subprocess.run([*LINKPASS, "coordinator", "token", *args, "--state-dir", str(state)],
                              capture_output=True, text=True, timeout=60)

    store = ("--store", pg.url, "--store-password-file", pg.password_file)
    untrusted = cli("h1", "--revoke", *store)  # the system's trust store does not know the server's CA
    assert untrusted.returncode != 0 and "TLS certificate is not trusted" in untrusted.stderr, untrusted.stderr
    both = cli("h1", "--revoke", *store, "--store-tls-ca", pg.ca_file, "--store-insecure-plaintext")
    assert both.returncode != 0 and "--store-tls-ca: not used with --store-insecure-plaintext" in both.stderr
    out = cli("h1", "--revoke", "--reason", "leaked", *store, "--store-tls-ca", pg.ca_file)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("lpa1.h1.1.")
    assert coordinator.written_elsewhere() and coordinator.agent_epochs() == {"h1": 1}
    assert not os.path.exists(state / "coordinator.db")  # nothing went to a SQLite file beside the secret
    listed = cli("list", "-o", "json", *store, "--store-tls-ca", pg.ca_file)
    assert listed.returncode == 0 and json.loads(listed.stdout)["agent_hosts_revoked"] == {"h1": 1}, listed.stderr
    alone = cli("h1", "--store-password-file", pg.password_file)
    assert alone.returncode != 0 and "--store-password-file: only with --store" in alone.stderr
    coordinator.close()


def test_a_postgresql_store_reconnects_after_the_server_dropped_it(pg, tmp_path):
    """A server restart drops the coordinator's connection: the next statement reconnects by itself;
    one inside a transaction fails it whole (nothing half stored), and the next one reconnects."""
    s = open_store(pg.url, pg.password_file, str(tmp_path), tls_ca_file=pg.ca_file)
    s.db.execute("DELETE FROM drains")
    s.db.execute("DELETE FROM events")
    s.set_drain("p0l0-p0s0", "before", "alice", 1.0)
    pg.restart()
    assert s.drains() == {"p0l0-p0s0": {"reason": "before", "by": "alice", "since": 1.0, "until": None}}
    with pytest.raises(StoreError, match="lost the connection to the PostgreSQL store"):
        with s.transaction():
            s.set_drain("p1l1-p1s1", "during", "bob", 2.0)
            pg.restart()  # between a request's writes
            s.event("drain", "bob", "p1l1-p1s1")
    assert sorted(s.drains()) == ["p0l0-p0s0"] and s.event_count() == 0  # none of that request's writes
    s.set_drain("p1l1-p1s1", "after", "bob", 3.0)
    assert sorted(s.drains()) == ["p0l0-p0s0", "p1l1-p1s1"] and s.drains()["p1l1-p1s1"]["reason"] == "after"
    s.close()


def ssl_in_use(store) -> bool:
    return store.db.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()[0]


def test_a_postgresql_store_is_reached_over_verified_tls_only(tmp_path, monkeypatch):
    """verify-full: the server's certificate chains to store_tls_ca_file (without it, to the
    system's trust store) and names the URL's host; never an unverified or a plaintext fallback."""
    from linkpass.coordinator import lab_ca
    from linkpass.control.tls import lab_paths

    with PostgresServer(tls=True) as server:
        s = open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=server.ca_file)
        assert ssl_in_use(s) is True
        s.set_drain("p0l0-p0s0", "over tls", "alice", 1.0)
        assert list(s.drains()) == ["p0l0-p0s0"]
        s.close()
        # no CA given: the system's trust store, which does not know this server's CA
        with pytest.raises(StoreError, match=r"TLS certificate is not trusted \(.*\): it must be signed by the CA "
                                             "of store_tls_ca_file"):
            open_store(server.url, server.password_file, str(tmp_path))
        other = str(tmp_path / "other-ca")
        lab_ca.ensure(other, sans=["127.0.0.1"])
        with pytest.raises(StoreError, match="TLS certificate is not trusted .*signed by the CA of store_tls_ca_file"):
            open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=lab_paths(other, "ca")[0])
        with pytest.raises(StoreError, match="store_tls_ca_file: .*/nope: No such file"):
            open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=str(tmp_path / "nope"))
        with pytest.raises(StoreError, match="store_tls_ca_file: not used with store_insecure_plaintext"):
            open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=server.ca_file,
                       insecure_plaintext=True)
        # the system's trust store is the default one, verified the same way
        monkeypatch.setenv("SSL_CERT_FILE", server.ca_file)
        s = open_store(server.url, server.password_file, str(tmp_path))
        assert ssl_in_use(s) is True and s.db.db.linkpass_auth == "scram"  # the server proved it knows the password
        s.close()
        monkeypatch.delenv("SSL_CERT_FILE")
        # plaintext, asked for by name, is plaintext even where the server offers TLS
        s = open_store(server.url, server.password_file, str(tmp_path), insecure_plaintext=True)
        assert ssl_in_use(s) is False and s.db.db.linkpass_auth == "scram"
        s.close()


def test_a_certificate_that_does_not_name_the_url_s_host_is_refused(tmp_path):
    with PostgresServer(tls=True, cert_names=("db.linkpass.test",)) as server:  # signed by the CA given, for another name
        with pytest.raises(StoreError, match=r"TLS certificate is not trusted \(.*mismatch.*\): .* name the "
                                             r"URL's host 127\.0\.0\.1"):
            open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=server.ca_file)


def test_a_server_without_tls_is_refused_unless_plaintext_is_asked_for_by_name(tmp_path):
    """The coordinator's default against a server that has no TLS: it does not start (it used to
    connect in plaintext). With store_insecure_plaintext it does, and logs a warning."""
    from linkpass.coordinator import startup
    from linkpass.control.errors import CoordinatorError
    from linkpass.observe.log import Logger

    with PostgresServer() as server:
        with pytest.raises(StoreError, match="does not offer TLS .* store_tls_ca_file .* store_insecure_plaintext"):
            open_store(server.url, server.password_file, str(tmp_path))
        settings = {"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0", "store": server.url,
                    "store_password_file": server.password_file}
        with pytest.raises(CoordinatorError, match="does not offer TLS .* store_insecure_plaintext"):
            startup.start(settings)
        with pytest.raises(CoordinatorError, match="settings.store_tls_ca_file: not used with "
                                                   "settings.store_insecure_plaintext"):
            startup.start({**settings, "store_insecure_plaintext": True, "store_tls_ca_file": "/etc/ssl/ca.crt"})
        out = io.StringIO()
        srv = startup.start({**settings, **server.settings}, log=Logger("coordinator", stream=out))
        try:
            assert server.settings["store_insecure_plaintext"] is True
            assert ssl_in_use(srv.service.coordinator.store) is False
            lines = [json.loads(line) for line in out.getvalue().splitlines()]
            warned = [x for x in lines if x["event"] == "store_insecure_plaintext"]
            assert len(warned) == 1 and warned[0]["level"] == "warning" and warned[0]["store"] == server.url
            assert "without TLS" in warned[0]["warning"]
        finally:
            srv.close()
            srv.service.coordinator.store.close()


@pytest.mark.parametrize("auth, says", [("password", "asked for the password in cleartext"),
                                        ("md5", "asked for the password as an MD5 hash")])
def test_a_server_that_asks_for_a_cleartext_or_md5_password_is_refused(tmp_path, auth, says):
    with PostgresServer(tls=True, auth=auth) as server:
        with pytest.raises(StoreError, match=f"{says} .*SCRAM-SHA-256 only and sent nothing of the password.*"
                                             "password_encryption = scram-sha-256.*scram-sha-256 in pg_hba.conf"):
            open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=server.ca_file)


class FakePostgres:
    """A server that answers the startup message with one authentication request and keeps what
    the client sends after it (over TLS with a lab CA's certificate for 127.0.0.1, or none)."""

    def __init__(self, request: bytes, tls: ssl.SSLContext | None):
        self.request, self.tls = request, tls
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(20)
        self.port = self.listener.getsockname()[1]
        self.after: bytes | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _exactly(self, conn, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def _serve(self):
        try:
            conn, _ = self.listener.accept()
        except OSError:  # nobody came: self.after stays None
            self.listener.close()
            return
        conn.settimeout(10)
        try:
            while True:
                n, code = struct.unpack("!ii", self._exactly(conn, 8))
                body = self._exactly(conn, n - 8)
                if code != 80877103:  # the startup message
                    assert body.startswith(b"user\0")
                    break
                conn.sendall(b"S" if self.tls else b"N")  # an SSLRequest
                if self.tls:
                    conn = self.tls.wrap_socket(conn, server_side=True)
            conn.sendall(self.request)
            after = b""
            try:
                while chunk := conn.recv(65536):
                    after += chunk
            except OSError:
                pass
            self.after = after
        finally:
            conn.close()
            self.listener.close()

    def messages(self) -> list[bytes]:
        """The type of each message the client sent after the request."""
        self.thread.join(timeout=30)
        assert self.after is not None, "the client never got as far as the authentication request"
        data, types = self.after, []
        while data:
            types.append(data[:1])
            data = data[1 + struct.unpack("!i", data[1:5])[0]:]
        return types


@pytest.mark.parametrize("over_tls", [True, False])
@pytest.mark.parametrize("code, extra, says", [
    (3, b"", "asked for the password in cleartext"),
    (5, b"salt", "asked for the password as an MD5 hash"),
    (0, b"", "let the user in without a SCRAM-SHA-256 exchange"),
])
def test_nothing_of_the_password_is_sent_to_a_server_that_asks_for_it_otherwise(tmp_path, over_tls, code, extra,
                                                                                says):
    """pg8000 by itself answers a cleartext or an MD5 request with the password: here the request
    is refused before a PasswordMessage ('p') goes out, whatever TLS carries it."""
    from linkpass.coordinator import lab_ca
    from linkpass.control.tls import SERVER, lab_paths

    context, ca = None, None
    if over_tls:
        lab_ca.ensure(str(tmp_path / "ca"), sans=["127.0.0.1"])
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*lab_paths(str(tmp_path / "ca"), SERVER))
        ca = lab_paths(str(tmp_path / "ca"), "ca")[0]
    server = FakePostgres(b"R" + struct.pack("!ii", 8 + len(extra), code) + extra, context)
    (tmp_path / "pw").write_text("hunter2-secret\n")
    with pytest.raises(StoreError) as refused:
        open_store(f"postgresql://linkpass@127.0.0.1:{server.port}/linkpass", str(tmp_path / "pw"), str(tmp_path),
                   tls_ca_file=ca, **({} if over_tls else {"insecure_plaintext": True}))
    sent = server.messages()
    assert b"p" not in sent and set(sent) <= {b"X"}, sent  # no PasswordMessage; at most a Terminate
    assert b"hunter2" not in server.after
    assert says in str(refused.value) and "SCRAM-SHA-256 only" in str(refused.value), refused.value
