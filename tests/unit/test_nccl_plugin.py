"""The NCCL net plugin (rdma/nccl/), driven by its harness exactly as NCCL's proxy drives it:
the exported ABI versions, the properties, and every rule of the data path NCCL relies on
(docs/nccl-plugin.md), on two loopback planes in one process."""
from __future__ import annotations

import os
import re
import socket
import struct
import subprocess

import pytest

from support.nccl import NCCL_DIR, harness_fields, nccl_build, nccl_harness


VERSIONS = [8, 9, 10, 11, 12]


def transfer(*args, version=None, env=None):
    r = nccl_harness(*(["-v", str(version)] if version else []), "transfer", *args, env=env)
    return r, harness_fields(r.stdout, "transfer") if "transfer " in r.stdout else {}


def ok(r, t):
    assert r.returncode == 0, f"harness exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert t["wrong"] == "0" and t["bad_sizes"] == "0", r.stdout
    assert t["send_done"] == t["recv_done"] == t["messages"], r.stdout


# ---- the ABI ------------------------------------------------------------------------------------

def test_exports_v8_to_v12_and_the_harness_takes_the_newest():
    plugin, _ = nccl_build()
    syms = subprocess.run(["nm", "-D", "--defined-only", plugin], capture_output=True, text=True, check=True).stdout
    found = sorted(int(v) for v in re.findall(r"\bncclNetPlugin_v(\d+)\b", syms))
    assert found == VERSIONS
    r = nccl_harness("info")
    assert r.returncode == 0, r.stderr
    assert "plugin name=LinkPass version=v12 devices=2" in r.stdout


def test_struct_layouts_match_the_documented_abi(tmp_path):
    """Sizes and offsets NCCL relies on (NCCL-NOTES §1.6), measured from our header by a C program."""
    src = tmp_path / "layout.c"
    src.write_text("""#include <stdio.h>
#include "nccl_net.h"
#define P(T, F) printf(#T "." #F "=%zu\\n", offsetof(T, F))
#define S(T) printf("sizeof(" #T ")=%zu\\n", sizeof(T))
int main(void) {
  S(ncclNetProperties_v8_t); S(ncclNetProperties_v9_t); S(ncclNetProperties_v11_t); S(ncclNetProperties_v12_t);
  S(ncclNet_v8_t); S(ncclNet_v9_t); S(ncclNet_v10_t); S(ncclNet_v11_t); S(ncclNet_v12_t);
  S(ncclNetDeviceHandle_v7_t); S(ncclNetAttr_v11_t);
  P(ncclNetProperties_v8_t, netDeviceVersion); P(ncclNetProperties_v9_t, maxCollBytes);
  P(ncclNetProperties_v11_t, maxMultiRequestSize); P(ncclNetProperties_v12_t, railId);
  P(ncclNetProperties_v12_t, planeId); P(ncclNetProperties_v12_t, maxP2pBytes);
  P(ncclNet_v12_t, test); P(ncclNet_v12_t, makeVDevice); P(ncclNet_v12_t, finalize); P(ncclNet_v12_t, setNetAttr);
  return 0;
}
""")
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-I", NCCL_DIR, "-o", str(exe), str(src)],
                   check=True)
    got = dict(line.split("=") for line in subprocess.run([str(exe)], capture_output=True, text=True).stdout.split())
    want = {"sizeof(ncclNetProperties_v8_t)": "64", "sizeof(ncclNetProperties_v9_t)": "104",
            "sizeof(ncclNetProperties_v11_t)": "112", "sizeof(ncclNetProperties_v12_t)": "128",
            "sizeof(ncclNet_v8_t)": "152", "sizeof(ncclNet_v9_t)": "160", "sizeof(ncclNet_v10_t)": "160",
            "sizeof(ncclNet_v11_t)": "176", "sizeof(ncclNet_v12_t)": "176", "sizeof(ncclNetDeviceHandle_v7_t)": "32",
            "sizeof(ncclNetAttr_v11_t)": "44", "ncclNetProperties_v8_t.netDeviceVersion": "56",
            "ncclNetProperties_v9_t.maxCollBytes": "96", "ncclNetProperties_v11_t.maxMultiRequestSize": "104",
            "ncclNetProperties_v12_t.railId": "124", "ncclNetProperties_v12_t.planeId": "126",
            "ncclNetProperties_v12_t.maxP2pBytes": "104", "ncclNet_v12_t.test": "104",
            "ncclNet_v12_t.makeVDevice": "152", "ncclNet_v12_t.finalize": "160", "ncclNet_v12_t.setNetAttr": "168"}
    assert got == want


@pytest.mark.parametrize("version", VERSIONS)
def test_properties_of_a_host_memory_plugin(version):
    r = nccl_harness("-v", str(version), "info")
    assert r.returncode == 0, r.stderr
    assert f"plugin name=LinkPass version=v{version} devices=2" in r.stdout
    for dev in (0, 1):
        p = harness_fields(r.stdout.replace(f"device {dev} ", f"device{dev} "), f"device{dev}")
        assert (p["ptrSupport"], p["regIsGlobal"], p["maxRecvs"], p["netDeviceType"], p["netDeviceVersion"]) == \
            ("1", "0", "1", "0", "0")
        assert int(p["speed"]) > 0 and int(p["maxComms"]) > 0
        if version >= 9:
            assert p["vdevs"] == "1" and p["forceFlush"] == "0"
            assert int(p["maxP2pBytes"]) == int(p["maxCollBytes"]) == 1 << 30
        if version >= 11:
            assert p["maxMultiRequestSize"] == "1"
        if version == 12:
            assert p["railId"] == p["planeId"] == "-1"
    assert "name=lo" in r.stdout  # plane 0 is 127.0.0.1, found on its interface


def test_the_pure_decisions_lane_states_flap_damping_stuck_bound_plane_choice():
    """rdma/nccl/test_policy.c: every (state, event) pair of the lane table, hold-outs doubling and
    decaying, the stuck bound from the RTT, the plane choice with and without the table's marks."""
    nccl_build()
    r = subprocess.run([os.path.join(NCCL_DIR, "build", "test_policy")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout


# ---- the data path: NCCL's rules ---------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_carries_every_size_in_posting_order(version):
    """Sizes around the chunk boundary (512 KiB), matched to receives in posting order: the pattern of
    message i differs from message i+1, so a send matched to the wrong receive shows as wrong bytes."""
    r, t = transfer("-s", "1,1000,524287,524288,524289,3M", "-n", "3", version=version)
    ok(r, t)
    assert t["messages"] == "18" and t["version"] == f"v{version}"


def test_zero_byte_messages_complete_with_size_zero():
    r, t = transfer("-s", "0,0,5,0", "-n", "20")
    ok(r, t)
    assert t["bytes"] == str(5 * 20)


def test_zero_byte_messages_with_no_buffer_at_all_complete():
    """-z: a 0-byte send and receive posted with a NULL buffer (nothing to point at) complete like
    any other; a receive that took its NULL destination for "discard" would never finish."""
    r, t = transfer("-s", "0,0,5,0", "-n", "20", "-z", "-T", "20")
    ok(r, t)
    assert t["messages"] == "80" and t["bytes"] == str(5 * 20)


@pytest.mark.parametrize("version", [8, 12])
def test_a_receive_posted_larger_than_the_send_reports_the_senders_size(version):
    """-x: every receive is posted 4097 bytes larger; test() must report the sent size and the
    excess must stay untouched (the harness fills it with a canary and checks it)."""
    r, t = transfer("-s", "0,100,1M", "-n", "4", "-x", "4097", version=version)
    ok(r, t)


def test_sizes_null_in_test():
    r, t = transfer("-s", "100,2M", "-n", "5", "-N")
    ok(r, t)


@pytest.mark.parametrize("version", VERSIONS)
def test_request_preset_to_optional_completion_is_overwritten(version):
    """NCCL may store 0x1 in *request before irecv; the plugin must overwrite it with a real request
    (the harness fails if it stays 0x1). NCCL's v8 layer resets it to NULL itself, as the harness does."""
    r, t = transfer("-s", "0,64,8K", "-n", "10", "-p", version=version)
    ok(r, t)


def test_32_outstanding_requests_per_comm():
    r, t = transfer("-s", "1,4K,64K,0", "-n", "64", "-w", "32")
    ok(r, t)
    assert t["messages"] == "256"


def test_sender_and_receiver_on_their_own_threads():
    """NCCL's progress threads call isend/irecv/test while its service thread made the connection."""
    r, t = transfer("-s", "0,1,300K,2M", "-n", "25", "-t")
    ok(r, t)


def test_traffic_stays_on_its_own_plane_while_it_is_healthy():
    """Rail locality: a comm on device 1 uses plane 1's lanes only; plane 0's standby lane carries nothing."""
    r, t = transfer("-d", "1", "-s", "2M", "-n", "10")
    ok(r, t)
    s = harness_fields(r.stdout, "stats")
    assert int(s["chunks_plane1"]) >= 40 and s["chunks_plane0"] == "0", r.stdout


# ---- configuration ------------------------------------------------------------------------------

def test_a_bad_variable_is_a_warning_naming_it_and_its_range_then_the_default():
    r = nccl_harness("info", env={"LINKPASS_LANES": "99", "LINKPASS_CHUNK_KB": "x", "LINKPASS_TEST_YIELD": "-1"})
    assert r.returncode == 0, r.stderr
    assert "NCCL WARN NET/LinkPass : LINKPASS_TEST_YIELD=-1 is not valid: it must be an integer 0..1000000" in r.stderr
    assert "NCCL WARN NET/LinkPass : LINKPASS_LANES=99 is not valid: it must be an integer 1..16" in r.stderr
    assert "NCCL WARN NET/LinkPass : LINKPASS_CHUNK_KB=x is not valid: it must be an integer 4..65536" in r.stderr
    assert "lanes: 4 on its own plane" in r.stderr and "chunks of 512 KiB" in r.stderr


def test_verbs_lanes_asked_for_on_a_host_without_rdma_give_no_devices_and_say_why():
    """LINKPASS_TRANSPORT=verbs is a demand: where no plane address is a RoCE v2 GID (this host has
    no RDMA at all) the plugin offers no device, so NCCL moves on to its next net, and says why."""
    r = nccl_harness("info", env={"LINKPASS_TRANSPORT": "verbs"})
    assert r.returncode == 0, r.stderr
    assert "devices=0" in r.stdout
    warn = [ln for ln in r.stderr.splitlines() if "NCCL WARN" in ln and "LINKPASS_TRANSPORT=verbs, but" in ln]
    assert warn and "no RDMA device" in warn[0] and "LINKPASS_TRANSPORT=auto" in warn[0], r.stderr


def test_by_default_lanes_are_tcp_where_the_host_has_no_rdma_and_the_log_says_why():
    r = nccl_harness("info")
    assert r.returncode == 0, r.stderr
    assert "devices=2" in r.stdout
    assert "lanes are TCP connections (verbs lanes not used: no RDMA device" in r.stderr, r.stderr
    r = nccl_harness("info", env={"LINKPASS_TRANSPORT": "tcp"})
    assert "lanes are TCP connections (verbs lanes not used: LINKPASS_TRANSPORT=tcp)" in r.stderr, r.stderr


def test_bad_transport_and_queue_pair_settings_are_named_with_what_they_accept():
    r = nccl_harness("info", env={"LINKPASS_TRANSPORT": "rdma", "LINKPASS_QP_TIMEOUT": "40", "LINKPASS_QP_RETRY": "9"})
    assert r.returncode == 0, r.stderr
    assert "LINKPASS_TRANSPORT=rdma is not valid: it must be auto (verbs lanes where every plane has a RoCE v2 " \
           "device, else TCP), tcp or verbs; using auto" in r.stderr
    assert "LINKPASS_QP_TIMEOUT=40 is not valid: it must be an integer 1..31" in r.stderr
    assert "LINKPASS_QP_RETRY=9 is not valid: it must be an integer 0..7" in r.stderr
    assert "devices=2" in r.stdout


def test_nics_that_do_not_exist_give_no_devices_and_say_why():
    r = nccl_harness("info", env={"LINKPASS_NICS": "127.0.0.1,nosuchif0"})
    assert r.returncode == 0, r.stderr
    assert "devices=0" in r.stdout
    assert "LINKPASS_NICS=127.0.0.1,nosuchif0 is not valid" in r.stderr and '"nosuchif0" is neither' in r.stderr


@pytest.mark.parametrize("version", [8, 12])
def test_listen_accept_and_connect_never_block(tmp_path, version):
    """accept with nobody connecting, and connect to a peer that takes the TCP connection but never
    answers the lane handshake, return at once with NULL, poll after poll (a blocking call would
    hang the harness or hand back a comm)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        addr = socket.inet_aton("127.0.0.1")
        eps = struct.pack("<4sHH", addr, silent.getsockname()[1], 0) + bytes(8 * 7)
        handle = struct.pack("<IHBBQ", 0x4C504E31, 2, 1, 0, 0x1234) + bytes(16) + eps
        (tmp_path / "h").write_text(handle.ljust(128, b"\0").hex() + "\n")
        r = nccl_harness("-v", str(version), "nonblocking", "-H", str(tmp_path / "h"), "-T", "5", timeout=60)
    finally:
        silent.close()
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-2000:]}"
    assert "nonblocking accept=null connect=null polls=50" in r.stdout


# ---- aarch64 (GH200/GB200 hosts) ------------------------------------------------------------------

def test_the_plugin_cross_built_for_aarch64_passes_its_policy_checks_and_moves_data(tmp_path):
    """The plugin, its harness and the policy checks cross-built for aarch64 with the same warnings
    as errors, then run under qemu-user: the decisions hold and a transfer arrives byte-exact over
    two loopback planes. qemu runs the code on this host's memory model, so this shows the aarch64
    build is right, not that it was stressed on a weakly ordered CPU."""
    import shutil

    if not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")
            and os.path.isdir("/usr/aarch64-linux-gnu/include")):
        pytest.skip("the aarch64 cross compiler and qemu-user are needed (deploy/install-test-deps.sh)")
    inc = tmp_path / "inc"
    inc.mkdir()
    os.symlink("/usr/include/infiniband", inc / "infiniband")  # the verbs headers are the same on both
    out = tmp_path / "build"
    targets = [str(out / t) for t in ("libnccl-net-linkpass.so", "lp_harness", "test_policy")]
    make = subprocess.run(["make", "-s", "-C", NCCL_DIR, f"O={out}", "CC=aarch64-linux-gnu-gcc",
                           f"CFLAGS=-O2 -g -isystem {inc}", *targets], capture_output=True, text=True, timeout=300)
    assert make.returncode == 0, make.stderr[-3000:]
    for t in targets:
        with open(t, "rb") as f:
            head = f.read(20)
        assert head[:4] == b"\x7fELF" and struct.unpack_from("<H", head, 18)[0] == 183  # EM_AARCH64
    qemu = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"]
    policy = subprocess.run([*qemu, targets[2]], capture_output=True, text=True, timeout=120)
    assert policy.returncode == 0 and policy.stdout.startswith("ok "), policy.stdout + policy.stderr
    env = dict(os.environ, LINKPASS_NICS="127.0.0.1,127.0.0.2", LINKPASS_ENTROPY_TABLE="/nonexistent/linkpass-entropy")
    for args in (["transfer"], ["transfer", "-s", "4194304", "-n", "8"]):
        r = subprocess.run([*qemu, targets[1], "-l", targets[0], *args], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        t = harness_fields(r.stdout, "transfer")
        assert t["wrong"] == "0" and t["send_done"] == t["recv_done"] == t["messages"], r.stdout
