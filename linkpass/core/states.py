"""What a path's state means, for everyone who reads one: the words and the rules, defined once.

Pure; no imports beyond the standard library. The detector (`detector.py`) decides the states;
routes, the coordinator, the CLI, the doctor and the demo read them, mostly as the strings the
agents report ("down"), and every one of them asks the same few questions of a state. Each
question has one answer here, so two commands cannot disagree about the same path.

    state       usable  dark  bad   good  health     what it is
    up          yes     -     -     yes   ok         answering on time
    suspect     yes     -     -     -     warning    a probe missed; traffic stays while it is short
    recovering  -       -     -     -     warning    answering again, in hold-down
    degraded    -       -     yes   -     warning    gray: loss, latency or MTU black hole
    down        -       yes   yes   -     critical   consecutive probes unanswered
    damped      -       yes   yes   -     critical   flapping: held out until the penalty decays

- usable: traffic may use the path (routes, entropy table).
- dark: nothing gets through, or the path is held out whatever it does.
- held out: answering, but kept out of use (degraded, recovering): neither usable nor dark.
- bad / good: evidence about the links the path crosses (the coordinator's localization, and
  "detection" events): bad says one of them is faulty, good that they all work. The others are
  passing states (suspect: one probe late; recovering: hold-down) that leave the path's last
  evidence standing; they are also the commonest reports.
- health: the one level every command derives its exit code and colour from. A suspect path is
  a warning: the path is still used, but on-call wants to know that probes are being lost.

A path's direction (`Direction`) is which way along it a packet travels: the probe (forward, to
the reflector) or its reply (reverse). A link's direction is another thing: which way across one
fabric link, by tier (`fabric.UP`, away from the hosts, and `fabric.DOWN`).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable


class State(enum.Enum):
    """A path's state, as the detector keeps it and agents report it (`value`)."""

    UP = "up"
    SUSPECT = "suspect"  # a probe missed; not yet failed (traffic stays)
    DOWN = "down"  # hard failure: consecutive misses
    DEGRADED = "degraded"  # gray: loss, latency or MTU black hole; traffic should leave
    DAMPED = "damped"  # flap-suppressed: out until the penalty decays
    RECOVERING = "recovering"  # answering again, under watch for the hold-down

    @property
    def usable(self) -> bool:
        """Whether traffic may use the path in this state."""
        return self in USABLE

    @property
    def health(self) -> Level:
        return HEALTH[self]


class Level(enum.Enum):
    """How much on-call should care; `value` is what JSON documents carry ("health")."""

    OK = "ok"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Level.OK: 0, Level.WARNING: 1, Level.CRITICAL: 2}

# The classes are tuples, not sets: the detector tests them on every batch of every path, and a
# tuple's `in` compares identities in C where a set would call Enum's __hash__, written in Python.
USABLE = (State.UP, State.SUSPECT)
DARK = (State.DOWN, State.DAMPED)
HELD_OUT = tuple(s for s in State if s not in USABLE and s not in DARK)  # degraded, recovering
BAD = (State.DOWN, State.DAMPED, State.DEGRADED)
GOOD = (State.UP,)

HEALTH: dict[State, Level] = {
    State.UP: Level.OK,
    State.SUSPECT: Level.WARNING,
    State.RECOVERING: Level.WARNING,
    State.DEGRADED: Level.WARNING,
    State.DOWN: Level.CRITICAL,
    State.DAMPED: Level.CRITICAL,
}

# how views colour a state (the dashboards' series; Grafana's colour names): one per state
COLOR = {State.UP: "green", State.SUSPECT: "yellow", State.RECOVERING: "blue", State.DEGRADED: "orange",
         State.DOWN: "red", State.DAMPED: "purple"}
STATE_NAMES = tuple(s.value for s in State)  # every state as reported, in declaration order
_BY_NAME = {s.value: s for s in State}


def state_of(name: State | str | None) -> State | None:
    """The `State` a reported name stands for; None for anything that is not a state (a row
    without one, or a newer agent's word this code does not know)."""
    if isinstance(name, State):
        return name
    return _BY_NAME.get(name) if isinstance(name, str) else None


def health_of(name: State | str | None) -> Level | None:
    """The health level of a reported state; None when it is not a state."""
    s = state_of(name)
    return None if s is None else HEALTH[s]


def is_bad(name: State | str) -> bool:
    return state_of(name) in BAD


def is_good(name: State | str) -> bool:
    return state_of(name) in GOOD


def worst(levels: Iterable[Level | None]) -> Level:
    """The most serious of `levels` (None entries count for nothing); OK when there are none."""
    out = Level.OK
    for lv in levels:
        if lv is not None and lv.rank > out.rank:
            out = lv
    return out


class Direction(enum.Enum):
    """Which way along a probed path: the probe's request or its reply (a path's direction,
    not a link's: see `fabric.UP`/`fabric.DOWN`). `value` is how reports and metrics spell it;
    `short` is the abbreviation in field and reason names (loss_fwd_pct, gray_loss_fwd)."""

    FWD = "forward"  # request path: sender -> reflector
    REV = "reverse"  # reply path: reflector -> sender

    @property
    def short(self) -> str:
        return "fwd" if self is Direction.FWD else "rev"
