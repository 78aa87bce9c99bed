"""TLS on the coordinator's real endpoint (in-process, 127.0.0.1), real handshakes: a client with
the lab CA gets answers; one without it, plain HTTP to the TLS port, and (with mutual TLS) a
client without a certificate or with one from another CA are refused, counted, and the endpoint
keeps serving; plain HTTP is served only when asked for by name."""
from __future__ import annotations

import json
import socket
import time

import pytest

from linkpass.coordinator import lab_ca, startup
from linkpass.control.client import Client, Refusal, TlsFailure, Unreachable
from linkpass.coordinator.coordinator import CoordinatorError
from linkpass.control.tls import build_client_context, lab_dir, lab_paths

from support.coordinator import coordinator_client, lab_ca_file
from support.ports import free_port


def start(tmp_path, **settings):
    srv = startup.start({"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0", **settings})
    token = (tmp_path / "state" / "reader.token").read_text().strip()
    return srv, token


def stop(srv) -> None:
    srv.close()
    srv.service.coordinator.store.close()


@pytest.fixture
def tls_server(tmp_path):
    srv, token = start(tmp_path)
    try:
        yield srv, token, tmp_path / "state"
    finally:
        stop(srv)


@pytest.fixture
def mtls_server(tmp_path):
    srv, token = start(tmp_path, require_client_cert=True)
    try:
        yield srv, token, tmp_path / "state"
    finally:
        stop(srv)


def test_the_default_is_https_and_a_client_with_the_lab_ca_gets_answers(tls_server):
    srv, token, state = tls_server
    assert srv.url.startswith("https://127.0.0.1:")
    c = coordinator_client(srv.url, token, state)
    assert c.get("/v1/status")["health"] == "ok"
    assert c.get("/v1/whoami") == {"name": "local-reader", "role": "reader", "host": None}
    c.close()
    # the lab CA's files: private, in a private directory
    d = lab_dir(str(state))
    assert oct((state / "tls").stat().st_mode & 0o777) == "0o700"
    assert {oct((state / "tls" / f).stat().st_mode & 0o777) for f in ("ca.key", "coordinator.key", "cli.key",
                                                                       "ca.crt", "coordinator.crt")} == {"0o600"}
    assert lab_paths(d, "ca")[0] == lab_ca_file(state)


def test_a_client_without_the_ca_fails_verification(tls_server, tmp_path):
    srv, token, _ = tls_server
    before = srv.errors["tls"]
    with pytest.raises(TlsFailure, match="CERTIFICATE_VERIFY_FAILED"):
        Client(srv.url, token).get("/v1/status")  # the system's trust store does not know the lab CA
    other = str(tmp_path / "other-ca")
    assert lab_ca.ensure(other)["ca"] == "made"  # a CA of its own, issuing the same names
    with pytest.raises(TlsFailure, match="CERTIFICATE_VERIFY_FAILED"):
        Client(srv.url, token, tls=build_client_context(lab_paths(other, "ca")[0])).get("/v1/status")
    wait_for(lambda: srv.errors["tls"] >= before + 2)


def test_a_certificate_must_name_the_address_the_client_dials(tmp_path):
    # the lab certificate names 127.0.0.1 and localhost, not the listener's other addresses: a
    # client dialling 127.0.0.2 (loopback too, the same listener on 0.0.0.0) must refuse it
    srv, token = start(tmp_path, listen="0.0.0.0:0")
    try:
        port, state = srv.address[1], tmp_path / "state"
        assert coordinator_client(f"https://127.0.0.1:{port}", token, state).get("/v1/healthz") == {"ok": True}
        with pytest.raises(TlsFailure, match="CERTIFICATE_VERIFY_FAILED"):
            coordinator_client(f"https://127.0.0.2:{port}", token, state).get("/v1/healthz")
    finally:
        stop(srv)


def test_plain_http_to_the_tls_port_gets_no_answer_and_is_counted(tls_server):
    srv, token, state = tls_server
    before = srv.errors["tls"]
    with socket.create_connection(srv.address, timeout=5) as s:
        s.sendall(b"GET /v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096) == b""  # closed: no HTTP answer, nothing in cleartext
    with pytest.raises(Unreachable):
        Client(srv.url.replace("https://", "http://"), token, insecure_http=True).get("/v1/healthz")
    wait_for(lambda: srv.errors["tls"] >= before + 2)
    c = coordinator_client(srv.url, token, state)
    metrics = c.get("/metrics").decode()
    assert 'linkpass_coordinator_request_errors_total{kind="tls"}' in metrics
    assert c.get("/v1/healthz") == {"ok": True}  # still serving
    c.close()


def test_a_silent_connection_does_not_hold_up_the_endpoint(tls_server):
    """Handshakes run in each connection's thread: one that never says a word blocks nobody else."""
    srv, token, state = tls_server
    with socket.create_connection(srv.address, timeout=5):
        c = coordinator_client(srv.url, token, state, timeout_s=5)
        assert c.get("/v1/healthz") == {"ok": True}
        c.close()


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls_server):
    srv, token, state = mtls_server
    before = srv.errors["tls"]
    with pytest.raises(Unreachable):
        coordinator_client(srv.url, token, state).get("/v1/healthz")
    wait_for(lambda: srv.errors["tls"] > before)
    c = coordinator_client(srv.url, token, state, client_cert="cli")
    assert c.get("/v1/status")["health"] == "ok"
    c.close()


def test_mutual_tls_refuses_a_certificate_from_another_ca(mtls_server, tmp_path):
    srv, token, state = mtls_server
    other = str(tmp_path / "other")
    lab_ca.ensure(other, clients=["cli"])
    ctx = build_client_context(lab_ca_file(state), *lab_paths(other, "cli"))
    with pytest.raises(Unreachable):
        Client(srv.url, token, tls=ctx).get("/v1/healthz")
    # the same name from the right CA is let in
    assert coordinator_client(srv.url, token, state, client_cert="cli").get("/v1/healthz") == {"ok": True}


def test_plain_http_only_when_asked_for_by_name_and_then_with_a_warning(tmp_path, capfd):
    with pytest.raises(ValueError, match="--insecure-http"):
        Client("http://127.0.0.1:9", "t")
    srv, token = start(tmp_path, insecure_http=True)
    try:
        assert srv.url.startswith("http://")
        assert not (tmp_path / "state" / "tls").exists()
        assert Client(srv.url, token, insecure_http=True).get("/v1/status")["health"] == "ok"
        logged = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
        assert any(e["event"] == "insecure_http" and "cleartext" in e["warning"] for e in logged)
    finally:
        stop(srv)


@pytest.mark.parametrize("settings, field", [
    ({"insecure_http": True, "tls_cert_file": "/x.crt"}, "tls_cert_file: not used with insecure_http"),
    ({"tls_cert_file": "/x.crt"}, "tls_key_file: required with tls_cert_file"),
    ({"tls_cert_file": "/nonexistent.crt", "tls_key_file": "/nonexistent.key"}, "tls_cert_file: cannot read"),
    ({"tls_san": ["not a name!"]}, "tls_san: 'not a name!'"),
])
def test_bad_tls_settings_name_the_setting_and_start_nothing(tmp_path, settings, field):
    port = free_port()
    with pytest.raises(CoordinatorError, match=field):
        startup.start({"state_dir": str(tmp_path / "state"), "listen": f"127.0.0.1:{port}", **settings})
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens there
    assert not (tmp_path / "state" / "tokens.yaml").exists()


def test_given_certificates_are_used_as_they_are(tmp_path):
    ca = str(tmp_path / "own-ca")
    lab_ca.ensure(ca, sans=["localhost"])
    cert, key = lab_paths(ca, "coordinator")
    srv, token = start(tmp_path, tls_cert_file=cert, tls_key_file=key)
    try:
        assert not (tmp_path / "state" / "tls").exists()  # no lab CA made beside given files
        c = Client(srv.url, token, tls=build_client_context(lab_paths(ca, "ca")[0]))
        assert c.get("/v1/healthz") == {"ok": True}
        c.close()
    finally:
        stop(srv)


def wait_for(pred, timeout_s: float = 5.0) -> None:
    """The server counts a refused handshake in the connection's own thread, just after the client sees it."""
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "the refused handshake was not counted"
        time.sleep(0.01)


def agent_token_of(state, host: str) -> str:
    from linkpass.coordinator.auth import agent_token, read_agent_secret

    return agent_token(read_agent_secret(str(state / "agent.secret")), host)


def test_with_mutual_tls_an_agent_token_travels_only_with_its_own_host_s_certificate(tmp_path):
    srv, reader = start(tmp_path / "mutual", require_client_cert=True)
    state = tmp_path / "mutual" / "state"
    lab_ca.ensure(lab_dir(str(state)), clients=["h0", "h1"])  # the lab CA's agent certificates: CN=<host>
    h1 = agent_token_of(state, "h1")
    operator = (state / "operator.token").read_text().strip()
    try:
        with coordinator_client(srv.url, h1, state, client_cert="h1") as c:
            assert c.get("/v1/whoami") == {"name": "h1", "role": "agent", "host": "h1"}
            assert c.post("/v1/register", {"name": "h1", "agent_id": 2, "service": "198.18.0.2", "nics": {},
                                           "paths": []})["drain_version"] == 0
        forbidden = srv.errors["forbidden"]
        for cert in ("h0", "cli"):  # another host's certificate, or the CLI's: refused, naming both
            with coordinator_client(srv.url, h1, state, client_cert=cert) as c:
                for call in (lambda: c.get("/v1/whoami"), lambda: c.post("/v1/report", {"name": "h1"})):
                    with pytest.raises(Refusal) as exc:
                        call()
                    assert exc.value.status == 403
                    assert f"the token of agent 'h1' came with the client certificate of '{cert}'" in str(exc.value)
        assert srv.errors["forbidden"] == forbidden + 4
        srv.service.flush_refusals()
        refused = [e for e in srv.service.coordinator.store.events(kinds=["refused"]) if e["actor"] == "h1"]
        assert len(refused) == 4 and "certificate of 'h0'" in refused[0]["detail"]["why"]
        # people's tokens take any certificate the CA signed
        for token, cert in ((reader, "h0"), (operator, "h1"), (reader, "cli")):
            with coordinator_client(srv.url, token, state, client_cert=cert) as c:
                assert c.get("/v1/status")["health"] == "ok"
    finally:
        stop(srv)
    # without mutual TLS a connection carries no client certificate, and an agent token needs none
    srv, _ = start(tmp_path / "server-only")
    state = tmp_path / "server-only" / "state"
    try:
        with coordinator_client(srv.url, agent_token_of(state, "h1"), state) as c:
            assert c.get("/v1/whoami")["host"] == "h1"
    finally:
        stop(srv)
