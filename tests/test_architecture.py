"""The shape of the code base (ARCHITECTURE.md): floors checked on every import statement, no
import cycle at any depth, functions that fit on a screen, benchmarks smaller than the product.

roof          workflow/        the CLI, the pipeline, the report, the demo data: imports anything
stages        stages/<stage>/  one package per stage; a stage imports only the stages below it
ground floor  stages/common/   config, storage, artifacts, session, locks, tracking...: imports no stage
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The floors, lowest first: a package may import its own floor's modules and any lower floor's.
# train, infer and serve share a floor and never import each other.
FLOORS = [{"common"}, {"etl"}, {"feed"}, {"model"}, {"train", "infer", "serve"}, {"tune"}]
LEVEL = {name: level for level, names in enumerate(FLOORS) for name in names}
ROOF_FILES = {"__init__.py", "__main__.py", "cli_args.py", "signals.py", "pipeline.py", "preflight.py", "report.py",
              "demo_data.py"}


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


def _module(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str | None:
    """The stage package a module belongs to (`stages.feed.streaming` -> `feed`), None outside stages/."""
    parts = module.split(".")
    return parts[1] if parts[0] == "stages" and len(parts) > 1 else None


def _floor_violations(path: Path, module: str | None = None) -> list[str]:
    own = _package(module or _module(path))
    bad = []
    for name in _imports(path):
        target = _package(name)
        if name.split(".")[0] == "workflow":
            bad.append(f"{name} (the roof)")
        elif target in LEVEL and target != own and LEVEL[target] >= LEVEL[own]:
            bad.append(f"{name} (floor {LEVEL[target]} >= {own}'s {LEVEL[own]})")
    return bad


def test_every_stage_package_has_a_floor():
    packages = {p.name for p in (REPO / "stages").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LEVEL), f"packages {packages ^ set(LEVEL)}: give each a floor in FLOORS and ARCHITECTURE.md"
    assert not [p.name for p in (REPO / "stages").glob("*.py") if p.name != "__init__.py"], \
        "a module directly in stages/: put it in its stage's package"


@pytest.mark.parametrize("path", _files("stages"), ids=lambda p: str(p.relative_to(REPO / "stages")))
def test_a_package_imports_only_lower_floors(path):
    bad = _floor_violations(path)
    assert not bad, f"{path.relative_to(REPO)} imports {bad}: a stage imports only the floors below it"


def test_imports_are_absolute():
    """The floor and cycle checks read absolute imports only: a `from . import x` would pass both."""
    relative = [f"{p.relative_to(REPO)}:{node.lineno}" for p in _files("stages") + _files("workflow")
                for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative, f"relative imports {relative}: write `from stages.<package> import <module>`"


def test_the_roof_holds_only_the_roof():
    extra = {p.name for p in (REPO / "workflow").rglob("*.py")} - ROOF_FILES
    assert not extra, f"workflow/ holds {extra}: workflow/ is the roof (CLI, pipeline, report, demo data)"


def _graph(roots: list[Path], base: Path = REPO) -> dict[str, set[str]]:
    """Module -> the product modules it imports. `from pkg import mod` is an edge to `pkg.mod` only:
    the package's own `__init__` re-exporting `run` from a sibling is not a cycle."""
    files = [p for root in roots for p in sorted(root.rglob("*.py"))]
    modules = {_module(p, base): p for p in files}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name
                       and not any(other.startswith(m + ".") for other in _imports(path) if other in modules)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (a list of modules, first == last), or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_no_import_cycle_between_modules():
    cycle = _cycle(_graph([REPO / "stages", REPO / "workflow"]))
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + "; move what they share to the lower module"


def test_the_checks_see_a_violation(tmp_path):
    """The scanners must find an upward import and a planted cycle, or the tests above prove nothing."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from workflow import pipeline\n    import stages.etl.stage\n")
    assert {"workflow", "workflow.pipeline", "stages.etl.stage"} <= set(_imports(bad))
    feed = REPO / "stages" / "feed" / "streaming.py"
    assert not _floor_violations(feed)
    upward = tmp_path / "stages" / "feed" / "up.py"
    upward.parent.mkdir(parents=True)
    upward.write_text("from stages.train import loop\n")
    assert _floor_violations(upward, "stages.feed.up")
    roofward = tmp_path / "roofward.py"
    roofward.write_text("def f():\n    from workflow.pipeline import run\n")
    assert _floor_violations(roofward, "stages.common.x")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import json\nfrom pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (pkg / "c.py").write_text("from pkg.a import x\n")
    assert _cycle(_graph([pkg], tmp_path)) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("import json\n")
    assert _cycle(_graph([pkg], tmp_path)) is None


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


def test_ray_data_task_functions_and_the_ingress_unpickle_without_torch(tmp_path):
    """Ray pickles a map function by its module: a Ray Data task worker unpickling one of these
    imports that module first. None of them may pull torch into a decode-only worker (each new
    worker paid ~1.7 s of CPU for it, on the first epoch's critical path). Nor may Serve's
    ingress replica, which never runs the model (213 MB without torch, 396 MB with it)."""
    import subprocess
    import sys

    from ray import cloudpickle

    from stages.feed import ray_udfs
    from stages.infer import decode as infer_decode

    functions = [ray_udfs.decode_augment_batch, ray_udfs.decode_batch, ray_udfs.augment_batch,
                 ray_udfs.from_webdataset, infer_decode.decode_batch]
    pickled = tmp_path / "functions.pkl"
    pickled.write_bytes(cloudpickle.dumps(functions))
    probe = ("import sys; from ray import cloudpickle; import stages.serve.http; "
             f"fs = cloudpickle.loads(open({str(pickled)!r}, 'rb').read()); "
             "print(len(fs), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == [str(len(functions)), "False"], done.stdout
