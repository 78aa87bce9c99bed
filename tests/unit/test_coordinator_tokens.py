"""Agent tokens with epochs, one host's revocation, and the names a client certificate gives:
the token codec and checks (auth.py), the revocations in the store (store.py), the certificate
names the endpoint binds agent tokens to (tls.py). No sockets; the endpoint's side is in
test_coordinator_http.py and test_coordinator_tls.py."""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import sqlite3

import pytest

from linkpass.coordinator.auth import MAX_EPOCH, AuthError, Caller, Revoked, Tokens, agent_token, token_hash
from linkpass.coordinator.store import SCHEMA_VERSION, Store, StoreError
from linkpass.coordinator.tls import certificate_names, names_host


SECRET = bytes(range(32))


def tokens(**listed) -> Tokens:
    """A reader, an operator and a listed agent entry for h7, plus derived agent tokens."""
    text = ("tokens:\n"
            f"  - {{name: grafana, role: reader, sha256: {token_hash('r')}}}\n"
            f"  - {{name: oncall, role: operator, sha256: {token_hash('o')}}}\n"
            f"  - {{name: h7-static, role: agent, host: h7, sha256: {token_hash('t7')}}}\n")
    return Tokens.parse(text, agent_secret=SECRET)


def who(t: Tokens, token: str):
    return t.caller(f"Bearer {token}")


def test_epoch_zero_is_the_form_every_deployed_token_has():
    """Tokens handed out before epochs existed are epoch 0 and keep working unchanged."""
    mac = hmac.new(SECRET, b"linkpass agent v1\0h3", hashlib.sha256).digest()
    old = "lpa1.h3." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    assert agent_token(SECRET, "h3") == agent_token(SECRET, "h3", 0) == old
    assert who(tokens(), old) == Caller("h3", "agent", "h3", 0)


def test_a_token_carries_its_epoch_and_speaks_for_its_host_only():
    t = tokens()
    tok = agent_token(SECRET, "h3", 4)
    assert tok.startswith("lpa1.h3.4.") and tok != agent_token(SECRET, "h3", 5)
    assert who(t, tok) == Caller("h3", "agent", "h3", 4)
    mac = tok.rpartition(".")[2]
    for forged in (f"lpa1.h2.4.{mac}", f"lpa1.h3.5.{mac}", f"lpa1.h3.{mac}", f"lpa1.h3.04.{mac}",
                   f"lpa1.h3.0.{mac}", f"lpa1.h3.+4.{mac}", f"lpa1.h3.٤.{mac}", f"lpa1.h3.{2**31}.{mac}"):
        assert who(t, forged) is None, forged


@pytest.mark.parametrize("host", ["gpu-017.rack3", "h.5", "a.1.2"])
def test_host_names_with_dots_read_one_way_only(host):
    """`lpa1.h.5.MAC` could be host h.5 at epoch 0 or host h at epoch 5: the MAC decides, and the
    two forms' MACs are over different contexts, so neither passes for the other."""
    t = tokens()
    for epoch in (0, 1, 5):
        assert who(t, agent_token(SECRET, host, epoch)) == Caller(host, "agent", host, epoch)
    short, _, digits = host.rpartition(".")
    if digits.isdigit():  # the epoch-0 token of h.5 is not host h's token at epoch 5, nor the reverse
        assert agent_token(SECRET, host, 0) != agent_token(SECRET, short, int(digits))
        assert who(t, agent_token(SECRET, short, int(digits))) == Caller(short, "agent", short, int(digits))


def test_bad_epochs_and_hosts_are_refused_by_name():
    for bad in (-1, MAX_EPOCH + 1, 1.0, True, "1"):
        with pytest.raises(AuthError, match="epoch"):
            agent_token(SECRET, "h1", bad)
    with pytest.raises(AuthError, match="host 'a/b'"):
        agent_token(SECRET, "a/b", 1)


def test_a_revoked_host_s_earlier_tokens_are_refused_and_nothing_else_is():
    t = tokens()
    t.set_min_epochs({"h1": 2, "h7": 1})
    for epoch in (0, 1):
        assert who(t, agent_token(SECRET, "h1", epoch)) == Revoked("h1", epoch, 2)
    for epoch in (2, 3):
        assert who(t, agent_token(SECRET, "h1", epoch)) == Caller("h1", "agent", "h1", epoch)
    assert who(t, agent_token(SECRET, "h2")) == Caller("h2", "agent", "h2", 0)  # other hosts: as they were
    assert who(t, "t7") == Revoked("h7", 0, 1)  # a listed agent token is of epoch 0
    assert who(t, "r") == Caller("grafana", "reader")  # people's tokens are not agents'
    assert who(t, "o") == Caller("oncall", "operator")
    t.set_min_epochs({})
    assert who(t, agent_token(SECRET, "h1", 0)) == Caller("h1", "agent", "h1", 0)


def test_the_revocation_message_names_the_host_and_the_fix_and_no_secret():
    old = agent_token(SECRET, "h1", 0)
    text = Revoked("h1", 0, 1).message()
    assert "h1" in text and "revoked" in text and "linkpass coordinator token h1" in text
    assert old.rpartition(".")[2] not in text and SECRET.hex() not in text and "lpa1." not in text


def test_revocations_are_stored_counted_up_and_survive_a_reopen(tmp_path):
    db = str(tmp_path / "c.db")
    s = Store(db)
    assert s.agent_epochs() == {}
    assert s.revoke_agent("h1", "alice (local)", "key leaked", 100.0, MAX_EPOCH) == 1
    assert s.revoke_agent("h1", "alice (local)", "again", 101.0, MAX_EPOCH) == 2
    assert s.revoke_agent("h2", "bob (local)", "rebuilt", 102.0, MAX_EPOCH) == 1
    s.close()
    s = Store(db)  # a restarted coordinator, or the CLI beside a running one
    assert s.agent_epochs() == {"h1": 2, "h2": 1}
    ev = [e for e in s.events() if e["kind"] == "agent"]
    assert [(e["actor"], e["subject"], e["detail"]) for e in ev] == [
        ("alice (local)", "h1", {"what": "token revoked", "epoch": 1, "reason": "key leaked"}),
        ("alice (local)", "h1", {"what": "token revoked", "epoch": 2, "reason": "again"}),
        ("bob (local)", "h2", {"what": "token revoked", "epoch": 1, "reason": "rebuilt"})]
    with pytest.raises(StoreError, match="rotate the agent secret"):
        s.revoke_agent("h1", "alice (local)", "x", 103.0, max_epoch=2)
    assert s.agent_epochs() == {"h1": 2, "h2": 1} and len(s.events()) == 3  # the refused one changed nothing
    s.close()


def test_the_coordinator_sees_when_another_process_wrote_its_store(tmp_path):
    """The running coordinator re-reads revocations only after someone else (the CLI) committed."""
    db = str(tmp_path / "c.db")
    coordinator, cli = Store(db), Store(db)
    assert coordinator.written_elsewhere() and not coordinator.written_elsewhere()
    coordinator.event("drain", "alice", "p0l0-p0s0")  # its own writes are not news to it
    assert not coordinator.written_elsewhere()
    cli.revoke_agent("h1", "bob (local)", "x", 1.0, MAX_EPOCH)
    assert coordinator.written_elsewhere() and coordinator.agent_epochs() == {"h1": 1}
    assert not coordinator.written_elsewhere()
    coordinator.close()
    cli.close()


def test_a_database_of_the_previous_schema_is_upgraded_and_a_newer_one_refused(tmp_path):
    old = tmp_path / "v1.db"
    db = sqlite3.connect(old)
    db.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                     "INSERT INTO meta VALUES ('schema', '1');")
    db.close()
    s = Store(str(old))
    assert s.get_meta("schema") == str(SCHEMA_VERSION) == "3" and s.agent_epochs() == {}
    s.set_meta("schema", "4")
    s.close()
    with pytest.raises(StoreError, match="schema version 4"):
        Store(str(old))


def test_a_certificate_names_its_common_names_and_dns_sans():
    peercert = {"subject": ((("organizationName", "LinkPass lab"),), (("commonName", "h0"),)),
                "subjectAltName": (("DNS", "gpu-1.rack3"), ("IP Address", "198.18.0.1"))}
    names = certificate_names(peercert)
    assert names == {"h0", "gpu-1.rack3"}
    assert names_host(names, "h0") and names_host(names, "gpu-1.rack3") and names_host(names, "GPU-1.rack3")
    assert not names_host(names, "h1") and not names_host(names, "198.18.0.1")  # an address is not a host name
    assert not names_host(names, "LinkPass lab")  # the organisation is not a name
    assert certificate_names(None) == certificate_names({}) == frozenset()



def test_a_secret_written_into_a_shared_directory_reaches_no_file_planted_there(tmp_path):
    """Files another user planted where a secret goes (a link at the temporary name the old
    writer used, a link at the target, a world-readable file at either): the secret ends up in a
    new file of mode 0600, and the files the links pointed to are untouched."""
    from linkpass.coordinator.auth import write_private

    victim = tmp_path / "victim"
    victim.write_text("theirs\n")
    out = tmp_path / "agent.token"
    (tmp_path / "agent.token.tmp").symlink_to(victim)
    write_private(str(out), "secret\n")
    assert victim.read_text() == "theirs\n"
    assert out.read_text() == "secret\n" and not out.is_symlink()
    assert os.stat(out).st_mode & 0o777 == 0o600

    other = tmp_path / "op.token"
    other.symlink_to(victim)  # a link at the target itself is replaced, not followed
    write_private(str(other), b"secret2\n")
    assert victim.read_text() == "theirs\n" and not other.is_symlink() and other.read_text() == "secret2\n"

    planted = tmp_path / "reader.token"
    planted.write_text("")
    os.chmod(planted, 0o644)
    write_private(str(planted), "secret3\n")
    assert os.stat(planted).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.token", "agent.token.tmp", "op.token",
                                                          "reader.token", "victim"]  # no temporary left
