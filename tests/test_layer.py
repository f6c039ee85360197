"""The tensor-parallel transformer example and its layer benchmark: the overlapped model trains
like the plain one, its backward uses the same dots as JAX's own, and the benchmark writes the
BENCHMARKS.md layer schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import GRAD_TOL, TOL

import jaxoverlap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import transformer_layer as L  # noqa: E402  (examples/transformer_layer.py)

DIMS = L.Dims(d_model=64, heads=4, ffn=128, seq=32, batch=2, layers=2)


def _mesh(n=4):
    return jax.make_mesh(
        (n,), (L.AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )


def _inputs(mesh, dtype):
    k_p, k_x, k_y = jax.random.split(jax.random.key(3), 3)
    params = L.init_params(DIMS, k_p, dtype)
    x = jax.random.normal(k_x, (DIMS.tokens, DIMS.d_model), jnp.float32).astype(dtype)
    y = jax.random.normal(k_y, (DIMS.tokens, DIMS.d_model), jnp.float32).astype(dtype)
    return L.place(mesh, params, x, y)


def _unsharded_layer_loss(params, x, y):
    """The same model without any parallelism: one device, every weight whole."""

    def layer(x, p):
        b, s, dh = DIMS.batch, DIMS.seq, DIMS.head_dim
        h = L.rms_norm(x, p["g1"])
        q, k, v = ((h @ p[n]).reshape(b, s, -1, dh) for n in ("wq", "wk", "wv"))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b * s, -1)
        x = x + a @ p["wo"]
        h = L.rms_norm(x, p["g2"])
        return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]

    out = jax.lax.scan(lambda x, p: (layer(x, p), None), x, params)[0]
    return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_overlapped_model_matches_plain_and_unsharded(dtype):
    mesh = _mesh()
    params, x, y = _inputs(mesh, dtype)
    plain = L.make_model(DIMS, mesh)
    models = {"plain": plain, "overlap": jaxoverlap.overlap(plain)}
    # both models' loss and gradients in one compile (each traced on its own)
    both = jax.jit(lambda *a: {n: jax.value_and_grad(L.loss_fn(m))(*a) for n, m in models.items()})
    grads = both(params, x, y)
    ref = jax.jit(jax.value_and_grad(_unsharded_layer_loss))(*jax.device_get((params, x, y)))
    for name, (loss, g) in grads.items():
        np.testing.assert_allclose(float(loss), float(ref[0]), **TOL[dtype], err_msg=name)
        for k in g:
            np.testing.assert_allclose(
                np.asarray(g[k], np.float32),
                np.asarray(ref[1][k], np.float32),
                **GRAD_TOL[dtype],
                err_msg=f"{name} d{k}",
            )


def _f32_dots(fn, *args):
    lines = str(jax.make_jaxpr(fn)(*args)).splitlines()
    return sorted(
        ln.split("=")[0].split(":")[1] for ln in lines if "= dot_general" in ln and ":f32[" in ln
    )


def test_overlapped_step_uses_the_ops_and_plain_dots():
    """The rewrite reaches both reduce-scatters; the ops' backward emits dots with the operands'
    dtype, as JAX's own transpose does (an f32-result dW made XLA:GPU compile a slower GEMM):
    the only f32-result dots are the attention's, which the plain step has too."""
    mesh = _mesh()
    params, x, y = _inputs(mesh, jnp.bfloat16)
    plain = L.make_model(DIMS, mesh)
    grad = jax.grad(L.loss_fn(jaxoverlap.overlap(plain)))
    counts = L.count_ops(grad, params, x, y)
    assert counts["matmul_reduce_scatter"] >= 2, counts
    assert _f32_dots(grad, params, x, y) == _f32_dots(jax.grad(L.loss_fn(plain)), params, x, y)


def test_no_comm_stand_ins_keep_shapes():
    import importlib.util

    path = os.path.join(ROOT, "benchmarks", "transformer_layer.py")
    spec = importlib.util.spec_from_file_location("bench_transformer_layer", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gather, scatter = bench.no_comm(4)
    x = jnp.ones((8, 16))
    assert gather(x).shape == (32, 16)
    assert scatter(gather(x)).shape == (8, 16)
    np.testing.assert_array_equal(scatter(gather(x)), 4 * x)


def _run(args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_example_trains_plain_and_overlapped_alike():
    out = _run(["examples/transformer_layer.py", "--steps", "3", "--d-model", "64", "--ffn", "128"])
    assert "max relative loss difference plain vs overlap" in out
    assert "plain vs jit" in out and "plain vs matmul" in out
    assert "plain    losses" in out and "overlap  losses" in out


def test_layer_benchmark_smoke(tmp_path):
    _run(
        [
            "benchmarks/transformer_layer.py",
            "--cpu-smoke",
            "--samples",
            "2",
            "--target-ms",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    with open(tmp_path / "transformer_layer_2xcpu_smoke.json") as f:
        doc = json.load(f)
    (row,) = doc["rows"]
    for key in ("d_model", "ffn", "heads", "tokens", "tp", "fused_call_sites", "hidden_fraction"):
        assert key in row
    assert set(row["ms"]) >= {"plain", "jaxoverlap", "nocomm", "plain_again"}
    assert all(v > 0 for v in row["ms"].values())
