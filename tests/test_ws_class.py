"""The workspace pool's size classes (ffi/runtime/ws_class.h; issue 25 item 4), checked without
GPUs: the header is plain C++, compiled here by the system compiler (tests/native/ws_class_test.cc).
Before it every (op, shape) kept a workspace of its own forever, so a serving loop whose batch
varies grew device memory by one workspace per batch size; these tests hold the policy that
bounds it: a class holds every block it serves and wastes at most half of it, a run of sizes
touches a logarithmic number of classes, and every call of a class -- whatever its site --
maps to one workspace, except the exact ones (the tile schedule's)."""

from __future__ import annotations

import math
import subprocess

import pytest
from harness import native_driver


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    exe = native_driver(tmp_path_factory, "ws_class_test.cc")

    def ask(*args):
        out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return [ln.split() for ln in out.stdout.splitlines()]

    return ask


def classes(pool, sizes):
    return {int(b): int(c) for _, b, c in pool(*[a for s in sizes for a in ("class", s)])}


def test_a_class_holds_its_block_and_wastes_at_most_half(pool):
    (_, low), = pool("min")  # fmt: skip
    low = int(low)
    sizes = [1, low - 1, low, low + 1, 3 * low // 2, 3 * low // 2 + 1, 2 * low - 1, 2 * low + 1]
    sizes += [2**k + d for k in range(17, 41, 3) for d in (-1, 0, 1)]
    sizes += [3 * 2**k + d for k in range(17, 40, 3) for d in (-1, 0, 1)]
    sizes += [131072 * i for i in range(1, 201)] + [12345 * i for i in range(1, 300, 7)]
    got = classes(pool, sizes)
    for b, c in got.items():
        assert c >= b and c >= low, (b, c)
        assert c <= max(low, 1.5 * b), (b, c)  # at most 1.5x the block it serves
        k = c.bit_length() - 1
        assert c == 2**k or c == 3 * 2 ** (k - 1), c  # 2^k or 3 * 2^(k-1)
    assert classes(pool, sorted(set(got.values()))) == {c: c for c in set(got.values())}
    order = sorted(got)
    assert all(got[a] <= got[b] for a, b in zip(order, order[1:], strict=False))  # monotone


def test_a_varying_batch_touches_a_logarithmic_number_of_classes(pool):
    # The memory probe's serving loop (tools/stress_xproc.py memory_worker): rows 256 * i of a
    # bf16 [rows, 512] @ [512, 512] reduce-scatter over 2 ranks, i = 1..200: 128 KiB * i blocks.
    blocks = [256 * i // 2 * 512 * 2 for i in range(1, 201)]
    got = classes(pool, blocks)
    used = set(got.values())
    assert len(used) <= 2 * math.ceil(math.log2(200)) + 1, sorted(used)
    # What the pool holds: each class once, vs one workspace per shape before.
    assert sum(used) <= 4 * max(used) <= 6 * max(blocks), (sum(used), max(blocks))
    assert sum(used) * 20 < sum(blocks)


def test_calls_of_one_class_share_one_workspace_whatever_their_site(pool):
    (_, low), = pool("min")  # fmt: skip
    low = int(low)
    rows = pool("key", 11, 3 * low, 0, "key", 22, 3 * low - 512, 0, "key", 33, 3 * low + 1, 0)
    (_, s1, b1, e1, same1), (_, s2, b2, e2, _), (_, s3, b3, _, _) = rows
    assert same1 == "1"
    assert (s1, b1, e1) == (s2, b2, e2) == ("-1", str(3 * low), "0")  # shared: site -1, class
    assert (s3, b3) == ("-1", str(4 * low))  # the next class: another workspace
    # Exact (the tile schedule): its own site and size, never shared.
    (_, s4, b4, e4, _), (_, s5, b5, _, _) = pool("key", 11, 3 * low, 1, "key", 22, 3 * low, 1)
    assert (s4, b4, e4) == ("11", str(3 * low), "1") and (s5, b5) == ("22", str(3 * low))


def test_exact_workspaces_are_capped(pool):
    (_, cap), = pool("cap")  # fmt: skip
    assert 8 <= int(cap) <= 256
