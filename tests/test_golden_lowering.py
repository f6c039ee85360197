"""Golden lowering: every op and variant lowers, for CUDA on fake CPU devices, to exactly the
jaxoverlap custom calls recorded in tests/golden/custom_calls.json -- target name, operand and
result types, every attribute (backend_config: group table, settings, workspace key ``site``,
call tag, knobs; operand/result layouts; api version), in program order -- and leaves the same
XLA collectives. It pins the FFI contract (target names, operands, attributes, key hashes) across
refactors of the Python side: a change there that alters what the handlers receive fails here.

Lowering needs no GPU and no native extension: the custom call is emitted by name, and the
extension's device queries are stood in for (Hopper GPUs joined by NVLink), as the other lowering
tests do (tests/conftest.py `lowering_only`). So the test runs everywhere, built or not.

A target change is made deliberately, as a new ``_v2`` target, and the golden file is updated in
the same commit: ``JAXOVERLAP_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_lowering.py``
rewrites it (then review the diff).

The test reaches no module-internal name: knobs that stand in for the tuner's cache and the
``JAXOVERLAP_AUTO_NEW_KERNELS`` opt-in are patched wherever a jaxoverlap module holds them
(`_patch`), so moving code between modules leaves this test unchanged.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fake_processes import as_process, two_processes
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden" / "custom_calls.json"
UPDATE = os.environ.get("JAXOVERLAP_UPDATE_GOLDEN") == "1"
BF16 = jnp.bfloat16
FUSED = Config(backend="fused")
COPY_ENGINE = Config(backend="fused", comm_sms=0)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute")
_CALL = re.compile(
    r"stablehlo\.custom_call @(jaxoverlap_\w+)\((.*?)\) (\{.*\}) : \((.*)\) -> (.*)$"
)


def _patch(monkeypatch, name, value):
    """Set ``name`` in every loaded jaxoverlap module that holds it (wherever the code keeps it)."""
    hit = False
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("jaxoverlap") and mod is not None and hasattr(mod, name):
            monkeypatch.setattr(mod, name, value)
            hit = True
    assert hit, f"no jaxoverlap module holds {name}"


def _types(text):
    """Split ``tensor<..>, !stablehlo.token`` (or one type, or a parenthesised tuple) into
    types (the order token is every _v2 call's last operand and last result)."""
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    return re.findall(r"tensor<[^>]*>|!stablehlo\.token", text)


def _attributes(text):
    """``{a = 1 : i32, backend_config = {...}, ...}`` -> {name: value text}, nested one level
    for backend_config (so a diff names the attribute that changed)."""
    body = text.strip()[1:-1]
    out, depth, start, key = {}, 0, 0, None
    items = []
    for i, ch in enumerate(body):
        if ch in "{[<(":
            depth += 1
        elif ch in "}]>)":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    for item in items:
        key, _, value = item.strip().partition(" = ")
        value = value.strip()
        out[key] = _attributes(value) if value.startswith("{") else value
    return out


def _record(text):
    """The jaxoverlap custom calls of a lowered module (in order) and the collectives left."""
    calls = []
    for line in text.splitlines():
        if "stablehlo.custom_call @jaxoverlap_" not in line:
            continue
        m = _CALL.search(line.strip())
        assert m, line
        target, _, attrs, operands, results = m.groups()
        calls.append(
            dict(
                target=target,
                operands=_types(operands),
                results=_types(results),
                attributes=_attributes(attrs),
            )
        )
    left = sorted({c for c in COLLECTIVES if f"stablehlo.{c}" in text})
    return dict(calls=calls, collectives=left)


def _lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, BF16)


def _mesh(n=2, order=None):
    devs = np.array(jax.devices()[:n])
    return Mesh(devs if order is None else devs[order], ("tp",))


def _dp_tp_mesh():
    devs = np.array(jax.devices()[:4])[[2, 0, 3, 1]].reshape(2, 2)
    return Mesh(devs, ("dp", "tp"))


def _sum_sq(f):
    return lambda *a: sum(jnp.sum(y.astype(jnp.float32) ** 2) for y in jax.tree.leaves(f(*a)))


# ----------------------------------------------------------------------------- the cases


def rs(x_shape, w_shape, cfg=FUSED, dim=0, mesh=None, axis="tp"):
    mesh = mesh or _mesh()
    nd = len(x_shape)
    x_spec = P(*([None] * (nd - 1)), "tp")
    out = [None] * nd
    out[dim] = ("dp", "tp") if "dp" in mesh.axis_names else "tp"
    if "dp" in mesh.axis_names:
        x_spec = P("dp", *([None] * (nd - 2)), "tp")

    def body(x, w):
        return jaxoverlap.matmul_reduce_scatter(x, w, axis, scatter_dimension=dim, config=cfg)

    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P("tp", None)), out_specs=P(*out))
    return _lower(f, _sds(*x_shape), _sds(*w_shape))


def ar(x_shape, w_shape, cfg=FUSED):
    mesh = _mesh(order=[1, 0])
    x_spec = P(*([None] * (len(x_shape) - 1)), "tp")

    def body(x, w):
        return jaxoverlap.matmul_all_reduce(x, w, "tp", config=cfg)

    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P("tp")), out_specs=P())
    return _lower(f, _sds(*x_shape), _sds(*w_shape))


def ag(x_shape, w_shape, cfg=FUSED, dim=0, mesh=None):
    mesh = mesh or _mesh()
    nd = len(x_shape)
    x_spec = [None] * nd
    x_spec[dim] = "tp"
    out_spec = P(*([None] * (nd - 1)), "tp")
    if dim == nd - 1:
        out_spec = P(*x_spec)

    def body(x, w):
        return jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=dim, config=cfg)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(*x_spec), P(None, "tp")), out_specs=out_spec)
    return _lower(f, _sds(*x_shape), _sds(*w_shape))


def training(dim=0, cfg=FUSED, shapes=((2 * 512, 256), (256, 2 * 384), (2 * 384, 256))):
    """A column- then row-parallel layer's train step: keep variant (forward), forward
    reduce-scatter, keep variant on the cotangent, the column-parallel backward."""
    mesh = _mesh()

    def layer(x, w1, w2):
        h = jaxoverlap.all_gather_matmul(x, w1, "tp", gather_dimension=dim, config=cfg)
        return jaxoverlap.matmul_reduce_scatter(h, w2, "tp", scatter_dimension=dim, config=cfg)

    nd = len(shapes[0])
    row = [None] * nd
    row[dim] = "tp"
    specs = (P(*row), P(None, "tp"), P("tp", None))
    f = jax.shard_map(layer, mesh=mesh, in_specs=specs, out_specs=P(*row))
    return _lower(jax.grad(_sum_sq(f), argnums=(0, 1, 2)), *(_sds(*s) for s in shapes))


def several_weights():
    """all_gather_matmul(x, [w0, w1]) trained: one keep gather, the backward with the addend."""
    mesh = _mesh()

    def body(x, ws):
        return jaxoverlap.all_gather_matmul(x, ws, "tp", config=FUSED)

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("tp"), [P(None, "tp")] * 2), out_specs=(P(None, "tp"),) * 2
    )
    ws = [_sds(256, 2 * n) for n in (384, 128)]
    return _lower(jax.grad(_sum_sq(f), argnums=(0, 1)), _sds(2 * 512, 256), ws)


def transposed_weight_k(monkeypatch):
    """dx of the all-gather along K: the last-dimension reduce-scatter with w.T read in place."""
    _patch(monkeypatch, "AUTO_NEW_KERNELS", True)
    _patch(monkeypatch, "_auto_reason", lambda *a: None)
    mesh = _mesh()

    def body(x, w):
        cfg = Config(backend="auto")
        return jaxoverlap.all_gather_matmul(x, w, "tp", gather_dimension=-1, config=cfg)

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, "tp")
    )
    g = jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32)), argnums=0)
    return _lower(g, _sds(1024, 2 * 512), _sds(2 * 512, 2 * 768))


def tma_rs(shape=(2 * 1024, 512), **kw):
    try:
        tma = importlib.import_module("jaxoverlap.fused.tma")
    except ImportError:
        tma = importlib.import_module("jaxoverlap.tma")
    mesh = _dp_tp_mesh()

    def body(x):
        return tma.tma_reduce_scatter(x, "tp", **kw)

    f = jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P(("dp", "tp")))
    return _lower(f, _sds(*shape))


def knobs(which):
    """The test-only and tool-only knobs reach the calls' attributes (stall_rank, profile), on
    the targets' ``_knobs`` twins only (D17): a call the knob does not name stays production."""
    fused = importlib.import_module("jaxoverlap.fused")
    ctx = {
        "stall": lambda: fused._stalled_rank_for_tests(1, fused.GEMM_AR_TARGET),
        "failed": lambda: fused._failed_rank_for_tests(0),
        "gemm_only": fused._gemm_only_for_tools,
    }[which]
    mesh = _mesh()

    def body(x, w):
        y = jaxoverlap.matmul_all_reduce(x, w, "tp", config=FUSED)
        return y, jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=FUSED)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=(P(), P("tp")))
    with ctx():
        return _lower(f, _sds(1024, 512), _sds(512, 384))


def cross_process(monkeypatch, process, op):
    """2 processes x 2 GPUs, ``tp`` pairing one GPU of each: the local-row form of the group
    table (members of the other process as -1 - global id) and the exchanged workspace."""
    mesh = two_processes(monkeypatch)
    as_process(monkeypatch, process)
    if op == "rs":

        def body(x, w):
            return jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=FUSED)

        specs = dict(in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P(("dp", "tp")))
        args = _sds(2 * 2048, 2 * 1024), _sds(2 * 1024, 1536)
    else:

        def body(x, w):
            return jaxoverlap.all_gather_matmul(x, w, "tp", config=FUSED)

        specs = dict(in_specs=(P(("dp", "tp")), P(None, "tp")), out_specs=P("dp", "tp"))
        args = _sds(4 * 256, 512), _sds(512, 2 * 384)
    return _lower(jax.shard_map(body, mesh=mesh, **specs), *args)


def _tuned(monkeypatch, entry, new_kernels=False):
    _patch(monkeypatch, "AUTO_NEW_KERNELS", new_kernels)
    _patch(monkeypatch, "tuned", lambda *a: entry)


CHUNKED = dict(choice="fused", chunks=2, comm_sms=8, ms_xla=1.0, ms_fused=0.8)
TILE = dict(
    choice="fused", chunks=1, comm_sms=0, schedule="tile", swizzle=2, ms_xla=1, ms_fused=0.8
)
CE = dict(choice="fused", chunks=4, comm_sms=0, ms_xla=1.0, ms_fused=0.8)

CASES = {
    # matmul_reduce_scatter over rows: the chunked SM-partition schedule
    "rs/rows": lambda mp: rs((2 * 512, 2 * 256), (2 * 256, 384), mesh=_dp_tp_mesh()),
    "rs/rows_settings": lambda mp: rs(
        (1024, 2 * 512), (2 * 512, 768), Config(backend="fused", chunks=2, comm_sms=8, timeout_s=7)
    ),
    "rs/rows_3d": lambda mp: rs((4, 256, 2 * 512), (2 * 512, 768)),
    "rs/middle_dim": lambda mp: rs((4, 2 * 256, 2 * 512), (2 * 512, 768), dim=1),
    "rs/middle_dim_batch1": lambda mp: rs((1, 1024, 2 * 256), (2 * 256, 512), dim=1),
    "rs/last_dim": lambda mp: rs((1024, 2 * 512), (2 * 512, 768), dim=1),
    "rs/last_dim_3d": lambda mp: rs((2, 512, 2 * 512), (2 * 512, 2 * 512), dim=2),
    "rs/copy_engine": lambda mp: rs(
        (1024, 2 * 512), (2 * 512, 384), Config(backend="fused", comm_sms=0)
    ),
    "rs/tile": lambda mp: rs(
        (1024, 2 * 512), (2 * 512, 384), Config(backend="fused", schedule="tile", timeout_s=9)
    ),
    "rs/tile_3d": lambda mp: rs(
        (2, 512, 2 * 512), (2 * 512, 1000), Config(backend="fused", schedule="tile")
    ),
    "rs/tuned_chunked": lambda mp: (
        _tuned(mp, CHUNKED),
        rs((1024, 2 * 512), (2 * 512, 768), Config(backend="auto")),
    )[1],
    "rs/tuned_tile": lambda mp: (
        _tuned(mp, TILE, new_kernels=True),
        rs((1024, 2 * 512), (2 * 512, 384), Config(backend="auto")),
    )[1],
    "rs/tuned_copy_engine": lambda mp: (
        _tuned(mp, CE, new_kernels=True),
        rs((1024, 2 * 512), (2 * 512, 384), Config(backend="auto")),
    )[1],
    "rs/tuned_copy_engine_not_allowed": lambda mp: (
        _tuned(mp, CE, new_kernels=False),
        rs((1024, 2 * 512), (2 * 512, 384), Config(backend="fused")),
    )[1],
    "rs/auto_rule": lambda mp: (
        _tuned(mp, None),
        rs((8192, 2 * 4096), (2 * 4096, 8192), Config(backend="auto")),
    )[1],
    # matmul_all_reduce: one call, the reduce-scatter's schedule plus the gather
    "ar/rows": lambda mp: ar((1024, 2 * 256), (2 * 256, 384)),
    "ar/rows_3d_settings": lambda mp: ar(
        (4, 256, 2 * 256), (2 * 256, 384), Config(backend="fused", chunks=4, comm_sms=8)
    ),
    "ar/copy_engine_config": lambda mp: ar(
        (1024, 2 * 256), (2 * 256, 384), Config(backend="fused", comm_sms=0)
    ),
    # all_gather_matmul: rows, middle dimension, along K
    "ag/rows": lambda mp: ag((2 * 256, 512), (512, 2 * 384), mesh=_dp_tp_mesh()),
    "ag/rows_3d": lambda mp: ag((2 * 2, 256, 512), (512, 2 * 384)),
    "ag/rows_chunks": lambda mp: ag(
        (2 * 512, 512), (512, 2 * 384), Config(backend="fused", chunks=2, timeout_s=5)
    ),
    "ag/middle_dim": lambda mp: ag((4, 2 * 256, 512), (512, 2 * 384), dim=1),
    "ag/along_k": lambda mp: ag((1024, 2 * 256), (2 * 256, 2 * 384), dim=1),
    "ag/along_k_3d": lambda mp: ag((2, 512, 2 * 256), (2 * 256, 2 * 384), dim=2),
    "ag/tuned": lambda mp: (
        _tuned(mp, dict(CHUNKED, comm_sms=None)),
        ag((4096, 4096), (4096, 2 * 2048), Config(backend="auto")),
    )[1],
    # the training path: keep variant, backward of the reduce-scatter, dgrad_rs_wgrad
    "train/rows": lambda mp: training(),
    "train/middle_dim": lambda mp: training(
        dim=1, shapes=((4, 2 * 256, 512), (512, 2 * 384), (2 * 384, 512))
    ),
    "train/several_weights_acc": lambda mp: several_weights(),
    "train/transposed_weight_along_k": transposed_weight_k,
    # the standalone TMA reduce-scatter
    "tma_rs/default": lambda mp: tma_rs(),
    "tma_rs/settings": lambda mp: tma_rs((2 * 256, 384), comm_sms=8, chunks=2, timeout_s=3.0),
    # knobs reaching the attributes
    "knobs/stall_one_target": lambda mp: knobs("stall"),
    "knobs/failed_rank": lambda mp: knobs("failed"),
    "knobs/gemm_only": lambda mp: knobs("gemm_only"),
    # a group spanning processes: local rows, workspace exchanged
    "xproc/rs_process0": lambda mp: cross_process(mp, 0, "rs"),
    "xproc/rs_process1": lambda mp: cross_process(mp, 1, "rs"),
    "xproc/ag_process0": lambda mp: cross_process(mp, 0, "ag"),
}


def _load():
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def test_golden_covers_every_case_and_target():
    """The golden file holds exactly these cases, and among them every jaxoverlap FFI target."""
    if UPDATE:
        pytest.skip("rewriting the golden file")
    golden = _load()
    assert sorted(golden) == sorted(CASES), "run with JAXOVERLAP_UPDATE_GOLDEN=1 and review"
    targets = {c["target"] for g in golden.values() for c in g["calls"]}
    # The knobs' twins (D17) only where a knob is set, and no production call carries a knob.
    for case, g in golden.items():
        for c in g["calls"]:
            assert case.startswith("knobs/") or not c["target"].endswith("_knobs"), (case, c)
            knobs = {"stall_rank", "profile"} & set(c["attributes"]["mhlo.backend_config"])
            assert bool(knobs) == c["target"].endswith("_knobs"), c
            assert c["operands"][-1] == c["results"][-1] == "!stablehlo.token", c
    targets = {t for t in targets if not t.endswith("_knobs")}
    assert targets == {
        "jaxoverlap_gemm_rs_v2",
        "jaxoverlap_gemm_ar_v2",
        "jaxoverlap_gemm_rs_ce_v2",
        "jaxoverlap_gemm_rs_tile_v2",
        "jaxoverlap_ag_gemm_v2",
        "jaxoverlap_ag_gemm_keep_v2",
        "jaxoverlap_ag_gemm_k_v2",
        "jaxoverlap_dgrad_rs_wgrad_v2",
        "jaxoverlap_dgrad_rs_wgrad_acc_v2",
        "jaxoverlap_rs_v2",
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_lowering_matches_golden(lowering_only, monkeypatch, case):
    """The order's token form (ORDER_FORM="token"): the `_v2` targets, token last."""
    from jaxoverlap.fused import call

    monkeypatch.setattr(call, "ORDER_FORM", "token")
    _patch(monkeypatch, "tuned", lambda *a: None)  # off GPU it is None anyway; made explicit
    _patch(monkeypatch, "AUTO_NEW_KERNELS", False)
    got = _record(CASES[case](monkeypatch))
    assert got["calls"], f"{case}: no jaxoverlap custom call was emitted"
    if UPDATE:
        golden = _load()
        golden[case] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
        return
    want = _load().get(case)
    assert want is not None, f"{case} is not in {GOLDEN.name}: JAXOVERLAP_UPDATE_GOLDEN=1"
    assert got == want


GOLDEN_V1 = GOLDEN.with_name("custom_calls_v1.json")


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_lowering_is_the_v1_contract(lowering_only, monkeypatch, case):
    """With the order token off -- the default (jaxoverlap/fused/call.py ORDER_CALLS; the CPU
    suite turns it on) -- every case lowers to the ``_v1`` targets exactly as before issue 26:
    tests/golden/custom_calls_v1.json is the golden file of 2026-12-02 before the token
    (9ea46a7), changed since only where the lowering meant to (the tuned tile call's swizzle)."""
    from jaxoverlap.fused import call

    monkeypatch.setattr(call, "ORDER_CALLS", False)
    _patch(monkeypatch, "tuned", lambda *a: None)
    _patch(monkeypatch, "AUTO_NEW_KERNELS", False)
    jax.clear_caches()  # traces of the same functions with the token on would be reused
    try:
        got = _record(CASES[case](monkeypatch))
    finally:
        jax.clear_caches()
    if UPDATE:
        golden = json.loads(GOLDEN_V1.read_text()) if GOLDEN_V1.exists() else {}
        golden[case] = got
        GOLDEN_V1.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
        return
    want = json.loads(GOLDEN_V1.read_text()).get(case)
    assert want is not None, f"{case} is not in {GOLDEN_V1.name}: JAXOVERLAP_UPDATE_GOLDEN=1"
    assert got == want
    for c in got["calls"]:
        assert c["target"].endswith("_v1") and "!stablehlo.token" not in c["operands"], c
        # the name tests and tools look for in HLO text (fused.emitted) is the emitted one
        assert jaxoverlap.fused.emitted(c["target"][: -len("_v1")] + "_v2") == c["target"], c


@pytest.mark.parametrize("case", sorted(CASES))
def test_barrier_form_calls_are_the_v1_contract(lowering_only, monkeypatch, case):
    """The order's barrier form (jaxoverlap/fused/call.py ORDER_FORM, the default) changes nothing
    the handlers receive: each case emits as many calls as with the token (custom_calls.json),
    and the ``_v1`` golden file's calls among them exactly (the order off, JAX drops a fused call
    whose results are unused, as in a grad that needs no forward values; an effect keeps it);
    the order is two optimization barriers per call around it, the token in each."""
    from jaxoverlap.fused import call

    monkeypatch.setattr(call, "ORDER_FORM", "barrier")
    _patch(monkeypatch, "tuned", lambda *a: None)
    _patch(monkeypatch, "AUTO_NEW_KERNELS", False)
    text = CASES[case](monkeypatch)
    got = _record(text)["calls"]
    assert len(got) == len(_load()[case]["calls"])
    want = json.loads(GOLDEN_V1.read_text())[case]["calls"]
    it = iter(got)
    assert all(any(c == w for c in it) for w in want), "the v1 calls are not among them"
    barriers = [ln for ln in text.splitlines() if "stablehlo.optimization_barrier" in ln]
    assert len(barriers) == 2 * len(got) and all("!stablehlo.token" in ln for ln in barriers)
