"""Polling a condition with a deadline."""
from __future__ import annotations

import time


def wait_until(pred, timeout_s: float, what: str, detail=None):
    """pred()'s first truthy value, polled every 20 ms; after timeout_s an AssertionError names
    `what` and, if given, detail()."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f": {detail()}" if detail else ""))
