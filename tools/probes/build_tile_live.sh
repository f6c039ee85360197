#!/usr/bin/env bash
# Builds tools/probes/tile_live.cu into build/probes/libtile_live.so (on the CPU machine; the
# library travels to the GPU machine, where tools/probes/tile_live.py loads it with ctypes:
# tools/gpu_check.sh --canary / --live-waits / --tile-ref). The menu's CUTLASS instantiations and
# the runtime pieces are linked from the native build's objects (compiled with -fPIC for the
# extension module), so only this file compiles here: run the native build first
# (build/native, see README). Env: BUILD (default build/native), CUBLAS_ROOT (the nvidia-cublas
# wheel's cu13 dir).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-/work/buildenv/bin/python}
BUILD=${BUILD:-build/native}
CUBLAS_ROOT=${CUBLAS_ROOT:-$("$PY" -c "import nvidia, os; print(next(os.path.join(p, 'cu13') for p in nvidia.__path__ if os.path.exists(os.path.join(p, 'cu13', 'include', 'cublasLt.h'))))")}
OUT=build/probes
mkdir -p "$OUT/obj-tile_live"
obj=$BUILD/CMakeFiles/_native.dir/ffi
objs=("$obj"/kernels/tile_rs_e*_w*.cu.o "$obj"/kernels/tile_rs.cu.o "$obj"/kernels/comm.cu.o
      "$obj"/kernels/fill.cu.o "$obj"/kernels/ce.cu.o "$obj"/runtime/gemm.cc.o
      "$obj"/runtime/capture.cc.o "$obj"/runtime/tile_menu.cc.o "$obj"/runtime/memops.cc.o)
for o in "${objs[@]}"; do
  [[ -f $o ]] || { echo "missing $o: build the native extension first"; exit 1; }
done
NAME=${NAME:-libtile_live}
if [[ -n ${EXTRA_ENTRIES:-} ]]; then
  # Tools menu entries (tile_rs.cu, e.g. EXTRA_ENTRIES="6 9") beside the default five: compiled
  # here with -fPIC, and tile_rs.cu again with them in its menu (TILE_LIVE_ENTRY picks one).
  CUTLASS_INC=${CUTLASS_INC:-$("$PY" -c "import importlib.util as u, os; d = os.path.join(u.find_spec('cutlass_library').submodule_search_locations[0], 'source'); print(os.path.join(d, 'include') + ' ' + os.path.join(d, 'tools', 'util', 'include'))")}
  mask=31 X=$OUT/obj-$NAME
  mkdir -p "$X"
  for e in $EXTRA_ENTRIES; do mask=$((mask | (1 << e))); done
  F=(-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
     -Xcompiler -fPIC -Iffi "-I$CUBLAS_ROOT/include" "-DJAXOVERLAP_TILE_MENU_MASK=$mask")
  for d in $CUTLASS_INC; do F+=("-I$d"); done
  kept=()
  for o in "${objs[@]}"; do [[ $o == */kernels/tile_rs.cu.o ]] || kept+=("$o"); done
  objs=("${kept[@]}")
  for s in ffi/kernels/tile_rs.cu $(for e in $EXTRA_ENTRIES; do echo ffi/kernels/tile_rs_e"$e"_w*.cu; done); do
    nvcc "${F[@]}" -x cu -c "$s" -o "$X/$(basename "$s").o"
    objs+=("$X/$(basename "$s").o")
  done
fi
nvcc -std=c++17 -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Iffi \
  "-I$CUBLAS_ROOT/include" -x cu -c tools/probes/tile_live.cu -o "$OUT/obj-tile_live/tile_live.o"
nvcc -shared -gencode=arch=compute_90a,code=sm_90a "$OUT/obj-tile_live/tile_live.o" "${objs[@]}" \
  -L"$CUBLAS_ROOT/lib" -l:libcublasLt.so.13 -Xlinker --no-undefined -o "$OUT/$NAME.so"
echo "built $OUT/$NAME.so"
