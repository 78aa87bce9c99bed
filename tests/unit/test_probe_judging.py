"""The three probe judges held to one rule (docs/probe-judging.md): every case of
tests/data/probe_judging_cases.json runs on the C probe core (through its judging test hooks:
the loop's own send bookkeeping, receive path and evidence step, with given times), the verbs
engine (its send and completion methods, on a stand-in NIC and clock) and the fleet simulator
(its judging of pending probes, `VirtualAgent._judge`), and each must report what the case
expects. A case names the judges it cannot be laid out for, and why."""
from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from linkpass.core import wire
from linkpass.core.probe_event import EV_ANSWERED, EV_LATE, EV_MISS, from_record


CASES = json.loads((Path(__file__).parents[1] / "data" / "probe_judging_cases.json").read_text())["cases"]
JUDGES = ("core", "verbs", "sim")

KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
ME, PEER, PATH, SPORT = 7, 3, 1, 50000
MY_ADDR, PEER_ADDR, STRANGER_ADDR = "198.18.0.1", "198.18.0.2", "198.18.0.9"
PEER_QPN = 0x22


def _stamps(t1: int, t4: int, hold: int) -> tuple[int, int]:
    """The reflector's t2, t3 for a reply stamped t4 that it held `hold` ns (one-way delays equal)."""
    t2 = t1 + (t4 - t1 - hold) // 2
    return t2, t2 + hold


class Judge:
    """A judge being driven through a case: sends, receives, evidence times, then what it reported."""

    def __init__(self, rto_ns: int):
        self.rto_ns = rto_ns
        self.sent: list[tuple[int, int]] = []  # request index -> (seq, t1)

    def seq_of(self, k: int) -> tuple[int, int]:
        if k < len(self.sent):
            return self.sent[k]
        return self.next_seq() + k - len(self.sent), 0  # a sequence the path never sent

    def plan(self, timeline: list[dict]) -> None:
        """Read the whole timeline first (only a judge that draws fates at sending needs it)."""

    def index_of(self, seq: int) -> int:
        return next(k for k, (s, _) in enumerate(self.sent) if s == seq)


class CoreJudge(Judge):
    def __init__(self, rto_ns: int):
        super().__init__(rto_ns)
        from linkpass.probe import _probecore

        self.core = _probecore.Core(KEY, ME)
        self.forger = _probecore.Core(OTHER_KEY, ME)
        self._next: int | None = None
        self.fds = os.pipe()  # never read or written: the hooks stand in for the sockets
        self.core.add_nic(*self.fds, socket.inet_aton(MY_ADDR))
        self._add()
        self.core.track(True)

    def _add(self) -> None:
        self.core.add_path(PATH, 0, PEER, socket.inet_aton(PEER_ADDR), SPORT, 10**9, 0, 2**62)
        self.core.set_rto(PATH, self.rto_ns)

    def next_seq(self) -> int:
        if self._next is None:
            raise ValueError("the path's next sequence is known once it sent a request")
        return self._next

    def send(self, t1: int, size: int) -> None:
        seq = self.core.judge_send(PATH, t1, size)
        self.sent.append((seq, t1))
        self._next = seq + 1

    def reply(self, k: int, t4: int, hold: int, stranger: bool, forged: bool) -> None:
        if not self.sent:
            raise ValueError("a reply before any request")
        seq, t1 = self.seq_of(k)
        t2, t3 = _stamps(t1, t4, hold)
        src = socket.inet_aton(STRANGER_ADDR if stranger else PEER_ADDR)
        codec = self.forger if forged else self.core
        pkt = codec.encode(wire.KIND_REPLY, 0, 0, ME, PEER, PATH, seq, t1, t2, t3, 0, k + 1, src,
                           socket.inet_aton(MY_ADDR), SPORT, wire.ROCE_PORT)
        self.core.judge_receive(pkt, src, SPORT, t4)

    def evidence(self, t: int) -> None:
        self.core.judge_evidence(t)

    def renew(self) -> None:
        self.core.remove_path(PATH)
        self._add()
        self._next = None

    def report(self):
        data, _ = self.core.take_events(True)
        events = [from_record(r) for r in _EVENT.iter_unpack(data)]
        return events, dict(self.core.counters()["drops"])

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


class _Clock:
    """The verbs engine's `time` module, at a time the case sets."""

    def __init__(self):
        self.now = 0

    def time_ns(self) -> int:
        return self.now

    monotonic_ns = time_ns


class VerbsJudge(Judge):
    def __init__(self, rto_ns: int):
        super().__init__(rto_ns)
        from linkpass.probe import verbs_engine as V

        self.V = V
        self._mp = pytest.MonkeyPatch()
        self._mp.setattr(V, "load_pyverbs", lambda: None)
        self.clock = _Clock()
        self.clock.now = 10**12  # a new path's sequences start at the clock (above any earlier path's)
        self._mp.setattr(V, "time", self.clock)
        self.eng = V.VerbsProbeEngine(ME, KEY)
        self.buf = b""
        mr = SimpleNamespace(read=lambda n, off: self.buf[off:off + n])
        qp = SimpleNamespace(qp_num=0x11, post_recv=lambda wr: None)
        self.nic = SimpleNamespace(name="p0", addr=MY_ADDR, addr_b=socket.inet_aton(MY_ADDR), qp=qp, mtu=1024,
                                   tx=_Tx(), mr=mr, slot=1 << 16, recv_wrs=[None])
        self.eng.nics["p0"] = self.nic
        self._add()

    def _add(self) -> None:
        from linkpass.probe.common import PathSpec

        self.eng.add_path(PathSpec(PATH, "p0", PEER, PEER_ADDR, SPORT, interval_s=1.0))
        self.eng.peers[PEER_ADDR].qpn = PEER_QPN
        self.eng.set_rto(PATH, self.rto_ns)

    def next_seq(self) -> int:
        return self.eng.paths[PATH].next_seq

    def send(self, t1: int, size: int) -> None:
        self.clock.now = t1
        if size:
            self.eng.set_size_probe(PATH, 1, 1000)
        seq = self.eng.paths[PATH].next_seq
        self.eng._send_request(self.eng.paths[PATH])
        if size:
            self.eng.set_size_probe(PATH, 0, 0)
        self.sent.append((seq, t1))

    def reply(self, k: int, t4: int, hold: int, stranger: bool, forged: bool) -> None:
        seq, t1 = self.seq_of(k)
        t2, t3 = _stamps(t1, t4, hold)
        rep = wire.Probe(wire.KIND_REPLY, ME, PEER, PATH, seq, t1, t2, t3, 0, k + 1)
        codec = wire.Codec(OTHER_KEY) if forged else self.eng.codec
        src = STRANGER_ADDR if stranger else PEER_ADDR
        # a completion as the device leaves it: the GRH slot (the IPv4 header in its last 20 bytes), then the record
        grh = bytes(20) + bytes(12) + socket.inet_aton(src) + socket.inet_aton(MY_ADDR)
        self.buf = grh + codec.encode_ud(rep, SPORT)
        self.clock.now = t4
        wc = SimpleNamespace(wr_id=0, status=0, byte_len=len(self.buf), src_qp=PEER_QPN)
        self.eng._completion(self.nic, wc, t4)

    def evidence(self, t: int) -> None:  # what _once does once every CQ was emptied
        with self.eng._lock:
            self.eng._evidence_ns = t
            self.eng._expire(t)

    def renew(self) -> None:
        self.eng.remove_path(PATH)
        self._add()

    def report(self):
        events, _ = self.eng.poll(True)
        return events, dict(self.eng.drops)

    def close(self) -> None:
        for fd in (self.eng._wake_r, self.eng._wake_w, self.eng._kick_r, self.eng._kick_w):
            os.close(fd)
        self._mp.undo()


class _Tx:
    def sendto(self, pkt: bytes, addr) -> int:
        return len(pkt)


class SimJudge(Judge):
    """The simulator draws each probe's fate (its reply's arrival, the reflector's hold) when it is
    sent; here the case sets them, and `_judge` runs as the agent loop calls it. Its `now` counts
    arrivals at `now` as read, so evidence time E is its now E - 1."""

    def __init__(self, rto_ns: int):
        super().__init__(rto_ns)
        from linkpass.core.decide import PathInfo
        from linkpass.core.detector import DetectorConfig
        from linkpass_sim import virtual

        self.v = virtual
        self.agent = virtual.VirtualAgent("h0", DetectorConfig(), np.random.default_rng(0))
        info = PathInfo(PATH, "h1", 0, SPORT, virtual.peer_addr("h1", 0))
        self.agent.add_path(virtual.VirtualPath(info, ("a",), ("b",), 10**9, 0, 0, virtual.Rtt()))
        self.agent._prepare()
        # no confirmation rounds: they add probes of their own (the C core's are off until set_confirm)
        self.agent._confirm_threshold = 0
        self.rows: list[dict] = []
        self.events: list = []
        self.fates: dict[int, tuple[int, int]] = {}  # request index -> (reply stamped at, hold)

    def plan(self, timeline: list[dict]) -> None:
        for step in timeline:
            if "reply" in step:
                if step["reply"] in self.fates or step.get("from") or step.get("forged"):
                    raise ValueError("not a fate the simulated fabric draws")
                self.fates[step["reply"]] = (step["at"], step.get("hold", 0))

    def next_seq(self) -> int:
        return len(self.sent)

    def send(self, t1: int, size: int) -> None:
        k = len(self.sent)
        self.sent.append((k, t1))
        arr, hold = self.fates.get(k, (self.v.NEVER, 0))
        self.rows.append({"j": 0, "seq": k, "t1": t1, "arr": arr, "dl": t1 + self.rto_ns, "size": size,
                          "rx": k + 1, "hold": hold, "conf": 0, "fa": 1})

    def reply(self, k: int, t4: int, hold: int, stranger: bool, forged: bool) -> None:
        """Drawn when request k was sent (plan)."""

    def evidence(self, t: int) -> None:
        if self.rows:
            self.agent._pend = {c: np.concatenate([self.agent._pend[c], np.array([r[c] for r in self.rows], np.int64)])
                                for c in self.v._COLS}
            self.rows = []
        events = self.agent._judge(t - 1, True)
        events.sort(key=lambda e: e.t4)  # as step_at hands them to Failover: the order the C loop learns them
        self.events += events

    def renew(self) -> None:
        raise ValueError("simulated paths are never removed")

    def report(self):
        return self.events, {}

    def close(self) -> None:
        pass


_EVENT = struct.Struct("<IIQIIIIqqqq")  # the C core's event record (engine.py reads it alike)
MAKE = {"core": CoreJudge, "verbs": VerbsJudge, "sim": SimJudge}


def run_case(judge: Judge, case: dict) -> dict:
    """Drive `judge` through the case's timeline; what it reported, in the expectation's terms."""
    judge.plan(case["timeline"])
    for step in case["timeline"]:
        if "send" in step:
            for i in range(step.get("count", 1)):
                judge.send(step["send"] + i * step.get("every", 0), step.get("size_probe", 0))
        elif "reply" in step:
            judge.reply(step["reply"], step["at"], step.get("hold", 0), step.get("from") == "stranger",
                        step.get("forged", False))
        elif "evidence" in step:
            judge.evidence(step["evidence"])
        elif step.get("renew"):
            judge.renew()
        else:
            raise ValueError(f"unknown timeline step {step}")
    events, drops = judge.report()
    got = {"answered": 0, "miss": [], "late": [], "streak": 0, "drops": drops, "size_probe_misses": []}
    for ev in events:
        assert ev.path_id == PATH
        if ev.kind == EV_ANSWERED:
            got["answered"] += ev.count
            got["newest"], got["worst_rtt_ns"] = judge.index_of(ev.seq), ev.worst_rtt_ns
            got["streak"] = 0
        elif ev.kind == EV_MISS:
            got["miss"].append(judge.index_of(ev.seq))
            if ev.size_probe:
                got["size_probe_misses"].append(judge.index_of(ev.seq))
            else:
                got["streak"] += 1
        else:
            assert ev.kind == EV_LATE
            got["late"].append(judge.index_of(ev.seq))
            got["streak"] = 0
    return got


@pytest.mark.parametrize("judge", JUDGES)
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_the_judge_reports_what_the_case_expects(case, judge):
    if judge in case.get("not_for", {}):
        pytest.skip(case["not_for"][judge])
    j = MAKE[judge](case["rto_ns"])
    try:
        got = run_case(j, case)
    finally:
        j.close()
    want = {"size_probe_misses": [], **case["expect"]}
    assert {k: got.get(k) for k in want} == want


def test_every_case_is_a_row_of_the_spec_and_a_well_formed_timeline():
    doc = (Path(__file__).parents[2] / "docs" / "probe-judging.md").read_text()
    assert len({c["id"] for c in CASES}) == len(CASES)
    for case in CASES:
        assert f"| {case['row']} |" in doc, f"{case['id']}: row {case['row']} is not in docs/probe-judging.md"
        assert f"`{case['id']}`" in doc, f"{case['id']} is not named in docs/probe-judging.md"
        assert set(case.get("not_for", {})) <= set(JUDGES)
        times = [s.get("send", s.get("at", s.get("evidence"))) for s in case["timeline"] if not s.get("renew")]
        assert times == sorted(times), f"{case['id']}: the timeline is not in time order"
        last = case["timeline"][-1]
        assert "evidence" in last and all(s["at"] < last["evidence"] for s in case["timeline"] if "reply" in s), \
            f"{case['id']}: a timeline ends with an evidence time after every reply in it"
