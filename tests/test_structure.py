"""The package's shape, checked from its source (ast; no import of jaxoverlap needed):

* imports go down only, in the layer order below (also in README's "Layout" and
  docs/structure.md): an import of a module of the same or a higher layer fails, and so does
  any cycle, counting imports inside functions too;
* no jaxoverlap module is imported inside a function (that is how a cycle hides); the one lazy
  load allowed is the native extension's (`runtime.native`, through importlib);
* every custom call of a jaxoverlap target is emitted by `jaxoverlap.fused.call.emit`: no other
  function calls ``ffi_lowering`` / ``ffi_call`` / ``custom_call``, and each target name is
  written once, in `jaxoverlap.fused.targets`.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "jaxoverlap"

# Lowest first. A module may import only modules of lower layers; modules of one layer are
# independent of each other. A new module must be placed here.
LAYERS = (
    ("config", "reference", "topology", "launch"),
    ("runtime",),
    ("xproc",),
    ("fused.knobs", "fused.targets", "fused.cache", "target"),
    ("fused.call", "fused.policy"),
    ("fused.tile", "fused.last_dim", "fused.backward", "fused.tma"),
    ("fused.rows", "fused.tuning"),
    ("fused.dispatch",),
    ("fused",),
    ("ops.primitives",),
    ("ops._common",),
    (
        "ops.matmul_reduce_scatter",
        "ops.all_gather_matmul",
        "ops.matmul_all_reduce",
        "ops.dgrad_rs_wgrad",
    ),
    ("ops",),
    ("rewrite.views", "rewrite.patterns", "rewrite.advice"),
    ("rewrite.norms",),
    ("rewrite.gathers", "rewrite.reductions"),
    ("rewrite.walk",),
    ("rewrite",),
    ("overlap", "partitioning", "nnx"),
    ("",),  # the package's face, jaxoverlap/__init__.py
    ("tune",),  # the CLI and the measuring, above the face it drives
)
LAYER = {("jaxoverlap." + m).rstrip("."): i for i, names in enumerate(LAYERS) for m in names}
EMIT_FUNCS = {"ffi_lowering", "ffi_call", "custom_call"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name, modules):
    """The deepest module of the package that ``name`` names (or lies in)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod, path, modules):
    """(target module, line, inside a function) of every jaxoverlap import of ``mod``."""
    tree = ast.parse(path.read_text())
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            local = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in child.names
                ]
            for name in names:
                if name == "jaxoverlap" or name.startswith("jaxoverlap."):
                    target = _resolve(name, modules)
                    if target and target != mod:
                        found.append((target, child.lineno, in_function))
            visit(child, local)

    visit(tree, False)
    return found


def _graph():
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_module_has_a_layer():
    modules, _ = _graph()
    missing = sorted(set(modules) - set(LAYER))
    assert not missing, f"place these modules in LAYERS (tests/test_structure.py): {missing}"
    assert not sorted(set(LAYER) - set(modules)), "LAYERS names modules that do not exist"


def test_imports_go_down_only():
    _, graph = _graph()
    up = [
        f"{m}:{line} imports {t} (layer {LAYER[t]} >= {LAYER[m]})"
        for m, edges in graph.items()
        for t, line, _ in edges
        if m in LAYER and t in LAYER and LAYER[t] >= LAYER[m]
    ]
    assert not up, "imports against the layer order:\n" + "\n".join(up)


def test_no_import_cycle():
    _, graph = _graph()
    edges = {m: sorted({t for t, _, _ in e}) for m, e in graph.items()}
    state, stack = {}, []

    def dfs(m):
        state[m] = "open"
        stack.append(m)
        for t in edges.get(m, ()):
            if state.get(t) == "open":
                cycle = stack[stack.index(t) :] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                dfs(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            dfs(m)


def test_no_function_local_import_of_the_package():
    _, graph = _graph()
    local = [f"{m}:{line} imports {t}" for m, e in graph.items() for t, line, inner in e if inner]
    assert not local, "jaxoverlap imported inside a function (a hidden cycle?):\n" + "\n".join(
        local
    )
    # The one lazy load: the native extension, through importlib, in runtime.native.
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
                arg = node.args[0].value if node.args else None
                assert (mod, arg) == ("jaxoverlap.runtime", "jaxoverlap._native"), (mod, arg)


def _calls(tree):
    """(enclosing function, called name, line) for every call of an attribute or name."""
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            )
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                out.append((func, name, child.lineno))
            visit(child, inner)

    visit(tree, None)
    return out


def test_every_custom_call_is_emitted_by_emit():
    emitted = []
    for mod, path in _modules().items():
        for func, name, line in _calls(ast.parse(path.read_text())):
            if name in EMIT_FUNCS:
                emitted.append((mod, func, name, line))
    where = {(m, f) for m, f, _, _ in emitted}
    assert where == {("jaxoverlap.fused.call", "emit")}, emitted
    # ... and each target name is spelled once, in fused/targets.py (docstrings aside).
    spelled = []
    for mod, path in _modules().items():
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and re.fullmatch(r"jaxoverlap_\w+_v\d+", node.value)
            ):
                spelled.append((mod, node.value))
    assert spelled and all(m == "jaxoverlap.fused.targets" for m, _ in spelled), spelled
    names = [v for _, v in spelled]
    assert len(names) == len(set(names)) == 10, names
