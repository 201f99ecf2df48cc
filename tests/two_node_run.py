"""A real two-node Ray cluster on loopback (ray.cluster_utils.Cluster), driven by test_cluster.py
and `python -m benchmarks chaos`.

Runs in its own process because a process joins one Ray cluster at most, and the test session
already holds one. Prints one JSON line with what the test asserts on.
Usage: python tests/two_node_run.py WORKDIR MODE, MODE one of
  complete           both nodes, no failure
  node-loss-recover  node B dies mid-epoch; elastic (train.min_workers=1) goes on with 1 worker
  node-loss-fail     node B dies; train.max_failures=0 stops with a clear error
  node-replace       node B dies, node B' joins; the full group of 2 resumes on A + B'
  capacity-timeout   node B dies, nothing joins; the CLI stops after train.capacity_timeout_s, exit 1
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from stages.etl import stage as etl
from stages.infer import stage as infer
from stages.train import stage as train
from stages.common import session
from workflow import demo_data
from workflow.__main__ import main as cli_main
from stages.common.artifacts import load_artifact
from stages.common.config import load_config

REPO = Path(__file__).resolve().parents[1]
CAPACITY_TIMEOUT_S = 20  # with the 15 s start timeout below: 2 start attempts, then CapacityError


def _mid_epoch_checkpoint_registered(run_dir: Path) -> bool:
    """True once Ray Train has *registered* an epoch-0 checkpoint (not merely started copying it).

    Killing the node after registration makes every recovery restore from a mid-epoch checkpoint,
    the case where a world-size change used to reuse checkpoint names.
    """
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    try:
        return '"checkpoint-e000-s' in snapshot.read_text()
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_replacement_node(gcs_address: str) -> subprocess.Popen:
    """`ray start --address` with 1 CPU: what an autoscaler runs on a fresh instance.

    It finds the cluster's token in ~/.ray/auth_token, as a real replacement node must. Its agents
    get free ports, so it can't collide with other Ray clusters on this machine.
    """
    ports = ("dashboard-agent-grpc-port", "dashboard-agent-listen-port", "metrics-export-port",
             "runtime-env-agent-port")
    cmd = [str(Path(sys.executable).with_name("ray")), "start", f"--address={gcs_address}", "--num-cpus=1",
           "--object-store-memory=157286400", "--node-manager-port=0", "--object-manager-port=0",
           "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats", "--block",
           *[f"--{name}={_free_port()}" for name in ports]]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _join_replacement_node(gcs_address: str, spares: list, log: list, attempts: int = 5) -> None:
    """Start replacement nodes until one joins, as an autoscaler replaces an instance that fails to boot.

    On this loaded 2-core machine a new node's dashboard agent can take over 15 s to start, and
    Ray 2.60's raylet then aborts ("Timed out waiting for file .../dashboard_agent_listen_port_...",
    a fixed wait): that node never joins, and Train waits on. Seen in 2 of 3 tries here.
    """
    known = {n["NodeID"] for n in ray.nodes()}
    for attempt in range(1, attempts + 1):
        proc = _start_replacement_node(gcs_address)
        spares.append(proc)
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None:
            if any(n["Alive"] and n["NodeID"] not in known for n in ray.nodes()):
                log.append(f"replacement joined (attempt {attempt})")
                return
            time.sleep(1)
        _stop([proc])
    log.append(f"no replacement joined in {attempts} attempts")


def _lose_worker_node(cluster: Cluster, node, run_dir: Path, log: list, spares: list) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and not _mid_epoch_checkpoint_registered(run_dir):
        time.sleep(0.1)
    cluster.remove_node(node, allow_graceful=False)
    log.append("removed")
    if spares is not None:  # a fresh node of the same shape, as after a spot-instance loss
        _join_replacement_node(cluster.address, spares, log)


def _stop(procs: list) -> None:
    for proc in procs:  # only the `ray start` this script started, and its own process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _train_via_cli(cfg_overrides: list[str], data: Path, out: Path) -> dict:
    """`raymill train` in this process (Ray is already joined): exit code and its stderr."""
    args = ["train", "--data", str(data), "--output", str(out), "--config", str(REPO / "configs/smoke.yaml")]
    for item in cfg_overrides:
        args += ["--set", item]
    stderr = io.StringIO()
    started = time.time()
    with contextlib.redirect_stderr(stderr):
        rc = cli_main(args)
    return {"ok": rc == 0, "exit_code": rc, "error": stderr.getvalue()[-2000:],
            "seconds": round(time.time() - started, 1)}


def _overrides(mode: str, work: Path) -> list[str]:
    max_failures = 0 if mode == "node-loss-fail" else 2
    # recover: elastic (1..2 workers), so losing a node leaves a smaller but running group
    elastic = ["train.min_workers=1"] if mode == "node-loss-recover" else []
    timeout = [f"train.capacity_timeout_s={CAPACITY_TIMEOUT_S}"] if mode == "capacity-timeout" else []
    return elastic + timeout + ["train.epochs=2", "train.batch_size=8", "train.checkpoint_every_steps=3",
                                f"train.max_failures={max_failures}", f"run.dir={work / 'run'}"]


def main(workdir: str, mode: str) -> None:
    work = Path(workdir)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker_node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    # A lost node leaves too few CPUs for the full group: retry the group's start sooner. Set in
    # the driver's environment, which Ray Train copies to its controller (and a user's setting
    # wins over the one stages/train/capacity.py derives from train.capacity_timeout_s).
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "15"
    ray.init(address=cluster.address, logging_level="WARNING")
    overrides = _overrides(mode, work)
    cfg = load_config(REPO / "configs/smoke.yaml", overrides)
    session.start(cfg.ray)
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    if not (work / "ds" / "manifest.json").exists():
        demo_data.generate(work / "src", images=200, seed=2)
        etl.run(cfg.etl, str(work / "src"), str(work / "ds"))
    data = load_artifact(str(work / "ds"), "etl")
    out = work / f"train-{mode}"
    events: list = []
    spares: list | None = [] if mode == "node-replace" else None
    if mode != "complete":
        threading.Thread(target=_lose_worker_node, daemon=True,
                         args=(cluster, worker_node, out / "ray/train", events, spares)).start()
    result = {"mode": mode, "cluster_nodes": sorted(nodes), "events": events,
              "removed_node": worker_node.node_id}
    if mode == "capacity-timeout":
        result.update(_train_via_cli(overrides, work / "ds", out))
        _finish(result, cluster, [])
        return
    try:
        model = train.run(cfg.train, data, str(out), seed=0, ray_cfg=cfg.ray)
        history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        preds = infer.run(cfg.infer, model.path, data.path, str(work / f"infer-{mode}"))
        result.update(ok=True, worker_nodes=history[0]["worker_nodes"], epochs=len(history),
                      last_worker_nodes=history[-1]["worker_nodes"],
                      test_acc=model.manifest["metrics"]["test_acc"],
                      infer_rows=preds.manifest.get("metrics", {}).get("rows"))
    except Exception as e:
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    _finish(result, cluster, spares or [])


def problems(result: dict) -> list[str]:
    """What went wrong in one run's RESULT, judged by its mode; [] when it behaved as it must."""
    mode, found = result["mode"], []
    if mode != "complete" and "removed" not in result["events"]:
        found.append("the worker node was never removed")
    if mode in ("complete", "node-loss-recover", "node-replace"):
        if not result.get("ok"):
            return found + [f"training failed: {result.get('error', '')[:300]}"]
        if result["epochs"] != 2:
            found.append(f"{result['epochs']} epochs, not 2")
    last = set(result.get("last_worker_nodes") or [])
    if mode == "node-loss-recover" and len(last) != 1:
        found.append(f"training did not continue on the surviving node alone: {sorted(last)}")
    if mode == "node-replace" and (len(last) != 2 or result["removed_node"] in last):
        found.append(f"the last epoch did not run on the survivor + the replacement: {sorted(last)}")
    if mode == "node-loss-fail" and (result.get("ok") or "max_failures=0" not in result.get("error", "")):
        found.append(f"expected a clear max_failures=0 error, got ok={result.get('ok')}")
    if mode == "capacity-timeout" and (result.get("exit_code") != 1 or "CapacityError" not in result.get("error", "")):
        found.append(f"expected exit 1 with CapacityError, got {result.get('exit_code')}")
    return found


def _finish(result: dict, cluster: Cluster, spares: list) -> None:
    print("RESULT " + json.dumps(result), flush=True)
    ray.shutdown()
    _stop(spares)
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
