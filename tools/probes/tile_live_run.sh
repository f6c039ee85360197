#!/usr/bin/env bash
# The tile probes with live ranks on one GPU, in one go (a batched device call or by hand):
# the race canary, the live waits and the reference table with XLA, then the paper columns.
#   ROOT: where tools/ and build/probes/libtile_live.so are (default: this checkout);
#   OUT: logs and JSON; BUDGET_S: seconds for all of it (default 150); CANARY=0: no canary;
#   LIVE_S: seconds for the live waits (default 3/10 of what the canary leaves).
set -u -o pipefail
ROOT=${ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}
OUT=${OUT:-$PWD/gpu_logs}
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-150}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
SHAPES=$OUT/shapes.txt
if [[ -f $ROOT/shapes.txt ]]; then cp "$ROOT/shapes.txt" "$SHAPES"
else "$PY" "$ROOT/tools/shapes.py" >"$SHAPES"; fi
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 1000 \
  >"$OUT/smi.csv" 2>&1 &
SMI=$!
rc=0
if [[ ${CANARY:-1} != 0 ]]; then
  timeout -k 3 $(($(left) < 30 ? $(left) : 30)) "$PY" "$ROOT/tools/probes/tile_live.py" canary \
    >"$OUT/canary.log" 2>&1 || rc=1
  tail -n 12 "$OUT/canary.log"
fi
l=${LIVE_S:-$(($(left) * 3 / 10))}
timeout -k 3 $((l + 15)) "$PY" "$ROOT/tools/probes/tile_live.py" live "$SHAPES" --deadline-s "$l" \
  --json "$OUT/live.json" >"$OUT/live.log" 2>&1 || rc=1
grep -E '^TILE|error|Error|GAVE' "$OUT/live.log" | tail -n 12
l=$(($(left) - 12))
timeout -k 3 $((l + 10)) "$PY" "$ROOT/tools/probes/tile_live.py" ref "$SHAPES" --sites \
  --judged-only --deadline-s "$l" --json "$OUT/ref.json" >"$OUT/ref.log" 2>&1 || rc=1
grep -E '^TILE|error|Error|deadline' "$OUT/ref.log" | tail -n 12
kill "$SMI" 2>/dev/null
[[ -f $OUT/ref.json ]] && "$PY" "$ROOT/tools/tile_paper.py" "$OUT/ref.json" >"$OUT/paper.log" 2>&1
[[ -f $OUT/paper.log ]] && grep -E "^LAYER|^TILE PAPER" "$OUT/paper.log"
echo "tile_live_run: rc $rc in $((SECONDS - T0)) s"
exit $rc
