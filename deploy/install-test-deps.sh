#!/usr/bin/env bash
# OS packages only the tests, the namespace testbed, the benchmarks and the demo need — never
# install them on a production host:
#   nftables         the testbed's faults (drops, loss, rate limits on fabric links)
#   frr              bfdd, the BFD peer the failover benchmark and its tests measure LinkPass against
#   qemu-system-x86, debootstrap, zstd, cpio
#                    the testbed's Soft-RoCE hosts: QEMU guests whose image is built from Debian packages
#   libibverbs-dev   the verbs headers the NCCL plugin's queue-pair lanes are built against
#   gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user (on x86-64 hosts)
#                    the C readers of the entropy table and the NCCL plugin cross-built for aarch64
#                    (GH200/GB200 hosts) and run under qemu-user; no binfmt handler is registered
#   zsh, fish        the CLI's completion scripts are checked by the shells that run them
#   buildah          the agent's container image is built (on a Debian root made by debootstrap)
#                    and its agent run on the testbed
#   postgresql       the coordinator's PostgreSQL store: each test makes its own server in a
#                    temporary directory, runs it as the postgres user and removes it
# Installs only what is missing. A service is never stopped or reconfigured unless this script
# installed it in the same run: FRR, when installed here, is kept from starting while it is
# installed and then disabled, because LinkPass runs bfdd only inside testbed namespaces; the same
# for PostgreSQL, whose tests run servers of their own. An FRR or PostgreSQL that was already on
# the host is left exactly as it was.
set -euo pipefail
need=()
[[ -x /usr/lib/frr/bfdd ]] || need+=(frr)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v zstd >/dev/null 2>&1 || need+=(zstd)
command -v cpio >/dev/null 2>&1 || need+=(cpio)
[[ -f /usr/include/infiniband/verbs.h ]] || need+=(libibverbs-dev)
command -v zsh >/dev/null 2>&1 || need+=(zsh)
command -v fish >/dev/null 2>&1 || need+=(fish)
command -v buildah >/dev/null 2>&1 || need+=(buildah)
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need+=(postgresql)
if [[ $(uname -m) == x86_64 ]]; then
    command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || need+=(gcc-aarch64-linux-gnu)
    [[ -d /usr/aarch64-linux-gnu/include ]] || need+=(libc6-dev-arm64-cross)
    command -v qemu-aarch64 >/dev/null 2>&1 || need+=(qemu-user)
fi
if ((${#need[@]} == 0)); then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "missing OS packages for the tests: ${need[*]}; install them as root (apt-get install ${need[*]})" >&2
    exit 1
fi
installing_frr=false
[[ " ${need[*]} " == *" frr "* ]] && installing_frr=true
installing_pg=false
[[ " ${need[*]} " == *" postgresql "* ]] && installing_pg=true
policy=/usr/sbin/policy-rc.d
made_policy=false
if { $installing_frr || $installing_pg; } && [[ ! -e $policy ]]; then
    # policy-rc.d (invoke-rc.d's hook) answering 101 keeps the new package's daemons from starting
    printf '#!/bin/sh\n# written by LinkPass install-test-deps.sh for the length of one apt-get run\nexit 101\n' > "$policy"
    chmod 0755 "$policy"
    made_policy=true
    trap 'rm -f "$policy"' EXIT
fi
echo "installing OS packages for the tests: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
if $made_policy; then
    rm -f "$policy"
    trap - EXIT
fi
if $installing_frr && command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    # the unit this run installed (and only it): not enabled at boot, not running
    systemctl disable --now frr.service >/dev/null 2>&1 || true
    echo "installed FRR for the tests and left its service disabled (LinkPass runs bfdd in testbed namespaces only)"
fi
if $installing_pg && command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    systemctl disable --now postgresql.service >/dev/null 2>&1 || true
    echo "installed PostgreSQL for the tests and left its service disabled (the tests run servers of their own)"
fi
