"""The layers of DESIGN.md, held by walking every module's imports with ast (module-level,
function-local and type-only imports alike): ``hal`` < ``models`` < ``engine`` < the rest
(``entrypoints``, ``server``, ``quant``, ``benchmarks``, ``testing``), with the library's types
(``config``, ``sampling_params``, ``outputs``, ``presets``) below them all; ``client`` and ``lang``
reach neither torch nor the engine; and no two modules import each other, however indirectly."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "pagedserve"
TYPES = ("config", "sampling_params", "outputs", "presets")
SDK = ("client", "lang")
RANKS = {
    "types": 0, "hal": 1, "models": 2, "lora": 2.5, "engine": 3, "rest": 4, "client": 4, "lang": 4,
}  # fmt: skip
# Imports that run up the layers on purpose, each with the reason.
ALLOWED_UPWARD = {
    ("pagedserve", "pagedserve.entrypoints.llm"): "the package's lazy `from pagedserve import LLM`",
    ("pagedserve", "pagedserve.lora.request"): "the lazy `from pagedserve import LoRARequest` "
    "(no torch there)",
}
SDK_MAY_NOT_REACH = ("torch", "pagedserve.hal", "pagedserve.models", "pagedserve.engine")


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = package_modules()


def imported_names(module: str) -> set[str]:
    """The dotted names ``module`` imports anywhere in its source; ``from a import b`` names
    both ``a`` and ``a.b`` (b may be a submodule)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 more
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def resolve(name: str) -> str | None:
    """The package module that an imported name lives in (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def dependencies(module: str) -> set[str]:
    """The package modules ``module`` imports, leaving out its own packages (a submodule that
    imports its package's ``__init__`` is not a dependency between rooms)."""
    found = {resolve(n) for n in imported_names(module) if n.split(".")[0] == PACKAGE}
    return {d for d in found if d and d != module and not module.startswith(d + ".")}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in TYPES:
        return "types"
    return parts[1] if parts[1] in RANKS else "rest"


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{module} ({layer(module)}) imports {dep} ({layer(dep)})"
        for module in sorted(MODULES)
        for dep in sorted(dependencies(module))
        if RANKS[layer(dep)] > RANKS[layer(module)] and (module, dep) not in ALLOWED_UPWARD
    ]
    assert not upward, "imports up the layers of DESIGN.md:\n" + "\n".join(upward)


def test_client_and_lang_reach_no_torch_and_no_engine():
    """Everything client and lang import, and everything that imports in turn."""
    reached: dict[str, str] = {}  # module or third-party name -> who imported it first
    todo = [m for m in MODULES if layer(m) in SDK]
    seen = set(todo)
    while todo:
        module = todo.pop()
        for name in imported_names(module):
            reached.setdefault(name, module)
        for dep in dependencies(module) - seen:
            seen.add(dep)
            todo.append(dep)
    bad = [
        f"{name} (imported by {by})"
        for name, by in sorted(reached.items())
        for banned in SDK_MAY_NOT_REACH
        if name == banned or name.startswith(banned + ".")
    ]
    assert not bad, "client and lang reach:\n" + "\n".join(bad)


def test_no_import_circles():
    """Tarjan's strongly connected components of the import graph: each must be one module."""
    graph = {module: dependencies(module) for module in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for dep in graph[module]:
            if dep not in index:
                visit(dep)
                low[module] = min(low[module], low[dep])
            elif dep in stack:
                low[module] = min(low[module], index[dep])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)
