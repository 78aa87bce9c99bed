"""The service manager's notification protocol (sd_notify(3)), spoken without libsystemd.

Under a unit with Type=notify, systemd puts the path of a datagram socket in $NOTIFY_SOCKET
(an absolute path, or `@name` for the abstract namespace) and the process sends it newline-
separated `KEY=VALUE` assignments:

    READY=1                      start-up is finished: `systemctl start` returns, dependants start
    STATUS=...                   one line for `systemctl status`
    RELOADING=1 + MONOTONIC_USEC a reload began (the clock reading lets systemd >= 253 tell this
                                 reload from an earlier one); READY=1 ends it
    STOPPING=1                   a clean stop began
    WATCHDOG=1                   alive; with WatchdogSec= set, systemd passes the timeout in
                                 $WATCHDOG_USEC (for the process $WATCHDOG_PID names, if set) and
                                 kills the service when no ping arrives within it

Where $NOTIFY_SOCKET is unset (a shell, a test, a container) every call is a no-op. A message
that cannot be sent is counted and dropped: the data path never waits for, or fails on, the
service manager.

`Watchdog` pings at half the timeout, and only while its health check finds nothing wrong: the
process stays alive to log why, and systemd restarts it when the timeout runs out.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable, Mapping


def socket_address(value: str | None) -> str | bytes | None:
    """$NOTIFY_SOCKET as an AF_UNIX address, or None: `@name` is the abstract namespace (a
    leading NUL); other forms (vsock:, relative paths) are not ours to speak."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def watchdog_usec(environ: Mapping[str, str], pid: int) -> int | None:
    """The watchdog timeout this process must keep, in µs, or None: $WATCHDOG_USEC when it is a
    positive number and $WATCHDOG_PID, if set, names this process (a child that inherited the
    environment must not ping for its parent)."""
    want = environ.get("WATCHDOG_PID")
    if want:
        try:
            if int(want) != pid:
                return None
        except ValueError:
            return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None


class Notifier:
    """Sends sd_notify messages to the service manager, if there is one."""

    def __init__(self, environ: Mapping[str, str] | None = None, pid: int | None = None,
                 monotonic_ns: Callable[[], int] = time.monotonic_ns):
        env = os.environ if environ is None else environ
        self.address = socket_address(env.get("NOTIFY_SOCKET"))
        self.watchdog_usec = watchdog_usec(env, os.getpid() if pid is None else pid) if self.address else None
        self._mono_ns = monotonic_ns
        self._sock: socket.socket | None = None
        self.sent = 0
        self.failed = 0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_s(self) -> float | None:
        return None if self.watchdog_usec is None else self.watchdog_usec / 1e6

    def send(self, *assignments: str) -> bool:
        """One datagram of `KEY=VALUE` lines; False if there is no manager or it could not be sent."""
        if self.address is None or not assignments:
            return False
        data = "\n".join(a.replace("\n", " ") for a in assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # the manager reads at once; never stall a loop on it
            self._sock.sendto(data, self.address)
        except OSError:
            self.failed += 1
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *((f"STATUS={status}",) if status else ()))

    def reloading(self) -> bool:
        return self.send("RELOADING=1", f"MONOTONIC_USEC={self._mono_ns() // 1000}")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *((f"STATUS={status}",) if status else ()))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def ping(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Watchdog:
    """WATCHDOG=1 every half timeout while `problem()` returns None. When it returns a reason the
    pings stop (systemd then restarts the service once the timeout has run out since the last
    one); `on_withheld(reason)` and `on_resumed()` are called when that starts and ends.
    `tick()` is cheap: call it from the loop whose liveness the pings should vouch for."""

    def __init__(self, notifier: Notifier, problem: Callable[[], str | None],
                 clock: Callable[[], float] = time.monotonic,
                 on_withheld: Callable[[str], None] | None = None, on_resumed: Callable[[], None] | None = None):
        self.notifier, self.problem, self.clock = notifier, problem, clock
        self.on_withheld, self.on_resumed = on_withheld, on_resumed
        timeout = notifier.watchdog_s
        self.interval_s = None if timeout is None else timeout / 2
        self.withheld: str | None = None  # why the pings stopped, while they are stopped
        self._next = clock()

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None

    def due_in(self) -> float | None:
        """Seconds until the next ping is due (for a loop that sleeps), or None without a watchdog."""
        return None if self.interval_s is None else max(0.0, self._next - self.clock())

    def tick(self) -> bool:
        """Ping if one is due and nothing is wrong; True if a ping was sent."""
        if self.interval_s is None:
            return False
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        why = self.problem()
        if why is not None:
            if self.withheld is None and self.on_withheld is not None:
                self.on_withheld(why)
            self.withheld = why
            return False
        if self.withheld is not None:
            self.withheld = None
            if self.on_resumed is not None:
                self.on_resumed()
        return self.notifier.ping()
