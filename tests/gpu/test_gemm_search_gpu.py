"""The GEMM runner's algorithm search (ffi/runtime/gemm.h), on one GPU: candidates are timed, the
choice is published in the shared cache, a process that finds a choice there adopts it (so ranks and
reruns compute the same bits), and JAXOVERLAP_GEMM_SEARCH=0 turns the search off. Each step in a
fresh process: plans live as long as the process."""

import json
import math
import os

from .scripts import run_script

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
