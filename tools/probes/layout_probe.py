"""Compile-only probe (one GPU, nothing executed): how XLA:GPU feeds a custom call that asks for
w column-major (w.T of a row-major parameter) and x S-major ([B, S, K] split over S)."""

import re

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap import runtime

runtime.register_targets()
ATTRS = dict(
    site=1,
    call_tag=0,
    ordinals=jnp.array([0, 1], jnp.int32),
    ranks=jnp.array([0, 1], jnp.int32),
    groups=jnp.array([0, 1, 0, 1], jnp.int32),
    n=2,
    comm_sms=4,
    chunks=1,
    timeout_s=1.0,
    stall_rank=-1,
    profile=0,
    w_colmajor=1,
    x_colmajor=0,
)
ATTRS = {
    k: (v if not hasattr(v, "shape") else __import__("numpy").asarray(v)) for k, v in ATTRS.items()
}


def call(x, wt, x_layout, w_layout):
    """Layouts minor-to-major, as jaxoverlap.fused passes them to ffi_lowering (ffi_call takes
    major-to-minor: reversed here)."""
    out = jax.ShapeDtypeStruct((*x.shape[:-1], wt.shape[1]), x.dtype)
    rev = lambda t: tuple(reversed(t))  # noqa: E731
    return jax.ffi.ffi_call(
        "jaxoverlap_gemm_rs_v1",
        out,
        input_layouts=[rev(x_layout), rev(w_layout)],
        output_layouts=rev(x_layout),
    )(x, wt, **ATTRS)


def report(name, f, *args):
    hlo = jax.jit(f).lower(*args).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :] if "ENTRY" in hlo else hlo
    ops = re.findall(r"= \S+ (\w[\w-]*)\(", entry)
    calls = [ln.strip()[:300] for ln in hlo.splitlines() if "custom-call(" in ln]
    print(f"== {name}: entry ops {sorted(set(ops))}")
    for c in calls:
        print("   ", c)
    for ln in hlo.splitlines():
        if ("transpose" in ln or "copy" in ln) and "=" in ln and "ROOT" not in ln[:6]:
            if "computation" not in ln or "fusion(" in ln:
                print("    [t/c]", ln.strip()[:160])


x = jnp.ones((4096, 1024), jnp.bfloat16)
w = jnp.ones((2048, 1024), jnp.bfloat16)  # [N, K]: the backward's w.T is [K, N] column-major
report("w.T of a parameter, (0,1)", lambda x, w: call(x, w.T, (1, 0), (0, 1)), x, w)
report("w.T of a parameter, (1,0) (materialised)", lambda x, w: call(x, w.T, (1, 0), (1, 0)), x, w)
x3 = jnp.ones((4, 1024, 1024), jnp.bfloat16)
w2 = jnp.ones((1024, 2048), jnp.bfloat16)
report("x [B,S,K] parameter S-major", lambda x, w: call(x, w, (2, 0, 1), (1, 0)), x3, w2)
report(
    "x [B,S,K] from an elementwise op, S-major",
    lambda x, w: call(jnp.tanh(x) * 2, w, (2, 0, 1), (1, 0)),
    x3,
    w2,
)
report("x [1,S,K] row-major (size-1 batch)", lambda x, w: call(x, w, (2, 1, 0), (1, 0)), x3[:1], w2)
ws = jnp.ones((3, 2048, 1024), jnp.bfloat16)


def scanned(x, ws):
    def body(c, w):
        return c, call(x, w.T, (1, 0), (0, 1))

    return lax.scan(body, 0, ws)[1]


report("scan: w.T of a sliced stacked weight, (0,1)", scanned, x, ws)
