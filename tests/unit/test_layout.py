"""The folders import one another only as ``DESIGN.md``'s table allows: downwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAY_IMPORT = {
    "schemas": set(),
    "control": {"schemas"},
    "streams": {"schemas"},
    "gateway": {"schemas", "control", "streams"},
    "sim": {"schemas", "control", "streams"},
}
OURS = {*MAY_IMPORT, "tokenfleet", "tests"}


def _imported_packages(source: Path) -> set[str]:
    tree = ast.parse(source.read_text(), filename=str(source))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name.split(".")[0] for name in names} & OURS


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_each_folder_imports_only_the_folders_below_it(folder: str) -> None:
    allowed = MAY_IMPORT[folder] | {folder}
    wrong = {
        str(source.relative_to(ROOT)): sorted(_imported_packages(source) - allowed)
        for source in (ROOT / folder).rglob("*.py")
    }
    assert {path: packages for path, packages in wrong.items() if packages} == {}
