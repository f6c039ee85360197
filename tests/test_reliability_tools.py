"""The reliability tools' own logic on CPU: tools/sanitize.py's reading of compute-sanitizer
logs, and tools/stress.py's two-process harness on the reference path (gloo)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import sanitize  # noqa: E402

LOG = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at void jaxoverlap::tile_kernel(int*)+0x70 in /x/tile_rs.cuh:12
=========     by thread (0,0,0) in block (0,0,0)
========= Error: Race reported between Write access at nvjet_sm90_tst_128x256+0x1230
=========     and Read access at nvjet_sm90_tst_128x256+0x1450 [1234 hazards]
========= Uninitialized __global__ memory read of size 4 bytes
=========     at jaxoverlap::ce_wait_arrival(unsigned int*)+0x40
========= Error: Potential WAR hazard detected at __shared__ 0x5036458 in block (5,5,0) :
=========     Read Thread (31,0,0) at nvjet_sm90_tst_64x96_64x10_4x2_h_bz_NNT+0xa60
=========     Write Thread (256,0,0) at nvjet_sm90_tst_64x96_64x10_4x2_h_bz_NNT+0x2fb0
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x2ef045] in libcuda.so.1
========= ERROR SUMMARY: 4 errors
"""


def test_sanitizer_log_attribution():
    found = sanitize.findings(LOG)
    assert [k for _, k in found] == [
        "jaxoverlap::tile_kernel(int*) @ tile_rs.cuh:12",  # the source line, where given
        "nvjet_sm90_tst_128x256",
        "jaxoverlap::ce_wait_arrival(unsigned int*)",
        "nvjet_sm90_tst_64x96_64x10_4x2_h_bz_NNT",
        "[0x2ef045] in libcuda.so.1",
    ]
    ours, excluded, api = sanitize.classify(found, sanitize.exclusions())
    assert [k for _, k in ours] == [found[0][1], found[2][1]]  # our kernels are never excluded
    assert sum(excluded.values()) == 2 and len(api) == 1


def test_sanitizer_exclusions_spare_our_kernels():
    rules = sanitize.exclusions()
    assert rules and all(reason for _, reason in rules), "every exclusion gives its reason"
    ours = "cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<jaxoverlap::tile::X>>"
    assert not any(p.search(ours) for p, _ in rules)
    assert not any(p.search("jaxoverlap::tma_push_kernel(jaxoverlap::CommArgs)") for p, _ in rules)
    # cuBLASLt's own helper kernels are cuBLASLt's (issue 25: its split-K reduce in training).
    split_k = "cublasLt::splitKreduce_kernel<(int)32, (int)16, int, float>(cublasLt::P<T6>)"
    assert any(p.search(split_k, "Uninitialized __global__ memory read") for p, _ in rules)


RING_LOG = """========= COMPUTE-SANITIZER
========= Error: Race reported between Read access at jaxoverlap::tile::TileEpilogue<cutlass::bfloat16_t, (int)256, (bool)0>::own_or_none(unsigned int) const+0xedd0 in tile_rs.cuh:256
=========     and Write access at jaxoverlap::tile::ClaimScheduler<(int)256, (int)1, (int)1, (bool)0>::publish(unsigned int, int)+0x133e0 in tile_sched.cuh:150 [64 hazards]
=========
========= Error: Race reported between Read access at jaxoverlap::tile::ClaimScheduler<(int)128, (int)1, (int)2, (bool)0>::claim(unsigned int)+0xb90 in tile_sched.cuh:181
=========     and Write access at jaxoverlap::tile::ClaimScheduler<(int)128, (int)1, (int)2, (bool)0>::publish(unsigned int, int)+0xf240 in tile_sched.cuh:150 [64 hazards]
=========
========= Potential invalid __shared__ write of size 8 bytes
=========     at jaxoverlap::tile::ClaimScheduler<(int)128, (int)1, (int)2, (bool)0>::publish(unsigned int, int)+0xd330 in tile_sched.cuh:150
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x1000400 is located in a block that might have already exited
=========
========= Error: Race reported between Write access at jaxoverlap::tile::TileEpilogue<cutlass::bfloat16_t, (int)256, (bool)0>::store_slab(float*, int)+0x113d0 in tile_slab.cuh:151
=========     and Read access at jaxoverlap::tile::TileEpilogue<cutlass::bfloat16_t, (int)256, (bool)0>::store_slab(float*, int)+0xb90 in tile_slab.cuh:181 [3 hazards]
========= RACECHECK SUMMARY: 4 hazards displayed (4 errors, 0 warnings)
"""  # noqa: E501  (call E's report lines, racecheck --racecheck-report analysis)


def test_the_claim_ring_exclusion_covers_the_ring_functions_only():
    found = sanitize.findings(RING_LOG)
    assert len(found) == 4, found
    assert found[2][0].startswith("Potential invalid __shared__ write")  # read, not dropped
    ours, excluded, _ = sanitize.classify(found, sanitize.exclusions())
    # The two races on the ring and the store into a cluster peer "that may have exited" at
    # publish (tools/probes/dsmem_exit_probe.cu: racecheck flags it awaited or not).
    assert sum(excluded.values()) == 3
    # Not excluded: a race in another function of the tile kernel, nor that kind elsewhere.
    assert [k for k, _ in ours] == [found[3][0]]
    assert "store_slab" in ours[0][1]
    moved = RING_LOG.replace(
        "ClaimScheduler<(int)128, (int)1, (int)2, (bool)0>::publish(unsigned int, int)+0xd330",
        "ClaimScheduler<(int)128, (int)1, (int)2, (bool)0>::decode(int) const+0xd330",
    )
    ours, _, _ = sanitize.classify(sanitize.findings(moved), sanitize.exclusions())
    assert [k for k, _ in ours] == [found[2][0], found[3][0]]


def _function_body(text, name):
    """The body of the first function definition `name(` in `text` (braces matched)."""
    at = re.search(rf"\b{name}\([^;{{]*\)[^;{{]*{{", text)
    assert at, f"{name} is not defined"
    depth, i = 1, at.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[at.end() : i - 1]


def test_the_excluded_ring_functions_touch_only_the_ring():
    """The claim-ring exclusion names functions, not lines: each must exist and access shared
    memory only through the ring (claim_ring(), one 64-bit ld/st), so a new shared access added
    to one of them is not excluded unawares."""
    kernels = os.path.join(ROOT, "ffi", "kernels")
    sched = open(os.path.join(kernels, "tile_sched.cuh")).read()
    epilogue = open(os.path.join(kernels, "tile_epilogue.cuh")).read()
    for text, name in ((sched, "publish"), (sched, "wait_ring"), (sched, "claim"),
                       (epilogue, "own_or_none")):  # fmt: skip
        body = _function_body(text, name)
        for access in re.findall(r"(?:ld|st)\.[a-z.:]*shared[a-z.:]*\.b\d+", body):
            assert access.endswith(".b64"), (name, access)
        assert "__shared__" not in body and "smem" not in body, name
        assert "claim_ring()" in body or "wait_ring(" in body, name


INITCHECK_LOG = """========= COMPUTE-SANITIZER
========= Host API memory access error at host access to 0x7f21ddca0000 of size 262,144 bytes
=========     Uninitialized access to 0x7f21ddca0020 on access by cudaMemcpy source
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at jaxoverlap::comm_kernel(jaxoverlap::CommArgs)+0x120 in common.cuh:268
=========     by thread (96,0,0) in block (4,0,0)
========= Uninitialized __global__ memory read of size 8 bytes
=========     at loop_convert_fusion+0x90
========= Uninitialized __global__ memory read of size 8 bytes
=========     at jaxoverlap::tile::fusion_like_loop_convert_fusion+0x90
========= Invalid __global__ read of size 8 bytes
=========     at loop_convert_fusion+0x90
========= Uninitialized __global__ memory read of size 8 bytes
=========     at wrapped_add+0xc0
========= Uninitialized __global__ memory read of size 8 bytes
=========     at jaxoverlap::wrapped_add_like+0xc0
========= ERROR SUMMARY: 7 errors
"""


def test_initcheck_reads_of_tma_written_memory_excluded_only_outside_our_kernels():
    """initcheck does not follow TMA bulk stores: host copies of such memory and XLA's own fusions
    reading it (the training cases' loop_convert_fusion on a cuBLASLt output) are excluded; an
    uninitialised read in a kernel of ours, or another kind of finding in XLA's fusion, is not."""
    found = sanitize.findings(INITCHECK_LOG)
    assert len(found) == 7, found
    ours, excluded, _ = sanitize.classify(found, sanitize.exclusions())
    assert sum(excluded.values()) == 3  # the host copy, XLA's fusion's and wrapped_add's reads
    assert [w for _, w in ours] == [
        "jaxoverlap::comm_kernel(jaxoverlap::CommArgs) @ common.cuh:268",
        "jaxoverlap::tile::fusion_like_loop_convert_fusion",
        "loop_convert_fusion",
        "jaxoverlap::wrapped_add_like",
    ]


def test_stress_across_two_processes_cpu():
    """Both processes build the ten call sites, run them in turn and check every execution
    against their own reference and the first execution's bits (reference path on CPU)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "stress.py"), "--processes", "2",
           "--cpu-smoke", "--calls", "200", "--deadline-s", "150"]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert out.count("STRESS-XPROC process") == 2 and "STRESS-XPROC: PASSED" in out, out[-3000:]
    assert out.count("site rs_tile:") == 2 and "MISMATCH" not in out


def test_memory_probe_across_two_processes_cpu():
    """tools/stress.py --memory's harness on two CPU processes (reference path, gloo): fresh call
    sites, then distinct batch sizes, every call's values checked (the device memory it measures
    on a GPU is issue 25's; here the arrays, the programs and the barrier)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "stress.py"), "--processes", "2",
           "--cpu-smoke", "--memory", "1,2", "--deadline-s", "150"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("7 calls, 0 wrong") == 2, out.stdout[-2000:]
    assert "MEMORY: PASSED" in out.stdout
    # Process 0's table: every mark with both processes' rows (exchanged through the store).
    marks = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("MEM ")]
    assert marks == ["start", "fresh:1", "sizes:1", "sizes:2"], marks
    assert all(ln.count(" ours ") == 2 for ln in out.stdout.splitlines() if ln.startswith("MEM "))


def _alive(pid):
    """Whether `pid` runs: gone, or a zombie nobody reaped yet (a container's init may not), is
    not running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_deadline_kills_the_worker_under_the_sanitizer(tmp_path, monkeypatch):
    """At the deadline run_tool kills each sanitizer's whole process group: the worker under it
    too (killing the sanitizer alone left the Python worker running, holding the GPU)."""
    fake = tmp_path / "compute-sanitizer"
    pids = tmp_path / "pids"
    fake.write_text(f"#!/bin/sh\nsleep 60 &\necho $! >> {pids}\nsleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: str(fake))
    logs, timed_out, _, codes, _ = sanitize.run_tool("memcheck", "ops", str(tmp_path), 3.0, 5.0)
    assert timed_out and all(c != 0 for c in codes), codes
    children = [int(p) for p in pids.read_text().split()]
    assert len(children) == 2
    for pid in children:
        for _ in range(100):  # the kill is asynchronous: let the child go
            if not _alive(pid):
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"the worker {pid} under the sanitizer outlived the deadline")


def test_training_initcheck_leaves_xla_fusions_and_host_copies_unchecked(tmp_path, monkeypatch):
    """MODE train under initcheck: XLA's fusions uninstrumented and host copies unchecked (their
    reports -- memory written by TMA stores or a peer's copy engine -- flooded every run); the ops
    mode keeps both, and so does an explicit --kernels filter."""
    fake = tmp_path / "compute-sanitizer"
    args = tmp_path / "args"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {args}\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: str(fake))
    for mode in ("train", "ops"):
        sanitize.run_tool("initcheck", mode, str(tmp_path), 10.0, 5.0)
    sanitize.run_tool("initcheck", "train", str(tmp_path), 10.0, 5.0, kernels="jaxoverlap")
    lines = args.read_text().splitlines()
    assert len(lines) == 6, lines  # two processes per run
    flags = " ".join(sanitize.TRAIN_INITCHECK_FLAGS)
    assert [flags in ln for ln in lines] == [True, True, False, False, False, False], lines
    assert "kns=_fusion" in flags and "--check-api-memory-access no" in flags


def test_the_ce_sum_exclusion_names_its_two_reads():
    """The copy-engine sum's initcheck exclusion names ce.cu's lines 141 (the own partial, a
    cuBLASLt output) and 146 (the peers' blocks, another process's copy-engine writes): they must
    still be those reads, and nothing else of the kernel nor another kind is excluded."""
    lines = open(os.path.join(ROOT, "ffi", "kernels", "ce.cu")).read().splitlines()
    assert "reinterpret_cast<const uint4*>(own)[v]" in lines[140], lines[140]
    assert "reinterpret_cast<const uint4*>(blocks + b * stride)[v]" in lines[145], lines[145]
    rules = sanitize.exclusions()
    kernel = "jaxoverlap::<unnamed>::sum_blocks_kernel<__nv_bfloat16>(T1 *, const T1 *, long)"
    read = "Uninitialized __global__ memory read of size 16 bytes"
    hit = lambda where, kind=read: any(p.search(where, kind) for p, _ in rules)  # noqa: E731
    assert hit(kernel + " @ ce.cu:141") and hit(kernel + " @ ce.cu:146")
    assert not hit(kernel + " @ ce.cu:150") and not hit(kernel)
    assert not hit(kernel + " @ ce.cu:141", "Invalid __global__ read of size 16 bytes")


def test_training_initcheck_fills_gemm_outputs(tmp_path, monkeypatch):
    """JAXOVERLAP_SANITIZER_MEMSET=1 (ffi/runtime/gemm.h: each GEMM's output filled before
    cuBLASLt writes it, which initcheck cannot see) reaches the workers of initcheck over MODE
    train only; a value in the caller's environment wins."""
    fake = tmp_path / "compute-sanitizer"
    seen = tmp_path / "seen"
    fake.write_text(f'#!/bin/sh\necho "$2 $JAXOVERLAP_SANITIZER_MEMSET" >> {seen}\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: str(fake))
    monkeypatch.delenv("JAXOVERLAP_SANITIZER_MEMSET", raising=False)
    for tool, mode in (("initcheck", "train"), ("initcheck", "ops"), ("racecheck", "train")):
        sanitize.run_tool(tool, mode, str(tmp_path), 10.0, 5.0)
    monkeypatch.setenv("JAXOVERLAP_SANITIZER_MEMSET", "0")
    sanitize.run_tool("initcheck", "train", str(tmp_path), 10.0, 5.0)
    want = ["initcheck 1"] * 2 + ["initcheck 0"] * 2 + ["racecheck 0"] * 2 + ["initcheck 0"] * 2
    assert seen.read_text().splitlines() == want


def test_the_race_canary_ends_each_call_with_the_librarys_finish():
    """The canary's calls end with the library's finish, which also zeroes the next call's ticket
    counters: a finish of the probe's own that only advanced the epoch made the comm canary's
    CTAs draw tickets past the grid from the third call on, and the part hung (issue 25, item
    2). The comm and chunked parts launch it (launch_finish, kernels/comm.h); the tile kernel
    ends its own calls (session 12: tile_rs.cuh, end_call), so no finish may follow it -- a
    second one would advance the epoch twice per call."""
    text = open(os.path.join(ROOT, "tools", "probes", "tile_live.cu")).read()
    assert not re.search(r"__global__ void \w*finish\w*\(", text)
    assert len(re.findall(r"launch_finish\(", text)) >= 2  # comm, chunked
    lines = text.splitlines()
    tile = [i for i, line in enumerate(lines) if "launch_tile_rs(" in line]
    assert len(tile) >= 2  # the canary's tile part, the live waits
    for i in tile:
        after = "\n".join(lines[i + 1 : i + 5])
        assert "launch_finish" not in after and "launch_release_slots" not in after, lines[i]


def test_sanitize_only_selects_the_training_workers_cases(tmp_path, monkeypatch):
    """tools/sanitize.py --only reaches both worker modes through one variable, XPROC_ONLY: until
    2026-12-03 the training mode read XPROC_CASES, so `--mode train --only row_parallel` ran every
    training case (and died in the one that crashes under the tool, issue 25). A tag that names
    no case of the mode is an error, never a run of nothing."""
    from tests.gpu import xproc_training

    fake = tmp_path / "compute-sanitizer"
    seen = tmp_path / "seen"
    fake.write_text(f'#!/bin/sh\necho "$XPROC_ONLY" >> {seen}\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: str(fake))
    sanitize.run_tool("memcheck", "train", str(tmp_path), 10.0, 5.0, only="row_parallel")
    assert seen.read_text().split() == ["row_parallel"] * 2
    cases = xproc_training.CASES
    monkeypatch.setenv("XPROC_ONLY", "batch_by_sequence,row_parallel")
    assert xproc_training.only_cases(cases, "train") == ["batch_by_sequence", "row_parallel"]
    monkeypatch.setenv("XPROC_ONLY", "")
    assert xproc_training.only_cases(cases, "train") == list(cases)
    monkeypatch.setenv("XPROC_ONLY", "row_parallel,rs_tile")
    try:
        xproc_training.only_cases(cases, "train")
    except SystemExit as e:
        assert "rs_tile" in str(e) and "train" in str(e)
    else:
        raise AssertionError("an unknown tag must not run nothing")


def test_the_sanitizers_own_crash_is_named(tmp_path, monkeypatch, capsys):
    """A worker line whose sanitizer process itself died (crash_backtrace's report carries the
    sanitizer's pid: session 9's exit -11 deaths, all in compute-sanitizer's own code) says TOOL
    CRASH and fails; the crash library is built and preloaded into the tool and its workers."""
    fake = tmp_path / "compute-sanitizer"
    seen = tmp_path / "preload"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$LD_PRELOAD" >> {seen}\n'
        'echo "column_parallel_bfloat16_1d OK captured=0"\n'
        'echo "[crash_backtrace] pid $$: signal 11 (Segmentation fault), address 0x10"\n'
        "kill -SEGV $$\n"
    )
    fake.chmod(0o755)
    which = sanitize.shutil.which
    monkeypatch.setattr(
        sanitize.shutil, "which", lambda name: str(fake) if "sanit" in name else which(name)
    )
    rc = sanitize.main(["--tools", "memcheck", "--mode", "train", "--out", str(tmp_path),
                        "--deadline-s", "20"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1 and "SANITIZE: FAILED" in out, out
    assert out.count("TOOL CRASH: compute-sanitizer itself") == 2, out
    lib = sanitize.crash_backtrace_lib(str(tmp_path))
    if lib is not None:  # a machine with gcc (CI has one): built and preloaded
        assert os.path.exists(lib)
        assert seen.read_text().split() == [lib, lib], seen.read_text()
