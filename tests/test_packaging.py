"""The package list in pyproject.toml names every package of the tree — every directory holding
Python files, with or without an ``__init__.py`` (a package left out is missing from the wheel,
though an editable install still finds it)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _packages_on_disk() -> set[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / path for name, path in cfg.get("package-dir", {}).items()}
    found = set()
    for py in (ROOT / "flatcake").rglob("*.py"):
        rel = py.parent.relative_to(ROOT)
        if "__pycache__" not in rel.parts:
            found.add(".".join(rel.parts))
    for name, d in dirs.items():
        for py in d.rglob("*.py"):
            rel = py.parent.relative_to(d)
            if "__pycache__" not in rel.parts:
                found.add(".".join((name, *rel.parts)) if rel.parts else name)
    return found


def test_every_package_of_the_tree_is_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = _packages_on_disk()
    assert on_disk - listed == set()
    assert listed - on_disk == set()  # no name left behind by a move
