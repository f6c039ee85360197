#!/usr/bin/env bash
# Builds tools/probes/tile_rs_probe.cu into build/probes/tile_rs_probe (on the CPU machine; the
# binary travels to the GPU machine, where tools/gpu_check.sh --tile-probe runs it).
#   CUTLASS_INC: the nvidia-cutlass wheel's include dirs (default: the build's, see CMakeLists)
#   CUBLAS_ROOT: the nvidia-cublas wheel's cu13 dir (headers + libcublasLt.so.13)
#   NAME, FLAGS: the binary's name and extra nvcc flags (a variant of the kernel, e.g.
#   NAME=tile_rs_probe_nolook FLAGS=-DJAXOVERLAP_TILE_SUM_LOOKAHEAD=0)
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
srcs=(ffi/kernels/tile_rs_e*_w*.cu ffi/kernels/tile_rs.cu ffi/kernels/comm.cu ffi/kernels/fill.cu
      ffi/runtime/gemm.cc ffi/runtime/capture.cc ffi/runtime/tile_menu.cc
      tools/probes/tile_rs_probe.cu)
# JOBS compilations at a time (default: the cores); an object newer than its source and the
# headers is kept (a rebuild after a probe-only change is quick).
JOBS=${JOBS:-$(nproc)}
newest=$(ls -t ffi/kernels/*.h ffi/kernels/*.cuh ffi/runtime/*.h | head -1)
for s in "${srcs[@]}"; do
  o="$OBJ/$(basename "$s").o"
  [[ -f $o && $o -nt $s && $o -nt $newest ]] && continue
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n; done
  nvcc "${F[@]}" -x cu -c "$s" -o "$o" &
done
while (($(jobs -rp | wc -l) > 0)); do wait -n || exit 1; done
nvcc -gencode=arch=compute_90a,code=sm_90a "$OBJ"/*.o -L"$CUBLAS_ROOT/lib" -l:libcublasLt.so.13 \
  -o "$OUT/$NAME"
echo "built $OUT/$NAME"
