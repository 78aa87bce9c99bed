"""Durations and times as the CLI reads them (`--since 2h`, `--for 30m`, ISO times) and shows them
(ages, spans, UTC stamps)."""
from __future__ import annotations

import datetime as dt

from .coordinator_client import Usage


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def age(now: float, ts: float | None) -> str:
    return "-" if ts is None else span(now - ts)


def span(seconds: float) -> str:
    s = max(0.0, seconds)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h" if s < 172800 else f"{s / 86400:.0f}d"


def when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def parse_duration(text: str) -> float | None:
    """Seconds in `30s`, `15m`, `2h`, `7d` (a decimal number and one unit), or None."""
    if text and text[-1] in _UNITS and text.isascii() and text[:-1].replace(".", "", 1).isdigit():
        return float(text[:-1]) * _UNITS[text[-1]]
    return None


def parse_since(text: str, now: float) -> float:
    ago = parse_duration(text)
    if ago is not None:
        return now - ago
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise Usage(f"--since {text!r}: use 30s, 15m, 2h, 7d or an ISO time like 2026-11-30T14:00") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()
