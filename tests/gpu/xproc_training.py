"""The training path's fused calls across two processes (tests/gpu/xproc_worker.py, MODE
``train``): the cases of tests/gpu/test_training_gpu.py, with the reference computed by the same
model on a one-device mesh of this process (the collectives over a size-1 axis are no-ops, so it
is the unsharded computation). Nothing may need XLA's NCCL path (no loss values, whose sum is an
all-reduce, only gradients): on a one-GPU machine both processes share the GPU, and NCCL refuses
two ranks on one GPU. Prints ``<tag> OK`` or ``<tag> FAILED ...`` per case."""

from __future__ import annotations

import os
import traceback
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused, runtime
from jaxoverlap.fused import backward as fused_backward
from tests.gpu import training_models

# Every cross-process wait bounded by $XPROC_TIMEOUT_S (default 60 s), as the ops mode's cases are:
# under a sanitizer (tools/sanitize.py raises it) one process may still be compiling a program its
# peer already runs -- the fixed 60 s timed out batch_by_sequence under initcheck (issue 25, helper
# U's call 2 of 2026-12-02: the peer's compile took longer than 60 s).
FUSED = Config(backend="fused", timeout_s=float(os.environ.get("XPROC_TIMEOUT_S", "60")))
XLA = Config(backend="xla")
TOL = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 3e-3}


def _compare(tag, got, want, dtype):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        (s,) = a.addressable_shards
        g = np.asarray(s.data, np.float32)
        w = np.asarray(b, np.float32)[s.index]
        err = float(np.abs(g - w).max() / max(float(np.abs(w).max()), 1e-6))
        assert np.isfinite(g).all() and err < TOL[jnp.dtype(dtype)], f"leaf {i}: error {err:.3g}"


# Every case of run(), in its order (tests/gpu/test_xproc_gpu.py parametrizes over these).
CASES = (
    "column_parallel_bfloat16_1d",
    "column_parallel_bfloat16_2d",
    "column_parallel_float16_1d",
    "column_parallel_float16_2d",
    "row_parallel",
    "batch_by_sequence",
    "scanned_training",
)


def only_cases(known, mode):
    """The cases that XPROC_ONLY (comma-separated tags; empty: all) selects among ``known``, in
    XPROC_ONLY's order -- the one selection of every worker MODE (tools/sanitize.py's --only sets
    it). A tag that names no case of ``mode`` is an error, not a run of nothing (until 2026-12-03
    the training mode read another variable, and sanitize.py --only ran every training case)."""
    only = [t for t in os.environ.get("XPROC_ONLY", "").split(",") if t]
    unknown = [t for t in only if t not in known]
    if unknown:
        raise SystemExit(f"XPROC_ONLY names no {mode} case: {unknown} (cases: {list(known)})")
    return only or list(known)


def _case(tag, build, host, specs, dtype, targets, mesh, arr):
    """build(mesh, config) -> jitted fn of the arrays ``host`` (NumPy, global shapes); ``arr(a,
    spec)``: the global array of ``a`` on ``mesh``."""
    assert tag in CASES, f"{tag}: add it to CASES"
    if tag not in only_cases(CASES, "train"):
        return
    try:
        local = Mesh(np.array(jax.local_devices()[:1]), ("tp",))
        args = [arr(a, s) for a, s in zip(host, specs, strict=True)]
        fused_fn = build(mesh, FUSED)
        calls_before = runtime.native().handler_calls()
        hlo = fused_fn.lower(*args).compile().as_text()
        for t in targets:
            assert f'custom_call_target="{t}"' in hlo, f"{t} not in the compiled HLO"
        assert "all-gather" not in hlo and "reduce-scatter" not in hlo, "an XLA collective is left"
        got = fused_fn(*args)
        jax.block_until_ready(got)
        jaxoverlap.check_errors()
        again = fused_fn(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again), strict=True):
            sa, sb = a.addressable_shards[0].data, b.addressable_shards[0].data
            assert np.array_equal(np.asarray(sa), np.asarray(sb)), "not deterministic"
        jax.block_until_ready(again)
        calls = runtime.native().handler_calls()
        want = build(local, XLA)(*[jnp.asarray(a) for a in host])
        _compare(tag, got, want, dtype)
        # With command buffers (JAXOVERLAP_COMMAND_BUFFERS=1), how many host calls were captured.
        print(f"{tag} OK captured={calls[1] - calls_before[1]}", flush=True)
    except Exception as e:  # report every case
        print(f"{tag} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
        traceback.print_exc()


def run(mesh, arr):
    rng = np.random.default_rng(3)

    def normal(*shape, scale=1.0, dtype=jnp.bfloat16):
        return (rng.standard_normal(shape, np.float32) * scale).astype(dtype)

    keep, bulk = fused.emitted(fused.AG_GEMM_KEEP_TARGET), fused.emitted(fused_backward.TARGET)
    for dtype in (jnp.bfloat16, jnp.float16):
        for rows in ((2 * 1536,), (2, 384)):
            k, n_local = 640, 1280
            x, w = normal(*rows, k, dtype=dtype), normal(k, 2 * n_local, scale=1 / 32, dtype=dtype)
            out = P(*([None] * len(rows)), "tp")
            _case(
                f"column_parallel_{jnp.dtype(dtype).name}_{len(rows)}d",
                lambda mesh, cfg, out=out: training_models.grads(
                    mesh, "ag", cfg, P("tp"), P(None, "tp"), out
                ),
                (x, w),
                (P("tp"), P(None, "tp")),
                dtype,
                (keep, bulk),
                mesh,
                arr,
            )
    m, k_local, n = 1536, 640, 896
    x, w = normal(m, 2 * k_local), normal(2 * k_local, n, scale=1 / 45)
    _case(
        "row_parallel",
        lambda mesh, cfg: training_models.grads(mesh, "rs", cfg, P(None, "tp"), P("tp"), P("tp")),
        (x, w),
        (P(None, "tp"), P("tp")),
        jnp.bfloat16,
        (keep,),
        mesh,
        arr,
    )
    b, s_local, d, f_local = 4, 384, 640, 1280
    host = (
        normal(b, 2 * s_local, d),
        normal(d, 2 * f_local, scale=1 / 25),
        normal(2 * f_local, d, scale=1 / 50),
    )
    _case(
        "batch_by_sequence",
        partial(training_models.mlp_step, with_loss=False),
        host,
        (P(None, "tp"), P(None, "tp"), P("tp")),
        jnp.bfloat16,
        (keep, bulk),
        mesh,
        arr,
    )
    d, f_local, layers = 768, 1280, 2
    host = (
        normal(3072, d),
        normal(layers, d, 2 * f_local, scale=1 / 32),
        normal(layers, 2 * f_local, d, scale=1 / 64),
    )
    _case(
        "scanned_training",
        partial(training_models.scanned_train, with_loss=False),
        host,
        (P("tp"), P(None, None, "tp"), P(None, "tp")),
        jnp.bfloat16,
        (keep, bulk),
        mesh,
        arr,
    )
