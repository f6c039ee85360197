"""No two files of ffi/handlers/ share a run of 6+ lines (issue 22): the prelude and ending every
handler had are FusedCall's now (ffi/handlers/fused_call_skeleton.h). The scanner
(tools/shared_runs.py) is checked first on files with a planted run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNER = os.path.join(ROOT, "tools", "shared_runs.py")

_spec = importlib.util.spec_from_file_location("shared_runs", SCANNER)
shared_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shared_runs)

BODY = [
    "  int rank = c.rank();",
    "  auto* dev = c.dev();",
    "  if (std::string e = c.fork(false); !e.empty()) return e;",
    "  CK(launch_a(peers, stream));",
    "  CK(launch_b(peers, stream));",
    "  CK(launch_release_slots(peers, stream));",
    "  return c.join();",
]


def test_finds_a_planted_run_whatever_its_spacing_and_comments(tmp_path):
    a = ["// file a", "#include <x>", "int f() {", *BODY, "}"]
    # The same seven lines re-indented, a comment and blank lines between them, other code round.
    b = ["int g() {", "  other();", "  int   rank  =  c.rank();  // mine", "", "  // why"]
    b += [*BODY[1:4], "  {", *BODY[4:], "}"]
    (tmp_path / "a.cc").write_text("\n".join(a) + "\n")
    (tmp_path / "b.cc").write_text("\n".join(b) + "\n")
    (tmp_path / "c.cc").write_text("\n".join(["int h() {", *BODY[:5], "}"]) + "\n")
    report = shared_runs.scan([str(tmp_path)], 6)
    assert report == [f"{tmp_path}/a.cc:4-10 ~ {tmp_path}/b.cc:3-12 (7 lines)"], report
    assert shared_runs.scan([str(tmp_path)], 5)[-1].startswith(f"{tmp_path}/b.cc:"), "5 lines"


def test_no_two_handler_files_share_six_lines():
    handlers = os.path.join(ROOT, "ffi", "handlers")
    assert len([f for f in os.listdir(handlers) if f.endswith(".cc")]) == 6
    out = subprocess.run(
        [sys.executable, SCANNER, handlers], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0 and not out.stdout, out.stdout
