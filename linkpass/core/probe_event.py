"""The probe event: what the probe data path tells the agent's decision loop. Pure.

The C core's judging mode (`linkpass/probe/_probecore.c`) matches every reply to its request
against the path's deadline and reports, per path and in the order it learned them:

    ANSWERED  on-time replies since the path's previous event, folded into one: `count` of them,
              the newest one's exchange (seq, rx_count, t1..t4), `size_probe` 1 if any of them was
              a full-size probe, and the batch's worst round trip. Flushed before any other event
              of its path, so order is kept.
    MISS      a request whose deadline passed without a reply: seq, size_probe, t1 = sent,
              t4 = the deadline; no reply fields.
    LATE      a reply that came after its request was judged missed (or matched none): seq,
              rx_count and t1..t4 of that exchange.

`ProbeEvent` is the one definition of the fields and their units; the C binding
(`CoreProbeEngine.poll`), the simulator's model of the data path (`linkpass_sim.virtual`),
the telemetry feed (`core.telemetry.feed_events`) and `Failover.step` all build or read it by
name. It is a NamedTuple: the binding makes one per record straight from the unpacked C struct
(`from_record`, tuple's own constructor in C), at the cost of a plain tuple.

Times are integer ns. t1 and t4 are on the sender's (this agent's) clock; t2 and t3 on the
reflector's, so t2 - t1 and t4 - t3 are one-way delays plus and minus the clock offset.
"""
from __future__ import annotations

from enum import IntEnum
from functools import partial
from typing import NamedTuple


class EventKind(IntEnum):
    """The kind of a probe event; the values are _probecore.c's."""

    ANSWERED = 1
    MISS = 2
    LATE = 3


EV_ANSWERED, EV_MISS, EV_LATE = EventKind.ANSWERED, EventKind.MISS, EventKind.LATE


class ProbeEvent(NamedTuple):
    """One judging-mode event (see the module doc for what each kind sets; unset fields are 0).
    Field order is the C record's (`<IIQIIIIqqqq`)."""

    kind: int  # an EventKind
    path_id: int
    seq: int  # ANSWERED: the newest on-time request; MISS: the missed one; LATE: the late one
    count: int  # ANSWERED: how many on-time replies the event stands for
    rx_count: int  # requests the reflector had received on this path when it answered `seq`
    size_probe: int  # 1: a full-size (MTU) probe among them
    worst_rtt_ns: int  # ANSWERED: the largest round trip among them (saturates at 2**32 - 1)
    t1: int  # request sent (sender clock)
    t2: int  # request received by the reflector (reflector clock)
    t3: int  # reply sent by the reflector (reflector clock)
    t4: int  # reply received (sender clock); MISS: the deadline the request missed

    @classmethod
    def answered(cls, path_id: int, seq: int, count: int, rx_count: int, size_probe: int, worst_rtt_ns: int,
                 t1: int, t2: int, t3: int, t4: int) -> "ProbeEvent":
        return cls(EV_ANSWERED, path_id, seq, count, rx_count, size_probe, worst_rtt_ns, t1, t2, t3, t4)

    @classmethod
    def miss(cls, path_id: int, seq: int, size_probe: int, t1: int, deadline_ns: int) -> "ProbeEvent":
        return cls(EV_MISS, path_id, seq, 0, 0, size_probe, 0, t1, 0, 0, deadline_ns)

    @classmethod
    def late(cls, path_id: int, seq: int, rx_count: int, t1: int, t2: int, t3: int, t4: int) -> "ProbeEvent":
        return cls(EV_LATE, path_id, seq, 0, rx_count, 0, 0, t1, t2, t3, t4)

    @property
    def replies(self) -> int:
        """How many replies the event carries: ANSWERED `count`, LATE 1, MISS none."""
        return self.count if self.kind == EV_ANSWERED else 0 if self.kind == EV_MISS else 1


# one event from an unpacked C record (a tuple in field order): tuple.__new__ runs in C, where
# NamedTuple's _make is a Python function; the binding makes thousands a second
from_record = partial(tuple.__new__, ProbeEvent)
