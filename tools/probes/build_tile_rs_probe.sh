#!/usr/bin/env bash
# Builds tools/probes/tile_rs_probe.cu into build/probes/tile_rs_probe (on the CPU machine; the
# binary travels to the GPU machine, where tools/gpu_check.sh --tile-probe runs it).
#   CUTLASS_INC: the nvidia-cutlass wheel's include dirs (default: the build's, see CMakeLists)
#   CUBLAS_ROOT: the nvidia-cublas wheel's cu13 dir (headers + libcublasLt.so.13)
#   NAME, FLAGS: the binary's name and extra nvcc flags (a variant of the kernel, e.g.
#   NAME=tile_rs_probe_poll FLAGS=-DJAXOVERLAP_TILE_RING_SLEEP_NS=0)
#   ENTRIES: the menu entries compiled in, e.g. ENTRIES="1 3 4" (default: all; entry k of the
#   default menu, ffi/kernels/tile_rs.cu; the probe's menu is then those, in that order): a
#   quicker build while iterating on one or two entries (each is two ~1-2 min instantiations)
#   STOCK=1: also build/probes/tile_stock_probe (tools/probes/tile_stock_probe.cu: stock CUTLASS
#   GEMMs, tools/probes/stock/stock_*.cu and hyb*.cu, one ~1-2 min instantiation each, against the
#   menu as plain GEMMs and cuBLASLt; linked with the same objects); with NOHYB=1 the stock
#   kernels only (no hybrids or scheduler variants, which recompile with our headers)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
CUBLAS_ROOT=${CUBLAS_ROOT:-$("$PY" -c "import nvidia, os; print(next(os.path.join(p, 'cu13') for p in nvidia.__path__ if os.path.exists(os.path.join(p, 'cu13', 'include', 'cublasLt.h'))))")}
CUTLASS_INC=${CUTLASS_INC:-$("$PY" -c "import importlib.util as u, os; d = os.path.join(u.find_spec('cutlass_library').submodule_search_locations[0], 'source'); print(os.path.join(d, 'include') + ' ' + os.path.join(d, 'tools', 'util', 'include'))")}
OUT=build/probes
NAME=${NAME:-tile_rs_probe}
OBJ=$OUT/obj-$NAME
mkdir -p "$OBJ"
F=(-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Iffi
   "-I$CUBLAS_ROOT/include" ${FLAGS:-})
for d in $CUTLASS_INC; do F+=("-I$d"); done
if [[ -n ${ENTRIES:-} ]]; then
  mask=0 entry_srcs=()
  for e in $ENTRIES; do
    mask=$((mask | (1 << e)))
    entry_srcs+=(ffi/kernels/tile_rs_e"$e"_w*.cu)
  done
  F+=("-DJAXOVERLAP_TILE_MENU_MASK=$mask")
else
  entry_srcs=(ffi/kernels/tile_rs_e*_w*.cu)
fi
# Objects are kept per NAME: a change of FLAGS or ENTRIES recompiles them all.
if [[ "$(cat "$OBJ/flags" 2>/dev/null)" != "${F[*]}" ]]; then
  rm -f "$OBJ"/*.o
  echo "${F[*]}" >"$OBJ/flags"
fi
srcs=("${entry_srcs[@]}" ffi/kernels/tile_rs.cu ffi/kernels/comm.cu ffi/kernels/fill.cu
      ffi/runtime/gemm.cc ffi/runtime/capture.cc ffi/runtime/tile_menu.cc
      tools/probes/tile_rs_probe.cu)
# JOBS compilations at a time (default: the cores); an object newer than its source and the
# headers is kept (a rebuild after a probe-only change is quick).
JOBS=${JOBS:-$(nproc)}
newest=$(ls -t ffi/kernels/*.h ffi/kernels/*.cuh ffi/runtime/*.h "$0" | head -1)
for s in "${srcs[@]}"; do
  o="$OBJ/$(basename "$s").o"
  [[ -f $o && $o -nt $s && $o -nt $newest ]] && continue
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n; done
  nvcc "${F[@]}" -x cu -c "$s" -o "$o" &
done
while (($(jobs -rp | wc -l) > 0)); do wait -n || exit 1; done
objs=()
for s in "${srcs[@]}"; do objs+=("$OBJ/$(basename "$s").o"); done
nvcc -gencode=arch=compute_90a,code=sm_90a "${objs[@]}" -L"$CUBLAS_ROOT/lib" -l:libcublasLt.so.13 \
  -o "$OUT/$NAME"
echo "built $OUT/$NAME"
if [[ -n ${STOCK:-} ]]; then
  SOBJ=$OUT/obj-stock
  mkdir -p "$SOBJ"
  # stock_*.cu include only CUTLASS and tools/probes/stock's headers; the hybrids and the probe
  # the kernels' too
  snewest=$(ls -t tools/probes/stock/*.h tools/probes/stock/*.cuh | head -1)
  hnewest=$(ls -t "$snewest" "$newest" | head -1)
  ssrcs=(tools/probes/stock/stock_*.cu tools/probes/stock/hyb*.cu tools/probes/tile_stock_probe.cu)
  SF=()
  if [[ -n ${NOHYB:-} ]]; then
    ssrcs=(tools/probes/stock/stock_*.cu tools/probes/tile_stock_probe.cu)
    SF=(-DJAXOVERLAP_STOCK_NO_HYBRIDS)
  fi
  # the probe's object follows NOHYB (its variant list)
  if [[ "$(cat "$SOBJ/flags" 2>/dev/null)" != "${SF[*]:-}" ]]; then
    rm -f "$SOBJ/tile_stock_probe.cu.o"
    echo "${SF[*]:-}" >"$SOBJ/flags"
  fi
  for s in "${ssrcs[@]}"; do
    o="$SOBJ/$(basename "$s").o"
    dep=$hnewest
    [[ $s == */stock_*.cu ]] && dep=$snewest
    [[ -f $o && $o -nt $s && $o -nt $dep ]] && continue
    while (($(jobs -rp | wc -l) >= JOBS)); do wait -n; done
    nvcc "${F[@]}" ${SF[@]+"${SF[@]}"} -Itools/probes -x cu -c "$s" -o "$o" &
  done
  while (($(jobs -rp | wc -l) > 0)); do wait -n || exit 1; done
  sobjs=()
  for s in "${ssrcs[@]}"; do sobjs+=("$SOBJ/$(basename "$s").o"); done
  for o in "${objs[@]}"; do [[ $o == */tile_rs_probe.cu.o ]] || sobjs+=("$o"); done
  nvcc -gencode=arch=compute_90a,code=sm_90a "${sobjs[@]}" -L"$CUBLAS_ROOT/lib" \
    -l:libcublasLt.so.13 -o "$OUT/tile_stock_probe"
  echo "built $OUT/tile_stock_probe"
fi
