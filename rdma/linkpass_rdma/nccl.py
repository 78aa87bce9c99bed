"""Where the NCCL net plugin's build puts its parts (rdma/nccl/Makefile; `make deps` runs it):

- `plugin()`: libnccl-net-linkpass.so, what NCCL loads (NCCL_NET_PLUGIN; docs/nccl-plugin.md);
- `baseline()`: libnccl-net-single-tcp.so, one TCP connection per communicator as NCCL's Socket
  transport uses it: what the plugin is measured against;
- `allreduce()`: lp_allreduce, the ring all-reduce over N ranks that uses only the plugin API.

Each builds what is out of date first (make is a no-op otherwise) and raises NcclBuildMissing,
naming the fix, when it cannot.
"""
from __future__ import annotations

import os
import subprocess

NCCL_DIR = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "nccl"))
BUILD_DIR = os.path.join(NCCL_DIR, "build")


class NcclBuildMissing(RuntimeError):
    pass


def _built(name: str) -> str:
    path = os.path.join(BUILD_DIR, name)
    r = subprocess.run(["make", "-s", "-C", NCCL_DIR], capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(path):
        raise NcclBuildMissing(f"{path} is not built ({(r.stderr or r.stdout).strip()[-300:] or 'make made nothing'}); "
                               "run `make deps` (it needs gcc and make)")
    return path


def plugin() -> str:
    return _built("libnccl-net-linkpass.so")


def baseline() -> str:
    return _built("libnccl-net-single-tcp.so")


def allreduce() -> str:
    return _built("lp_allreduce")
