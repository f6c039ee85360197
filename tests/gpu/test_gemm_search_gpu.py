"""The GEMM runner's algorithm search (ffi/runtime/gemm.h), on one GPU: candidates are timed, the
choice is published in the shared cache, a process that finds a choice there adopts it (so ranks and
reruns compute the same bits), and JAXOVERLAP_GEMM_SEARCH=0 turns the search off. Each step in a
fresh process: plans live as long as the process."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from .scripts import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, sys
from jaxoverlap import runtime
nat = runtime.native()
if sys.argv[1]:
    nat.set_gemm_cache_dir(sys.argv[1])
err = nat._gemm_alignment_check(0, 0)
_, ms = nat._gemm_candidates(0, 2048, 2048, 2048)
print("RESULT " + json.dumps(dict(err=err, plans=nat.gemm_plans(0), candidates=ms)))
"""


def _run(cache_dir, **env):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        out, lines = run_script(SCRIPT, str(cache_dir), timeout=120)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert "RESULT" in lines, out[-3000:]
    r = json.loads(lines["RESULT"].split(" ", 1)[1])
    (plan,) = [p for p in r["plans"] if (p["m"], p["n"], p["k"]) == (128, 384, 256)]
    return r, plan


def test_search_publish_and_adopt(gpus_any, tmp_path):
    r, plan = _run(tmp_path)
    assert r["err"] < 1e-2
    assert plan["note"] == "" and plan["candidates"] > 1 and not plan["cached"], plan
    assert 0 < plan["ms_best"] <= plan["ms_first"]
    assert math.isfinite(r["candidates"][0]) and r["candidates"][0] > 0, r["candidates"]
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 1 and files[0].startswith("gemm-"), files  # no temporary left behind
    path = tmp_path / files[0]
    index, first, best, count = path.read_text().split()
    assert (int(index), int(count)) == (plan["chosen"], plan["candidates"])

    # Another process finds a (different) choice in the cache: it computes with that one.
    other = (int(index) + 1) % int(count)
    path.write_text(f"{other} {first} {best} {count}\n")
    r2, plan2 = _run(tmp_path)
    assert plan2["cached"] and plan2["chosen"] == other, plan2
    assert r2["err"] < 1e-2  # the adopted algorithm computes the same product


def test_search_off(gpus_any, tmp_path):
    r, plan = _run(tmp_path, JAXOVERLAP_GEMM_SEARCH="0")
    assert r["err"] < 1e-2
    assert plan["candidates"] == 1 and plan["chosen"] == 0, plan
    assert plan["note"] == "JAXOVERLAP_GEMM_SEARCH=0"
    assert os.listdir(tmp_path) == []


# The search on the GEMM stream of a green-context SM partition (as a fused call's GEMMs plan
# there), on the shape of tools/sanitize.py's small cases.
GREEN = """
import json
from jaxoverlap import runtime
sms, ms = runtime.native()._gemm_candidates(0, 1024, 512, 256, False, 16)
print("RESULT " + json.dumps(dict(sms=sms, candidates=ms)))
"""


def test_search_on_a_green_context_stream_under_initcheck(gpus_any, tmp_path):
    """Issue 25: compute-sanitizer 2025.3.1's initcheck crashed the process (SIGSEGV in its
    cuMemAllocAsync hook) on a stream-ordered allocation on a green-context stream, which the
    search made for its scratch operands on the partition's GEMM stream
    (tools/probes/green_async_alloc_probe.cu reproduces the crash without our code). The scratch
    now comes from an ordinary stream of the runner's (ffi/runtime/gemm.cc: time_candidates):
    under initcheck the process must end normally, every candidate timed, with no finding outside
    cuBLASLt's kernels (tools/sanitizer_exclude.txt)."""
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        if os.environ.get("JAXOVERLAP_REQUIRE_GPU") == "1":
            pytest.fail("compute-sanitizer not found (JAXOVERLAP_REQUIRE_GPU=1)")
        pytest.skip("compute-sanitizer not found")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import sanitize

    log = tmp_path / "initcheck.log"
    # JAX on CPU: only the native module touches the GPU (fewer launches for the sanitizer).
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "JAXOVERLAP_GEMM_SEARCH": "1"}
    cmd = [exe, "--tool", "initcheck", "--log-file", str(log), sys.executable, "-c", GREEN]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    text = log.read_text() if log.exists() else ""
    print(p.stdout[-2000:], p.stderr[-2000:], text[-3000:], sep="\n")
    assert p.returncode == 0, f"exit {p.returncode} under initcheck"
    result = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert result, "no result line"
    r = json.loads(result[0].split(" ", 1)[1])
    assert r["sms"] > 0 and len(r["candidates"]) > 1, r  # the partition's stream, a search
    timed = [t for t in r["candidates"] if math.isfinite(t)]  # +inf: a candidate that failed
    assert math.isfinite(r["candidates"][0]) and len(timed) > 1 and min(timed) > 0, r
    assert "ERROR SUMMARY" in text, "initcheck wrote no summary"
    ours, _, api = sanitize.classify(sanitize.findings(text), sanitize.exclusions())
    assert not ours and not api, (ours[:5], api[:5])


# The GEMM runner's lone GEMM (128 x 384 x 256 bf16), its output copied to the host.
ALONE = """
from jaxoverlap import runtime
print("RESULT", runtime.native()._gemm_alignment_check(0, 0))
"""


def test_sanitizer_memset_makes_gemm_outputs_initialised_under_initcheck(gpus_any, tmp_path):
    """Issue 25: initcheck does not see cuBLASLt's (TMA) stores, so the copy of a GEMM's output to
    the host is reported on every 32-byte granule (3,072 here, helper R's call 2 of 2026-12-02) --
    the blind spot that flooded the training path's initcheck. JAXOVERLAP_SANITIZER_MEMSET=1
    (ffi/runtime/gemm.h) fills the output before the GEMM: no report, the same right product.
    Without it (the control) the reports are there: if a later compute-sanitizer sees TMA stores,
    this fails and the knob is no longer needed."""
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        if os.environ.get("JAXOVERLAP_REQUIRE_GPU") == "1":
            pytest.fail("compute-sanitizer not found (JAXOVERLAP_REQUIRE_GPU=1)")
        pytest.skip("compute-sanitizer not found")
    reports = {}
    for knob in ("1", "0"):
        log = tmp_path / f"initcheck-{knob}.log"
        env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
               "JAXOVERLAP_SANITIZER_MEMSET": knob}  # fmt: skip
        cmd = [exe, "--tool", "initcheck", "--print-limit", "10", "--log-file", str(log),
               sys.executable, "-c", ALONE]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        text = log.read_text() if log.exists() else ""
        print(knob, p.stdout[-1000:], p.stderr[-1000:], text[-1500:], sep="\n")
        assert p.returncode == 0, f"exit {p.returncode} under initcheck (knob {knob})"
        result = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        assert result and float(result[0].split()[1]) < 1e-2, result
        summary = re.search(r"ERROR SUMMARY: (\d+) error", text)
        assert summary, "initcheck wrote no summary"
        reports[knob] = int(summary.group(1))
    assert reports["1"] == 0, reports
    assert reports["0"] > 0, reports  # the blind spot the knob covers (see the docstring)
