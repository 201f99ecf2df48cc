"""Time to a result: the train stage's wall split into Ray's naive floor, raymill's own fixed
costs and the real work, side by side in one run (the demo: configs/default.yaml, 1,500 images).

- **The demo end to end**: `make run`'s command (`raymill run`, configs/default.yaml, 1,500 demo
  images) as a subprocess, `--demo-runs` times, timed from its start to its exit (imports, `ray.init`
  and `ray.shutdown` included), with each stage's own seconds from the run's report.json. Its train
  stage is split into named parts (stages.train.timings, from what the stage publishes): the driver's
  checks and trainer, Ray's controller and worker-group start, the workers' own set-up (model, DDP,
  decode pool), the epochs (the real work), evaluation, the reports between epochs, the last report
  and Ray's shutdown, publishing, and MLflow. Fixed cost = the stage's wall - the epochs.
- **Ray's naive floor** for the same shape, `FLOOR_RUNS` times (the median is the target's), each in a
  fresh process with a fresh Ray, as a user's script pays it (the first `fit()` of a Ray session
  creates Train's and Ray Data's cluster actors; the demo's train stage pays them too), its fit
  `SETTLE_S` after `ray.init` returns: `ray.init`, then a no-op `TorchTrainer` with the same
  planned workers and one report with a checkpoint of the model's size per epoch, as a user writes
  it (Ray Train's defaults), and the same with raymill's setting of Train's controller poll
  (`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, stages/common/ray_start.TRAIN_POLL_S).
- **Data checks** before the first step, at 1x and 10x the demo: the first train on an ETL
  output hashes every shard, a second one only stats them (stages/etl/integrity.verify_once).
- **One worker under each train host** (`--host-runs` each, alternating): the demo end to end with
  `train.num_workers=1` x 2 CPUs, a one-GPU node's plan on the CPUs, with `train.host=ray_train`
  (a TorchTrainer) and `tune_trial` (one Tune trial actor, what `auto` picks there).
These run in that order, one at a time. The targets: the demo's train-stage fixed cost <= 0.5x the
naive floor (Ray's defaults, median), in every run; the demo's `raymill run` <= 40 s on 2 cores (every run);
one worker's fixed cost under the trial actor <= 0.6x under Ray Train (worst against best).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, fmt, loadavg, md_table, ratio, targets_table
from benchmarks.user_runs import raymill, train_sets
from stages.train.timings import WORKER_SETUP

__all__ = ["add_arguments", "run", "render"]

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
# The demo's train stage starts ~3 s after `ray.init` returns (ETL runs between); the floor's fit
# waits as long, so neither pays for the other's Ray still starting its worker processes.
SETTLE_S = 3.0
FLOOR_RUNS = 3  # the floor of Ray's defaults: its median is the target's denominator


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=1500, help="demo images (default 1500: `make run`'s)")
    p.add_argument("--scale", type=int, default=10, help="the larger data set for the data checks (default 10x)")
    p.add_argument("--epochs", type=int, default=10, help="train.epochs (default 10: configs/default.yaml)")
    p.add_argument("--demo-runs", type=int, default=3, help="`raymill run` of the demo, end to end (default 3)")
    p.add_argument("--host-runs", type=int, default=2,
                   help="one-worker demo runs per train host, alternating (default 2 each; 0: skip)")


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


def floor_main(spec: dict[str, Any]) -> dict[str, float]:
    """In a fresh process: Ray started as raymill starts it (stages.common.session), then the no-op
    TorchTrainer; seconds of each. Run by `_floor` as `python -c`."""
    os.environ[POLL_ENV] = spec["poll_s"]  # before session.start, which only sets it when unset
    from stages.common import session  # before Ray's import: it keeps Ray's listeners on loopback
    from stages.common.config import load_config

    started = time.perf_counter()
    session.start(load_config(REPO / "configs" / "default.yaml", []).ray)
    init_s = time.perf_counter() - started
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    time.sleep(SETTLE_S)  # the node's own start-up work ends first, as it has by the demo's train stage
    trainer = TorchTrainer(_noop_loop, train_loop_config={"reports": spec["reports"],
                                                          "checkpoint_bytes": spec["checkpoint_bytes"]},
                           scaling_config=ScalingConfig(num_workers=spec["workers"],
                                                        resources_per_worker={"CPU": spec["cpus_per_worker"]}),
                           run_config=RunConfig(storage_path=spec["storage"], name=f"floor-{time.time_ns()}"))
    started = time.perf_counter()
    trainer.fit()
    return {"ray_init_s": round(init_s, 2), "fit_s": round(time.perf_counter() - started, 2)}


def _floor(spec: dict[str, Any]) -> dict[str, float]:
    code = f"import json; from benchmarks.startup import floor_main; print(json.dumps(floor_main({spec!r})))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the floor's process exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    return {"images": images, "shard_mb": round(mb, 1), "first_s": times[0], "second_s": times[1]}


def _demo_runs(images: int, runs: int, sets: list[list[str]] | None = None) -> list[dict[str, Any]]:
    """`raymill run` of the demo, `runs` times (or once per `sets`, each run's extra --set keys),
    each into a fresh run.dir: wall, stage seconds, and the train stage's parts (stages.train.timings)."""
    sets = sets or [[]] * runs
    from stages.train import timings
    from workflow import demo_data

    rows = []
    with tempfile.TemporaryDirectory(prefix="raymill-demo-") as tmp:
        demo_data.generate(Path(tmp) / "demo", images=images, seed=0)  # `make run`'s data
        for i, extra in enumerate(sets):
            run_dir = Path(tmp) / f"run{i}"
            wall = raymill("run", "--config", str(REPO / "configs" / "default.yaml"),
                           *train_sets([f"run.source={Path(tmp) / 'demo'}", f"run.dir={run_dir}", *extra]))
            report = json.loads((run_dir / "report.json").read_text())
            stages = {s["stage"]: round(s["seconds"], 2) for s in report["stages"]}
            manifest = json.loads((run_dir / "train" / "manifest.json").read_text())
            history = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
            parts = timings.split(manifest, history, stages["train"])
            if parts is None:  # a fresh run.dir trains from scratch in one attempt: always split
                raise RuntimeError(f"no timings split for {run_dir / 'train'}: did it resume?")
            rows.append({"wall_s": wall, "reported_s": report["seconds"], **stages, "parts": parts,
                         "fixed_s": round(stages["train"] - parts[timings.EPOCHS], 2),
                         "checkpoint_bytes": (run_dir / "train" / "model.pt").stat().st_size,
                         "plan": manifest["resource_plan"], "host": manifest["timings"].get("host", "ray_train")})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from stages.common import session
    from stages.common.config import load_config
    from stages.etl import integrity

    load, out = loadavg(), {"args": vars(args)}
    out["demo"] = _demo_runs(args.images, args.demo_runs)
    one = ["train.num_workers=1", "train.cpus_per_worker=2"]  # a one-GPU node's shape, on the CPUs
    out["hosts"] = _demo_runs(args.images, 0, [one + [f"train.host={h}"] for _ in range(args.host_runs)
                                               for h in ("ray_train", "tune_trial")])
    plan = out["demo"][0]["plan"]
    out["plan"] = {"workers": plan["num_workers"], "cpus_per_worker": plan["cpus_per_worker"]}
    with tempfile.TemporaryDirectory(prefix="raymill-startup-") as tmp:
        root = Path(tmp)
        spec = {"reports": args.epochs, "checkpoint_bytes": out["demo"][0]["checkpoint_bytes"],
                "workers": plan["num_workers"], "cpus_per_worker": plan["cpus_per_worker"],
                "storage": str(root / "floor")}
        floors = [_floor({**spec, "poll_s": "2.0"}) for _ in range(FLOOR_RUNS)]
        out["floor_ray_default"] = {"runs": floors, "fit_s": statistics.median(f["fit_s"] for f in floors),
                                    "ray_init_s": statistics.median(f["ray_init_s"] for f in floors)}
        out["floor_raymill_poll"] = _floor({**spec, "poll_s": "0.2"})
        cfg = load_config(REPO / "configs" / "default.yaml", ["tracking.enabled=false"])
        session.start(cfg.ray)
        integrity.STAMP_DIR = root / "stamps"  # a fresh stamp folder: the first check is a full one
        out["checks"] = {"1x": _data_checks(cfg.etl, root, args.images, "1x"),
                         f"{args.scale}x": _data_checks(cfg.etl, root, args.images * args.scale, f"{args.scale}x")}
    out["loadavg_at_start"] = load
    return out


def render(result: dict[str, Any]) -> str:
    a, demo = result["args"], result["demo"]
    floor, polled = result["floor_ray_default"], result["floor_raymill_poll"]
    lines = [f"Demo data ({a['images']} images, configs/default.yaml, {a['epochs']} epochs), plan "
             f"{result['plan']['workers']} worker(s) x {result['plan']['cpus_per_worker']:g} CPU. "
             f"Load average at start: {result['loadavg_at_start']}.", "",
             f"The demo end to end (`raymill run`), {len(demo)} runs one after another:", ""]
    lines += md_table(["run", "wall s (start to exit)", "report's total s", "etl s", "train s", "infer s"],
                      [[i + 1, fmt(d["wall_s"], 1), fmt(d["reported_s"], 1), fmt(d.get("etl"), 1),
                        fmt(d.get("train"), 1), fmt(d.get("infer"), 1)] for i, d in enumerate(demo)],
                      "rrrrrr") + [""]
    lines += ["Each run's train stage, split into named parts that add up to its wall (stages.train.timings; "
              "seconds; the same split is in each run's report.md):", ""]
    names = list(demo[0]["parts"])
    rows = [[n, *(fmt(d["parts"][n], 2) for d in demo)] for n in names]
    rows += [["**train stage: wall**", *(fmt(d["train"], 2) for d in demo)],
             ["**fixed cost (wall - epochs)**", *(fmt(d["fixed_s"], 2) for d in demo)]]
    lines += md_table(["part", *(f"run {i + 1}" for i in range(len(demo)))], rows, "l" + "r" * len(demo)) + [""]
    floor_runs = floor.get("runs", [floor])
    lines += [f"Ray's naive floor for the same shape, each run in a fresh process with a fresh Ray, its fit "
              f"{SETTLE_S:g} s after `ray.init` returns (seconds). Until 2026-11-27 it was measured once, in this "
              "benchmark's process after raymill's own fit (a Ray whose Train actors were already up: 31.9 s "
              "that day, the ratio 0.504); a user's script pays what a first fit pays, as the demo's train "
              "stage does.", ""]
    lines += md_table(["floor", *(f"run {i + 1}" for i in range(len(floor_runs))), "median"],
                      [["no-op TorchTrainer, a checkpointed report per epoch (Ray's defaults): fit",
                        *(fmt(f["fit_s"], 2) for f in floor_runs), fmt(floor["fit_s"], 2)],
                       ["the same with raymill's controller poll (0.2 s): fit", fmt(polled["fit_s"], 2),
                        *[""] * len(floor_runs)],
                       ["`ray.init` (not in the train stage)", *(fmt(f["ray_init_s"], 2) for f in floor_runs),
                        fmt(floor["ray_init_s"], 2)]], "l" + "r" * (len(floor_runs) + 1)) + [""]
    lines += _hosts_lines(result.get("hosts") or [])
    check_rows = [[k, v["images"], fmt(v["shard_mb"], 1), fmt(v["first_s"], 3), fmt(v["second_s"], 3)]
                  for k, v in result["checks"].items()]
    lines += ["Data checks before the first step (stages/etl/integrity.verify_once):", ""]
    lines += md_table(["data", "images", "shard MB", "first train s (hash all)", "second train s (stamp)"],
                      check_rows, "lrrrr") + [""]
    worst_fixed = max(d["fixed_s"] for d in demo)
    big = result["checks"][f"{a['scale']}x"]
    slowest = max(d["wall_s"] for d in demo)
    targets = [{"target": f"train fixed cost, worst of {len(demo)} / Ray's naive floor, median of "
                          f"{len(floor_runs)} (<= 0.5)",
                "measured": ratio(worst_fixed, floor["fit_s"], 3), "pass": worst_fixed <= 0.5 * floor["fit_s"]},
               {"target": f"second check at {a['scale']}x / at 1x, seconds (no growth with the data: <= 2)",
                "measured": ratio(big["second_s"], max(result["checks"]["1x"]["second_s"], 1e-3)),
                "pass": big["second_s"] <= 2 * max(result["checks"]["1x"]["second_s"], 0.01)},
               {"target": f"demo `raymill run`, slowest of {len(demo)}, seconds (<= 40 on 2 cores)",
                "measured": slowest, "pass": slowest <= 40}]
    targets += _hosts_targets(result.get("hosts") or [])
    return "\n".join(lines + targets_table(targets, 3))


def _by_host(hosts: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {h: [d for d in hosts if d["host"] == h] for h in ("ray_train", "tune_trial")}


def _hosts_lines(hosts: list[dict[str, Any]]) -> list[str]:
    """The one-worker shape (a one-GPU node's plan, on the CPUs here) under each train host."""
    if not hosts:
        return []
    lines = ["One worker x 2 CPUs (`train.num_workers=1`: the plan of a one-GPU node, emulated on the CPUs), "
             "the demo end to end under each train host, alternating (seconds; `train.host=tune_trial` is "
             "what `auto` picks for this shape on one node: stages/train/solo.py):", ""]
    rows = [[d["host"], fmt(d["wall_s"], 1), fmt(d["train"], 2), fmt(d["parts"]["epochs (real work)"], 2),
             fmt(d["fixed_s"], 2), fmt(next(v for k, v in d["parts"].items() if k.startswith("Ray:")), 2),
             fmt(_worker_setup(d["parts"]), 2),
             fmt(d["parts"]["last report and Ray's shutdown"], 2)] for d in hosts]
    return lines + md_table(["host", "demo wall", "train stage", "epochs", "fixed cost", "Ray's part",
                             "worker: start and model", "last report and shutdown"], rows, "lrrrrrrr") + [""]


def _worker_setup(parts: dict[str, float]) -> float:
    """The part's seconds; results recorded before 2026-11-29 carry its old label, which named CUDA
    and DDP on CPU runs too."""
    return parts[WORKER_SETUP] if WORKER_SETUP in parts else parts["worker: start and model (CUDA, DDP)"]


def _hosts_targets(hosts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = _by_host(hosts)
    if not by["ray_train"] or not by["tune_trial"]:
        return []
    worst, best = max(d["fixed_s"] for d in by["tune_trial"]), min(d["fixed_s"] for d in by["ray_train"])
    return [{"target": "one worker: train fixed cost, Tune trial host (worst) / Ray Train host (best) <= 0.6",
             "measured": ratio(worst, best, 3), "pass": worst <= 0.6 * best}]
