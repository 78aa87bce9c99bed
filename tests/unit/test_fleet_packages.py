"""Packages for fleets: the wheel (built from the sdist, manylinux-tagged) and the Debian
package's contents (deploy/package.py); one version source; the OS-package scripts never touch a
service they did not install; the example configs (installed and run on the testbed:
tests/root/test_fleet_packages_install.py)."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import yaml

from linkpass import __version__

REPO = Path(__file__).resolve().parents[2]
PACKAGE = [sys.executable, str(REPO / "deploy" / "package.py")]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())

def test_one_version_source():
    meta = pyproject()["project"]
    assert "version" not in meta and "version" in meta["dynamic"]
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "linkpass.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_the_agent_depends_on_three_packages_and_the_rest_are_extras():
    meta = pyproject()["project"]
    names = {re.split(r"[<>=\[ ]", d)[0].lower() for d in meta["dependencies"]}
    assert names == {"pyroute2", "prometheus-client", "pyyaml"}
    extras = meta["optional-dependencies"]
    assert {"coordinator", "demo", "sim", "test"} <= set(extras)
    assert any(d.startswith("ray") for d in extras["coordinator"])
    assert "linkpass[coordinator]" in extras["demo"]  # the demo runs a real coordinator
    assert meta["urls"] and meta["license"] and meta["classifiers"]
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_os_package_scripts_never_stop_a_service_they_did_not_install():
    runtime = (REPO / "deploy" / "install-os-deps.sh").read_text()
    tests = (REPO / "deploy" / "install-test-deps.sh").read_text()
    code = [ln for ln in runtime.splitlines() if not ln.lstrip().startswith("#")]
    assert not any("systemctl" in ln or "frr" in ln or "qemu" in ln for ln in code), \
        "the runtime script installs what the agent needs, nothing for the tests and no service change"
    # the test script touches FRR's and PostgreSQL's units only when this run installed them
    lines = [ln.strip() for ln in tests.splitlines()]
    guards = [i for i, ln in enumerate(lines)
              if ln.startswith(("if $installing_frr && command -v systemctl", "if $installing_pg && command -v systemctl"))]
    assert len(guards) == 2
    for guard in guards:
        assert any("systemctl" in ln for ln in lines[guard + 1:guard + 3])
    assert all(any(i in range(g, g + 3) for g in guards) for i, ln in enumerate(lines)
               if "systemctl" in ln and not ln.startswith("#"))
    for script in ("install-os-deps.sh", "install-test-deps.sh"):
        assert subprocess.run(["bash", "-n", str(REPO / "deploy" / script)]).returncode == 0


def test_wheel_is_manylinux_with_the_compiled_core_license_and_metadata(dist):
    wheel = dist["wheel"]
    assert re.fullmatch(rf"linkpass-{re.escape(__version__)}-cp3\d+-cp3\d+-manylinux_2_\d+_(x86_64|aarch64)\.whl",
                        wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"linkpass-{__version__}.dist-info/METADATA").decode()
    assert any(re.fullmatch(r"linkpass/probe/_probecore\.cpython-3\d+-[\w-]+\.so", n) for n in names)
    assert any(n.endswith("dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    requires = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist: ")]
    plain = {re.split(r"[<>=; ]", r)[0].lower() for r in requires if "extra ==" not in r}
    assert plain == {"pyroute2", "prometheus-client", "pyyaml"}, requires
    assert any(r.startswith("ray") and 'extra == "coordinator"' in r for r in requires), requires
    assert "Project-URL: Source, " in meta and "License-Expression: Apache-2.0" in meta
    # the sdist the wheel was built from carries the C sources and the license
    with tarfile.open(dist["sdist"]) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"LICENSE", "linkpass/probe/_probecore.c", "linkpass/probe/probe_rx.h", "rdma/nccl/Makefile",
            "rdma/entropy_table.h", "setup.py"} <= members


def _deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True, check=True).stdout.strip()


def test_deb_carries_the_venv_units_plugin_docs_and_safe_scripts(dist, tmp_path):
    deb = dist["deb"]
    assert _deb_field(deb, "Package") == "linkpass" and _deb_field(deb, "Version") == f"{__version__}-1"
    depends = _deb_field(deb, "Depends")
    # procps: the unit's ExecReload= is its /bin/kill (Debian's minbase has none)
    assert "python3 (>= 3.11)" in depends and "iproute2" in depends and "procps" in depends
    assert "frr" not in depends and "qemu" not in depends and "nftables" not in depends  # the testbed's, not the agent's
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    paths = {ln.split()[5].removeprefix(".") for ln in listing.splitlines()}
    want = {"/opt/linkpass/venv/bin/linkpass", "/opt/linkpass/bin/linkpass", "/usr/bin/linkpass",
            "/opt/linkpass/lib/libnccl-net-linkpass.so", "/opt/linkpass/lib/liblinkpass-steer.so",
            "/lib/systemd/system/linkpass-agent.service",
            "/lib/systemd/system/linkpass-coordinator.service", "/usr/share/doc/linkpass/copyright",
            "/usr/share/doc/linkpass/failover.md", "/usr/share/linkpass/prometheus/linkpass-rules.yml",
            "/usr/share/linkpass/grafana/linkpass-fleet.json", "/usr/share/doc/linkpass/examples/agent-fleet.yaml",
            "/usr/share/doc/linkpass/install.md", "/usr/lib/sysusers.d/linkpass.conf",
            "/usr/lib/sysctl.d/90-linkpass.conf"}
    assert want <= paths, want - paths
    assert not any(re.search(r"/site-packages/(ray|torch|scapy|cryptography|numpy)/", p) for p in paths)
    assert "/usr/bin/linkpass -> /opt/linkpass/bin/linkpass" in listing
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    # nothing in the package names the directory it was staged in
    staged = subprocess.run(["grep", "-rlI", "linkpass-deb-", str(root)], capture_output=True, text=True)
    assert staged.stdout == "", staged.stdout
    assert (root / "opt/linkpass/venv/bin/linkpass").read_text().splitlines()[0] == "#!/opt/linkpass/venv/bin/python"
    assert os.readlink(root / "opt/linkpass/venv/bin/python3") == "/usr/bin/python3"
    run = subprocess.run([str(root / "opt/linkpass/venv/bin/python"), "-m", "linkpass", "--version"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.stdout.strip() == f"linkpass {__version__}", run.stderr
    # md5sums match the files
    control = tmp_path / "control"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    sums = dict(reversed(ln.split("  ", 1)) for ln in (control / "md5sums").read_text().splitlines())
    assert len(sums) > 100
    for rel in ("opt/linkpass/venv/bin/linkpass", "usr/share/doc/linkpass/copyright"):
        assert sums[rel] == hashlib.md5((root / rel).read_bytes()).hexdigest()
    # maintainer scripts: valid sh; they stop only the package's own units and never enable or start one
    for name in ("postinst", "prerm", "postrm"):
        text = (control / name).read_text()
        assert subprocess.run(["sh", "-n", str(control / name)]).returncode == 0
        commands = [ln.strip() for ln in text.splitlines() if not ln.strip().startswith(("#", "echo "))]
        for ln in commands:
            if "systemctl" in ln and "daemon-reload" not in ln:
                assert "disable --now linkpass-agent.service linkpass-coordinator.service" in ln, ln
        assert not any(re.search(r"systemctl\s+(enable|start|restart)", ln) for ln in commands)
        # what they delete is the package's own tree, nothing an operator wrote
        for ln in commands:
            if re.match(r"(rm|rmdir)\s", ln):
                assert re.fullmatch(r"rm -rf /opt/linkpass/venv|rmdir (/opt/linkpass\S* ?)+2>/dev/null \|\| true", ln), ln
        assert "frr" not in text


def test_package_script_reports_a_failing_step_in_one_line_and_exits_1(tmp_path):
    run = subprocess.run(PACKAGE + ["deb", "--out", str(tmp_path), "--wheel", str(tmp_path / "missing.whl")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.startswith("package: error: ") and "missing.whl" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not list(tmp_path.glob("*.deb"))


def test_example_configs_are_valid_for_the_hosts_they_describe():
    from linkpass.agent.config import HostFacts, load_text, parse

    examples = REPO / "deploy" / "examples"
    fleet = yaml.safe_load((examples / "agent-fleet.yaml").read_text())
    for i in (1, 7, 300):
        a, b = divmod(i, 256)
        addrs = [("lo", f"198.18.{a}.{b}/32"), ("bond0", f"198.19.{a}.{b}/16")]
        addrs += [(f"ens{p}f0", f"198.18.{16 * (p + 1) + a}.{(2 * b + 1) % 256}/31") for p in range(8)]
        cfg = parse(fleet, HostFacts(f"gpu-{i}", tuple(addrs)))
        assert len(cfg.nics) == 8 and all(n.gateway for n in cfg.nics) and cfg.name == f"gpu-{i}"
        assert cfg.metrics_address == f"198.19.{a}.{b}" and cfg.coordinator.follow_plan
    one = load_text((examples / "agent-one-host.yaml").read_text(), "agent-one-host.yaml")
    assert (one.name, len(one.nics), len(one.peers), one.coordinator) == ("gpu-a11", 2, 2, None)


def test_a_command_that_needs_an_extra_says_which_in_one_line(tmp_path):
    """On an agent host (no Ray, no cryptography) `linkpass coordinator` and `linkpass tls init`
    name the extra to install instead of a traceback: simulated by hiding both packages."""
    hide = ("import sys, importlib.abc\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('ray', 'cryptography'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from linkpass.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    for args in (["coordinator", "--state-dir", str(tmp_path / "s"), "--max-seconds", "1"],
                 ["tls", "init", "--dir", str(tmp_path / "tls")]):
        run = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=60,
                             cwd=REPO)
        assert run.returncode == 3, (args, run.stderr)
        assert "pip install 'linkpass[coordinator]'" in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
