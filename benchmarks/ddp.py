"""DDP step rate: Ray Train's TorchTrainer against plain torchrun on the same model and data.

Both launchers run benchmarks.ddp_torchrun_worker.timed_steps():
  - model: stages.model.zoo small_cnn (width 32, 10 classes), SGD with momentum;
  - data: a few in-memory random batches of 64x64 images, batch size 64 per worker (no input
    pipeline: this measures the launcher and DDP, not ingest);
  - gloo backend, torch.set_num_threads(1) in every process;
  - `--warmup` untimed steps, then `--steps` timed steps between two barriers (timing from rank 0).

  ray       TorchTrainer(num_workers=n, resources_per_worker={"CPU": --cpus-per-worker}),
            model wrapped by ray.train.torch.prepare_model (DDP when n > 1).
  torchrun  python -m torch.distributed.run --standalone --nproc_per_node n
            benchmarks/ddp_torchrun_worker.py, model wrapped in DistributedDataParallel when n > 1.

Each is run with 2 and 1 workers, in `--repeat` rounds whose order alternates, so the machine's
other load hits both launchers. The in-loop rate (steps/s of the timed steps) is the compared
number; the whole job's wall time (launcher start-up included) is reported beside it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import NOISY_SPREAD, loadavg, ratio, start_ray, targets_table, with_retry
from benchmarks.common import fmt as _fmt1


def fmt(v: Any, nd: int = 2) -> str:
    return _fmt1(v, nd)

__all__ = ["add_arguments", "run", "render"]

TARGETS = {"ray_vs_torchrun": 0.95}
log = logging.getLogger(__name__)
WORKER_SCRIPT = Path(__file__).resolve().parent / "ddp_torchrun_worker.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", type=int, default=30, help="untimed steps per run (default 30)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per run (default 100)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--width", type=int, default=32, help="small_cnn width (default 32)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per process (default 1)")
    p.add_argument("--cpus-per-worker", type=float, default=0.75,
                   help="Ray resources_per_worker CPU (default 0.75; never 1 CPU per worker with 2 "
                        "workers on a 2-CPU box, see PLATFORM.md)")
    p.add_argument("--workers", default="2,1", help="worker counts to run (default 2,1)")
    p.add_argument("--repeat", type=int, default=2, help="rounds of every (launcher, workers) pair (default 2)")
    p.add_argument("--seed", type=int, default=0)


# ------------------------------------------------------------------------------------------
# the two launchers
# ------------------------------------------------------------------------------------------

def _ray_loop(config: dict[str, Any]) -> None:
    t_loop = time.time()
    import ray.train
    import ray.train.torch
    import torch

    from benchmarks.ddp_torchrun_worker import build, timed_steps

    torch.set_num_threads(config["threads"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = ray.train.torch.prepare_model(build(config["width"], config["classes"], config["seed"]))
    result = timed_steps(model, rank=rank, world=world, batch_size=config["batch_size"],
                         image_size=config["image_size"], classes=config["classes"],
                         warmup=config["warmup"], steps=config["steps"], seed=config["seed"])
    result.update(launcher="ray", loop_start=t_loop, finished=time.time(),
                  ddp_wrapped=type(model).__name__)
    # Ray Train V2 keeps in Result.metrics only metrics reported with a checkpoint: send a tiny one.
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "result.json").write_text(json.dumps(result))
        ray.train.report(result, checkpoint=ray.train.Checkpoint.from_directory(folder) if rank == 0 else None)


def run_ray(args: argparse.Namespace, workers: int, storage: Path) -> dict[str, Any]:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    config = {k: getattr(args, k) for k in ("warmup", "steps", "batch_size", "image_size", "width",
                                             "classes", "threads", "seed")}
    trainer = TorchTrainer(
        _ray_loop, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=workers,
                                               resources_per_worker={"CPU": args.cpus_per_worker}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=ray.train.RunConfig(name=f"ddp-{workers}-{time.time_ns()}", storage_path=str(storage)))
    t0 = time.time()
    result = trainer.fit()
    wall = time.time() - t0
    if result.error:
        raise RuntimeError(f"ray run failed: {result.error}") from result.error
    m = dict(result.metrics)
    m.update(job_wall_s=wall, startup_s=m["loop_start"] - t0, job_start=t0)
    return m


def run_torchrun(args: argparse.Namespace, workers: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"torchrun-{workers}-{time.time_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(workers),
           str(WORKER_SCRIPT), "--out", str(out), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--image-size", str(args.image_size), "--width",
           str(args.width), "--classes", str(args.classes), "--threads", str(args.threads), "--seed",
           str(args.seed)]
    # The same environment Ray gives a worker holding < 1 CPU (OMP_NUM_THREADS=1, see
    # ray._private.utils.set_omp_num_threads_if_unset); torchrun itself sets it only for nproc > 1.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.time() - t0
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"torchrun failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    m = json.loads(out.read_text())
    shown = ["python", *cmd[1:6], "benchmarks/ddp_torchrun_worker.py", "--out", "result.json", *cmd[9:]]
    m.update(job_wall_s=wall, startup_s=m["process_start"] - t0, job_start=t0, command=" ".join(shown))
    return m




# ------------------------------------------------------------------------------------------

def _summ(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Best run of one (launcher, workers) pair, with medians beside it and every run's rate."""
    rates = [r["steps_per_s"] for r in runs]
    best = max(runs, key=lambda r: r["steps_per_s"])

    def med(key: str, nd: int = 1) -> float:
        return round(statistics.median(r[key] for r in runs), nd)

    return {"steps_per_s": round(best["steps_per_s"], 3), "steps_per_s_median": med("steps_per_s", 3),
            "samples_per_s": round(best["samples_per_s"], 1), "samples_per_s_median": med("samples_per_s"),
            "step_ms_p50": round(best["step_ms_p50"], 1), "step_ms_p90": round(best["step_ms_p90"], 1),
            "job_wall_s": round(min(r["job_wall_s"] for r in runs), 1), "job_wall_s_median": med("job_wall_s"),
            "startup_s": round(min(r["startup_s"] for r in runs), 1),
            "runs_steps_per_s": [round(x, 3) for x in rates],
            "runs_job_wall_s": [round(r["job_wall_s"], 1) for r in runs],
            "torch_threads": best["torch_threads"], "omp_num_threads_env": best.get("omp_num_threads_env"),
            "cpu_ms_per_step": round(min(r["cpu_ms_per_step"] for r in runs), 1),
            "cpu_ms_per_step_median": med("cpu_ms_per_step"),
            "spread": round(max(rates) / min(rates), 2),
            "final_loss": round(best["final_loss"], 4), "ddp_wrapped": best.get("ddp_wrapped")}


def _rounds(args: argparse.Namespace, counts: list[int], tmp: Path) -> tuple[dict[str, list], list[str]]:
    """`--repeat` rounds of every (launcher, workers) pair; the order flips every other round."""
    runs: dict[str, list[dict[str, Any]]] = {f"{l}_{n}": [] for n in counts for l in ("ray", "torchrun")}
    order_log = []
    for r in range(max(1, args.repeat)):
        pairs = [(launcher, n) for n in counts for launcher in ("torchrun", "ray")]
        for launcher, n in (pairs[::-1] if r % 2 else pairs):
            load = loadavg()
            m = with_retry(lambda: run_ray(args, n, tmp / "ray") if launcher == "ray"
                           else run_torchrun(args, n, tmp), f"ddp: {launcher} x{n}")
            m.update(loadavg_before=load, round=r)
            runs[f"{launcher}_{n}"].append(m)
            order_log.append(f"{launcher}_{n}")
            log.warning("ddp: round %d/%d %-8s x%d: %.2f steps/s (%.0f samples/s), job %.1f s, load %s",
                        r + 1, args.repeat, launcher, n, m["steps_per_s"], m["samples_per_s"],
                        m["job_wall_s"], load)
    return runs, order_log


def _ratios(runs: dict[str, list], methods: dict[str, dict], counts: list[int]) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    for n in counts:
        ray_k, tr_k = f"ray_{n}", f"torchrun_{n}"
        paired = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs[ray_k], runs[tr_k])]
        ratios[f"ray_vs_torchrun_{n}"] = ratio(methods[ray_k]["steps_per_s"], methods[tr_k]["steps_per_s"], 3)
        ratios[f"ray_vs_torchrun_{n}_median"] = ratio(methods[ray_k]["steps_per_s_median"],
                                                      methods[tr_k]["steps_per_s_median"], 3)
        ratios[f"ray_vs_torchrun_{n}_paired"] = [round(x, 3) for x in paired]
        ratios[f"ray_vs_torchrun_{n}_paired_median"] = round(statistics.median(paired), 3) if paired else None
        # CPU time per step, torchrun / Ray: above 1 means Ray's workers spend less CPU per step
        ratios[f"cpu_per_step_torchrun_vs_ray_{n}"] = ratio(methods[tr_k]["cpu_ms_per_step_median"],
                                                            methods[ray_k]["cpu_ms_per_step_median"], 3)
        ratios[f"job_wall_ray_vs_torchrun_{n}"] = ratio(methods[ray_k]["job_wall_s"], methods[tr_k]["job_wall_s"])
    return ratios


def _targets(methods: dict, ratios: dict, top: int) -> list[dict[str, Any]]:
    measured = ratios[f"ray_vs_torchrun_{top}"]
    spread = max(methods[f"ray_{top}"]["spread"], methods[f"torchrun_{top}"]["spread"])
    cpu_ratio = ratios.get(f"cpu_per_step_torchrun_vs_ray_{top}")
    goal = TARGETS["ray_vs_torchrun"]
    return [{"target": f"Ray Train steps/s >= {goal} x torchrun ({top} workers, best run of each)",
             "measured": measured, "pass": measured is not None and measured >= goal,
             "noisy": spread > NOISY_SPREAD, "spread": spread},
            {"target": f"(proxy, not the target) CPU time per step: torchrun ÷ Ray >= {goal} ({top} workers, "
                       f"median runs)", "measured": cpu_ratio, "pass": cpu_ratio is not None and cpu_ratio >= goal}]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    counts = [int(x) for x in str(args.workers).split(",") if x.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="raymill-bench-ddp-"))
    started_ray = not ray.is_initialized()
    ray_start_s = start_ray(max(counts), args.cpus_per_worker)
    try:
        runs, order_log = _rounds(args, counts, tmp)
    finally:
        if started_ray:
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    methods = {k: _summ(v) for k, v in runs.items() if v}
    ratios = _ratios(runs, methods, counts)
    scaling = {}
    if 1 in counts and 2 in counts:
        for launcher in ("ray", "torchrun"):
            two, one = methods[f"{launcher}_2"], methods[f"{launcher}_1"]
            scaling[launcher] = {"efficiency": ratio(two["samples_per_s"], 2 * one["samples_per_s"], 3),
                                 "efficiency_median": ratio(two["samples_per_s_median"],
                                                            2 * one["samples_per_s_median"], 3)}
    top = max(counts)
    return {"config": {k: getattr(args, k) for k in ("warmup", "steps", "batch_size", "image_size", "width",
                                                      "classes", "threads", "cpus_per_worker", "repeat")},
            "workers": counts, "cores": os.cpu_count(), "ray_start_s": round(ray_start_s, 1),
            "cluster_cpus": ray.cluster_resources().get("CPU"), "methods": methods, "ratios": ratios, "scaling": scaling,
            "order": order_log, "targets": _targets(methods, ratios, top),
            "runs": {k: [{kk: vv for kk, vv in m.items() if kk != "command"} for m in v] for k, v in runs.items()},
            "torchrun_command": runs[f"torchrun_{top}"][0]["command"] if runs.get(f"torchrun_{top}") else None}


# ------------------------------------------------------------------------------------------

def _tables(result: dict[str, Any]) -> list[str]:
    c, methods, ratios = result["config"], result["methods"], result["ratios"]
    lines = [
        f"DDP step rate, Ray Train `TorchTrainer` vs `torchrun` (`python -m torch.distributed.run "
        f"--standalone`): the same loop (`benchmarks/ddp_torchrun_worker.py: timed_steps`), small_cnn width "
        f"{c['width']}, {c['classes']} classes, batch {c['batch_size']} per worker of in-memory random "
        f"{c['image_size']}x{c['image_size']} images, gloo, `torch.set_num_threads({c['threads']})` per "
        f"process, {c['warmup']} warm-up + {c['steps']} timed steps between barriers. Ray workers hold "
        f"{c['cpus_per_worker']} CPU each. {c['repeat']} rounds, launcher order alternating per round; "
        f"the best run of each is reported, every run is in the JSON.",
        "",
        "| launcher | workers | steps/s (best) | steps/s (median) | samples/s (best) | ms/step p50 | "
        "Ray ÷ torchrun (best / median) | CPU ms per step, all ranks (median) | job wall s (best) | "
        "launch → loop start s | runs steps/s (fastest ÷ slowest) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n in result["workers"]:
        for launcher in ("ray", "torchrun"):
            m = methods.get(f"{launcher}_{n}")
            if not m:
                continue
            rel = (f"{fmt(ratios.get(f'ray_vs_torchrun_{n}'), 3)} / {fmt(ratios.get(f'ray_vs_torchrun_{n}_median'), 3)}"
                   if launcher == "ray" else "1.000")
            lines.append(f"| {launcher} | {n} | {fmt(m['steps_per_s'])} | {fmt(m['steps_per_s_median'])} | "
                         f"{fmt(m['samples_per_s'], 1)} | {fmt(m['step_ms_p50'], 1)} | {rel} | "
                         f"{fmt(m.get('cpu_ms_per_step_median'), 1)} | "
                         f"{fmt(m['job_wall_s'], 1)} | {fmt(m['startup_s'], 1)} | "
                         f"{', '.join(fmt(x) for x in m['runs_steps_per_s'])} (x{fmt(m.get('spread'))}) |")
    lines.append("")
    if result.get("scaling"):
        lines += ["| launcher | 2-worker scaling efficiency (best) | (median) |", "|---|---:|---:|"]
        for launcher, s in result["scaling"].items():
            lines.append(f"| {launcher} | {fmt(s['efficiency'], 3)} | {fmt(s['efficiency_median'], 3)} |")
        lines.append("")
    lines += targets_table(result["targets"], 3)
    return lines


def _notes(result: dict[str, Any]) -> list[str]:
    ratios, top = result["ratios"], max(result["workers"])
    lines = [
        f"- Scaling efficiency = samples/s with 2 workers / (2 x samples/s with 1 worker). This machine has "
        f"{result['cores']} cores, so 2 single-threaded workers can at best double a 1-worker run; gloo's "
        f"all-reduce and the machine's other load eat into that.",
        f"- Per-round paired ratios Ray ÷ torchrun at {top} workers (runs next to each other in time): "
        f"{', '.join(fmt(x, 3) for x in ratios.get(f'ray_vs_torchrun_{top}_paired', []))} (median "
        f"{fmt(ratios.get(f'ray_vs_torchrun_{top}_paired_median'), 3)}).",
        f"- CPU time per step (all ranks' processes, all threads, median run): torchrun ÷ Ray = "
        f"{fmt(ratios.get(f'cpu_per_step_torchrun_vs_ray_{top}'), 3)} at {top} workers"
        + "".join(f", {fmt(ratios.get(f'cpu_per_step_torchrun_vs_ray_{n}'), 3)} at {n}"
                  for n in result["workers"] if n != top)
        + " (above 1: Ray's workers use less CPU per step). Other load on the machine moves CPU time much "
          "less than wall time, so this is the steadier comparison of per-step overhead on a shared box.",
        f"- A verdict is flagged noisy when the fastest and slowest run of one launcher differ by more than "
        f"x{NOISY_SPREAD}: the 5% the target asks about is then inside the run-to-run noise.",
        f"- Whole-job wall time, launcher start-up included, Ray ÷ torchrun at {top} workers: "
        f"{fmt(ratios.get(f'job_wall_ray_vs_torchrun_{top}'))} x (Ray was already running; `ray.init` took "
        f"{result['ray_start_s']} s once, not counted). Ray's fixed cost is the Train controller, the worker "
        f"actors and the process-group set-up; it does not grow with the number of steps.",
        "- Launch → loop start: from `trainer.fit()` / the torchrun subprocess launch to the first line of "
        "the per-worker function (process_start for torchrun, before its imports).",
        "- The box was shared with other work (tests, other helpers) during the run: absolute rates move with "
        "that load (load averages are in the JSON), so the ratios of runs taken side by side are the result, "
        "not the absolute steps/s.",
    ]
    if result.get("torchrun_command"):
        lines.append(f"- torchrun command: `{result['torchrun_command']}`")
    return lines


def render(result: dict[str, Any]) -> str:
    return "\n".join(_tables(result) + [""] + _notes(result)) + "\n"


if __name__ == "__main__":  # quick manual run without the runner
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    print(render(run(ap.parse_args())))
