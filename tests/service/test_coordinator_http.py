"""The coordinator's real endpoint (HTTPS on 127.0.0.1 with the lab CA it makes, SQLite on disk),
without Ray: tokens and roles, agents that speak only for themselves, refusals counted and
summarised, garbage bodies answered, bodies never read before the token is checked, a flood of
half-sent requests, the CLI
against it."""
from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from linkpass.coordinator import startup
from linkpass.control.client import Refusal
from linkpass.coordinator.http import json_depth_ok
from linkpass.testbed.prometheus import promtool

from support.coordinator import agent_tokens, coordinator_client, lab_ca_file
from support.fleet import MODEL, identity, table_of
from support.waiting import wait_until


LINKPASS = [sys.executable, "-m", "linkpass.cli"]


def start(tmp_path, **settings):
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(MODEL.to_dict()))
    srv = startup.start({"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0", "fabric": str(fabric),
                        **settings})
    state = tmp_path / "state"
    tokens = {role: (state / f"{role}.token").read_text().strip() for role in ("reader", "operator")}
    tokens.update(agent_tokens(state))
    srv.state_dir = state
    for i in range(4):
        with connect(srv, tokens[f"h{i}"]) as agent:
            agent.post("/v1/register", {**identity(i), "paths": table_of(i)})
    return srv, tokens


@pytest.fixture
def server(tmp_path):
    srv, tokens = start(tmp_path)
    try:
        yield srv, tokens
    finally:
        srv.close()
        srv.service.coordinator.store.close()


def connect(srv, token, **kw):
    return coordinator_client(srv.url, token, srv.state_dir, **kw)


def urlopen(srv, req, timeout):
    return urllib.request.urlopen(req, timeout=timeout, context=ssl.create_default_context(cafile=lab_ca_file(srv.state_dir)))


def raw_request(srv, head: bytes, body: bytes = b"", timeout_s: float = 10.0) -> tuple[int, dict]:
    """One request on a fresh socket, sent as given; the status and JSON answer."""
    with tls_socket(srv, timeout_s) as sk:
        sk.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sk.recv(65536)
            if not chunk:
                break
            data += chunk
        head_out, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head_out.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            chunk = sk.recv(65536)
            if not chunk:
                break
            rest += chunk
    return int(head_out.split(b" ")[1]), json.loads(rest[:length])


def post_head(path: str, length: int, token: str | None = None, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def tls_socket(srv, timeout_s: float) -> ssl.SSLSocket:
    """A connection to the endpoint with the TLS handshake done, nothing sent yet."""
    ctx = ssl.create_default_context(cafile=lab_ca_file(srv.state_dir))
    return ctx.wrap_socket(socket.create_connection(srv.address, timeout=timeout_s), server_hostname=srv.address[0])


def test_tokens_are_private_and_hashed_at_rest(server, tmp_path):
    srv, tokens = server
    state = tmp_path / "state"
    for name in ("operator.token", "reader.token", "agent.secret"):
        assert oct(os.stat(state / name).st_mode & 0o777) == "0o600", name
    assert not (state / "agent.token").exists()  # no token speaks for every agent
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
    agent = connect(srv, tokens["h0"])
    for path, body in (("/v1/drain", {"link": "p0l0-p0s0", "reason": "x"}), ("/v1/decommission", {"host": "h1", "reason": "x"})):
        with pytest.raises(Refusal) as exc:
            agent.post(path, body)
        assert exc.value.status == 403 and "needs role 'operator'" in str(exc.value)
    for bad in (None, "not-a-token"):
        with pytest.raises(Refusal) as exc:
            connect(srv, bad).post("/v1/drain", {"link": "p0l0-p0s0", "reason": "x"})
        assert exc.value.status == 401
        with pytest.raises(Refusal):
            connect(srv, bad).get("/v1/status")
    op = connect(srv, tokens["operator"])
    with pytest.raises(Refusal) as exc:  # operators drain; only agents report
        op.post("/v1/report", {"name": "h0"})
    assert exc.value.status == 403 and "needs role 'agent'" in str(exc.value)
    assert op.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "optic"})["changed"]
    srv.service.flush_refusals()
    refusals = op.get("/v1/events", kind="refused")
    assert {e["actor"] for e in refusals if e["subject"] == "/v1/drain"} >= {"local-reader", "h0"}
    # the unauthenticated ones are one summary, not one event each
    summary = [e for e in refusals if e["actor"] == "unauthenticated"]
    assert len(summary) == 1 and summary[0]["detail"]["requests"] == 4
    assert summary[0]["detail"]["by_address"] == {"127.0.0.1": 4}
    assert srv.service.coordinator.drains["p0l0-p0s0"]["by"] == "local-operator"
    assert op.get("/v1/whoami") == {"name": "local-operator", "role": "operator", "host": None}
    assert agent.get("/v1/whoami") == {"name": "h0", "role": "agent", "host": "h0"}
    for c in (reader, agent, op):
        c.close()


def test_an_agent_speaks_only_for_itself(server):
    srv, tokens = server
    c = srv.service.coordinator
    before = (sorted(c.paths), {n: a.last_seen for n, a in c.agents.items()}, len(c.store.events(limit=10**6)))
    h1 = connect(srv, tokens["h1"])
    bad_paths = [dict(p, state="down", reason="hard_failure") for p in table_of(2)]
    for path, body in (("/v1/register", {**identity(2), "paths": bad_paths}),
                       ("/v1/report", {"name": "h2", "paths": bad_paths}),
                       ("/v1/report", {"name": "ghost"})):
        with pytest.raises(Refusal) as exc:
            h1.post(path, body)
        assert exc.value.status == 403, path
        assert "the token of agent 'h1' cannot speak for" in str(exc.value)
    assert (sorted(c.paths), {n: a.last_seen for n, a in c.agents.items()}) == before[:2]
    assert all(r.state == "up" for r in c.paths.values())
    # a token whose MAC is another host's, or that was edited, names nobody
    mac = tokens["h1"].rpartition(".")[2]
    # one character of the MAC changed, mid-way (the last one carries padding bits; and a fixed
    # ending could be the token's own, 1 in 4 096)
    t = tokens["h1"]
    edited = t[:-10] + ("B" if t[-10] == "A" else "A") + t[-9:]
    for forged in (f"lpa1.h2.{mac}", edited, "lpa1.h1", "lpa1..x"):
        with pytest.raises(Refusal) as exc:
            connect(srv, forged).post("/v1/report", {"name": "h2"})
        assert exc.value.status == 401, forged
    assert h1.post("/v1/report", {"name": "h1"})["drain_version"] == 0  # itself, fine
    srv.service.flush_refusals()
    spoof = [e for e in c.store.events(kinds=["refused"]) if e["actor"] == "h1"]
    assert len(spoof) == 3 and "cannot speak for 'h2'" in spoof[0]["detail"]["why"]
    h1.close()


def test_a_shared_agent_token_is_refused_at_start(tmp_path):
    from linkpass.coordinator.auth import token_hash
    from linkpass.control.errors import CoordinatorError

    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "tokens.yaml").write_text(
        f"tokens:\n  - {{name: fleet-agents, role: agent, sha256: {token_hash('t')}}}\n")
    with pytest.raises(CoordinatorError, match=r"tokens\[0\]\.host: an agent token speaks for one host.*"
                                               "`linkpass coordinator token HOST`"):
        start(tmp_path)
    (tmp_path / "state" / "tokens.yaml").write_text(
        f"tokens:\n  - {{name: h7-static, role: agent, host: h7, sha256: {token_hash('t7')}}}\n")
    srv = startup.start({"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0"})
    srv.state_dir = tmp_path / "state"
    try:
        with connect(srv, "t7") as c:
            assert c.get("/v1/whoami") == {"name": "h7-static", "role": "agent", "host": "h7"}
            with pytest.raises(Refusal, match="cannot speak for 'h0'"):
                c.post("/v1/register", {**identity(0), "paths": []})
    finally:
        srv.close()
        srv.service.coordinator.store.close()


def test_garbage_is_answered_and_counted(server):
    srv, tokens = server
    for body in (b"{not json", b"[1,2]", b"\xff\xfe"):
        req = urllib.request.Request(srv.url + "/v1/report", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {tokens['h0']}"})
        with pytest.raises(urllib.error.HTTPError) as exc:
            urlopen(srv, req, timeout=5)
        assert exc.value.code == 400
    agent = connect(srv, tokens["h0"])
    with pytest.raises(Refusal, match="paths\\[0\\]\\.id: required"):
        agent.post("/v1/report", {"name": "h0", "paths": [{"peer": "h1"}]})
    assert srv.errors["bad_request"] >= 4
    assert agent.get("/v1/healthz") == {"ok": True}  # still serving
    metrics = connect(srv, tokens["reader"]).get("/metrics").decode()
    assert 'linkpass_coordinator_request_errors_total{kind="bad_request"}' in metrics
    assert 'linkpass_coordinator_agents{status="reporting"} 4.0' in metrics
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    timed = {s.labels["path"]: s.value for s in families["linkpass_coordinator_request_duration_seconds"].samples
             if s.name.endswith("_count")}
    assert timed["/v1/report"] >= 4 and "/v1/nowhere" not in timed  # refused bodies are timed too
    assert [s.value for s in families["linkpass_coordinator_agent_up"].samples] == [1.0] * 4
    assert families["linkpass_coordinator_requests_pending"].samples[0].value == 1  # this scrape itself
    assert "process_cpu_seconds" in families and "linkpass_build_info" in families
    lint = promtool("check", "metrics", stdin=metrics)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    agent.close()


def cli(srv, token: str, *args):
    env = {**os.environ, "LINKPASS_COORDINATOR": srv.url, "LINKPASS_TOKEN": token, "NO_COLOR": "1",
           "LINKPASS_CA_FILE": lab_ca_file(srv.state_dir)}
    return subprocess.run([*LINKPASS, *args], capture_output=True, text=True, env=env, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_cli_against_the_endpoint(server):
    srv, tokens = server
    out = cli(srv, tokens["reader"], "status")
    assert out.returncode == 0, out.stderr
    assert "fleet ok: 4 agents (0 lost), 40 paths" in out.stdout
    out = cli(srv, tokens["reader"], "drain", "p0l0-p0s0", "--reason", "x")
    assert out.returncode == 3 and "needs role 'operator'" in out.stderr  # an auth refusal: UNKNOWN (docs/cli.md)
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
    own = tmp_path / "h0.token"
    own.write_text(tokens["h0"] + "\n")
    cases = [(srv.url, own, D.OK), (srv.url, state / "reader.token", D.FAIL),
             (srv.url, bogus, D.FAIL), ("https://127.0.0.1:9", own, D.WARN)]
    for url, token_file, want in cases:
        f = D.Facts(coordinator_url=url)
        _ask_coordinator(f, None, CoordinatorLinkConfig(url, str(token_file), ca_file=lab_ca_file(state)))
        check = D.check_coordinator(f)
        assert check.status == want, (url, token_file, check)


def test_no_body_is_read_before_the_token_is_checked(server):
    """A 12 MB body without a token: refused from the head alone (the body is never sent here, so
    a server that waited for it would not answer)."""
    srv, tokens = server
    events = len(srv.service.coordinator.store.events(limit=10**6))
    for path in ("/v1/report", "/v1/drain", "/v1/register"):
        status, doc = raw_request(srv, post_head(path, 12 << 20))
        assert status == 401 and "no valid token" in doc["error"], path
        status, doc = raw_request(srv, post_head(path, 12 << 20, tokens["reader"]))
        assert status == 403, path
    # nothing written per unauthenticated refusal: one summary; of the reader's, only the refused
    # drain is recorded (refused drains of known callers are)
    srv.service.flush_refusals()
    new = srv.service.coordinator.store.events(limit=10**6)[events:]
    assert sorted((e["actor"], e["subject"]) for e in new) == [("local-reader", "/v1/drain"),
                                                               ("unauthenticated", "endpoint")]
    assert next(e for e in new if e["actor"] == "unauthenticated")["detail"]["requests"] == 3


def test_bodies_over_the_cap_are_refused_before_they_are_read(tmp_path):
    srv, tokens = start(tmp_path, max_body_bytes=64 << 10)
    try:
        status, doc = raw_request(srv, post_head("/v1/report", (64 << 10) + 1, tokens["h0"]))
        assert status == 413 and "max_body_bytes (65536)" in doc["error"]
        chunked = (f"POST /v1/report HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tokens['h0']}\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n").encode()
        status, doc = raw_request(srv, chunked)
        assert status == 411 and "send Content-Length" in doc["error"]
        status, doc = raw_request(srv, post_head("/v1/report", 5, tokens["h0"], "Content-Length: 6\r\n"), b"{}")
        assert status == 400 and "given twice" in doc["error"]
        # at the cap exactly: read and parsed
        body = json.dumps({"name": "h0", "pad": "x" * ((64 << 10) - 30)}).encode()[:64 << 10]
        body = body[:-2] + b'"}' if not body.endswith(b'"}') else body
        status, doc = raw_request(srv, post_head("/v1/report", len(body), tokens["h0"]), body)
        assert status == 200, doc
        assert srv.errors["too_large"] == 1 and srv.errors["length_required"] == 1
    finally:
        srv.close()
        srv.service.coordinator.store.close()


@pytest.mark.parametrize("path,body,words", [
    ("/v1/register", {**identity(0), "agent_id": 2**70, "paths": []}, "agent_id: expected an integer"),
    ("/v1/report", {"name": "h0", "changes": 5}, "changes: expected a list"),
    ("/v1/report", {"name": "h0", "paths": [table_of(0)[0], dict(table_of(0)[1], hops=["nope"])]},
     r"paths\[1\]\.hops\[0\]: expected an IP address"),
    ("/v1/drain", {"link": "p0l0-p0s0", "reason": "x", "dry_run": "false"}, "dry_run: expected true or false"),
    ("/v1/decommission", {"host": "h3"}, "reason"),
    # what reaches an operator's terminal is printable: no OSC 52 (clipboard), no fake colours
    ("/v1/report", {"name": "h0", "changes": [{"id": 0, "state": "down", "reason": "x\x1b]52;c;aGk=\x07"}]},
     r"changes\[0\]\.reason: printable characters only; got '\\x1b' at position 1"),
    ("/v1/report", {"name": "h0", "paths": [dict(table_of(0)[0], reason="\u202eevil")]},
     r"paths\[0\]\.reason: printable characters only"),
    ("/v1/register", {**identity(0), "version": "\x1b[32m0.1.0", "paths": []}, "version: printable characters only"),
    ("/v1/drain", {"link": "p0l0-p0s0", "reason": "planned\r\nfake line"}, "reason: printable characters only"),
])
def test_bad_fields_are_400s_naming_the_field(server, path, body, words):
    srv, tokens = server
    who = tokens["operator"] if path in ("/v1/drain", "/v1/decommission") else tokens["h0"]
    before = sorted((k, r.state, r.hops) for k, r in srv.service.coordinator.paths.items())
    with connect(srv, who) as c, pytest.raises(Refusal, match=words) as exc:
        c.post(path, body)
    assert exc.value.status == 400
    assert sorted((k, r.state, r.hops) for k, r in srv.service.coordinator.paths.items()) == before
    assert srv.service.coordinator.drains == {} and len(srv.service.coordinator.agents) == 4
    assert srv.errors["internal"] == 0


def test_deep_json_and_odd_queries_are_400s(server):
    srv, tokens = server
    deep = b'{"name": "h0", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, doc = raw_request(srv, post_head("/v1/report", len(deep), tokens["h0"]), deep)
    assert status == 400 and "nested deeper than 32 levels" in doc["error"]
    shallow = b'{"name": "h0", "x": ' + b"[" * 30 + b'"[[[[["' + b"]" * 30 + b"}"  # brackets in strings do not count
    assert raw_request(srv, post_head("/v1/report", len(shallow), tokens["h0"]), shallow)[0] == 200
    with connect(srv, tokens["reader"]) as c:
        for q, field in ((dict(limit="nan"), "limit"), (dict(limit="inf"), "limit"), (dict(limit=-1), "limit"),
                         (dict(limit=10**6), "limit: expected 1..10000"), (dict(after="1e30"), "after"),
                         (dict(after="²"), "after"), (dict(limit="٣"), "limit"),
                         (dict(since="nan"), "since"), (dict(kind="nope"), "kind")):
            with pytest.raises(Refusal, match=field) as exc:
                c.get("/v1/events", **q)
            assert exc.value.status == 400, q
        for q, words in ((dict(host="../x"), "host: expected a host name"), ({}, "host: required")):
            with pytest.raises(Refusal, match=words):
                c.get("/v1/plan", **q)
        assert len(c.get("/v1/events", limit=10_000)) <= 10_000
    assert srv.errors["internal"] == 0


def reference_depth(doc) -> int:
    if isinstance(doc, dict):
        return 1 + max(map(reference_depth, doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max(map(reference_depth, doc), default=0)
    return 0


def test_the_depth_check_agrees_with_the_parser_on_valid_json():
    """Every valid document: the check passes exactly when the parsed document nests at most
    max_depth containers, strings full of brackets, quotes and backslashes included."""
    import random

    rng = random.Random(7)
    tricky = ['"', "\\", "[", "]", "{", "}", "\\\"", "a", "\u005b", "\\["]

    def doc(depth):
        if depth == 0 or rng.random() < 0.2:
            return "".join(rng.choice(tricky) for _ in range(rng.randrange(6)))
        if rng.random() < 0.5:
            return [doc(depth - 1) for _ in range(rng.randrange(1, 3))]
        return {f"k{i}{rng.choice(tricky)}": doc(depth - 1) for i in range(rng.randrange(1, 3))}

    for _ in range(3000):
        d = doc(rng.randrange(1, 12))
        raw = json.dumps(d, ensure_ascii=rng.random() < 0.5).encode()
        for limit in (1, 3, 6, 10):
            assert json_depth_ok(raw, limit) == (reference_depth(d) <= limit), (raw, limit)


def test_a_body_built_to_be_slow_to_check_does_not_hold_the_coordinator(server):
    """Unterminated escaped quotes and more brackets than the limit: the check is linear, so a
    64 KiB body of them is refused at once and the coordinator answers everyone meanwhile."""
    srv, tokens = server
    evil = b'{"name": "h0", "x": "' + b'\\"' * (32 << 10) + b"[" * 40
    done = threading.Event()

    def send():
        try:
            status, doc = raw_request(srv, post_head("/v1/report", len(evil), tokens["h0"]), evil, timeout_s=60)
            assert status == 400
        finally:
            done.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    t0 = time.monotonic()
    answered = 0
    while not done.is_set() and time.monotonic() - t0 < 60:
        assert raw_request(srv, b"GET /v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n", timeout_s=2.0)[0] == 200
        answered += 1
    assert done.wait(10)
    # the old check took ~17 s on this body, holding the loop: every health check above would time out
    assert time.monotonic() - t0 < 5.0, "checking one 64 KiB body took seconds"
    assert srv.errors["internal"] == 0


def test_no_body_is_parsed_under_the_coordinator_lock(server, monkeypatch):
    """Parsing and checking a body is the request's own cost: it happens before the lock that
    serialises every request is taken, whichever thread runs it."""
    from linkpass.coordinator import http as coordinator_http

    srv, tokens = server
    held = []
    real = coordinator_http._json_body

    def spy(raw, max_depth):
        held.append(srv.service.lock._is_owned())
        return real(raw, max_depth)

    monkeypatch.setattr(coordinator_http, "_json_body", spy)
    with connect(srv, tokens["h0"]) as agent:
        for _ in range(5):
            agent.post("/v1/report", {"name": "h0"})
    with connect(srv, tokens["operator"]) as op:
        with pytest.raises(Refusal):
            op.post("/v1/drain", {"link": "no-such-link"})
    assert len(held) >= 6 and not any(held)


def test_anonymous_metrics_are_counts_that_name_no_host_or_link_and_take_no_lock(server):
    """Without a token /metrics has the counts (what a fleet-wide alert needs), none of the series
    that name hosts and links, and it is answered while the coordinator's lock is held elsewhere;
    with a reader's token it has them too. A wrong token is refused, not served as anonymous."""
    srv, tokens = server
    with connect(srv, tokens["h1"]) as agent:
        agent.post("/v1/report", {"name": "h1", "changes": [{"id": 1, "state": "down", "reason": "loss"}]})
    with srv.service.lock:  # the lock every request against the coordinator takes: anonymous scrapes never do
        anonymous = urlopen(srv, srv.url + "/metrics", timeout=5).read().decode()
        spec = json.loads(urlopen(srv, srv.url + "/v1/openapi.json", timeout=5).read())
    names = {f.name for f in text_string_to_metric_families(anonymous)}
    assert "linkpass_coordinator_agent_up" not in names and "linkpass_coordinator_link_fault" not in names
    assert not any(f"h{i}" in anonymous for i in range(4)) and "p0l" not in anonymous
    assert 'linkpass_coordinator_paths{state="down"} 1.0' in anonymous
    assert 'linkpass_coordinator_agents{status="reporting"} 4.0' in anonymous
    assert "/metrics" in spec["paths"]
    named = connect(srv, tokens["reader"]).get("/metrics").decode()
    assert 'linkpass_coordinator_agent_up{host="h1"} 1.0' in named
    assert 'linkpass_coordinator_paths{state="down"} 1.0' in named
    with pytest.raises(urllib.error.HTTPError) as exc:
        urlopen(srv, urllib.request.Request(srv.url + "/metrics", headers={"Authorization": "Bearer nope"}), 5)
    assert exc.value.code == 401


def test_the_path_counts_kept_as_paths_change_match_a_count_of_every_path(server):
    """The counts /metrics and status read are kept as reports come, not counted at each read:
    after registrations, changes, a re-registration and a decommission they equal a full count."""
    import collections
    import random

    srv, tokens = server
    rng = random.Random(3)
    for round_ in range(30):
        host = f"h{rng.randrange(4)}"
        with connect(srv, tokens[host]) as agent:
            if round_ == 12:
                agent.post("/v1/register", {**identity(int(host[1:])), "paths": table_of(int(host[1:]))[:5]})
                continue
            changes = [{"id": rng.randrange(1, 11), "state": rng.choice(["up", "down", "suspect", "degraded"]),
                        "reason": None} for _ in range(3)]
            agent.post("/v1/report", {"name": host, "changes": changes})
    with connect(srv, tokens["operator"]) as op:
        op.post("/v1/decommission", {"host": "h3", "reason": "rebuilt"})
    c = srv.service.coordinator
    with srv.service.lock:
        truth = collections.Counter(rec.state for rec in c.paths.values())
        assert dict(c.state_counts) == dict(truth) and sum(truth.values()) == len(c.paths)
        assert c.paths_unmapped == sum(1 for rec in c.paths.values() if not rec.links)


def test_decommission_over_http_and_the_cli(server):
    srv, tokens = server
    out = cli(srv, tokens["reader"], "coordinator", "decommission", "h3", "--reason", "retired")
    assert out.returncode == 3 and "needs role 'operator'" in out.stderr
    out = cli(srv, tokens["operator"], "coordinator", "decommission", "h3", "--reason", "retired", "--dry-run")
    assert out.returncode == 0 and "would forget agent h3 and the 10 paths" in out.stdout
    assert "h3" in srv.service.coordinator.agents
    out = cli(srv, tokens["operator"], "coordinator", "decommission", "h3", "--reason", "retired")
    assert out.returncode == 0 and "forgot agent h3" in out.stdout, out.stderr
    assert "h3" not in srv.service.coordinator.agents
    out = cli(srv, tokens["operator"], "coordinator", "decommission", "h3", "--reason", "again")
    assert out.returncode == 3 and "no agent named 'h3'" in out.stderr


def test_each_refusal_names_its_kind_for_programs_to_match(server):
    """A refusal carries a kind (control/errors.py) besides its message: the agent matches
    `not_registered` to register again, never the message's words, which are for people."""
    from linkpass.control.client import Refusal

    srv, tokens = server
    with connect(srv, tokens["operator"]) as op:
        op.post("/v1/decommission", {"host": "h3", "reason": "retired"})
        with pytest.raises(Refusal) as missing:
            op.post("/v1/drain", {"link": "p9l9-p9s9", "reason": "x"})
    with connect(srv, tokens["h3"]) as h3:
        with pytest.raises(Refusal) as forgotten:
            h3.post("/v1/report", {"name": "h3", "changes": [{"id": 1, "state": "down", "reason": "hard_failure"}]})
        with pytest.raises(Refusal) as bad:
            h3.post("/v1/report", {"name": "h3", "changes": [{"id": 1, "state": "sideways"}]})
    assert (forgotten.value.status, forgotten.value.kind) == (404, "not_registered")
    assert (missing.value.status, missing.value.kind) == (404, "not_found")
    assert (bad.value.status, bad.value.kind) == (400, "bad_request")


def test_who_may_ask_is_refused_with_a_kind_too(server):
    """The endpoint's own refusals of a caller carry a kind as the service's do: no valid token is
    `unauthenticated`; a token that may not do this is `forbidden`, naming the role that may when
    the role is what is wrong. The CLI matches these, never the message's words."""
    srv, tokens = server
    with pytest.raises(Refusal) as nobody:
        connect(srv, "not-a-token").get("/v1/status")
    assert (nobody.value.status, nobody.value.kind) == (401, "unauthenticated")
    with connect(srv, tokens["reader"]) as reader, pytest.raises(Refusal) as role:
        reader.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "x"})
    assert (role.value.status, role.value.kind, role.value.doc) == (403, "forbidden", {"needs_role": "operator"})
    with connect(srv, tokens["h0"]) as h0, pytest.raises(Refusal) as other:
        h0.post("/v1/report", {"name": "h1"})
    assert (other.value.status, other.value.kind, other.value.doc) == (403, "forbidden", {})
    status, doc = raw_request(srv, b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, doc["kind"]) == (404, "not_found"), doc


def test_agent_token_command(server, tmp_path):
    srv, tokens = server
    out = subprocess.run([*LINKPASS, "coordinator", "token", "h2", "--state-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == tokens["h2"]
    dest = tmp_path / "h2.token"
    out = subprocess.run([*LINKPASS, "coordinator", "token", "h2", "--state-dir", str(tmp_path / "state"),
                          "--out", str(dest)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and oct(os.stat(dest).st_mode & 0o777) == "0o600"
    with connect(srv, dest.read_text().strip()) as c:
        assert c.get("/v1/whoami")["host"] == "h2"
    out = subprocess.run([*LINKPASS, "coordinator", "token", "a/b", "--state-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "expected a host name" in out.stderr


def test_refusals_are_rate_limited_and_summarised(tmp_path):
    srv, tokens = start(tmp_path, refusal_burst=20, refusal_rate_per_s=1.0)
    try:
        before = len(srv.service.coordinator.store.events(limit=10**6))
        codes = []
        t0 = time.monotonic()
        with connect(srv, None) as anon:
            for _ in range(200):
                try:
                    anon.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "x"})
                except Refusal as exc:
                    codes.append(exc.status)
        refill = (time.monotonic() - t0) * 1.0 + 1  # refusal_rate_per_s over the run (each 429 costs a handshake)
        assert codes.count(401) <= 20 + refill and codes.count(429) >= 200 - 20 - refill  # the burst, then the refill
        srv.service.flush_refusals()
        new = srv.service.coordinator.store.events(limit=10**6)[before:]
        assert len(new) == 1 and new[0]["actor"] == "unauthenticated" and new[0]["detail"]["requests"] == len(codes)
        metrics = urlopen(srv, srv.url + "/metrics", timeout=5).read().decode()
        assert f'linkpass_coordinator_request_errors_total{{kind="unauthenticated"}} {float(len(codes))}' in metrics
        assert f'linkpass_coordinator_request_errors_total{{kind="rate_limited"}} {float(codes.count(429))}' in metrics
        with connect(srv, tokens["reader"]) as c:  # known callers from elsewhere are not held back
            assert c.get("/v1/status")["agents"] == 4
    finally:
        srv.close()
        srv.service.coordinator.store.close()


def test_a_flood_of_half_sent_requests_does_not_lock_anyone_out(tmp_path):
    """More half-sent requests than the server keeps connections: an authenticated call still gets
    its answer, and the server itself closes what was never finished."""
    srv, tokens = start(tmp_path, max_connections=64, read_timeout_s=1.0, idle_timeout_s=2.0)
    socks = []
    try:
        for i in range(300):
            sk = tls_socket(srv, 10)  # handshake done: what a flood costs is the request it never finishes
            sk.sendall(b"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Le" if i % 2 else b"G")
            socks.append(sk)
        with connect(srv, tokens["reader"], timeout_s=30) as c:
            assert c.get("/v1/status")["agents"] == 4
        with connect(srv, tokens["h0"], timeout_s=30) as c:
            assert "drain_version" in c.post("/v1/report", {"name": "h0"})

        def all_closed():
            for sk in socks:
                sk.settimeout(0.01)
                try:
                    if sk.recv(1) != b"":
                        return False
                except (TimeoutError, BlockingIOError):
                    return False
                except (ConnectionError, ssl.SSLError):
                    pass
            return True
        wait_until(all_closed, 30, "the server closes every half-sent request")
        assert srv.errors["evicted"] + srv.errors["timeout"] >= 300 - 64
        with connect(srv, tokens["reader"]) as c:
            assert c.get("/v1/status")["agents"] == 4
    finally:
        for sk in socks:
            sk.close()
        srv.close()
        srv.service.coordinator.store.close()



def token_cli(state, *args):
    return subprocess.run([*LINKPASS, "coordinator", "token", *args, "--state-dir", str(state)], capture_output=True,
                          text=True, timeout=60)


def refusal_of(srv, token, path="/v1/whoami"):
    """The Refusal a GET with `token` gets, or None if it is answered."""
    with connect(srv, token) as c:
        try:
            c.get(path)
        except Refusal as exc:
            return exc
    return None


def test_one_host_s_token_is_revoked_and_nothing_else_changes(server, tmp_path):
    srv, tokens = server
    state, old = tmp_path / "state", tokens["h1"]
    assert refusal_of(srv, old) is None
    out = token_cli(state, "h1", "--revoke", "--reason", "key left on a laptop")
    assert out.returncode == 0, out.stderr
    new = out.stdout.strip()
    assert new.startswith("lpa1.h1.1.") and "revoked every earlier agent token of h1" in out.stderr
    # the running coordinator reads the revocation from its store within a tick
    exc = wait_until(lambda: refusal_of(srv, old), 10, "the running coordinator refusing h1's old token")
    assert exc.status == 401 and "the agent token of h1 was revoked" in str(exc)
    assert exc.kind == "unauthenticated"  # revoked is one way of having no valid token
    assert old.rpartition(".")[2] not in str(exc) and "lpa1." not in str(exc)  # no secret material
    with connect(srv, old) as c, pytest.raises(Refusal, match="was revoked") as exc:
        c.post("/v1/report", {"name": "h1"})
    assert exc.value.status == 401
    with connect(srv, new) as c:
        assert c.get("/v1/whoami") == {"name": "h1", "role": "agent", "host": "h1"}
        assert "drain_version" in c.post("/v1/report", {"name": "h1"})
    for host in ("h0", "h2", "h3"):  # every other host, and the fleet's state, as they were
        with connect(srv, tokens[host]) as c:
            assert "drain_version" in c.post("/v1/report", {"name": host})
    assert len(srv.service.coordinator.agents) == 4 and refusal_of(srv, tokens["reader"]) is None
    revoked = srv.errors["revoked"]
    assert revoked >= 2 and srv.errors["unauthenticated"] == 0
    metrics = urlopen(srv, srv.url + "/metrics", timeout=5).read().decode()
    assert f'linkpass_coordinator_request_errors_total{{kind="revoked"}} {float(revoked)}' in metrics
    # the history: who revoked and why, once; the refusals as one summary, not an event each
    srv.service.flush_refusals()
    events = srv.service.coordinator.store.events(kinds=["agent", "refused"])
    done = [e for e in events if e["detail"].get("what") == "token revoked"]
    assert len(done) == 1 and done[0]["subject"] == "h1" and done[0]["actor"].endswith("(local)")
    assert done[0]["detail"] == {"what": "token revoked", "epoch": 1, "reason": "key left on a laptop"}
    summary = [e for e in events if e["actor"] == "revoked"]
    assert len(summary) == 1 and summary[0]["detail"]["by_host"] == {"h1": revoked}
    # the token command gives the current epoch's token from now on; other hosts' are unchanged
    assert token_cli(state, "h1").stdout.strip() == new
    assert token_cli(state, "h2").stdout.strip() == tokens["h2"]


def test_a_revocation_works_with_the_coordinator_down_and_outlives_restarts(tmp_path):
    srv, tokens = start(tmp_path)
    state = tmp_path / "state"
    srv.close()
    srv.service.coordinator.store.close()
    first = token_cli(state, "h1", "--revoke")
    second = token_cli(state, "h1", "--revoke")
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert second.stdout.strip().startswith("lpa1.h1.2.")
    srv = startup.start({"state_dir": str(state), "listen": "127.0.0.1:0"})
    srv.state_dir = state
    try:
        for stale in (tokens["h1"], first.stdout.strip()):  # refused from the first request on
            exc = refusal_of(srv, stale)
            assert exc is not None and exc.status == 401 and "h1 was revoked" in str(exc)
        assert refusal_of(srv, second.stdout.strip()) is None
        assert refusal_of(srv, tokens["h2"]) is None
    finally:
        srv.close()
        srv.service.coordinator.store.close()


def test_the_token_command_refuses_bad_usage_and_then_changes_nothing(server, tmp_path):
    srv, tokens = server
    state = tmp_path / "state"
    out = token_cli(state, "h1", "--reason", "x")
    assert out.returncode == 3 and "--reason: only with --revoke" in out.stderr
    out = token_cli(state, "a/b", "--revoke")
    assert out.returncode == 3 and "expected a host name" in out.stderr
    nowhere = tmp_path / "nowhere"
    out = token_cli(nowhere, "h1", "--revoke")
    assert out.returncode == 3 and "agent.secret" in out.stderr and not nowhere.exists()
    with srv.service.lock:
        assert srv.service.coordinator.store.agent_epochs() == {}
    assert refusal_of(srv, tokens["h1"]) is None


def test_an_agent_takes_the_new_token_put_in_its_token_file(server, tmp_path):
    """After a revocation the agent is refused; once its token_file holds the new token, it
    registers again without a restart."""
    from linkpass.control.answers import AnswerRules
    from linkpass.agent.config import CoordinatorLinkConfig
    from linkpass.agent.coordinator_link import CoordinatorLink

    srv, tokens = server
    state, token_file = tmp_path / "state", tmp_path / "h1.token"
    token_file.write_text(tokens["h1"] + "\n")
    logged = []
    cfg = CoordinatorLinkConfig(srv.url, str(token_file), report_ms=50, ca_file=lab_ca_file(state))
    link = CoordinatorLink(cfg, lambda: identity(1), lambda: table_of(1), lambda drains: None, lambda plan: None,
                           lambda event, **fields: logged.append((event, fields)), rules=AnswerRules("h1", 2, 1024))
    link.start()
    try:
        wait_until(lambda: link.stats["registrations"] >= 1, 10, "the agent registering")
        out = token_cli(state, "h1", "--revoke", "--out", str(token_file))
        assert out.returncode == 0, out.stderr
        new = token_file.read_text().strip()
        assert new.startswith("lpa1.h1.1.")
        wait_until(lambda: any(e == "coordinator_token_reloaded" for e, _ in logged), 20,
                   "the agent reading its new token", lambda: logged[-5:])
        assert link.client.token == new
        wait_until(lambda: link.stats["registrations"] >= 2 and link.registered, 20, "the agent registering again")
    finally:
        link.stop()


def test_a_timed_drain_and_the_history_of_one_link_through_the_cli(server):
    srv, tokens = server
    out = cli(srv, tokens["operator"], "drain", "p0l0-p0s1", "--reason", "optic swap", "--for", "2h")
    assert out.returncode == 0, out.stderr
    assert "drain p0l0-p0s1, until " in out.stdout and "(then undrained by itself)" in out.stdout
    with srv.service.lock:
        d = srv.service.coordinator.drains["p0l0-p0s1"]
        assert 7190 < d["until"] - d["since"] <= 7200
    out = cli(srv, tokens["operator"], "drain", "p1l0-p1s1", "--reason", "x", "--for", "soon")
    assert out.returncode == 3 and "--for 'soon': use a duration such as 30m" in out.stderr and out.stdout == ""
    out = cli(srv, tokens["operator"], "drain", "p1l0-p1s1", "--reason", "x", "--for", "10s")
    assert out.returncode == 3 and "for_s: a timed drain lasts 60 s" in out.stderr
    out = cli(srv, tokens["reader"], "events", "--link", "p0l0-p0s1", "-o", "json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [e["kind"] for e in rows] == ["drain"] and rows[0]["detail"]["for_s"] == 7200
    out = cli(srv, tokens["reader"], "events", "--host", "h2", "-o", "json")
    assert out.returncode == 0 and all(e["actor"] == "h2" or e["subject"].split("/")[0] == "h2"
                                       for e in json.loads(out.stdout))


def test_a_person_gets_an_operator_token_their_drains_carry_their_name_and_revoking_it_works(server, tmp_path):
    """`token create alice --role operator` on the coordinator's host: the running coordinator takes
    it at its next tick (no restart), alice's drain is recorded as alice's, `token list` shows her
    without any hash, and `token revoke alice` makes her token refused again."""
    srv, tokens = server
    state = str(srv.state_dir)

    def token(*args):
        return subprocess.run([*LINKPASS, "coordinator", "token", *args, "--state-dir", state], capture_output=True,
                              text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

    def answered(out) -> bool:
        # status exits with the fleet's state (0-2) once the token is taken, 3 when it is refused; the
        # fixture's agents count as lost (2) after 10 s, which this test can outlast on a loaded machine
        return out.returncode in (0, 1, 2)

    made = token("create", "alice", "--role", "operator")
    assert made.returncode == 0, made.stderr
    alice = made.stdout.strip()
    assert len(alice) >= 40 and "shown once" in made.stderr
    assert token("create", "alice", "--role", "reader").returncode == 3  # one token per name
    bad = token("create", "bob smith", "--role", "operator")
    assert bad.returncode == 3 and "is not a token name" in bad.stderr
    assert token("create", "bob").returncode == 3  # --role is required
    wait_until(lambda: answered(cli(srv, alice, "status")), 10, "the coordinator taking alice's token")
    out = cli(srv, alice, "drain", "p0l0-p0s1", "--reason", "optic swap")
    assert out.returncode == 0, out.stderr
    drain = [e for e in srv.service.coordinator.store.events(kinds=["drain"])][-1]
    assert drain["actor"] == "alice"
    listed = token("list", "-o", "json")
    doc = json.loads(listed.stdout)
    assert {"name": "alice", "role": "operator", "host": None} in doc["listed"]
    assert "sha256" not in listed.stdout and alice not in listed.stdout
    gone = token("revoke", "alice")
    assert gone.returncode == 0 and "revoked alice's operator token" in gone.stdout
    wait_until(lambda: cli(srv, alice, "status").returncode == 3, 10, "alice's token refused")
    assert token("revoke", "alice").returncode == 3
    assert answered(cli(srv, tokens["reader"], "status"))  # nobody else is touched


def test_a_broken_tokens_file_is_refused_and_the_tokens_in_use_kept(server):
    srv, tokens = server
    path = os.path.join(srv.state_dir, "tokens.yaml")
    good = open(path).read()
    logged = []
    srv.service.log = lambda event, **f: logged.append((event, f))
    with open(path, "w") as f:
        f.write("tokens: [{name: x, role: admin, sha256: 00}]\n")
    wait_until(lambda: any(e == "tokens_reload_refused" for e, _ in logged), 10, "the reload refused")
    assert "role: 'admin' is not a role" in dict(logged)["tokens_reload_refused"]["error"]
    assert cli(srv, tokens["reader"], "status").returncode == 0  # still the tokens it had
    from linkpass.coordinator.auth import AuthError, remove_listed_token

    with open(path, "w") as f:
        f.write(good)
    for entry in ("local-reader",):
        remove_listed_token(path, entry)
    with pytest.raises(AuthError, match="last listed token"):
        remove_listed_token(path, "local-operator")


def test_an_agent_sends_digests_and_a_lost_report_is_healed_by_one(server, tmp_path):
    """Between whole tables the link sends only the digest of its verdicts; a change the
    coordinator never got (a report lost) makes the digests differ, the coordinator asks for
    the table, and its copy is right again."""
    from linkpass.control.answers import AnswerRules
    from linkpass.agent.config import CoordinatorLinkConfig
    from linkpass.agent.coordinator_link import CoordinatorLink

    srv, tokens = server
    state, token_file = tmp_path / "state", tmp_path / "h1.token"
    token_file.write_text(tokens["h1"] + "\n")
    rows = table_of(1)
    cfg = CoordinatorLinkConfig(srv.url, str(token_file), report_ms=50, summary_s=0.3, ca_file=lab_ca_file(state))
    link = CoordinatorLink(cfg, lambda: identity(1), lambda: [dict(r) for r in rows], lambda drains: None,
                           lambda plan: None, lambda event, **fields: None, rules=AnswerRules("h1", 2, 1024))
    link.start()
    try:
        wait_until(lambda: link.stats["digests"] >= 3, 10, "three digests", lambda: link.stats)
        assert link.digests and link.stats["tables"] == 0 and link.stats["tables_asked"] == 0, link.stats
        assert srv.service.coordinator.counters["digest_mismatches"] == 0
        # the agent's path 1 goes down, and the report that said so is lost on the way
        rows[0] = {**rows[0], "state": "down", "reason": "hard_failure"}
        link.sent[rows[0]["id"]] = ("down", "hard_failure")
        # the link counts the table once the coordinator has answered it: after its copy changed
        wait_until(lambda: srv.service.coordinator.paths["h1/1"].state == "down" and link.stats["tables"] >= 1, 10,
                   "the coordinator's copy healed", lambda: (link.stats, dict(srv.service.coordinator.counters)))
        assert link.stats["tables_asked"] >= 1
        assert srv.service.coordinator.counters["digest_mismatches"] >= 1
        asked = link.stats["tables_asked"]
        time.sleep(1.0)  # healed: digests match again, no more tables
        assert link.stats["tables_asked"] == asked
        metrics = urlopen(srv, srv.url + "/metrics", timeout=5).read().decode()
        assert f"linkpass_coordinator_tables_asked_total {float(srv.service.coordinator.counters['digest_mismatches'])}" in metrics
        assert "linkpass_coordinator_digests_total" in metrics
    finally:
        link.stop()


def test_paths_the_fleet_model_cannot_map_are_counted_in_the_metrics(server):
    srv, tokens = server
    metrics = urlopen(srv, srv.url + "/metrics", timeout=5).read().decode()
    assert "linkpass_coordinator_paths_unmapped 0.0" in metrics
    assert "linkpass_coordinator_changes_unknown_path_total 0.0" in metrics
    rows = table_of(1)
    k = next(i for i, r in enumerate(rows) if len(r["hops"]) > 1)
    rows[k] = {**rows[k], "hops": list(reversed(rows[k]["hops"]))}  # hops no path of the model crosses
    with connect(srv, tokens["h1"]) as agent:
        agent.post("/v1/register", {**identity(1), "paths": rows})
        agent.post("/v1/report", {"name": "h1", "changes": [{"id": 999, "state": "down", "reason": "hard_failure"}]})
    metrics = urlopen(srv, srv.url + "/metrics", timeout=5).read().decode()
    assert "linkpass_coordinator_paths_unmapped 1.0" in metrics
    assert "linkpass_coordinator_changes_unknown_path_total 1.0" in metrics


def test_one_token_has_a_request_budget_and_others_are_not_slowed(tmp_path):
    """A token past its budget gets 429 without its body being read, counted by its own kind;
    another agent's reports go on being answered meanwhile."""
    srv, tokens = start(tmp_path, token_rate_per_s=1.0, token_burst=5)
    try:
        codes = []
        with connect(srv, tokens["h0"]) as hog:
            for _ in range(12):
                try:
                    hog.post("/v1/report", {"name": "h0"})
                    codes.append(200)
                except Refusal as exc:
                    codes.append(exc.status)
                    assert "more than 1 requests a second" in str(exc) and exc.kind == "throttled"
        # the burst (one of it went on the registration), then a refill at most
        assert 4 <= codes.count(200) <= 6 and set(codes[7:]) == {429}, codes
        with connect(srv, tokens["h1"]) as other:
            assert "drain_version" in other.post("/v1/report", {"name": "h1"})
        assert srv.errors["token_budget"] == codes.count(429)
    finally:
        srv.close()
        srv.service.coordinator.store.close()


def test_a_report_checks_its_digest_against_the_changes_alone(server, monkeypatch):
    """An agent's digest is checked against a sum the coordinator keeps as verdicts change: a report
    of one change with a digest hashes that change's rows, not the agent's whole table."""
    from linkpass.coordinator import coordinator as C
    from linkpass.core.report_digest import table_digest

    srv, tokens = server
    rows = {r["id"]: (r["state"], r["reason"]) for r in table_of(0)}
    rows[2] = ("down", "loss")
    hashed = []
    real = C.row_hash
    monkeypatch.setattr(C, "row_hash", lambda *r: hashed.append(r) or real(*r))
    with connect(srv, tokens["h0"]) as agent:
        answer = agent.post("/v1/report", {"name": "h0", "digests": True, "changes": [{"id": 2, "state": "down",
                                                                                        "reason": "loss"}],
                                           "digest": table_digest((i, s, r) for i, (s, r) in rows.items())})
    assert "send_paths" not in answer  # the digest matched
    assert len(hashed) == 2, hashed  # the changed row out, its new self in: not the 10 rows held
    assert srv.service.coordinator.counters["digests"] == 1
