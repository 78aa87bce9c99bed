"""`linkpass coordinator` in the foreground (the embedded default, and the systemd unit): the
process that holds the local Ray instance and the actor, and speaks the service manager's
protocol for them (observe/sdnotify.py; docs/systemd.md).

- READY=1 once the endpoint answers `GET /v1/healthz` on this host (the actor being created is
  not enough: its server must accept connections).
- WATCHDOG=1 after each check the endpoint answers, checking six times per watchdog timeout:
  a dead or wedged actor, or an event loop that no longer serves, stops the pings, and systemd
  restarts the unit (Ray restarts a dead actor by itself first; the timeout leaves it the time
  to). One check that fails or times out on a busy host must not: at two checks per timeout the
  next answer would come a timeout and a check's duration after the last ping, too late.
- STOPPING=1 when SIGTERM or Ctrl-C ends the wait; the caller then stops the actor and Ray.

The health check is this host talking to its own child over loopback: it sends no token, and
does not verify the server's certificate (the name in it need not be a loopback name). Under
mutual TLS it shows the lab CA's local client certificate when there is one; without one, a
completed handshake counts (the server then refuses the request, but it served the connection).
"""
from __future__ import annotations

import http.client
import os
import ssl
import time
from typing import Callable
from urllib.parse import urlparse

from ..observe.log import say
from ..observe.sdnotify import Notifier
from ..control.tls import LOCAL_CLIENT, lab_dir, lab_paths

CHECK_TIMEOUT_S = 5.0
# k failed checks in a row (each up to CHECK_TIMEOUT_S) leave (k + 1) x timeout/6 + k x 5 s between
# pings: 60 s of watchdog tolerates three (55 s), the fourth restarts the unit
CHECKS_PER_WATCHDOG = 6
START_CHECK_EVERY_S = 0.5  # until the endpoint first answers
SLICE_S = 0.5  # the wait's granularity: `end` and signals are seen this quickly


def local_target(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) to reach the endpoint at `url` from this host: a wildcard listen
    address is reached on loopback."""
    u = urlparse(url)
    host = u.hostname or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return u.scheme, host, u.port or (443 if u.scheme == "https" else 80)


def _client_context(settings: dict) -> tuple[ssl.SSLContext, bool]:
    """The check's TLS context, and whether it shows a client certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # our own child on loopback; nothing secret is sent
    cert, key = lab_paths(lab_dir(settings.get("state_dir") or "."), LOCAL_CLIENT)
    if settings.get("require_client_cert") and os.access(cert, os.R_OK) and os.access(key, os.R_OK):
        try:
            ctx.load_cert_chain(cert, key)
            return ctx, True
        except (OSError, ssl.SSLError):
            pass
    return ctx, False


def endpoint_problem(url: str, settings: dict, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """None if the endpoint answers GET /v1/healthz, else why not. Under mutual TLS without a
    local client certificate, a completed handshake is the answer: the server then refuses the
    request (an alert, or it hangs up), but its loop served the connection."""
    try:
        scheme, host, port = local_target(url)
    except ValueError as exc:  # not a URL this check can dial
        return f"cannot dial {url}: {exc}"
    refused_ok = False
    if scheme == "https":
        ctx, shown = _client_context(settings)
        refused_ok = bool(settings.get("require_client_cert")) and not shown
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        try:
            conn.connect()  # TCP, and TLS: the handshake is already the endpoint's loop at work
        except ssl.SSLError as exc:
            if refused_ok and "ALERT" in str(exc.reason or "").upper():
                return None
            return f"TLS with {host}:{port} failed ({exc.reason or exc})"
        except OSError as exc:
            return f"{host}:{port} does not answer ({exc})"
        try:
            conn.request("GET", "/v1/healthz")
            resp = conn.getresponse()
            resp.read(4096)
        except (OSError, http.client.HTTPException) as exc:
            return None if refused_ok else f"{host}:{port} does not answer /v1/healthz ({exc})"
        return None if resp.status == 200 else f"GET /v1/healthz answered {resp.status}"
    finally:
        conn.close()


def hold(url: str, settings: dict, end: float | None, notifier: Notifier | None = None,
         problem: Callable[[str, dict], str | None] = endpoint_problem,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait in the foreground until `end` (time.monotonic; None: until stopped) or a
    KeyboardInterrupt (SIGTERM is turned into one), speaking sd_notify meanwhile. Returns after
    STOPPING=1 has been sent; the caller stops the actor."""
    n = notifier if notifier is not None else Notifier()
    ready = not n.enabled  # without a service manager there is nobody to tell
    interval = None if n.watchdog_s is None else n.watchdog_s / CHECKS_PER_WATCHDOG
    next_check = clock()
    failing: str | None = None
    try:
        while end is None or clock() < end:
            mono_s = clock()
            if n.enabled and mono_s >= next_check:
                why = problem(url, settings)
                if why is None:
                    if not ready:
                        n.ready(f"serving {url}")
                        ready = True
                    elif failing is not None:
                        n.status(f"serving {url}")
                        say(f"linkpass coordinator: the endpoint answers again: {url}", level="info")
                    failing = None
                    n.ping()
                else:
                    if failing is None and ready:
                        n.status(f"endpoint not answering: {why}; watchdog pings withheld")
                        say(f"linkpass coordinator: the endpoint does not answer ({why}): watchdog pings withheld, "
                            "systemd restarts the coordinator if this lasts the watchdog timeout", level="warning")
                    failing = why
                if not ready:
                    next_check = clock() + START_CHECK_EVERY_S
                else:
                    next_check = clock() + (interval if interval is not None else float("inf"))
            sleep(SLICE_S if end is None else max(0.0, min(SLICE_S, end - clock())))
    except KeyboardInterrupt:
        pass
    n.stopping("stopping: the actor and the local Ray instance")
    n.close()
