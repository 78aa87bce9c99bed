"""No secret reaches a log line: the real code paths that handle tokens, the agent secret, the
fleet key and TLS private keys run with every log level on and stdout/stderr captured, then
none of those secrets (nor their hex or base64) may appear in what was written."""
from __future__ import annotations

import base64
import json
import os
import re
import secrets
import subprocess
import sys

import pytest
import yaml

from linkpass.agent import daemon
from linkpass.control.answers import AnswerRules
from linkpass.agent.coordinator_link import CoordinatorLink
from linkpass.coordinator import lab_ca, startup
from linkpass.control.client import Refusal
from linkpass.control.tls import lab_dir

from support.coordinator import agent_tokens, coordinator_client
from support.fleet import MODEL, identity, table_of
from support.waiting import wait_until


LINKPASS = [sys.executable, "-m", "linkpass.cli"]


def agent_config(tmp_path, srv_url: str, lab: str, fleet_key_file, token_file, **coordinator) -> str:
    doc = {"agent_id": 2, "name": "h1", "fleet_key_file": str(fleet_key_file), "service": "198.18.0.2",
           "nics": [{"plane": 0, "ifname": "p0", "addr": "198.18.64.3"}],
           "peers": [{"name": "h0", "agent_id": 1, "service": "198.18.0.1", "nics": {0: "198.18.64.1"}}],
           "coordinator": {"url": srv_url, "token_file": str(token_file), "ca_file": f"{lab}/ca.crt",
                           "cert_file": f"{lab}/h1.crt", "key_file": f"{lab}/h1.key", "report_ms": 50,
                           **coordinator}}
    path = tmp_path / f"agent-{len(list(tmp_path.glob('agent-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def private_key_parts(path: str) -> list[str]:
    """A PEM private key's base64 lines and their join: what a leak of it would show."""
    lines = [ln for ln in open(path).read().splitlines() if ln and not ln.startswith("-----")]
    return lines + ["".join(lines)]


def forms(secret: str | bytes) -> list[str]:
    """The ways a secret could show up in text: itself, hex either case, base64 of its bytes."""
    raw = secret if isinstance(secret, bytes) else secret.encode()
    out = [raw.hex(), raw.hex().upper(), base64.b64encode(raw).decode().rstrip("="),
           base64.urlsafe_b64encode(raw).decode().rstrip("=")]
    return out + ([secret] if isinstance(secret, str) else [])


def test_no_secret_reaches_a_log_line(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("LINKPASS_LOG_LEVEL", "debug")
    state = tmp_path / "state"
    lab = lab_dir(str(state))
    lab_ca.ensure(lab, clients=["cli", "h1"])  # mutual TLS: the agent shows h1's certificate
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(MODEL.to_dict()))
    srv = startup.start({"state_dir": str(state), "listen": "127.0.0.1:0", "fabric": str(fabric),
                        "require_client_cert": True})
    seen: list[str] = []  # secrets made along the way (the wrong token, the revoked one's successor)
    link = None
    try:
        tokens = {role: (state / f"{role}.token").read_text().strip() for role in ("reader", "operator")}
        tokens.update(agent_tokens(state))

        # the agent's side: its config with a fleet key file and the coordinator's TLS files, loaded
        fleet_key = secrets.token_bytes(32)
        key_file = tmp_path / "fleet.key"
        key_file.write_text(fleet_key.hex() + "\n")
        os.chmod(key_file, 0o600)
        token_file = tmp_path / "h1.token"
        wrong = secrets.token_urlsafe(32)
        seen.append(wrong)
        token_file.write_text(wrong + "\n")
        os.chmod(token_file, 0o600)
        cfg, key, _accept_key = daemon.load(agent_config(tmp_path, srv.url, lab, key_file, token_file))
        assert key == fleet_key
        # ... and the same refused at start: readable by others, too short, a key for another certificate
        os.chmod(key_file, 0o644)
        assert daemon.main(agent_config(tmp_path, srv.url, lab, key_file, token_file)) == 2
        os.chmod(key_file, 0o600)
        short = tmp_path / "short.key"
        short.write_text(fleet_key[:16].hex())
        os.chmod(short, 0o600)
        assert daemon.main(agent_config(tmp_path, srv.url, lab, short, token_file)) == 2
        assert daemon.main(agent_config(tmp_path, srv.url, lab, key_file, token_file, key_file=f"{lab}/cli.key")) == 2

        # the agent's coordinator thread, logging through the agent's own logger: refused with a
        # wrong token, then the right one put in its token_file, then revoked and replaced
        link = CoordinatorLink(cfg.coordinator, lambda: identity(1), lambda: table_of(1), lambda drains: None,
                               lambda plan: None, daemon.log, rules=AnswerRules("h1", 2, 1024))
        link.start()
        wait_until(lambda: link.stats["refusals"] >= 1, 20, "the wrong token refused")
        token_file.write_text(tokens["h1"] + "\n")
        wait_until(lambda: link.registered, 30, "the agent registering with its token")
        out = subprocess.run([*LINKPASS, "coordinator", "token", "h1", "--revoke", "--out", str(token_file),
                              "--state-dir", str(state)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        seen.append(token_file.read_text().strip())
        wait_until(lambda: link.stats["registrations"] >= 2 and link.registered, 30, "the agent's new token taken")

        # requests with good tokens, bad ones, another host's token, and one the handler fails on
        # with the caller's token in its exception (a bug of that kind must still not leak it)
        reader = coordinator_client(srv.url, tokens["reader"], state, client_cert="cli")
        assert reader.get("/v1/status")["agents"] == 1
        operator = coordinator_client(srv.url, tokens["operator"], state, client_cert="cli")
        operator.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "a test", "dry_run": True})
        for token in (tokens["h0"], secrets.token_urlsafe(32), tokens["reader"] + "x"):
            with pytest.raises(Refusal):
                coordinator_client(srv.url, token, state, client_cert="h1").post("/v1/report", {"name": "h0"})

        def broken(now):
            raise RuntimeError(f"a bug that quotes the request: Authorization: Bearer {tokens['reader']}")

        monkeypatch.setattr(srv.service.coordinator, "status", broken)
        with pytest.raises(Refusal, match="internal error"):
            reader.get("/v1/status")
        reader.close()
        operator.close()
    finally:
        if link is not None:
            link.stop()
        srv.close()
        srv.service.coordinator.store.close()
    captured = capfd.readouterr()
    text = captured.out + captured.err

    # the paths ran and logged (so the check below is not of an empty text)
    events = [json.loads(line)["event"] for line in text.splitlines() if line.startswith("{")]
    for event in ("started", "coordinator_refused", "coordinator_token_reloaded", "coordinator_registered",
                  "request_failed", "stopped"):
        assert event in events, (event, events)
    assert len(re.findall(r"^linkpass agent: config error: ", text, re.M)) == 3, text
    assert "Bearer <redacted>" in text  # the handler's bug was logged, its token masked

    secret_texts = [*tokens.values(), *seen, (state / "agent.secret").read_text().strip()]
    leaks = []
    for s in secret_texts:
        leaks += [f for f in forms(s) if f in text]
    leaks += [f for f in forms(fleet_key) + forms(fleet_key[:16]) if f in text]
    leaks += [f for f in forms(bytes.fromhex((state / "agent.secret").read_text().strip())) if f in text]
    for name in sorted(os.listdir(lab)):
        if name.endswith(".key"):
            leaks += [f"{name}: {p[:12]}..." for p in private_key_parts(os.path.join(lab, name)) if p in text]
    assert not leaks, f"secrets in the log: {leaks}"
