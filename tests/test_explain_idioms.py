"""explain tells the truth: for six public-code idioms (tests/idioms.py) and the patterns of
issue 27, its verdict per candidate -- fused or XLA's path -- is what the CUDA lowering then emits
(lowered from fake CPU devices for a Hopper/NVLink target, the `lowering_only` fixture), under
the default ``backend="auto"`` and under ``backend="fused"``; and every piece of near-miss
advice it prints, applied mechanically to the program (`apply_advice`), leaves the values
unchanged (and lets the pair be rewritten)."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from idioms import IDIOMS, PATTERNS
from jax import lax
from jax._src import core
from jax._src.mesh import get_abstract_mesh
from jax.sharding import PartitionSpec as P
from overlap_util import TOL, assert_tree_close, inputs, mesh_1d

from jaxoverlap import Config
from jaxoverlap.overlap import explain, overlap
from jaxoverlap.rewrite import advice, walk

CONFIGS = {"auto": None, "auto_new": None, "fused": Config(backend="fused")}


def _op_of(target):
    for key, op in (("gemm_ar", "matmul_all_reduce"), ("ag_gemm", "all_gather_matmul"),
                    ("gemm_rs", "matmul_reduce_scatter")):  # fmt: skip
        if key in target:
            return op
    raise AssertionError(target)


def fused_calls(f, args, config):
    """The jaxoverlap custom calls in ``overlap(f)`` lowered for CUDA, by target name."""
    lowered = jax.jit(overlap(f, config=config)).trace(*args).lower(lowering_platforms=("cuda",))
    names = re.findall(r"stablehlo.custom_call @(jaxoverlap_\w+)", lowered.as_text())
    return collections.Counter(names)


def verdicts(f, args, config):
    """explain's candidates, and the kernels it names for those it says run fused."""
    n = args[0].sharding.mesh.devices.size
    found = explain(f, *args, target=f"{n}xH200", config=config)
    fused = [c for c in found if c.path.startswith("fused")]
    assert all(_op_of(c.kernel) == c.op for c in fused), found  # (each names its op's kernel)
    return found, collections.Counter(c.kernel.split(" ")[0] for c in fused)


CASES = {**IDIOMS, **PATTERNS}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", list(CASES))
def test_explain_verdict_is_what_lowering_emits(lowering_only, monkeypatch, case, config):
    from jaxoverlap import fused

    # auto_new: JAXOVERLAP_AUTO_NEW_KERNELS=1 (the norm across K then rewrites under auto)
    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", config == "auto_new")
    f, args = CASES[case]()
    found, predicted = verdicts(f, args, CONFIGS[config])
    assert fused_calls(f, args, CONFIGS[config]) == predicted, found  # the same kernels
    if config == "fused":  # every pair the ops rewrite has a kernel here: it is named fused
        assert all(c.path.startswith("fused") for c in found if c.rewritten), found
    assert predicted or config != "fused" or case == "mixed_dtypes"  # (f32: no kernel)
    if (case, config) == ("seqax", "auto_new"):
        assert "norm across K" in found[0].note and predicted, found


@pytest.mark.parametrize(
    "config, kernel, how",
    [
        (Config(backend="fused", comm_sms=0), "jaxoverlap_gemm_rs_ce_v2", "copy engine"),
        (Config(backend="fused", schedule="tile"), "jaxoverlap_gemm_rs_tile_v2", "tile"),
        (Config(backend="fused", chunks=1, comm_sms=8), "jaxoverlap_gemm_rs_v2", "1 chunk(s)"),
    ],
)
def test_explain_names_the_kernel_and_schedule_lowering_emits(lowering_only, config, kernel, how):
    """The settings choose among the reduce-scatter's kernels; explain names the one lowering
    emits (`fused.dispatch.kernel`: `policy.rows_setting`, as the lowering takes it)."""
    f, args = CASES["llama3"]()  # (a reduce-scatter over rows: every schedule serves it)
    found, predicted = verdicts(f, args, config)
    assert fused_calls(f, args, config) == predicted == {kernel: 1}, found
    (c,) = [c for c in found if c.kernel]
    assert how in c.kernel and f"kernel: {c.kernel}" in str(c), c


def test_explain_names_the_tuned_schedule(tmp_path, monkeypatch):
    """A tuning cache's entry picks the tile schedule (auto, new kernels allowed): explain, on a
    named target with that cache, names the tile kernel and the entry it came from."""
    from jaxoverlap import fused, tune
    from jaxoverlap.target import KINDS

    monkeypatch.setattr(fused.policy, "AUTO_NEW_KERNELS", True)
    f, args = CASES["llama3"]()
    target = f"{args[0].sharding.mesh.devices.size}xH200"
    (c,) = [c for c in explain(f, *args, target=target) if c.rewritten]
    assert c.path.startswith("fused (untuned") and "SMs pushing by TMA" in c.kernel, c
    m, k, _, n_cols = map(
        int, re.search(r"\[(\d+),(\d+)\]\S* @ \S+\[(\d+),(\d+)\]", c.detail).groups()
    )
    tp = int(target[0])
    cache = str(tmp_path / "tune.json")
    key = tune.Key("matmul_reduce_scatter", m, k, n_cols, "bfloat16", tp, KINDS["H200"])
    entry = dict(choice="fused", chunks=1, comm_sms=4, ms_xla=1.0, ms_fused=0.7, schedule="tile")
    tune.record(key, entry, cache)
    (c,) = [c for c in explain(f, *args, target=target, tuning_cache=cache) if c.rewritten]
    assert c.path == "fused (tuned: 0.700 ms fused vs 1.000 ms XLA)", c
    assert c.kernel == "jaxoverlap_gemm_rs_tile_v2 (the tile schedule)", c


# ----------------------------------------------------------------------------- advice, applied


def _bind(e, vals, params=None):
    out = e.primitive.bind(*vals, **e.primitive.get_bind_params(params or e.params))
    return out if e.primitive.multiple_results else [out]


def apply_advice(jaxpr, consts, args, advices):
    """Evaluate ``jaxpr`` with every `Advice` applied: an "after" equation redone on the
    collective's result (with the replicated operands it names), a "before" region computed
    on the local block (shapes divided along the gathered dimension) and gathered into the
    matmuls that consumed it."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    eqns = jaxpr.eqns

    def read(a, scope=env):
        return a.val if isinstance(a, core.Literal) else scope.get(a, env.get(a))

    skip = {a.moved[0]: a for a in advices if a.kind == "after"}
    after = {a.coll: a for a in advices if a.kind == "after"}
    before = {a.coll: a for a in advices if a.kind == "before"}
    local = {a.coll: {} for a in before.values()}
    for i, e in enumerate(eqns):
        vals = [read(a) for a in e.invars]
        if e.primitive.name == "dot_general":  # consumes a region moved before its gather
            for c, loc in local.items():
                coll = eqns[c]
                for k, a in enumerate(e.invars):
                    if isinstance(a, core.Var) and a in loc and a is not coll.outvars[0]:
                        vals[k] = lax.all_gather(loc[a], coll.params["axis_name"],
                                                 axis=before[c].out_dim, tiled=True)  # fmt: skip
        if i in skip:  # moved after the collective: pass the matmul's result through
            (src,) = [a for a, o in zip(e.invars, skip[i].operands, strict=True) if o is None]
            env[e.outvars[0]] = read(src)
            continue
        for v, o in zip(e.outvars, _bind(e, vals), strict=True):
            env[v] = o
        if i in after:
            b = eqns[after[i].moved[0]]
            ops = [env[e.outvars[0]] if o is None else read(o) for o in after[i].operands]
            env[e.outvars[0]] = _bind(b, ops)[0]
        if i in before:
            local[i][e.outvars[0]] = read(e.invars[0])
        for c, adv in before.items():
            if i in adv.moved:
                coll = eqns[c]
                n, full = coll.params["axis_size"], coll.outvars[0].aval.shape[
                    coll.params["all_gather_dimension"]]  # fmt: skip
                p = adv.dims[adv.moved.index(i)]
                params = dict(e.params)
                if "shape" in params:
                    params["shape"] = tuple(s // n if k == p and s == full else s
                                            for k, s in enumerate(params["shape"]))  # fmt: skip
                lvals = [read(a, local[c]) for a in e.invars]
                local[c][e.outvars[0]] = _bind(e, lvals, params)[0]
    return [read(v) for v in jaxpr.outvars]


def advised(body, in_specs, out_specs):
    """``body`` with its near misses' advice applied (there must be some)."""

    def new_body(*args):
        closed = jax.make_jaxpr(body)(*args)
        manual = frozenset(get_abstract_mesh().manual_axes)
        advices = [m.advice for m in walk.find_matches(closed.jaxpr, manual) if m.advice]
        assert advices, "no advice to apply"
        (out,) = apply_advice(closed.jaxpr, closed.consts, args, advices)
        return out

    return jax.shard_map(new_body, mesh=mesh_1d(), in_specs=in_specs, out_specs=out_specs)


def _ag(x, axis=0):
    return lax.all_gather(x, "tp", axis=axis, tiled=True)


def _llama_norm(x, scale, w1, w2):  # RMSNorm of gathered rows, two projections
    h = _ag(x)
    h = h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * scale
    return (h @ w1) * jnp.tanh(h @ w2)


def _llama_norm_cast_after(x, scale, w1, w2):  # the scale typed varying after its broadcast
    h = _ag(x)  # (jax 0.11 orders it so itself: pvary(broadcast_in_dim(scale)); 0.12 casts first)
    s = lax.pcast(lax.broadcast_in_dim(scale, (1, scale.shape[0]), (1,)), "tp", to="varying")
    h = h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * s
    return (h @ w1) * jnp.tanh(h @ w2)


ROWS = (P("tp", None), P(), P(None, "tp"), P(None, "tp"))
ROW_PAR = (P(None, "tp"), P("tp", None))
# body, in specs, out spec, shapes, the op the advice lets the rewrite use, and whether the
# advice says the moved program is exact (the same bits; else the same within rounding)
ADVISED = {
    "norm_of_gathered_rows": (_llama_norm, ROWS, P(None, "tp"),
                              [(32, 16), (16,), (16, 32), (16, 32)], "all_gather_matmul", False),
    "norm_scale_cast_after_broadcast": (_llama_norm_cast_after, ROWS, P(None, "tp"),
                                        [(32, 16), (16,), (16, 32), (16, 32)],
                                        "all_gather_matmul", False),
    "tanh_of_gathered_rows": (lambda x, w: jnp.tanh(_ag(x)) @ w, ROWS[::2], P(None, "tp"),
                              [(32, 16), (16, 32)], "all_gather_matmul", True),
    "replicated_scale_before_psum": (lambda x, w: lax.psum((x @ w) * 0.3, "tp"), ROW_PAR, P(),
                                     [(16, 32), (32, 8)], "matmul_all_reduce", False),
    "sum_before_psum": (lambda x, w: lax.psum(jnp.sum(x @ w, axis=0), "tp"), ROW_PAR, P(),
                        [(16, 32), (32, 8)], None, False),
    "slice_before_psum": (lambda x, w: lax.psum((x @ w)[:, 1:5], "tp"), ROW_PAR, P(),
                          [(16, 32), (32, 8)], "matmul_all_reduce", True),
    "negation_before_scatter": (
        lambda x, w: lax.psum_scatter(-(x @ w), "tp", scatter_dimension=0, tiled=True),
        ROW_PAR, P("tp"), [(16, 32), (32, 8)], "matmul_reduce_scatter", True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ADVISED))
def test_printed_advice_applied_mechanically_keeps_the_values(case):
    """The values of the advised program: the same bits where the advice says "exactly", within
    float32 rounding where it says "within rounding" (and it says which it is)."""
    body, in_specs, out_specs, shapes, op, exact = ADVISED[case]
    f = jax.shard_map(body, mesh=mesh_1d(), in_specs=in_specs, out_specs=out_specs)
    args = inputs(mesh_1d(), list(zip(shapes, in_specs, strict=True)))
    found = [c for c in explain(f, *args) if c.kind == "near miss"]
    assert found and all(re.search(r"apply (it|them|the)|after the collective", c.reason)
                         for c in found), found  # fmt: skip
    says = advice.EXACTLY if exact else advice.WITHIN_ROUNDING
    assert all(says in c.reason for c in found), found
    g = advised(body, in_specs, out_specs)
    got, want = jax.jit(g)(*args), jax.jit(f)(*args)
    if exact:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        assert_tree_close(got, want, TOL[jnp.float32])
    if op is not None:  # and the pair is then rewritten
        assert any(c.op == op and c.rewritten for c in explain(g, *args)), op


def test_advice_is_printed_only_with_an_equal_move():
    """Every near miss of the idioms and of the near-miss table: advice text exactly where the
    matcher holds an `Advice` (the one `apply_advice` applies)."""
    import test_overlap_near_miss as nm

    bodies = [(b, s, o, [(16, 32), (32, 8)]) for b, s, o, *_ in nm.NEAR.values()]
    bodies += [(b, s, o, sh) for b, s, o, sh, *_ in ADVISED.values()]
    for body, in_specs, out_specs, shapes in bodies:
        args = inputs(mesh_1d(), list(zip(shapes, in_specs, strict=True)))

        def check(*args, body=body):
            closed = jax.make_jaxpr(body)(*args)
            for m in walk.find_matches(closed.jaxpr, frozenset(get_abstract_mesh().manual_axes)):
                if m.kind == "near miss":
                    says = bool(re.search(r"apply (it|them|the)|after the collective", m.reason))
                    assert says == (m.advice is not None), m.reason
                    if says:  # and how the values compare, as the advice holds it
                        exact = advice.EXACTLY in m.reason
                        assert exact != (advice.WITHIN_ROUNDING in m.reason), m.reason
                        assert exact == m.advice.exact, m.reason
            return body(*args)

        jax.jit(jax.shard_map(check, mesh=mesh_1d(), in_specs=in_specs,
                              out_specs=out_specs)).trace(*args)  # fmt: skip


# ----------------------------------------------------------------------------- targets


def test_without_gpus_explain_predicts_for_a_named_target(capsys, monkeypatch):
    from jaxoverlap import target

    no_gpu = target.Target("this machine", 0, None, False)
    monkeypatch.setattr(target, "live", lambda tuning_cache=None: no_gpu)  # (as in CI)
    f, args = IDIOMS["scaling_book"]()
    found = explain(f, *args)  # this machine has no GPU: the default named target
    out = capsys.readouterr().out
    assert "2xH200" in out.splitlines()[0] and "a prediction" in out.splitlines()[0], out
    assert "native extension" not in out
    assert [c.path.split(" ")[0] for c in found] == ["fused", "fused"], found
    with pytest.raises(ValueError, match="unknown target"):
        explain(f, *args, target="2xA100")


def test_explain_reads_the_cluster_tuning_cache(tmp_path):
    """A laptop with the cluster's cache: a measured loss keeps XLA's path inside the rule, a
    measured win takes the fused path outside it; both say so."""
    from jaxoverlap import tune
    from jaxoverlap.target import KINDS

    cache = str(tmp_path / "tune-cluster.json")
    key = tune.Key("matmul_reduce_scatter", 4096, 4096, 4096, "bfloat16", 2, KINDS["H200"])
    tune.record(key, dict(choice="xla", chunks=0, comm_sms=0, ms_xla=1.0, ms_fused=1.1), cache)
    key = tune.Key("all_gather_matmul", 4096, 4096, 4096, "bfloat16", 2, KINDS["H200"])
    tune.record(key, dict(choice="fused", chunks=1, comm_sms=0, ms_xla=1.0, ms_fused=0.8), cache)
    f, args = IDIOMS["scaling_book"]()
    ag, rs = explain(f, *args, target="2xH200", tuning_cache=cache)
    assert ag.path == "fused (tuned: 0.800 ms fused vs 1.000 ms XLA)", ag.path
    assert rs.path.startswith("reference: backend='auto': tuned, XLA's path measured"), rs.path
