"""rdma/nccl/gpu/: the prepared run of the plugin under real NCCL on one GPU (docs/nccl-plugin.md,
"Running under real NCCL on a GPU"), checked without a GPU: the pure parts of gpu_nccl.py (NCCL's
log lines -> ABI version, devices, net, channels; socket tables -> what a kill targets; iteration
times -> busbw and stall; results -> benchmark rows), run.sh's syntax, and its dry run."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(ROOT, "rdma", "nccl", "gpu")
RUN_SH = os.path.join(GPU_DIR, "run.sh")
PLUGIN = os.path.join(ROOT, "rdma", "nccl", "build", "libnccl-net-linkpass.so")

_spec = importlib.util.spec_from_file_location("gpu_nccl", os.path.join(GPU_DIR, "gpu_nccl.py"))
g = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(g)

MiB = 1 << 20

# NCCL's INFO/WARN lines below are WRITTEN after NCCL's format ("host:pid:tid [cudaDev] NCCL INFO
# ..." and the messages of src/plugin/net.cc, net_v12.cc, init.cc, transport/net_socket.cc, and the
# plugin's own "NET/LinkPass : ..." lines); they were NOT captured from a run: no GPU was available.
LINKPASS_LOG = """\
gpu0:4711:4711 [0] NCCL INFO Bootstrap: Using lo:127.0.0.1<0>
gpu0:4711:4711 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to /repo/rdma/nccl/build/libnccl-net-linkpass.so
gpu0:4711:4711 [0] NCCL INFO NET/Plugin: Loaded net plugin LinkPass (v12)
gpu0:4711:4711 [0] NCCL INFO Successfully loaded external network plugin /repo/rdma/nccl/build/libnccl-net-linkpass.so
gpu0:4711:4711 [0] NCCL INFO cudaDriverVersion 13000
gpu0:4711:4711 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
gpu0:4711:4725 [0] NCCL INFO NET/LinkPass : device 0 = plane 0: 127.0.1.1 (127.0.1.1), 10000 Mbps, listening on port 40001
gpu0:4711:4725 [0] NCCL INFO NET/LinkPass : device 1 = plane 1: 127.0.2.1 (127.0.2.1), 10000 Mbps, listening on port 40002
gpu0:4711:4725 [0] NCCL INFO NET/LinkPass : lanes are TCP connections (verbs lanes not used: no RDMA device)
gpu0:4711:4725 [0] NCCL INFO Initialized NET plugin LinkPass
gpu0:4711:4725 [0] NCCL INFO Assigned NET plugin LinkPass to comm
gpu0:4711:4725 [0] NCCL INFO Using network LinkPass
gpu0:4711:4725 [0] NCCL INFO ncclCommInitRankConfig comm 0x55d0c8a0 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 commId 0x7f3c5a1b2c3d4e5f - Init COMPLETE
gpu0:4711:4730 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/LinkPass/0
gpu0:4711:4730 [0] NCCL INFO Channel 01/0 : 1[0] -> 0[0] [receive] via NET/LinkPass/1
gpu0:4711:4730 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/LinkPass/0
gpu0:4711:4730 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/LinkPass/0
gpu0:4711:4730 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 0
gpu0:4711:4740 [0] NCCL INFO NET/LinkPass : lane 0.1 (sport 45002) to 127.0.1.2:40011 on plane 0 down: recv: Connection reset by peer; 3 chunks move to other lanes; retry in 0 ms
"""

SOCKET_LOG = """\
gpu0:4800:4800 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to none
gpu0:4800:4800 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
gpu0:4800:4812 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>
gpu0:4800:4812 [0] NCCL INFO Initialized NET plugin Socket
gpu0:4800:4812 [0] NCCL INFO Assigned NET plugin Socket to comm
gpu0:4800:4812 [0] NCCL INFO Using network Socket
gpu0:4800:4830 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
gpu0:4800:4830 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
gpu0:4800:4833 [0] NCCL WARN socketProgress: Connection closed by remote peer gpu0<41234>
"""


# ---- NCCL's log --------------------------------------------------------------------------------------

def test_linkpass_log_gives_abi_devices_net_and_channels():
    p = g.parse_nccl_log(LINKPASS_LOG)
    assert p["version"] == "2.28.9"
    assert p["loaded"] == [{"name": "LinkPass", "abi": 12}]
    assert p["using"] == ["LinkPass"] and p["assigned"] == ["LinkPass"]
    assert p["linkpass_devices"] == [
        {"dev": 0, "plane": 0, "label": "127.0.1.1", "addr": "127.0.1.1", "mbps": 10000, "port": 40001},
        {"dev": 1, "plane": 1, "label": "127.0.2.1", "addr": "127.0.2.1", "mbps": 10000, "port": 40002}]
    assert p["socket_devices"] == []
    assert p["channels"] == {"LinkPass/0": 3, "LinkPass/1": 1}
    assert p["warnings"] == []
    assert g.busiest_device(p["channels"], "LinkPass") == 0


def test_socket_log_gives_its_devices_and_warning():
    p = g.parse_nccl_log(SOCKET_LOG)
    assert p["loaded"] == [] and p["using"] == ["Socket"] and p["assigned"] == ["Socket"]
    assert p["socket_devices"] == [{"dev": 0, "ifname": "lo", "addr": "127.0.0.1"}]
    assert p["channels"] == {"Socket/0": 2}
    assert p["warnings"] == ["socketProgress: Connection closed by remote peer gpu0<41234>"]


def test_socket_devices_of_several_interfaces_and_older_abi():
    text = ("h:1:2 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0> [1]lo:127.0.0.1<0>\n"
            "h:1:2 [0] NCCL INFO NET/Plugin: Loaded net plugin LinkPass (v8)\n"
            "h:1:2 [0] NCCL INFO NET/Plugin: Loaded net plugin LinkPass (v8)\n")
    p = g.parse_nccl_log(text)
    assert p["socket_devices"] == [{"dev": 0, "ifname": "eth0", "addr": "10.0.0.5"},
                                   {"dev": 1, "ifname": "lo", "addr": "127.0.0.1"}]
    assert p["loaded"] == [{"name": "LinkPass", "abi": 8}]  # once, however many ranks say it


def test_busiest_device():
    assert g.busiest_device({"LinkPass/0": 1, "LinkPass/1": 3}, "LinkPass") == 1
    assert g.busiest_device({"LinkPass/0": 2, "LinkPass/1": 2}, "LinkPass") == 0  # a tie: the lower
    assert g.busiest_device({"Socket/1": 9}, "LinkPass") == 0  # another net's channels do not count
    assert g.busiest_device({}, "LinkPass") == 0


def test_plugin_lines_keep_what_concerns_the_net_with_their_source():
    lines = g.plugin_lines({"linkpass rank0": LINKPASS_LOG, "socket rank0": SOCKET_LOG})
    assert lines[0] == "[linkpass rank0] gpu0:4711:4711 [0] NCCL INFO NCCL_NET_PLUGIN set by environment to " \
                       "/repo/rdma/nccl/build/libnccl-net-linkpass.so"
    assert "[linkpass rank0] gpu0:4711:4711 [0] NCCL INFO NET/Plugin: Loaded net plugin LinkPass (v12)" in lines
    assert "[socket rank0] gpu0:4800:4812 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>" in lines
    assert not any("cudaDriverVersion" in x or "Connected all rings" in x or "Bootstrap" in x for x in lines)
    assert len([x for x in lines if x.startswith("[linkpass rank0]")]) == 16
    assert len([x for x in lines if x.startswith("[socket rank0]")]) == 9


def test_init_failure_kinds():
    dup = "h:1:1 [0] NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 18000\n"
    assert g.init_failure_kind(dup, "LinkPass") == "duplicate-gpu"
    multi = "h:1:1 [0] NCCL WARN Multiple Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1\n"
    assert g.init_failure_kind(multi, "Socket") == "duplicate-gpu"
    missing = ("h:1:1 [0] NCCL INFO NET/Plugin: Could not find: /x/libnccl-net-linkpass.so\n"
               "h:1:1 [0] NCCL WARN Failed to initialize any NET plugin\n")
    assert g.init_failure_kind(missing, "LinkPass") == "plugin-not-loaded"
    assert g.init_failure_kind(missing, "Socket") is None
    assert g.init_failure_kind(LINKPASS_LOG + "h:1:1 [0] NCCL WARN Failed to initialize any NET plugin\n",
                               "LinkPass") is None  # it was loaded: a retry by name would not help
    assert g.init_failure_kind("RuntimeError: CUDA error: out of memory", "LinkPass") is None


# ---- sockets -------------------------------------------------------------------------------------------

TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7334 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0 100 0 0 10 0
   1: 0100007F:9C40 0100007F:7334 01 00000000:00000000 00:00000000 00000000     0        0 1002 1 0 20 4 30 10 -1
   2: 0101007F:A000 0201007F:B000 01 00000000:00000000 00:00000000 00000000     0        0 1003 1 0 20 4 30 10 -1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:7334 0000000000000000FFFF00000100007F:9C41 01 00000000:00000000 00:00000000 00000000     0        0 1004 1 0 20 4 30 10 -1
   1: 00000000000000000000000001000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1005 1 0 100 0 0 10 0
"""


def test_proc_net_tcp_parses_v4_and_v4_mapped_v6():
    s = g.parse_proc_net_tcp(TCP) + g.parse_proc_net_tcp(TCP6)
    assert [(x["local"], x["remote"], x["state"], x["inode"]) for x in s] == [
        (("127.0.0.1", 29492), ("0.0.0.0", 0), "0A", 1001),
        (("127.0.0.1", 40000), ("127.0.0.1", 29492), "01", 1002),
        (("127.0.1.1", 40960), ("127.0.1.2", 45056), "01", 1003),
        (("127.0.0.1", 29492), ("127.0.0.1", 40001), "01", 1004),
        (("::1", 22), ("::", 0), "0A", 1005)]
    inodes = g.socket_inodes({3: "socket:[1002]", 4: "pipe:[77]", 5: "/dev/null", 6: "socket:[1003]"})
    assert inodes == {1002: 3, 1003: 6}
    mine = g.sockets_of(s, inodes)
    assert [(x["inode"], x["fd"]) for x in mine] == [(1002, 3), (1003, 6)]
    assert g.same_endpoint(("::ffff:127.0.0.1", 40000, 0, 0), ("127.0.0.1", 40000))
    assert g.same_endpoint(("127.0.0.1", 40000), ("127.0.0.1", 40000))
    assert not g.same_endpoint(("127.0.0.1", 40001), ("127.0.0.1", 40000))


def _s(local, remote, state="01"):
    return {"local": local, "remote": remote, "state": state, "inode": 0}


A, B, STORE = 100, 200, 29500
L = "127.0.0.1"
CURRENT = {
    A: [_s((L, 30000), ("0.0.0.0", 0), "0A"),        # rank 0's NCCL bootstrap listener (at init)
        _s((L, STORE), ("0.0.0.0", 0), "0A"),        # the store's listener
        _s((L, STORE), (L, 41000)),                  # the store, serving rank 1
        _s((L, 41001), (L, STORE)),                  # rank 0's own client of its store (same process)
        _s((L, 30000), (L, 42000)),                  # bootstrap: rank 1 connected to rank 0's listener
        _s((L, 43000), (L, 31000)),                  # rank 0 to rank 1's proxy/bootstrap listener
        _s((L, 50000), (L, 44000)),                  # NEW: NCCL Socket net, rank 0 accepted
        _s((L, 45000), (L, 51000)),                  # NEW: NCCL Socket net, rank 0 connected
        _s((L, 46000), (L, 46001)), _s((L, 46001), (L, 46000))],  # rank 0 to its own proxy (one process)
    B: [_s((L, 31000), ("0.0.0.0", 0), "0A"),
        _s((L, 41000), (L, STORE)),
        _s((L, 42000), (L, 30000)),
        _s((L, 31000), (L, 43000)),
        _s((L, 44000), (L, 50000)),                  # NEW
        _s((L, 51000), (L, 45000))],                 # NEW
}
BASELINES = {A: {"listen": [30000, STORE], "est": [[L, STORE, L, 41000], [L, 41001, L, STORE]]},
             B: {"listen": [31000], "est": [[L, 41000, L, STORE]]}}


def test_socket_kill_targets_only_connections_opened_after_init():
    t = g.new_peer_connections(CURRENT, BASELINES, STORE)
    assert sorted((x["pid"], x["local"][1], x["remote"][1]) for x in t) == [
        (A, 45000, 51000), (A, 50000, 44000), (B, 44000, 50000), (B, 51000, 45000)]
    pairs = [(*x["local"], *x["remote"]) for x in t if x["pid"] == A]
    assert g.ss_pairs_filter(pairs) == "( sport = :50000 and dport = :44000 ) or ( sport = :45000 and dport = :51000 )"


def test_socket_kill_fallback_takes_every_inter_rank_connection_but_the_store():
    t = g.all_peer_connections(CURRENT, STORE)
    assert sorted((x["pid"], x["local"][1]) for x in t) == [
        (A, 30000), (A, 43000), (A, 45000), (A, 50000), (B, 31000), (B, 42000), (B, 44000), (B, 51000)]


def test_plane_kill_targets_and_filter():
    own = [_s(("127.0.2.1", 40002), ("0.0.0.0", 0), "0A"), _s(("127.0.2.1", 5000), ("127.0.2.2", 40012)),
           _s(("127.0.1.1", 5001), ("127.0.1.2", 40011)), _s(("127.0.2.1", 40002), ("127.0.2.2", 6000))]
    assert [x["local"][1] for x in g.plane_sockets(own, g.plane_prefix(1))] == [5000, 40002]
    assert g.ss_plane_filter(0) == "dst 127.0.1.0/24" and g.ss_plane_filter(1) == "dst 127.0.2.0/24"
    bl = g.baseline_of(own)
    assert bl == {"listen": [40002], "est": [["127.0.1.1", 5001, "127.0.1.2", 40011],
                                             ["127.0.2.1", 5000, "127.0.2.2", 40012],
                                             ["127.0.2.1", 40002, "127.0.2.2", 6000]]}


# ---- the plan --------------------------------------------------------------------------------------------

def test_rank_environment():
    plan = g.default_plan("/tmp/o", PLUGIN, "/py")
    e0, e1 = (g.rank_env(plan, "LinkPass", r, "/tmp/o/w") for r in (0, 1))
    assert e0["LINKPASS_NICS"] == "127.0.1.1,127.0.2.1" and e1["LINKPASS_NICS"] == "127.0.1.2,127.0.2.2"
    assert e0["NCCL_HOSTID"] != e1["NCCL_HOSTID"]
    for e in (e0, e1):
        assert e["NCCL_NET"] == "LinkPass" and e["NCCL_NET_PLUGIN"] == PLUGIN
        assert e["NCCL_P2P_DISABLE"] == e["NCCL_SHM_DISABLE"] == "1"
        assert e["NCCL_DEBUG"] == "INFO" and e["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
        assert "NCCL_MULTI_RANK_GPU_ENABLE" not in e
    assert e1["NCCL_DEBUG_FILE"] == "/tmp/o/w/rank1.nccl.log"
    assert g.rank_env(plan, "LinkPass", 0, "/w", multi_rank=True)["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    byname = g.rank_env(plan, "LinkPass", 0, "/w", plugin_mode="name")
    assert byname["NCCL_NET_PLUGIN"] == "linkpass"
    assert byname["LD_LIBRARY_PATH"].split(":")[0] == os.path.dirname(PLUGIN)
    s = g.rank_env(plan, "Socket", 1, "/w")
    assert s["NCCL_NET"] == "Socket" and s["NCCL_NET_PLUGIN"] == "none" and s["NCCL_HOSTID"] == e1["NCCL_HOSTID"]
    assert not [k for k in s if k.startswith("LINKPASS_")]


def test_plan_is_valid_and_its_faults_are_named():
    plan = g.default_plan("/tmp/o", PLUGIN)
    assert g.validate_plan(plan, 400) == []
    assert g.validate_plan(g.default_plan("/tmp/o", PLUGIN, cpu_selftest=True), 400) == []
    bad = json.loads(json.dumps(plan))
    bad["kill"]["pre_s"] = 9.0
    bad["torch_timeout_s"] = 160
    problems = g.validate_plan(bad, 200)
    assert len(problems) == 3, problems
    assert any("pre_s + window_s" in p for p in problems) and any("torch timeout" in p for p in problems)
    assert any("budget 200 s" in p for p in problems)


# ---- numbers and rows -------------------------------------------------------------------------------------

def test_busbw_stall_and_timed_iterations():
    assert g.busbw_gbs(16 * MiB, 0.01) == pytest.approx(1.6777216, abs=1e-12)  # n = 2: busbw = algbw
    assert g.busbw_gbs(16 * MiB, 0.01, nranks=4) == pytest.approx(1.6777216 * 1.5, abs=1e-12)
    assert g.stall_ms([0.010, 0.011, 0.012, 0.050]) == pytest.approx(38.5, abs=1e-9)
    assert g.stall_ms([]) is None
    assert g.timed_iters(10, 0.5, 20.0, 3) == 10
    assert g.timed_iters(10, 4.0, 20.0, 3) == 5
    assert g.timed_iters(10, 60.0, 20.0, 3) == 3
    assert g.timed_iters(2, 60.0, 20.0, 3) == 2


def _its(times, t0=1000.0, ok=True):
    out, t = [], t0
    for i, d in enumerate(times):
        out.append({"ev": "it", "i": i, "t0": t, "dt": d, "ok": ok})
        t += d
    return out


def _bench(m, times, wrong=0):
    return {"ev": "bench", "size_mib": m, "warmup": 2, "iters": len(times), "times": times, "wrong": wrong}


def test_kill_outcomes():
    times = [0.02] * 20 + [0.32] + [0.02] * 19
    lp = {r: {"events": [{"ev": "loop-start", "t": 1000.0, "n": 40}, *_its(times), {"ev": "loop-end"}],
              "exit": 0, "exit_t": 1010.0, "timed_out": False} for r in (0, 1)}
    kill = {"first_t": 1000.39, "killed_total": 10}
    o = g.kill_outcome(lp, kill)
    assert o["outcome"] == "completed" and o["iterations"] == 40 and o["wrong"] == 0
    assert o["stall_ms"] == pytest.approx(300.0) and o["median_ms"] == pytest.approx(20.0)
    assert o["after_kill"] == 21
    assert g.kill_outcome(lp, {"first_t": 1000.39, "killed_total": 0})["outcome"] == "not-run"
    assert g.kill_outcome(lp, None)["outcome"] == "not-run"

    sock = {r: {"events": [{"ev": "loop-start", "t": 1000.0, "n": 40}, *_its([0.02] * 5)],
                "exit": -6, "exit_t": 1000.9, "timed_out": False} for r in (0, 1)}
    text = "gpu0:1:2 [0] NCCL WARN socketProgress: Connection closed by remote peer gpu0<41234>\nnoise\n"
    o = g.kill_outcome(sock, {"first_t": 1000.4, "killed_total": 6}, text, 45)
    assert o["outcome"] == "error" and o["end_after_kill_s"] == pytest.approx(0.5)
    assert o["why"] == "rank exits {0: -6, 1: -6}"
    assert o["errors"] == ["gpu0:1:2 [0] NCCL WARN socketProgress: Connection closed by remote peer gpu0<41234>"]
    late = {r: dict(v, exit_t=1046.0) for r, v in sock.items()}
    o = g.kill_outcome(late, {"first_t": 1000.4, "killed_total": 6}, "", 45)
    assert o["outcome"] == "hang" and o["why"].startswith("no error until torch's timeout (45 s)")
    stuck = {r: dict(v, timed_out=True) for r, v in sock.items()}
    assert g.kill_outcome(stuck, {"first_t": 1000.4, "killed_total": 6})["outcome"] == "hang"
    bad = {r: {"events": [{"ev": "loop-start", "t": 1000.0, "n": 3}, *_its([0.02] * 3, ok=False),
                          {"ev": "loop-end"}], "exit": 0, "exit_t": 1001.0} for r in (0, 1)}
    assert g.kill_outcome(bad, kill)["outcome"] == "wrong-result"
    assert g.kill_outcome({0: {"events": []}}, kill) == {"outcome": "not-run", "why": "the loop never started"}


def test_rows_and_document():
    lp_times = {1: [0.001] * 20, 16: [0.01] * 20, 256: [0.2] * 5}
    so_times = {1: [0.002] * 20, 16: [0.02] * 20, 256: [0.1] * 5}
    phases = {
        "LinkPass": {"events0": [_bench(m, t) for m, t in lp_times.items()],
                     "kill_outcome": {"outcome": "completed", "stall_ms": 12.5},
                     "kill": {"what": "plane 0: every lane with an end on 127.0.1.x", "method": "ss"}},
        "Socket": {"events0": [_bench(m, t) for m, t in so_times.items()],
                   "kill_outcome": {"outcome": "error", "stall_ms": 3.0, "end_after_kill_s": 0.4},
                   "kill": {"what": "6 TCP sockets ...", "method": "ss"}},
    }
    rows = g.build_rows(phases)
    assert [r["case"] for r in rows] == ["allreduce-1MiB", "allreduce-16MiB", "allreduce-256MiB", "plane-kill-16MiB"]
    r1 = rows[0]
    assert (r1["metric"], r1["unit"], r1["n"], r1["peer"], r1["peer_n"]) == ("busbw", "GB/s", 20, "nccl-socket", 20)
    assert r1["median"] == round(MiB / 0.001 / 1e9, 3) == 1.049 and r1["peer_median"] == 0.524
    assert r1["ratio"] == 2.0 and r1["p99"] == 1.049 and r1["wrong"] == 0
    assert rows[2]["n"] == 5 and rows[2]["p99"] is None and rows[2]["ratio"] == 0.5
    k = rows[3]
    assert (k["metric"], k["unit"], k["n"], k["median"]) == ("stall", "ms", 1, 12.5)
    assert k["outcome"] == "completed" and k["peer_outcome"] == "error"
    assert k["peer_n"] == 0 and k["peer_median"] is None and "ratio" not in k  # no stall for a peer that failed
    assert k["kill_method"] == "ss" and k["peer_detail"]["end_after_kill_s"] == 0.4
    empty = g.build_rows({})
    assert [r["n"] for r in empty] == [0, 0, 0, 0] and empty[3]["outcome"] == "not-run"
    doc = g.document(rows, "NVIDIA H100 80GB HBM3, 16 cores, Linux 6.8")
    assert doc["benchmark"] == "gpu_nccl" and doc["machine"].startswith("NVIDIA H100")
    assert doc["when"].endswith("Z") and doc["rows"] is rows
    json.dumps(doc)
    table = g.table(rows)
    assert "allreduce-256MiB" in table and "completed / error" in table


def test_event_stream_survives_a_cut_line():
    text = '{"ev": "start", "t": 1}\n{"ev": "it", "i": 0, "t0": 1.0, "dt": 0.1, "ok": true}\n{"ev": "it", "i'
    assert [e["ev"] for e in g.events_of(text)] == ["start", "it"]


# ---- run.sh -------------------------------------------------------------------------------------------------

def test_run_sh_syntax():
    r = subprocess.run(["bash", "-n", RUN_SH], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_run_sh_usage_errors():
    r = subprocess.run(["bash", RUN_SH], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "OUT_DIR" in r.stderr
    r = subprocess.run(["bash", RUN_SH, "/tmp/x", "--bogus"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr


def test_dry_run_needs_no_torch_and_names_the_plan(tmp_path):
    # a torch that cannot be imported: the dry run must not try
    blocker = tmp_path / "block"
    (blocker / "torch").mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('the dry run must not import torch')\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(blocker))
    r = subprocess.run(["bash", RUN_SH, str(out), "--dry-run", "--python", sys.executable],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    text = r.stdout
    assert "NCCL_NET=LinkPass" in text and "NCCL_NET=Socket" in text
    assert "1 MiB, 16 MiB, 256 MiB" in text
    assert f"NCCL_NET_PLUGIN={PLUGIN}" in text and f"plugin: {PLUGIN} (present)" in text
    assert "LINKPASS_NICS=127.0.1.1,127.0.2.1" in text and "LINKPASS_NICS=127.0.1.2,127.0.2.2" in text
    assert "ss -K -t 'dst 127.0.1.0/24'" in text
    assert text.rstrip().endswith("plan ok")
    probe = json.loads((out / "probe.json").read_text())
    assert set(probe) >= {"netns", "nft", "tc", "ss_kill", "loopback_planes", "kernel"}
    assert not (out / "gpu_nccl.json").exists() and not (out / "logs").exists()  # nothing was run
