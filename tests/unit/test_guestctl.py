"""The guest's control agent (rdma/guest/guestctl.py), run on the host over a socketpair.

The same code serves the virtio port in the guest; here `--fd` hands it one end of a socketpair
and `--log-dir` a tmp dir. Off the guest it is not PID 1, so it makes itself the subreaper (the
orphans of what it runs come back to it, as they do to PID 1) and a `poweroff` only ends it.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


GUESTCTL = Path(__file__).resolve().parents[2] / "rdma" / "guest" / "guestctl.py"
CAP = 1 << 20


class Ctl:
    def __init__(self, sock: socket.socket, proc: subprocess.Popen, log_dir: Path):
        self.sock, self.proc, self.log_dir = sock, proc, log_dir
        self.reader = sock.makefile("rb")
        self.order: list = []   # ids in the order their replies arrived
        self.replies: dict = {}
        sock.settimeout(30)     # a hung server fails the test instead of hanging it

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, req: dict) -> None:
        self.send_raw((json.dumps(req) + "\n").encode())

    def next_reply(self) -> dict:
        line = self.reader.readline()
        assert line, "guestctl closed the connection"
        reply = json.loads(line)
        self.order.append(reply.get("id"))
        self.replies[reply.get("id")] = reply
        return reply

    def wait(self, rid) -> dict:
        while rid not in self.replies:
            self.next_reply()
        return self.replies.pop(rid)

    def call(self, req: dict) -> dict:
        self.send(req)
        return self.wait(req.get("id"))


@pytest.fixture
def ctl(tmp_path):
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, str(GUESTCTL), "--fd", str(theirs.fileno()),
                             "--log-dir", str(tmp_path)], pass_fds=[theirs.fileno()])
    theirs.close()
    c = Ctl(ours, proc, tmp_path)
    try:
        yield c
    finally:
        c.reader.close()  # the socket's fd stays open while its file object does
        ours.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_run_returns_exit_code_output_and_takes_env(ctl):
    r = ctl.call({"id": 1, "op": "run", "argv": ["sh", "-c", "echo out $FOO; echo err >&2; exit 3"],
                  "env": {"FOO": "bar"}, "timeout": 20})
    assert r == {"id": 1, "rc": 3, "stdout": "out bar\n", "stderr": "err\n"}


def test_run_reports_a_signal_death_as_minus_the_signal(ctl):
    r = ctl.call({"id": 1, "op": "run", "argv": ["sh", "-c", "kill -9 $$"], "timeout": 20})
    assert r["rc"] == -9 and "timed_out" not in r


def test_run_timeout_kills_the_process_group_and_says_so(ctl):
    r = ctl.call({"id": 7, "op": "run", "argv": ["sh", "-c", "sleep 60 & echo $!; wait"], "timeout": 0.5})
    assert r["rc"] == 124 and r["timed_out"] is True
    grandchild = int(r["stdout"])
    gone = lambda: not os.path.exists(f"/proc/{grandchild}")  # noqa: E731
    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(), "the timeout left the run's background child alive"


def test_run_caps_each_stream_at_one_mib_and_says_truncated(ctl):
    r = ctl.call({"id": 1, "op": "run", "argv": [sys.executable, "-c",
                  f"import sys; sys.stdout.write('x' * {CAP + 5000}); sys.stderr.write('e')"], "timeout": 30})
    assert r["rc"] == 0 and r["truncated"] is True
    assert r["stdout"] == "x" * CAP and r["stderr"] == "e"
    r = ctl.call({"id": 2, "op": "run", "argv": ["echo", "small"], "timeout": 20})
    assert "truncated" not in r


def test_orphans_are_reaped(ctl):
    """What a run leaves behind comes back to guestctl when it exits, and must not stay a zombie."""
    r = ctl.call({"id": 1, "op": "run", "argv": ["sh", "-c", "sleep 0.3 >/dev/null 2>&1 & echo $!"],
                  "timeout": 20})
    orphan = int(r["stdout"])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
        time.sleep(0.05)
    state = Path(f"/proc/{orphan}/stat").read_text().split()[2] if os.path.exists(f"/proc/{orphan}") else None
    assert state is None, f"orphan {orphan} is still there in state {state}"


def test_spawn_logs_to_the_log_dir_and_kill_returns_the_exit_code(ctl):
    r = ctl.call({"id": 1, "op": "spawn", "name": "agent", "env": {"X": "1"},
                  "argv": ["sh", "-c", "echo started $X; exec sleep 60"]})
    pid = r["pid"]
    assert isinstance(pid, int) and os.path.exists(f"/proc/{pid}")
    again = ctl.call({"id": 2, "op": "spawn", "name": "agent", "argv": ["true"]})
    assert "still running" in again["error"] and again["id"] == 2
    log = ctl.log_dir / "agent.log"
    deadline = time.monotonic() + 10
    while "started 1" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.read_text() == "started 1\n"
    assert ctl.call({"id": 3, "op": "kill", "name": "agent", "signal": 15}) == {"id": 3, "rc": -15}
    # once it has ended, kill only reports how it ended
    assert ctl.call({"id": 4, "op": "kill", "name": "agent", "signal": 9}) == {"id": 4, "rc": -15}


def test_kill_answers_null_when_the_process_outlives_the_wait(ctl):
    ctl.call({"id": 1, "op": "spawn", "name": "stubborn",
              "argv": ["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.05; done"]})
    log = ctl.log_dir / "stubborn.log"
    deadline = time.monotonic() + 10
    while "ready" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ctl.call({"id": 2, "op": "kill", "name": "stubborn", "signal": 15, "timeout": 0.3}) == {"id": 2, "rc": None}
    assert ctl.call({"id": 3, "op": "kill", "name": "stubborn", "signal": 9}) == {"id": 3, "rc": -9}


def test_a_long_run_does_not_hold_up_spawn_and_kill(ctl):
    ctl.send({"id": "slow", "op": "run", "argv": ["sleep", "3"], "timeout": 20})
    assert "pid" in ctl.call({"id": "s", "op": "spawn", "name": "quick", "argv": ["sleep", "60"]})
    assert ctl.call({"id": "k", "op": "kill", "name": "quick", "signal": 9}) == {"id": "k", "rc": -9}
    assert "slow" not in ctl.order
    assert ctl.wait("slow")["rc"] == 0


def test_bad_requests_get_errors_and_the_server_goes_on(ctl):
    ctl.send_raw(b"{not json\n")
    assert ctl.next_reply()["id"] is None and "not JSON" in ctl.replies[None]["error"]
    ctl.send_raw(b"[1, 2]\n")
    assert ctl.next_reply() == {"id": None, "error": 'a request is a JSON object with "id" and "op"'}
    assert "unknown" in ctl.call({"id": 5, "op": "format-disk"})["error"]
    assert "unknown" in ctl.call({"id": 6, "op": ["run"]})["error"]
    assert "argv" in ctl.call({"id": 7, "op": "run", "argv": "ls"})["error"]
    assert "argv" in ctl.call({"id": 8, "op": "run", "argv": ["no-such-program-here"]})["error"]
    assert "env" in ctl.call({"id": 9, "op": "run", "argv": ["true"], "env": {"A": 1}})["error"]
    assert "timeout" in ctl.call({"id": 10, "op": "run", "argv": ["true"], "timeout": -1})["error"]
    assert "name" in ctl.call({"id": 11, "op": "spawn", "name": "../etc/x", "argv": ["true"]})["error"]
    assert "signal" in ctl.call({"id": 12, "op": "kill", "name": "x", "signal": 999})["error"]
    assert "no process" in ctl.call({"id": 13, "op": "kill", "name": "never", "signal": 15})["error"]
    ctl.send_raw(b"x" * (CAP + 10) + b"\n")
    assert "longer than" in ctl.next_reply()["error"]
    assert ctl.call({"id": 14, "op": "run", "argv": ["echo", "alive"]})["stdout"] == "alive\n"
    assert not (ctl.log_dir.parent / "etc").exists()


def test_poweroff_replies_and_off_the_guest_only_ends_guestctl(ctl):
    assert ctl.call({"id": 1, "op": "poweroff"}) == {"id": 1, "poweroff": True}
    assert ctl.proc.wait(timeout=10) == 0
