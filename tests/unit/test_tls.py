"""TLS without a network: the lab CA (idempotent, private files, refuses to replace a CA it cannot
use), the contexts' errors naming their setting, the agent's coordinator section (HTTPS unless
plain HTTP is asked for by name), the testbed's agent configs with the lab CA, and the CLI's
`tls init` and its refusal of an http:// URL. Real handshakes are in test_coordinator_tls.py."""
from __future__ import annotations

import datetime as dt
import os

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from linkpass.agent.config import ConfigError, parse
from linkpass.cli.main import build_parser
from linkpass.coordinator import lab_ca
from linkpass.control.client import Client
from linkpass.control.tls import TlsError, build_client_context, lab_paths
from linkpass.coordinator.tls import build_server_context
from linkpass.testbed.agents import write_agent_configs

from support.fleet import FAB


def sans(directory) -> set[str]:
    with open(lab_paths(str(directory), "coordinator")[0], "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    return {str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}


def contents(directory) -> dict[str, bytes]:
    return {f: (directory / f).read_bytes() for f in sorted(os.listdir(directory))}


# ---- the lab CA --------------------------------------------------------------------------------
def test_init_makes_private_files_and_is_idempotent(tmp_path):
    d = tmp_path / "tls"
    assert lab_ca.ensure(str(d), clients=["h0", "h1"], sans=["198.18.0.1"]) == {
        "ca": "made", "coordinator": "made", "h0": "made", "h1": "made"}
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    assert {oct((d / f).stat().st_mode & 0o777) for f in os.listdir(d)} == {"0o600"}
    assert sans(d) == {"localhost", "127.0.0.1", "::1", "198.18.0.1"}
    first = contents(d)
    assert set(lab_ca.ensure(str(d), clients=["h0", "h1"], sans=["198.18.0.1"]).values()) == {"kept"}
    assert contents(d) == first  # nothing rewritten


def test_the_certificates_load_as_a_server_and_client_pair(tmp_path):
    d = str(tmp_path)
    lab_ca.ensure(d, clients=["h0"])
    build_server_context(*lab_paths(d, "coordinator"), lab_paths(d, "ca")[0], require_client_cert=True)
    ctx = build_client_context(lab_paths(d, "ca")[0], *lab_paths(d, "h0"))
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("organizationName", "LinkPass lab"),),
                                                           (("commonName", "LinkPass lab CA"),))]


def test_a_new_san_reissues_the_coordinator_certificate_keeping_the_old_ones(tmp_path):
    d = tmp_path / "tls"
    lab_ca.ensure(str(d), sans=["198.18.0.1"])
    ca = (d / "ca.crt").read_bytes()
    done = lab_ca.ensure(str(d), clients=["h2"], sans=["198.18.0.9"])
    assert done == {"ca": "kept", "coordinator": "renewed", "h2": "made"}
    assert (d / "ca.crt").read_bytes() == ca
    assert sans(d) >= {"198.18.0.1", "198.18.0.9"}


def test_a_leaf_near_its_end_or_from_another_ca_is_issued_again(tmp_path):
    d, other = tmp_path / "tls", tmp_path / "other"
    lab_ca.ensure(str(d), clients=["h0"])
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=lab_ca.LEAF_DAYS - lab_ca.RENEW_DAYS + 1)
    assert lab_ca.ensure(str(d), clients=["h0"], now=later) == {"ca": "kept", "coordinator": "renewed", "h0": "renewed"}
    lab_ca.ensure(str(other), clients=["h0"])
    for f in ("h0.crt", "h0.key"):
        (d / f).write_bytes((other / f).read_bytes())
    assert lab_ca.ensure(str(d), clients=["h0"])["h0"] == "renewed"


def test_a_ca_it_cannot_use_is_not_replaced_without_force(tmp_path):
    d = tmp_path / "tls"
    lab_ca.ensure(str(d), clients=["h0"])
    (d / "ca.key").write_bytes(b"not a key")
    before = contents(d)
    with pytest.raises(lab_ca.LabCaError, match=r"ca\.crt: the CA in .* cannot be used: .*--force"):
        lab_ca.ensure(str(d), clients=["h0"])
    assert contents(d) == before  # changed nothing
    assert lab_ca.ensure(str(d), clients=["h0"], force=True) == {"ca": "made", "coordinator": "made", "h0": "made"}
    assert (d / "ca.crt").read_bytes() != before["ca.crt"]


def test_an_expired_ca_is_refused(tmp_path):
    lab_ca.ensure(str(tmp_path))
    future = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=lab_ca.CA_DAYS + 1)
    with pytest.raises(lab_ca.LabCaError, match="expired"):
        lab_ca.ensure(str(tmp_path), now=future)


@pytest.mark.parametrize("clients, sans_, match", [
    (["ca"], [], "--hosts: 'ca' is not a usable client name"),
    (["h 0"], [], "--hosts: 'h 0'"),
    ([], ["bad_name!"], "--san: 'bad_name!' is neither an IP address nor a DNS name"),
])
def test_bad_names_are_refused_before_anything_is_written(tmp_path, clients, sans_, match):
    with pytest.raises(lab_ca.LabCaError, match=match):
        lab_ca.ensure(str(tmp_path / "tls"), clients=clients, sans=sans_)
    assert not (tmp_path / "tls").exists()


# ---- contexts ----------------------------------------------------------------------------------
def test_context_errors_name_the_setting_and_the_fix(tmp_path):
    names = ("coordinator.ca_file", "coordinator.cert_file", "coordinator.key_file")
    with pytest.raises(TlsError, match=r"^coordinator\.ca_file: cannot read .*linkpass tls init"):
        build_client_context(str(tmp_path / "missing.crt"), names=names)
    with pytest.raises(TlsError, match=r"^coordinator\.key_file: required with coordinator\.cert_file"):
        build_client_context(None, str(tmp_path / "x.crt"), names=names)
    (tmp_path / "junk.crt").write_text("junk")
    with pytest.raises(TlsError, match=r"^coordinator\.ca_file: .*holds no PEM CA certificate"):
        build_client_context(str(tmp_path / "junk.crt"), names=names)
    lab_ca.ensure(str(tmp_path / "a"), clients=["h0"])
    lab_ca.ensure(str(tmp_path / "b"), clients=["h0"])
    with pytest.raises(TlsError, match=r"^tls_cert_file/tls_key_file: .* are not a PEM certificate and its private key"):
        build_server_context(lab_paths(str(tmp_path / "a"), "coordinator")[0], lab_paths(str(tmp_path / "b"), "coordinator")[1],
                             names=("tls_cert_file", "tls_key_file", "tls_ca_file"))
    with pytest.raises(TlsError, match=r"^tls_ca_file: required when client certificates are required"):
        build_server_context(*lab_paths(str(tmp_path / "a"), "coordinator"), None, require_client_cert=True,
                             names=("tls_cert_file", "tls_key_file", "tls_ca_file"))


def test_the_client_refuses_plain_http_unless_asked(tmp_path):
    with pytest.raises(ValueError, match="cleartext.*--insecure-http"):
        Client("http://198.18.0.1:9470", "token")
    assert Client("http://198.18.0.1:9470", "token", insecure_http=True).tls is None
    assert Client("https://198.18.0.1:9470", "token").tls is not None  # verified against the system's CAs


# ---- the agent's coordinator section ---------------------------------------------------------
BASE = {"agent_id": 1, "name": "h0", "fleet_key_file": "/k", "service": "198.18.0.1",
        "nics": [{"plane": 0, "ifname": "p0", "addr": "198.18.64.1"}]}


def coordinator(**section):
    return parse({**BASE, "coordinator": {"token_file": "/t", **section}}).coordinator


def test_the_agent_takes_https_with_its_tls_files():
    c = coordinator(url="https://198.18.0.9:9470", ca_file="/ca.crt", cert_file="/h0.crt", key_file="/h0.key")
    assert (c.ca_file, c.cert_file, c.key_file, c.insecure_http) == ("/ca.crt", "/h0.crt", "/h0.key", False)
    assert coordinator(url="http://198.18.0.9:9470", insecure_http=True).insecure_http


@pytest.mark.parametrize("section, message", [
    ({"url": "http://198.18.0.9:9470"}, "coordinator.url: http://198.18.0.9:9470 is plain HTTP, .*insecure_http: true"),
    ({"url": "ftp://198.18.0.9"}, "coordinator.url: expected https://HOST:PORT"),
    ({"url": "https://198.18.0.9:9470", "insecure_http": True}, "coordinator.insecure_http: true, but"),
    ({"url": "http://198.18.0.9:9470", "insecure_http": True, "ca_file": "/ca"}, "coordinator.ca_file: not used with plain"),
    ({"url": "https://198.18.0.9:9470", "cert_file": "/c"}, "coordinator.key_file: required with coordinator.cert_file"),
    ({"url": "https://198.18.0.9:9470", "key_file": "/k"}, "coordinator.cert_file: required with coordinator.key_file"),
    ({"url": "https://198.18.0.9:9470", "ca_file": ""}, "coordinator.ca_file: expected a non-empty string"),
    ({"url": "https://198.18.0.9:9470", "insecure_http": "yes"}, "coordinator.insecure_http: expected true or false"),
])
def test_the_agent_refuses_unclear_transport_settings(section, message):
    with pytest.raises(ConfigError, match=message):
        coordinator(**section)


# ---- the testbed's agents and the CLI ---------------------------------------------------------
def test_testbed_agents_get_the_lab_ca_and_a_certificate_each(tmp_path):
    tls = str(tmp_path / "tls")
    link = {"url": "https://198.18.0.9:9470", "token_file": "/t"}
    configs = write_agent_configs(FAB, str(tmp_path / "agents"), bytes(32), hosts=[0, 2], coordinator=link, tls_dir=tls)
    for h, path in configs.items():
        with open(path) as f:
            c = parse(yaml.safe_load(f)).coordinator
        assert (c.ca_file, c.cert_file, c.key_file) == (lab_paths(tls, "ca")[0], *lab_paths(tls, f"h{h}"))
        build_client_context(c.ca_file, c.cert_file, c.key_file)
        with open(c.cert_file, "rb") as f:  # the name the coordinator binds this host's agent token to
            subject = x509.load_pem_x509_certificate(f.read()).subject
        assert [a.value for a in subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == [f"h{h}"]
    plain = write_agent_configs(FAB, str(tmp_path / "plain"), bytes(32), hosts=[0], tls_dir=tls,
                                coordinator={**link, "url": "http://198.18.0.9:9470", "insecure_http": True})
    with open(plain[0]) as f:
        assert parse(yaml.safe_load(f)).coordinator.ca_file is None


def run(argv) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_tls_init_command(tmp_path, capsys):
    d = str(tmp_path / "tls")
    assert run(["tls", "init", "--dir", d, "--hosts", "h0,h1", "--san", "198.18.0.1"]) == 0
    out = capsys.readouterr().out
    assert f"made     {d}/ca.crt" in out and f"made     {d}/h1.crt" in out and f"made     {d}/cli.crt" in out
    assert run(["tls", "init", "--dir", d, "--hosts", "h0,h1"]) == 0
    assert "made" not in capsys.readouterr().out
    assert run(["tls", "init", "--dir", d, "--hosts", "coordinator"]) == 3
    assert "--hosts: 'coordinator' is not a usable client name" in capsys.readouterr().err


def test_the_cli_refuses_an_http_url_unless_asked(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LINKPASS_STATE_DIR", str(tmp_path))
    assert run(["status", "--coordinator", "http://127.0.0.1:9"]) == 3
    assert "plain HTTP" in capsys.readouterr().err
    assert run(["status", "--coordinator", "http://127.0.0.1:9", "--insecure-http"]) == 3  # asked: it tries
    err = capsys.readouterr().err
    assert "warning:" in err and "cleartext" in err and "does not answer" in err
    assert run(["status", "--coordinator", "https://127.0.0.1:9", "--ca-file", str(tmp_path / "none.crt")]) == 3
    assert "--ca-file: cannot read" in capsys.readouterr().err
