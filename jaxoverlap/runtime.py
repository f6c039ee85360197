"""Loading the native extension and registering its FFI targets, lazily.

Nothing here runs at ``import jaxoverlap``: the extension is imported the first time the fused
path is considered (trace or lowering time), and its FFI targets are registered with XLA the first
time a fused op is lowered. Importing the extension initialises no CUDA state; only its handlers
(and `can_access_peer`) touch CUDA. Without a built extension, or without the cuBLASLt library,
`unavailable_reason` says why and every op takes the reference path.

Workspaces of groups that span processes are set up by `jaxoverlap.xproc` at lowering time.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import logging
import os
import threading

log = logging.getLogger("jaxoverlap")
# JAXOVERLAP_COMMAND_BUFFERS=1 lets XLA capture the fused handlers into its command buffers
# (CUDA graphs; ffi/runtime/capture.h). Off by default: captured calls run correctly (fused ops
# alone, in
# lax.scan, the scanned training step; docs/measurements.md runs 40 and 44, one GPU shared by two
# processes) but are not yet measured on two GPUs, and a replayed call runs no host code, so its
# error surfaces later (check_errors() or a call that is not replayed). Off, every fused call
# splits its command buffer.
COMMAND_BUFFERS = os.environ.get("JAXOVERLAP_COMMAND_BUFFERS", "0") == "1"
# The XLA flag whose CONCURRENT modes order a command buffer's commands by their buffers alone:
# the fused calls' order tokens (jaxoverlap/fused/call.py) have no buffer, so there they would run
# unordered (docs/ordering-and-stream-memops.md, section 1).
SCHEDULING_FLAG = "xla_gpu_command_buffer_scheduling_mode"
_lock = threading.Lock()
_native = None
_load_error: str | None = None
_registered = False
# The tuner's cache format (tune.py writes it, fused/cache.py reads it); part of `fingerprint`,
# so a new format starts a new file and old caches stay valid.
CACHE_VERSION = 1


def _preload_cublaslt():
    """Make ``libcublasLt.so.13`` resolvable for the extension (it records no rpath to it).

    JAX's CUDA plugin usually has it loaded already; otherwise take it from the ``nvidia-cublas``
    wheel (``nvidia/cu13/lib``), else from the system library path.
    """
    candidates = []
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        for root in getattr(nvidia, "__path__", []):
            candidates.append(os.path.join(root, "cu13", "lib", "libcublasLt.so.13"))
    except ImportError:
        pass
    candidates.append("libcublasLt.so.13")
    errors = []
    for path in candidates:
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return None
        except OSError as e:
            errors.append(f"{path}: {e}")
    return "cannot load libcublasLt.so.13 (pip install nvidia-cublas): " + "; ".join(errors)


def native():
    """The ``jaxoverlap._native`` module, or None (see `unavailable_reason`)."""
    global _native, _load_error
    with _lock:
        if _native is None and _load_error is None:
            err = _preload_cublaslt()
            try:
                # Lazy by design (nothing native at `import jaxoverlap`); the one import of a
                # jaxoverlap module inside a function (tests/test_structure.py allows it).
                _native = importlib.import_module("jaxoverlap._native")
            except ImportError as e:
                _load_error = (
                    "the native extension jaxoverlap._native is not built or cannot be loaded "
                    f"({e}){'; ' + err if err else ''}. Build it with a CUDA toolkit: "
                    "pip install -e . (see README)"
                )
    return _native


def unavailable_reason():
    """None when the extension is loaded, else a sentence saying why it is not."""
    native()
    return _load_error


def register_targets():
    """Register every FFI target of the extension with XLA (CUDA platform), once."""
    global _registered
    mod = native()
    if mod is None:
        raise RuntimeError(_load_error)
    with _lock:
        if _registered:
            return
        import jax
        from jax._src.lib import xla_client

        traits = xla_client.CustomCallTargetTraits.DEFAULT
        if command_buffers():  # XLA may capture the handlers in CUDA graphs (ffi/runtime/runtime.h)
            traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
        for name, stages in mod.registrations().items():
            jax.ffi.register_ffi_target(name, stages, platform="CUDA", traits=traits)
        _registered = True
    # Outside the lock: the fingerprint loads the extension through native(), which takes it.
    _share_gemm_choices(mod)


def concurrent_scheduling(flags=None):
    """The CONCURRENT mode ``XLA_FLAGS`` (or ``flags``) sets for command buffers
    (``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` or ``CONCURRENT_REGIONS``; the last
    occurrence wins, as in XLA), else None. Per-``jit`` ``compiler_options`` are not visible
    here (docs/ordering-and-stream-memops.md, section 1)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    mode = None
    for word in flags.split():
        name, _, value = word.lstrip("-").partition("=")
        if name == SCHEDULING_FLAG:
            mode = value.strip("'\"").upper()
    return mode if mode in ("CONCURRENT", "CONCURRENT_REGIONS") else None


def command_buffers():
    """Whether the targets are registered COMMAND_BUFFER_COMPATIBLE:
    ``JAXOVERLAP_COMMAND_BUFFERS=1`` and no CONCURRENT scheduling in ``XLA_FLAGS``
    (`concurrent_scheduling`). In a CONCURRENT graph XLA orders commands by the buffers they
    share, and the fused calls' order tokens have none, so two fused calls could start in
    different orders on two GPUs (a wait out to the timeout) or share a workspace's epoch: the
    targets then run as ordinary thunks, between graphs, in the program's order (XLA's own work
    still runs in concurrent graphs), with one warning."""
    if not COMMAND_BUFFERS:
        return False
    mode = concurrent_scheduling()
    if mode is None:
        return True
    log.warning(
        "jaxoverlap: JAXOVERLAP_COMMAND_BUFFERS=1 is ignored for the fused calls: XLA_FLAGS sets "
        "--%s=%s, where a command buffer orders commands by their buffers only and the fused "
        "calls would run unordered; they run outside command buffers instead, in program order "
        "(use --%s=LHS, the default, to capture them)",
        SCHEDULING_FLAG,
        mode,
        SCHEDULING_FLAG,
    )
    return False


def _share_gemm_choices(mod):
    """Points the GEMM runner's algorithm choices (ffi/runtime/gemm.h) at the tuner's cache, under
    the
    tuner's fingerprint: every process of this machine then computes a shape with the algorithm
    the first of them measured fastest (the same bits on every rank and rerun)."""
    path = os.path.join(cache_dir(), f"gemm-{fingerprint()}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # read-only home: every process times its own choice
        log.warning("jaxoverlap: GEMM choices not shared between processes (%s)", e)
        return
    mod.set_gemm_cache_dir(path)


def cache_dir() -> str:
    """Where measured decisions live: ``$XDG_CACHE_HOME/jaxoverlap`` (default ``~/.cache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxoverlap")


def fingerprint() -> str:
    """Hash of what the timings depend on: jaxlib, the native extension's file, the driver."""
    import jax
    import jaxlib

    parts = [f"v{CACHE_VERSION}", jaxlib.__version__]
    path = getattr(native(), "__file__", None)
    if path and os.path.exists(path):
        st = os.stat(path)
        parts.append(f"{st.st_size}:{int(st.st_mtime)}")
    try:
        parts.append(jax.devices()[0].client.platform_version)
    except Exception:  # noqa: BLE001 - no backend: the fingerprint just has one part fewer
        pass
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def can_access_peer(a: int, b: int) -> bool:
    mod = native()
    return bool(mod is not None and mod.can_access_peer(int(a), int(b)))


def compute_capability(ordinal: int) -> tuple[int, int]:
    """(major, minor) of a CUDA ordinal; (-1, -1) when unknown."""
    mod = native()
    return tuple(mod.compute_capability(int(ordinal))) if mod is not None else (-1, -1)


def peer_link(a: int, b: int) -> dict:
    """The link ``a -> b`` as CUDA reports it: ``access``, ``native_atomics`` (true for NVLink /
    NVSwitch peers only, false over PCIe) and ``performance_rank``."""
    mod = native()
    if mod is None:
        return {"access": False, "native_atomics": False, "performance_rank": -1}
    return dict(mod.peer_link(int(a), int(b)))


def stream_memop_caps(ordinal: int) -> dict:
    """Diagnostics (issue 26, R5): what a CUDA ordinal supports of the stream memory operations --
    ``mem_ops_64``, ``flush_remote_writes``, ``wait_value_nor`` (1/0; -1: could not be asked) and
    ``entry_points`` (the driver gave cuStreamWriteValue32/WaitValue32/BatchMemOp); ``{}`` without
    the native extension. docs/ordering-and-stream-memops.md section 3 says what uses them."""
    mod = native()
    return {} if mod is None else dict(mod.stream_memop_caps(int(ordinal)))


def memory_in_use(ordinal: int) -> int:
    """Device memory in use on a CUDA ordinal (total - free, all allocators), bytes."""
    mod = native()
    if mod is None:
        raise RuntimeError(_load_error)
    return int(mod.memory_in_use(int(ordinal)))


def workspace_pool() -> dict:
    """What jaxoverlap's workspace pool holds in this process (docs/workspaces.md), counted from
    its buffers: ``workspaces`` (``exact``: the tile schedule's, ``spanning``: groups over
    processes), ``own_bytes`` (device memory this process allocated for them; ``own_by_device``
    by CUDA ordinal), ``mapped_bytes`` (peers' buffers mapped by CUDA IPC: another process's
    memory), ``flags_bytes`` (one member's flag block) and ``block_bytes`` (each workspace's slot
    bytes: its size class, or an exact workspace's size); not counted, a workspace's 256-byte
    abort ring. Unlike `memory_in_use` it excludes XLA's buffers and other processes."""
    mod = native()
    if mod is None:
        raise RuntimeError(_load_error)
    return dict(mod.workspace_pool())


def size_class(block_bytes: int) -> int:
    """The slot bytes of the shared workspace that a call with ``block_bytes``-byte blocks gets
    (ffi/runtime/ws_class.h: the smallest of 2^k and 3 * 2^(k-1) that holds it, at least 64 KiB)."""
    mod = native()
    if mod is None:
        raise RuntimeError(_load_error)
    return int(mod.ws_size_class(int(block_bytes)))


class FusedCallError(RuntimeError):
    """A fused call gave up: a cross-GPU wait timed out (a peer failed, stalled or ran another
    program) or a rank failed after its peers launched. The message names op, device, rank,
    peer and chunk."""


def pending_error() -> str:
    """The oldest unreported failure of a fused call in this process ('' if none); not cleared.

    A wait that gives up records op, rank, peer and chunk in host memory, makes every rank of
    that call give up too (the ranks whose waits gave up fill their outputs with NaN) and lets
    the kernels exit: the process and its GPUs stay usable. The failure is then reported by the
    next fused call of every workspace (it raises; the call after it runs normally), unless
    `check_errors` reported it first.
    """
    mod = _native
    return mod.pending_error() if mod is not None else ""


def check_errors() -> None:
    """Raise `FusedCallError` for the oldest unreported failure of a fused call, and forget it.

    Call it after ``jax.block_until_ready`` on a fused op's result to learn about a failure
    before using the (NaN-filled) values; without it, the next fused call raises the failure.
    """
    mod = _native
    msg = mod.take_error() if mod is not None else ""
    if msg:
        raise FusedCallError(msg)
