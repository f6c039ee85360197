"""Shared test machinery: meshes over the 8 fake CPU devices, random inputs, tolerances."""

from __future__ import annotations

import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Tolerances per dtype for comparing an op with its reference (same math, maybe another order).
TOL = {
    jnp.float32: dict(rtol=2e-5, atol=2e-5),
    jnp.bfloat16: dict(rtol=2e-2, atol=2e-2),
    jnp.float16: dict(rtol=2e-3, atol=2e-3),
}
# Gradients go through one more matmul and a sum over the group: looser for low precision.
GRAD_TOL = {
    jnp.float32: dict(rtol=1e-4, atol=1e-4),
    jnp.bfloat16: dict(rtol=4e-2, atol=6e-2),
    jnp.float16: dict(rtol=4e-3, atol=6e-3),
}

# name -> (axis names, axis sizes, device order)
MESHES = {
    "tp2": (("tp",), (2,), None),
    "tp4": (("tp",), (4,), None),
    "tp8": (("tp",), (8,), None),
    "dp2_tp4": (("dp", "tp"), (2, 4), None),
    "tp4_dp2_permuted": (("tp", "dp"), (4, 2), (3, 6, 0, 5, 2, 7, 1, 4)),
}


def make_mesh(name):
    names, sizes, order = MESHES[name]
    devices = jax.devices()[: int(np.prod(sizes))]
    if order is not None:
        devices = [devices[i] for i in order]
    return Mesh(
        np.array(devices).reshape(sizes), names, axis_types=(AxisType.Explicit,) * len(names)
    )


def axis_size(mesh, axes):
    return int(np.prod([mesh.shape[a] for a in axes]))


def spec_entry(axes):
    return axes[0] if len(axes) == 1 else tuple(axes)


def normal(key, shape, scale=1.0):
    """float32 standard normal values of ``shape`` times ``scale`` (a numpy array), drawn by
    numpy from the bits of the jax ``key``: fixed for a key, like ``jax.random.normal``, but
    without compiling a sampler per shape (about a second each on CPU, hundreds of shapes)."""
    seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return values * np.float32(scale)


def random(key, shape, dtype):
    """Random normal inputs scaled so matmul outputs stay O(1) in every dtype (a numpy array, in
    ``dtype``: `place` puts it on a mesh, jax functions take it as it is)."""
    scale = 1.0 / np.sqrt(shape[-1]) if len(shape) > 1 else 1.0
    return normal(key, shape, scale).astype(dtype)


def place(mesh, arrays, specs):
    """``arrays`` laid out over ``mesh`` by ``specs``; from the host (a device-to-device
    resharding compiles a program per layout on CPU)."""
    return [jax.device_put(np.asarray(a), NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]


def sharded(mesh, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def assert_close(actual, expected, tol, what=""):
    actual = np.asarray(actual).astype(np.float32)  # on the host: no program per dtype/layout
    expected = np.asarray(expected).astype(np.float32)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    np.testing.assert_allclose(actual, expected, err_msg=what, **tol)


__all__ = [
    "P",
    "TOL",
    "GRAD_TOL",
    "MESHES",
    "make_mesh",
    "axis_size",
    "spec_entry",
    "normal",
    "random",
    "place",
    "sharded",
    "assert_close",
]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def native_driver(tmp_path_factory, source):
    """tests/native/<source>, plain C++ with ffi/ on the include path, compiled by the system
    compiler ($CXX, c++ or g++) with warnings as errors: the executable's path. Skips the test
    without a compiler."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip(f"no C++ compiler to build tests/native/{source}")
    exe = tmp_path_factory.mktemp(source.split(".")[0]) / "driver"
    src = os.path.join(ROOT, "tests", "native", source)
    subprocess.run(
        [cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", os.path.join(ROOT, "ffi"), src,
         "-o", str(exe)],
        check=True,
    )  # fmt: skip
    return exe
