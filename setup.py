"""Build of the compiled probe core; everything else is declared in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("linkpass.probe._probecore", sources=["linkpass/probe/_probecore.c"],
                             depends=["linkpass/probe/probe_wire.h", "linkpass/probe/probe_rx.h"],
                             extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                                                 "-Wno-unused-parameter", "-Wno-cast-function-type"])])
