"""Flax NNX tensor-parallel linear layers built on the jaxoverlap ops (``pip install '.[flax]'``).

`ColumnParallelLinear` holds ``kernel [in, out]`` split over ``axis_name`` along ``out`` (bias
split with it); `RowParallelLinear` holds ``kernel [in, out]`` split along ``in`` (bias
replicated, added once, after the reduction). `ParallelMLP` is the two in a row. Per device:

==============  ===================  ==========================  ====================
layer           input ``x``          computation                 output
==============  ===================  ==========================  ====================
column          ``[.., S, in]``      ``x @ kernel`` (local)      ``[.., S, out/t]``
column, ``sp``  ``[.., S/t, in]``    ``all_gather_matmul``       ``[.., S, out/t]``
row             ``[.., S, in/t]``    ``matmul_all_reduce``       ``[.., S, out]``
row, ``sp``     ``[.., S, in/t]``    ``matmul_reduce_scatter``   ``[.., S/t, out]``
==============  ===================  ==========================  ====================

(``t`` = size of ``axis_name``, ``sp`` = ``sequence_parallel=True``, ``S`` = dimension
``sequence_dim`` of ``x``, by default the one before the features.) Seen globally, the output of a
column layer is sharded ``P(.., None, axis_name)`` (features), that of a row layer ``P(.., None,
None)``, or ``P(.., axis_name, None)`` (sequence) with ``sp``; an ``sp`` column layer takes ``x``
sharded on the sequence dimension (it is resharded there if it is not).

Two ways to call them, chosen per call from ``jax.sharding.get_abstract_mesh()``:

* **Global view** (``axis_name`` is not a manual axis here): ``x`` and the params are global
  arrays, e.g. under ``jax.jit`` with ``jax.set_mesh(mesh)``. The layer runs its per-device
  computation in a ``jax.shard_map`` over the mesh: the ``mesh=`` given to the constructor (a
  ``jax.sharding.Mesh``), else the context mesh. On a mesh of ``Explicit`` axes
  (``jax.make_mesh``'s default) the layout is fully determined: the inputs are resharded
  (``jax.reshard``) to the table above, and other axes (a data axis, say) stay on the batch
  dimensions of ``x`` and of the output; they are dropped from ``x``'s features and the params.
  On ``Auto`` axes only ``axis_name`` is manual, shard_map reshards the inputs, and other axes are
  left to XLA's propagation, which may gather them around the sequence-parallel collectives
  (seen on CPU: a ``dp`` all-gather of ``x``).
* **Per device** (inside the user's ``jax.shard_map`` with ``axis_name`` manual): ``x`` and the
  params are shards (pass the state with ``in_specs=nnx.get_partition_spec(state)``), and the
  layer calls the op directly.

The params carry their layout as NNX sharding metadata (``nnx.with_partitioning``), so
``nnx.get_partition_spec(nnx.state(layer))`` gives ``P(None, axis_name)`` for a column kernel and
``P(axis_name, None)`` for a row kernel. With flax's eager sharding (its default), create the layers
under ``jax.set_mesh(mesh)`` or pass ``mesh=``: the params are then created sharded.
"""

from __future__ import annotations

try:
    from flax import nnx
except ImportError as e:  # flax is an optional dependency
    raise ImportError(
        "jaxoverlap.nnx needs Flax NNX, which is an optional dependency: "
        "pip install 'jaxoverlap[flax]' (from a checkout: pip install -e '.[flax]')"
    ) from e

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxoverlap.ops import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

__all__ = ["ColumnParallelLinear", "ParallelMLP", "RowParallelLinear"]

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class _ParallelLinear(nnx.Module):
    """What both layers share; ``_column`` says which one this is."""

    _column: bool

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rngs: nnx.Rngs,
        axis_name: str = "tp",
        sequence_parallel: bool = False,
        sequence_dim: int = -2,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_kernel_init,
        bias_init=default_bias_init,
        mesh: Mesh | None = None,
        config=None,
    ):
        if not isinstance(axis_name, str):
            raise TypeError(
                f"{self._name}: axis_name must be one mesh axis name (a str), got {axis_name!r}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.axis_name, self.mesh, self.config = axis_name, mesh, config
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        self.use_bias, self.dtype, self.param_dtype = use_bias, dtype, param_dtype
        if mesh is not None:
            self._check_divisible(self._axis_size(mesh))
        k_spec = (None, axis_name) if self._column else (axis_name, None)
        b_spec = (axis_name,) if self._column else (None,)
        init = nnx.with_partitioning(kernel_init, k_spec, mesh=mesh)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        bias = None
        if use_bias:
            init = nnx.with_partitioning(bias_init, b_spec, mesh=mesh)
            bias = nnx.Param(init(rngs.params(), (out_features,), param_dtype))
        self.bias = nnx.data(bias)

    @property
    def _name(self):
        return type(self).__name__

    # ------------------------------------------------------------------------- call

    def __call__(self, x):
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        dtype = self.dtype or jnp.result_type(x, kernel, *([] if bias is None else [bias]))
        x, kernel = jnp.asarray(x, dtype), kernel.astype(dtype)
        args = (x, kernel) if bias is None else (x, kernel, bias.astype(dtype))
        seq = self._seq_dim(x)
        context = jax.sharding.get_abstract_mesh()
        if self.axis_name in context.manual_axes:  # inside the user's shard_map: shards
            self._check_local(x, kernel, context.shape[self.axis_name])
            return self._per_device(seq, *args)
        mesh = self._global_mesh(context)
        self._check_global(x, seq, self._axis_size(mesh))
        return self._global_call(mesh, seq, args)

    def _global_call(self, mesh, seq, args):
        """Run `_per_device` on global ``args`` (x, kernel[, bias]) in a ``jax.shard_map``."""
        a, sp_dim = self.axis_name, (seq if self.sequence_parallel else None)
        # the dimension that `a` splits in x, kernel, bias and in the result (None: none)
        dims, out_dim = ((sp_dim, 1, 0), -1) if self._column else ((-1, 0, None), sp_dim)
        dims = dims[: len(args)]
        free = {n: t for n, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
        if set(free.values()) == {AxisType.Auto}:
            # only `a` becomes manual; shard_map reshards the inputs over it
            in_specs = tuple(_spec(v.ndim, d, a) for v, d in zip(args, dims))
            out_spec, manual = _spec(args[0].ndim, out_dim, a), {a}
        elif set(free.values()) == {AxisType.Explicit}:
            # every free axis becomes manual: lax.psum_scatter fails to lower in a shard_map that
            # is manual over only some Explicit axes (jax 0.11, 0.12). x keeps its other axes on
            # its batch dims; contracted dims and params are replicated over them.
            in_specs = tuple(
                _explicit_spec(v, d, a, i == 0) for i, (v, d) in enumerate(zip(args, dims))
            )
            args = tuple(_reshard(v, spec, mesh) for v, spec in zip(args, in_specs))
            out = [_names(e) for e in in_specs[0][:-1]] + [(a,) if self._column else ()]
            if sp_dim is not None:  # column: gathered there; row: scattered there
                out[sp_dim] = tuple(n for n in out[sp_dim] if n != a) + (
                    () if self._column else (a,)
                )
            out_spec, manual = PartitionSpec(*map(_entry, out)), set(free)
        else:
            raise ValueError(
                f"{self._name}: the mesh mixes Auto and Explicit axes ({free}); use one axis type "
                "for the non-manual axes."
            )
        fn = jax.shard_map(
            lambda *local: self._per_device(seq, *local),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_spec,
            axis_names=manual,
        )
        return fn(*args)

    def _per_device(self, seq, x, kernel, bias=None):
        a, config = self.axis_name, self.config
        if self._column and self.sequence_parallel:
            y = all_gather_matmul(x, kernel, a, gather_dimension=seq, config=config)
        elif self._column:
            y = jnp.matmul(x, kernel)
        elif self.sequence_parallel:
            y = matmul_reduce_scatter(x, kernel, a, scatter_dimension=seq, config=config)
        else:
            y = matmul_all_reduce(x, kernel, a, config=config)
        if bias is not None:  # column: this device's features; row: after the reduction
            y = y + bias.reshape((1,) * (y.ndim - 1) + (-1,))
        return y

    # ------------------------------------------------------------------------- checks

    def _axis_size(self, mesh):
        if self.axis_name not in mesh.axis_names:
            raise ValueError(
                f"{self._name}: axis_name {self.axis_name!r} is not an axis of the mesh (axes "
                f"{tuple(mesh.axis_names)}). Pass the tensor-parallel axis as axis_name=."
            )
        return mesh.shape[self.axis_name]

    def _check_divisible(self, t):
        dim, what = (self.out_features, "out") if self._column else (self.in_features, "in")
        if dim % t:
            raise ValueError(
                f"{self._name}: {what}_features={dim} is not divisible by the size {t} of axis "
                f"{self.axis_name!r}, which splits the kernel ({self.in_features}, "
                f"{self.out_features}) along {what}. Choose {what}_features a multiple of {t}."
            )

    def _seq_dim(self, x):
        if not self.sequence_parallel:
            return None
        nd = jnp.ndim(x)
        d = self.sequence_dim + nd if self.sequence_dim < 0 else self.sequence_dim
        if nd < 2 or not 0 <= d < nd - 1:
            raise ValueError(
                f"{self._name}: sequence_dim={self.sequence_dim} must name a dimension of x "
                f"other than the last (features); x has shape {jnp.shape(x)}. With "
                "sequence_parallel=True x needs rank >= 2: [tokens, features], [batch, seq, "
                "features], ..."
            )
        return d

    def _global_mesh(self, context):
        if self.mesh is not None:
            return self.mesh
        if context.empty:
            raise ValueError(
                f"{self._name}: no mesh to shard over axis {self.axis_name!r}. Call it under "
                "jax.set_mesh(mesh), pass mesh= to the constructor, or call it inside "
                f"jax.shard_map with {self.axis_name!r} among the manual axes."
            )
        return context

    def _check_global(self, x, seq, t):
        self._check_divisible(t)
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self._name}: x has shape {x.shape}; its last dimension must be in_features="
                f"{self.in_features} (kernel ({self.in_features}, {self.out_features})). "
                f"Reshape x to [..., {self.in_features}] or build the layer for x's features."
            )
        if seq is not None and x.shape[seq] % t:
            raise ValueError(
                f"{self._name}: sequence_parallel=True splits dimension {seq} of x (shape "
                f"{x.shape}) over axis {self.axis_name!r} of size {t}, and {x.shape[seq]} is not "
                f"divisible by {t}. Pad the sequence to a multiple of {t} or set "
                "sequence_parallel=False."
            )

    def _check_local(self, x, kernel, t):
        i, o = self.in_features, self.out_features
        want = (i, o // t) if self._column else (i // t, o)
        if kernel.shape != want:
            raise ValueError(
                f"{self._name}: inside shard_map over {self.axis_name!r} (size {t}) the kernel "
                f"shard must have shape {want} (global ({i}, {o})), got {kernel.shape}. Pass the "
                "module state into jax.shard_map with in_specs=nnx.get_partition_spec(state)."
            )
        if x.ndim < 1 or x.shape[-1] != want[0]:
            raise ValueError(
                f"{self._name}: inside shard_map the shard of x must end in {want[0]} features "
                f"(kernel shard {want}), got x of shape {x.shape}."
                + ("" if self._column else " A row-parallel input is split over features.")
            )


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ kernel + bias`` with ``kernel [in, out]`` and ``bias [out]`` split over
    ``axis_name`` along ``out``; the output stays split over features (module docstring).

    Arguments as `flax.nnx.Linear` (``in_features``, ``out_features``, ``rngs``, ``use_bias``,
    ``dtype``, ``param_dtype``, ``kernel_init``, ``bias_init``), plus:

    Args:
      axis_name: the mesh axis of tensor parallelism.
      sequence_parallel: ``x`` arrives split over ``axis_name`` along ``sequence_dim``; the layer
        gathers it inside `jaxoverlap.all_gather_matmul`.
      sequence_dim: the sequence (token) dimension of ``x``; default -2.
      mesh: the mesh for global-view calls (default: the context mesh); also used to place the
        params when they are created.
      config: a `jaxoverlap.Config` for the op.
    """

    _column = True


class RowParallelLinear(_ParallelLinear):
    """``y = x @ kernel + bias`` with ``kernel [in, out]`` split over ``axis_name`` along ``in``
    and ``x`` split along its features; the partial products are summed by
    `jaxoverlap.matmul_all_reduce`, or with ``sequence_parallel`` summed and split over the
    sequence by `jaxoverlap.matmul_reduce_scatter`. ``bias [out]`` is replicated and added once,
    after the reduction. Arguments as `ColumnParallelLinear`.
    """

    _column = False


class ParallelMLP(nnx.Module):
    """``RowParallelLinear(activation(ColumnParallelLinear(x)))``: ``features -> hidden ->
    features`` with one collective each way (two with ``sequence_parallel``). Keyword arguments
    (``axis_name``, ``sequence_parallel``, ``dtype``, ``mesh``, ...) go to both layers."""

    def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs, activation=None, **kwargs):
        self.activation = activation if activation is not None else jax.nn.gelu
        self.up = ColumnParallelLinear(features, hidden, rngs=rngs, **kwargs)
        self.down = RowParallelLinear(hidden, features, rngs=rngs, **kwargs)

    def __call__(self, x):
        return self.down(self.activation(self.up(x)))


# ----------------------------------------------------------------------------- placement


def _spec(ndim, dim, axis):
    """``PartitionSpec`` of a rank-``ndim`` array split over ``axis`` along ``dim`` (or not)."""
    entries = [None] * ndim
    if dim is not None:
        entries[dim] = axis
    return PartitionSpec(*entries)


def _names(entry):
    """One PartitionSpec entry as a tuple of axis names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(names):
    return None if not names else names[0] if len(names) == 1 else tuple(names)


def _explicit_spec(v, dim, axis, keep_batch):
    """The spec ``v`` needs on an all-Explicit mesh: ``axis`` on dimension ``dim`` only; other
    axes kept on the batch dims (all but the last) when ``keep_batch``, else dropped."""
    have = tuple(jax.typeof(v).sharding.spec) + (None,) * v.ndim
    want = []
    for i in range(v.ndim):
        names = ()
        if keep_batch and i < v.ndim - 1:
            names = tuple(n for n in _names(have[i]) if n != axis)
        if dim is not None and i == dim % v.ndim:
            names += (axis,)
        want.append(_entry(names))
    return PartitionSpec(*want)


def _reshard(v, spec, mesh):
    have = tuple(jax.typeof(v).sharding.spec) + (None,) * v.ndim
    if tuple(map(_names, have[: v.ndim])) == tuple(map(_names, spec)):
        return v
    return jax.reshard(v, NamedSharding(mesh, spec) if isinstance(mesh, Mesh) else spec)
