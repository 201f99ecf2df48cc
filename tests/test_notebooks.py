"""Every notebook runs top to bottom on a fresh Jupyter kernel, on the smoke config, in one run folder.

The second-day passes (`01_etl` with overwrite=True, then `03_tune` resuming its finished search,
issue 14) left the suite to keep it under 20 minutes (~25 s): what they guarded, data fingerprinted
by content and not by run id, is checked in test_etl (the same fingerprint after a re-run), and
tune's resume of finished trials in test_tune.
"""
from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO

NOTEBOOKS = ["01_etl.ipynb", "02_train.ipynb", "03_tune.ipynb", "04_serve.ipynb"]


@pytest.fixture(scope="module")
def notebook_env(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("nb")
    old = dict(os.environ)
    # The kernel is a fresh process with its own Ray; it inherits these.
    os.environ.update({"RAYMILL_CONFIG": str(REPO / "configs/smoke.yaml"), "RAYMILL_RUN_DIR": str(run_dir / "run"),
                       "RAYMILL_SOURCE": str(run_dir / "src")})
    yield run_dir
    os.environ.clear()
    os.environ.update(old)


@pytest.mark.parametrize("name", [f"{n}#1" for n in NOTEBOOKS])
def test_notebook_executes(name, notebook_env):
    path = REPO / "notebooks" / name.split("#")[0]
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "store notebooks without outputs"
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    # a notebook that succeeds shows no traceback either (03_tune's trial actors had printed one per
    # decode-pool semaphore as the search ended, until the pool stopped naming semaphores: pipe_pool)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Traceback (most recent call last)" not in _without_ray_sigterm_noise(text), text[-3000:]


def _without_ray_sigterm_noise(text: str) -> str:
    """Drop the one block Ray itself prints when Tune ends a finished trial's actor with SIGTERM
    while that process runs a garbage-collector callback: "Exception ignored in: <... WeakSet ...>",
    Ray's `sigterm_handler`, "SystemExit: 1" (1 of 4 fresh-clone CI runs, 2026-11-27). It is the
    actor's shutdown, after its trial's results are in; any other traceback still fails."""
    kept, block = [], []
    for line in text.splitlines():
        if "Exception ignored in:" in line:
            block = [line]
        elif block:
            block.append(line)
            if line.rstrip().endswith("SystemExit: 1"):
                if not any("sigterm_handler" in b for b in block):
                    kept += block
                block = []
        else:
            kept.append(line)
    return "\n".join(kept + block)
