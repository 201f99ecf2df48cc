"""Time to a result: the train stage's wall split into Ray's naive floor, raymill's own fixed
costs and the real work, side by side in one run (the demo: configs/default.yaml, 1,500 images).

- **Ray's naive floor** for the same shape: `ray.init`, then a no-op `TorchTrainer` with the
  same planned workers and one report with a checkpoint of the model's size per epoch, as a user
  writes it (Ray Train's defaults), and the same with raymill's setting of Train's controller poll
  (`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, stages/common/ray_start.TRAIN_POLL_S).
- **raymill's train stage** (`stages.train.run`, what `raymill train` calls) on the same data:
  wall, the epochs' own wall (metrics.jsonl `wall_s`), and the rest: its fixed cost.
- **Data checks** before the first step, at 1x and 10x the demo: the first train on an ETL
  output hashes every shard, a second one only stats them (stages/etl/integrity.verify_once).
- **The demo end to end**: `make run`'s command (`raymill run`, configs/default.yaml, 1,500 demo
  images) as a subprocess, `--demo-runs` times, timed from its start to its exit (imports, `ray.init`
  and `ray.shutdown` included), with each stage's own seconds from the run's report.json. These run
  first, before this process starts a Ray of its own.
The targets: the train stage's fixed cost (wall - epochs) <= 0.5x the naive floor (TorchTrainer
part, Ray's defaults); the demo's `raymill run` <= 40 s on 2 cores (every run, not the best).
`ray.init` is reported beside them, once per process for both.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import fmt, loadavg, md_table, ratio, targets_table
from benchmarks.user_runs import raymill, train_sets

__all__ = ["add_arguments", "run", "render"]

REPO = Path(__file__).resolve().parents[1]
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=1500, help="demo images (default 1500: `make run`'s)")
    p.add_argument("--scale", type=int, default=10, help="the larger data set for the data checks (default 10x)")
    p.add_argument("--epochs", type=int, default=10, help="train.epochs (default 10: configs/default.yaml)")
    p.add_argument("--demo-runs", type=int, default=3, help="`raymill run` of the demo, end to end (default 3)")


def _noop_loop(config: dict) -> None:
    """A training function that trains nothing: `reports` reports, rank 0 with a checkpoint."""
    import ray.train

    payload = os.urandom(config["checkpoint_bytes"])
    rank = ray.train.get_context().get_world_rank()
    for epoch in range(config["reports"]):
        if rank == 0:
            with tempfile.TemporaryDirectory() as folder:
                Path(folder, "state.pt").write_bytes(payload)
                ray.train.report({"epoch": epoch}, checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report({"epoch": epoch})


def _floor(plan, reports: int, checkpoint_bytes: int, storage: str, poll_s: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    os.environ[POLL_ENV] = poll_s  # propagated by the trainer from the driver to its controller
    trainer = TorchTrainer(_noop_loop, train_loop_config={"reports": reports, "checkpoint_bytes": checkpoint_bytes},
                           scaling_config=ScalingConfig(num_workers=plan.num_workers,
                                                        resources_per_worker={"CPU": plan.cpus_per_worker}),
                           run_config=RunConfig(storage_path=storage, name=f"floor-{poll_s}-{time.time_ns()}"))
    started = time.perf_counter()
    trainer.fit()
    return round(time.perf_counter() - started, 2)


def _data_checks(etl_cfg, root: Path, images: int, tag: str) -> dict[str, Any]:
    """First and second verify_once of a fresh ETL output of `images` demo images."""
    from stages import etl
    from stages.etl import integrity
    from workflow import demo_data

    demo_data.generate(root / f"src-{tag}", images=images, seed=0)
    data = etl.run(etl_cfg, str(root / f"src-{tag}"), str(root / f"ds-{tag}"))
    times = []
    for _ in range(2):
        started = time.perf_counter()
        assert integrity.verify_once(data.path) == []
        times.append(round(time.perf_counter() - started, 3))
    mb = sum(s["bytes"] for s in data.manifest["shards"]) / 2**20
    return {"images": images, "shard_mb": round(mb, 1), "first_s": times[0], "second_s": times[1], "data": data}


def _demo_runs(images: int, runs: int) -> list[dict[str, Any]]:
    """`raymill run` of the demo, `runs` times, each into a fresh run.dir: wall and stage seconds."""
    from workflow import demo_data

    rows = []
    with tempfile.TemporaryDirectory(prefix="raymill-demo-") as tmp:
        demo_data.generate(Path(tmp) / "demo", images=images, seed=0)  # `make run`'s data
        for i in range(runs):
            run_dir = Path(tmp) / f"run{i}"
            wall = raymill("run", "--config", str(REPO / "configs" / "default.yaml"),
                           *train_sets([f"run.source={Path(tmp) / 'demo'}", f"run.dir={run_dir}"]))
            report = json.loads((run_dir / "report.json").read_text())
            rows.append({"wall_s": wall, "reported_s": report["seconds"],
                         **{s["stage"]: round(s["seconds"], 2) for s in report["stages"]}})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from stages import train
    from stages.common import session
    from stages.common.config import load_config
    from stages.etl import integrity

    load, out = loadavg(), {"args": vars(args)}
    out["demo"] = _demo_runs(args.images, args.demo_runs)
    cfg = load_config(REPO / "configs" / "default.yaml", [f"train.epochs={args.epochs}", "tracking.enabled=false"])
    started = time.perf_counter()
    resources = session.start(cfg.ray)
    out["ray_init_s"] = round(time.perf_counter() - started, 2)
    with tempfile.TemporaryDirectory(prefix="raymill-startup-") as tmp:
        root = Path(tmp)
        integrity.STAMP_DIR = root / "stamps"  # a fresh stamp folder: the first check is a full one
        small = _data_checks(cfg.etl, root, args.images, "1x")
        big = _data_checks(cfg.etl, root, args.images * args.scale, f"{args.scale}x")
        data = small.pop("data")
        big.pop("data")
        plan = session.plan_workers(cfg.train, resources, cfg.ray.data_reserved_cpus)
        out["plan"] = {"workers": plan.num_workers, "cpus_per_worker": plan.cpus_per_worker}
        started = time.perf_counter()
        artifact = train.run(cfg.train, data, str(root / "train"), seed=0, ray_cfg=cfg.ray)
        wall = time.perf_counter() - started
        history = [json.loads(line) for line in (root / "train" / "metrics.jsonl").read_text().splitlines()]
        state_bytes = (root / "train" / "model.pt").stat().st_size
        out["floor_ray_default_s"] = _floor(plan, args.epochs, state_bytes, str(root / "floor"), "2.0")
        out["floor_raymill_poll_s"] = _floor(plan, args.epochs, state_bytes, str(root / "floor"), "0.2")
    epochs_s = sum(h.get("wall_s", 0.0) for h in history)
    out.update(loadavg_at_start=load, checks={"1x": small, f"{args.scale}x": big},
               train={"wall_s": round(wall, 2), "epochs_wall_s": round(epochs_s, 2),
                      "fixed_s": round(wall - epochs_s, 2),
                      "test_seconds": sum(h.get("test_seconds", 0.0) for h in history),
                      "test_acc": artifact.manifest["metrics"]["test_acc"], "checkpoint_bytes": state_bytes})
    return out


def render(result: dict[str, Any]) -> str:
    a, t = result["args"], result["train"]
    floor, polled = result["floor_ray_default_s"], result["floor_raymill_poll_s"]
    lines = [f"Demo data ({a['images']} images, configs/default.yaml, {a['epochs']} epochs), plan "
             f"{result['plan']['workers']} worker(s) x {result['plan']['cpus_per_worker']:g} CPU. "
             f"Load average at start: {result['loadavg_at_start']}. `ray.init`: {fmt(result['ray_init_s'], 1)} s "
             "(once per process, for raymill and the floor alike).", ""]
    rows = [["Ray's naive floor: no-op TorchTrainer, a checkpointed report per epoch (Ray's defaults)", fmt(floor, 1)],
            ["the same floor with raymill's controller poll (0.2 s)", fmt(polled, 1)],
            ["raymill train stage: wall", fmt(t["wall_s"], 1)],
            ["  of which the epochs (real work)", fmt(t["epochs_wall_s"], 1)],
            ["  of which fixed (wall - epochs)", fmt(t["fixed_s"], 1)],
            ["  test-split scoring inside the epochs' reports", fmt(t["test_seconds"], 2)]]
    lines += md_table(["part", "seconds"], rows, "lr") + [""]
    check_rows = [[k, v["images"], fmt(v["shard_mb"], 1), fmt(v["first_s"], 3), fmt(v["second_s"], 3)]
                  for k, v in result["checks"].items()]
    lines += ["Data checks before the first step (stages/etl/integrity.verify_once):", ""]
    lines += md_table(["data", "images", "shard MB", "first train s (hash all)", "second train s (stamp)"],
                      check_rows, "lrrrr") + [""]
    demo = result.get("demo", [])
    if demo:
        lines += [f"The demo end to end (`raymill run`, {a['images']} images, configs/default.yaml), "
                  f"{len(demo)} runs one after another:", ""]
        lines += md_table(["run", "wall s (start to exit)", "report's total s", "etl s", "train s", "infer s"],
                          [[i + 1, fmt(d["wall_s"], 1), fmt(d["reported_s"], 1), fmt(d.get("etl"), 1),
                            fmt(d.get("train"), 1), fmt(d.get("infer"), 1)] for i, d in enumerate(demo)],
                          "rrrrrr") + [""]
    fixed_ratio = ratio(t["fixed_s"], floor, 3)  # judged unrounded: 0.504 had shown as 0.50 and passed
    big = result["checks"][f"{a['scale']}x"]
    targets = [{"target": "train fixed cost / Ray's naive floor (<= 0.5)", "measured": fixed_ratio,
                "pass": fixed_ratio is not None and t["fixed_s"] <= 0.5 * floor},
               {"target": f"second check at {a['scale']}x / at 1x, seconds (no growth with the data: <= 2)",
                "measured": ratio(big["second_s"], max(result["checks"]["1x"]["second_s"], 1e-3)),
                "pass": big["second_s"] <= 2 * max(result["checks"]["1x"]["second_s"], 0.01)}]
    if demo:
        slowest = max(d["wall_s"] for d in demo)
        targets.append({"target": f"demo `raymill run`, slowest of {len(demo)}, seconds (<= 40 on 2 cores)",
                        "measured": slowest, "pass": slowest <= 40})
    return "\n".join(lines + targets_table(targets, 3))
