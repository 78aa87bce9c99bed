#!/usr/bin/env bash
# OS packages the LinkPass agent and CLI need on a host: iproute2 (ip) and python3-venv.
# Nothing else: what only the tests, the testbed and the demo use is in
# install-test-deps.sh. Installs only what is missing; never starts, stops or reconfigures a service.
set -euo pipefail
need=()
command -v ip  >/dev/null 2>&1 || need+=(iproute2)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if ((${#need[@]} == 0)); then
    exit 0
fi
mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
if [[ $(id -u) -ne 0 ]]; then
    echo "missing OS packages: ${need[*]}; install them as root (apt-get install ${need[*]})" >&2
    exit 1
fi
echo "installing OS packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
