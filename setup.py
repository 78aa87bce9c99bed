"""Build of the compiled parts; everything else is declared in pyproject.toml.

- the probe core, a CPython extension (linkpass/probe/_probecore.c);
- a memory barrier for the entropy table's seqlock, a CPython extension (linkpass/kernel/_barrier.c);
- the NCCL net plugin and its harness (rdma/nccl/, plain C built by its own Makefile into
  rdma/nccl/build/libnccl-net-linkpass.so and rdma/nccl/build/lp_harness; docs/nccl-plugin.md).
"""
import os
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NCCL_DIR = Path(__file__).resolve().parent / "rdma" / "nccl"


class BuildExtAndPlugin(build_ext):
    """build_ext, then the NCCL plugin: `pip install` (and `make deps`) leave both built.

    The plugin is a separate library, not part of the wheel (the Debian package carries it):
    LINKPASS_SKIP_NCCL_PLUGIN=1 builds the probe core alone, for a wheel made on a host without the
    verbs headers."""

    def run(self):
        super().run()
        if os.environ.get("LINKPASS_SKIP_NCCL_PLUGIN") != "1" and (NCCL_DIR / "Makefile").exists():
            subprocess.run(["make", "-s", "-C", str(NCCL_DIR)], check=True)


setup(ext_modules=[Extension("linkpass.probe._probecore", sources=["linkpass/probe/_probecore.c"],
                             depends=["linkpass/probe/probe_wire.h", "linkpass/probe/blake2b.h", "linkpass/probe/probe_rx.h", "linkpass/probe/lane_watch.h"],
                             extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                                                 "-Wno-unused-parameter", "-Wno-cast-function-type"]),
                   # the entropy table's seqlock on weakly ordered CPUs (aarch64): a memory barrier
                   Extension("linkpass.kernel._barrier", sources=["linkpass/kernel/_barrier.c"],
                             depends=["linkpass/kernel/barrier.h"], extra_compile_args=["-O2", "-Wall", "-Wextra"])],
      cmdclass={"build_ext": BuildExtAndPlugin})
