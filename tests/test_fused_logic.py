"""The fused path's decisions on CPU: trace-time reasons, chunk choice, the measured-win rule
for backend="auto", lazy loading, and the custom call a CUDA lowering emits (lowered for CUDA
from fake CPU devices; no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused, runtime
from jaxoverlap.fused import tile as fused_tile

TOKEN = "!stablehlo.token"  # every fused call's last operand and result (the order)

OP = "matmul_reduce_scatter"


def _aval(shape, dtype=jnp.bfloat16):
    return jax.core.ShapedArray(shape, dtype)


def _reason(x_shape, w_shape, n=2, dtype=jnp.bfloat16, **cfg):
    params = dict(axis_name=("tp",), scatter_dimension=0, config=Config(**cfg))
    return fused.unsupported_reason(OP, _aval(x_shape, dtype), _aval(w_shape, dtype), params, n)


def test_all_reduce_fuses_only_when_asked_or_tuned(native_ok, monkeypatch):
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    x, w = _aval((8192, 4096)), _aval((4096, 8192))

    def reason(backend):
        params = dict(axis_name=("tp",), config=Config(backend=backend))
        return fused.unsupported_reason("matmul_all_reduce", x, w, params, 2)

    assert reason("fused") is None
    assert "never measured" in reason("auto") and "--op matmul_all_reduce" in reason("auto")
    entry = dict(choice="fused", chunks=2, comm_sms=4, ms_xla=1.0, ms_fused=0.8)
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: entry)
    assert reason("auto") is None
    params = dict(axis_name=("tp",), config=Config(backend="fused"))
    odd = fused.unsupported_reason(
        "matmul_all_reduce", _aval((4097, 512)), _aval((512, 8)), params, 2
    )
    assert "not divisible by the group size" in odd


@pytest.mark.parametrize(
    "x_shape, chunks, comm_sms",
    [((1024, 2 * 256), None, None), ((4, 256, 2 * 256), 4, 8)],
)
def test_cuda_lowering_of_all_reduce_is_one_fused_call(lowering_only, x_shape, chunks, comm_sms):
    """One GEMM_AR_TARGET call, the whole [..., N] sum as its result, the group table and the
    settings as attributes; no collective is left to XLA."""
    mesh = Mesh(np.array(jax.devices()[:2])[::-1], ("tp",))
    cfg = Config(backend="fused", chunks=chunks, comm_sms=comm_sms, timeout_s=7.0)

    def body(x, w):
        return jaxoverlap.matmul_all_reduce(x, w, "tp", config=cfg)

    x_spec = P(*([None] * (len(x_shape) - 1)), "tp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P("tp")), out_specs=P()))
    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2 * 256, 384), jnp.bfloat16)
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_AR_TARGET}" in ln]
    assert f"@{fused.GEMM_RS_TARGET}" not in text
    assert "all_gather" not in text and "all_reduce" not in text and "reduce_scatter" not in text
    local = "x".join(map(str, (*x_shape[:-1], 256)))
    out = "x".join(map(str, (*x_shape[:-1], 384)))
    assert (
        f"(tensor<{local}xbf16>, tensor<256x384xbf16>, {TOKEN}) -> (tensor<{out}xbf16>, {TOKEN})"
        in call
    ), call
    assert "ordinals = dense<[1, 0]>" in call and "ranks = dense<[0, 1]>" in call
    assert "groups = dense<[1, 0, 1, 0]>" in call and "n = 2" in call
    want_chunks, want_sms = (chunks, comm_sms) if chunks else fused._DEFAULT_SETTING
    assert f"chunks = {want_chunks}" in call and f"comm_sms = {want_sms}" in call
    assert "timeout_s = 7.0" in call and "stall_rank" not in call  # knobs: only on twins
    assert "w_colmajor = 0" in call and "x_colmajor = 0" in call  # the handler binds both


def test_all_reduce_stall_knob_reaches_its_call_only(lowering_only):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def body(x, w):
        cfg = Config(backend="fused")
        y = jaxoverlap.matmul_all_reduce(x, w, "tp", config=cfg)
        return y, jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)

    specs = dict(in_specs=(P(None, "tp"), P("tp")), out_specs=(P(), P("tp")))
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)
    with fused._stalled_rank_for_tests(1, fused.GEMM_AR_TARGET):
        f = jax.jit(jax.shard_map(body, mesh=mesh, **specs))
        text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    (ar,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_AR_TARGET}_knobs(" in ln]
    (rs,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TARGET}(" in ln]
    assert "stall_rank = 1" in ar and "stall_rank" not in rs  # rs: the production target


def test_reasons(native_ok, monkeypatch):
    assert _reason((1024, 512), (512, 768), backend="fused") is None
    assert _reason((4, 384, 512), (512, 512), backend="fused") is None
    assert "float32" in _reason((1024, 512), (512, 768), dtype=jnp.float32, backend="fused")
    assert "multiples of 8" in _reason((1024, 500), (500, 768), backend="fused")
    assert "alignment" in _reason((2 * 24, 8), (8, 8), backend="fused")
    assert "outside 2..8" in _reason((1024, 512), (512, 768), n=16, backend="fused")
    params = dict(
        axis_name=("tp",), scatter_dimension=1, config=Config(backend="fused"), w_colmajor=False
    )
    # The last dimension (N): the transposed problem (fused/last_dim.py), 128-row chunks of N / n.
    assert fused.unsupported_reason(OP, _aval((1024, 512)), _aval((512, 768)), params, 2) is None
    why = fused.unsupported_reason(OP, _aval((1024, 512)), _aval((512, 400)), params, 2)
    assert "multiple of 128 rows" in why
    why = fused.unsupported_reason(OP, _aval((1024, 512)), _aval((512, 770)), params, 4)
    assert "not divisible by the group size 4" in why
    auto = dict(params, config=Config(backend="auto"))
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", False)
    why = fused.unsupported_reason(OP, _aval((8192, 4096)), _aval((4096, 8192)), auto, 2)
    assert "JAXOVERLAP_AUTO_NEW_KERNELS" in why and "last dimension" in why
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", True)
    assert fused.unsupported_reason(OP, _aval((8192, 4096)), _aval((4096, 8192)), auto, 2) is None
    # A middle dimension: major-most in the custom call's layout, blocks of rows again.
    assert fused.unsupported_reason(OP, _aval((1, 1024, 512)), _aval((512, 768)), params, 2) is None
    assert fused.unsupported_reason(OP, _aval((2, 1024, 512)), _aval((512, 768)), params, 2) is None
    params_n = dict(params, scatter_dimension=2)  # N of a 3-D x: the transposed problem too
    x3 = _aval((2, 512, 512))
    assert fused.unsupported_reason(OP, x3, _aval((512, 768)), params_n, 2) is None
    assert "rank 1" in _reason((512,), (512, 768), backend="fused")
    assert "no rows" in _reason((0, 512), (512, 768), backend="fused")


def test_missing_extension_is_the_reason(monkeypatch):
    monkeypatch.setattr(runtime, "unavailable_reason", lambda: "not built (test)")
    assert _reason((1024, 512), (512, 768), backend="fused") == "not built (test)"


def test_auto_untuned_uses_the_conservative_rule(native_ok, monkeypatch):
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    assert "outside the conservative rule" in _reason((1024, 512), (512, 768))
    assert "outside the conservative rule" in _reason((8192, 4096), (4096, 8192), n=4)
    assert "jaxoverlap.tune --op matmul_reduce_scatter --shapes 8192x14336x8192" in _reason(
        (8192, 14336), (14336, 8192)
    )
    assert _reason((8192, 4096), (4096, 8192)) is None
    assert fused.auto_predicts_win(4096, 8192, 6144, 2)
    assert not fused.auto_predicts_win(1024, 8192, 8192, 2)
    assert not fused.auto_predicts_win(8192, 4096, 8192, 4)


def test_auto_follows_the_tuners_measurement(native_ok, monkeypatch):
    entry = dict(choice="xla", chunks=2, comm_sms=4, ms_xla=1.0, ms_fused=1.01)
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: entry)
    # Inside the conservative rule, but measured no faster: XLA's path, saying so.
    assert "tuned, XLA's path measured" in _reason((8192, 4096), (4096, 8192))
    entry["choice"] = "fused"
    # Outside the rule (K=14336, tp=4), but measured faster: fused.
    assert _reason((8192, 14336), (14336, 8192)) is None
    assert _reason((8192, 4096), (4096, 8192), n=4) is None


def test_tuned_is_none_off_gpu():
    assert fused.tuned("matmul_reduce_scatter", 8192, 4096, 8192, jnp.bfloat16, 2) is None


def test_choose_chunks():
    assert fused.choose_chunks(4096, 4096, 8192) == 4
    assert fused.choose_chunks(4096, 4096, 8192, requested=2) == 2
    assert fused.choose_chunks(24, 8, 8) is None
    assert fused.choose_chunks(768, 1152, 1280) == 4  # 192-row chunks: aligned
    assert fused.choose_chunks(256, 8, 8, requested=3) is None


def test_import_initialises_nothing_native():
    code = (
        "import sys, jaxoverlap; "
        "assert 'jaxoverlap._native' not in sys.modules; "
        "assert not any(m.startswith('jax_cuda') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cuda_lowering_emits_the_custom_call(monkeypatch, lowering_only):
    monkeypatch.setattr(runtime, "can_access_peer", lambda a, b: True)
    devs = np.array(jax.devices()[:4])[[2, 0, 3, 1]].reshape(2, 2)
    mesh = Mesh(devs, ("dp", "tp"))

    def body(x, w):
        y = jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=Config(backend="fused"))
        return jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=Config(backend="fused")) + y

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P(("dp", "tp"))
        )
    )
    x = jax.ShapeDtypeStruct((2 * 512, 2 * 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2 * 256, 384), jnp.bfloat16)
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if f"@{fused.GEMM_RS_TARGET}" in line]
    assert len(calls) == 2
    assert "reduce_scatter" not in text
    call = calls[0]
    # devices 2,0 form one tp group and 3,1 the other; ranks follow the tp position
    assert "ordinals = dense<[2, 0, 3, 1]>" in call
    assert "ranks = dense<[0, 1, 0, 1]>" in call
    assert "groups = dense<[2, 0, 2, 0, 3, 1, 3, 1]>" in call
    assert "n = 2" in call and "stall_rank" not in call


@pytest.mark.parametrize("tuned_sms,new_kernels", [(None, False), (0, True), (0, False)])
def test_comm_sms_0_is_the_copy_engine_reduce_scatter(
    monkeypatch, lowering_only, tuned_sms, new_kernels
):
    """Config(comm_sms=0), or a tuner entry with comm_sms 0 once new kernels are allowed: the
    copy-engine handler; the all-reduce has none and keeps its SM schedule. A tuner entry with
    comm_sms 0 while they are not allowed: the SM schedule's default."""
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", new_kernels)
    entry = dict(choice="fused", chunks=2, comm_sms=0, ms_xla=1.0, ms_fused=0.8)
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: entry if tuned_sms == 0 else None)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    cfg = Config(backend="fused", comm_sms=None if tuned_sms == 0 else 0)

    def body(x, w):
        y = jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)
        return y, jaxoverlap.matmul_all_reduce(x, w, "tp", config=cfg)

    specs = (P(None, "tp"), P("tp", None))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("tp"), P())))
    x = jax.ShapeDtypeStruct((1024, 2 * 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2 * 512, 384), jnp.bfloat16)
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    if tuned_sms == 0 and not new_kernels:
        assert f"@{fused.GEMM_RS_CE_TARGET}" not in text
        (rs,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TARGET}(" in ln]
        assert f"comm_sms = {fused.DEFAULT_COMM_SMS}" in rs
        return
    (ce,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_CE_TARGET}" in ln]
    assert "comm_sms = 0" in ce and "chunks = 2" in ce
    (ar,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_AR_TARGET}" in ln]
    assert f"comm_sms = {fused.DEFAULT_COMM_SMS}" in ar
    assert f"@{fused.GEMM_RS_TARGET}" not in text


def test_cuda_lowering_falls_back_without_peer_access(monkeypatch, lowering_only):
    monkeypatch.setattr(runtime, "can_access_peer", lambda a, b: False)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def body(x, w):
        return jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=Config(backend="fused"))

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp"))
    )
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot access GPU"):
        f.trace(x, w).lower(lowering_platforms=("cuda",))


def test_cuda_lowering_fuses_a_middle_dimension_after_size_1_dims(lowering_only):
    """[1, S, K] sequence parallelism (batch 1): the scattered S blocks are rows of x[..., K]."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def body(x, w):
        cfg = Config(backend="fused")
        y = jaxoverlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1, config=cfg)
        return jaxoverlap.all_gather_matmul(y, w.T[:, :256], "tp", gather_dimension=1, config=cfg)

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, None, "tp"), P("tp", None)),
            out_specs=P(None, None, "tp"),
        )
    )
    x = jax.ShapeDtypeStruct((1, 1024, 2 * 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2 * 256, 512), jnp.bfloat16)
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert f"@{fused.GEMM_RS_TARGET}" in text and f"@{fused.AG_GEMM_TARGET}" in text
    assert "reduce_scatter" not in text and "all_gather" not in text


def test_tile_schedule_reasons(native_ok, monkeypatch):
    """Config(schedule="tile"): bfloat16, rows per rank a multiple of 256 (a cluster's two
    128-row tiles); a clear reason otherwise. backend="auto" takes it only once kernels not yet
    measured on two GPUs are allowed, and then by the usual rule or the tuner."""
    tile = dict(backend="fused", schedule="tile")
    assert _reason((1024, 512), (512, 768), **tile) is None
    assert _reason((4, 256, 512), (512, 1000), **tile) is None  # batch dims, partial N tiles
    assert "bfloat16 only" in _reason((1024, 512), (512, 768), dtype=jnp.float16, **tile)
    why = _reason((2 * 384, 512), (512, 768), **tile)  # 384 rows per rank
    assert "rows per rank (384) must be a multiple of 256" in why and "chunked" in why
    assert _reason((2 * 384, 512), (512, 768), backend="fused") is None  # chunked runs it
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", False)
    why = _reason((8192, 4096), (4096, 8192), backend="auto", schedule="tile")
    assert "JAXOVERLAP_AUTO_NEW_KERNELS" in why
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", True)
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None)
    assert _reason((8192, 4096), (4096, 8192), backend="auto", schedule="tile") is None
    assert "conservative rule" in _reason((1024, 512), (512, 768), backend="auto", schedule="tile")


def test_tile_slot_bytes_match_the_handlers():
    """tile_rs_slot_bytes (ffi/kernels/tile_rs.cu): both parities of the block, one flag word per
    16 x 128 piece of it (whatever the menu entry's tile), rounded to 256 bytes. A mismatch would
    leave a workspace that spans processes unfound by its handler."""
    assert fused_tile.slot_bytes(256, 256) == 2 * 256 * 256 * 2 + 256  # 32 flags: 128 bytes
    assert fused_tile.slot_bytes(1024, 1000) == 2 * 1024 * 1000 * 2 + (64 * 8) * 4
    assert fused_tile.slot_bytes(4096, 4096) % 256 == 0


@pytest.mark.parametrize("how", ["config", "tuned", "tuned_not_allowed"])
def test_tile_schedule_lowering(monkeypatch, lowering_only, how):
    """Config(schedule="tile"), or a tuner entry that chose it once new kernels are allowed: one
    GEMM_RS_TILE_TARGET call with the default swizzle (a swizzle in the entry, which the tuner
    never writes, is not read), no chunks, no SMs of its own, and no collective left; the
    all-reduce keeps its schedule. A tuner entry for it while new kernels are not allowed: the
    chunked schedule."""
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", how == "tuned")
    entry = dict(
        choice="fused", chunks=1, comm_sms=0, schedule="tile", swizzle=2, ms_xla=1.0, ms_fused=0.8
    )
    monkeypatch.setattr(fused.policy, "tuned", lambda *a: None if how == "config" else entry)
    cfg = Config(backend="fused", schedule="tile" if how == "config" else None, timeout_s=9.0)
    mesh = Mesh(np.array(jax.devices()[:2])[::-1], ("tp",))

    def body(x, w):
        y = jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg)
        return y, jaxoverlap.matmul_all_reduce(x, w, "tp", config=cfg)

    specs = (P(None, "tp"), P("tp", None))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("tp"), P())))
    x = jax.ShapeDtypeStruct((1024, 2 * 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2 * 512, 384), jnp.bfloat16)
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    tile_calls = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TILE_TARGET}" in ln]
    if how == "tuned_not_allowed":
        assert not tile_calls
        assert any(f"@{fused.GEMM_RS_TARGET}(" in ln for ln in text.splitlines())
        return
    (call,) = tile_calls
    assert (
        f"(tensor<1024x512xbf16>, tensor<512x384xbf16>, {TOKEN}) -> (tensor<512x384xbf16>, {TOKEN})"
        in call
    ), call
    assert f"swizzle = {fused_tile.DEFAULT_SWIZZLE} " in call, call  # not the entry's 2
    assert "comm_sms = 0" in call and "chunks = 1" in call
    assert "timeout_s = 9.0" in call and "ordinals = dense<[1, 0]>" in call
    assert f"@{fused.GEMM_RS_TARGET}(" not in text and "reduce_scatter" not in text
    (ar,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_AR_TARGET}" in ln]
    assert f"comm_sms = {fused.DEFAULT_COMM_SMS}" in ar
