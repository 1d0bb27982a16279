"""The package keeps the size rules of docs/ARCHITECTURE.md ("Size rules"): an `ast` scan, nothing imported.

No module over 500 lines (the generated stubs aside), no class over 300, no function over 80, no folder with
more than 15 modules. A class or function counts from its first line to its last (decorators aside).
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "dreamp2p"
GENERATED = "v1"  # protoc's stubs, a folder of the package

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
MAX_FOLDER_MODULES = 15


def sources(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    return sorted(p for p in package_dir.rglob("*.py") if package_dir / GENERATED not in p.parents)


def spans(tree: ast.AST) -> Iterator[tuple[str, str, int]]:
    """(kind, name, lines) for every class and function (methods and nested ones included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            yield "class", node.name, (node.end_lineno or node.lineno) - node.lineno + 1
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield "function", node.name, (node.end_lineno or node.lineno) - node.lineno + 1


def oversized(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Every breach of the rules under ``package_dir``, one line each."""
    limits = {"class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    found = []
    for path in sources(package_dir):
        rel = path.relative_to(package_dir.parent).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            found.append(f"{rel}: module of {lines} lines (> {MAX_MODULE_LINES})")
        for kind, name, n in spans(ast.parse(text, filename=rel)):
            if n > limits[kind]:
                found.append(f"{rel}: {kind} {name} of {n} lines (> {limits[kind]})")
    per_folder = Counter(p.parent for p in sources(package_dir) if p.name != "__init__.py")
    for folder, n in sorted(per_folder.items()):
        if n > MAX_FOLDER_MODULES:
            rel = folder.relative_to(package_dir.parent).as_posix()
            found.append(f"{rel}/: {n} modules (> {MAX_FOLDER_MODULES})")
    return found


def test_the_package_keeps_the_size_rules() -> None:
    found = oversized()
    assert found == [], "split what grew past the size rules (docs/ARCHITECTURE.md):\n" + "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "dreamp2p" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "dreamp2p"


def _function(name: str, body_lines: int) -> str:
    return f"def {name}() -> None:\n" + "    pass\n" * (body_lines - 1)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"ok.py": _function("f", MAX_FUNCTION_LINES)}, []),
        ({"big.py": _function("f", MAX_FUNCTION_LINES + 1)}, ["dreamp2p/big.py: function f of 81 lines (> 80)"]),
        (
            {"cls.py": "class C:\n" + "    x = 1\n" * MAX_CLASS_LINES},
            ["dreamp2p/cls.py: class C of 301 lines (> 300)"],
        ),
        ({"long.py": "x = 1\n" * (MAX_MODULE_LINES + 1)}, ["dreamp2p/long.py: module of 501 lines (> 500)"]),
        ({"v1/peer_pb2.py": "x = 1\n" * (MAX_MODULE_LINES + 1)}, []),  # generated: exempt
        (
            {f"room/m{i}.py": "" for i in range(MAX_FOLDER_MODULES + 1)} | {"room/__init__.py": ""},
            ["dreamp2p/room/: 16 modules (> 15)"],
        ),
    ],
    ids=["function-at-limit", "function-over", "class-over", "module-over", "generated-exempt", "folder-over"],
)
def test_the_scan_names_each_breach(tmp_path: Path, files: dict[str, str], expected: list[str]) -> None:
    assert oversized(_write(tmp_path, files)) == expected
