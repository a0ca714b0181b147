"""The module layers: each layer imports only layers below it, and no private name crosses
a module boundary (see docs/design.md, "Modules")."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = SRC / "kernreg"
OPS = ROOT / "ops" / "src"

#: Layer of every core module, lowest first. A module may import its own layer and below.
LAYERS: dict[str, int] = {}
_ORDER = (
    (
        "values",
        "kernreg._fork kernreg._frozen kernreg._names kernreg.errors kernreg.dtypes kernreg._packages "
        "kernreg.platform kernreg._devices kernreg.spec kernreg.config kernreg.measurement "
        "kernreg.version kernreg.pins kernreg.plan kernreg._compile",
    ),
    ("decision", "kernreg.selection kernreg.ambiguity kernreg.autotune"),
    ("stores", "kernreg.tuning kernreg.tracing kernreg.demotion"),
    ("inventory", "kernreg.inventory"),
    ("registry", "kernreg.registry"),
    ("dispatch", "kernreg.dispatch kernreg._codegen kernreg._pickle"),
)
for _level, (_name, _modules) in enumerate(_ORDER):
    for _module in _modules.split():
        LAYERS[_module] = _level
OUTER = len(_ORDER)
#: Outer modules: may import anything in the core, never imported by it.
OUTER_PREFIXES = ("kernreg.torch", "kernreg.cli", "kernreg.distributed", "kernreg.plugins")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(root.rglob("*.py")):
        yield _module_name(path, root), path


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(module: str, path: Path) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import anywhere in the file,
    under ``TYPE_CHECKING`` and inside functions included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node, is_package)
            for alias in node.names:
                yield target, alias.name, node.lineno


def _core_modules() -> list[tuple[str, Path]]:
    return [
        (name, path)
        for name, path in _sources(SRC)
        if name != "kernreg" and name != "kernreg.__main__" and not name.startswith(OUTER_PREFIXES)
    ]


def _layer_of(module: str) -> int | None:
    if module.startswith(OUTER_PREFIXES) or module in ("kernreg", "kernreg.__main__"):
        return OUTER
    return LAYERS.get(module)


def test_every_core_module_has_a_layer() -> None:
    unplaced = [name for name, _ in _core_modules() if name not in LAYERS]
    assert unplaced == [], f"give these modules a layer in LAYERS: {unplaced}"


@pytest.mark.parametrize(("module", "path"), _core_modules(), ids=lambda v: str(v))
def test_core_modules_import_only_their_layer_and_below(module: str, path: Path) -> None:
    own = LAYERS[module]
    upward = []
    for imported, name, line in _imports(module, path):
        if imported != "kernreg" and not imported.startswith("kernreg."):
            continue
        candidates = [imported]
        if name is not None:  # `from kernreg import registry` imports a module
            candidates.insert(0, f"{imported}.{name}")
        layer = next((_layer_of(c) for c in candidates if _layer_of(c) is not None), None)
        if imported == "kernreg" and (name is None or _layer_of(f"kernreg.{name}") is None):
            layer = OUTER  # the package facade re-exports everything
        if layer is not None and layer > own:
            upward.append(f"line {line}: {imported}{'.' + name if name else ''}")
    assert upward == [], f"{module} (layer {own}) imports from above: {upward}"


@pytest.mark.parametrize("module", sorted(m for m, _ in _core_modules()))
def test_importing_a_core_module_loads_no_outer_layer(module: str) -> None:
    code = (
        f"import {module}, json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kernreg'))))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(out.splitlines()[-1])
    outer = [
        m for m in loaded if m.startswith(("kernreg.torch", "kernreg.cli", "kernreg.distributed"))
    ]
    assert outer == []


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package (``from kernreg import _devices``)."""
    for root in (SRC, OPS):
        base = root / Path(*dotted.split("."))
        if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
            return True
    return False


#: The field tables every ``kernreg._frozen.Frozen`` value class declares (its documented
#: protocol: which fields compare, show and pickle), readable from outside like ``__slots__``.
FROZEN_PROTOCOL = frozenset({"_fields", "_compare", "_repr", "_slots"})


def _private_uses(module: str, path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    aliases: dict[str, str] = {}  # local name -> kernreg module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, node, is_package)
            if not target.startswith(("kernreg", "kernreg_ops")):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                submodule = f"{target}.{alias.name}"
                if private and target != module and not _is_module(submodule):
                    yield f"line {node.lineno}: from {target} import {alias.name}"
                aliases[alias.asname or alias.name] = submodule
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(("kernreg", "kernreg_ops")):
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if node.attr in FROZEN_PROTOCOL:
            continue
        dotted = []
        value: ast.expr = node.value
        while isinstance(value, ast.Attribute):
            dotted.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in aliases:
            continue
        owner = ".".join([aliases[value.id], *reversed(dotted)])
        if owner != module and owner.startswith(("kernreg", "kernreg_ops")):
            yield f"line {node.lineno}: {owner}.{node.attr}"


@pytest.mark.parametrize(("module", "path"), [*_sources(SRC), *_sources(OPS)], ids=lambda v: str(v))
def test_no_private_name_crosses_a_module_boundary(module: str, path: Path) -> None:
    assert list(_private_uses(module, path)) == []


def test_the_module_map_in_the_docs_matches_the_layers() -> None:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ")]
    documented = [
        (layer.strip(), sorted(m.strip(" `") for m in modules.split(",")))
        for layer, modules in rows[1:]
        if layer.strip() != "outer"
    ]
    assert documented == [(name, sorted(modules.split())) for name, modules in _ORDER]


def _private_names_defined(tree: ast.Module) -> set[str]:
    """The private attribute names a module defines: attributes it stores
    (``self._x = ...``), what its classes define, slots and keyword parameters. Its own
    module-level names do not count: ``other._lock`` is not this module's ``_lock``."""
    names: set[str] = set()
    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for cls in classes:
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(item.name)
            for target in ast.walk(item) if isinstance(item, (ast.Assign, ast.AnnAssign)) else ():
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    names.add(target.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries, setattr(obj, "_x", ...) and the like
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _kernreg_sources() -> list[tuple[str, Path]]:
    return [*_sources(SRC), *_sources(OPS)]


def _private_attribute_reads(path: Path, elsewhere: set[str]) -> Iterator[str]:
    """``obj._name`` where ``_name`` is private to another module (``self`` and ``cls``
    reach their own class and its bases)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = _private_names_defined(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr.startswith("__"):
            continue
        if not node.attr.startswith("_") or node.attr in FROZEN_PROTOCOL:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr not in own and node.attr in elsewhere:
            yield f"line {node.lineno}: {ast.unparse(node)}"


def test_no_private_attribute_is_read_across_modules() -> None:
    sources = _kernreg_sources()
    defined = {
        module: _private_names_defined(ast.parse(path.read_text(encoding="utf-8")))
        for module, path in sources
    }
    found = {}
    for module, path in sources:
        elsewhere = set().union(*(names for m, names in defined.items() if m != module))
        reads = {r.rpartition(".")[2] for r in _private_attribute_reads(path, elsewhere)}
        if reads:
            found[module] = reads
    assert found == {}


#: What the core may keep at module level that changes at run time (docs/design.md
#: "Size"): registries, caches, context variables, state objects.
MAX_MODULE_STATE = 15


def _module_state(module: str, path: Path) -> list[str]:
    """The names ``module`` assigns at module level whose value is mutable: containers,
    weak collections, context variables and instances of the core's own mutable classes
    (frozen values, classes, functions and read-only mappings are not state)."""
    import contextvars
    import dataclasses
    import importlib
    import types
    import weakref
    from collections import deque

    from kernreg._frozen import Frozen

    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        names += [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
    loaded = importlib.import_module(module)
    mutable = (
        dict,
        list,
        set,
        bytearray,
        deque,
        weakref.WeakSet,
        weakref.WeakKeyDictionary,
        weakref.WeakValueDictionary,
        contextvars.ContextVar,
    )
    found = []
    for name in names:
        value = vars(loaded)[name]
        plain = (type, types.FunctionType, types.MappingProxyType, Frozen, tuple, frozenset)
        frozen = dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen  # type: ignore[attr-defined]
        own = type(value).__module__.startswith("kernreg") and not isinstance(value, plain)
        own = own and not frozen
        if isinstance(value, mutable) or own:
            found.append(f"{module}.{name}")
    return found


def test_the_core_keeps_little_module_level_state() -> None:
    found = [name for module, path in _core_modules() for name in _module_state(module, path)]
    assert len(found) <= MAX_MODULE_STATE, found
