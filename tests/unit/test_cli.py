"""The CLI at its edges: exit codes (usage errors, refused tokens, refused writes, failures), one
line on stderr for every failure with stdout left empty, `--debug`, the config file's contexts
end to end, `linkpass agents`, and the completion helper's names.

The coordinator is a stand-in: a plain-HTTP server on 127.0.0.1 answering each endpoint what the
test says (`--insecure-http`), so every refusal the real one gives can be had on demand.
"""
from __future__ import annotations

import http.server
import json
import os
import socket
import threading

import pytest

from linkpass.cli import fleet as fleet_cli
from linkpass.cli.main import main
from linkpass.console.output import EXIT_CRITICAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNKNOWN
from linkpass.coordinator.coordinator import Coordinator, CoordinatorConfig
from linkpass.coordinator.store import Store

from support.fleet import MODEL, identity, table_of
from support.golden import check_golden
from support.http_stub import send_json


NOW = 1_796_000_000.0
AGENTS = [{"name": "h0", "agent_id": 1, "lost": False, "last_seen_s": 0.4, "paths": 12, "version": "1.4.0",
           "service": "10.0.0.1"},
          {"name": "h1", "agent_id": 2, "lost": True, "last_seen_s": 7300.0, "paths": 12, "version": None,
           "service": "10.0.0.2"}]
LINKS = [{"link": "p0l0-p0s0"}, {"link": "h1-p0l0"}]
STATUS_OK = {"health": "ok", "agents": 1, "agents_lost": [], "paths": 0, "paths_by_state": {}, "findings": [],
             "drains": [], "fabric": None}


class FakeCoordinator:
    """Answers `routes[(METHOD, PATH)] = (status, document)`; 404 for the rest. Records each
    request's method, path and Authorization header."""

    def __init__(self):
        self.routes: dict[tuple[str, str], tuple[int, object]] = {}
        self.seen: list[tuple[str, str, str | None]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                path = self.path.split("?")[0]
                fake.seen.append((self.command, self.path, self.headers.get("Authorization")))
                status, doc = fake.routes.get((self.command, path), (404, {"error": f"no such endpoint: {path}"}))
                send_json(self, status, doc)

            do_GET = do_POST = _answer

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # a short poll: shutdown() waits for it, once per test
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    """No setting leaks in from the machine: no LINKPASS_* variable, an empty config folder and
    state directory."""
    for name in list(os.environ):
        if name.startswith("LINKPASS_") and name != "LINKPASS_UPDATE_GOLDEN":
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("LINKPASS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("NO_COLOR", "1")


@pytest.fixture
def fake():
    f = FakeCoordinator()
    yield f
    f.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def ask(capsys, fake, *argv):
    """A command against the stand-in coordinator, with a token from the environment."""
    return run(capsys, *argv, "--coordinator", fake.url, "--insecure-http")


def one_error_line(err: str) -> str:
    """stderr's lines apart from the plain-HTTP warning these tests ask for: exactly one error."""
    lines = [line for line in err.splitlines() if "plain HTTP" not in line]
    assert len(lines) == 1 and lines[0].startswith("linkpass: error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---- usage errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["status", "-o", "xml"], ["status", "--no-such-flag"], ["drain"], ["drain", "p0l0-p0s0"], ["nosuch"],
    ["coordinator", "token"], ["coordinator", "decommission", "h1"], ["testbed"], ["tls", "init"],
    ["events", "--limit", "many"], ["completion", "tcsh"], ["agents", "--watch", "soon"],
])
def test_every_usage_error_exits_3_with_the_fix_on_stderr(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == EXIT_UNKNOWN and out == ""
    assert "error:" in err and "--help` lists the arguments" in err


def test_help_and_version_exit_0(capsys):
    for argv in (["--help"], ["status", "--help"], ["coordinator", "token", "--help"], ["--version"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == EXIT_OK, argv
    assert "usage: linkpass" in capsys.readouterr().out


def test_no_command_prints_help_on_stderr_and_exits_3(capsys):
    code, out, err = run(capsys)
    assert code == EXIT_UNKNOWN and out == "" and "usage: linkpass" in err


# ---- refusals and failures ---------------------------------------------------------------------
@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("argv,method,path", [
    (["status"], "GET", "/v1/status"), (["links"], "GET", "/v1/links"), (["agents"], "GET", "/v1/agents"),
    (["events"], "GET", "/v1/events"), (["paths", "h1"], "GET", "/v1/paths"),
    (["drain", "p0l0-p0s0", "--reason", "optic"], "POST", "/v1/drain"),
    (["undrain", "p0l0-p0s0"], "POST", "/v1/undrain"),
    (["coordinator", "decommission", "h1", "--reason", "gone"], "POST", "/v1/decommission"),
])
def test_a_refused_token_is_unknown_for_reads_and_writes(capsys, fake, monkeypatch, status, argv, method, path):
    monkeypatch.setenv("LINKPASS_TOKEN", "not-a-token")
    fake.routes[(method, path)] = (status, {"error": "no valid token", "kind": "unauthenticated"} if status == 401 else
                                   {"error": "local-reader has role 'reader'; this needs role 'operator'",
                                    "kind": "forbidden", "needs_role": "operator"})
    code, out, err = ask(capsys, fake, *argv, "-o", "json")
    assert code == EXIT_UNKNOWN and out == ""
    line = one_error_line(err)
    assert f"refused (HTTP {status})" in line and "; token from $LINKPASS_TOKEN;" in line
    assert "--token-file" in line and "token NAME ROLE" not in line
    if status == 403:
        assert "operator.token" in line
    assert fake.seen[-1][2] == "Bearer not-a-token"


def test_a_write_the_guard_refuses_is_critical(capsys, fake):
    fake.routes[("POST", "/v1/drain")] = (409, {"error": "blast-radius guard: 2 of 4 spine links of plane 0",
                                                "kind": "refused"})
    code, out, err = ask(capsys, fake, "drain", "p0l0-p0s0", "--reason", "optic", "-o", "json")
    assert code == EXIT_CRITICAL and out == ""
    assert "blast-radius guard" in one_error_line(err) and "HTTP 409" in err


@pytest.mark.parametrize("doc, hint", [
    ({"error": "Zugriff verweigert", "kind": "forbidden", "needs_role": "operator"}, "operator.token"),
    ({"error": "the token of agent 'h0' cannot speak for 'h1'", "kind": "forbidden"}, None),
    ({"error": "Token ungültig", "kind": "unauthenticated"}, "give a valid one with --token-file"),
])
def test_the_hint_for_a_refused_token_follows_its_kind_not_its_words(capsys, fake, monkeypatch, doc, hint):
    """What the CLI advises about a refused token comes from the refusal's kind (and the role it
    names), so a reworded message changes nothing; a refusal that names no role gets no role hint."""
    monkeypatch.setenv("LINKPASS_TOKEN", "not-a-token")
    status = 401 if doc["kind"] == "unauthenticated" else 403
    fake.routes[("POST", "/v1/drain")] = (status, doc)
    code, out, err = ask(capsys, fake, "drain", "p0l0-p0s0", "--reason", "optic", "-o", "json")
    line = one_error_line(err)
    assert code == EXIT_UNKNOWN and out == "" and f"refused (HTTP {status})" in line
    if hint is None:
        assert "operator.token" not in line and "--token-file" not in line
    else:
        assert hint in line


@pytest.mark.parametrize("status", [400, 404, 429, 500, 503])
def test_other_refusals_are_unknown(capsys, fake, status):
    fake.routes[("POST", "/v1/drain")] = (status, {"error": "no link named 'x'"})
    code, out, err = ask(capsys, fake, "drain", "x", "--reason", "optic", "-o", "yaml")
    assert code == EXIT_UNKNOWN and out == "" and f"(HTTP {status})" in one_error_line(err)


@pytest.mark.parametrize("argv", [["status"], ["agents"], ["links"], ["events"], ["paths", "h1"],
                                  ["drain", "l", "--reason", "r"], ["undrain", "l"],
                                  ["coordinator", "decommission", "h1", "--reason", "r"]])
def test_no_coordinator_is_unknown_and_stdout_stays_empty(capsys, argv):
    url = f"https://127.0.0.1:{closed_port()}"
    code, out, err = run(capsys, *argv, "-o", "json", "--coordinator", url)
    assert code == EXIT_UNKNOWN and out == ""
    line = one_error_line(err)
    assert url in line and "does not answer" in line and "the address is from --coordinator" in line


def test_local_paths_error_goes_to_stderr(capsys):
    code, out, err = run(capsys, "paths", "--port", str(closed_port()), "-o", "json")
    assert code == EXIT_UNKNOWN and out == ""
    assert "no agent answers" in one_error_line(err)


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(capsys, fake, monkeypatch):
    fake.routes[("GET", "/v1/status")] = (200, {"health": "ok"})  # an answer this CLI cannot render
    code, out, err = ask(capsys, fake, "status")
    assert code == EXIT_UNKNOWN and out == ""
    line = one_error_line(err)
    assert "KeyError" in line and "--debug shows the traceback" in line
    for argv, env in ((["--debug", "status"], None), (["status", "--debug"], None), (["status"], "1")):
        if env:
            monkeypatch.setenv("LINKPASS_DEBUG", env)
        code, out, err = ask(capsys, fake, *argv)
        assert code == EXIT_UNKNOWN and "Traceback (most recent call last)" in err, argv
        assert err.rstrip().splitlines()[-1].startswith("linkpass: error: KeyError")


def test_interrupted_is_130(capsys, monkeypatch):
    def interrupted(*_a):
        raise KeyboardInterrupt
    monkeypatch.setattr(fleet_cli, "_status", interrupted)
    code, out, err = run(capsys, "status")
    assert code == EXIT_INTERRUPTED == 130 and "interrupted" in err


def test_an_unreachable_ray_address_is_one_line(capsys, tmp_path):
    port = closed_port()
    code, out, err = run(capsys, "coordinator", "--address", f"127.0.0.1:{port}", "--state-dir", str(tmp_path))
    assert code == EXIT_UNKNOWN
    line = one_error_line(err)
    assert f"--address 127.0.0.1:{port}: nothing answers" in line and "ray status" in line


def test_ray_refusing_the_address_is_one_line(capsys, tmp_path, monkeypatch):
    from linkpass.coordinator import ray_actor

    def refuse(address=None, num_cpus=None):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to")
    monkeypatch.setattr(ray_actor, "connect", refuse)
    code, out, err = run(capsys, "coordinator", "--address", "auto", "--state-dir", str(tmp_path))
    assert code == EXIT_UNKNOWN
    assert "--address auto: no Ray instance runs on this host" in one_error_line(err)


# ---- the config file, end to end ---------------------------------------------------------------
def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "xdg" / "linkpass" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_the_current_context_names_coordinator_and_token(capsys, fake, tmp_path):
    (tmp_path / "xdg" / "linkpass").mkdir(parents=True)
    (tmp_path / "xdg" / "linkpass" / "lab.token").write_text("lab-token\n")
    write_config(tmp_path, f"current-context: lab\ncontexts:\n  lab:\n    coordinator: {fake.url}\n"
                           "    token-file: lab.token\n")
    fake.routes[("GET", "/v1/status")] = (200, STATUS_OK)
    code, out, err = run(capsys, "status", "-o", "json", "--insecure-http")
    assert code == EXIT_OK and json.loads(out)["health"] == "ok"
    assert fake.seen[-1][2] == "Bearer lab-token"


def test_flag_beats_environment_beats_config(capsys, fake, tmp_path, monkeypatch):
    (tmp_path / "flag.token").write_text("from-flag\n")
    (tmp_path / "ctx.token").write_text("from-context\n")
    write_config(tmp_path, f"current-context: lab\ncontexts:\n  lab:\n    coordinator: https://127.0.0.1:1\n"
                           f"    token-file: {tmp_path / 'ctx.token'}\n")
    fake.routes[("GET", "/v1/status")] = (200, STATUS_OK)
    monkeypatch.setenv("LINKPASS_COORDINATOR", fake.url)  # beats the context's
    assert run(capsys, "status", "--insecure-http")[0] == EXIT_OK
    assert fake.seen[-1][2] == "Bearer from-context"
    monkeypatch.setenv("LINKPASS_TOKEN", "from-env")  # beats the context's token-file
    assert run(capsys, "status", "--insecure-http")[0] == EXIT_OK
    assert fake.seen[-1][2] == "Bearer from-env"
    # --token-file beats $LINKPASS_TOKEN
    assert run(capsys, "status", "--insecure-http", "--token-file", str(tmp_path / "flag.token"))[0] == EXIT_OK
    assert fake.seen[-1][2] == "Bearer from-flag"
    # --coordinator beats $LINKPASS_COORDINATOR
    code, _, err = run(capsys, "status", "--coordinator", f"https://127.0.0.1:{closed_port()}")
    assert code == EXIT_UNKNOWN and "does not answer" in err


@pytest.mark.parametrize("text,words", [
    ("contexts: [a, b]\n", "contexts: expected a mapping"),
    ("current-context: prod\ncontexts:\n  lab: {coordinator: https://x:9470}\n",
     "current-context: no context named 'prod'; the file has lab"),
    ("contexts:\n  lab: {coordinator: 'ftp://x'}\n", "contexts.lab.coordinator: expected a URL like https://HOST:9470"),
    ("contexts:\n  lab: {tokenfile: x}\n", "contexts.lab.tokenfile: unknown field; a context has coordinator"),
    ("contexts:\n  lab: {coordinator: [1]\n", "not valid YAML at line"),
])
def test_a_bad_config_file_is_one_line_naming_file_and_field(capsys, tmp_path, text, words):
    path = write_config(tmp_path, text)
    code, out, err = run(capsys, "status", "-o", "json")
    assert code == EXIT_UNKNOWN and out == ""
    line = one_error_line(err)
    assert path in line and words in line, line


def test_an_unknown_context_and_a_missing_named_file(capsys, tmp_path):
    write_config(tmp_path, "contexts:\n  lab: {coordinator: 'https://x:9470'}\n")
    code, _, err = run(capsys, "links", "--context", "prod")
    assert code == EXIT_UNKNOWN and "--context prod: no such context" in one_error_line(err) and "lab" in err
    code, _, err = run(capsys, "links", "--config-file", str(tmp_path / "nowhere.yaml"))
    assert code == EXIT_UNKNOWN and "nowhere.yaml: no such config file" in one_error_line(err)


def test_a_named_context_that_the_environment_contradicts_is_refused(capsys, fake, tmp_path, monkeypatch):
    write_config(tmp_path, "contexts:\n  prod: {coordinator: 'https://prod.example:9470'}\n")
    monkeypatch.setenv("LINKPASS_COORDINATOR", fake.url)
    code, _, err = run(capsys, "drain", "p0l0-p0s0", "--reason", "optic", "--context", "prod")
    assert code == EXIT_UNKNOWN and "$LINKPASS_COORDINATOR" in one_error_line(err) and "context prod" in err
    assert fake.seen == []  # nothing was sent to the other coordinator


def test_other_commands_ignore_a_broken_config_file(capsys, tmp_path):
    write_config(tmp_path, "contexts: [broken\n")
    code, out, _ = run(capsys, "completion", "bash")
    assert code == EXIT_OK and "complete -F _linkpass linkpass" in out


# ---- linkpass agents ---------------------------------------------------------------------------
@pytest.fixture
def agent_rows(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    c = Coordinator(store, MODEL, CoordinatorConfig(), wall_s=NOW - 7200)
    for i in range(4):
        c.register({**identity(i), "paths": table_of(i)}, NOW - (3600 if i == 3 else 5))
    c.tick(NOW)
    yield json.loads(json.dumps(c.agent_rows(NOW)))
    store.close()


def test_agents_golden_and_exit(agent_rows, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert [r["lost"] for r in agent_rows] == [False, False, False, True]
    check_golden("agents_table.txt", fleet_cli.render_agents(agent_rows) + "\n")
    check_golden("agents_wide.txt", fleet_cli.render_agents(agent_rows, wide=True) + "\n")
    assert fleet_cli.agents_exit(agent_rows) == EXIT_CRITICAL  # a lost agent, as `linkpass status` counts it
    assert fleet_cli.agents_exit(agent_rows[:3]) == EXIT_OK
    assert fleet_cli.agents_exit([]) == EXIT_OK
    assert fleet_cli.render_agents([]).endswith("no agent has registered")


def test_agents_command(capsys, fake):
    fake.routes[("GET", "/v1/agents")] = (200, AGENTS)
    code, out, _ = ask(capsys, fake, "agents")
    assert code == EXIT_CRITICAL and "h1    lost   2h ago" in out and "2 agents, 1 lost" in out
    code, out, _ = ask(capsys, fake, "agents", "--lost", "-o", "json")
    assert code == EXIT_CRITICAL and [r["name"] for r in json.loads(out)] == ["h1"]
    fake.routes[("GET", "/v1/agents")] = (200, AGENTS[:1])
    code, out, _ = ask(capsys, fake, "agents", "-o", "yaml")
    assert code == EXIT_OK and "name: h0" in out


# ---- the completion helper ---------------------------------------------------------------------
def test_complete_prints_names_from_the_coordinator(capsys, fake):
    fake.routes[("GET", "/v1/agents")] = (200, AGENTS)
    fake.routes[("GET", "/v1/links")] = (200, LINKS)
    assert ask(capsys, fake, "__complete", "hosts") == (EXIT_OK, "h0\nh1\n", "")
    assert ask(capsys, fake, "__complete", "links") == (EXIT_OK, "h1-p0l0\np0l0-p0s0\n", "")


@pytest.mark.parametrize("argv", [["__complete", "hosts", "--coordinator", "https://127.0.0.1:1"],
                                  ["__complete", "nonsense"], ["__complete"]])
def test_complete_fails_silently(capsys, argv):
    assert run(capsys, *argv) == (EXIT_OK, "", "")


def test_complete_gives_up_fast_on_a_silent_coordinator(capsys):
    import time

    with socket.socket() as s:  # accepts connections (the backlog) and never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        t0 = time.monotonic()
        result = run(capsys, "__complete", "hosts", "--coordinator", f"http://127.0.0.1:{s.getsockname()[1]}",
                     "--insecure-http")
        took = time.monotonic() - t0
    assert result == (EXIT_OK, "", "") and took < 4


# ---- untrusted strings -------------------------------------------------------------------------
HOSTILE = ["x\x1b]52;c;aGVsbG8=\x07", "\x1b[32mhealthy\x1b[0m", "lone \x1b", "\u202eright-to-left", "a\r\nb"]


def test_what_agents_and_the_coordinator_say_reaches_the_terminal_escaped(capsys, fake):
    """Strings from the coordinator (an agent's reason or version, an event's detail) are shown,
    never acted on: no escape, control or bidi character reaches stdout or stderr, a lone ESC does
    not break the table, and -o json still carries the text exactly."""
    events = [{"id": k + 1, "ts": 1_700_000_000 + k, "kind": kind, "actor": "h1", "subject": s,
               "detail": {"state": "down", "reason": s, "peer": "h2", "plane": 0, "why": s, "action": "drain"}}
              for k, (kind, s) in enumerate(zip(["detection", "refused", "detection", "agent", "detection"], HOSTILE))]
    fake.routes[("GET", "/v1/events")] = (200, events)
    for wide in ([], ["-o", "wide"]):
        code, out, err = ask(capsys, fake, "events", *wide)
        assert code == EXIT_OK, err
        assert not any(c in out + err for c in "\x1b\x07\u202e\r"), out
        assert "\\x1b]52;c;aGVsbG8=\\x07" in out and "lone \\x1b" in out
    code, out, _ = ask(capsys, fake, "events", "-o", "json")
    assert [e["subject"] for e in json.loads(out)] == HOSTILE
    fake.routes[("GET", "/v1/agents")] = (200, [dict(AGENTS[0], version=HOSTILE[1])])
    code, out, err = ask(capsys, fake, "agents", "-o", "wide")
    assert "\x1b" not in out and "\\x1b[32mhealthy" in out
    fake.routes[("GET", "/v1/status")] = (409, {"error": "refused \x1b]0;title\x07 by the guard"})
    code, out, err = ask(capsys, fake, "status")
    assert "\x1b" not in err and "\\x1b]0;title\\x07" in err
