"""The code a pipeline step runs, as a fingerprint: its function and the package modules it imports.

A step's cache key covers the code that can change its output, and nothing else: the step
function's own source, and every module of this package it imports, followed transitively through
each module's imports (module level and inside functions, parent packages included, since
importing ``a.b`` runs ``a/__init__.py``). Imports under ``if TYPE_CHECKING:`` never run and are
skipped. So an edit to the scorer re-runs eval and report, never the teacher.

Sources are compared as their syntax trees with docstrings removed, so a comment, docstring or
formatting edit changes no fingerprint. Two modules are left out on purpose:
``distillgates.config`` (a step's config *values*, defaults included, are fingerprinted
separately) and ``distillgates.progress`` (display only).

Everything is read from the files, nothing is imported: the fingerprint of a copy of the package
(``package_root``) can be computed without running it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path

import distillgates

PACKAGE = "distillgates"
PACKAGE_ROOT = Path(distillgates.__file__).parent
NOT_CODE = frozenset({"distillgates.config", "distillgates.progress"})  # see the module docstring


def module_file(module: str, package_root: Path = PACKAGE_ROOT) -> Path | None:
    """The source file of ``distillgates.x.y`` (module or package), or None if there is none."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = package_root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, package_root: Path) -> set[str]:
    """Modules of this package that ``tree`` imports when it runs (``TYPE_CHECKING`` blocks skipped)."""
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            found.add(node.module)
            for alias in node.names:  # ``from distillgates.eval import scorer`` imports a module
                sub = f"{node.module}.{alias.name}"
                if module_file(sub, package_root) is not None:
                    found.add(sub)
        stack.extend(ast.iter_child_nodes(node))
    with_parents: set[str] = set()
    for module in found:
        parts = module.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return with_parents


def _normalized(tree: ast.AST) -> str:
    """The syntax tree without docstrings (comments and formatting are not in it to begin with)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):  # fmt: skip
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def _top_level(module: str, package_root: Path) -> dict[str, ast.AST]:
    path = module_file(module, package_root)
    if path is None:
        raise FileNotFoundError(f"{module}: no source file under {package_root}")
    tree = ast.parse(path.read_text(), str(path))
    return {node.name: node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}  # fmt: skip


def module_hashes(roots: Iterable[ast.AST], package_root: Path = PACKAGE_ROOT) -> dict[str, str]:
    """``{module: sha256 of its normalized source}`` for every module ``roots`` import, transitively."""
    todo = set().union(*(_imports(root, package_root) for root in roots)) - NOT_CODE
    hashes: dict[str, str] = {}
    while todo:
        module = todo.pop()
        path = module_file(module, package_root)
        if path is None or module in hashes:
            continue
        imports, hashes[module] = _module_info(path.read_text(), str(path), package_root)
        todo |= imports - NOT_CODE - hashes.keys() - {module}
    return dict(sorted(hashes.items()))


@functools.lru_cache(maxsize=512)
def _module_info(source: str, filename: str, package_root: Path) -> tuple[frozenset[str], str]:
    """(imported package modules, sha256 of the normalized source): parsed once per source text."""
    tree = ast.parse(source, filename)
    imports = frozenset(_imports(tree, package_root))
    return imports, hashlib.sha256(_normalized(tree).encode()).hexdigest()


def step_code(module: str, function: str, package_root: Path = PACKAGE_ROOT) -> dict[str, str]:
    """What a step function runs: its own normalized source and that of the functions of its module it
    calls (keys ``<module>:<name>``), and the hashes of the package modules they import (:func:`module_hashes`).
    """
    defs = _top_level(module, package_root)
    if function not in defs:
        raise LookupError(f"{module}: no top-level function {function!r}")
    own: dict[str, ast.AST] = {}
    todo = [function]
    while todo:  # the step function and the module-level helpers it names, transitively
        name = todo.pop()
        if name in own:
            continue
        own[name] = defs[name]
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs and n.id not in own]
    code = {f"{module}:{name}": hashlib.sha256(_normalized(tree).encode()).hexdigest() for name, tree in own.items()}
    return dict(sorted({**code, **module_hashes(own.values(), package_root)}.items()))


def modules_code(*modules: str, package_root: Path = PACKAGE_ROOT) -> dict[str, str]:
    """The hashes of ``modules`` and of the package modules they import, transitively (:func:`module_hashes`)."""
    return module_hashes([ast.parse(f"import {m}") for m in modules], package_root)
