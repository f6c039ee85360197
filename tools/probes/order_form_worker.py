"""One process of a two-process order probe (issue 26 R2; run by tools/probes/order_pair.sh).

    python tools/probes/order_form_worker.py PROCESS NPROC PORT GPU MODE [WORKER]

Runs tests/gpu/xproc_worker.py's MODE (``train``: tests/gpu/xproc_training.py, XPROC_ONLY picks
the cases) or, with WORKER ``order``, tests/gpu/order_worker.py's MODE (WORKER ``dispatch``:
tools/probes/order_dispatch.py's two-process measurement), with the order as
``JAXOVERLAP_ORDER_CALLS`` says (run it with 1) in the lowering form ``ORDER_FORM`` names
(jaxoverlap/fused/call.py, `ORDER_FORM`): ``token`` (the token through the `_v2` call),
``barrier`` (the `_v3` call between optimization barriers with the token), or the diagnostic
``bypass`` (tokens threaded by JAX through loops and shard_maps exactly as with ``barrier``,
but the calls not tied to them: which part of the order an XLA failure needs)."""

from __future__ import annotations

import os
import sys


def _apply_form():
    from jaxoverlap.fused import call

    form = os.environ.get("ORDER_FORM", "barrier")
    call.ORDER_FORM = "token" if form == "token" else "barrier"
    if form == "bypass":
        call._barrier = list
    print(
        f"order_form {form} ORDER_CALLS={call.ORDER_CALLS} ORDER_FORM={call.ORDER_FORM}", flush=True
    )


def main():
    dump = os.environ.get("ORDER_DUMP")
    if dump and sys.argv[1] == "0":  # process 0's HLO around PriorityFusion (before jax starts)
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text "
            f"--xla_dump_hlo_module_re={os.environ.get('ORDER_DUMP_MODULE', 'jit_run')} "
            "--xla_dump_hlo_pass_re=priority-fusion"
        ).strip()
    from tests.gpu import xproc_worker

    join = xproc_worker.join

    def joined(*a):
        out = join(*a)
        _apply_form()
        return out

    xproc_worker.join = joined  # order_worker imports it from there inside main
    args = sys.argv[1:6]
    kind = sys.argv[6] if len(sys.argv) > 6 else "xproc"
    if kind == "dispatch":  # tools/probes/order_dispatch.py across the processes
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import order_dispatch

        process = int(args[0])
        mesh, arr = xproc_worker.join(process, *map(int, args[1:4]))
        order_dispatch.pair(mesh, arr, process)
    elif kind == "order":
        from tests.gpu import order_worker

        order_worker.main(*map(int, args[:4]), args[4])
    else:
        xproc_worker.main(*map(int, args[:4]), args[4])


if __name__ == "__main__":
    main()
