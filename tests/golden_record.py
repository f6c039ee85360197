"""What tests/test_golden_lowering.py compares: the jaxoverlap custom calls of a lowered module's
text -- target, operand and result types, attributes -- in program order, and the XLA
collectives left."""

from __future__ import annotations

import re

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute")
_CALL = re.compile(
    r"stablehlo\.custom_call @(jaxoverlap_\w+)\((.*?)\) (\{.*\}) : \((.*)\) -> (.*)$"
)


def _types(text):
    """Split ``tensor<..>, !stablehlo.token`` (or one type, or a parenthesised tuple) into
    types (the order token is every _v2 call's last operand and last result)."""
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    return re.findall(r"tensor<[^>]*>|!stablehlo\.token", text)


def _attributes(text):
    """``{a = 1 : i32, backend_config = {...}, ...}`` -> {name: value text}, nested one level
    for backend_config (so a diff names the attribute that changed)."""
    body = text.strip()[1:-1]
    out, depth, start, key = {}, 0, 0, None
    items = []
    for i, ch in enumerate(body):
        if ch in "{[<(":
            depth += 1
        elif ch in "}]>)":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    for item in items:
        key, _, value = item.strip().partition(" = ")
        value = value.strip()
        out[key] = _attributes(value) if value.startswith("{") else value
    return out


def record(text):
    """The jaxoverlap custom calls of a lowered module (in order) and the collectives left."""
    calls = []
    for line in text.splitlines():
        if "stablehlo.custom_call @jaxoverlap_" not in line:
            continue
        m = _CALL.search(line.strip())
        assert m, line
        target, _, attrs, operands, results = m.groups()
        calls.append(
            dict(
                target=target,
                operands=_types(operands),
                results=_types(results),
                attributes=_attributes(attrs),
            )
        )
    left = sorted({c for c in COLLECTIVES if f"stablehlo.{c}" in text})
    return dict(calls=calls, collectives=left)
