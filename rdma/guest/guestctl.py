#!/usr/bin/env python3
"""guestctl: the LinkPass guest's control agent, PID 1 once init has set the guest up.

It serves the virtio-serial port ``org.linkpass.ctl``: one JSON object per line each way.

    {"id": N, "op": "run", "argv": [...], "timeout": S, "env": {...}}
        -> {"id": N, "rc": int, "stdout": str, "stderr": str}
           plus "timed_out": true (rc 124) when the timeout killed it, and "truncated": true when
           stdout or stderr passed 1 MiB (the rest was read and dropped)
    {"id": N, "op": "spawn", "name": "x", "argv": [...], "env": {...}}
        -> {"id": N, "pid": int}         stdout and stderr go to /lp/x.log
    {"id": N, "op": "kill", "name": "x", "signal": 15, "timeout": S}
        -> {"id": N, "rc": int | null}   null: still running S seconds (default 10) after the signal
    {"id": N, "op": "poweroff"}
        -> {"id": N, "poweroff": true}, then sync and power off

Bad input gets {"id": N or null, "error": "..."} naming the field; nothing a request carries
can end the server. Each request runs in its own thread (at most MAX_INFLIGHT at once), so a
long ``run`` never holds up ``spawn`` or ``kill``; replies are written whole under one lock and
carry the request's id, since they leave in completion order. An exit code is the process's
status, or minus the signal that ended it. ``run`` and ``spawn`` start each process in a new
session, so a timeout or a ``kill`` signals its whole process group. ``env`` is laid over a
base environment (PATH, HOME, LANG).

Being PID 1, it inherits every orphan in the guest: one reaper thread collects every exit,
ours and theirs, so no zombie accumulates and no request thread waits on a pid another thread
may already have collected. Off a guest (tests) it makes itself the subreaper instead, so the
same code runs, and it refuses to power the machine off unless it is PID 1.

The host side of the port is trusted: it is the guest's owner and may run anything here.
Limits (line length, concurrency, captured output) keep a confused host from exhausting the
guest's memory.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import select
import signal
import sys
import threading
import time

PORT_NAME = "org.linkpass.ctl"
PORT_PATH = "/dev/virtio-ports/" + PORT_NAME
LOG_DIR = "/lp"
MAX_LINE = 1 << 20          # one request; argv and env fit with room to spare
OUTPUT_CAP = 1 << 20        # per stream of a run
MAX_INFLIGHT = 64
MAX_NAMES = 256             # spawned names remembered (finished ones are forgotten first)
DEFAULT_RUN_TIMEOUT = 60.0
DEFAULT_KILL_TIMEOUT = 10.0
MAX_TIMEOUT = 7 * 24 * 3600.0
PIPE_GRACE = 1.0            # a run whose process exited but left a background holder of its pipes
KILL_GRACE = 5.0            # a run killed at its timeout that still has not exited
RECONNECT_POLL = 0.05       # the port reads empty while no host is connected
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "LANG": "C.UTF-8"}
RB_POWER_OFF = 0x4321FEDC   # <sys/reboot.h>: what `poweroff -f` asks the kernel for
PR_SET_CHILD_SUBREAPER = 36


def log(msg: str) -> None:
    print(f"guestctl: {msg}", file=sys.stderr, flush=True)


class RequestError(ValueError):
    """The request is wrong; the message names the field and what it should be."""


# --- processes ------------------------------------------------------------------------------------

class Child:
    def __init__(self, pid: int):
        self.pid = pid
        self.rc: int | None = None
        self.done = threading.Event()

    def signal_group(self, sig: int) -> None:
        """Signals the child's session (its process group); a no-op once it has been reaped."""
        with REAPER.lock:
            if self.rc is None:
                try:
                    os.killpg(self.pid, sig)
                except ProcessLookupError:
                    pass


class Reaper:
    """Collects every exit in the process. A pid stays a zombie until ``lock`` is held, so a pid
    that ``signal_group`` finds unreaped cannot have been reused."""

    def __init__(self):
        self.lock = threading.Lock()
        self.children: dict[int, Child] = {}
        self.wake = threading.Event()

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> Child:
        actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_DUP2, stdout, 1), (os.POSIX_SPAWN_DUP2, stderr, 2)]
        with self.lock:
            # Python ignores SIGPIPE and SIGXFSZ for itself; programs expect the defaults.
            pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True,
                                  setsigdef=(signal.SIGPIPE, signal.SIGXFSZ), setsigmask=())
            child = self.children[pid] = Child(pid)
        self.wake.set()
        return child

    def run_forever(self) -> None:
        while True:
            try:
                self.reap_one()
            except Exception as exc:  # the reaper must outlive anything
                log(f"reaper: {exc!r}")
                time.sleep(0.1)

    def reap_one(self) -> None:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            # No children, so no orphan can appear until we spawn: wait for that.
            self.wake.wait(1.0)
            self.wake.clear()
            return
        if info is None:
            return
        with self.lock:
            _, status = os.waitpid(info.si_pid, 0)
            child = self.children.pop(info.si_pid, None)
            if child is not None:
                child.rc = os.waitstatus_to_exitcode(status)
        if child is not None:
            child.done.set()


REAPER = Reaper()


def _env(req: dict) -> dict[str, str]:
    extra = req.get("env", {})
    if not isinstance(extra, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in extra.items()):
        raise RequestError("env: an object of string to string (names without '=') is required")
    return {**BASE_ENV, **extra}


def _argv(req: dict) -> list[str]:
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(
            isinstance(a, str) and "\0" not in a for a in argv) or not argv[0]:
        raise RequestError("argv: a non-empty list of strings is required, e.g. [\"ibv_devices\"]")
    return argv


def _timeout(req: dict, default: float) -> float:
    t = req.get("timeout", default)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_TIMEOUT:
        raise RequestError(f"timeout: seconds, a number > 0 and <= {MAX_TIMEOUT:.0f}")
    return float(t)


def _name(req: dict) -> str:
    name = req.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise RequestError("name: 1-64 of [A-Za-z0-9._-], not starting with '.' or '-' "
                           "(it names the log file /lp/NAME.log)")
    return name


def _start(argv, env, stdout, stderr) -> Child:
    try:
        return REAPER.spawn(argv, env, stdout, stderr)
    except OSError as exc:
        raise RequestError(f"argv: cannot start {argv[0]!r}: {exc.strerror}") from None


class Capture:
    def __init__(self):
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = OUTPUT_CAP - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def op_run(req: dict) -> dict:
    argv, env, timeout = _argv(req), _env(req), _timeout(req, DEFAULT_RUN_TIMEOUT)
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    try:
        child = _start(argv, env, w_out, w_err)
    except BaseException:
        for fd in (r_out, r_err):
            os.close(fd)
        raise
    finally:
        os.close(w_out)
        os.close(w_err)
    caps = {r_out: Capture(), r_err: Capture()}
    open_fds = set(caps)
    deadline = time.monotonic() + timeout
    timed_out = False
    exited_at = None
    try:
        while open_fds or not child.done.is_set():
            now = time.monotonic()
            if not timed_out and now >= deadline:
                timed_out = True
                child.signal_group(signal.SIGKILL)
            if child.done.is_set() and exited_at is None:
                exited_at = now
            if exited_at is not None and now - exited_at > PIPE_GRACE:
                break  # something it left behind holds the pipes: answer with what came
            if timed_out and now - deadline > KILL_GRACE:
                break  # SIGKILL did not end it (stuck in the kernel): answer anyway
            wait = 0.2 if timed_out or exited_at is not None else min(0.2, deadline - now)
            if not open_fds:
                child.done.wait(max(wait, 0.0))
                continue
            ready, _, _ = select.select(list(open_fds), [], [], max(wait, 0.0))
            for fd in ready:
                chunk = os.read(fd, 65536)
                if chunk:
                    caps[fd].add(chunk)
                else:
                    open_fds.discard(fd)
    finally:
        for fd in caps:
            os.close(fd)
    reply = {"rc": 124 if timed_out else child.rc,
             "stdout": caps[r_out].text(), "stderr": caps[r_err].text()}
    if timed_out:
        reply["timed_out"] = True
    if any(c.total > OUTPUT_CAP for c in caps.values()):
        reply["truncated"] = True
    return reply


class Spawned:
    """Processes started by ``spawn``, by name."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.lock = threading.Lock()
        self.by_name: dict[str, Child] = {}

    def spawn(self, req: dict) -> dict:
        name, argv, env = _name(req), _argv(req), _env(req)
        with self.lock:
            old = self.by_name.get(name)
            if old is not None and not old.done.is_set():
                raise RequestError(f"name: {name!r} is still running (pid {old.pid}); kill it first")
            if old is None and len(self.by_name) >= MAX_NAMES:
                finished = [n for n, c in self.by_name.items() if c.done.is_set()]
                if not finished:
                    raise RequestError(f"name: {MAX_NAMES} processes are running; kill some first")
                del self.by_name[finished[0]]
            path = os.path.join(self.log_dir, name + ".log")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise RequestError(f"name: cannot open {path}: {exc.strerror}") from None
            try:
                child = _start(argv, env, fd, fd)
            finally:
                os.close(fd)
            self.by_name[name] = child
        return {"pid": child.pid}

    def kill(self, req: dict) -> dict:
        name = _name(req)
        sig = req.get("signal", signal.SIGTERM.value)
        if isinstance(sig, bool) or not isinstance(sig, int) or not 0 <= sig < signal.NSIG:
            raise RequestError(f"signal: a signal number 0-{signal.NSIG - 1}, e.g. 15 (SIGTERM)")
        timeout = _timeout(req, DEFAULT_KILL_TIMEOUT)
        with self.lock:
            child = self.by_name.get(name)
        if child is None:
            raise RequestError(f"name: no process {name!r} was spawned")
        if not child.done.is_set():
            child.signal_group(sig)
            if sig != 0:  # 0 only asks whether it is still there
                child.done.wait(timeout)
        return {"rc": child.rc}


# --- the port -------------------------------------------------------------------------------------

class Server:
    def __init__(self, fd: int, log_dir: str, eof_ends: bool):
        self.fd = fd
        self.eof_ends = eof_ends  # a socket's EOF is the end; the port's is a host that left
        self.write_lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_INFLIGHT)
        self.spawned = Spawned(log_dir)
        self.ops = {"run": op_run, "spawn": self.spawned.spawn, "kill": self.spawned.kill,
                    "poweroff": self.op_poweroff}

    def send(self, obj: dict) -> None:
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        with self.write_lock:
            view = memoryview(data)
            while view:
                try:
                    n = os.write(self.fd, view)
                except OSError as exc:
                    log(f"reply for id {obj.get('id')!r} lost: {exc.strerror}")
                    return
                view = view[n:]

    def serve(self) -> None:
        buf = bytearray()
        skipping = False  # inside a line that was too long: drop up to its newline
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError as exc:
                log(f"reading the port: {exc.strerror}")
                time.sleep(RECONNECT_POLL)
                continue
            if not chunk:
                if self.eof_ends:
                    return
                buf.clear()  # the half line of a host that went away
                skipping = False
                time.sleep(RECONNECT_POLL)
                continue
            buf += chunk
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    if len(buf) > MAX_LINE:
                        if not skipping:
                            self.send({"id": None, "error": f"request longer than {MAX_LINE} bytes: dropped"})
                        skipping = True
                        buf.clear()
                    break
                line = bytes(buf[:nl])
                del buf[:nl + 1]
                if skipping:
                    skipping = False
                    continue
                if len(line) > MAX_LINE:
                    self.send({"id": None, "error": f"request longer than {MAX_LINE} bytes: dropped"})
                elif line.strip():
                    self.dispatch(line)

    def dispatch(self, line: bytes) -> None:
        try:
            req = json.loads(line)
        except ValueError as exc:
            self.send({"id": None, "error": f"not JSON: {exc}"})
            return
        if not isinstance(req, dict):
            self.send({"id": None, "error": "a request is a JSON object with \"id\" and \"op\""})
            return
        rid = req.get("id")
        if not (rid is None or isinstance(rid, (int, str))) or isinstance(rid, bool):
            self.send({"id": None, "error": "id: a number or a string"})
            return
        op = req.get("op")
        handler = self.ops.get(op) if isinstance(op, str) else None
        if handler is None:
            self.send({"id": rid, "error": f"op: {req.get('op')!r} is unknown; one of {sorted(self.ops)}"})
            return
        if not self.slots.acquire(blocking=False):
            self.send({"id": rid, "error": f"busy: {MAX_INFLIGHT} requests in progress"})
            return
        threading.Thread(target=self.handle, args=(handler, rid, req), daemon=True).start()

    def handle(self, handler, rid, req: dict) -> None:
        try:
            reply = handler(req)
        except RequestError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # a bug here must cost one request, not the guest
            log(f"request {rid!r} ({req.get('op')}): {exc!r}")
            reply = {"error": f"internal error: {exc!r}"}
        finally:
            self.slots.release()
        self.send({"id": rid, **reply})
        if reply.get("poweroff"):
            power_off()

    def op_poweroff(self, req: dict) -> dict:
        return {"poweroff": True}


def power_off() -> None:
    os.sync()
    if os.getpid() != 1:
        # Never switch off the machine this runs on unless it is the guest's init.
        log("not PID 1: exiting instead of powering off")
        os._exit(0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.reboot(RB_POWER_OFF)
    log(f"reboot(POWER_OFF) failed: {os.strerror(ctypes.get_errno())}")
    os._exit(1)  # init exiting panics the kernel, and panic=-1 with -no-reboot ends qemu


def find_port() -> str:
    """The port's device, by the name the host gave it (init makes the same link udev would)."""
    if os.path.exists(PORT_PATH):
        return PORT_PATH
    base = "/sys/class/virtio-ports"
    for dev in sorted(os.listdir(base)) if os.path.isdir(base) else ():
        try:
            with open(os.path.join(base, dev, "name")) as f:
                if f.read().strip() == PORT_NAME:
                    return "/dev/" + dev
        except OSError:
            continue
    raise SystemExit(f"guestctl: no virtio-serial port named {PORT_NAME} "
                     "(qemu needs -device virtserialport,name=" + PORT_NAME + ")")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="The LinkPass guest's control agent.")
    ap.add_argument("--fd", type=int, help="serve this open file descriptor (a socket) instead "
                    "of the virtio port; its EOF ends the server")
    ap.add_argument("--log-dir", default=LOG_DIR, help="where spawned processes' logs go")
    ap.add_argument("--poweroff", action="store_true", help="sync and power off (PID 1 only)")
    args = ap.parse_args(argv)
    if args.poweroff:
        power_off()
    if os.getpid() != 1:
        # Orphans of our children come back to us, as they do to PID 1 in the guest.
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    threading.Thread(target=REAPER.run_forever, name="reaper", daemon=True).start()
    if args.fd is not None:
        Server(args.fd, args.log_dir, eof_ends=True).serve()
        return
    path = find_port()
    fd = os.open(path, os.O_RDWR)
    log(f"serving {path}")
    Server(fd, args.log_dir, eof_ends=False).serve()


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as exc:
        log(f"stopped: {exc!r}")
        if os.getpid() == 1:
            power_off()
        raise
