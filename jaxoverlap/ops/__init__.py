"""One module per op family; importing this package registers the primitives' rules (the
primitives themselves: `jaxoverlap.ops.primitives`)."""

from jaxoverlap.ops import dgrad_rs_wgrad  # noqa: F401  (the column-parallel backward's rules)
from jaxoverlap.ops.all_gather_matmul import all_gather_matmul, all_gather_matmul_p
from jaxoverlap.ops.matmul_all_reduce import matmul_all_reduce, matmul_all_reduce_p
from jaxoverlap.ops.matmul_reduce_scatter import matmul_reduce_scatter, matmul_reduce_scatter_p

__all__ = [
    "all_gather_matmul",
    "all_gather_matmul_p",
    "matmul_all_reduce",
    "matmul_all_reduce_p",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_p",
]
