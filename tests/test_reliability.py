"""Reliability decisions checked without GPUs: the timeout policy, where the fused path refuses
to run (compute capability, NVLink) at lowering, and the workspace key every process derives
alike."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, config, fused, runtime, topology
from jaxoverlap.fused import tma


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 0, 0.0, -1.0, True, "5", 1e9])
def test_timeout_rejects_unbounded_and_nonsense(bad):
    with pytest.raises(ValueError, match=r"timeout_s=.* must be a finite number of seconds"):
        Config(timeout_s=bad)


def test_timeout_default_is_in_line_with_the_field():
    assert Config().timeout_s == config.DEFAULT_TIMEOUT_S == 100.0
    assert Config(timeout_s=1).timeout_s == 1
    assert Config(timeout_s=config.MAX_TIMEOUT_S).timeout_s == config.MAX_TIMEOUT_S


def test_tma_reduce_scatter_checks_its_timeout():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    for bad in (math.nan, math.inf, -1.0):
        f = jax.shard_map(
            lambda v, bad=bad: tma.tma_reduce_scatter(v, "tp", timeout_s=bad),
            mesh=mesh,
            in_specs=P(None, "tp"),
            out_specs=P("tp"),
        )
        with pytest.raises(ValueError, match="tma_reduce_scatter: timeout_s="):
            jax.jit(f).trace(jax.ShapeDtypeStruct((64, 64), jnp.bfloat16))


# ----------------------------------------------------------------------------- where to fuse

NVLINK = {"access": True, "native_atomics": True, "performance_rank": 0}
PCIE = {"access": True, "native_atomics": False, "performance_rank": 1}


@pytest.fixture
def cuda_lowering(lowering_only):
    """Lower for CUDA on fake CPU devices with the native queries patched (conftest)."""

    def lower(backend, shape=(8192, 2 * 4096), n_cols=8192):
        mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
        cfg = Config(backend=backend)
        f = jax.jit(
            jax.shard_map(
                lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=cfg),
                mesh=mesh,
                in_specs=(P(None, "tp"), P("tp", None)),
                out_specs=P("tp"),
            )
        )
        x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        w = jax.ShapeDtypeStruct((shape[1], n_cols), jnp.bfloat16)
        return f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()

    return lower


def test_fuses_on_hopper_with_nvlink(cuda_lowering):
    for backend in ("auto", "fused"):
        assert f"@{fused.GEMM_RS_TARGET}" in cuda_lowering(backend)


@pytest.mark.parametrize("cc", [(8, 0), (10, 0), (9, 1), (-1, -1)])
def test_refuses_other_compute_capabilities(monkeypatch, cuda_lowering, cc):
    monkeypatch.setattr(runtime, "compute_capability", lambda o: cc if o == 1 else (9, 0))
    text = cuda_lowering("auto")  # auto: XLA's path
    assert f"@{fused.GEMM_RS_TARGET}" not in text and "reduce_scatter" in text
    with pytest.raises(ValueError, match=rf"GPU 1 has compute capability {cc[0]}\.{cc[1]}.*9\.0"):
        cuda_lowering("fused")


def test_refuses_pcie_peers(monkeypatch, cuda_lowering):
    monkeypatch.setattr(runtime, "peer_link", lambda a, b: PCIE)
    text = cuda_lowering("auto")
    assert f"@{fused.GEMM_RS_TARGET}" not in text and "reduce_scatter" in text
    match = r"GPU 0 reaches GPU 1 without NVLink.*native peer atomics"
    with pytest.raises(ValueError, match=match):
        cuda_lowering("fused")


# ----------------------------------------------------------------------------- workspace keys


def _site(text):
    (line,) = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TARGET}" in ln]
    return line.split("site = ")[1].split(" ")[0].rstrip(",:")


def test_workspace_key_is_stable_across_wrappers_and_tells_ops_apart(cuda_lowering):
    # Fresh jit wrappers of one op share one workspace key (memory does not grow per call site)...
    sites = {_site(cuda_lowering("fused")) for _ in range(3)}
    assert len(sites) == 1
    # ...another shape or op gets its own...
    assert _site(cuda_lowering("fused", n_cols=4096)) not in sites
    key = fused.site_key(_TABLE, 4, 2, _KIND)
    assert 0 <= key < 2**63
    assert key != fused.site_key(_TABLE, 4, 2, ("other",) + _KIND[1:])
    assert key != fused.site_key(_TABLE, 8, 2, _KIND)
    # ...and the key is the same in every process (no counter, no salted str hash): one process
    # per GPU must agree on it.
    code = (
        "import numpy as np; from jaxoverlap import fused, topology; "
        "t = topology.GroupTable(n=2, ordinals=np.array([0, 1]), ranks=np.array([0, 1]), "
        "groups=np.array([[0, 1], [0, 1]]), processes=np.array([0, 0])); "
        f"print(fused.site_key(t, 4, 2, {_KIND!r}))"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.getcwd()}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.strip() == str(key), out.stderr[-2000:]


_TABLE = topology.GroupTable(
    n=2,
    ordinals=np.array([0, 1]),
    ranks=np.array([0, 1]),
    groups=np.array([[0, 1], [0, 1]]),
    processes=np.array([0, 0]),
)
_KIND = (fused.GEMM_RS_TARGET, (8192, 4096), (4096, 8192), "bfloat16")
