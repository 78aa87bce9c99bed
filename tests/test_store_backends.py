"""The coordinator's store on both backends: SQLite (a file, the default) and PostgreSQL (a real
server, started and removed here). The same calls must keep the same state on either, a
transaction must commit whole or not at all, the schema makes itself, and another process's
revocation must be seen."""
from __future__ import annotations

import pytest

from linkpass.coordinator.auth import MAX_EPOCH
from linkpass.coordinator.store import Store, StoreError, open_store, parse_postgres_url

from pgserver import PostgresServer


@pytest.fixture(scope="module")
def pg():
    with PostgresServer() as server:
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
            return open_store(server.url, server.password_file, str(tmp_path / "unused"))
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


@pytest.mark.service
def test_both_backends_keep_the_same_state(opener):
    s = opener()
    s.event("drain", "alice", "p0l0-p0s0", reason="optic")
    s.add_events([(10.5, "detection", "h1", "h1/3", {"state": "down"}), (11.0, "recovery", "h1", "h1/3", {})])
    s.set_drain("p0l0-p0s0", "optic", "alice", 100.25)
    s.set_drain("p0l0-p0s0", "optic swapped", "bob", 101.5, until=200.0)  # an upsert, not a second row
    s.upsert_agent("h1", 1, {"version": "1"}, 50.0)
    s.upsert_agent("h1", 7, {"version": "2"}, 60.0)
    s.put_paths([("h1/1", "h1", {"peer": "h2", "plane": 0}, "up", None, 70.0),
                 ("h1/2", "h1", {"peer": "h3", "plane": 1}, "up", None, 70.0)])
    s.put_paths([("h1/1", "h1", {"peer": "h2", "plane": 0}, "down", "hard_failure", 71.0)])
    s.put_states([("degraded", "gray_loss_fwd", 72.0, "h1/2")])
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


@pytest.mark.service
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


@pytest.mark.service
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


@pytest.mark.service
def test_a_store_of_a_newer_schema_is_refused(opener):
    s = opener()
    s.set_meta("schema", "99")
    with pytest.raises(StoreError, match="schema version 99, this coordinator reads 3"):
        opener()
    s.set_meta("schema", "3")


@pytest.mark.unit
@pytest.mark.parametrize("url, says", [
    ("postgres://u@h/db", "not a postgresql:// URL"),
    ("postgresql://u:secret@h/db", "carries a password"),
    ("postgresql://h/db", "needs a user, a host and a database"),
    ("postgresql://u@h/", "needs a user, a host and a database"),
    ("postgresql://u@h/db?sslmode=require", "needs a user, a host and a database"),
    ("postgresql://u@h:99999/db", "port that is not a number"),
])
def test_a_bad_store_url_is_refused_by_name_and_never_echoes_a_password(url, says):
    with pytest.raises(StoreError, match=says) as err:
        parse_postgres_url(url)
    assert str(err.value).startswith("store:") and "secret" not in str(err.value)


@pytest.mark.unit
def test_the_store_url_s_parts_and_the_password_file(tmp_path):
    assert parse_postgres_url("postgresql://link%20pass@db.example:6543/fleet") == {
        "user": "link pass", "host": "db.example", "port": 6543, "database": "fleet"}
    assert parse_postgres_url("postgresql://u@h/db")["port"] == 5432
    with pytest.raises(StoreError, match="store_password_file: .*/nope: No such file"):
        open_store("postgresql://u@127.0.0.1:1/db", str(tmp_path / "nope"), str(tmp_path))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(StoreError, match="store_password_file: .* is empty"):
        open_store("postgresql://u@127.0.0.1:1/db", str(tmp_path / "empty"), str(tmp_path))
    (tmp_path / "pw").write_text("x\n")
    with pytest.raises(StoreError, match="cannot connect to the coordinator's PostgreSQL store"):
        open_store("postgresql://u@127.0.0.1:1/db", str(tmp_path / "pw"), str(tmp_path))
    assert isinstance(open_store(None, None, str(tmp_path / "st")), Store)


@pytest.mark.service
def test_the_token_cli_revokes_into_the_postgresql_store_the_coordinator_reads(pg, tmp_path):
    import json
    import os
    import subprocess

    from linkpass.coordinator.auth import SECRET_FILE, ensure_secret, ensure_tokens
    from linkpass.testbed.agents import LINKPASS

    state = tmp_path / "state"
    ensure_secret(str(state / SECRET_FILE))
    ensure_tokens(str(state))
    coordinator = open_store(pg.url, pg.password_file, str(state))
    for table in ("events", "agent_epochs"):
        coordinator.db.execute(f"DELETE FROM {table}")
    coordinator.written_elsewhere()

    def cli(*args):
        return subprocess.run([*LINKPASS, "coordinator", "token", *args, "--state-dir", str(state)],
                              capture_output=True, text=True, timeout=60)

    out = cli("h1", "--revoke", "--reason", "leaked", "--store", pg.url, "--store-password-file", pg.password_file)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("lpa1.h1.1.")
    assert coordinator.written_elsewhere() and coordinator.agent_epochs() == {"h1": 1}
    assert not os.path.exists(state / "coordinator.db")  # nothing went to a SQLite file beside the secret
    listed = cli("list", "-o", "json", "--store", pg.url, "--store-password-file", pg.password_file)
    assert listed.returncode == 0 and json.loads(listed.stdout)["agent_hosts_revoked"] == {"h1": 1}, listed.stderr
    alone = cli("h1", "--store-password-file", pg.password_file)
    assert alone.returncode != 0 and "--store-password-file: only with --store" in alone.stderr
    coordinator.close()


@pytest.mark.service
def test_a_postgresql_store_reconnects_after_the_server_dropped_it(pg, tmp_path):
    """A server restart drops the coordinator's connection: the next statement reconnects by itself;
    one inside a transaction fails it whole (nothing half stored), and the next one reconnects."""
    s = open_store(pg.url, pg.password_file, str(tmp_path))
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


@pytest.mark.service
def test_a_postgresql_store_over_tls_checks_the_server_s_certificate(tmp_path):
    from linkpass.coordinator import lab_ca
    from linkpass.coordinator.tls import lab_paths

    with PostgresServer(tls=True) as server:
        s = open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=server.ca_file)
        assert s.db.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()[0] is True
        s.set_drain("p0l0-p0s0", "over tls", "alice", 1.0)
        assert list(s.drains()) == ["p0l0-p0s0"]
        s.close()
        # no CA given: TLS when the server offers it, but any certificate will do (nothing verified)
        unverified = open_store(server.url, server.password_file, str(tmp_path))
        assert unverified.db.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()[0] is True
        unverified.close()
        other = str(tmp_path / "other-ca")
        lab_ca.ensure(other, sans=["127.0.0.1"])
        with pytest.raises(StoreError, match="signed by the CA of store_tls_ca_file"):
            open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=lab_paths(other, "ca")[0])
        with pytest.raises(StoreError, match="store_tls_ca_file: .*/nope: No such file"):
            open_store(server.url, server.password_file, str(tmp_path), tls_ca_file=str(tmp_path / "nope"))


@pytest.mark.unit
def test_a_file_that_is_not_a_database_is_refused_with_what_to_do(tmp_path):
    bad = tmp_path / "coordinator.db"
    bad.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 16)
    with pytest.raises(StoreError, match="cannot open the coordinator database .*move it aside"):
        Store(str(bad))
    assert bad.read_bytes()[:16] == b"SQLite format 3\x00"  # left as it was, for whoever restores it
