"""The op pack's dispatch overhead on real torch tensors (CPU), next to direct calls.

Each op object call is timed against a direct call of the implementation kernreg chose,
on tiny tensors so the figures are dispatch, not arithmetic. For comparison, the same
op exposed as a ``torch.library`` custom op (``kernreg.torch.as_custom_op``) and called
eagerly. Needs torch and kernreg-ops (``pip install -e ./ops``); the runner reports this
module as skipped without them.
"""

from __future__ import annotations

import timeit
from typing import Any

import torch

import kernreg_ops.ops as ops
from kernreg.torch import as_custom_op
from kernreg_ops import _aten, reference

#: DESIGN.md: an op object with a per-call dtype/device gate costs at most this over a direct call.
GATED_BUDGET_NS = 250.0


def _per_call_ns(stmt: str, namespace: dict[str, Any], number: int, rounds: int) -> float:
    timer = timeit.Timer(stmt, globals=namespace)
    timer.timeit(min(number, 200))  # resolve the op object, fill its decision cache
    return min(timer.timeit(number) / number * 1e9 for _ in range(rounds))


def run(quick: bool = False) -> list[dict[str, Any]]:
    number, rounds = (2_000, 3) if quick else (50_000, 7)
    x, w = torch.ones(1, 8), torch.ones(8)
    x2 = torch.ones(1, 16)
    custom = as_custom_op(ops.rmsnorm)
    ns = {
        "x": x,
        "w": w,
        "x2": x2,
        "aten_rmsnorm": _aten.rmsnorm,
        "rmsnorm": ops.rmsnorm,
        "silu_ref": reference.silu_and_mul,
        "silu_and_mul": ops.silu_and_mul,
        "custom": custom,
    }
    direct = _per_call_ns("aten_rmsnorm(x, w)", ns, number, rounds)
    gated = _per_call_ns("rmsnorm(x, w)", ns, number, rounds)
    silu_direct = _per_call_ns("silu_ref(x2)", ns, number, rounds)
    silu = _per_call_ns("silu_and_mul(x2)", ns, number, rounds)
    custom_ns = _per_call_ns("custom(x, w)", ns, number, rounds)
    over = gated - direct
    return [
        {
            "name": "ops: rmsnorm, direct aten call",
            "value": direct,
            "unit": "ns",
            "budget": None,
            "baseline": None,
            "ratio": None,
            "ok": None,
        },
        {
            "name": "ops: rmsnorm op object over direct (dtype+device gate)",
            "value": over,
            "unit": "ns",
            "budget": f"<= {GATED_BUDGET_NS:g} ns",
            "baseline": "ops: rmsnorm, direct aten call",
            "ratio": gated / direct,
            "ok": over <= GATED_BUDGET_NS,
        },
        {
            "name": "ops: silu_and_mul op object over direct (gate + when predicate)",
            "value": silu - silu_direct,
            "unit": "ns",
            "budget": None,
            "baseline": None,
            "ratio": silu / silu_direct,
            "ok": None,
            "note": "the torch_compile opt-in predicate is evaluated per call where nothing "
            "faster than the reference is eligible",
        },
        {
            "name": "ops: rmsnorm as a torch.library custom op, over direct",
            "value": custom_ns - direct,
            "unit": "ns",
            "budget": None,
            "baseline": None,
            "ratio": custom_ns / direct,
            "ok": None,
        },
    ]


if __name__ == "__main__":
    for record in run():
        print(f"{record['name']}: {record['value']:.0f} {record['unit']}")
