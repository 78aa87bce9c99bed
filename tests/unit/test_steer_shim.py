"""The steering shim (rdma/steer/, liblinkpass-steer.so): its decisions case by case
(test_steer_policy.c), and the shim itself preloaded into a small verbs program whose
libibverbs is a stand-in that records what reaches it (tests/support/verbs/): which transitions
it steers, to which ports, in what order, what it leaves alone and why, and that the program
never sees an error of the shim's. What real verbs and the wire show runs in the Soft-RoCE guests."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from linkpass.agent.entropy_writer import EntropyWriter
from linkpass_rdma.steer import sport_of_flow_label

from support.nccl import NCCL_DIR, nccl_build

VERBS_SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "verbs")
SHIM = os.path.join(NCCL_DIR, "build", "liblinkpass-steer.so")
PEER, OTHER_PLANE_PEER, STRANGER = "198.18.72.1", "198.19.72.1", "198.18.99.9"
PORTS = (0xC001, 0xC0A2, 0xD003, 0xC000)  # 0xC000: the one port whose flow label needs a high bit
PATH_IDS = (0x1A, 0x2B, 0x3C, 0x4D)


def test_every_decision_of_the_policy():
    nccl_build()
    r = subprocess.run([os.path.join(NCCL_DIR, "build", "test_steer_policy")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout + r.stderr
    assert int(r.stdout.split()[1]) >= 40


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The verbs program, linked against the stand-in libibverbs (built here with gcc)."""
    nccl_build()
    d = tmp_path_factory.mktemp("standin")
    lib = d / "libibverbs.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(lib), "-Wl,-soname,libibverbs.so.1",
                    f"-Wl,--version-script={VERBS_SUPPORT}/standin_ibverbs.map",
                    os.path.join(VERBS_SUPPORT, "standin_ibverbs.c")], check=True)
    os.symlink("libibverbs.so.1", d / "libibverbs.so")
    exe = d / "verbs_app"
    subprocess.run(["gcc", "-Wall", "-Werror", "-o", str(exe), os.path.join(VERBS_SUPPORT, "verbs_app.c"),
                    f"-L{d}", "-libverbs", f"-Wl,-rpath,{d}"], check=True)
    return str(exe)


@pytest.fixture
def lab(tmp_path):
    """A table (peer with four ports on plane 0, another peer on plane 1) in a directory only
    this uid can write, and a sysfs with one RoCE v2 GID (index 1) and one RoCE v1 (index 0)."""
    os.chmod(tmp_path, 0o700)
    table = tmp_path / "run" / "entropy"
    table.parent.mkdir(mode=0o755)
    w = EntropyWriter(str(table), capacity=16)
    w.update(PEER, 0, PORTS, PATH_IDS)
    w.update(OTHER_PLANE_PEER, 1, (0xC111,), (0x77,))
    w.close()
    types = tmp_path / "sys" / "rxe_p0" / "ports" / "1" / "gid_attrs" / "types"
    types.mkdir(parents=True)
    (types / "0").write_text("IB/RoCE v1\n")
    (types / "1").write_text("RoCE v2\n")
    return tmp_path


def run(app, lab, *args, preload=True, env=None, dev="rxe_p0"):
    """The program's return codes, the flow labels that reached libibverbs, and the shim's log."""
    out, log = lab / "standin.log", lab / "steer.log"
    for f in (out, log):
        if f.exists():
            f.unlink()
    e = {k: v for k, v in os.environ.items() if not k.startswith(("LINKPASS_", "LD_PRELOAD"))}
    e.update({"STANDIN_LOG": str(out), "LINKPASS_ENTROPY_TABLE": str(lab / "run" / "entropy"),
              "LINKPASS_STEER_SYSFS": str(lab / "sys"), "LINKPASS_STEER_LOG": str(log)})
    if preload:
        e["LD_PRELOAD"] = SHIM
    e.update(env or {})
    r = subprocess.run([app, dev, *map(str, args)], env=e, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    labels = [int(m) for m in re.findall(r"flow_label=(\d+)", out.read_text())] if out.exists() else []
    return [int(x) for x in r.stdout.split()], labels, (log.read_text() if log.exists() else "")


def test_rc_qps_to_a_peer_take_its_spread_set_in_turn(app, lab):
    codes, labels, log = run(app, lab, 8, "rc", "rtr", 1, 0, PEER, 1)
    assert codes == [0] * 8
    assert [sport_of_flow_label(fl) for fl in labels] == list(PORTS) * 2, labels
    steered = re.findall(r"qp (\d+) on rxe_p0 port 1 gid 1 to 198\.18\.72\.1 \(plane 0\): steered to source port (\d+) "
                         r"\(flow label 0x[0-9a-f]+, path ([0-9a-f]{8}), (\d) of 4 in the spread set\)", log)
    assert [(int(q), int(p), int(path, 16), int(i)) for q, p, path, i in steered] == \
        [(100 + i, PORTS[i % 4], PATH_IDS[i % 4], i % 4 + 1) for i in range(8)], log
    assert "8 QP transition(s) to RTR: steered 8; retried unsteered 0" in log


def test_without_the_shim_the_labels_stay_as_the_program_set_them(app, lab):
    codes, labels, log = run(app, lab, 4, "rc", "rtr", 1, 0, PEER, 1, preload=False)
    assert codes == [0] * 4 and labels == [0] * 4 and log == ""


@pytest.mark.parametrize("args,env,reason", [
    ((2, "ud", "rtr", 1, 0, PEER, 1), {}, "not_rc"),
    ((2, "rc", "rtr", 0, 0, PEER, 1), {}, "no_grh"),
    ((2, "rc", "rtr", 1, 0x777, PEER, 1), {}, "app_label"),
    ((2, "rc", "rtr", 1, 0, PEER, 0), {}, "not_roce_v2"),
    ((2, "rc", "rtr", 1, 0, PEER, 5), {}, "not_roce_v2"),  # no such GID: its type cannot be read
    ((2, "rc", "rtr", 1, 0, STRANGER, 1), {}, "not_linkpass"),
    ((2, "rc", "rtr", 1, 0, PEER, 1), {"LINKPASS_ENTROPY_TABLE": "/nonexistent/entropy"}, "no_table"),
], ids=["ud-qp", "no-grh", "program-chose-a-label", "roce-v1-gid", "unknown-gid", "peer-not-probed", "no-table"])
def test_what_the_shim_leaves_alone_and_says_why(app, lab, args, env, reason):
    codes, labels, log = run(app, lab, *args, env=env)
    assert codes == [0, 0]
    assert labels == [args[4]] * 2, labels  # exactly what the program asked for
    assert len(re.findall(rf"untouched \({reason}\)", log)) == 2, log
    assert f"steered 0, {reason} 2" in log, log
    if reason == "no_table":
        assert "entropy table not used: /nonexistent/entropy: No such file or directory" in log


def test_other_transitions_pass_through_and_are_not_logged(app, lab):
    codes, labels, log = run(app, lab, 3, "rc", "rts", 1, 0, PEER, 1)
    assert codes == [0] * 3 and labels == [0] * 3
    assert log == ""  # nothing to say about transitions it never judges


def test_override_replaces_a_label_the_program_chose(app, lab):
    _, labels, log = run(app, lab, 2, "rc", "rtr", 1, 0x777, PEER, 1, env={"LINKPASS_STEER_OVERRIDE": "1"})
    assert [sport_of_flow_label(fl) for fl in labels] == list(PORTS[:2]), log


def test_a_peer_on_another_plane_is_found_by_its_address(app, lab):
    _, labels, log = run(app, lab, 2, "rc", "rtr", 1, 0, OTHER_PLANE_PEER, 1)
    assert [sport_of_flow_label(fl) for fl in labels] == [0xC111] * 2
    assert "to 198.19.72.1 (plane 1): steered to source port 49425" in log


def test_disabled_passes_everything_through(app, lab):
    _, labels, log = run(app, lab, 2, "rc", "rtr", 1, 0, PEER, 1, env={"LINKPASS_STEER": "0"})
    assert labels == [0, 0] and "steered" not in log


def test_a_table_others_could_write_is_not_used(app, lab):
    os.chmod(lab / "run" / "entropy", 0o666)
    codes, labels, log = run(app, lab, 2, "rc", "rtr", 1, 0, PEER, 1)
    assert codes == [0, 0] and labels == [0, 0]
    assert "can be written by its group or others (mode 0666)" in log and "untouched (no_table)" in log


def test_a_refused_steered_transition_is_made_again_as_asked(app, lab):
    """A driver that refuses the label: the program sees success and its QP connects unsteered."""
    codes, labels, log = run(app, lab, 2, "rc", "rtr", 1, 0, PEER, 1, env={"STANDIN_REFUSE_LABELS": "1"})
    assert codes == [0, 0]
    assert [sport_of_flow_label(fl) if fl else 0 for fl in labels] == [PORTS[0], 0, PORTS[1], 0], labels
    assert log.count("the steered transition failed (Invalid argument); made again as the application asked") == 2
    assert "retried unsteered 2" in log


def test_the_shim_exports_only_the_call_it_wraps():
    nccl_build()
    syms = subprocess.run(["nm", "-D", "--defined-only", SHIM], capture_output=True, text=True, check=True).stdout
    assert re.findall(r" T (\w+)", syms) == ["ibv_modify_qp"], syms
    needed = subprocess.run(["readelf", "-d", SHIM], capture_output=True, text=True, check=True).stdout
    assert "libibverbs" not in needed  # it calls the program's own libibverbs, whatever loaded it
