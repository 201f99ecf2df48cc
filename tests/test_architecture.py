"""The shape of the code base (ARCHITECTURE.md): floors checked on every import statement,
functions that fit on a screen, benchmarks smaller than the product.

ground floor  workflow/core/  config, storage, artifacts, session, locks, fingerprint, tracking:
                              imports nothing from stages/ or the roof
rooms         stages/         one module per stage plus the pieces they share: imports
                              workflow.core and other stages, never the roof
roof          workflow/       the CLI, the pipeline, the report: imports anything
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOF = {"workflow.pipeline", "workflow.__main__", "workflow.report", "workflow.demo_data"}


def _imports(path: Path) -> list[str]:
    """Every module an import statement in `path` names, at any depth (function-local ones too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _files("workflow/core"), ids=lambda p: p.name)
def test_ground_floor_imports_no_stage_and_no_roof(path):
    bad = [m for m in _imports(path) if m.split(".")[0] == "stages" or m in ROOF
           or (m.startswith("workflow.") and not m.startswith("workflow.core"))]
    assert not bad, f"{path.relative_to(REPO)} imports {bad}: the ground floor must not import upward"


@pytest.mark.parametrize("path", _files("stages"), ids=lambda p: p.name)
def test_stages_import_only_the_ground_floor(path):
    bad = [m for m in _imports(path) if m.startswith("workflow") and not m.startswith("workflow.core")
           and m != "workflow"]
    assert not bad, f"{path.relative_to(REPO)} imports {bad}: a stage may import only workflow.core"


def test_the_check_sees_a_violation(tmp_path):
    """The scanner itself must find an upward import, or the tests above prove nothing."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from workflow import pipeline\n    import stages.etl\n")
    assert {"workflow", "workflow.pipeline", "stages.etl"} <= set(_imports(bad))


def _functions(folder: str):
    for path in _files(folder):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


@pytest.mark.parametrize("folder", ["stages", "workflow", "benchmarks"])
def test_functions_fit_on_a_screen(folder):
    """STYLE.md rule 7: at most 60 lines a function, unless a `# long:` comment on its first
    line says why."""
    long = [f"{p.relative_to(REPO)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p, n in _functions(folder) if n.end_lineno - n.lineno + 1 > 60
            and "# long:" not in p.read_text().splitlines()[n.lineno - 1]]
    assert not long, "split these functions: " + "; ".join(long)


def test_benchmarks_are_smaller_than_the_product():
    def lines(folder: str) -> int:
        return sum(len(p.read_text().splitlines()) for p in _files(folder))

    assert lines("benchmarks") < lines("stages") + lines("workflow")
