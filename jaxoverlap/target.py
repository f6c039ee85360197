"""The machine a decision of the fused path is taken for: this one, or a named one (a prediction).

The fused path's decision (`jaxoverlap.fused.unsupported_reason` at trace time, the group table's
check at lowering time: `jaxoverlap.fused.call.group_decision`) depends on a few facts of the
machine: whether the native extension loads, the GPUs' kind (the tuning cache is keyed by it), their
compute capability, whether they are peers over NVLink, and which tuning cache holds the
measurements. `Target` carries them. Lowering always decides for this machine (``target=None``: the
live facts, from `jaxoverlap.runtime`); `jaxoverlap.explain` passes a `Target` to the same
functions, so that a laptop without GPUs can say what lowering will do on the cluster::

    jaxoverlap.explain(step, *args, target="2xH200", tuning_cache="tune-abc.json")

A named target ``"<n>x<GPU>"`` (``2xH200``, ``8xH100``) is ``n`` Hopper GPUs of one process,
all joined by NVLink, with the extension built: what the fused kernels need. Its verdicts are
predictions: they hold on such a machine under the same ``Config``, environment
(``JAXOVERLAP_AUTO_NEW_KERNELS``) and tuning cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re

import jax

from jaxoverlap import runtime, xproc

# The device_kind strings CUDA reports (the tuning cache's keys), by short name.
KINDS = {"H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200", "H800": "NVIDIA H800",
         "H20": "NVIDIA H20", "GH200": "NVIDIA GH200 480GB"}  # fmt: skip
NVLINK = {"access": True, "native_atomics": True, "performance_rank": 0}
DEFAULT = "2xH200"


@dataclasses.dataclass(frozen=True)
class Target:
    """The facts a decision is taken from.

    Attributes:
      name: ``"this machine"`` or the named target (``"2xH200"``).
      gpus: GPUs of the one process (named) or of this machine.
      device_kind: what CUDA calls them (the tuning cache's key), None without GPUs.
      predicted: a named target: verdicts are predictions for it.
      tuning_cache: the tuning cache file to read (None: this machine's default; a named
        target without one has no measurements, so the untuned rules decide).
      lookups: the entries `jaxoverlap.fused.policy.tuned` found, for explain to say what a
        decision came from.
    """

    name: str
    gpus: int
    device_kind: str | None
    predicted: bool
    tuning_cache: str | None = None
    lookups: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def native_reason(self):
        """None when the native extension loads (always, on a named target)."""
        return None if self.predicted else runtime.unavailable_reason()

    def native_loaded(self) -> bool:
        return self.predicted or runtime.native() is not None

    def facts(self) -> dict:
        """The keyword arguments of `jaxoverlap.topology.unfusable_reason` for this machine."""
        if self.predicted:  # Hopper GPUs of one process, every pair joined by NVLink
            return dict(can_access_peer=lambda a, b: True, compute_capability=lambda o: (9, 0),
                        peer_link=lambda a, b: NVLINK, cross_process=None)  # fmt: skip
        return dict(
            can_access_peer=runtime.can_access_peer,
            compute_capability=runtime.compute_capability,
            peer_link=runtime.peer_link,
            cross_process=xproc.decide if xproc.client() is not None else None,
        )

    def describe(self) -> str:
        what = f"{self.name}: {self.gpus} x {self.device_kind or 'no GPU'}"
        if self.predicted:
            what += ", Hopper, NVLink, one process -- a prediction"
        cache = self.tuning_cache or ("none" if self.predicted else "this machine's default")
        return f"{what}; tuning cache: {cache}"


_tracing_for = contextvars.ContextVar("jaxoverlap_target", default=None)


@contextlib.contextmanager
def tracing_for(target: Target | None):
    """Within: the ops' trace-time check of ``backend='fused'`` decides for ``target`` (explain
    traces the replacement ops on a laptop for the cluster)."""
    token = _tracing_for.set(target)
    try:
        yield
    finally:
        _tracing_for.reset(token)


def tracing_target() -> Target | None:
    """The target set by `tracing_for` (None: this machine)."""
    return _tracing_for.get()


def live(tuning_cache: str | None = None) -> Target:
    """This machine's GPUs (``gpus=0`` and no kind where it has none)."""
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    kind = devices[0].device_kind if devices else None
    return Target("this machine", len(devices), kind, False, tuning_cache)


def named(spec: str, tuning_cache: str | None = None) -> Target:
    """``"<n>x<GPU>"``, e.g. ``"2xH200"``: n Hopper GPUs of one process joined by NVLink."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*([A-Za-z0-9]+)\s*", spec)
    gpu = m and m.group(2).upper()
    if not m or gpu not in KINDS:
        raise ValueError(
            f"jaxoverlap: unknown target {spec!r}; name one as '<n>x<GPU>' with a Hopper GPU "
            f"({', '.join(KINDS)}), e.g. '2xH200', or pass target=None for this machine."
        )
    return Target(f"{int(m.group(1))}x{gpu}", int(m.group(1)), KINDS[gpu], True, tuning_cache)


def resolve(target=None, tuning_cache: str | None = None) -> Target:
    """A `Target` from explain's argument: a `Target`, a name, or None -- this machine where
    it has GPUs and the native extension, else the default named target (a prediction)."""
    if isinstance(target, Target):
        return dataclasses.replace(target, tuning_cache=tuning_cache or target.tuning_cache)
    if target is not None:
        return named(target, tuning_cache)
    here = live(tuning_cache)
    if here.gpus and here.native_loaded():
        return here
    return named(DEFAULT, tuning_cache)
