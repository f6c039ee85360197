"""jaxoverlap.nnx on 8 fake CPU devices: values and gradients equal `flax.nnx.Linear` on the
unsharded weights, output shardings as documented, under jit with a mesh and inside shard_map."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import GRAD_TOL, TOL, P, assert_close
from jax.sharding import AxisType, NamedSharding

# CI installs the flax extra (.ci/run), so there these tests run; elsewhere they need it too
nnx = pytest.importorskip("flax.nnx", reason="needs the flax extra: pip install -e '.[flax]'")

from jaxoverlap.nnx import ColumnParallelLinear, ParallelMLP, RowParallelLinear  # noqa: E402

B, S, IN, OUT, TP = 2, 8, 16, 32, 4
LAYERS = {"column": ColumnParallelLinear, "row": RowParallelLinear}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce")


def mesh_of(kind=AxisType.Explicit):
    return jax.make_mesh((2, TP), ("dp", "tp"), axis_types=(kind, kind))


def x_spec(layer, sp):
    """Where x lives globally: batch on dp; a column sp layer's x on the sequence, a row layer's on
    features (the output of a column layer)."""
    if layer == "row":
        return P("dp", None, "tp")
    return P("dp", "tp", None) if sp else P("dp", None, None)


# documented global output layouts (jaxoverlap/nnx.py)
OUT_SPEC = {
    ("column", False): P("dp", None, "tp"),
    ("column", True): P("dp", None, "tp"),
    ("row", False): P("dp", None, None),
    ("row", True): P("dp", "tp", None),
}
# the one collective of each forward (the column layer without sp has none)
FWD_COLLECTIVE = {
    ("column", False): None,
    ("column", True): "all-gather",
    ("row", False): "all-reduce",
    ("row", True): "reduce-scatter",
}


def make_pair(layer, sp, dtype, mesh, **kw):
    """Our layer (params sharded on `mesh`, random bias) and an `nnx.Linear` with its weights."""
    with jax.set_mesh(mesh):
        ours = LAYERS[layer](IN, OUT, rngs=nnx.Rngs(0), sequence_parallel=sp, dtype=dtype, **kw)
        if ours.bias is not None:
            ours.bias[...] = jax.random.normal(jax.random.key(7), (OUT,)) * 0.5
    ref = nnx.Linear(IN, OUT, rngs=nnx.Rngs(1), dtype=dtype, use_bias=ours.bias is not None)
    ref.kernel[...] = np.asarray(ours.kernel[...])
    if ours.bias is not None:
        ref.bias[...] = np.asarray(ours.bias[...])
    return ours, ref


def inputs(dtype):
    kx, kc = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (B, S, IN), jnp.float32).astype(dtype)
    ct = jax.random.normal(kc, (B, S, OUT), jnp.float32).astype(dtype)
    return x, ct


def loss_of(graphdef, ct):
    def loss(state, x):
        y = nnx.merge(graphdef, state)(x)
        return jnp.sum((y * ct).astype(jnp.float32))

    return loss


def reference(ref, x, ct):
    """Value and gradients (params, x) of `nnx.Linear` on unsharded numpy-backed arrays."""
    g, s = nnx.split(ref)
    y = nnx.merge(g, s)(x)
    grads = jax.grad(loss_of(g, ct), argnums=(0, 1))(s, x)
    return y, grads


def spec_names(spec, ndim):
    entries = tuple(spec) + (None,) * ndim
    return [(e,) if isinstance(e, str) else tuple(e or ()) for e in entries[:ndim]]


def assert_matches(y, grads, ref_y, ref_grads, dtype, use_bias=True):
    assert y.dtype == ref_y.dtype
    assert_close(y, ref_y, TOL[dtype], "value")
    (gs, gx), (rs, rx) = grads, ref_grads
    assert_close(gx, rx, GRAD_TOL[dtype], "d/dx")
    assert_close(gs["kernel"][...], rs["kernel"][...], GRAD_TOL[dtype], "d/dkernel")
    if use_bias:
        assert_close(gs["bias"][...], rs["bias"][...], GRAD_TOL[dtype], "d/dbias")


CASES = [
    (layer, sp, dtype, kind)
    for layer in LAYERS
    for sp in (False, True)
    for dtype, kind in (
        (jnp.float32, AxisType.Explicit),
        (jnp.bfloat16, AxisType.Explicit),
        (jnp.float32, AxisType.Auto),
    )
]


@pytest.mark.parametrize("layer,sp,dtype,kind", CASES)
def test_jit_global_view_matches_linear(layer, sp, dtype, kind):
    mesh = mesh_of(kind)
    ours, ref = make_pair(layer, sp, dtype, mesh)
    x, ct = inputs(dtype)
    ref_y, ref_grads = reference(ref, x, ct)

    graphdef, state = nnx.split(ours)
    specs = nnx.get_partition_spec(state)
    column = layer == "column"
    assert specs["kernel"].get_value() == (P(None, "tp") if column else P("tp", None))
    assert specs["bias"].get_value() == (P("tp") if column else P(None))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, x_spec(layer, sp)))
        fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, xs).compile()
        y = fwd(state, xs)
        grads = jax.jit(jax.grad(loss_of(graphdef, ct), argnums=(0, 1)))(state, xs)
    assert_matches(y, grads, ref_y, ref_grads, dtype)

    want = OUT_SPEC[(layer, sp)]
    got = spec_names(y.sharding.spec, 3)
    if kind == AxisType.Explicit:
        assert got == spec_names(want, 3), (y.sharding.spec, want)
    else:  # Auto: the tp placement is the layer's; dp is left to XLA's propagation
        assert [("tp" in g) for g in got] == [("tp" in w) for w in spec_names(want, 3)], got
    hlo, op = fwd.as_text(), FWD_COLLECTIVE[(layer, sp)]
    found = [c for c in COLLECTIVES if c in hlo]
    if kind == AxisType.Explicit or op is None:
        assert found == ([op] if op else []), found  # the layer's collective and nothing else
    else:  # Auto: XLA may also gather dp around the sequence collective (module docstring)
        assert op in found, found


@pytest.mark.parametrize("sp", [False, True])
def test_inside_shard_map_matches_linear(sp):
    """Per-device call: the user's shard_map passes the state with its partition specs."""
    mesh, dtype = mesh_of(), jnp.float32
    x, _ = inputs(dtype)
    ct = jax.random.normal(jax.random.key(5), x.shape)
    with jax.set_mesh(mesh):
        model = ParallelMLP(IN, OUT, rngs=nnx.Rngs(0), sequence_parallel=sp)
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    io_spec = P("dp", "tp", None) if sp else P("dp", None, None)

    def loss(state, x):
        fwd = jax.shard_map(
            lambda s, x: nnx.merge(graphdef, s)(x),
            mesh=mesh,
            in_specs=(specs, io_spec),
            out_specs=io_spec,
        )
        y = fwd(state, x)
        return jnp.sum(y * ct), y

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, io_spec))
        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, xs)

    def ref_loss(params, x):
        (k1, b1), (k2, b2) = params
        y = jax.nn.gelu(x @ k1 + b1) @ k2 + b2
        return jnp.sum(y * ct), y

    params = [
        [np.asarray(l_.kernel[...]), np.asarray(l_.bias[...])] for l_ in (model.up, model.down)
    ]
    (_, ref_y), (ref_p, ref_x) = jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)(
        params, x
    )
    assert_close(y, ref_y, TOL[dtype], "value")
    assert_close(grads[1], ref_x, GRAD_TOL[dtype], "d/dx")
    for name, (dk, db) in zip(("up", "down"), ref_p):
        assert_close(grads[0][name]["kernel"][...], dk, GRAD_TOL[dtype], f"{name} d/dkernel")
        assert_close(grads[0][name]["bias"][...], db, GRAD_TOL[dtype], f"{name} d/dbias")


def test_no_bias_and_param_dtype():
    mesh, dtype = mesh_of(), jnp.bfloat16
    ours, ref = make_pair("row", True, dtype, mesh, use_bias=False, param_dtype=jnp.bfloat16)
    assert ours.bias is None and ours.kernel[...].dtype == jnp.bfloat16
    x, ct = inputs(dtype)
    ref_y, ref_grads = reference(ref, x, ct)
    graphdef, state = nnx.split(ours)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, x_spec("row", True)))
        y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, xs)
        grads = jax.jit(jax.grad(loss_of(graphdef, ct), argnums=(0, 1)))(state, xs)
    assert_matches(y, grads, ref_y, ref_grads, dtype, use_bias=False)


def test_mesh_argument_without_context_mesh():
    """mesh= at construction: params placed on it, calls need no jax.set_mesh; sequence_dim=0."""
    mesh = mesh_of()
    layer = ColumnParallelLinear(
        IN, OUT, rngs=nnx.Rngs(0), mesh=mesh, sequence_parallel=True, sequence_dim=0
    )
    assert layer.kernel[...].sharding.spec == P(None, "tp")
    x = jax.random.normal(jax.random.key(0), (S, B, IN))  # [seq, batch, features]
    y = jax.jit(lambda x: layer(x))(x)
    want = x @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])
    assert_close(y, want, TOL[jnp.float32])
    assert spec_names(y.sharding.spec, 3) == spec_names(P(None, None, "tp"), 3)


def test_readme_snippet():
    """The README's "Flax NNX layers" example runs as printed (it asserts its own result)."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Flax NNX layers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


# ----------------------------------------------------------------------------- errors


def test_errors():
    mesh = mesh_of()
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: out_features=30 .* size 4 "):
        ColumnParallelLinear(IN, 30, rngs=nnx.Rngs(0), mesh=mesh)
    with pytest.raises(ValueError, match=r"RowParallelLinear: in_features=6 .*multiple of 4"):
        RowParallelLinear(6, OUT, rngs=nnx.Rngs(0), mesh=mesh)
    with pytest.raises(ValueError, match=r"axis_name 'model' is not an axis of the mesh"):
        RowParallelLinear(IN, OUT, rngs=nnx.Rngs(0), mesh=mesh, axis_name="model")
    with pytest.raises(TypeError, match=r"axis_name must be one mesh axis name"):
        RowParallelLinear(IN, OUT, rngs=nnx.Rngs(0), axis_name=("dp", "tp"))

    layer = ColumnParallelLinear(IN, OUT, rngs=nnx.Rngs(0), mesh=mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: x has shape \(2, 8, 12\); .*16"):
        layer(jnp.zeros((B, S, 12)))
    with pytest.raises(ValueError, match=r"dimension 1 of x \(shape \(2, 6, 16\)\).*Pad"):
        layer(jnp.zeros((B, 6, IN)))
    with pytest.raises(ValueError, match=r"sequence_dim=-2 .* shape \(16,\)"):
        layer(jnp.zeros((IN,)))

    with nnx.use_eager_sharding(False):
        unplaced = RowParallelLinear(IN, OUT, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"RowParallelLinear: no mesh .* jax.set_mesh"):
        unplaced(jnp.zeros((B, S, IN)))

    # inside shard_map with the kernel not split: the user forgot the partition specs
    with nnx.use_eager_sharding(False):
        layer = ColumnParallelLinear(IN, OUT, rngs=nnx.Rngs(0), sequence_parallel=True)
    graphdef, state = nnx.split(layer)
    fwd = jax.shard_map(
        lambda s, x: nnx.merge(graphdef, s)(x),
        mesh=mesh,
        in_specs=(P(), P(None, "tp", None)),
        out_specs=P(None, None, "tp"),
    )
    with pytest.raises(ValueError, match=r"kernel shard must have shape \(16, 8\).*get_partition"):
        jax.jit(fwd)(
            state, jax.device_put(jnp.zeros((B, S, IN)), NamedSharding(mesh, P(None, "tp")))
        )


def test_flax_is_optional():
    """Without flax, `import jaxoverlap` works and `jaxoverlap.nnx` names the extra."""
    code = (
        "import sys; sys.modules['flax'] = None\n"  # `import flax` raises ImportError
        "import jaxoverlap\n"
        "try:\n    import jaxoverlap.nnx\n"
        "except ImportError as e:\n    print(e)\n"
    )
    root = pathlib.Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "pip install 'jaxoverlap[flax]'" in out.stdout, out.stdout
