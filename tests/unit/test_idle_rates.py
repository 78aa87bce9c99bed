"""Active and idle rates: which peers move data (the kernel's TCP socket diagnostics) sets how
often each path is probed; the pure bookkeeping and the netlink parser (the kernel's filter among
thousands of sockets, and the agent on the testbed: tests/root/test_idle_rates_testbed.py)."""
from __future__ import annotations

import ipaddress
import random
import socket
import struct
import time

import pytest

from linkpass.core.activity import (ACTIVE, BATCH_CEILING_S, IDLE, PROGRESSING, STANDBY, Activity, LaneSeen, PathKey,
                                    RateChange, UnreportedRdma, batch_interval_s)
from linkpass.agent.config import Peer
from linkpass.kernel import rdma as R
from linkpass.kernel import sockdiag as SD

MS = 1_000_000


def test_a_peer_is_active_from_its_first_data_until_it_has_been_quiet_for_idle_after():
    act = Activity(idle_after_ns=1000 * MS)
    paths = {1: PathKey("h1", 0, 1), 2: PathKey("h1", 1, 2), 3: PathKey("h3", 0, 3)}
    # new paths start at the active rate: the first look demotes those of quiet peers
    assert act.update(paths, 0) == [RateChange(1, "h1", IDLE), RateChange(2, "h1", IDLE), RateChange(3, "h3", IDLE)]
    assert act.update(paths, 100 * MS) == []  # nothing changed, nothing to do
    act.saw(["h3"], 200 * MS)  # TCP to h3's service address: every path of h3 (the routes pick the plane)
    assert act.update(paths, 200 * MS) == [RateChange(3, "h3", ACTIVE)]
    assert act.counts() == {ACTIVE: 1, PROGRESSING: 0, STANDBY: 0, IDLE: 2}
    assert act.update(paths, 1200 * MS) == []  # quiet for exactly idle_after: still active
    assert act.update(paths, 1201 * MS) == [RateChange(3, "h3", IDLE)]
    # TCP to h1's plane-1 address: that plane's path is active, the peer's others standby
    act.saw_planes([("h1", 1)], 1300 * MS)
    assert act.update(paths, 1300 * MS) == [RateChange(1, "h1", STANDBY), RateChange(2, "h1", ACTIVE)]
    # a path that is gone is forgotten, and so is a peer without paths
    act.saw(["h3"], 1300 * MS)
    assert act.update({1: PathKey("h1", 0, 1)}, 1300 * MS) == [] and act.rate == {1: STANDBY}
    assert "h3" not in act.last_moved
    with pytest.raises(ValueError, match="idle_after_ns must be > 0"):
        Activity(0)


def test_replies_are_taken_as_often_as_the_fastest_path_is_probed_within_the_floor_and_ceiling():
    floor = 0.01  # probe.batch_ms
    assert batch_interval_s([0.001, 0.05, 0.1], floor) == floor  # a path at the active rate: every 10 ms
    assert batch_interval_s([0.05, 0.1], floor) == 0.05  # the job's lanes progressing, the rest idle
    assert batch_interval_s([0.02, 0.1], floor) == 0.02
    assert batch_interval_s([0.1, 1.0], floor) == BATCH_CEILING_S  # all idle: the ceiling, not 100 ms
    assert batch_interval_s([], floor) == floor  # no paths yet
    assert batch_interval_s([0.001], 0.08) == 0.08  # a longer probe.batch_ms wins over both


def test_update_gives_every_path_the_rate_classify_gives_it():
    """update() skips the full classification for paths no evidence names; over random mixes of
    TCP, lanes (stalled, progressing, silent, quiet) and unreported RDMA, every path must still
    get exactly what classify() says."""
    import random

    rnd = random.Random(7)
    peers = [f"h{i}" for i in range(1, 8)]
    paths = {i: PathKey(rnd.choice(peers), rnd.randrange(4), rnd.choice((0, 49152, 49153))) for i in range(60)}
    for trial in range(200):
        act = Activity(idle_after_ns=1000 * MS, progress_window_ns=4 * MS)
        t = 2000 * MS
        for _ in range(rnd.randrange(4)):
            act.saw([rnd.choice(peers)], t - rnd.randrange(2000) * MS)
        for _ in range(rnd.randrange(4)):
            act.saw_planes([(rnd.choice(peers), rnd.randrange(4))], t - rnd.randrange(2000) * MS)
        if rnd.random() < 0.3:
            act.saw_unreported_rdma([rnd.randrange(4)], t - rnd.randrange(2000) * MS)
        for look in range(3):  # three looks, so stalls, holds and waiting spells build up
            now = t + look * 3 * MS
            act.saw_lanes([LaneSeen(rnd.choice(peers), rnd.randrange(4), rnd.choice((0, 49152, 49153)),
                                    now - rnd.randrange(12) * MS, rnd.random() < 0.6,
                                    now - rnd.choice((0, 1, 30)) * MS) for _ in range(rnd.randrange(6))], now)
        now = t + 9 * MS
        act.update(paths, now)
        busy = act.busy_peers(now)
        assert act.rate == {pid: act.classify(key, now, busy) for pid, key in paths.items()}, trial
    # a lane that stalled and is gone from the reports: its path stays active for the hold,
    # though nothing else names its peer any more
    act = Activity(idle_after_ns=1000 * MS, progress_window_ns=4 * MS)
    one = {1: PathKey("h9", 0, 49152)}
    act.saw_lanes([LaneSeen("h9", 0, 49152, 90 * MS, True, 100 * MS)], 100 * MS)
    act.saw_lanes([LaneSeen("h9", 0, 49152, 90 * MS, True, 106 * MS)], 106 * MS)
    act.saw_lanes([], 108 * MS)
    act.update(one, 108 * MS)
    assert act.lane_stalled and act.rate == {1: ACTIVE}


def test_rdma_traffic_no_lane_names_makes_its_plane_active_and_only_that_plane():
    """A plane's RDMA device moving more packets than the agent's probes account for, with no
    lane report on it, is traffic the agent cannot place: every path of that plane is active
    (whatever peer), the other planes keep their rates, until it has been quiet for idle_after."""
    un = UnreportedRdma(floor_pps=5000)
    assert un.look(0, {0: 1000, 1: 1000}, 0, ()) == {}  # the first look only takes the counters
    # 0.1 s: plane 0 moved 900 + 2000 packets, 2000 of them the agent's own (requests, replies,
    # reflected): 9 000/s left, over the floor; plane 1 moved its 300 and no more than the probes
    assert un.look(100 * MS, {0: 3900, 1: 1300}, 2000, ()) == {0: pytest.approx(9000)}
    # a lane report on plane 0 names its traffic: no longer unreported
    assert un.look(200 * MS, {0: 6900, 1: 1400}, 2100, {0}) == {}
    # a counter that went backwards (the device was reset) is no evidence; the next look starts there
    assert un.look(300 * MS, {0: 5, 1: 1500}, 2200, ()) == {}
    assert list(un.look(400 * MS, {0: 2000, 1: 1600}, 2300, ())) == [0]
    # the agent's own probes alone never count, however many
    assert un.look(500 * MS, {0: 102_000, 1: 1700}, 102_300, ()) == {}
    with pytest.raises(ValueError, match="floor_pps must be > 0"):
        UnreportedRdma(0)

    act = Activity(idle_after_ns=1000 * MS)
    paths = {1: PathKey("h1", 0, 1), 2: PathKey("h1", 1, 2), 3: PathKey("h3", 0, 3), 4: PathKey("h3", 1, 4)}
    act.update(paths, 0)
    act.saw_unreported_rdma([0], 100 * MS)
    assert act.update(paths, 100 * MS) == [RateChange(1, "h1", ACTIVE), RateChange(3, "h3", ACTIVE)]
    assert act.unreported_rdma_planes(100 * MS) == [0]
    # a lane's own progress still says more about its path than the plane's counters
    act.saw_lanes([LaneSeen("h3", 0, 3, 150 * MS, True)], 151 * MS)
    assert act.classify(paths[3], 151 * MS, act.busy_peers(151 * MS)) == PROGRESSING
    assert act.update(paths, 1101 * MS)[0] == RateChange(1, "h1", IDLE) and act.unreported_rdma_planes(1101 * MS) == []


def test_the_agent_takes_its_own_probes_from_the_counters_and_says_which_planes_went_active():
    """The agent's step between the sampler's counter reads and the rates: its own exchanges
    (requests sent and reflected, two packets each) come off, each new read is taken once, and
    the planes made active are logged when they change. The engine and config are stand-ins;
    the logic under test is the agent's."""
    from types import SimpleNamespace

    from linkpass.agent.rates import Rates

    logged = []
    agent = SimpleNamespace(cfg=SimpleNamespace(unreported_rdma_pps=5000), rdma_ports=None, unreported=None,
                            _rdma_fed=0, _rdma_said=[], _rdma_pps={}, activity=Activity(idle_after_ns=1000 * MS),
                            engine=SimpleNamespace(stats={"sent": 0, "reflected": 0}),
                            log=lambda event, **kw: logged.append((event, kw.get("planes"), kw.get("pps"))))

    def see(when, counts, sent, reflected, lane_planes=(), now=None):
        if counts is not None:
            agent.rdma_ports = (when, counts)
        agent.engine.stats = {"sent": sent, "reflected": reflected}
        Rates._see_unreported_rdma(agent, set(lane_planes), when if now is None else now)

    see(1, {0: 0, 1: 0}, 0, 0)
    # 0.1 s: 400 exchanges of the agent's own (800 packets) and 1 000 more on plane 0: 10 000/s
    see(100 * MS, {0: 1800, 1: 800}, 200, 200)
    assert logged == [("rdma_unreported", [0], {0: 10_000})]
    see(150 * MS, None, 10**6, 0)  # no new read: nothing is taken again, whatever the probes did
    assert agent._rdma_fed == 100 * MS and len(logged) == 1
    see(1200 * MS, None, 10**6, 0)  # quiet for idle_after: the plane is back to its paths' own rates
    assert logged[-1] == ("rdma_unreported", [], {})
    agent.cfg.unreported_rdma_pps = 0  # a reload turned it off: no more reads are taken
    see(1300 * MS, {0: 10**9, 1: 0}, 0, 0)
    assert logged[-1] == ("rdma_unreported", [], {}) and len(logged) == 2


def test_an_rdma_ports_packet_counters_are_read_from_sysfs(tmp_path):
    """The port's own counters (InfiniBand and mlx5 RoCE ports) first, then the driver's (rxe);
    a file that is not one decimal number, or is missing, gives None rather than a guess."""
    def write(dev: str, group: str, name: str, text: str) -> None:
        d = tmp_path / dev / "ports" / "1" / group
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)

    write("mlx5_0", "counters", "port_xmit_packets", "1000\n")
    write("mlx5_0", "counters", "port_rcv_packets", "234\n")
    write("mlx5_0", "hw_counters", "sent_pkts", "7\n")
    write("mlx5_0", "hw_counters", "rcvd_pkts", "7\n")
    write("rxe_p0", "hw_counters", "sent_pkts", "40\n")
    write("rxe_p0", "hw_counters", "rcvd_pkts", "2\n")
    write("bad0", "hw_counters", "sent_pkts", "-5\n")
    write("bad0", "hw_counters", "rcvd_pkts", "1\n")
    write("long0", "hw_counters", "sent_pkts", "1" * 64)
    write("long0", "hw_counters", "rcvd_pkts", "1\n")
    assert R.port_packets("mlx5_0", sysfs=str(tmp_path)) == 1234
    assert R.port_packets("rxe_p0", sysfs=str(tmp_path)) == 42
    assert R.port_packets("bad0", sysfs=str(tmp_path)) is None
    assert R.port_packets("long0", sysfs=str(tmp_path)) is None
    assert R.port_packets("gone0", sysfs=str(tmp_path)) is None


def diag_message(family: int, dst: str, last_sent_ms: int, last_recv_ms: int, info: bool = True) -> bytes:
    """One SOCK_DIAG_BY_FAMILY message as the kernel writes it (inet_diag_msg, then INET_DIAG_INFO)."""
    packed = ipaddress.ip_address(dst).packed
    addr = packed + bytes(16 - len(packed)) if family == socket.AF_INET else packed
    msg = bytearray(SD._MSG_LEN)
    msg[0], msg[1] = family, 1
    msg[SD._DST] = addr
    body = bytes(msg)
    if info:
        tcp_info = bytearray(104)
        SD._LAST_DATA.pack_into(tcp_info, SD._LAST_DATA_AT, last_sent_ms, last_recv_ms)
        body += SD._NLA.pack(SD._NLA.size + len(tcp_info), SD.INET_DIAG_INFO) + bytes(tcp_info)
    return SD._NLMSGHDR.pack(SD._NLMSGHDR.size + len(body), SD.SOCK_DIAG_BY_FAMILY, 2, 1, 0) + body


def peer(name: str, service: str, nics: dict | None = None) -> Peer:
    return Peer(name, 1, service, nics or {})


DONE = SD._NLMSGHDR.pack(SD._NLMSGHDR.size + 4, SD.NLMSG_DONE, 2, 1, 0) + bytes(4)


def test_the_parser_finds_peers_whose_sockets_moved_data_lately():
    by_addr = SD.peer_addresses([peer("h1", "198.18.0.2", {0: "198.18.64.3"}), peer("h3", "198.18.0.4"),
                                 peer("v6", "fd00::7")])
    buf = (diag_message(socket.AF_INET, "198.18.64.3", 5000, 40)  # received 40 ms ago: moving
           + diag_message(socket.AF_INET, "198.18.0.4", 9000, 9000)  # quiet for 9 s
           + diag_message(socket.AF_INET, "198.18.0.99", 0, 0)  # not a peer
           + DONE)
    out: set[str] = set()
    assert SD.parse_dump(buf, by_addr, 200, out) == (True, 3) and out == {("h1", 0)}  # on its plane 0
    # IPv6 sockets: native and v4-mapped addresses
    six = diag_message(socket.AF_INET6, "::ffff:198.18.0.4", 10, 10) + diag_message(socket.AF_INET6, "fd00::7", 0, 99)
    out = set()
    assert SD.parse_dump(six, by_addr, 200, out) == (False, 2)  # no DONE yet: more to read
    assert out == {("h3", None), ("v6", None)}  # their service addresses
    # a message without tcp_info says nothing
    out = set()
    assert SD.parse_dump(diag_message(socket.AF_INET, "198.18.0.2", 0, 0, info=False) + DONE, by_addr, 200, out) \
        == (True, 1)
    assert out == set()


def test_the_parser_refuses_lengths_it_cannot_trust():
    good = diag_message(socket.AF_INET, "198.18.0.2", 0, 0)
    by_addr = SD.peer_addresses([peer("h1", "198.18.0.2")])
    with pytest.raises(OSError, match="truncated"):
        SD.parse_dump(good[:-8], by_addr, 200, set())
    too_long = struct.pack("=I", len(good) + 64) + good[4:]
    with pytest.raises(OSError, match="truncated"):
        SD.parse_dump(too_long, by_addr, 200, set())
    err = SD._NLMSGHDR.pack(SD._NLMSGHDR.size + 4, SD.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -1)
    with pytest.raises(OSError, match="refused"):
        SD.parse_dump(err, by_addr, 200, set())
    # an attribute claiming less than its own header ends that message's attributes, nothing more
    bad_attr = bytearray(good)
    struct.pack_into("=H", bad_attr, SD._NLMSGHDR.size + SD._MSG_LEN, 2)
    out: set[str] = set()
    SD.parse_dump(bytes(bad_attr) + DONE, by_addr, 200, out)
    assert out == set()


@pytest.mark.parametrize("any_family", [True, False], ids=["one-dump", "by-family"])
def test_real_sockets_on_loopback(any_family):
    """The kernel's own dump: a connection that just moved data is seen, a quiet one is not; with
    the one dump for both families and with a dump per family (a kernel that refuses the first).
    The "peer" is a loopback address of its own: other processes' connections to 127.0.0.1 move
    data whenever they like (the accepted end's destination is 127.0.0.1, no peer's)."""
    srv = socket.socket()
    srv.bind(("127.83.41.7", 0))
    srv.listen(4)
    quiet = socket.create_connection(srv.getsockname())
    quiet_peer, _ = srv.accept()
    tcp = SD.TcpActivity()
    tcp.any_family = any_family
    try:
        time.sleep(0.3)
        by_addr = SD.peer_addresses([peer("loopback", "127.83.41.7")])
        assert tcp.moving(by_addr, 100) == set()
        quiet.sendall(b"x" * 1000)
        quiet_peer.recv(2000)
        assert tcp.moving(by_addr, 100) == {("loopback", None)} and tcp.sockets_read == 1
        assert tcp.any_family == any_family and tcp.filtering  # this kernel answers the one dump, filtered
    finally:
        tcp.close()
        for s in (quiet, quiet_peer, srv):
            s.close()


def top_bits(addr: bytes, n: int) -> int:
    return int.from_bytes(addr, "big") >> (8 * len(addr) - n)


def run_bytecode(attr: bytes, family: int, dst: str) -> bool:
    """What the kernel does with the filter for a socket of `family` whose destination is `dst`
    (inet_diag_bc_run for D_COND with any port, and JMP): first its audit (inet_diag_bc_audit),
    raising ValueError where the kernel answers EINVAL; then True when the socket is kept."""
    length, kind = SD._NLA.unpack_from(attr)
    assert kind == SD.INET_DIAG_REQ_BYTECODE and length == len(attr) <= 0xFFFF
    bc = attr[SD._NLA.size:]
    on_yes_walk, at = set(), 0  # every op's offset and the end, following `yes` from the start
    while at < len(bc):
        code, yes, no = SD._OP.unpack_from(bc, at)
        size = SD._OP.size + (SD._HOSTCOND.size + (4 if bc[at + 4] == socket.AF_INET else 16)
                              if code == SD.INET_DIAG_BC_D_COND else 0)
        if code not in (SD.INET_DIAG_BC_D_COND, SD.INET_DIAG_BC_JMP) or at + size > len(bc):
            raise ValueError(f"op at {at}")
        left = len(bc) - at
        if not (size <= no <= left + 4 and no % 4 == 0 and size <= yes <= left + 4 and yes % 4 == 0):
            raise ValueError(f"jump at {at}")
        on_yes_walk.add(at)
        at += yes
    if at != len(bc):
        raise ValueError("the yes walk does not end at the end")
    for at in on_yes_walk:
        no = SD._OP.unpack_from(bc, at)[2]
        if no < len(bc) - at and at + no not in on_yes_walk:
            raise ValueError(f"no of {at} between ops")
    raw = ipaddress.ip_address(dst).packed
    at = 0
    while 0 <= at < len(bc):
        code, yes, no = SD._OP.unpack_from(bc, at)
        ok = False
        if code == SD.INET_DIAG_BC_D_COND:
            cfam, plen, port = SD._HOSTCOND.unpack_from(bc, at + SD._OP.size)
            addr = bc[at + SD._OP.size + SD._HOSTCOND.size:][:4 if cfam == socket.AF_INET else 16]
            assert port == -1
            if cfam == socket.AF_INET and family == socket.AF_INET6 and raw[:12] == bytes(10) + b"\xff\xff":
                mine = raw[12:]  # v4-mapped
            else:
                mine = raw if cfam == family else b""
            ok = len(mine) == len(addr) and top_bits(mine, plen) == top_bits(addr, plen)
        at += yes if ok else no
    return at == len(bc)


def test_the_kernel_filter_keeps_exactly_the_peers_destinations():
    """The bytecode the dump request carries: an OR of destination conditions whose jumps all go
    forward and land where the kernel's audit wants them, keeping a socket to any of the peers'
    addresses (IPv4 also v4-mapped in an IPv6 socket) and no other."""
    one = SD.dst_bytecode([ipaddress.ip_address("198.18.0.2").packed])
    # one condition: yes is the end (kept), no 4 bytes past it (dropped); family, /32, any port
    assert one == SD._NLA.pack(20, SD.INET_DIAG_REQ_BYTECODE) + SD._OP.pack(SD.INET_DIAG_BC_D_COND, 16, 20) \
        + SD._HOSTCOND.pack(socket.AF_INET, 32, -1) + bytes([198, 18, 0, 2])
    keys = ["198.18.0.2", "198.18.64.3", "fd00::7", "fd00:0:0:1::9"]
    attr = SD.dst_bytecode([ipaddress.ip_address(a).packed for a in keys])
    bc, ops, at = attr[SD._NLA.size:], [], 0
    while at < len(bc):
        code, yes, no = SD._OP.unpack_from(bc, at)
        ops.append((at, code, yes, no))
        at += yes
    conds = [op for op in ops if op[1] == SD.INET_DIAG_BC_D_COND]
    jumps = [op for op in ops if op[1] == SD.INET_DIAG_BC_JMP]
    assert [c[1] for c in ops] == [SD.INET_DIAG_BC_D_COND, SD.INET_DIAG_BC_JMP] * 3 + [SD.INET_DIAG_BC_D_COND]
    assert [bc[c[0] + 4] for c in conds] == [socket.AF_INET] * 2 + [socket.AF_INET6] * 2
    for (at, _, yes, no), jump in zip(conds, jumps):
        assert at + yes == jump[0] and at + no == jump[0] + 4  # kept: on to the jump; not: the next condition
        assert jump[0] + jump[3] == len(bc)  # the jump (always its `no`) goes to the end: kept
    last = conds[-1]
    assert last[0] + last[2] == len(bc) and last[0] + last[3] == len(bc) + 4  # the last: kept, or past the end
    for family, dst, kept in [(socket.AF_INET, "198.18.0.2", True), (socket.AF_INET, "198.18.64.3", True),
                              (socket.AF_INET6, "::ffff:198.18.64.3", True), (socket.AF_INET6, "fd00::7", True),
                              (socket.AF_INET6, "fd00:0:0:1::9", True), (socket.AF_INET, "198.18.0.3", False),
                              (socket.AF_INET, "127.0.0.1", False), (socket.AF_INET6, "::1", False),
                              (socket.AF_INET6, "fd00::6", False), (socket.AF_INET6, "::198.18.0.2", False)]:
        assert run_bytecode(attr, family, dst) == kept, dst
    # the fewest exact prefixes: 2 000 addresses in a row are 5, each a peer's and no other
    row = [ipaddress.IPv4Address(int(ipaddress.IPv4Address("10.1.0.0")) + i).packed for i in range(2000)]
    assert [p[1] for p in SD.prefixes(row)] == [22, 23, 24, 25, 26, 28]
    attr = SD.dst_bytecode(row)
    assert run_bytecode(attr, socket.AF_INET, "10.1.7.207") and not run_bytecode(attr, socket.AF_INET, "10.1.7.208")
    # 2 000 addresses scattered are as many conditions: more than the kernel's compare is worth,
    # so no filter; with the bound lifted they still fit an attribute and pass the audit
    rnd = random.Random(3)
    scattered = [bytes([253, 0]) + rnd.randbytes(14) for _ in range(2000)]
    assert len(SD.prefixes(scattered)) == 2000 and SD.dst_bytecode(scattered) == b""
    bound = SD.MAX_CONDITIONS
    try:
        SD.MAX_CONDITIONS = 10**6
        attr = SD.dst_bytecode(scattered)
        assert len(attr) == 4 + 2000 * 28 + 1999 * 4  # 64 000 bytes, under 64 KiB
        assert run_bytecode(attr, socket.AF_INET6, str(ipaddress.IPv6Address(scattered[-1])))
        assert SD.dst_bytecode(scattered + [bytes([254]) + rnd.randbytes(15) for _ in range(100)]) == b""  # > 64 KiB
    finally:
        SD.MAX_CONDITIONS = bound
    assert SD.dst_bytecode([]) == b""
