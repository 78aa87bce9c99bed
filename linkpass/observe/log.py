"""The JSON-line log of the agent and the coordinator: one line per event, each with its level.

    {"ts": 1764000000.123456, "time": "2025-11-24T16:00:00.123Z", "level": "warning",
     "component": "agent", "event": "coordinator_unreachable", "url": "...", ...}

`ts` (epoch seconds) is what tools and tests parse; `time` is the same instant for a reader.
Each event name has one level, in EVENTS; a call may override it with `level=`. A unit test
scans the code for every event name logged and checks it is listed here. Lines below the
threshold (LINKPASS_LOG_LEVEL or --log-level: debug, info, warning, error; default info) are
not written.

Under systemd, when stderr is the journal ($JOURNAL_STREAM names its device and inode), each
line starts with its syslog priority, `<4>{...}`: journald takes it as the entry's priority
(SyslogLevelPrefix=, on by default), so `journalctl -p warning -u linkpass-agent` shows warnings
and errors only. Anywhere else lines are bare JSON.

The coordinator's Ray actor writes to a file in its state directory (`LogFile`, bounded) instead
of Ray's worker logs; the `linkpass coordinator` process copies that file's new lines to its own
stderr (`Follower`), so they land in its journal.
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
import time

ENV = "LINKPASS_LOG_LEVEL"
RANK = {"debug": 10, "info": 20, "warning": 30, "error": 40}
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3}  # syslog's, as journald reads them
DEFAULT_LEVEL = "info"

# every event either component logs, and its level. warning: something is off and may need a
# look (traffic moved, a peer or the coordinator gone, a config refused); error: something is
# broken and needs a human (a bug caught, no usable path, the coordinator refusing the agent)
EVENTS = {
    # both
    "started": "info",
    "stopped": "info",
    # the agent (agent/daemon.py)
    "discovery": "info",
    "peer_added": "info",
    "peer_removed": "info",
    "routes_reconciled": "info",
    "routes_left": "info",
    "drains_applied": "info",
    "plan_applied": "info",
    "reloaded": "info",
    "fleet_keys_changed": "warning",
    "tokens_reloaded": "info",
    "tokens_reload_refused": "error",
    "reload_partial": "warning",
    "reload_rejected": "warning",
    "rt_priority_refused": "warning",
    "loop_priority_refused": "warning",
    "entropy_table_replaced": "warning",
    "lanes_unread": "warning",
    "loop_error": "error",
    "path_check": "info",
    "path_rates": "info",
    "rdma_unreported": "warning",
    "probe_budget": "warning",
    "path_check_failed": "error",
    "watchdog_withheld": "error",
    "watchdog_resumed": "info",
    # the agent's decisions (core/failover.py, agent/routes.py)
    "path_state": "info",
    "route_change": "warning",
    "host_lateness": "warning",
    "peer_silent": "warning",
    "fail_static": "error",
    "fail_static_cleared": "info",
    "route_journal_lines_skipped": "warning",
    # the agent's coordinator thread (agent/coordinator_link.py)
    "coordinator_registered": "info",
    "coordinator_back": "info",
    "coordinator_moved": "info",
    "coordinator_token_reloaded": "info",
    "coordinator_unreachable": "warning",
    "coordinator_busy": "warning",
    "coordinator_answer_rejected": "warning",
    "coordinator_insecure_http": "warning",
    "coordinator_refused": "error",
    "coordinator_link_error": "error",
    # the coordinator (coordinator/http.py, coordinator/startup.py)
    "insecure_http": "warning",
    "store_insecure_plaintext": "warning",
    # the coordinator's history, as it commits it (coordinator/startup.py: log_history)
    "localized": "warning",
    "localization_cleared": "info",
    "link_drained": "warning",
    "link_undrained": "info",
    "agent_changed": "info",  # registered, returned, decommissioned, expired; "lost" is logged at warning
    "request_refused": "warning",
    "plan_coverage": "warning",  # links the probe budgets leave short of 2 reporters; covered again at info
    "request_failed": "error",
    "connection_failed": "error",
    "tick_failed": "error",
}

# the envelope's own keys: a field of the same name is renamed rather than allowed to replace one
ENVELOPE = frozenset(("ts", "time", "level", "component", "event"))

# secrets that have a shape are masked even if a message carries one by mistake (an exception's
# text, a header echoed): a bearer token, and the MAC of a derived agent token (its host stays)
_SECRET_SHAPES = re.compile(r"(?i:bearer)(?:\s|\\[tn])+[A-Za-z0-9._~+/-]{8,}=*"
                            r"|(?<=\blpa1\.)((?:[A-Za-z0-9_-]+\.)+)[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])")
_WRITE_LOCK = threading.Lock()  # one write per line, for every Logger of the process


def parse_level(text: str, where: str = ENV) -> str:
    """The level a knob names (any case), or ValueError naming the knob and the choices."""
    level = str(text).strip().lower()
    if level not in RANK:
        raise ValueError(f"{where}: {text!r} is not a log level; use one of {', '.join(RANK)}")
    return level


def level_from_env(given: str | None = None) -> str:
    """`given` (a --log-level), else $LINKPASS_LOG_LEVEL, else info; ValueError if one is not a level."""
    if given:
        return parse_level(given, "--log-level")
    return parse_level(os.environ[ENV]) if os.environ.get(ENV) else DEFAULT_LEVEL


def _env_level() -> str:
    """$LINKPASS_LOG_LEVEL, or info if it is unset or not a level (the commands refuse a bad one
    at start, with level_from_env; a logger made at import must not raise)."""
    try:
        return level_from_env()
    except ValueError:
        return DEFAULT_LEVEL


def is_journal(stream) -> bool:
    """Whether `stream` is the journal's stream systemd connected this process to: systemd sets
    $JOURNAL_STREAM to that stream's "device:inode" (a redirected stderr no longer matches)."""
    want = os.environ.get("JOURNAL_STREAM")
    if not want:
        return False
    try:
        dev, ino = (int(x) for x in want.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError, io.UnsupportedOperation):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def redact(line: str) -> str:
    """`line` with shaped secrets masked (see _SECRET_SHAPES); cheap when there is none."""
    if "lpa1." not in line and "earer" not in line and "EARER" not in line:
        return line
    return _SECRET_SHAPES.sub(lambda m: f"{m.group(1)}<redacted>" if m.group(1) else "Bearer <redacted>", line)


def iso_time(t: float) -> str:
    """UTC, to the millisecond: 2025-11-24T16:00:00.123Z."""
    ms = int(t * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


class Logger:
    """`log(event, **fields)` writes one JSON line; `level=` overrides the event's level.

    `stream`: where lines go; None is sys.stderr as it is at each write (tests swap it). A line
    that cannot be written (stderr closed, journald restarted) is dropped and counted: the agent's
    data path must not stop for its log."""

    def __init__(self, component: str, stream=None, level: str | None = None):
        self.component = component
        self.stream = stream
        self.threshold = RANK[parse_level(level, "level") if level else _env_level()]
        self.dropped = 0
        self._journal: tuple[object, bool] | None = None  # (the stream last checked, is it the journal)

    def set_level(self, level: str) -> None:
        self.threshold = RANK[parse_level(level, "level")]

    def __call__(self, event: str, level: str | None = None, **fields) -> None:
        level = level if level in RANK else EVENTS.get(event, DEFAULT_LEVEL)
        if RANK[level] < self.threshold:
            return
        t = time.time()
        rec = {"ts": round(t, 6), "time": iso_time(t), "level": level, "component": self.component, "event": event}
        if not ENVELOPE.isdisjoint(fields):
            fields = {(f"field_{k}" if k in ENVELOPE else k): v for k, v in fields.items()}
        rec.update(fields)
        self.write(redact(json.dumps(rec, default=str)), level)

    def write(self, line: str, level: str) -> None:
        """One line as it is (JSON, no newline), with the journal's prefix where that applies."""
        stream = self.stream if self.stream is not None else sys.stderr
        if self._journal is None or self._journal[0] is not stream:
            self._journal = (stream, is_journal(stream))
        text = (f"<{PRIORITY[level]}>" if self._journal[1] else "") + line + "\n"
        try:
            with _WRITE_LOCK:
                stream.write(text)
                stream.flush()
        except (OSError, ValueError):  # ValueError: a closed file
            self.dropped += 1


def say(text: str, level: str = "error", stream=None) -> None:
    """A plain-text line for a person (a refused config at start), with the journal's priority
    prefix when stderr is the journal, so `journalctl -p err` shows why a unit did not start."""
    stream = stream if stream is not None else sys.stderr
    prefix = f"<{PRIORITY[level]}>" if is_journal(stream) else ""
    with _WRITE_LOCK:
        stream.write(prefix + text + "\n")
        stream.flush()


class LogFile:
    """A log file as a Logger's stream: appended to (a restarted process carries on in it),
    private (mode 0600), bounded: past max_bytes it is renamed to <path>.1 (the previous .1 goes)
    and a new one started. One write per line, so a Follower never reads half of one."""

    def __init__(self, path: str, max_bytes: int = 16 << 20):
        self.path, self.max_bytes = path, max_bytes
        self._fd: int | None = None
        self._size = 0

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._size = os.fstat(self._fd).st_size

    def write(self, text: str) -> None:
        data = text.encode()
        if self._fd is None:
            self._open()
        elif self._size + len(data) > self.max_bytes and self._size:
            os.close(self._fd)
            os.replace(self.path, self.path + ".1")
            self._open()
        self._size += os.write(self._fd, data)

    def flush(self) -> None:
        pass  # os.write: nothing is buffered

    def fileno(self) -> int:
        if self._fd is None:
            self._open()
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_LEVEL_FIELD = re.compile(r'"level": "(\w+)"')


class Follower:
    """Copies the lines appended to a log file to `stream` (default: sys.stderr at each write),
    from where the file ended when the Follower was made; follows a LogFile's rotation. The
    journal's priority prefix is added from each line's level when the stream is the journal.
    `start()` polls in a thread every interval_s; `stop()` copies what is left and ends it."""

    def __init__(self, path: str, stream=None, interval_s: float = 0.2):
        self.path, self.stream, self.interval_s = path, stream, interval_s
        self._out = Logger("follower", stream, level="debug")  # its write() only
        self._file = None
        self._ino: int | None = None
        self._rest = b""
        self.copied = 0
        try:
            self._open(at_end=True)
        except FileNotFoundError:
            pass  # not written yet: read it from its start once it exists
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-follower", daemon=True)

    def _open(self, at_end: bool) -> None:
        f = open(self.path, "rb")
        self._ino = os.fstat(f.fileno()).st_ino
        if at_end:
            f.seek(0, os.SEEK_END)
        self._file = f

    def poll(self) -> int:
        """Copy the complete lines appended since the last poll; how many."""
        n = 0
        while True:
            if self._file is not None:
                n += self._copy(self._file.read())
            try:
                ino = os.stat(self.path).st_ino
            except FileNotFoundError:
                return n
            if ino == self._ino:
                return n
            # rotated (or made for the first time): what the old file still held was read above
            if self._file is not None:
                self._file.close()
            self._rest = b""
            try:
                self._open(at_end=False)
            except FileNotFoundError:
                self._file = None
                return n

    def _copy(self, data: bytes) -> int:
        if not data:
            return 0
        *lines, self._rest = (self._rest + data).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            found = _LEVEL_FIELD.search(line)
            level = found.group(1) if found and found.group(1) in RANK else DEFAULT_LEVEL
            self._out.write(line, level)
        self.copied += len(lines)
        return len(lines)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except OSError:
                pass  # the state directory unreadable for a moment: the next poll tries again

    def start(self) -> "Follower":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.poll()
        except OSError:
            pass
        if self._file is not None:
            self._file.close()
            self._file = None
