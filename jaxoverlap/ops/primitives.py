"""Every primitive of the op families, declared in one place; each op module registers its own
rules (abstract eval, lowering, autodiff, batching) on them.

Declared here, not in the op modules, because the ops' transposes bind each other's primitives
(dx of ``all_gather_matmul`` is a ``matmul_reduce_scatter`` and the other way round; the
column-parallel backward is `dgrad_rs_wgrad_p`): with the primitives below the op modules, each
op module imports only downward. The names are the ones jaxprs show (and
``jaxoverlap.tune.shapes_of`` and ``explain`` read); they do not change.
"""

from __future__ import annotations

from jax._src import core

matmul_reduce_scatter_p = core.Primitive("matmul_reduce_scatter")
# The op's tangent when both x and w carry one, ``psum_scatter(dx @ w + x @ dw)``, as a linear
# primitive of (dx, dw) so that its transpose can gather the cotangent once, fused with dx's
# matmul, and hand the gathered cotangent to dW. Internal.
matmul_reduce_scatter_tangent_p = core.Primitive("matmul_reduce_scatter_tangent")

all_gather_matmul_p = core.Primitive("all_gather_matmul")
# The variant that also returns the gathered x: the forward of a layer whose weight is trained
# (dW = gathered^T @ ct needs it, as plain JAX keeps its all_gather's result), the backward of
# matmul_reduce_scatter (ct gathered once for dx and dW), and all_gather_matmul with several
# weights (the others multiply the gathered x). Internal.
all_gather_matmul_keep_p = core.Primitive("all_gather_matmul_keep")
all_gather_matmul_keep_p.multiple_results = True
# The tangent ``all_gather(dx) @ w + g @ dw`` (g: the gathered x; the second term only
# ``with_dw``) -- and, ``with_gathered``, ``all_gather(dx)`` itself -- as a linear primitive of
# (dx[, dw]) with operands (dx, [dw,] g, w): its transpose gathers nothing and scatters dx's
# cotangent once; with dw, in one op with dW's GEMM, so the collective hides behind it. Internal.
all_gather_matmul_tangent_p = core.Primitive("all_gather_matmul_tangent")
all_gather_matmul_tangent_p.multiple_results = True

matmul_all_reduce_p = core.Primitive("matmul_all_reduce")

# The column-parallel backward: dx = psum_scatter(ct @ w.T) beside dW = all_gather(x).T @ ct.
dgrad_rs_wgrad_p = core.Primitive("all_gather_matmul_backward")
dgrad_rs_wgrad_p.multiple_results = True
