"""Runs of identical lines that two source files share (issue 22: no two files of ffi/handlers/
share a run of 6+ lines; tests/test_shared_runs.py runs it in CI).

    python tools/shared_runs.py [--min-lines 6] [DIR_OR_FILE ...]   (default: ffi/handlers)

Lines are compared whitespace-normalised (runs of white space folded to one space, ends
stripped, a trailing // comment dropped); blank lines, comment lines, preprocessor lines and lone
punctuation (braces, parentheses, `namespace x {`) are passed over, so a run is code that says the
same thing twice. Prints one line per pair of files, `a:10-24 ~ b:40-54 (N lines)` for the longest
run the two share, and exits 1 if it printed any."""

from __future__ import annotations

import argparse
import os
import re
import sys

SOURCE = (".cc", ".h", ".cu", ".cuh", ".cpp", ".hpp", ".py")
_PUNCT = re.compile(r"^[{}()\[\];,]*$")


def _strip_comment(line: str) -> str:
    """The line without a trailing // comment outside string literals."""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif line.startswith("//", i):
            return line[:i]
        i += 1
    return line


def normalised(text: str) -> list[tuple[int, str]]:
    """[(1-based line number, normalised line)] of the lines that count."""
    out = []
    in_block = False
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if in_block:
            if "*/" in line:
                in_block = False
            continue
        if line.startswith("/*"):
            in_block = "*/" not in line
            continue
        line = " ".join(_strip_comment(line).split())
        if not line or line.startswith(("#", "//")) or _PUNCT.match(line):
            continue
        if re.fullmatch(r"(}\s*)?namespace\s*\w*\s*{?", line) or line == "namespace {":
            continue
        out.append((no, line))
    return out


def shared_runs(a: list[tuple[int, str]], b: list[tuple[int, str]], min_lines: int):
    """[(start in a, start in b, length)] of the maximal runs of >= min_lines equal lines."""
    index: dict[tuple[str, ...], list[int]] = {}
    for i in range(len(a) - min_lines + 1):
        index.setdefault(tuple(x for _, x in a[i : i + min_lines]), []).append(i)
    runs = []
    covered = set()
    for j in range(len(b) - min_lines + 1):
        for i in index.get(tuple(x for _, x in b[j : j + min_lines]), ()):
            if (i, j) in covered:
                continue
            n = min_lines
            while i + n < len(a) and j + n < len(b) and a[i + n][1] == b[j + n][1]:
                n += 1
            covered.update((i + k, j + k) for k in range(n))
            runs.append((i, j, n))
    return runs


def scan(paths: list[str], min_lines: int = 6) -> list[str]:
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(p, f) for f in sorted(os.listdir(p)) if f.endswith(SOURCE)]
        else:
            files.append(p)
    lines = {}
    for f in files:
        with open(f, encoding="utf-8") as fh:
            lines[f] = normalised(fh.read())
    report = []
    for x in range(len(files)):
        for y in range(x + 1, len(files)):
            fa, fb = files[x], files[y]
            runs = shared_runs(lines[fa], lines[fb], min_lines)
            if not runs:
                continue
            i, j, n = max(runs, key=lambda r: r[2])
            a, b = lines[fa], lines[fb]
            more = f", +{len(runs) - 1} more runs" if len(runs) > 1 else ""
            report.append(
                f"{fa}:{a[i][0]}-{a[i + n - 1][0]} ~ {fb}:{b[j][0]}-{b[j + n - 1][0]} "
                f"({n} lines{more})"
            )
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["ffi/handlers"])
    ap.add_argument("--min-lines", type=int, default=6)
    args = ap.parse_args(argv)
    report = scan(args.paths, args.min_lines)
    for ln in report:
        print(ln)
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main())
