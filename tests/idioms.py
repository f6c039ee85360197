"""Small tensor-parallel layers written the way six public sources write them (our own snippets,
not their code), for tests/test_explain_idioms.py and docs/will-my-model-fuse.md.

Each ``IDIOMS[name]()`` returns ``(f, args)``: a ``jax.shard_map`` over a 2-device ``tp`` mesh
(the shard_map tutorial's over ``dp`` x ``tp``, 4 devices) and ``jax.ShapeDtypeStruct``
arguments at layer sizes where ``backend="auto"``'s untuned rule can pick the fused kernels.
Nothing is computed: the tests trace, explain and lower them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BF16 = jnp.bfloat16
S, D, F = 4096, 4096, 8192  # tokens per step, model width, MLP width


def _mesh(shape, names):
    n = int(np.prod(shape))
    return Mesh(
        np.array(jax.devices()[:n]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape)
    )


def _args(mesh, specs, shapes, dtypes):
    return [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p))
            for s, d, p in zip(shapes, dtypes, specs, strict=True)]  # fmt: skip


def _sm(body, mesh, in_specs, out_specs):
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def rms(h, scale, eps=1e-6):
    hf = h.astype(jnp.float32)
    hf = hf * lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    return (hf * scale.astype(jnp.float32)).astype(h.dtype)


def shard_map_tutorial():
    """FSDP over ``dp`` and tensor parallelism over ``tp`` (the shard_map tutorial's pattern):
    weights and biases gathered over ``dp`` (FSDP), activations sharded over features, each
    layer ``psum_scatter(x @ w + b)`` over ``tp`` along the features."""
    mesh = _mesh((2, 2), ("dp", "tp"))
    specs = (P("dp", "tp"), P("tp", "dp"), P("dp"))

    def layer(x, w, b):
        w = lax.all_gather(w, "dp", axis=1, tiled=True)  # FSDP: out of scope (a weight)
        b = lax.all_gather(b, "dp", tiled=True)  # a gathered bias: not a candidate
        return lax.psum_scatter(x @ w + b, "tp", scatter_dimension=1, tiled=True)

    f = _sm(layer, mesh, specs, P("dp", "tp"))
    return f, _args(mesh, specs, [(S, D), (D, D), (D,)], [BF16] * 3)


def scaling_book():
    """The scaling book's collective matmuls: an MLP with x sequence-sharded, gathered into the
    up projection, and the down projection's result reduce-scattered over the sequence."""
    mesh = _mesh((2,), ("tp",))
    specs = (P("tp", None), P(None, "tp"), P("tp", None))

    def mlp(x, w_in, w_out):
        h = lax.all_gather(x, "tp", axis=0, tiled=True) @ w_in
        return lax.psum_scatter(jax.nn.gelu(h) @ w_out, "tp", scatter_dimension=0, tiled=True)

    f = _sm(mlp, mesh, specs, P("tp", None))
    return f, _args(mesh, specs, [(S, D), (D, F), (F, D)], [BF16] * 3)


def seqax():
    """seqax-style: activations sharded over the model dimension; gathered, RMS-normed (the norm
    scale FSDP-gathered too) and projected: a norm between a gather along K and its matmul."""
    mesh = _mesh((2,), ("tp",))
    specs = (P(None, "tp"), P("tp"), P(None, "tp"))

    def block(x, scale, w):
        h = lax.all_gather(x, "tp", axis=1, tiled=True)
        h = rms(h, lax.all_gather(scale, "tp", tiled=True))
        return h @ w

    f = _sm(block, mesh, specs, P(None, "tp"))
    return f, _args(mesh, specs, [(S, D), (D,), (D, F)], [BF16, jnp.float32, BF16])


def gpt_j():
    """GPT-J-style row-parallel output projection: a bf16 matmul, a float32 bias added by every
    shard before the reduce-scatter (so the sum holds it n times), the result float32."""
    mesh = _mesh((2,), ("tp",))
    specs = (P(None, "tp"), P("tp", None), P())

    def out_proj(x, w, b):
        return lax.psum_scatter(x @ w + b, "tp", scatter_dimension=0, tiled=True)

    f = _sm(out_proj, mesh, specs, P("tp", None))
    return f, _args(mesh, specs, [(S, F), (F, D), (D,)], [BF16, BF16, jnp.float32])


class Linear:
    """Computes as ``flax.nnx.Linear(dtype=bf16, param_dtype=f32)`` does: the input, the f32
    kernel and the bias cast to bf16 right before its own matmul."""

    def __init__(self, kernel, bias=None, dtype=BF16):
        self.kernel, self.bias, self.dtype = kernel, bias, dtype

    def __call__(self, x):
        x, k = x.astype(self.dtype), self.kernel.astype(self.dtype)
        y = lax.dot_general(x, k, (((x.ndim - 1,), (0,)), ((), ())))
        return y if self.bias is None else y + self.bias.astype(self.dtype)


def flax_nnx():
    """Flax NNX modules with ``dtype=bf16`` inside a shard_map: q, k and v projections of one
    sequence-gathered input (each casting its own f32 kernel), an output projection scattered."""
    mesh = _mesh((2,), ("tp",))
    specs = (P("tp", None), P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp", None))

    def attention_projections(x, wq, wk, wv, wo):
        h = lax.all_gather(x, "tp", axis=0, tiled=True)
        q, k, v = Linear(wq)(h), Linear(wk)(h), Linear(wv)(h)
        o = jax.nn.sigmoid(q * k) * v  # (stands in for attention)
        return lax.psum_scatter(Linear(wo)(o), "tp", scatter_dimension=0, tiled=True)

    f = _sm(attention_projections, mesh, specs, P("tp", None))
    shapes = [(S, D), (D, D), (D, D), (D, D), (D, D)]
    return f, _args(mesh, specs, shapes, [BF16] + [jnp.float32] * 4)


def llama3():
    """Llama 3 style, sequence parallel: RMSNorm of the gathered rows, SwiGLU's gate and up
    projections of one gathered value, the down projection reduce-scattered over the sequence.
    The norm sits between the gather (of rows) and the matmuls: a near miss, with advice."""
    mesh = _mesh((2,), ("tp",))
    specs = (P("tp", None), P(), P(None, "tp"), P(None, "tp"), P("tp", None))

    def mlp(x, scale, w_gate, w_up, w_down):
        h = rms(lax.all_gather(x, "tp", axis=0, tiled=True), scale)
        g = jax.nn.silu(h @ w_gate) * (h @ w_up)
        return lax.psum_scatter(g @ w_down, "tp", scatter_dimension=0, tiled=True)

    f = _sm(mlp, mesh, specs, P("tp", None))
    shapes = [(S, D), (D,), (D, F), (D, F), (F, D)]
    return f, _args(mesh, specs, shapes, [BF16, jnp.float32, BF16, BF16, BF16])


IDIOMS = {f.__name__: f for f in (shard_map_tutorial, scaling_book, seqax, gpt_j, flax_nnx,
                                  llama3)}  # fmt: skip


def _row_parallel(body, dtypes, bias=False):
    mesh = _mesh((2,), ("tp",))
    specs = (P(None, "tp"), P("tp", None), P()) if bias else (P(None, "tp"), P("tp", None))
    shapes = [(S, D), (D, D), (D,)][: len(specs)]
    return _sm(body, mesh, specs, P("tp", None)), _args(mesh, specs, shapes, dtypes)


def _rs(y):
    return lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)


# The patterns of issue 27 one by one (the norm across K is seqax above).
PATTERNS = {
    "mixed_dtypes": lambda: _row_parallel(lambda x, w: _rs(jnp.matmul(x, w)),
                                          [BF16, jnp.float32]),
    "weight_cast": lambda: _row_parallel(lambda x, w: _rs(x @ w.astype(BF16)),
                                         [BF16, jnp.float32]),
    "bias_before_rs": lambda: _row_parallel(lambda x, w, b: _rs(x @ w + b), [BF16] * 3,
                                            bias=True),
}  # fmt: skip
