"""The coordinator's real endpoint (HTTPS on 127.0.0.1 with the lab CA it makes, SQLite on disk),
without Ray: tokens and roles, refusals logged, garbage bodies answered and counted, the CLI
against it."""
from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.request

import pytest

from linkpass.coordinator import runner
from linkpass.coordinator.client import Refusal

from helpers import MODEL, coordinator_client, identity, lab_ca_file, table_of

pytestmark = pytest.mark.service

LINKPASS = [sys.executable, "-m", "linkpass.cli"]


@pytest.fixture
def server(tmp_path):
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(MODEL.to_dict()))
    srv = runner.start({"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0", "fabric": str(fabric)})
    tokens = {role: (tmp_path / "state" / f"{role}.token").read_text().strip() for role in ("reader", "agent", "operator")}
    srv.state_dir = tmp_path / "state"
    agent = connect(srv, tokens["agent"])
    for i in range(4):
        agent.post("/v1/register", {**identity(i), "paths": table_of(i)})
    try:
        yield srv, tokens
    finally:
        agent.close()
        srv.close()
        srv.coordinator.store.close()


def connect(srv, token):
    return coordinator_client(srv.url, token, srv.state_dir)


def urlopen(srv, req, timeout):
    return urllib.request.urlopen(req, timeout=timeout, context=ssl.create_default_context(cafile=lab_ca_file(srv.state_dir)))


def test_tokens_are_private_and_hashed_at_rest(server, tmp_path):
    srv, tokens = server
    state = tmp_path / "state"
    assert oct(os.stat(state / "operator.token").st_mode & 0o777) == "0o600"
    text = (state / "tokens.yaml").read_text()
    assert all(t not in text for t in tokens.values())


def test_roles(server):
    srv, tokens = server
    reader = connect(srv, tokens["reader"])
    assert reader.get("/v1/status")["agents"] == 4
    with pytest.raises(Refusal) as exc:
        reader.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "x"})
    assert exc.value.status == 403 and "needs role 'operator'" in str(exc.value)
    with pytest.raises(Refusal) as exc:
        reader.post("/v1/report", {"name": "h0"})
    assert exc.value.status == 403
    agent = connect(srv, tokens["agent"])
    with pytest.raises(Refusal):
        agent.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "x"})
    for bad in (None, "not-a-token"):
        with pytest.raises(Refusal) as exc:
            connect(srv, bad).post("/v1/drain", {"link": "p0l0-p0s0", "reason": "x"})
        assert exc.value.status == 401
        with pytest.raises(Refusal):
            connect(srv, bad).get("/v1/status")
    op = connect(srv, tokens["operator"])
    assert op.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "optic"})["changed"]
    refusals = [e for e in op.get("/v1/events", kind="refused")]
    assert {e["actor"] for e in refusals} >= {"local-reader", "local-agent"}
    assert any(e["actor"].startswith("unauthenticated@127.0.0.1") for e in refusals)
    assert srv.coordinator.drains["p0l0-p0s0"]["by"] == "local-operator"
    for c in (reader, agent, op):
        c.close()


def test_garbage_is_answered_and_counted(server):
    srv, tokens = server
    for body in (b"{not json", b"[1,2]", b"\xff\xfe"):
        req = urllib.request.Request(srv.url + "/v1/report", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {tokens['agent']}"})
        with pytest.raises(urllib.error.HTTPError) as exc:
            urlopen(srv, req, timeout=5)
        assert exc.value.code == 400
    agent = connect(srv, tokens["agent"])
    with pytest.raises(Refusal, match="paths\\[\\]\\.id: required"):
        agent.post("/v1/report", {"name": "h0", "paths": [{"peer": "h1"}]})
    assert srv.errors["bad_request"] >= 4
    assert agent.get("/v1/healthz") == {"ok": True}  # still serving
    metrics = urlopen(srv, srv.url + "/metrics", timeout=5).read().decode()
    assert 'linkpass_coordinator_request_errors_total{kind="bad_request"}' in metrics
    assert 'linkpass_coordinator_agents{status="reporting"} 4.0' in metrics
    agent.close()


def cli(srv, token: str, *args):
    env = {**os.environ, "LINKPASS_COORDINATOR": srv.url, "LINKPASS_TOKEN": token, "NO_COLOR": "1",
           "LINKPASS_CA_FILE": lab_ca_file(srv.state_dir)}
    return subprocess.run([*LINKPASS, *args], capture_output=True, text=True, env=env, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(__file__)))


def test_cli_against_the_endpoint(server):
    srv, tokens = server
    out = cli(srv, tokens["reader"], "status")
    assert out.returncode == 0, out.stderr
    assert "fleet ok: 4 agents (0 lost), 40 paths" in out.stdout
    out = cli(srv, tokens["reader"], "drain", "p0l0-p0s0", "--reason", "x")
    assert out.returncode == 2 and "needs role 'operator'" in out.stderr
    out = cli(srv, tokens["operator"], "drain", "h3-p0l1", "--reason", "optic", "--dry-run")
    assert out.returncode == 0 and "would drain h3-p0l1" in out.stdout and "(10 paths)" in out.stdout
    out = cli(srv, tokens["operator"], "drain", "h3-p0l1", "--reason", "optic", "-o", "json")
    assert out.returncode == 0 and json.loads(out.stdout)["changed"] is True
    out = cli(srv, tokens["reader"], "links", "--problems")
    assert out.returncode == 1 and "h3-p0l1" in out.stdout and "drained" in out.stdout
    out = cli(srv, tokens["reader"], "paths", "h0", "h3", "-o", "json")
    assert out.returncode == 0 and len(json.loads(out.stdout)) == 4
    out = cli(srv, tokens["reader"], "events", "--since", "5m", "--kind", "drain")
    assert out.returncode == 0 and "drained: optic" in out.stdout
    out = cli(srv, tokens["operator"], "undrain", "h3-p0l1")
    assert out.returncode == 0 and "undrain h3-p0l1" in out.stdout
    out = cli(srv, tokens["reader"], "status", "--coordinator", "https://127.0.0.1:9")
    assert out.returncode == 3 and "does not answer" in out.stderr


def test_doctor_asks_the_real_coordinator_about_its_token(server, tmp_path):
    from linkpass.doctor import checks as D
    from linkpass.doctor.gather import _ask_coordinator
    from linkpass.agent.config import CoordinatorLinkConfig

    srv, tokens = server
    state = tmp_path / "state"
    bogus = tmp_path / "bogus.token"
    bogus.write_text("not-a-token\n")
    cases = [(srv.url, state / "agent.token", D.OK), (srv.url, state / "reader.token", D.FAIL),
             (srv.url, bogus, D.FAIL), ("https://127.0.0.1:9", state / "agent.token", D.WARN)]
    for url, token_file, want in cases:
        f = D.Facts(coordinator_url=url)
        _ask_coordinator(f, None, CoordinatorLinkConfig(url, str(token_file), ca_file=lab_ca_file(state)))
        check = D.check_coordinator(f)
        assert check.status == want, (url, token_file, check)
