"""Soft-RoCE guests on the testbed fabric: hosts 0 and 3 of the default shape are QEMU guests
with rdma_rxe, the others namespaces. The guests boot with one RDMA device per plane, the fabric
reaches them like any host, an RC queue pair steered to a source port carries exactly that port
on the wire (both directions), each port keeps to one spine, the mlx5-only re-path call is
refused on rxe, LinkPass agents inside the guests probe through verbs (UD QPs) and write an
entropy table that a channel of RC QPs follows off a dead spine link, verbs programs no one here
wrote (perftest's ib_write_bw, ibv_rc_pingpong) put their QPs on that table's ports, spread over
the spines, through the steering shim, and the NCCL plugin's verbs lanes carry a ring all-reduce
between the guests through an uplink cut, a leaf-spine link down and 30 % one-way loss, moving
its traffic to other queue pairs and back. The first run
builds the guest image (minutes; cached afterwards)."""
from __future__ import annotations

import json
import time

import pytest

from linkpass.core.names import host_name
from linkpass.kernel import netns as ns_io
from linkpass.testbed import agents, build, faults, guest_ring, guests, roce_paths
from linkpass.testbed.capture import Capture
from linkpass.testbed.faults import FaultSpec

from support.coordinator import coordinator_client
from support.ports import free_port
from support.testbed import guest_fabric
from support.waiting import wait_until


GA, GB = 0, 3  # on different leaves: their traffic crosses a spine
GUEST_ENV = roce_paths.GUEST_ENV


@pytest.fixture(scope="module")
def rfab():
    with guest_fabric("r", (GA, GB)) as fab:
        yield fab


@pytest.fixture(scope="module")
def ctl(rfab):
    conns = {h: guests.Control(rfab.prefix, h) for h in (GA, GB)}
    try:
        yield conns
    finally:
        for c in conns.values():
            c.close()


def test_guests_boot_with_one_soft_roce_device_per_plane(rfab, ctl):
    for h in (GA, GB):
        links = ctl[h].check(["rdma", "-j", "link"])
        by_dev = {entry["ifname"]: entry.get("netdev") for entry in json.loads(links)}
        assert by_dev == {"rxe_p0": "p0", "rxe_p1": "p1"}, links
        for p in range(rfab.spec.planes):
            dev = roce_paths.rdma_device(ctl[h], rfab.nic_addr(h, p))
            assert dev[0] == f"rxe_p{p}", dev


ECHO = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.bind(('0.0.0.0', 7007))\n"
        "while True:\n    data, peer = s.recvfrom(2048)\n    s.sendto(data, peer)\n")


def _echo_from_namespace(fab, host: int, addr: str) -> bytes | None:
    s = ns_io.socket_in_netns(fab.netns(host_name(host)))
    s.settimeout(1.0)
    try:
        for _ in range(5):  # the guest's server may still be starting
            s.sendto(b"hello " + addr.encode(), (addr, 7007))
            try:
                return s.recv(2048)
            except TimeoutError:
                continue
        return None
    finally:
        s.close()


def test_the_fabric_reaches_guests_like_any_host(rfab, ctl):
    for h in (GA, GB):
        ctl[h].spawn("echo", ["python3", "-c", ECHO])
    try:
        for h in (GA, GB):  # from a namespace host, to every address of each guest
            for addr in [rfab.service_addr(h)] + [rfab.nic_addr(h, p) for p in range(rfab.spec.planes)]:
                assert _echo_from_namespace(rfab, 1, addr) == b"hello " + addr.encode(), addr
        # guest to guest, over the fabric
        code = ("import socket,sys; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.settimeout(3); "
                "s.bind((sys.argv[1],0)); s.sendto(b'ping',(sys.argv[2],7007)); print(s.recv(64).decode())")
        out = ctl[GA].check(["python3", "-c", code, rfab.service_addr(GA), rfab.service_addr(GB)])
        assert out.strip() == "ping"
    finally:
        for h in (GA, GB):
            ctl[h].kill("echo")


def test_an_rc_qp_carries_the_port_it_was_steered_to_and_keeps_one_spine(rfab, ctl, port_paths):
    for sport, pp in port_paths.items():
        assert pp.reported == sport, pp
        assert len(pp.forward) == 1 and len(pp.reverse) == 1, f"port {sport} was not on exactly one spine: {pp}"
    assert not next(iter(port_paths.values())).foreign  # no packet of these QPs on a port nobody chose
    # ECMP spreads the ports: both spines carry some (each port keeps its own)
    assert {pp.forward[0] for pp in port_paths.values()} == {"s0", "s1"}, port_paths


@pytest.fixture(scope="module")
def port_paths(rfab, ctl):
    """Eight ports across the RoCE range, each one's spine in both directions, off the wire."""
    ports = [49152, 49153, 49160, 50000, 52017, 58177, 61000, 65535]
    return roce_paths.map_ports(rfab, GA, GB, ports, ctl[GA], ctl[GB])


def test_a_channel_moves_to_its_standby_qp_when_its_spine_link_dies(rfab, ctl, port_paths):
    """The active QP's spine link goes down under a stream of messages: the path's failure is seen
    (the QP errors after its own short timeout, or, when the request got through and only its echo
    was lost, the echo is not back within twice that), traffic moves to the standby QP on a port
    through the other spine (seen on the wire), no message is lost or delivered twice, and the
    stream finishes."""
    via = {sp: pp.forward[0] for sp, pp in port_paths.items() if pp.forward == pp.reverse}
    active = next(sp for sp, s in via.items() if s == "s0")
    others = [sp for sp, s in via.items() if s == "s1"]
    assert others, via
    ports = [active] + others
    leaf_a, _ = roce_paths.spine_ports(rfab, GA, 0)
    run = roce_paths.channel_under_fault(rfab, GA, GB, ctl[GA], ctl[GB], ports, rfab.leaf_spine(leaf_a, 0).name)
    res, served = run.result, run.served
    assert res["count"] == 300 and served["delivered"] == 300, (res, served)
    moves = [e for e in res["events"] if e["event"] == "moved"]
    assert moves and moves[0]["from"] == active and via[moves[0]["to"]] == "s1", res["events"]
    # either sign of the dead path (channel.py, _once); which comes first is a race with the cut
    # under emulation (a CI run saw the echo timeout win)
    assert moves[0]["why"].startswith(("QP error", "no answer within")), moves
    # on the wire: A's leaf carried the standby's packets towards spine 1
    assert ("s1", moves[0]["to"]) in {(p.ifname, p.sport) for p in run.packets}, run.packets[-5:]


def test_repathing_a_live_qp_is_refused_on_rxe_with_the_alternative_named(rfab, ctl):
    code = ("import sys; from linkpass_rdma.qp import Device, SteeredRC; from linkpass.kernel.rdma import "
            "RdmaUnavailable\nrc = SteeredRC(Device.for_address(sys.argv[1]))\ntry:\n    rc.repath(50000)\n"
            "except RdmaUnavailable as e:\n    print('refused:', e)")
    out = ctl[GA].check(["python3", "-c", code, rfab.nic_addr(GA, 0)], env=GUEST_ENV)
    assert "refused:" in out and "mlx5" in out and "new QP" in out, out


def test_a_guest_command_that_fails_reports_its_exit_code_and_output(ctl):
    res = ctl[GA].run(["sh", "-c", "echo oops >&2; exit 3"])
    assert res.rc == 3 and "oops" in res.stderr
    with pytest.raises(guests.GuestError, match="exited 3"):
        ctl[GA].check(["sh", "-c", "exit 3"])


def test_the_namespace_traffic_tools_refuse_a_guest_by_name_and_check_skips_it(rfab):
    from linkpass.testbed import traffic
    with pytest.raises(build.TestbedError, match="h0 is a Soft-RoCE guest"):
        traffic.send_flow(rfab, GA, 1, plane=0, count=1)
    rows = traffic.reachability(rfab, tries=1)
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["src"] for r in rows} | {r["dst"] for r in rows} == {"h1", "h2"}


# agents under emulation: probes every 100 ms (an agent at 50 ms took over half of a guest's one
# emulated CPU, and beside a ring all-reduce it fell seconds behind, so its peer's paths read down
# and the table flapped under the ring), timeouts for round trips of up to 1.5 s (a starved guest
# answers that late without a link failing), and one-way delays judged only beyond 50 ms of noise
# (an emulated NIC carrying a ring all-reduce queues that much on its own); a path back after 50 good
# probes, the same 5 s as 100 at the old 50 ms; gray loss cleared after ~240 clean probes (24 s)
# instead of 1150 (two minutes at this rate, past the tests' waits), the faults here being 30 %
GUEST_DETECT = {"timeout_floor_us": 100_000, "timeout_ceiling_ms": 1500, "latency_floor_us": 50_000,
                "recovery_good_probes": 50, "gray_sensitive_loss_pct": 2}
TABLE = agents.GUEST_TABLE


def _table(ctl, peer_addr: str) -> dict:
    code = ("import json, sys; from linkpass_rdma import entropy; t = entropy.read_table(sys.argv[1]); "
            "print(json.dumps({f'{e.peer}/{e.plane}': [list(e.ports), e.flags] for e in t.entries}))")
    try:
        return json.loads(ctl.check(["python3", "-c", code, TABLE], env=GUEST_ENV).strip().splitlines()[-1])
    except (guests.GuestError, ValueError, IndexError):
        return {}


@pytest.fixture(scope="module")
def guest_coordinator(rfab, tmp_path_factory):
    """The coordinator as a Ray actor on this host, HTTPS with mutual TLS on the management
    network: what the guests' agents report to. (settings, url, state dir)"""
    from linkpass.coordinator import ray_actor
    from linkpass.core.fabric import from_testbed

    d = tmp_path_factory.mktemp("guest-coordinator")
    port = free_port()
    settings = {"state_dir": str(d / "state"), "listen": f"0.0.0.0:{port}", "fabric_model": from_testbed(rfab).to_dict(),
                "tls_san": [rfab.mgmt_root_addr], "require_client_cert": True}
    ray_actor.connect(num_cpus=1)
    try:
        ray_actor.ensure(settings)
        yield settings, f"https://{rfab.mgmt_root_addr}:{port}", d
    finally:
        h = ray_actor.existing()
        if h is not None:
            ray_actor.stop(h)
        ray_actor.shutdown()


@pytest.fixture(scope="module")
def guest_agents(rfab, ctl, guest_coordinator):
    """A LinkPass agent in each guest, probing its peer through UD QPs (plane 0 and 1, both spines)
    and reporting to the coordinator over the management network."""
    from linkpass.control.tls import lab_dir

    settings, url, d = guest_coordinator
    link = {"url": url, "agent_secret_file": str(d / "state" / "agent.secret"), "report_ms": 200, "summary_s": 5}
    # every 10th probe as large as a UD message can be (1076 IP bytes on rxe): MTU black holes
    ga = agents.GuestAgents(rfab, [GA, GB], interval_ms=100, probe={"batch_ms": 50, "size_probe_every": 10},
                            detect=GUEST_DETECT, coordinator=link, tls_dir=lab_dir(settings["state_dir"]),
                            controls=dict(ctl)).start()
    try:
        yield ga
    finally:
        ga.close()
    stopped = [e for h in (GA, GB) for e in ga.events(h, "stopped")]
    assert len(stopped) == 2 and all(e["stats"]["counters"]["replies"] > 0 for e in stopped), stopped


def test_agents_in_guests_probe_through_verbs_and_a_channel_follows_their_table_off_a_dead_link(
        rfab, ctl, port_paths, guest_agents):
    """An agent inside each guest probes its peer through UD queue pairs (rxe takes every RoCEv2
    packet; no socket could hear a probe), and its entropy table lists the healthy port of each
    spine. A channel whose QPs keep NCCL's timeouts (they would not error for over a minute here)
    follows that table: when its spine link dies, the agent's verdict moves it to the other
    spine's QP, no message lost, and A's agent named the path down as a hard failure."""
    ga = guest_agents
    addr_b = rfab.nic_addr(GB, 0)
    for h in (GA, GB):
        started = ga.events(h, "started")[-1]
        assert started["probes"]["engine"] == "verbs" and started["probes"]["timestamps"] == "software", started
        assert set(started["probes"]["nics"]) == {"p0", "p1"} and started["paths"] >= 4, started
    deadline = time.monotonic() + 90
    while len((table := _table(ctl[GA], addr_b)).get(f"{addr_b}/0", [[]])[0]) < 2:
        assert time.monotonic() < deadline, (table, ga.log(GA)[-2000:])
        time.sleep(1)
    ports, flags = table[f"{addr_b}/0"]
    assert flags == 0, table  # healthy, not fail-static
    spine = {sp: port_paths[sp].forward[0] if sp in port_paths else None for sp in ports}
    if None in spine.values():  # the agent's ports are its own; map those the fixture did not
        spine.update({sp: pp.forward[0] for sp, pp in
                      roce_paths.map_ports(rfab, GA, GB, [p for p in ports if spine[p] is None],
                                           ctl[GA], ctl[GB]).items()})
    assert set(spine.values()) == {"s0", "s1"}, spine  # one healthy port per spine
    active = ports[0]
    cut = rfab.leaf_spine(roce_paths.spine_ports(rfab, GA, 0)[0], roce_paths.spine_of_if(spine[active])).name
    from linkpass_rdma import channel
    run = roce_paths.channel_under_fault(rfab, GA, GB, ctl[GA], ctl[GB], ports, cut, count=300,
                                         timeout=channel.NCCL_TIMEOUT, retry=channel.NCCL_RETRY,
                                         deadline_s=30, table=TABLE, lead_s=2.0)
    res, served = run.result, run.served
    assert res["count"] == 300 and not res["stuck"] and served["delivered"] == 300, (res, served)
    moves = [e for e in res["events"] if e["event"] == "moved"]
    assert moves and moves[0]["from"] == active and moves[0]["why"] == "port left the healthy set", res["events"]
    assert spine[moves[0]["to"]] != spine[active], (moves, spine)
    downs = [e for e in ga.events(GA, "path_state") if e["peer"] == host_name(GB) and e["plane"] == 0
             and e["sport"] == active and e["new"] == "down"]
    assert downs and downs[0]["reason"] == "hard_failure", ga.events(GA, "path_state")[-6:]
    # the move followed the agent's verdict (same guest clock), not a QP timeout
    assert downs[0]["mono_ns"] / 1e9 <= moves[0]["t"], (downs[0], moves[0])
    other_if = spine[moves[0]["to"]]
    assert (other_if, moves[0]["to"]) in {(p.ifname, p.sport) for p in run.packets}, run.packets[-5:]


def test_agents_in_guests_report_their_verbs_probed_paths_to_the_coordinator(rfab, guest_agents, guest_coordinator):
    """Over the management network, with mutual TLS and each agent's own token: the coordinator
    lists both guests' agents and maps their paths onto the fabric's links."""
    settings, url, d = guest_coordinator
    token = (d / "state" / "reader.token").read_text().strip()
    c = coordinator_client(url, token, settings["state_dir"], client_cert="cli")
    try:
        names = (host_name(GA), host_name(GB))

        def paths_reported() -> dict:
            return {a["name"]: a["paths"] for a in c.get("/v1/agents") if a["name"] in names}

        wait_until(lambda: (lambda seen: len(seen) == 2 and min(seen.values()) >= 4)(paths_reported()), 120,
                   "both guests' agents registered with their paths", lambda: (paths_reported(),
                                                                               guest_agents.log(GA)[-1500:]))
        rows = c.get("/v1/paths", host=host_name(GA), peer=host_name(GB))
        assert len(rows) >= 4 and all(r["links"] for r in rows), rows
    finally:
        c.close()


def _plane_paths_up(ga, host: int, plane: int) -> bool:
    last = {}
    for e in ga.events(host, "path_state"):
        if e["plane"] == plane:
            last[e["path"]] = e["new"]
    return all(state == "up" for state in last.values())


# (fault on A's plane-1 uplink, the reason A's agent must give for its paths to B, and B's for its paths to A)
VERBS_FAULTS = [
    (lambda fab: FaultSpec("down", fab.uplink(host_name(GA), 1).name), "down", "hard_failure", "hard_failure"),
    (lambda fab: FaultSpec("loss", fab.uplink(host_name(GA), 1).name, host_name(GA), {"pct": 30.0}), "degraded",
     "gray_loss_fwd", "gray_loss_rev"),  # leaving A: A's requests and A's replies to B
    (lambda fab: FaultSpec("loss", fab.uplink(host_name(GA), 1).name, fab.leaf_of(GA, 1), {"pct": 30.0}),
     "degraded", "gray_loss_rev", "gray_loss_fwd"),  # towards A: B's replies to A and B's requests
    # below the size of an RC packet with a 1024-byte payload: a real black hole for RDMA traffic
    (lambda fab: FaultSpec("mtu", fab.uplink(host_name(GA), 1).name, params={"bytes": 1000}), "degraded",
     "mtu_blackhole", "mtu_blackhole"),
    # last: a flapped path stays damped for a while after the flapping stops
    (lambda fab: FaultSpec("flap", fab.uplink(host_name(GA), 1).name, params={"period": "1s"}), "damped",
     "flapping", "flapping"),
]


def test_an_rxe_ports_packet_counters_move_with_the_rdma_traffic_on_it(rfab, ctl, guest_agents):
    """What an agent reads to see RDMA traffic no lane report names: the packets its plane's RDMA
    port sent and received, from the guest's sysfs (rxe's own counters). They move with the
    agents' UD probes, which cross that port (two packets an exchange, each way's agent probing)."""
    code = ("import json, sys, time; from linkpass.kernel import rdma; d = rdma.Device.for_address(sys.argv[1]).name; "
            "a = rdma.port_packets(d); time.sleep(3); print(json.dumps([d, a, rdma.port_packets(d)]))")
    out = ctl[GA].check(["python3", "-c", code, rfab.nic_addr(GA, 0)], env=GUEST_ENV)
    dev, before, after = json.loads(out.strip().splitlines()[-1])
    assert dev.startswith("rxe") and before is not None and after is not None, out
    assert after - before >= 20, (dev, before, after)  # 3 s of probes every 100 ms on two or more paths


@pytest.mark.parametrize("make,state,reason_a,reason_b", VERBS_FAULTS, ids=["uplink-down", "loss-from-a", "loss-to-a", "mtu", "flap"])
def test_agents_in_guests_detect_each_fault_through_verbs_with_its_reason_and_direction(
        rfab, guest_agents, make, state, reason_a, reason_b):
    """The same verdicts as on namespace hosts (tests/root/test_failover.py), from probes that only a
    UD QP could receive: a cut uplink is a hard failure at both ends; 30 % loss one way is gray
    loss forward at the sender's end and in reverse at the other's; an MTU below RDMA's packets is
    a black hole; a flapping link is damped."""
    ga = guest_agents
    for h in (GA, GB):  # the previous fault's paths back in use first (gray loss clears over its window, then recovery)
        deadline = time.monotonic() + 180
        while not _plane_paths_up(ga, h, 1):
            assert time.monotonic() < deadline, ga.events(h, "path_state")[-6:]
            time.sleep(1)
    seen = {h: len(ga.events(h, "path_state")) for h in (GA, GB)}
    spec = make(rfab)
    faults.apply(rfab.prefix, spec)
    try:
        for h, peer, reason in ((GA, GB, reason_a), (GB, GA, reason_b)):
            ev = None
            deadline = time.monotonic() + 60
            while ev is None and time.monotonic() < deadline:
                ev = next((e for e in ga.events(h, "path_state")[seen[h]:] if e["new"] == state
                           and e["peer"] == host_name(peer)), None)
                time.sleep(0.2)
            assert ev is not None, (spec, host_name(h), ga.events(h, "path_state")[seen[h]:][-6:])
            assert ev["reason"] == reason and ev["plane"] == 1, (spec, host_name(h), ev)
            # the healthy plane is not blamed: no plane-0 path went bad for this fault
            bad0 = [e for e in ga.events(h, "path_state")[seen[h]:] if e["plane"] == 0 and e["new"] in ("degraded",)]
            assert not bad0, bad0
    finally:
        faults.clear(rfab.prefix)


# ---- unmodified verbs programs under the steering shim (rdma/steer/, docs/steer.md) ---------------

def _spread_ready(ctl, rfab, want: int) -> tuple[list[int], list[int]]:
    """Both guests' table ports towards each other on plane 0, once each lists `want` of them."""
    addr_a, addr_b = rfab.nic_addr(GA, 0), rfab.nic_addr(GB, 0)
    got: dict = {}

    def ready() -> bool:
        got["a"] = roce_paths.healthy_ports(ctl[GA], addr_b)
        got["b"] = roce_paths.healthy_ports(ctl[GB], addr_a)
        return len(got["a"]) == want and len(got["b"]) == want
    roce_paths.wait_until(ready, 150, f"both tables to list {want} healthy port(s) on plane 0", lambda: got, poll_s=2)
    return got["a"], got["b"]


def _spread(paths) -> dict[str, int]:
    """QPs per spine port, each QP on exactly one."""
    out: dict[str, int] = {}
    for qp in paths.values():
        assert len(qp.sports) == 1 and len(qp.spines) == 1, qp  # one port, one spine per QP
        out[qp.spines[0]] = out.get(qp.spines[0], 0) + 1
    return out


def test_ib_write_bw_under_the_shim_spreads_its_qps_evenly_over_the_spines_per_the_table(rfab, ctl, guest_agents):
    """perftest's ib_write_bw with 8 QPs, a program no one here wrote, preloaded with the shim on
    both sides: every QP's packets carry a port of the agent's table for that peer, the table's
    ports in turn (4 QPs each), so 4 QPs cross each spine in each direction. Without the shim,
    the same run: each QP carries the port the kernel derives from the two QP numbers."""
    from linkpass_rdma.steer import qp_sport

    table_a, table_b = _spread_ready(ctl, rfab, 2)
    plain = roce_paths.write_bw(rfab, GA, GB, ctl[GA], ctl[GB], 8, False, "plain")
    steered = roce_paths.write_bw(rfab, GA, GB, ctl[GA], ctl[GB], 8, True, "steered")
    for run in (plain, steered):
        assert run.rc == (0, 0), run.output
        assert len(run.forward) == 8 and len(run.reverse) == 8, (run.forward, run.reverse)
    # with the shim: the table's ports, in turn, and so both spines evenly, both ways
    for paths, table in ((steered.forward, table_a), (steered.reverse, table_b)):
        used = sorted(qp.sports[0] for qp in paths.values())
        assert used == sorted(table * 4), (used, table)
        assert _spread(paths) == {"s0": 4, "s1": 4}, paths
    assert steered.steer_log.count("steered to source port") == 16, steered.steer_log
    assert steered.steer_log.count("8 QP transition(s) to RTR: steered 8") == 2, steered.steer_log
    # without it: where the hash of the QP numbers puts them (and no shim line)
    assert plain.steer_log == ""
    a_qpns = sorted(plain.reverse)  # A's QPs: what B's packets name
    for qpn_b, qp in plain.forward.items():
        assert any(qp_sport(0, qpn_a, qpn_b) == qp.sports[0] for qpn_a in a_qpns), (qpn_b, qp, a_qpns)
    print("ib_write_bw -q 8, QPs per spine (A->B, B->A): without the shim", _spread(plain.forward),
          _spread(plain.reverse), "with it", _spread(steered.forward), _spread(steered.reverse))


def test_ibv_rc_pingpong_under_the_shim_takes_the_tables_first_port_both_ways(rfab, ctl, guest_agents):
    """ibverbs-utils' ibv_rc_pingpong: one RC QP each side, steered to the first port of its
    table's entry for the other (its first QP to that peer), on the wire in both directions."""
    table_a, table_b = _spread_ready(ctl, rfab, 2)
    addr_a, addr_b = rfab.nic_addr(GA, 0), rfab.nic_addr(GB, 0)
    gid = {GA: roce_paths.rdma_device(ctl[GA], addr_a), GB: roce_paths.rdma_device(ctl[GB], addr_b)}
    env = roce_paths.steer_env(TABLE)
    ctl[GB].spawn("pingpong", ["ibv_rc_pingpong", "-d", gid[GB][0], "-g", gid[GB][1], "-n", "50", "-p", "18610"],
                  env=env)
    leaf_a, ups_a = roce_paths.spine_ports(rfab, GA, 0)
    leaf_b, ups_b = roce_paths.spine_ports(rfab, GB, 0)
    try:
        roce_paths.wait_listening(ctl[GB], 18610, "ibv_rc_pingpong's server", lambda: ctl[GB].log("pingpong")[-500:])
        with Capture(rfab.netns(leaf_a), ups_a, roce_paths.ROCE_V2_DPORT) as cap_a, \
                Capture(rfab.netns(leaf_b), ups_b, roce_paths.ROCE_V2_DPORT) as cap_b:
            res = ctl[GA].run(["ibv_rc_pingpong", "-d", gid[GA][0], "-g", gid[GA][1], "-n", "50", "-p", "18610",
                               rfab.mgmt_addr(GB)], timeout_s=120, env=env)
    finally:
        ctl[GB].kill("pingpong")
    assert res.rc == 0, res.stdout + res.stderr
    fwd, rev = roce_paths.qp_paths(cap_a.packets, addr_a, addr_b), roce_paths.qp_paths(cap_b.packets, addr_b, addr_a)
    assert [qp.sports for qp in fwd.values()] == [(table_a[0],)], fwd
    assert [qp.sports for qp in rev.values()] == [(table_b[0],)], rev
    assert "steered to source port %d" % table_a[0] in res.stderr, res.stderr
    assert "steered to source port %d" % table_b[0] in ctl[GB].log("pingpong")


def test_with_a_spine_link_down_before_they_start_no_steered_qp_lands_on_it(rfab, ctl, guest_agents):
    """A's leaf loses its link to spine 0 before ib_write_bw starts: once the agents have taken
    that spine's paths out of their tables, the 8 QPs of each side all take spine 1, and the run
    completes. (Without the shim, the QPs the hash puts on spine 0 would lose every packet.)"""
    _spread_ready(ctl, rfab, 2)
    leaf_a, _ = roce_paths.spine_ports(rfab, GA, 0)
    faults.apply(rfab.prefix, FaultSpec("down", rfab.leaf_spine(leaf_a, 0).name))
    try:
        _spread_ready(ctl, rfab, 1)
        run = roce_paths.write_bw(rfab, GA, GB, ctl[GA], ctl[GB], 8, True, "one-spine")
    finally:
        faults.clear(rfab.prefix)
    assert run.rc == (0, 0), run.output
    assert _spread(run.forward) == {"s1": 8} and _spread(run.reverse) == {"s1": 8}, (run.forward, run.reverse)


# ---- the NCCL plugin's verbs lanes --------------------------------------------------------------

HARNESS = "/opt/linkpass/rdma/nccl/build/lp_harness"


def _harness(ctl, *args: str, env: dict | None = None, timeout_s: float = 240) -> tuple[dict, dict, str]:
    """lp_harness transfer in a guest over the plugin's verbs lanes: (transfer fields, stats, log)."""
    res = ctl.run([HARNESS, "-l", guest_ring.PLUGIN, "transfer", *args],
                  env={"LINKPASS_NICS": "p0,p1", **guest_ring.GUEST_PLUGIN_ENV, **(env or {})}, timeout_s=timeout_s)
    out = res.stdout + res.stderr
    assert res.rc == 0, out[-3000:]
    fields = {}
    for line in res.stdout.splitlines():
        word, _, rest = line.partition(" ")
        fields[word] = dict(kv.split("=", 1) for kv in rest.split() if "=" in kv)
    return fields["transfer"], fields["stats"], out


def test_the_plugins_verbs_lanes_pass_the_harness_in_a_guest(ctl):
    """Every check the TCP lanes pass, on RC queue pairs over rxe: sizes around the chunk boundary
    in posting order, 0-byte messages, receives posted larger than the send, 32 outstanding
    requests, sizes == NULL, the request preset to 0x1, two threads; and a lane whose socket is
    reset under load (its QP goes with it) resends what it owed on other lanes, no byte lost."""
    t, stats, log = _harness(ctl[GA], "-s", "0,1,65535,65536,65537,200000,1M", "-n", "2", "-w", "32", "-x", "100",
                             "-N", "-p", "-t", "-T", "200")
    assert t["wrong"] == t["bad_sizes"] == "0" and t["messages"] == t["send_done"] == t["recv_done"] == "14", log[-2000:]
    assert stats["lane_kind"] == "verbs", stats
    assert "lanes are RC queue pairs (verbs)" in log and "verbs lanes on rxe_p0 port 1" in log, log[-2000:]
    # a verbs lane's socket queues no bytes, so the harness resets one after its 2 s wait for a busy one
    t, stats, log = _harness(ctl[GA], "-s", "4M", "-n", "20", "-k", "400:2", "-T", "200")
    assert t["wrong"] == "0" and t["send_done"] == t["recv_done"] == "20" and int(t["lanes_killed"]) >= 1, log[-2000:]
    assert int(stats["lanes_down"]) >= 1 and "is back" in log, log[-2000:]


@pytest.mark.parametrize("kind", guest_ring.FAULT_KINDS)
def test_a_verbs_ring_all_reduce_moves_to_other_qps_through_each_fault_and_back(rfab, ctl, guest_agents, kind):
    """The plugin's ring all-reduce between the guests, every lane an RC queue pair on a port from
    the agent's entropy table: under the fault the ring gets no error and no wrong byte, its chunks
    stop crossing the broken path and cross another on a queue pair that carried none before (seen
    on the wire at A's leaf), and once the agents list the path again, traffic crosses it again."""
    ga = guest_agents
    aim = guest_ring.AimedFault(rfab, GA, GB, kind)  # A's plane-1 uplink, or the spine the ring's chunks cross
    plane = aim.plane
    addr_b = rfab.nic_addr(GB, plane)
    for h in (GA, GB):  # the previous fault's paths back in use first
        deadline = time.monotonic() + 120
        while not (_plane_paths_up(ga, h, 0) and _plane_paths_up(ga, h, 1)):
            assert time.monotonic() < deadline, ga.events(h, "path_state")[-6:]
            time.sleep(1)
    run = guest_ring.ring_under_fault(
        rfab, GA, GB, ctl[GA], ctl[GB], aim, lead_s=5, hold_s=20, after_s=10, heal_timeout_s=150,
        healed=lambda: len(roce_paths.healthy_ports(ctl[GA], addr_b, plane)) >= 2, tag=f"ring-{kind}",
        healing=lambda: ga.events(GA, "path_state")[-8:])
    # the agents' verdicts (each in its guest's clock, as the lane lines): what the table followed
    verdicts = "\n".join(f"  h{h} {e['mono_ns'] / 1e9:.3f} {e['peer']} plane {e['plane']} port {e['sport']}: "
                         f"{e['old']} -> {e['new']} ({e['reason']})"
                         for h in (GA, GB) for e in ga.events(h, "path_state")[-12:])
    why = f"{guest_ring.describe(run)}\nthe agents' last verdicts:\n{verdicts}"
    assert plane == 1 or aim.seen, "the ring carried nothing on plane 0 before the fault"
    assert run.rc == [0, 0], why
    assert all(sm and sm["errors"] == 0 and sm["wrong"] == 0 and sm["lane_kind"] == "verbs" for sm in run.summary), why
    addrs = {p: (rfab.nic_addr(GA, p), rfab.nic_addr(GB, p)) for p in range(rfab.spec.planes)}
    wire = guest_ring.wire_verdict(run, addrs, plane, aim.victim)
    assert wire.moved, f"{wire.detail}\n{why}"
    assert wire.back, f"{wire.detail}\n{why}"
    # the first lane to leave was moved by a designed detector: the agent's table or its own progress
    downs = [e for e in run.lanes(0) if e.what == "down"]
    assert downs and guest_ring.move_cause(downs[0]) in ("table", "stuck", "qp-error"), why


def test_rdma_traffic_no_lane_reports_makes_its_planes_active_in_an_agent_with_rates(rfab, ctl, guest_agents):
    """An agent with rates on sees RDMA traffic that reports no lanes (here the plugin's ring with
    its lane reports switched off, standing for NCCL's own IB transport) in its planes' rxe packet
    counters: it logs the planes, probes every path of them at the active rate, and lets them go
    once the traffic has been quiet for idle_after. Runs last: it replaces the module's agents."""
    def stopped() -> None:
        for h in (GA, GB):
            deadline = time.monotonic() + 30
            while ctl[h].kill("agent", 0) is None:
                assert time.monotonic() < deadline, f"the agent in {host_name(h)} did not stop within 30 s"
                time.sleep(0.5)

    guest_agents.stop()
    stopped()
    ga = agents.GuestAgents(rfab, [GA, GB], interval_ms=100,
                            probe={"batch_ms": 50, "size_probe_every": 0, "idle_rates": True, "idle_after_ms": 3000,
                                   "unreported_rdma_pps": 200},
                            detect=GUEST_DETECT, controls=dict(ctl)).start()
    try:
        time.sleep(3)  # 30 looks at the counters with the agents' own probes alone: not traffic
        assert not ga.events(GA, "rdma_unreported"), ga.events(GA, "rdma_unreported")
        run = guest_ring.ring_under_fault(rfab, GA, GB, ctl[GA], ctl[GB], None, lead_s=2, hold_s=8, after_s=1,
                                          size="1M", env={"LINKPASS_LANES_DIR": "/nonexistent/lanes"}, tag="ring-unreported")
        assert run.rc == [0, 0], guest_ring.describe(run)
        went = [e for e in ga.events(GA, "rdma_unreported") if e["planes"]]
        assert went, (ga.events(GA, "rdma_unreported"), ga.events(GA, "path_rates")[-4:])
        assert set(went[0]["planes"]) <= {0, 1} and all(n > 200 for n in went[0]["pps"].values()), went[0]
        assert any(host_name(GB) in e["active"] for e in ga.events(GA, "path_rates")), ga.events(GA, "path_rates")[-4:]
        quiet = ga.wait_for(GA, "rdma_unreported", lambda e: e["planes"] == [], timeout_s=30)
        assert quiet is not None, ga.events(GA, "rdma_unreported")
    finally:
        ga.stop()  # the module's fixture closes the controls and checks that these agents stopped cleanly
        stopped()
