"""The two-process GPU cases (tests/gpu/xproc_worker.py: op_cases), at the tests' own shapes and
at the second set (XPROC_SHAPES=other), each lower to their fused custom call when lowered for
CUDA here: a GPU run of either set exercises the fused handlers, not a trace-time refusal."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gpu import xproc_worker
from jax.sharding import Mesh, NamedSharding


@pytest.mark.parametrize("shapes", sorted(xproc_worker.SHAPES))
def test_every_case_lowers_to_its_fused_call(lowering_only, shapes):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def arr(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    cases = xproc_worker.op_cases(mesh, arr, 60.0, shapes)
    assert len(cases) == 11
    for tag, f, args, _, target, *_ in cases:
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert f"@{target}" in text, f"{shapes} {tag}: no {target}"
