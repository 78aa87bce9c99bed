#!/usr/bin/env bash
# The LinkPass net plugin under real NCCL on one GPU (docs/nccl-plugin.md, "Running under real
# NCCL on a GPU"): builds the plugin, probes the host, runs two torch.distributed NCCL ranks on
# cuda:0 over LinkPass and over NCCL's Socket net (1, 16, 256 MiB all-reduce; a plane's lanes
# killed mid-loop), and writes OUT_DIR/gpu_nccl.json, OUT_DIR/nccl-plugin-lines.txt and logs.
#
#   rdma/nccl/gpu/run.sh OUT_DIR [--dry-run] [--python PY] [--limit-s S] [--cpu-selftest]
#
#   --python PY      the Python with torch (default /opt/torch/.venv/bin/python)
#   --dry-run        check the tools, build the plugin, check and print the plan; no GPU, no torch
#   --limit-s S      the whole run, build included, ends within S seconds (default 420)
#   --cpu-selftest   check the driver itself on a CPU: gloo ranks instead of NCCL (needs torch, no GPU)
#
# Exit: 0 the LinkPass phase ran (the JSON says what happened), 1 it did not, 2 usage or plan,
# 3 a tool or the build is missing, 124 the time limit cut the run.
set -euo pipefail

usage() { sed -n '7,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

OUT=""
DRY=0
PY=/opt/torch/.venv/bin/python
LIMIT=420
SELFTEST=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --cpu-selftest) SELFTEST=(--cpu-selftest) ;;
        --python) [ $# -ge 2 ] || usage; PY="$2"; shift ;;
        --limit-s) [ $# -ge 2 ] || usage; LIMIT="$2"; shift ;;
        -h|--help) usage ;;
        -*) echo "run.sh: unknown option $1" >&2; usage ;;
        *) [ -z "$OUT" ] || usage; OUT="$1" ;;
    esac
    shift
done
[ -n "$OUT" ] || usage
case "$LIMIT" in ''|*[!0-9]*) echo "run.sh: --limit-s wants whole seconds" >&2; exit 2 ;; esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
DRIVER="$HERE/gpu_nccl.py"
SO="$ROOT/rdma/nccl/build/libnccl-net-linkpass.so"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
START=$SECONDS

missing=0
for tool in make cc timeout; do
    command -v "$tool" >/dev/null 2>&1 || { echo "run.sh: $tool is needed and not found" >&2; missing=1; }
done
for tool in ss ip nvidia-smi nm; do
    command -v "$tool" >/dev/null 2>&1 || echo "run.sh: note: $tool not found (recorded; the run goes on)" >&2
done
case "$PY" in
    */*) [ -x "$PY" ] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;;  # absolute, symlink kept (a venv)
    *) PY="$(command -v "$PY" || echo "$PY")" ;;
esac
if [ ! -x "$PY" ]; then echo "run.sh: no Python at $PY (--python)" >&2; missing=1; fi
[ "$missing" = 0 ] || exit 3

echo "== build: make -s -C rdma/nccl"
timeout 200 make -s -C "$ROOT/rdma/nccl" > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log" >&2; echo "run.sh: build failed" >&2; exit 3; }
[ -f "$SO" ] || { echo "run.sh: $SO was not built" >&2; exit 3; }
if command -v nm >/dev/null 2>&1; then
    echo "   $SO exports: $(nm -D --defined-only "$SO" | grep -o 'ncclNetPlugin_v[0-9]*' | sort -V | tr '\n' ' ')"
fi

if [ "$DRY" = 1 ]; then
    echo "== dry run: the plan (nothing is started; no GPU, no torch)"
    exec "$PY" "$DRIVER" plan --out "$OUT" --plugin "$SO" --python "$PY" --budget-s $((LIMIT - 10)) --dry-run
fi

LEFT=$((LIMIT - (SECONDS - START)))
if [ "$LEFT" -lt 120 ]; then echo "run.sh: only ${LEFT}s left after the build" >&2; exit 124; fi
# the driver gets the time left less a margin; timeout ends it (and its ranks' sessions get SIGKILL
# from the driver's own limits before that)
BUDGET=$((LEFT - 10))
echo "== run: $PY $DRIVER run (budget ${BUDGET}s, hard limit ${LEFT}s)"
rc=0
timeout -k 5 "$LEFT" "$PY" "$DRIVER" run --out "$OUT" --plugin "$SO" --budget-s "$BUDGET" "${SELFTEST[@]}" || rc=$?
echo "== done in $((SECONDS - START))s, exit $rc: $OUT/gpu_nccl.json, $OUT/nccl-plugin-lines.txt, $OUT/logs/"
exit "$rc"
