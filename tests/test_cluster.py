"""A real two-node Ray cluster on loopback: placement across nodes, ETL -> DDP train -> infer on
shared storage, and the loss of a node during training: elastic recovery, a replacement node,
a bounded wait for capacity, or a clear failure. Each run is tests/two_node_run.py in its own
process; `python -m benchmarks chaos` repeats the node-loss runs to count how often they recover."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.two_node_run import CAPACITY_TIMEOUT_S, problems


def _run(workdir, mode: str) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "tests/two_node_run.py"), str(workdir), mode],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, f"no result (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("two-node")


def test_node_loss_with_elastic_workers_recovers_on_the_remaining_node(workdir):
    # train.min_workers=1, train.max_failures=2; the node dies after a mid-epoch checkpoint is
    # registered, so the 1-worker group restarts that epoch: its checkpoints must not reuse names.
    result = _run(workdir, "node-loss-recover")
    assert not problems(result), result
    assert result["last_worker_nodes"] == [n for n in result["cluster_nodes"] if n != result["removed_node"]]


def test_node_loss_then_a_replacement_node_resumes_the_full_group_on_it(workdir):
    # No min_workers: Train waits for room for both workers; `ray start --address` adds node B'.
    # Also the plain multi-node path: ETL -> 2-worker DDP spread over two nodes -> batch inference
    # on shared storage (a separate no-fault run cost ~70 s of suite time and showed nothing more).
    result = _run(workdir, "node-replace")
    assert not problems(result), result
    assert len(result["cluster_nodes"]) == 2 and result["epochs"] == 2 and result["infer_rows"] > 0
    assert len(set(result["worker_nodes"])) == 2, "the two DDP workers did not land on two nodes"
    survivor = next(n for n in result["cluster_nodes"] if n != result["removed_node"])
    assert survivor in result["last_worker_nodes"]
    assert not set(result["last_worker_nodes"]) & {result["removed_node"]}


def test_node_loss_without_a_replacement_stops_after_the_capacity_timeout(workdir):
    result = _run(workdir, "capacity-timeout")  # `raymill train`, train.capacity_timeout_s=20
    assert not problems(result), result
    assert result["exit_code"] == 1
    # stream keeps no Ray Data reserve: each worker asks for its node's 1 CPU
    assert "missing: 1 x {CPU: 1}" in result["error"] and "rerun the same command" in result["error"]
    # bounded: the timeout plus one start attempt and the run itself, never an endless wait
    assert result["seconds"] < CAPACITY_TIMEOUT_S + 240, result["seconds"]


def test_node_loss_without_retries_fails_clearly(workdir):
    result = _run(workdir, "node-loss-fail")
    assert result["events"] == ["removed"], result
    assert not result["ok"]
    assert "TrainError: training failed after train.max_failures=0 retries" in result["error"]
