"""The JSON-line log (linkpass/observe/log.py): every event logged has a level in the table, lines
carry level and component, the threshold filters, journald's priority prefix appears exactly when
stderr is the journal's stream (checked in child processes against a real file and a real pipe),
shaped secrets are masked, and the coordinator actor's log file is bounded and followed."""
from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from linkpass.observe import log as L


ROOT = Path(__file__).parents[2]
# where log lines are written: the agent (its decision loop is core/failover.py, which logs through
# the caller's logger), the coordinator, the CLI, observe
LOGGING_PACKAGES = ("linkpass/agent", "linkpass/core/failover.py", "linkpass/coordinator", "linkpass/cli",
                    "linkpass/observe")


def log_calls():
    """(where, first argument node, keywords) of every `log(...)`, `_log(...)` and `x.log(...)` call
    in the packages that log through observe/log.py, and of every log record made for later
    (`LogRecord(...)`, `LogRecord.of(...)`: the failover's decisions, written by the agent)."""
    for package in LOGGING_PACKAGES:
        place = ROOT / package
        for path in [place] if place.is_file() else sorted(place.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                record = name == "LogRecord" or (isinstance(f, ast.Attribute) and f.attr == "of"
                                                  and isinstance(f.value, ast.Name) and f.value.id == "LogRecord")
                if name in ("log", "_log") or record:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    yield where, (node.args[0] if node.args else None), node.keywords


def test_every_event_logged_has_a_level_in_the_table_and_every_entry_is_logged():
    used, wrong = set(), []
    for where, first, keywords in log_calls():
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            wrong.append(f"{where}: the event name must be a string literal (the table is checked against them)")
            continue
        used.add(first.value)
        if first.value not in L.EVENTS:
            wrong.append(f"{where}: event {first.value!r} is not in observe/log.py EVENTS (give it a level there)")
        for kw in keywords:
            if kw.arg == "level":  # the override: a literal level
                if not (isinstance(kw.value, ast.Constant) and kw.value.value in L.RANK):
                    wrong.append(f"{where}: level= must be one of {', '.join(L.RANK)}")
            elif kw.arg in L.ENVELOPE:
                wrong.append(f"{where}: field {kw.arg!r} is one of the envelope's own keys; name it otherwise")
    assert not wrong, "\n".join(wrong)
    assert len(used) > 30, sorted(used)  # the scan sees the call sites (a broken scan would pass anything)
    assert sorted(set(L.EVENTS) - used) == [], "events in the table that nothing logs: remove them"
    assert set(L.EVENTS.values()) <= set(L.RANK)


def test_the_docs_event_table_is_the_codes():
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \|", (ROOT / "docs" / "logs.md").read_text(), re.M)
    assert dict(rows) == L.EVENTS and len(rows) == len(L.EVENTS)


def lines_of(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_has_time_level_component_and_event_and_the_threshold_filters(monkeypatch):
    monkeypatch.delenv(L.ENV, raising=False)
    out = io.StringIO()
    log = L.Logger("agent", stream=out)
    log("started", agent_id=3)
    log("loop_error", step="poll", ts="not the envelope's")
    log("path_state", level="debug", peer="h1")  # below the default threshold (info)
    log("path_state", level="warning", peer="h2")  # an override
    first, second, third = lines_of(out)
    assert list(first)[:5] == ["ts", "time", "level", "component", "event"]
    assert first["level"] == "info" and first["component"] == "agent" and first["event"] == "started"
    assert isinstance(first["ts"], float) and first["agent_id"] == 3
    assert first["time"] == L.iso_time(first["ts"]) and first["time"].endswith("Z") and len(first["time"]) == 24
    assert second["level"] == "error" and second["field_ts"] == "not the envelope's" and isinstance(second["ts"], float)
    assert (third["level"], third["peer"]) == ("warning", "h2")
    assert not out.getvalue().startswith("<")  # no journal here: bare JSON

    out = io.StringIO()
    log = L.Logger("coordinator", stream=out, level="warning")
    log("started")
    log("request_failed", path="/v1/report")
    log("started", level="error")
    assert [(e["event"], e["level"]) for e in lines_of(out)] == [("request_failed", "error"), ("started", "error")]

    monkeypatch.setenv(L.ENV, "DEBUG")
    out = io.StringIO()
    L.Logger("agent", stream=out)("path_state", level="debug")
    assert lines_of(out)[0]["level"] == "debug"
    assert L.level_from_env("error") == "error"  # the command's --log-level wins over the environment

    monkeypatch.setenv(L.ENV, "loud")
    with pytest.raises(ValueError, match="LINKPASS_LOG_LEVEL: 'loud' is not a log level; use one of debug, info"):
        L.level_from_env()
    assert L.Logger("agent").threshold == L.RANK["info"]  # made at import: falls back, the command refuses it


def test_lines_of_many_threads_never_interleave(tmp_path):
    path = tmp_path / "log"
    with open(path, "w") as f:
        log = L.Logger("agent", stream=f)

        def burst(n):
            for i in range(300):
                log("path_state", peer=f"h{n}", i=i, detail="x" * 500)

        threads = [threading.Thread(target=burst, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    lines = path.read_text().splitlines()
    assert len(lines) == 8 * 300 and all(json.loads(line)["event"] == "path_state" for line in lines)


def test_a_line_that_cannot_be_written_is_dropped_not_raised():
    stream = io.StringIO()
    log = L.Logger("agent", stream=stream)
    stream.close()
    log("route_change", peer="h1")  # the data path must not stop for its log
    assert log.dropped == 1


CHILD = """
import sys
from linkpass.observe.log import Logger
log = Logger("agent")
log("started", agent_id=1)
log("route_change", peer="h1")
log("fail_static", peer="h1")
log("path_state", level="debug", peer="h1")
"""


def run_child(stderr, env_extra: dict) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    env.update({L.ENV: "debug", **env_extra})
    subprocess.run([sys.executable, "-c", CHILD], stderr=stderr, env=env, check=True, timeout=60, cwd=ROOT)


def journal_stream_of(what) -> str:
    """What systemd would put in JOURNAL_STREAM for this descriptor or path."""
    st = os.stat(what)
    return f"{st.st_dev}:{st.st_ino}"


def split_prefixes(text: str) -> list[tuple[str, str]]:
    """(prefix, event) per line; the prefix is "" when there is none."""
    out = []
    for line in text.splitlines():
        prefix = line[:line.index("{")]
        out.append((prefix, json.loads(line[len(prefix):])["event"]))
    return out


PREFIXED = [("<6>", "started"), ("<4>", "route_change"), ("<3>", "fail_static"), ("<7>", "path_state")]
BARE = [("", "started"), ("", "route_change"), ("", "fail_static"), ("", "path_state")]


def test_journald_priority_prefix_when_stderr_is_the_journal_stream_a_file(tmp_path):
    """systemd's JOURNAL_STREAM names the stream by device and inode; a file stands in for it."""
    with open(tmp_path / "err", "w+") as f:
        run_child(f, {"JOURNAL_STREAM": journal_stream_of(f.fileno())})
    assert split_prefixes((tmp_path / "err").read_text()) == PREFIXED
    with open(tmp_path / "plain", "w+") as f:
        run_child(f, {})
    assert split_prefixes((tmp_path / "plain").read_text()) == BARE
    with open(tmp_path / "elsewhere", "w+") as f:  # stderr redirected away from the journal's stream
        run_child(f, {"JOURNAL_STREAM": journal_stream_of(tmp_path / "err")})
    assert split_prefixes((tmp_path / "elsewhere").read_text()) == BARE


def test_journald_priority_prefix_when_stderr_is_the_journal_stream_a_pipe():
    """journald's streams are sockets; a pipe is the same kind of anonymous inode."""
    for env, want in ((True, PREFIXED), (False, BARE)):
        r, w = os.pipe()
        try:
            run_child(w, {"JOURNAL_STREAM": journal_stream_of(w)} if env else {})
        finally:
            os.close(w)
        with os.fdopen(r) as f:
            assert split_prefixes(f.read()) == want


def test_an_agent_refusing_its_config_says_why_at_error_priority_in_the_journal(tmp_path):
    """A start refused before logging begins is plain text, but at priority 3, so `journalctl -p
    warning` shows why the unit did not start."""
    code = "import sys; from linkpass.agent.daemon import main; sys.exit(main(sys.argv[1]))"
    with open(tmp_path / "err", "w+") as f:
        env = {**os.environ, "JOURNAL_STREAM": journal_stream_of(f.fileno())}
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing.yaml")], stderr=f, env=env,
                             timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert (tmp_path / "err").read_text().startswith("<3>linkpass agent: config error: ")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing.yaml")], capture_output=True,
                         text=True, env={**os.environ, L.ENV: "chatty"}, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.startswith("linkpass agent: LINKPASS_LOG_LEVEL: 'chatty' is not")


@pytest.mark.parametrize("text, want", [
    ("Authorization: Bearer Zm9vYmFyYmF6cXV4MTIz", "Authorization: Bearer <redacted>"),
    ("header was BEARER\tZm9vYmFyYmF6cXV4MTIz", "header was Bearer <redacted>"),  # a tab: \t in the JSON line
    ("token lpa1.h3." + "A" * 43 + " refused", "token lpa1.h3.<redacted> refused"),
    ("lpa1.gpu-017.rack3.12." + "b_-" * 14 + "c", "lpa1.gpu-017.rack3.12.<redacted>"),
    ("reader and operator bearer tokens", "reader and operator bearer tokens"),  # prose stays
    ("agent lpa1.h3 has no MAC here", "agent lpa1.h3 has no MAC here"),
])
def test_secrets_with_a_shape_are_masked(text, want):
    assert L.redact(text) == want
    out = io.StringIO()
    L.Logger("agent", stream=out)("coordinator_link_error", error=text)
    assert lines_of(out)[0]["error"] == want


def test_the_actor_log_file_is_bounded_and_followed_across_rotation(tmp_path, monkeypatch):
    path = str(tmp_path / "coordinator.log")
    old = L.LogFile(path)
    old.write("written before the follower started\n")
    old.close()
    copied = io.StringIO()
    follower = L.Follower(path, stream=copied)  # not started: polled by hand
    sink = L.LogFile(path, max_bytes=4096)
    log = L.Logger("coordinator", stream=sink, level="debug")
    for i in range(100):
        log("request_failed", i=i, error="y" * 100)
        if i % 7 == 0:
            follower.poll()
    log("stopped", level="warning")
    follower.stop()
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert os.path.getsize(path) <= 4096 and os.path.getsize(path + ".1") <= 4096
    got = lines_of(copied)
    assert [e.get("i") for e in got[:-1]] == list(range(100)), "every line once, in order, across rotations"
    assert got[-1]["event"] == "stopped" and got[-1]["component"] == "coordinator"

    # copied to the journal: each line with the priority of its own level
    with open(tmp_path / "journal", "w") as out:
        monkeypatch.setenv("JOURNAL_STREAM", journal_stream_of(out.fileno()))
        follower = L.Follower(path, stream=out)
        log("started")
        log("tick_failed", error="z")
        log("started", level="debug")
        follower.stop()
    assert split_prefixes((tmp_path / "journal").read_text()) == [("<6>", "started"), ("<3>", "tick_failed"),
                                                                  ("<7>", "started")]


def test_a_follower_of_a_file_not_written_yet_copies_it_from_its_start(tmp_path):
    path = str(tmp_path / "coordinator.log")
    copied = io.StringIO()
    follower = L.Follower(path, stream=copied, interval_s=0.01).start()
    L.Logger("coordinator", stream=L.LogFile(path))("started", url="https://127.0.0.1:9470")
    follower.stop()
    assert [e["event"] for e in lines_of(copied)] == ["started"]


def test_the_coordinators_history_reaches_its_log_once_committed(tmp_path):
    """Localizations, drains and agents lost are in the coordinator's own log (its journal), once
    the store has committed them; a rolled-back transaction logs nothing, per-path events stay
    in the store only."""
    from linkpass.coordinator.startup import log_history
    from linkpass.coordinator.store import Store

    lines = io.StringIO()
    log = L.Logger("coordinator", stream=lines)
    store = Store(str(tmp_path / "coordinator.db"), on_committed=lambda events: log_history(log, events))
    try:
        store.event("localization", "coordinator", "p0l0-p0s1:forward", confidence=0.9)
        store.event("detection", "h0", "h0>h2 plane 0", state="down")
        with pytest.raises(RuntimeError):
            with store._tx():
                store.event("drain", "alice", "p0l0-p0s1", reason="optic")
                raise RuntimeError("the request failed after writing")
        store.event("agent", "coordinator", "h3", what="lost")
        store.event("agent", "h1", "h1", what="registered")
        recs = [json.loads(line) for line in lines.getvalue().splitlines()]
        assert [(r["event"], r["level"], r["subject"]) for r in recs] == [
            ("localized", "warning", "p0l0-p0s1:forward"), ("agent_changed", "warning", "h3"),
            ("agent_changed", "info", "h1")]
        assert recs[0]["confidence"] == 0.9 and recs[0]["component"] == "coordinator"
        assert store.events(kinds=["drain"]) == []  # rolled back: neither stored nor logged
    finally:
        store.close()


def test_the_plans_coverage_under_the_budgets_reaches_the_log(tmp_path):
    """Links the agents' probe budgets leave short of 2 reporters are logged at warning; their
    being covered again at info."""
    from linkpass.coordinator.startup import log_history
    from linkpass.coordinator.store import Store

    lines = io.StringIO()
    log = L.Logger("coordinator", stream=lines)
    store = Store(str(tmp_path / "coordinator.db"), on_committed=lambda events: log_history(log, events))
    try:
        store.event("coordinator", "coordinator", "plan", what="under_covered", count=2,
                    links=["h0-p0l0:up", "h0-p0l0:down"])
        store.event("coordinator", "coordinator", "plan", what="covered", count=0, links=[])
        store.event("coordinator", "coordinator", "coordinator", recovered_paths=3)  # a restart: not logged
        recs = [json.loads(line) for line in lines.getvalue().splitlines()]
        assert [(r["event"], r["level"], r["count"]) for r in recs] == [("plan_coverage", "warning", 2),
                                                                          ("plan_coverage", "info", 0)]
    finally:
        store.close()


def test_a_commands_last_line_of_failure_carries_the_error_priority_in_the_journal(tmp_path):
    """`linkpass: error: ...` (an unexpected error, an interrupt) is what `journalctl -p err` must
    show when a unit's process dies of it."""
    child = "import importlib, sys; sys.exit(importlib.import_module('linkpass.cli.main')._fail('boom'))"
    for env, want in ((True, "<3>linkpass: error: boom"), (False, "linkpass: error: boom")):
        with open(tmp_path / "err", "w+") as f:
            extra = {"JOURNAL_STREAM": journal_stream_of(f.fileno())} if env else {}
            environ = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"} | extra | {"NO_COLOR": "1"}
            subprocess.run([sys.executable, "-c", child], stderr=f, env=environ, timeout=60, cwd=ROOT)
        assert (tmp_path / "err").read_text().strip() == want
