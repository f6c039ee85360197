#!/usr/bin/env bash
# The one command for the GPU machine (2x H200): checks the carried native extension, runs the
# GPU tests, the op benchmarks and the CPU test suite, and prints the summary table LAST.
#
#   tools/gpu_check.sh [--quick] [--skip-tests] [--skip-bench] [--skip-cpu-tests] [--cpu-smoke]
#                      [--layer] [--stress] [--gemm-probe] [--tile-probe] [--sanitize[=TOOLS]]
#                      [--dw-probe] [--memory] [--canary] [--live-waits] [--tile-ref]
#                      [--tile-ncu]
#
# --quick: shorter benchmark samples, 2 SM counts; --skip-tests: no GPU tests; --skip-bench;
# --skip-cpu-tests; --cpu-smoke: benchmarks on 2 fake CPU devices (tries this script anywhere);
# --layer: also the transformer layer's train step (tuned first; tuning cache under $LOG);
# --stress: also tools/stress.py (10,000 fused calls of mixed shapes, every result checked; on one
# GPU: two processes sharing it, 10 call sites, tools/stress_xproc.py).
# --sanitize[=memcheck,racecheck,...]: also tools/sanitize.py (two processes, each under
# compute-sanitizer, every fused op; default all four tools; GPU_CHECK_SANITIZE_MODE=ops|train,
# GPU_CHECK_SANITIZE_ONLY=<cases>).
# --dw-probe: tools/probes/dw_layout_probe.py (the weight gradient's two layouts, one GPU).
# --memory: memory over 1,000 fresh call sites and 200 batch sizes (two processes; the workspace
# pool judged, the whole GPU and XLA reported).
# --gemm-probe: also tools/probes/gemm_search_probe.py (one GPU: the fused schedule's GEMM work
# against XLA's GEMM, cuBLASLt's first choice vs the best of its candidates).
# --tile-probe: also build/probes/tile_rs_probe (one GPU; built on the CPU machine by
# tools/probes/build_tile_rs_probe.sh and carried): the tile-fused GEMM + reduce-scatter's menu
# checked at 2, 4 and 8 ranks on one GPU against an f32 reference, and every entry's and the
# pick's time against cuBLASLt's on tools/shapes.py's shapes (GPU_CHECK_TILE_SEED=S: new draws).
# --tile-ncu: ncu --clock-control none of `tile_rs_probe prof` (one launch of cuBLASLt, then of
# every entry plain and prod) on the shapes GPU_CHECK_TILE_NCU="TP M K N;..." (default: the three
# worst pick plain/ref shapes of session 9, docs/measurements.md): the speed-of-light, warp-state
# and compute-workload sections per kernel, CSV under $OUT/tile-ncu-*.csv. GPU_CHECK_TILE_NCU_EPI=V:
# the entries with that epilogue variant (TILE_PROBE_PROF_EPI; 4: the ping-pong entries' tensor
# stores). GPU_CHECK_TILE_NCU_FULL=1: the first shape also with `--set full` (report
# $OUT/tile-ncu-full.ncu-rep, its details page and per-instruction SASS page with the warp-stall
# samples as CSV: where each kernel's issue slots and stalls go).
# --canary / --live-waits / --tile-ref: tools/probes/tile_live.py (one GPU; build/probes/
# libtile_live.so, built on the CPU machine by tools/probes/build_tile_live.sh, carried): the race
# canary (two in-process ranks, 10,000 calls each of the tile kernel, the comm kernel's two
# schedules and the copy-engine pushes, rank 1 late by 0/25/50 us), the live waits against two
# concurrent cuBLASLt GEMMs, the tile table's reference with XLA timed in the same rounds (and
# tools/tile_paper.py's t_comm/t_gemm, NVLink demand and run 21's layer budget).
# GPU_CHECK_LAYER_FLAGS: extra flags of the layer benchmark (e.g. "--fused-proj --sizes 8b").
# GPU_CHECK_TESTS_K: the one-GPU tests' -k expression (default "not bitwise and not
# other_shapes"; "other_shapes" alone: every op again at a second set of shapes).
#
# Run from a copy of the repository that carries jaxoverlap/_native*.so (built on the CPU
# machine). Logs, benchmark JSON/PNG/tables go to $OUT (else ./gpu_logs). Every step runs
# under `timeout`, and the whole script stays within GPU_CHECK_BUDGET_S seconds (default 530):
# a step that would not fit is skipped, never left to hang. Exit status: 0 if every step passed.
set -u -o pipefail
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG=${OUT:-$PWD/gpu_logs}
RESULTS="$LOG/results"
BUDGET=${GPU_CHECK_BUDGET_S:-530}
mkdir -p "$RESULTS"
rm -f "$RESULTS"/*.txt # the summary prints this run's tables only

BENCH_FLAGS=() TESTS=1 BENCH=1 CPU_TESTS=1 LAYER=0 STRESS=0 GEMM_PROBE=0 TILE_PROBE=0 SANITIZE=
DW_PROBE=0 MEMORY=0 LIVE=() TILE_NCU=0
for a in "$@"; do
  case $a in
    --quick) BENCH_FLAGS+=(--quick) ;;
    --cpu-smoke) BENCH_FLAGS+=(--cpu-smoke) ;;
    --skip-tests) TESTS=0 ;;
    --skip-bench) BENCH=0 ;;
    --skip-cpu-tests) CPU_TESTS=0 ;;
    --layer) LAYER=1 ;;
    --stress) STRESS=1 ;;
    --dw-probe) DW_PROBE=1 ;;
    --memory) MEMORY=1 ;;
    --gemm-probe) GEMM_PROBE=1 ;;
    --tile-probe) TILE_PROBE=1 ;;
    --tile-ncu) TILE_NCU=1 ;;
    --canary | --live-waits | --tile-ref) LIVE+=("${a#--}") ;;
    --sanitize) SANITIZE=memcheck,racecheck,synccheck,initcheck ;;
    --sanitize=*) SANITIZE=${a#--sanitize=} ;;
    -h | --help) sed -n 2,35p "$0"; exit 0 ;;
    *) echo "unknown flag: $a (see --help)"; exit 2 ;;
  esac
done

START=$SECONDS
FAILED=0
SUMMARY=()

# step NAME CAP_S CMD... : run CMD under timeout (the lesser of CAP_S and the budget left),
# log to $LOG/NAME.log, record one summary line; show the log's tail when the step fails.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START) - 5))
  local limit=$((cap < left ? cap : left))
  if ((limit < 15)); then
    SUMMARY+=("$(printf '%-12s %-16s %5s  %s' SKIPPED "$name" - "budget of ${BUDGET}s spent")")
    FAILED=1
    return
  fi
  local log="$LOG/$name.log" t0=$SECONDS rc status
  echo "== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=TIMEOUT ;;
    *) status="FAIL(rc=$rc)" ;;
  esac
  if [[ $status != ok ]]; then
    FAILED=1
    echo "-- $status; last lines of $log:"
    tail -n 30 "$log"
  fi
  # pytest's last line ("3 passed, 1 skipped in 9.1s"), a benchmark's headline, a check's
  # verdict; else the log's last line
  local detail
  detail=$(grep -E '[0-9]+ (passed|failed|errors?|skipped)|^geomean|^TMA with|^FAIL|check: OK|^TILE|^STRESS|^SANITIZE' \
    "$log" | tail -n 1)
  [[ -z $detail ]] && detail=$(grep -v '^\s*$' "$log" | tail -n 1)
  SUMMARY+=("$(printf '%-12s %-16s %4ss  %.110s' "$status" "$name" $((SECONDS - t0)) "$detail")")
  echo "   $status in $((SECONDS - t0))s"
}

# Optional pytest plugins (both are on the GPU image): a per-test timeout that names the stuck
# test and dumps its stacks, and parallel workers for the CPU suite.
TEST_TIMEOUT=() XDIST=()
"$PY" -c 'import pytest_timeout' 2>/dev/null && TEST_TIMEOUT=(--timeout=100 --timeout-method=thread)
"$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n 8)

step env 30 bash -c "date -u; nvidia-smi; nvidia-smi topo -m; $PY -c 'import jax, jaxlib; \
print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__); print(jax.devices())'"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if ((NGPU >= 2)); then
  step native 90 "$PY" tools/check_native.py
fi
if ((TESTS)); then
  # No preallocation: some tests start a second GPU process while pytest holds the GPUs.
  if ((NGPU >= 2)); then
    step gpu-tests 420 env JAXOVERLAP_REQUIRE_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
      "$PY" -m pytest tests/gpu -x -q -p no:cacheprovider "${TEST_TIMEOUT[@]}"
  else
    # One GPU: only what runs there -- two processes sharing it (tests/gpu/test_xproc_gpu.py:
    # every fused op and the training path with two ranks, time-sliced; no speed), the GEMM
    # search, the export's thread left without a CUDA context (test_device_context_gpu.py),
    # explain's verdicts against the compiled programs (test_explain_gpu.py), the order of a
    # device's fused calls (test_order_gpu.py, ~80 s: command buffers with the order token, the
    # inverted order's bounded deadlock, 1,000 runs under CONCURRENT), stream memory
    # operations and the copy-engine signal against a kernel holding every SM
    # (test_stream_memops_gpu.py) and command buffers re-recorded in one process only
    # (test_command_buffer_rerecord_gpu.py), and the reduce-push beside a kernel holding most SMs
    # (test_reduce_push_occupier_gpu.py, issue 26 R6). GPU_CHECK_TESTS_K=
    # "not bitwise" adds the second set of shapes (test_ops_across_processes_other_shapes).
    echo "one GPU: running the tests that one GPU can run (two processes sharing it, the GEMM search)"
    step gpu-tests-one-gpu "${GPU_CHECK_TESTS_S:-380}" env JAXOVERLAP_REQUIRE_GPU=1 \
      XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest tests/gpu/test_xproc_gpu.py \
      tests/gpu/test_gemm_search_gpu.py tests/gpu/test_device_context_gpu.py \
      tests/gpu/test_explain_gpu.py tests/gpu/test_order_gpu.py tests/gpu/test_stream_memops_gpu.py \
      tests/gpu/test_command_buffer_rerecord_gpu.py tests/gpu/test_reduce_push_occupier_gpu.py \
      -q -p no:cacheprovider -rA -k "${GPU_CHECK_TESTS_K:-not bitwise and not other_shapes}"
  fi
fi
if ((GEMM_PROBE)); then
  # One GPU suffices: the fused schedule's GEMM work (no communication) against XLA's GEMM, with
  # cuBLASLt's first choice and with the best of its candidates (ffi/runtime/gemm.h's search).
  step gemm-probe 200 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 "$PY" \
    tools/probes/gemm_search_probe.py --json "$RESULTS/gemm_search_probe.json"
fi
# The nvidia-cublas wheel's lib dir (libcublasLt.so.13 for the carried probe binaries).
cublas_lib() {
  "$PY" -c "import nvidia, os; print(next(os.path.join(p, 'cu13', 'lib') for p in nvidia.__path__ if os.path.exists(os.path.join(p, 'cu13', 'lib'))))" 2>/dev/null
}
if ((TILE_PROBE)); then
  CUBLAS_LIB=$(cublas_lib)
  # Shapes (tools/shapes.py): the project's 10 and 24 per-device shares of real layers, or with
  # GPU_CHECK_TILE_SEED=S only new random shares drawn with that seed.
  TILE_SHAPES="$LOG/tile-shapes.txt"
  "$PY" tools/shapes.py ${GPU_CHECK_TILE_SEED:+--seed "$GPU_CHECK_TILE_SEED"} >"$TILE_SHAPES"
  step tile-check 150 env LD_LIBRARY_PATH="$CUBLAS_LIB" build/probes/tile_rs_probe check
  # SM clock, power and temperature beside the timing (a throttled clock reads as a slow kernel)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 1000 \
    >"$LOG/tile-time-smi.csv" 2>&1 &
  SMI=$!
  # Every menu entry plain and solo, the pick chosen in a separate pass (empty cache) and timed
  # in the same fresh interleaved rounds; JSON rows per BENCHMARKS.md "One-GPU rows".
  step tile-time 300 env LD_LIBRARY_PATH="$CUBLAS_LIB" build/probes/tile_rs_probe time \
    "$TILE_SHAPES" --pick --json "$RESULTS/matmul_reduce_scatter_1xH200.json"
  for variant in build/probes/tile_rs_probe_*; do  # kernel variants, if built (NAME=...)
    [[ -x $variant ]] && step "$(basename "$variant")" 150 env LD_LIBRARY_PATH="$CUBLAS_LIB" \
      "$variant" time "$TILE_SHAPES"
  done
  kill "$SMI" 2>/dev/null
fi
if ((TILE_NCU)); then
  CUBLAS_LIB=$(cublas_lib)
  IFS=';' read -r -a NCU_SHAPES <<<"${GPU_CHECK_TILE_NCU:-4 12288 1280 5120;2 14336 2048 4096;8 16384 1792 4096}"
  NCU_ENV=(env LD_LIBRARY_PATH="$CUBLAS_LIB" TILE_PROBE_PROF_EPI="${GPU_CHECK_TILE_NCU_EPI:-0}")
  for shape in "${NCU_SHAPES[@]}"; do
    read -r tp m k n <<<"$shape"
    step "tile-ncu-${tp}x${m}x${k}x${n}" 150 "${NCU_ENV[@]}" ncu \
      --clock-control none --profile-from-start off --csv --section SpeedOfLight \
      --section WarpStateStats --section ComputeWorkloadAnalysis --section LaunchStats \
      --section SchedulerStats --section InstructionStats \
      --log-file "$LOG/tile-ncu-${tp}x${m}x${k}x${n}.csv" \
      build/probes/tile_rs_probe prof "$tp" "$m" "$k" "$n"
  done
  if [[ ${GPU_CHECK_TILE_NCU_FULL:-0} == 1 ]]; then
    read -r tp m k n <<<"${NCU_SHAPES[0]}"
    REP="$LOG/tile-ncu-full"
    step tile-ncu-full 240 "${NCU_ENV[@]}" ncu --clock-control none --profile-from-start off \
      --set full --import-source no -f -o "$REP" build/probes/tile_rs_probe prof "$tp" "$m" "$k" "$n"
    [[ -f $REP.ncu-rep ]] && ncu -i "$REP.ncu-rep" --page details --csv >"$REP-details.csv" 2>&1
    [[ -f $REP.ncu-rep ]] && ncu -i "$REP.ncu-rep" --page source --print-source sass --csv \
      >"$REP-sass.csv" 2>&1
  fi
fi
for what in "${LIVE[@]}"; do  # tools/probes/tile_live.py: live ranks of the tile kernel, one GPU
  TILE_SHAPES="$LOG/tile-shapes.txt"
  "$PY" tools/shapes.py ${GPU_CHECK_TILE_SEED:+--seed "$GPU_CHECK_TILE_SEED"} >"$TILE_SHAPES"
  case $what in
    canary) step tile-canary 120 "$PY" tools/probes/tile_live.py canary ;;
    live-waits) step tile-live 240 "$PY" tools/probes/tile_live.py live "$TILE_SHAPES" \
      --deadline-s 200 --json "$RESULTS/tile_live_1xH200.json" ;;
    tile-ref)
      REF_JSON="$RESULTS/matmul_reduce_scatter_ref_1xH200.json"
      step tile-ref 300 env XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" tools/probes/tile_live.py \
        ref "$TILE_SHAPES" --sites --judged-only --deadline-s 250 --json "$REF_JSON"
      [[ -f $REF_JSON ]] && "$PY" tools/tile_paper.py "$REF_JSON" >"$LOG/tile-paper.log" &&
        grep '^LAYER' "$LOG/tile-paper.log" ;;
  esac
done
if ((NGPU < 2 && STRESS)); then
  # Two processes sharing the GPU: every call site's protocol with a real second rank (kernels
  # time-slice: endurance and correctness, no speed).
  step stress-xproc 420 "$PY" tools/stress.py --processes 2 --deadline-s 400
  STRESS=0
fi
if ((DW_PROBE)); then
  # One GPU: the weight gradient's two layouts of the same dot, precision and time (issue 27).
  step dw-probe 120 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 "$PY" tools/probes/dw_layout_probe.py
fi
if ((MEMORY)); then
  # Memory as call sites multiply (two processes; tools/stress_xproc.py memory_worker): issue
  # 25's scale, 1,000 fresh jit call sites over 4 shapes, then 200 batch sizes. Reported: the
  # whole GPU, XLA's allocator and jaxoverlap's workspace pool per process; judged: the pool
  # (unchanged over the fresh sites; one workspace per new size class at exactly its bytes,
  # under the cap of docs/workspaces.md); every call's values checked.
  # GPU_CHECK_MEMORY=FRESH,SIZES[,MIB] (MIB: also a bound on the pool's growth per process).
  # Not timed alone yet: 119 s beside 14 sanitizer runs (issue 25, call D), ~60-75 s expected.
  step memory 200 "$PY" tools/stress.py --processes 2 --memory "${GPU_CHECK_MEMORY:-1000,200}" \
    --deadline-s 190
fi
if [[ -n $SANITIZE ]]; then
  # GPU_CHECK_SANITIZE_ONLY: the worker's cases (sanitize.py --only, e.g. "row_parallel").
  step sanitize 560 "$PY" tools/sanitize.py --tools "$SANITIZE" --out "$LOG" \
    --mode "${GPU_CHECK_SANITIZE_MODE:-ops}" --deadline-s "${GPU_CHECK_SANITIZE_TOOL_S:-240}" \
    ${GPU_CHECK_SANITIZE_ONLY:+--only "$GPU_CHECK_SANITIZE_ONLY"}
fi
if ((NGPU < 2 && (BENCH || LAYER))); then
  echo "one GPU: benchmarks and the layer need two GPUs; skipped"
  BENCH=0 LAYER=0
fi
if ((BENCH)); then
  step bench-gemm-rs 180 "$PY" benchmarks/matmul_reduce_scatter.py --out "$RESULTS" \
    --windowed-timeout 80 "${BENCH_FLAGS[@]}"
  step bench-rs-bw 80 "$PY" benchmarks/rs_bandwidth.py --out "$RESULTS" "${BENCH_FLAGS[@]}"
  step bench-ag-gemm 150 "$PY" benchmarks/all_gather_matmul.py --out "$RESULTS" "${BENCH_FLAGS[@]}"
  step bench-gemm-ar 120 "$PY" benchmarks/matmul_all_reduce.py --out "$RESULTS" "${BENCH_FLAGS[@]}"
  # Issue 11: the fused call with its group over 2 processes (1 GPU each) and over 1 process.
  step bench-processes-2 150 env XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m jaxoverlap.launch \
    -n 2 --devices-per-process 1 --timeout 140 benchmarks/processes.py --out "$RESULTS" \
    "${BENCH_FLAGS[@]}"
  step bench-processes-1 120 "$PY" benchmarks/processes.py --out "$RESULTS" "${BENCH_FLAGS[@]}"
fi
if ((STRESS)); then
  step stress 200 env XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" tools/stress.py
fi
if ((LAYER)); then
  read -r -a LAYER_FLAGS <<<"${GPU_CHECK_LAYER_FLAGS:-}"
  step bench-layer 300 env XDG_CACHE_HOME="$LOG/cache" "$PY" benchmarks/transformer_layer.py \
    --tune --out "$RESULTS" "${BENCH_FLAGS[@]}" "${LAYER_FLAGS[@]}"
fi
if ((CPU_TESTS)); then
  # The CI suite on 8 fake CPU devices (JAX_PLATFORMS=cpu, as in CI): it expects CPU devices.
  step cpu-tests 240 env JAX_PLATFORMS=cpu "$PY" -m pytest tests -x -q -p no:cacheprovider \
    --ignore=tests/gpu "${TEST_TIMEOUT[@]}" "${XDIST[@]}"
fi

echo
echo "================================ SUMMARY ($((SECONDS - START))s; logs in $LOG)"
printf '%-12s %-16s %5s  %s\n' status step time detail
printf '%s\n' "${SUMMARY[@]}"
for t in "$RESULTS"/*.txt; do
  [[ -f $t ]] && { echo; cat "$t"; }
done
echo
if ((FAILED)); then echo "GPU CHECK: FAILED"; else echo "GPU CHECK: PASSED"; fi
exit $FAILED
