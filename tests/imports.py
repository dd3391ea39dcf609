"""The import statements of a Python source, as the tests of dvc.yaml's code deps and of ppo_core's layers read them."""

from __future__ import annotations

import ast
from collections.abc import Iterator


def import_statements(text: str, package: list[str]) -> Iterator[tuple[str, list[str]]]:
    """``(absolute module, imported names)`` of every import statement of ``text``, a module of ``package``
    (``["ppo_core", "algo"]``; a package's ``__init__`` is a module of the package itself), those in functions too but
    not those under ``if TYPE_CHECKING:``. ``import a.b`` gives ``("a.b", [])``."""
    tree = ast.parse(text)
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and getattr(node.test, "id", "") ==
               "TYPE_CHECKING" for part in node.body for n in ast.walk(part)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            yield ".".join(base + ([node.module] if node.module else [])), [alias.name for alias in node.names]
