"""Layout and packaging promises: console script, lazy pyverbs, import names."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_console_script_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "linkpass.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "testbed" in out.stdout and "demo" in out.stdout


def test_version_flag():
    from linkpass import __version__

    out = subprocess.run([sys.executable, "-m", "linkpass.cli", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"linkpass {__version__}"


def test_importing_linkpass_does_not_import_pyverbs_or_ray():
    code = "import linkpass.cli, linkpass.testbed.cli, linkpass_rdma, sys; print('pyverbs' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_missing_pyverbs_says_how_to_install(tmp_path, monkeypatch):
    from linkpass.kernel import rdma as verbs

    monkeypatch.delitem(sys.modules, "pyverbs", raising=False)
    monkeypatch.setattr(importlib, "import_module", _fail_pyverbs(importlib.import_module))
    with pytest.raises(verbs.RdmaUnavailable, match="apt-get install python3-pyverbs"):
        verbs.load_pyverbs(search_dirs=(str(tmp_path),))


def test_system_pyverbs_is_loaded_alone_from_its_directory(tmp_path, monkeypatch):
    """A pyverbs package in a system directory is found without putting that directory on sys.path."""
    from linkpass.kernel import rdma as verbs

    pkg = tmp_path / "pyverbs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("MARK = 'system'\n")
    (pkg / "device.py").write_text("def get_device_list():\n    raise RuntimeError('Failed to get devices list')\n")
    (tmp_path / "unrelated_pkg.py").write_text("X = 1\n")
    monkeypatch.delitem(sys.modules, "pyverbs", raising=False)
    monkeypatch.setattr(importlib, "import_module", _fail_pyverbs(importlib.import_module))
    try:
        mod = verbs.load_pyverbs(search_dirs=(str(tmp_path / "none"), str(tmp_path)))
        assert mod.MARK == "system" and str(tmp_path) not in sys.path
        with pytest.raises(verbs.RdmaUnavailable, match="no RDMA devices: Failed to get devices list"):
            verbs.device_names()
    finally:
        for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
            del sys.modules[name]


def _fail_pyverbs(real):
    """importlib.import_module as in a venv without pyverbs (submodules resolve normally)."""
    def import_module(name, *a, **k):
        if name == "pyverbs":
            raise ImportError("no pyverbs in this venv")
        return real(name, *a, **k)

    return import_module
