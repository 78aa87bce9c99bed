"""Refused requests at the coordinator's endpoint: a token bucket per key (a client address, a
caller) that rate-limits them, and the ledger of what of them reaches the history.

Refusals never each reach the store: unauthenticated ones and revoked agent tokens become one
summary event per window (how many, from which addresses); refused drains and decommissions by
known callers and attempts to report as another host are recorded one by one up to
FORBIDDEN_EVENTS_PER_WINDOW, the rest in the summary. The service's tick writes them
(service.py).
"""
from __future__ import annotations

import collections
import threading
import time

from .auth import Caller
from .store import EventRow

FORBIDDEN_EVENTS_PER_WINDOW = 20  # refused drains etc. recorded one by one per summary window
TRACKED_ADDRESSES = 4096  # rate-limit buckets kept (least recently refused dropped first)


class Buckets:
    """A token bucket per key (a client address, a caller), the least recently used forgotten
    beyond `keep`. Thread-safe."""

    def __init__(self, rate: float, burst: int, keep: int = TRACKED_ADDRESSES):
        self.rate, self.burst, self.keep = rate, float(burst), keep
        self._lock = threading.Lock()
        self._buckets: collections.OrderedDict[str, list[float]] = collections.OrderedDict()

    def take(self, key: str) -> bool:
        """One from `key`'s bucket; False when it is empty."""
        mono_s = time.monotonic()
        with self._lock:
            b = self._buckets.pop(key, None) or [self.burst, mono_s]
            b[0] = min(self.burst, b[0] + (mono_s - b[1]) * self.rate)
            b[1] = mono_s
            ok = b[0] >= 1.0
            if ok:
                b[0] -= 1.0
            self._buckets[key] = b
            while len(self._buckets) > self.keep:
                self._buckets.popitem(last=False)
        return ok


class Refusals:
    """Refused requests: a token bucket per client address (rate limit), and what of them goes
    into the history. Called from the loop and the workers; `take` from the tick thread."""

    def __init__(self, rate_per_s: float, burst: int, window_s: float):
        """`rate_per_s`, `burst`: refusals a client address may cost before 429; `window_s`: how
        often the summary of the rest reaches the history."""
        self._rate = Buckets(rate_per_s, burst)
        self.window_s = window_s
        self._lock = threading.Lock()
        self._unauth: collections.Counter = collections.Counter()
        self._unauth_paths: collections.Counter = collections.Counter()
        self._revoked: collections.Counter = collections.Counter()  # host -> requests with a revoked token
        self._revoked_from: collections.Counter = collections.Counter()  # ... by client address
        self._events: list[EventRow] = []
        self._recorded = 0  # individual events this window
        self._unrecorded = 0  # refusals of known callers beyond the cap, this window
        self._window_start = time.time()

    def note(self, remote: str | None) -> bool:
        """One refusal from `remote`; False if it is over its rate."""
        return remote is None or self._rate.take(remote)

    def unauthenticated(self, remote: str, path: str) -> None:
        with self._lock:
            if remote in self._unauth or len(self._unauth) < 100:
                self._unauth[remote] += 1
            else:
                self._unauth["other addresses"] += 1
            if path in self._unauth_paths or len(self._unauth_paths) < 20:
                self._unauth_paths[path] += 1

    def revoked(self, host: str, remote: str) -> None:
        """A revoked agent token shown: its agent not yet given the new one, or someone who took
        the old one. One summary a window, like unauthenticated refusals (an agent retries)."""
        with self._lock:
            if host in self._revoked or len(self._revoked) < 100:
                self._revoked[host] += 1
            else:
                self._revoked["other hosts"] += 1
            if remote in self._revoked_from or len(self._revoked_from) < 100:
                self._revoked_from[remote] += 1

    def forbidden(self, caller: Caller, remote: str, path: str, why: str, record: bool) -> None:
        if not record:
            return
        with self._lock:
            if self._recorded < FORBIDDEN_EVENTS_PER_WINDOW:
                self._recorded += 1
                self._events.append(EventRow(time.time(), "refused", caller.name, path,
                                             {"action": path.rsplit("/", 1)[-1], "why": why, "remote": remote}))
            else:
                self._unrecorded += 1

    def take(self, final: bool, wall_s: float) -> list[EventRow]:
        with self._lock:
            out, self._events = self._events, []
            if final:
                if self._unauth:
                    out.append(EventRow(wall_s, "refused", "unauthenticated", "endpoint",
                                        {"why": "no valid token", "requests": sum(self._unauth.values()),
                                         "window_s": round(wall_s - self._window_start, 1),
                                         "by_address": dict(self._unauth.most_common(10)),
                                         "paths": dict(self._unauth_paths.most_common(5))}))
                if self._revoked:
                    out.append(EventRow(wall_s, "refused", "revoked", "endpoint",
                                        {"why": "revoked agent token", "requests": sum(self._revoked.values()),
                                         "window_s": round(wall_s - self._window_start, 1),
                                         "by_host": dict(self._revoked.most_common(10)),
                                         "by_address": dict(self._revoked_from.most_common(10))}))
                if self._unrecorded:
                    out.append(EventRow(wall_s, "refused", "coordinator", "endpoint",
                                        {"why": f"{self._unrecorded} more refusals of known callers than "
                                                f"{FORBIDDEN_EVENTS_PER_WINDOW} a window (not recorded one by one)",
                                         "window_s": round(wall_s - self._window_start, 1)}))
                self._unauth.clear()
                self._unauth_paths.clear()
                self._revoked.clear()
                self._revoked_from.clear()
                self._recorded = self._unrecorded = 0
                self._window_start = wall_s
        return out
