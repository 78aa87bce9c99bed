# The two commands a new user needs (as root, on a fresh machine):
#   make demo   - the main job on the embedded default
#   make test   - the layer contracts, then the whole test suite
# Both install what they need first, idempotently: OS packages, then a .venv with the project.
# That environment is for development (tests, demo, benchmarks): it carries FRR, QEMU, torch and
# Ray. A production host gets the wheel or the Debian package instead (`make wheel`, `make deb`;
# docs/install.md), with the agent's few dependencies only.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
# the stamp names a checksum of everything the install builds from, so a change to the C core rebuilds it
BUILD_INPUTS := pyproject.toml setup.py deploy/install-os-deps.sh deploy/install-test-deps.sh linkpass/probe/_probecore.c \
                linkpass/probe/probe_wire.h linkpass/probe/blake2b.h linkpass/probe/probe_rx.h linkpass/probe/lane_watch.h linkpass/kernel/_barrier.c linkpass/kernel/barrier.h \
                rdma/entropy_table.h \
                $(wildcard rdma/nccl/*.c rdma/nccl/*.h) rdma/nccl/Makefile
STAMP := $(VENV)/.installed-$(shell cat $(BUILD_INPUTS) 2>/dev/null | cksum | cut -d' ' -f1)

.PHONY: demo test test-unit lint-imports bench deps nccl-plugin prometheus wheel deb image clean

# exit 1 = the job was unharmed but a timing target was missed on this machine: reported, not a failure.
# DEMO_ARGS: more `linkpass demo` options, e.g. make demo DEMO_ARGS="--faults uplink-cut"
demo: deps prometheus
	$(VENV)/bin/linkpass demo --compare $(DEMO_ARGS) || [ $$? -eq 1 ]

# the layer contracts first (pyproject.toml [tool.importlinter]), then every test of every tier
test: lint-imports prometheus
	$(PY) -m pytest -q

# the unit tier, tests/unit: no root, no service (tests/conftest.py defines the tiers)
test-unit: deps prometheus
	$(PY) -m pytest -q tests/unit

lint-imports: deps
	$(VENV)/bin/lint-imports --no-logo --no-cache

# every benchmark: the lab's (bench/: testbed, agents, C core, coordinator, plugin) and the simulator's (sim/bench/)
bench: deps
	@mkdir -p out
	for b in bench/*.py sim/bench/*.py; do $(PY) $$b --json out/bench-$$(basename $$b .py).json || exit 1; done

deps: $(STAMP) nccl-plugin

# Prometheus and promtool for the demo and the tests: Debian's package unpacked into a private
# folder (deploy/install-prometheus.sh), no service installed; a no-op once there
prometheus:
	@bash deploy/install-prometheus.sh >/dev/null

# the NCCL net plugin: rdma/nccl/build/libnccl-net-linkpass.so (+ its harness); a no-op when up to date
nccl-plugin: $(STAMP)
	@$(MAKE) -s -C rdma/nccl

$(STAMP): $(BUILD_INPUTS)
	@bash deploy/install-os-deps.sh
	@bash deploy/install-test-deps.sh
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "installing Python packages into $(VENV) (first time: ~2 min, torch's CPU build is ~1 GB)"
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[test,demo,sim]'
	@rm -f $(VENV)/.installed-* && touch $@

# the wheel (the probe core compiled, manylinux-tagged by auditwheel) into dist/
wheel: deps
	@$(PY) deploy/package.py wheel --out dist

# the Debian package (a venv under /opt/linkpass, the units, sysctl.d, examples, docs) into dist/
deb: deps
	@$(PY) deploy/package.py deb --out dist

# the agent's container image (buildah, on a Debian 12 root bootstrapped here: no registry needed)
image: deps
	@$(PY) deploy/package.py image --target agent

# remove leftovers of crashed testbeds (every prefix), then the venv
clean:
	-@test -x $(VENV)/bin/linkpass && $(VENV)/bin/linkpass testbed clean --all
	rm -rf $(VENV) out dist .pytest_cache
