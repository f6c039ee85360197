"""compute-sanitizer over every fused handler, with a real second rank: two processes of
tests/gpu/xproc_worker.py (one GPU each, or both sharing one GPU), each under the sanitizer.

    python tools/sanitize.py [--tools memcheck,racecheck,synccheck,initcheck] [--mode ops]
                             [--out DIR] [--deadline-s 480] [--only TAGS] [--kernels SUBSTR]
                             [--tag NAME] [--extra "FLAGS"]

Per tool, both processes run the worker's MODE (``ops``: every fused op, the tile schedule, the
copy-engine and all-reduce handlers, the gathers along K; ``train``: the training path) with
``XPROC_TIMEOUT_S`` raised to fit the sanitizer's slowness, their logs under ``--out``. Each
finding is attributed to the kernel it names; findings in kernels matched by
tools/sanitizer_exclude.txt (cuBLASLt's, each with its reason) are counted apart. Prints one
line per (tool, process) and ``SANITIZE: PASSED`` when no finding is left in jaxoverlap's own
kernels and every case of the worker reported OK; exit status 0 then. Each finding is named by
its kernel and, where the sanitizer gives one (the kernels are built with -lineinfo), its source
line: an exclusion may name either (``kernel @ file:line``).

``--only``: the worker's cases by tag (XPROC_ONLY). ``--shapes``: the worker's problem (``default``
2048 x 2048 x 1024; ``small``, 1024 x 512 x 256, every case's code paths at 1/32 of its GEMM work).
Workers that died without a line (issue 25, calls E and 1-3): under racecheck the host's OOM killer
(a racecheck worker's host memory grows ~1 GB/s to ~48 GB and more: one racecheck pair at a time on
a 128 GB host, or ``--sanitized`` one process); under initcheck a SIGSEGV in the tool's
cuMemAllocAsync hook on a green-context stream (the GEMM search no longer allocates there, below);
under every tool, intermittently, a SIGSEGV of the compute-sanitizer process itself (2025.3.1)
while XLA compiles (session 9; reproduced without jaxoverlap: tools/probes/sanitizer_scan_probe.py).
tools/probes/crash_backtrace.c is built and preloaded where gcc is found, and a line says ``TOOL
CRASH`` when the sanitizer's own process is the one that died.
``--kernels``: instrument only kernels whose name contains this substring (``--kernel-name
kns=...``; the others run uninstrumented) -- not under racecheck while cuBLASLt's kernels run
(KERNELS says why). ``--sanitized 0``: only process 0 runs under the sanitizer, process 1 plainly
(still a real rank). ``--extra``: more compute-sanitizer flags, one string (``--extra="--flag
value"``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "gpu", "xproc_worker.py")
EXCLUDE = os.path.join(ROOT, "tools", "sanitizer_exclude.txt")
SANITIZER_FLAGS = {
    "memcheck": ["--leak-check", "no"],
    # One report per pair of racing source locations (the default): per-hazard reports of
    # cuBLASLt's mbarrier-ordered shared memory (excluded by name) flood the log and slow the run.
    "racecheck": ["--racecheck-report", "analysis"],
    "synccheck": [],
    "initcheck": [],
}


class _Rule:
    """An exclusion: ``search(where)`` on a finding's kernel (and source line); a rule written
    ``{<kind regex>} <regex>`` applies only to findings whose report line matches the kind."""

    def __init__(self, pattern):
        self.kind = None
        if pattern.startswith("{"):
            kind, _, pattern = pattern[1:].partition("} ")
            self.kind = re.compile(kind)
        self.where = re.compile(pattern.strip())

    def search(self, where, kind=""):
        return (self.kind is None or self.kind.search(kind)) and self.where.search(where)


def exclusions(path=EXCLUDE):
    """[(rule, reason)] from the exclusion file: ``[{<kind regex>} ]<regex>  # <reason>`` per
    line (the kind: a regex on the report's first line)."""
    out = []
    for line in open(path):
        line = line.strip()
        if line and not line.startswith("#"):
            pattern, _, reason = line.partition("#")
            out.append((_Rule(pattern.strip()), reason.strip()))
    return out


# Reports printed at most per process: enough that cuBLASLt's excluded ones cannot hide ours (in
# call D a per-hazard racecheck log reached 200 within cuBLASLt's kernels alone).
PRINT_LIMIT = "1000"
# Kernels instrumented per tool unless --kernels says otherwise (None: all). None for racecheck
# either: with any kernel filter (--kernel-name, --kernel-name-exclude) racecheck 2025.3.1 failed
# ("Internal Sanitizer Error: failed to handle a hardware exception", then an illegal address in
# the process) as soon as cuBLASLt's GEMM kernels ran uninstrumented -- with nothing instrumented
# at all too -- while every case ran with everything instrumented, and a filter over cases
# without cuBLASLt ran (issue 25, call D). Hence whole instrumentation, cuBLASLt's findings
# excluded by name (sanitizer_exclude.txt).
KERNELS: dict[str, str] = {}
# initcheck of the training path (MODE train): XLA's fusions read the fused ops' outputs, and the
# copy-engine handlers copy out of staging slots, both written by stores initcheck cannot see (TMA
# bulk stores of cuBLASLt's and ours; a peer process's copy engine: sanitizer_exclude.txt says
# why); initcheck flags every element of them, once per read -- a flood of reports, each with its
# host backtrace, that kept every training run from finishing in 90-160 s (issue 25: helper S's
# call 3, helper R's calls 1-2). So there XLA's fusions run uninstrumented (their reports were all
# of that kind) and host copies go unchecked; jaxoverlap's kernels, and cuBLASLt's, are checked.
TRAIN_INITCHECK_FLAGS = ["--kernel-name-exclude", "kns=_fusion", "--check-api-memory-access", "no"]


# ... and the GEMM runner fills each GEMM's output (and each cuBLASLt workspace) with 0xFF before
# cuBLASLt writes it (JAXOVERLAP_SANITIZER_MEMSET=1, ffi/runtime/gemm.h; sanitizer runs only): our
# kernels' reads of cuBLASLt's outputs (the copy-engine sum's own partial, ce.cu:141) and
# cuBLASLt's split-K reduce's reads of its workspace were reported once per element -- the flood
# that kept the training path's initcheck from finishing (issue 25, helper R's calls 2-4) -- and
# are not after the fill; an element the GEMM failed to write reads as NaN against the reference.
# Set in the caller's environment (0 or 1), the caller's value wins, in every tool and mode.
def sanitizer_memset(tool, mode):
    """JAXOVERLAP_SANITIZER_MEMSET for a run of `tool` over MODE `mode`."""
    return os.environ.get("JAXOVERLAP_SANITIZER_MEMSET") or (
        "1" if tool == "initcheck" and mode == "train" else "0"
    )


def _name(text):
    """The function named by ``at <name>+0x...`` (return type dropped)."""
    text = text.split("+0x", 1)[0].split(" in /", 1)[0].strip()
    return text[5:] if text.startswith("void ") else text


def _source(text):
    """`` @ file:line`` of a report line that gives one (``... in /path/file.cu:123``), else ""."""
    m = re.search(r" in (?:\S*/)?([^/\s]+:\d+)", text)
    return f" @ {m.group(1)}" if m else ""


def findings(log_text):
    """[(kind, where)] of one sanitizer log: each report's first line and the kernel it names,
    with its source line where given (for an API error -- ``kind`` starts with "Program hit" --
    its first host frame)."""
    found, kind = [], None
    start = re.compile(
        r"(Invalid |Uninitialized |Error: |Race reported|Barrier |Program hit |Potential )"
    )
    for line in log_text.splitlines():
        if not line.startswith("========="):
            continue
        body = line[len("=========") :].strip()
        if "SUMMARY" in body:
            continue
        if start.match(body):
            if kind is not None:
                found.append((kind, "?"))
            kind = body
            if " access at " in body:  # racecheck names the kernel on its first line
                at = body.split(" access at ", 1)[1]
                found.append((kind, _name(at) + _source(at)))
                kind = None
            continue
        if kind is None:
            continue
        at = re.search(r"(?:^|\s)at (.+?\+0x)", body)  # "at K+0x..", "Read Thread (..) at K+0x.."
        if at:
            found.append((kind, _name(at.group(1)) + _source(body)))
            kind = None
        elif body.startswith("Host Frame:") and kind.startswith("Program hit"):
            found.append((kind, body[len("Host Frame:") :].strip()))
            kind = None
    if kind is not None:
        found.append((kind, "?"))
    return found


def classify(found, rules):
    """(device findings not excluded, {reason: count} excluded, host API errors)."""
    ours, excluded, api = [], {}, []
    for kind, kernel in found:
        if kind.startswith("Program hit"):
            api.append((kind, kernel))
            continue
        reason = next((r for p, r in rules if p.search(kernel, kind)), None)
        if reason is None:
            ours.append((kind, kernel))
        else:
            excluded[reason] = excluded.get(reason, 0) + 1
    return ours, excluded, api


# The first line of a host crash's report in a worker's output (faulthandler; the native stack
# of tools/probes/crash_backtrace.c where it is preloaded).
_CRASH = re.compile(r"^(Fatal Python error|\[crash_backtrace\])")


def _kill_group(proc):
    """SIGKILL `proc`'s whole process group (it leads one: start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def crash_backtrace_lib(out):
    """tools/probes/crash_backtrace.c built into ``out`` (gcc), or None where it cannot be:
    preloaded into the sanitizer and its workers, it prints a host crash's native stack and tells
    the tool's own crash from the worker's (session 9: every worker that died with exit -11 under
    the tool died of a SIGSEGV in the compute-sanitizer process, in XLA's compilation)."""
    lib = os.path.join(os.path.abspath(out), "libcrash_backtrace.so")
    src = os.path.join(ROOT, "tools", "probes", "crash_backtrace.c")
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        return None
    r = subprocess.run([gcc, "-O1", "-g", "-shared", "-fPIC", "-o", lib, src, "-ldl"],
                       capture_output=True)  # fmt: skip
    return lib if r.returncode == 0 else None


def tool_crash(printed, pid):
    """The crash report of process ``pid`` (the sanitizer's own, when ``pid`` is the sanitizer's)
    in a worker's output, as crash_backtrace prints it, or None."""
    m = re.search(rf"^\[crash_backtrace\] pid {pid}: (.*)$", printed, re.M)
    return m.group(1) if m else None


def run_tool(tool, mode, out, deadline_s, timeout_s, only="", kernels=None, tag="", extra=(),
             sanitized=(0, 1), shapes="default", preload=None):  # fmt: skip
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        gpus = max(1, subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                     text=True).stdout.count("GPU "))  # fmt: skip
    except OSError:
        gpus = 1
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XPROC_TIMEOUT_S": str(timeout_s),  # every bounded wait sized for the sanitizer
        "JAXOVERLAP_SETUP_TIMEOUT_S": str(max(300, timeout_s)),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0",
        "NCCL_NVLS_ENABLE": "0",
        "XPROC_ONLY": only,
        "XPROC_SHAPES": shapes,
        # A host crash (a signal) prints every thread's Python stack into the worker's .out: in
        # call E two workers died under racecheck/initcheck without a line.
        "PYTHONFAULTHANDLER": "1",
        "JAXOVERLAP_SANITIZER_MEMSET": sanitizer_memset(tool, mode),
    }
    if preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [preload, os.environ.get("LD_PRELOAD")]))
    # initcheck runs with the GEMM search on (issue 25): compute-sanitizer 2025.3.1's initcheck
    # crashed the process (SIGSEGV in its cuMemAllocAsync hook) on the search's stream-ordered
    # scratch allocations on the SM partition's green-context GEMM stream
    # (tools/probes/green_async_alloc_probe.cu); the search now allocates them on an ordinary
    # stream (ffi/runtime/gemm.cc: time_candidates; tests/gpu/test_gemm_search_gpu.py runs it
    # under initcheck). JAXOVERLAP_GEMM_SEARCH=0 in the caller's environment still turns it off.
    kernels = KERNELS.get(tool) if kernels is None else kernels
    flags = [*SANITIZER_FLAGS[tool], *(["--kernel-name", f"kns={kernels}"] if kernels else [])]
    if tool == "initcheck" and mode == "train" and not kernels:
        flags += TRAIN_INITCHECK_FLAGS
    procs, logs, files = [], [], []
    for p in range(2):
        name = f"sanitize-{tool}{'-' + tag if tag else ''}-{mode}-p{p}"
        log = os.path.join(out, f"{name}.log")
        stdout = open(os.path.join(out, f"{name}.out"), "w")
        cmd = [exe, "--tool", tool, "--target-processes", "all", "--print-limit", PRINT_LIMIT,
               "--log-file", log, *flags, *extra,
               sys.executable, WORKER, str(p), "2", str(port), str(p % gpus), mode]  # fmt: skip
        if p not in sanitized:  # the peer runs plainly (--sanitized): its rank is real all the same
            cmd = cmd[cmd.index(sys.executable) :]
        if p == min(sanitized):
            knob = f"JAXOVERLAP_SANITIZER_MEMSET={env['JAXOVERLAP_SANITIZER_MEMSET']}"
            print("$", knob, " ".join(cmd), flush=True)
        # Its own process group: at the deadline the sanitizer and the Python worker under it
        # go together (killing the sanitizer alone left the worker running, holding the GPU).
        procs.append(
            subprocess.Popen(
                cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )
        files.append(stdout)
        logs.append((log, stdout.name))
    t0, timed_out = time.time(), False
    for pr in procs:
        try:
            pr.wait(timeout=max(1.0, deadline_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                _kill_group(q)
    codes = []
    for pr, f in zip(procs, files, strict=True):
        codes.append(pr.wait())
        f.close()
    return logs, timed_out, time.time() - t0, codes, [pr.pid for pr in procs]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tools", default="memcheck,racecheck,synccheck,initcheck")
    ap.add_argument("--mode", default="ops", help="xproc_worker mode (ops, train)")
    ap.add_argument("--out", default=os.environ.get("OUT", "sanitize_logs"))
    ap.add_argument("--deadline-s", type=float, default=480.0, help="per tool")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="Config.timeout_s")
    ap.add_argument("--only", default="", help="the worker's cases by tag, comma-separated")
    ap.add_argument("--kernels", default=None, help="instrument only kernels containing this")
    ap.add_argument("--shapes", default="default", help="the worker's shapes (XPROC_SHAPES)")
    ap.add_argument("--tag", default="", help="a name for this run's log files")
    ap.add_argument("--extra", default="", help="more compute-sanitizer flags (one string)")
    ap.add_argument(
        "--sanitized",
        default="0,1",
        help="the processes run under the sanitizer (the others plainly, still real ranks)",
    )
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    rules = exclusions()
    sanitized = tuple(int(p) for p in a.sanitized.split(","))
    preload = crash_backtrace_lib(a.out)
    ok = True
    for tool in a.tools.split(","):
        logs, timed_out, dt, codes, pids = run_tool(
            tool, a.mode, a.out, a.deadline_s, a.timeout_s, a.only, a.kernels, a.tag,
            a.extra.split(), sanitized, a.shapes, preload,
        )  # fmt: skip
        for p, (log, stdout) in enumerate(logs):
            if p not in sanitized:
                continue
            text = open(log).read() if os.path.exists(log) else ""
            printed = open(stdout).read()
            cases = re.findall(r"^(\S+) (OK|FAILED)", printed, re.M)
            failed = [c for c, s in cases if s == "FAILED"]
            ours, excluded, api = classify(findings(text), rules)
            summary = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: (\d+) (?:error|hazard)", text)
            # A worker ends with os._exit(0): any other status (a signal: 11 SIGSEGV, 9 SIGKILL as
            # the sanitizer passes them on) fails the line even after its cases reported.
            line_ok = not ours and not failed and cases and not timed_out and codes[p] == 0
            print(f"{tool:9s} process {p}: {len(cases)} cases ({len(failed)} failed), "
                  f"{'TIMED OUT ' if timed_out else ''}{dt:.0f} s, exit {codes[p]}, sanitizer "
                  f"summary {'+'.join(summary) or '-'} errors; ours {len(ours)}, excluded "
                  f"{sum(excluded.values())}, host API errors {len(api)}", flush=True)  # fmt: skip
            crashed = re.findall(r"Internal Sanitizer Error[^\n]*", text)
            for c in crashed[:2]:
                print(f"    SANITIZER: {c[:160]}")
            own = tool_crash(printed, pids[p])  # the Popen'd process is the sanitizer itself
            if own:
                crashed.append(own)
                print(f"    TOOL CRASH: compute-sanitizer itself (pid {pids[p]}) died: {own[:120]} "
                      "-- in the tool's own code, not the worker's (its stack below)")  # fmt: skip
            line_ok = line_ok and not crashed
            ok &= bool(line_ok)
            for reason, count in excluded.items():
                print(f"    excluded {count}: {reason[:100]}")
            for kind, frame in api[:3]:
                print(f"    API: {kind[:140]} ({frame})")
            by_line = {}
            for kind, kernel in ours:
                by_line.setdefault(kernel, []).append(kind)
            for kernel, kinds in list(by_line.items())[:20]:
                print(f"    OURS x{len(kinds)}: {kernel}: {kinds[0][:160]}")
            for c in failed[:5]:
                print(f"    FAILED case: {c}")
            if not line_ok:  # why, for a run whose log files do not come back
                lines = [ln for ln in printed.splitlines() if ln.strip()]
                crash = [i for i, ln in enumerate(lines) if _CRASH.search(ln)][:2]
                tail = [ln for i in crash for ln in lines[i : i + 30]] or lines[-6:]
                errors = [ln for ln in text.splitlines() if "rror" in ln][:4]
                for ln in tail + errors:
                    print(f"    | {ln[:200]}")
    print("SANITIZE:", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
