"""jaxoverlap: GEMM + collective ops for tensor-parallel JAX, fused on NVLink-connected Hopper GPUs.

Call the ops inside ``jax.shard_map``; each equals its lax composition (see `jaxoverlap.reference`)
and runs it wherever the fused GPU path cannot run (CPU, other GPUs, unsupported shapes).
`overlap` substitutes them into unchanged shard_map code; `matmul` picks them for global-view
jitted code. Importing this package never initialises CUDA.
"""

from jaxoverlap.config import Config
from jaxoverlap.ops import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from jaxoverlap.overlap import explain, overlap
from jaxoverlap.partitioning import matmul
from jaxoverlap.runtime import FusedCallError, check_errors

__version__ = "0.1.0"

__all__ = [
    "Config",
    "FusedCallError",
    "all_gather_matmul",
    "check_errors",
    "explain",
    "matmul",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "overlap",
]
