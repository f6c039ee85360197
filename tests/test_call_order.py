"""The call-order guard (ffi/runtime/call_order.h), checked without GPUs: the header is plain C++,
compiled here into a small driver that replays the calls of one workspace as the ranks' hosts
issue them. Also the ``call_tag`` attribute the lowering sends (jaxoverlap/fused/call.py
``_call_tag``).

A "logical call" below is (launch, call site, iteration): what the ranks must pair. The guard sees
(run id, call tag) per call; the property checked is that it flags call number k on a rank
exactly when that rank's logical call differs from the one the first rank issued under k."""

from __future__ import annotations

import itertools
import random
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import native_driver
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import Config, fused


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    exe = native_driver(tmp_path_factory, "call_order_driver.cc")

    def run(n, calls):
        """calls: [(rank, run, tag[, captured])] in host order -> [(same, reported)] per call."""
        text = "".join(" ".join(str(v) for v in c) + "\n" for c in calls)
        out = subprocess.run([str(exe), str(n)], input=text, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return [tuple(int(v) for v in ln.split()) for ln in out.stdout.splitlines()], out.stderr

    return run


def _calls(seq):
    """A rank's logical calls [(launch, site)] -> the same with the iteration of each."""
    seen = {}
    out = []
    for launch, site in seq:
        seen[(launch, site)] = seen.get((launch, site), 0) + 1
        out.append((launch, site, seen[(launch, site)]))
    return out


def _replay(driver, n, per_rank, order):
    """Issue rank r's calls (per_rank[r], logical) in the host interleaving `order` (a list of
    ranks); check the guard against the logical calls and return the number of flagged calls."""
    logical = [_calls(seq) for seq in per_rank]
    pos = [0] * n
    calls, expect = [], []
    first = {}  # call number -> logical call of the first rank that issued it
    for r in order:
        k = pos[r]
        launch, site, _ = logical[r][k]
        pos[r] += 1
        first.setdefault(k, logical[r][k])
        calls.append((r, 1000 + launch, 7 * site + 3))  # run ids and tags as XLA / fused/call.py
        expect.append(int(first[k] == logical[r][k]))
    got, why = driver(n, calls)
    assert [g[0] for g in got] == expect, (per_rank, order)
    flagged_numbers = {
        k for k in first if any(logical[r][k] != first[k] for r in range(n) if k < len(logical[r]))
    }
    assert sum(g[1] for g in got) == len(flagged_numbers)  # one report per mispaired number
    return sum(1 - e for e in expect), why


def _interleavings(per_rank, count, seed=0):
    rng = random.Random(seed)
    tickets = [r for r, seq in enumerate(per_rank) for _ in seq]
    for _ in range(count):
        rng.shuffle(tickets)
        yield list(tickets)


def test_same_order_is_never_flagged_whatever_the_host_interleaving(driver):
    # Two launches of two programs sharing the workspace, one with the same call site twice
    # (a scan) and one with two call sites, in the same order on both ranks.
    seq = [(1, 0), (1, 0), (1, 1), (2, 5), (3, 0), (3, 0), (3, 1)]
    for order in _interleavings([seq, seq], 50):
        assert _replay(driver, 2, [seq, seq], order)[0] == 0


def test_two_programs_in_opposite_orders_are_flagged(driver):
    # Thread A's program P (two calls of one site) and thread B's program Q reach the GPUs in
    # opposite orders: every call number pairs different calls, including P's second call on
    # one rank with its first on the other (same run id and tag: the iteration tells them apart).
    rank0 = [(1, 0), (1, 0), (2, 9)]
    rank1 = [(2, 9), (1, 0), (1, 0)]
    flagged, why = _replay(driver, 2, [rank0, rank1], [0, 0, 0, 1, 1, 1])
    assert flagged == 3
    assert "different orders" in why and "rank 0" in why and "rank 1" in why
    # Afterwards the ranks are back in step: later calls pair correctly.
    more = [(3, 0), (3, 0)]
    for order in _interleavings([rank0 + more, rank1 + more], 20, seed=1):
        assert _replay(driver, 2, [rank0 + more, rank1 + more], order)[0] == 3


def test_control_flow_that_differs_between_devices_is_flagged(driver):
    # lax.cond on a device-varying value around a fused call: rank 1 skips call site 0.
    rank0 = [(1, 0), (1, 1)]
    rank1 = [(1, 1)]
    for order in ([0, 0, 1], [1, 0, 0], [0, 1, 0]):
        assert _replay(driver, 2, [rank0, rank1], order)[0] == 1


def test_command_buffers_rerecorded_on_one_rank_are_not_flagged(driver):
    """Issue 26, R3: under XLA's command buffers a device replays its graph without the handler,
    and XLA re-records per device (here rank 1 alone: an eviction or moved buffers), so the two
    hosts' call numbers count different things. Once a call of the workspace was captured the
    guard stops comparing them (the devices' epochs pair the calls); before that it flags a
    difference as always."""
    warm_up, record = 0, 1  # a command buffer's first execution is uncaptured, then recorded
    calls = [
        (0, 1000, 3, warm_up), (1, 1000, 3, warm_up),
        (0, 1001, 3, record), (1, 1001, 3, record),  # then both replay: nothing on the hosts
        (1, 1005, 3, warm_up), (1, 1006, 3, record),  # rank 1 re-records alone
        (0, 1009, 3, warm_up), (1, 1009, 3, warm_up),  # a later re-record of both
        (0, 1010, 3, record), (1, 1010, 3, record),
    ]  # fmt: skip
    got, why = driver(2, calls)
    assert got == [(1, 0)] * len(calls), (got, why)
    # Without a capture, the same host sequences are a difference (the guard is armed).
    plain = [(r, run, tag, 0) for r, run, tag, _ in calls]
    got, why = driver(2, plain)
    assert any(g == (0, 1) for g in got) and "different orders" in why, got
    # Before the first capture a difference is still flagged; after it, none is.
    mixed = [(0, 1, 3, 0), (0, 2, 3, 0), (1, 2, 3, 0), (1, 1, 3, 0), (0, 5, 3, 1), (1, 7, 3, 1)]
    got, why = driver(2, mixed)
    assert [g[0] for g in got] == [1, 1, 0, 0, 1, 1] and sum(g[1] for g in got) == 2, got


def test_random_orders_against_the_logical_calls(driver):
    rng = random.Random(3)
    for n in (2, 3, 4, 8):
        for trial in range(20):
            base = [(rng.randrange(4), rng.randrange(3)) for _ in range(12)]
            per_rank = []
            for _ in range(n):
                seq = list(base)
                if rng.random() < 0.5:  # this rank reorders a few of its calls
                    i, j = rng.randrange(12), rng.randrange(12)
                    seq[i], seq[j] = seq[j], seq[i]
                per_rank.append(seq)
            for order in _interleavings(per_rank, 3, seed=trial):
                _replay(driver, n, per_rank, order)


def test_many_distinct_calls_in_the_same_order_are_never_flagged(driver):
    # More (run, tag) pairs than the per-rank counter keeps: evictions happen alike on every
    # rank, so identical orders still agree.
    seq = [(launch, site) for launch in range(3) for _ in range(2) for site in range(150)]
    calls = [(r, 1000 + launch, site) for launch, site in seq for r in (0, 1)]
    got, _ = driver(2, calls)
    assert all(same == 1 for same, _ in got)


def test_a_rank_that_stops_issuing_keeps_memory_bounded(driver):
    # Rank 1 never issues: rank 0's calls stay open; the guard keeps at most 65536 of them and
    # still answers (and a late rank 1 call far behind is simply a first arrival).
    calls = [(0, 1, i) for i in range(70000)] + [(1, 1, 0)]
    got, _ = driver(2, calls)
    assert len(got) == 70001 and all(same == 1 for same, _ in got)


# ----------------------------------------------------------------------------- call_tag


def _tags(text):
    lines = [ln for ln in text.splitlines() if f"@{fused.GEMM_RS_TARGET}" in ln]
    return [
        (ln.split(" site = ")[1].split(" ")[0].rstrip(",:}"),
         ln.split("call_tag = ")[1].split(" ")[0].rstrip(",:}"))
        for ln in lines
    ]  # fmt: skip


def _lower(fn, name):
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    fn.__name__ = name
    f = jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)
        )
    )
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    return _tags(f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text())


CFG = Config(backend="fused")


def _rs(x, w):
    return jaxoverlap.matmul_reduce_scatter(x, w, "tp", config=CFG)


def test_call_tags_tell_the_calls_of_a_program_apart_and_are_stable(lowering_only):
    def two(x, w):
        return _rs(x, w) + _rs(x * 2, w)

    def branch(x, w):
        first = lax.cond(lax.axis_index("tp") == 0, lambda: _rs(x, w), lambda: _rs(x * 3, w))
        return first + _rs(x, w)

    a = _lower(two, "step")
    assert len(a) == 2 and a[0][0] == a[1][0]  # one workspace...
    assert a[0][1] != a[1][1]  # ...two call sites
    assert _lower(two, "step") == a  # a fresh wrapper: the same tags (no counter)
    other = _lower(two, "eval_step")
    assert [s for s, _ in other] == [s for s, _ in a] and not {t for _, t in other} & {
        t for _, t in a
    }  # the same op in another program: the same workspace, other tags
    tags = [t for _, t in _lower(branch, "step")]
    assert len(tags) == 3 and len(set(tags)) == 3  # each branch and the call after the cond
    assert all(int(t) >= 0 for t in itertools.chain(tags, (t for _, t in a)))
