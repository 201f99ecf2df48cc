"""A real two-node Ray cluster on loopback (ray.cluster_utils.Cluster), driven by test_cluster.py.

Runs in its own process because a process joins one Ray cluster at most, and the test session
already holds one. Prints one JSON line with what the test asserts on.
Usage: python tests/two_node_run.py WORKDIR {complete|node-loss-recover|node-loss-fail}
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from stages import etl, infer, train
from workflow import demo_data, session
from workflow.artifacts import load_artifact
from workflow.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _remove_worker_node_mid_training(cluster: Cluster, node, ckpt_dir: Path, log: list) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and not list(ckpt_dir.glob("checkpoint-e000-s*")):
        time.sleep(0.1)
    cluster.remove_node(node, allow_graceful=False)
    log.append("removed")


def main(workdir: str, mode: str) -> None:
    work = Path(workdir)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker_node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    # A lost node leaves too few CPUs for the full group; give up waiting sooner and go elastic.
    ray.init(address=cluster.address, logging_level="WARNING",
             runtime_env={"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15"}})
    max_failures = 0 if mode == "node-loss-fail" else 2
    # recover: elastic (1..2 workers), so losing a node leaves a smaller but running group
    elastic = ["train.min_workers=1"] if mode == "node-loss-recover" else []
    cfg = load_config(REPO / "configs/smoke.yaml", elastic + [
        "train.epochs=2", "train.batch_size=8", "train.checkpoint_every_steps=3",
        f"train.max_failures={max_failures}", f"run.dir={work / 'run'}"])
    session.start(cfg.ray)
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    if not (work / "ds" / "manifest.json").exists():
        demo_data.generate(work / "src", images=200, seed=2)
        etl.run(cfg.etl, str(work / "src"), str(work / "ds"))
    data = load_artifact(str(work / "ds"), "etl")
    out = work / f"train-{mode}"
    events: list = []
    if mode != "complete":
        threading.Thread(target=_remove_worker_node_mid_training, daemon=True,
                         args=(cluster, worker_node, out / "ray/train", events)).start()
    result = {"mode": mode, "cluster_nodes": sorted(nodes), "events": events}
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
    print("RESULT " + json.dumps(result), flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
