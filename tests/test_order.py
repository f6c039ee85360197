"""Issue 26, R2: every fused call of a device is ordered after the previous one and before the
next, in program order, by a token XLA's schedulers must respect (jaxoverlap/fused/call.py,
`FusedOrder`), on CPU with 8 fake devices:

* the jaxpr shows the effect, for every fused primitive;
* in the module lowered for CUDA, each jaxoverlap custom call takes a token as its last operand
  and returns one as its last result, and the token of call k reaches call k + 1 and no other
  fused call -- at the top level, in scan, cond, shard_map, remat and grad (forward and backward
  calls) -- followed through the regions and calls of the module (`token_sources`);
* a multi-device jit with the effect runs, compiled ahead of time too (`FusedDispatch`), and
  values and gradients equal the reference's (the reference lowering forwards the token);
* under CONCURRENT command buffers the targets are kept out of command buffers, with one warning
  (`jaxoverlap.runtime.command_buffers`).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.lib.mlir import ir
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused, reference, runtime

FUSED = Config(backend="fused")
AUTO = Config(backend="auto")  # off GPUs: the reference path, with the same effect


def _mesh():
    return Mesh(np.array(jax.devices()[:2]), ("tp",))


def fused_ops(cfg):
    """(reduce-scatter, all-gather) as jaxoverlap ops with ``cfg``."""
    return (
        lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg),
        lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp", config=cfg),
    )


# The same programs in plain JAX (jaxoverlap.reference: lax.psum_scatter / all_gather + dots).
PLAIN = (
    lambda x, w: reference.matmul_reduce_scatter(x, w, "tp"),
    lambda x, w: reference.all_gather_matmul(x, w, "tp"),
)


# ----------------------------------------------------------------------------- programs
# Each takes (rs, ag) and returns a body for shard_map over tp: x [M, K] with K split for the
# reduce-scatter (-> [M/2, N]); the all-gather takes [M/2, N] rows back to [M, N2 / 2].

M, K, N = 256, 256, 128
SPECS = (P(None, "tp"), P("tp", None), P(None, "tp"))
SHAPES = ((M, K), (K, N), (N, 2 * 64))


def straight(ops):
    rs, ag = ops
    return lambda x, w, v: ag(rs(x, w), v)


def three_calls(ops):
    rs, ag = ops

    def body(x, w, v):  # a and b are independent: only the order token connects them
        a = rs(x, w)
        b = rs(x * 2, w)
        return ag(a + b, v)

    return body


def scanned(ops):
    rs, ag = ops

    def body(x, w, v):
        h0 = rs(x, w)  # before the loop

        def step(h, _):
            return h + jnp.sum(ag(h, v)) * 1e-3, None  # one call per iteration

        h, _ = lax.scan(step, h0, None, length=3)
        return ag(h, v)  # after the loop

    return body


def conditional(ops):
    rs, ag = ops

    def body(x, w, v):
        h = rs(x, w)
        taken = lax.psum(jnp.sum(h * h), "tp") >= 0  # true, the same on every rank
        h = lax.cond(taken, lambda: rs(x * 2, w), lambda: jnp.zeros_like(h))
        return ag(h, v)

    return body


def rematted(ops):
    rs, ag = ops

    def body(x, w, v):
        h = jax.checkpoint(lambda x, w: rs(jnp.sin(x), w))(x, w)
        return ag(h, v)

    return body


CASES = [straight, three_calls, scanned, conditional, rematted]


def _fn(body, out_spec=P(None, "tp")):
    return jax.shard_map(body, mesh=_mesh(), in_specs=SPECS, out_specs=out_spec)


def _args(dtype=jnp.bfloat16, concrete=False):
    rng = np.random.default_rng(0)
    if concrete:
        return tuple(jnp.asarray(rng.standard_normal(s) / 16, dtype) for s in SHAPES)
    return tuple(jax.ShapeDtypeStruct(s, dtype) for s in SHAPES)


def _grad(f):
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))


def _module(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")


# ----------------------------------------------------------------------------- the token graph


def _ops(block):
    for op in block.operations:
        yield op
        for region in op.regions:
            for b in region.blocks:
                yield from _ops(b)


def _name(op):
    return op.operation.name


def _is_fused(op):
    return _name(op) == "stablehlo.custom_call" and str(op.attributes["call_target_name"]).strip(
        '"'
    ).startswith("jaxoverlap_")


def _sym(op, attr):
    return str(op.attributes[attr]).strip('@"')


def _terminator(region):
    return list(region.blocks[0].operations)[-1]


def _barrier_after(call):
    """The optimization barrier that takes ``call``'s results after the order token (the
    "barrier" form, `jaxoverlap.fused.call.ORDER_FORM`), or None."""
    for r in call.results:
        for use in r.uses:
            op = use.owner
            if _name(op) == "stablehlo.optimization_barrier" and _is_barrier_after(op):
                return op
    return None


def _is_barrier_after(barrier):
    """Whether ``barrier`` is a fused call's barrier after it: the token and the call's first
    result."""
    operands = list(barrier.operands)
    if len(operands) != 2 or str(operands[0].type) != "!stablehlo.token":
        return False
    first = operands[1]
    return not isinstance(first, ir.BlockArgument) and _is_fused(first.owner)


def call_tokens(call):
    """(the order token ``call`` consumes, the token it produces), in either form: the call's
    last operand and result (``token``), or the token beside its first operand in the barrier
    before it and the first result of the barrier after it (``barrier``)."""
    if str(call.operands[len(call.operands) - 1].type) == "!stablehlo.token":
        assert str(call.results[len(call.results) - 1].type) == "!stablehlo.token"
        return call.operands[len(call.operands) - 1], call.results[len(call.results) - 1]
    before = call.operands[0].owner
    assert _name(before) == "stablehlo.optimization_barrier", "no order token before the call"
    assert len(before.operands) == 2, "the barrier before the call: its first operand, the token"
    tok = before.operands[1]
    assert str(tok.type) == "!stablehlo.token", "the barrier before the call has no token"
    after = _barrier_after(call)
    assert after is not None, "no barrier with the order token after the call"
    return tok, after.results[0]


def token_sources(module):
    """{fused call: the fused calls (or "entry") whose token reaches its token operand through
    token plumbing alone: region arguments and results, returns, calls}; and the calls."""
    ops = list(_ops(module.body))
    funcs = {
        str(op.attributes["sym_name"]).strip('"'): op for op in ops if _name(op) == "func.func"
    }
    callers = {}
    for op in ops:
        if _name(op) == "func.call":
            callers.setdefault(str(op.attributes["callee"]).strip('@"'), []).append(op)
    calls = [op for op in ops if _is_fused(op)]

    def from_value(v, seen):
        key = (id(v.owner) if not isinstance(v, ir.BlockArgument) else id(v.owner), str(v))
        if key in seen:
            return set()
        seen.add(key)
        if isinstance(v, ir.BlockArgument):
            block = v.owner
            parent = block.owner
            i = v.arg_number
            name = _name(parent)
            if name == "func.func":
                fname = str(parent.attributes["sym_name"]).strip('"')
                if fname == "main":
                    return {"entry"}
                return set().union(*(from_value(c.operands[i], seen) for c in callers[fname]))
            if name == "stablehlo.while":
                body = parent.regions[1]
                return from_value(parent.operands[i], seen) | from_value(
                    _terminator(body).operands[i], seen
                )
            if name == "sdy.manual_computation":
                return from_value(parent.operands[i], seen)
            raise AssertionError(f"token block argument of {name}")
        op = v.owner
        name = _name(op)
        r = v.result_number
        if _is_fused(op):
            assert r == len(op.results) - 1, "a fused call's token is its last result"
            return {op}
        if name == "stablehlo.while":
            return from_value(_terminator(op.regions[1]).operands[r], seen)
        if name in ("stablehlo.case", "stablehlo.if", "sdy.manual_computation"):
            return set().union(*(from_value(_terminator(g).operands[r], seen) for g in op.regions))
        if name == "func.call":
            callee = funcs[str(op.attributes["callee"]).strip('@"')]
            return from_value(_terminator(callee.regions[0]).operands[r], seen)
        if name == "stablehlo.optimization_barrier":
            if r == 0 and _is_barrier_after(op):  # the token after a fused call (barrier form)
                return {op.operands[1].owner}
            return from_value(op.operands[r], seen)
        raise AssertionError(f"a token from {name}: not a chain")

    sources = {}
    for c in calls:
        tok, _ = call_tokens(c)
        sources[c] = from_value(tok, set())
    return sources, calls


def _target(op):
    return str(op.attributes["call_target_name"]).strip('"')


def chain(f, *args):
    """The fused calls of ``f`` lowered for CUDA, as a total order: starting from the entry
    token, each call's token reaches exactly the next one. Returns their targets in order (and
    asserts that every call is on the chain and fed by one call only)."""
    module = _module(f, *args)
    sources, calls = token_sources(module)
    order, last = [], "entry"
    while True:
        nxt = [c for c, s in sources.items() if s == {last}]
        if not nxt:
            break
        assert len(nxt) == 1, f"two calls follow {last}: {[_target(c) for c in nxt]}"
        order.append(nxt[0])
        last = nxt[0]
    assert len(order) == len(calls), {_target(c): s for c, s in sources.items()}
    return [_target(c) for c in order], sources


def _operand(call, i):
    """``call``'s operand ``i`` as the program computed it (before the barrier of the barrier
    form)."""
    v = call.operands[i]
    if not isinstance(v, ir.BlockArgument) and _name(v.owner) == "stablehlo.optimization_barrier":
        return v.owner.operands[v.result_number]
    return v


# ----------------------------------------------------------------------------- tests


@pytest.fixture(params=["token", "barrier"])
def form(request, monkeypatch, lowering_only):
    """Both ways `emit` ties a call to the order token (jaxoverlap/fused/call.py ORDER_FORM)."""
    from jaxoverlap.fused import call

    monkeypatch.setattr(call, "ORDER_FORM", request.param)
    return request.param


@pytest.mark.parametrize("case", CASES)
def test_jaxpr_shows_the_effect(lowering_only, case):
    f = _fn(case(fused_ops(FUSED)))
    jaxpr = jax.make_jaxpr(f)(*_args())
    assert fused.FusedOrder in {type(e) for e in jaxpr.effects}, jaxpr.effects
    assert fused.FusedOrder in {type(e) for e in jax.make_jaxpr(_grad(f))(*_args()).effects}


def test_every_fused_primitive_has_the_effect(lowering_only):
    """The primitives a user's program reaches: the ops, their keep and tangent variants, the
    column-parallel backward (in grad) and tma_reduce_scatter."""
    from jaxoverlap.fused import tma

    f = _fn(straight(fused_ops(FUSED)))
    text = str(jax.make_jaxpr(_grad(f))(*_args()))
    for prim in ("matmul_reduce_scatter", "all_gather_matmul_keep", "all_gather_matmul_backward"):
        assert prim in text
    x = jax.ShapeDtypeStruct((M, N), jnp.bfloat16)
    g = jax.shard_map(
        lambda x: tma.tma_reduce_scatter(x, "tp"), mesh=_mesh(), in_specs=P(), out_specs=P("tp")
    )
    assert fused.FusedOrder in {type(e) for e in jax.make_jaxpr(g)(x).effects}


def test_top_level_calls_chain_in_program_order(form):
    order, _ = chain(_fn(three_calls(fused_ops(FUSED))), *_args())
    rs, ag = fused.emitted(fused.GEMM_RS_TARGET), fused.emitted(fused.AG_GEMM_TARGET)
    assert order == [rs, rs, ag]


def test_independent_calls_are_ordered_by_the_token_alone(form):
    """Two calls with no data between them: the second still takes the first's token, and
    their operand shapes say which is which (x, then 2 * x: the program's order)."""
    module = _module(_fn(three_calls(fused_ops(FUSED))), *_args())
    sources, calls = token_sources(module)
    a, b, c = calls
    assert sources[a] == {"entry"} and sources[b] == {a} and sources[c] == {b}
    # a's x operand is the argument itself; b's is 2 * x, computed after the argument.
    assert isinstance(_operand(a, 0), ir.BlockArgument)
    assert not isinstance(_operand(b, 0), ir.BlockArgument)


def test_scan_threads_the_token_through_its_carry(form):
    module = _module(_fn(scanned(fused_ops(FUSED))), *_args())
    sources, (before, body, after) = token_sources(module)  # in the module's order
    assert "stablehlo.while" in str(body.operation.parent.parent)
    assert sources[before] == {"entry"}
    assert sources[body] == {before, body}  # the first iteration, then the previous one
    assert sources[after] == {body}


def test_cond_branches_pass_the_token(form):
    module = _module(_fn(conditional(fused_ops(FUSED))), *_args())
    sources, (first, branch, last) = token_sources(module)
    assert sources[first] == {"entry"} and sources[branch] == {first}
    assert sources[last] == {first, branch}  # through the branch with a call, or the other


def test_remat_and_grad_chain_forward_and_backward_calls(form):
    """grad of a rematted layer: forward calls, the recomputation and the backward's calls, all
    on one chain through the shard_maps of the forward and the backward."""
    order, _ = chain(_grad(_fn(rematted(fused_ops(FUSED)))), *_args())
    assert len(order) >= 4, order
    rs, keep = fused.emitted(fused.GEMM_RS_TARGET), fused.emitted(fused.AG_GEMM_KEEP_TARGET)
    assert order[:2] == [rs, keep], order
    assert fused.emitted(fused.DGRAD_RS_WGRAD_TARGET) in order or rs in order[2:], order
    order, _ = chain(_grad(_fn(straight(fused_ops(FUSED)))), *_args())
    assert order[0] == rs and len(order) >= 4, order


@pytest.mark.parametrize("order_form", ["token", "barrier", "off"])
def test_knobs_reach_only_their_twin_targets(lowering_only, monkeypatch, order_form):
    """D17: a production call carries no test knob, in any form (_v2 in the token form, _v3 in
    the barrier form and with the order off); under a knob the call goes to the target's _knobs
    twin with both knob attributes, and `fused.emitted` names it."""
    from jaxoverlap.fused import call

    monkeypatch.setattr(call, "ORDER_FORM", "barrier" if order_form == "off" else order_form)
    monkeypatch.setattr(call, "ORDER_CALLS", order_form != "off")
    jax.clear_caches()  # traces of the same functions in another form would be reused
    f = jax.jit(_fn(three_calls(fused_ops(FUSED))))
    text = f.trace(*_args()).lower(lowering_platforms=("cuda",)).as_text()
    assert "stall_rank" not in text and "profile" not in text and "_knobs" not in text
    version = "_v2" if order_form == "token" else "_v3"
    assert f"@{fused.AG_GEMM_TARGET[: -len('_v2')]}{version}(" in text
    with fused._stalled_rank_for_tests(1, fused.AG_GEMM_TARGET):
        g = jax.jit(_fn(three_calls(fused_ops(FUSED))))
        text = g.trace(*_args()).lower(lowering_platforms=("cuda",)).as_text()
        twin = fused.emitted(fused.AG_GEMM_TARGET)
        plain = fused.emitted(fused.GEMM_RS_TARGET)
    jax.clear_caches()
    assert twin.endswith(version + "_knobs") and plain.endswith(version), (twin, plain)
    calls = [ln for ln in text.splitlines() if "custom_call @jaxoverlap" in ln]
    knobbed = [ln for ln in calls if f"@{twin}(" in ln]
    assert len(knobbed) == 1 and "stall_rank = 1" in knobbed[0] and "profile = 0" in knobbed[0]
    assert all("stall_rank" not in ln and "profile" not in ln for ln in calls if ln not in knobbed)
    assert sum(f"@{plain}(" in ln for ln in calls) == 2


@pytest.mark.parametrize("case", CASES)
def test_values_and_grads_match_the_reference_on_many_devices(case):
    """A multi-device jit with the effect runs (reference lowering: the token is forwarded),
    and its values and gradients equal those of the same program in plain JAX."""
    args = _args(jnp.float32, concrete=True)
    f, g = _fn(case(fused_ops(AUTO))), _fn(case(PLAIN))
    np.testing.assert_allclose(jax.jit(f)(*args), jax.jit(g)(*args), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.jit(_grad(f))(*args), jax.jit(_grad(g))(*args), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_ahead_of_time_executable_runs_twice():
    """jit(f).lower().compile(): JAX's C++ fast path of such an executable would drop the order
    token from its second call on (pxla.MeshExecutable.create_cpp_call checks unordered effects
    only); the fused primitives' `FusedDispatch` effect keeps it off that path."""
    args = _args(jnp.float32, concrete=True)
    c = jax.jit(_fn(three_calls(fused_ops(AUTO)))).lower(*args).compile()
    first = c(*args)
    for _ in range(3):
        np.testing.assert_array_equal(c(*args), first)


def test_the_extension_registers_v3_v2_their_twins_and_v1():
    """ffi/registry.cc: for every op (fused/targets.py) the targets the lowering emits -- _v3 (no
    token) and _v2 (the token form) --, their _knobs twins, and the _v1 target that programs
    compiled before issue 26 name (kept, unchanged); nothing else."""
    from jaxoverlap.fused import targets

    if runtime.native() is None:
        pytest.skip(f"the native extension is not built here: {runtime.unavailable_reason()}")
    names = set(runtime.native().registrations())
    want = set()
    for t in targets.ALL:
        v3 = targets.v3(t)
        want |= {t, targets.with_knobs(t), v3, targets.with_knobs(v3), targets.v1(t)}
    assert len(want) == 5 * len(targets.ALL)
    assert names == want


# ----------------------------------------------------------------------------- CONCURRENT


@pytest.mark.parametrize(
    "flags, mode",
    [
        ("", None),
        ("--xla_gpu_command_buffer_scheduling_mode=LHS", None),
        ("--xla_force_host_platform_device_count=8 "
         "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", "CONCURRENT"),
        ("--xla_gpu_command_buffer_scheduling_mode=concurrent_regions", "CONCURRENT_REGIONS"),
        ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT "
         "--xla_gpu_command_buffer_scheduling_mode=LHS", None),
    ],
)  # fmt: skip
def test_concurrent_scheduling_read_from_xla_flags(flags, mode):
    assert runtime.concurrent_scheduling(flags) == mode


class _FakeNative:
    def registrations(self):
        return {fused.GEMM_RS_TARGET: {}, fused.GEMM_RS_TARGET + "_knobs": {}}

    def set_gemm_cache_dir(self, path):
        pass


@pytest.mark.parametrize("buffers", [False, True])
@pytest.mark.parametrize("mode", ["", "CONCURRENT", "CONCURRENT_REGIONS", "LHS"])
def test_targets_kept_out_of_concurrent_command_buffers(monkeypatch, caplog, buffers, mode):
    from jax._src.lib import xla_client

    flags = f"--xla_gpu_command_buffer_scheduling_mode={mode}" if mode else ""
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setattr(runtime, "COMMAND_BUFFERS", buffers)
    monkeypatch.setattr(runtime, "_registered", False)
    monkeypatch.setattr(runtime, "native", lambda: _FakeNative())
    monkeypatch.setattr(runtime, "_share_gemm_choices", lambda mod: None)
    got = []
    monkeypatch.setattr(
        jax.ffi, "register_ffi_target", lambda name, st, platform, traits: got.append(traits)
    )
    with caplog.at_level(logging.WARNING, logger="jaxoverlap"):
        runtime.register_targets()
        runtime.register_targets()  # once per process
    traits = xla_client.CustomCallTargetTraits
    concurrent = mode.startswith("CONCURRENT")
    want = traits.COMMAND_BUFFER_COMPATIBLE if buffers and not concurrent else traits.DEFAULT
    assert got == [want, want]
    warned = [r for r in caplog.records if "is ignored for the fused calls" in r.getMessage()]
    assert len(warned) == (1 if buffers and concurrent else 0)
    if warned:
        assert f"xla_gpu_command_buffer_scheduling_mode={mode}" in warned[0].getMessage()
