#!/usr/bin/env bash
# OS packages LinkPass and its tests need: iproute2 (ip netns), nftables (faults, later the
# agent's own rules), python3-venv, frr (bfdd, the BFD peer in benchmarks and tests), and for
# the testbed's Soft-RoCE guests qemu-system-x86, debootstrap, zstd and cpio, and libibverbs-dev
# to build the NCCL plugin's verbs lanes.
# Idempotent: installs only what is missing.
set -euo pipefail
need=()
command -v ip  >/dev/null 2>&1 || need+=(iproute2)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v tc  >/dev/null 2>&1 || need+=(iproute2)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# FRR's bfdd: the BFD peer the failover benchmark and its tests measure LinkPass against
[[ -x /usr/lib/frr/bfdd ]] || need+=(frr)
# the testbed's Soft-RoCE hosts: QEMU guests (TCG) whose image is built from Debian packages
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v zstd >/dev/null 2>&1 || need+=(zstd)
command -v cpio >/dev/null 2>&1 || need+=(cpio)
# the NCCL plugin's verbs lanes are built against the verbs headers (libibverbs itself is loaded at run time)
[[ -f /usr/include/infiniband/verbs.h ]] || need+=(libibverbs-dev)
if ((${#need[@]} == 0)); then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "missing OS packages: ${need[*]}; install them as root (apt-get install ${need[*]})" >&2
    exit 1
fi
echo "installing OS packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# LinkPass runs bfdd only inside testbed namespaces; never let a packaged FRR run in the root one
if command -v systemctl >/dev/null 2>&1; then systemctl disable --now frr >/dev/null 2>&1 || true; fi
