"""The package's shape: module and function size budgets, and the bench as a client.

A module over ``MODULE_LINES`` lines, or a function over ``FUNCTION_LINES`` lines, says
why in its module docstring, on a line of its own::

    Longer than 300 lines: one state machine; its states read best side by side.
    Longer than 60 lines: ``_serve`` is one select loop over the hop's sockets.

A function's line names it (its name, or ``Class.method``). Nothing outside
``lightning_wsync/bench`` imports the bench: it is a client of the library, reached
through the ``lightning-wsync bench`` command. (The layer order itself is checked by
``lint-imports`` with the contracts in pyproject.toml.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import lightning_wsync

MODULE_LINES = 300
FUNCTION_LINES = 60
PACKAGE = Path(lightning_wsync.__file__).resolve().parent
TESTS = Path(__file__).resolve().parents[1]
BENCH = PACKAGE / "bench"
BENCH_MODULE = "lightning_wsync.bench"


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    """Dotted name of a file under the package (``lightning_wsync.x.y``; a package is its ``__init__``)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, nested ones included, with its qualified name."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _reasons(tree: ast.Module) -> list[str]:
    """The module docstring's lines that start with ``Longer than`` (stripped)."""
    doc = ast.get_docstring(tree) or ""
    return [line.strip() for line in doc.splitlines() if line.strip().startswith("Longer than")]


def over_budget(path: Path) -> list[str]:
    """What in ``path`` is over budget without a reason in its module docstring."""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    reasons = _reasons(tree)
    problems = []
    lines = len(text.splitlines())
    if lines > MODULE_LINES and not any(r.startswith(f"Longer than {MODULE_LINES} lines:") for r in reasons):
        problems.append(f"module {lines} lines")
    for qualname, node in _functions(tree):
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length <= FUNCTION_LINES:
            continue
        named = [r for r in reasons if r.startswith(f"Longer than {FUNCTION_LINES} lines:")]
        if not any(qualname in r or f"`{node.name}`" in r for r in named):
            problems.append(f"{qualname}() {length} lines")
    return problems


def bench_imports(path: Path) -> list[str]:
    """``lightning_wsync.bench`` imports in ``path``, as ``line: module``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.is_relative_to(PACKAGE) else ""
    if package and path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        hits = [n for n in names if n == BENCH_MODULE or n.startswith(BENCH_MODULE + ".")]
        if hits:
            found.append(f"{node.lineno}: {hits[0]}")
    return found


def test_modules_and_functions_stay_within_budget_or_say_why() -> None:
    report = {}
    for path in _sources(PACKAGE):
        problems = over_budget(path)
        if problems:
            report[str(path.relative_to(PACKAGE.parent))] = problems
    assert not report, (
        f"over budget (module > {MODULE_LINES} lines, function > {FUNCTION_LINES} lines) with no reason in the "
        f"module docstring: split it, or add a line 'Longer than {MODULE_LINES} lines: <why>' / "
        f"'Longer than {FUNCTION_LINES} lines: `<function>` <why>':\n"
        + "\n".join(f"  {p}: {', '.join(v)}" for p, v in sorted(report.items()))
    )


def test_nothing_outside_the_bench_imports_it() -> None:
    report = {}
    for path in _sources(PACKAGE) + _sources(TESTS):
        if path.is_relative_to(BENCH):
            continue
        found = bench_imports(path)
        if found:
            report[str(path)] = found
    assert not report, (
        "the bench is a client of the library: drive it through lightning_wsync.cli.main(['bench', ...]) or "
        "'python -m lightning_wsync.cli bench', and move what others need into lightning_wsync.testing:\n"
        + "\n".join(f"  {p}: {', '.join(v)}" for p, v in sorted(report.items()))
    )


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    long_body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    module = tmp_path / "m.py"
    module.write_text(f'"""Doc."""\n\n\ndef f():\n{long_body}\n')
    assert over_budget(module) == [f"f() {FUNCTION_LINES + 1} lines"]
    reason = f"Longer than {FUNCTION_LINES} lines: `f` is a table."
    module.write_text(f'"""Doc.\n\n{reason}\n"""\n\n\ndef f():\n{long_body}\n')
    assert over_budget(module) == []
    method = "\n".join(f"        x{i} = {i}" for i in range(FUNCTION_LINES))
    module.write_text(f'"""Doc."""\n\n\nclass C:\n    def g(self):\n{method}\n' + "\n" * MODULE_LINES)
    expected = [f"module {MODULE_LINES + FUNCTION_LINES + 5} lines", f"C.g() {FUNCTION_LINES + 1} lines"]
    assert over_budget(module) == expected
    importer = tmp_path / "t.py"
    importer.write_text(
        "import lightning_wsync.bench._push\nfrom lightning_wsync import bench, cli\nimport lightning_wsync.cli\n"
    )
    assert bench_imports(importer) == ["1: lightning_wsync.bench._push", "2: lightning_wsync.bench"]
