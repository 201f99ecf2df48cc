"""Two-node loopback cluster for train.ingest=ray_data placement, driven by test_ingest_ray.py.

The head node has 1 CPU and a custom resource `accelerator` standing in for a GPU; the second
node is a 2-CPU "CPU node". The one training worker asks for {"CPU": 1, "accelerator": 1}, so
it lands on the head and fills its CPU; Ray Data's decode tasks can then only run on the CPU
node. Prints one JSON line: the node ids of the worker, of decoding, and of each node.
Usage: python tests/ingest_two_node_run.py WORKDIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from stages.etl import stage as etl
from stages.train import stage as train
from stages.common import session
from workflow import demo_data
from stages.common.config import load_config

REPO = Path(__file__).resolve().parents[1]


def main(workdir: str) -> None:
    work = Path(workdir)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"accelerator": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    accelerator = next(i for i, r in nodes.items() if r.get("accelerator"))
    cfg = load_config(REPO / "configs/smoke.yaml", [
        "train.ingest=ray_data", "train.num_workers=1", "train.cpus_per_worker=1",
        "train.worker_resources={accelerator: 1}", "train.epochs=1", "train.batch_size=8",
        f"run.dir={work / 'run'}"])
    session.start(cfg.ray)
    demo_data.generate(work / "src", images=120, seed=3)
    data = etl.run(cfg.etl, str(work / "src"), str(work / "ds"))
    result = {"accelerator_node": accelerator, "cpu_node": next(i for i in nodes if i != accelerator)}
    try:
        model = train.run(cfg.train, data, str(work / "train"), seed=0, ray_cfg=cfg.ray)
        history = [json.loads(x) for x in (work / "train/metrics.jsonl").read_text().splitlines()]
        result.update(ok=True, worker_nodes=history[0]["worker_nodes"],
                      decode_nodes=history[0]["decode_nodes"], test_acc=model.manifest["metrics"]["test_acc"])
    except Exception as e:
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    print("RESULT " + json.dumps(result), flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
