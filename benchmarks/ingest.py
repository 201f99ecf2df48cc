"""Training ingest: our streaming shard reader inside Ray Train against a PyTorch DataLoader.

Data: workflow.demo_data.generate(images=N, size=(500, 375), png_fraction=0) (all JPEG), then
stages.etl.stage.run to 64 px JPEG-in-parquet shards (shard_max_rows 500; etl.min_shards may make them
smaller), every image in the train split
(split 1/0/0) so both methods read the same N images per epoch. No model step anywhere: this
measures the input path only.

  ours        a TorchTrainer with 1 and 2 workers ({"CPU": --cpus-per-worker} each). Its loop is the
              training stage's reader (stages.train.loop.Worker.train_batches / decode_train):
              rank_pieces -> iter_samples (seeded shard order, 512-row shuffle buffer) -> Prefetcher
              (decode_threads=2, 4 batches ahead; decode_sample + augment with the per-sample RNG)
              -> to_batch (uint8 NHWC -> normalised float NCHW). Per-rank counts and timings are
              gathered over the process group and sent with ray.train.report.
  raydata     the same TorchTrainer with train.ingest=ray_data (--ray-data-workers): Ray Data
              reads the shards, decodes + augments in map_batches tasks (stages.feed.ray_data), and
              each rank iterates ShardBatches over get_dataset_shard("train"). Its images per
              CPU-second count the CPU of the whole local Ray process tree (decode runs outside
              the workers); ours' count the worker processes only.
  dataloader  torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True,
              num_workers=os.cpu_count()) over the raw ImageFolder of JPEGs, in a fresh Python
              process. The dataset is a plain map-style class: read file -> stages.etl.images.decode_rgb
              (centre crop to 64, JPEG draft) -> stages.feed.streaming.augment with the same parameters; the
              default collate stacks uint8 tensors and the loop normalises them as to_batch does.
              Workers are not persistent (the default), so each epoch forks them anew.

Both run `--epochs` epochs (each reported on its own) in `--repeat` rounds whose order
alternates, so the machine's other load hits both. Time to first batch is measured two ways:
  loop: from the start of the per-worker loop, after its imports (ours: in the Ray Train worker
        function; DataLoader: before the file listing) to the first normalised batch (ours: the
        slowest rank);
  job:  from the launch (ours: TorchTrainer.fit() with Ray already running; DataLoader: the
        subprocess launch, Python start-up and imports included) to the first batch.
The target uses `loop`; `job` is shown beside it.

Stall (part 3): the demo training, configs/default.yaml (stages.train.stage.run on a 1,500-image demo
set), and the per-epoch input-stall fraction and verdict from its metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import NOISY_SPREAD, REPO, ratio, start_ray, with_retry
from benchmarks.ingest_baseline import run_dataloader
from benchmarks.ingest_ours import run_ours
from benchmarks.ingest_report import STALL_TARGET, render

__all__ = ["add_arguments", "run", "render"]

TARGETS = {"throughput_ratio": 2.0, "first_batch_ratio": 1.5, "stall_fraction": STALL_TARGET}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=2000, help="generated JPEGs (default 2000)")
    p.add_argument("--source-size", default="500x375", help="generated JPEG size WxH (default 500x375)")
    p.add_argument("--image-size", type=int, default=64, help="training side in px (default 64)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (default 2)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    p.add_argument("--workers", default="2,1", help="Ray Train worker counts for ours (default 2,1)")
    p.add_argument("--ray-data-workers", default="2",
                   help="Ray Train worker counts for train.ingest=ray_data (default 2; '' skips it)")
    p.add_argument("--cpus-per-worker", type=float, default=0.75,
                   help="Ray resources_per_worker CPU (default 0.75; never 1 per worker with 2 workers "
                        "on a 2-CPU box, see PLATFORM.md)")
    p.add_argument("--decode-threads", type=int, default=2, help="ours: train.decode_threads (default 2)")
    p.add_argument("--prefetch-batches", type=int, default=4, help="ours: train.prefetch_batches (default 4)")
    p.add_argument("--shuffle-buffer-rows", type=int, default=512, help="ours (default 512)")
    p.add_argument("--shard-rows", type=int, default=500, help="ETL shard_max_rows (default 500)")
    p.add_argument("--dl-workers", type=int, default=os.cpu_count() or 1,
                   help="DataLoader num_workers (default os.cpu_count())")
    p.add_argument("--repeat", type=int, default=3, help="rounds of every method (default 3)")
    p.add_argument("--stall-images", type=int, default=1500,
                   help="demo images for the stall run with configs/default.yaml (default 1500; 0 skips it)")
    p.add_argument("--stall-config", default="configs/default.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="parent of the temp dir (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")


def run_stall(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from stages.etl import stage as etl
    from stages.train import stage as train
    from workflow import demo_data
    from stages.common.config import load_config

    config_path = REPO / args.stall_config if not Path(args.stall_config).is_absolute() else Path(args.stall_config)
    cfg = load_config(config_path, [f"run.dir={tmp / 'stall_run'}", f"run.source={tmp / 'stall_src'}"])
    t0 = time.perf_counter()
    demo_data.generate(tmp / "stall_src", images=args.stall_images, seed=cfg.run.seed)
    data = etl.run(cfg.etl, str(tmp / "stall_src"), str(tmp / "stall_run" / "etl"))
    t_etl = time.perf_counter()
    model = train.run(cfg.train, data, str(tmp / "stall_run" / "train"), seed=cfg.run.seed, ray_cfg=cfg.ray)
    t_train = time.perf_counter()
    history = [json.loads(line) for line in (Path(model.path) / "metrics.jsonl").read_text().splitlines()]
    epochs = [{"epoch": h["epoch"], "images_per_s": round(h["images_per_s"], 1), "wait_s": round(h["wait_s"], 3),
               "compute_s": round(h["compute_s"], 3), "stall_fraction": round(h["stall_fraction"], 4),
               "verdict": h["verdict"], "train_acc": round(h["train_acc"], 3), "val_acc": round(h["val_acc"], 3)}
              for h in history]
    wait, compute = sum(e["wait_s"] for e in epochs), sum(e["compute_s"] for e in epochs)
    m = model.manifest
    return {"config": str(args.stall_config), "images": args.stall_images,
            "train_rows": sum(m2 for m2 in data.manifest["counts"]["train"].values()),
            "train_config": {k: m["config"][k] for k in ("model", "width", "epochs", "batch_size", "num_workers",
                                                         "decode_threads", "prefetch_batches", "data_format")},
            "parquet_encoding": data.manifest["config"]["parquet_encoding"],
            "resource_plan": m.get("resource_plan"), "epochs": epochs,
            "stall_overall": round(wait / max(wait + compute, 1e-9), 4),
            "stall_max": max(e["stall_fraction"] for e in epochs),
            "stall_max_after_first": max((e["stall_fraction"] for e in epochs[1:]), default=None),
            "epochs_over_target": sum(e["stall_fraction"] > TARGETS["stall_fraction"] for e in epochs),
            "last_verdict": epochs[-1]["verdict"], "test_acc": m["metrics"]["test_acc"],
            "etl_s": round(t_etl - t0, 1), "train_s": round(t_train - t_etl, 1)}




# ------------------------------------------------------------------------------------------

def _summ(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Best (fastest) run's numbers, medians beside them, every run kept."""
    best = max(runs, key=lambda r: r["images_per_s"])
    med = lambda key: round(statistics.median(r[key] for r in runs), 3)  # noqa: E731
    n_epochs = len(runs[0]["epochs"])
    return {
        "images_per_s": best["images_per_s"], "images_per_s_median": med("images_per_s"),
        "epoch_images_per_s": [max(r["epochs"][e]["images_per_s"] for r in runs) for e in range(n_epochs)],
        "epoch_images_per_s_median": [round(statistics.median(r["epochs"][e]["images_per_s"] for r in runs), 1)
                                      for e in range(n_epochs)],
        "first_batch_loop_s": min(r["first_batch_loop_s"] for r in runs),
        "first_batch_loop_s_median": med("first_batch_loop_s"),
        "first_batch_job_s": min(r["first_batch_job_s"] for r in runs),
        "first_batch_job_s_median": med("first_batch_job_s"),
        "epoch2_first_batch_s": min(r["epochs"][-1]["first_batch_s"] for r in runs),
        "first_read_s": [r["epochs"][0].get("first_read_s") for r in runs],
        "later_first_read_s": [r["epochs"][-1].get("first_read_s") for r in runs],
        "startup_s": min(r["startup_s"] for r in runs),
        "peak_rss_mb": max(r["memory"]["peak_rss_mb"] for r in runs),
        "peak_rss_workers_mb": max(r["memory"]["peak_rss_workers_mb"] for r in runs),
        "peak_rss_tree_mb": max(r["memory"]["peak_rss_tree_mb"] for r in runs),
        "start_rss_mb": runs[0]["memory"]["start_rss_mb"],
        "counts_ray_processes": runs[0]["memory"]["counts_ray_processes"],
        "images_per_epoch": runs[0]["epochs"][0]["images"],
        "images_per_cpu_s": max(r["images_per_cpu_s"] for r in runs),
        "images_per_cpu_s_median": med("images_per_cpu_s"),
        "spread": round(max(r["images_per_s"] for r in runs) / max(1e-9, min(r["images_per_s"] for r in runs)), 2),
    }


def _prepare(args: argparse.Namespace, tmp: Path, counts: list[int]) -> dict[str, Any]:
    """Demo JPEGs -> Ray up -> the ETL stage's parquet shards, every method's input."""
    from stages.etl import stage as etl
    from stages.feed import streaming
    from workflow import demo_data
    from stages.common.config import EtlConfig

    w, h = (int(v) for v in args.source_size.lower().split("x"))
    t0 = time.perf_counter()
    demo_data.generate(tmp / "src", images=args.images, seed=args.seed, size=(w, h), png_fraction=0.0)
    gen_s = time.perf_counter() - t0
    src_bytes = sum(f.stat().st_size for f in (tmp / "src").glob("*/*"))
    ray_start_s = start_ray(max(counts), args.cpus_per_worker)
    etl_cfg = EtlConfig.model_validate({"image_size": args.image_size, "formats": ["parquet"],
                                        "shard_max_rows": args.shard_rows,
                                        "split": {"train": 1.0, "val": 0.0, "test": 0.0}})
    t0 = time.perf_counter()
    data = etl.run(etl_cfg, str(tmp / "src"), str(tmp / "ds"))
    etl_s = time.perf_counter() - t0
    refs = streaming.shard_refs(data.manifest, data.path, "train", "parquet")
    if sum(r.rows for r in refs) != args.images:
        raise RuntimeError(f"ETL kept {sum(r.rows for r in refs)} of {args.images} images")
    print(f"ingest: ray {ray_start_s:.1f} s, ETL {etl_s:.1f} s -> {len(refs)} parquet shards", flush=True)
    return {"shards": [{"uri": r.uri, "format": r.format, "rows": r.rows, "bytes": r.bytes, "sha256": r.sha256}
                       for r in refs], "ray_start_s": round(ray_start_s, 1),
            "data": {"images": args.images, "source_size": [w, h],
                     "mean_file_kb": round(src_bytes / args.images / 1024, 1), "generate_s": round(gen_s, 1),
                     "etl_s": round(etl_s, 1), "shards": len(refs), "rows_per_shard": sorted({r.rows for r in refs}),
                     "shard_rows": args.shard_rows, "parquet_mb": round(sum(r.bytes for r in refs) / 2**20, 2)}}


def _rounds(args: argparse.Namespace, shards: list[dict], tmp: Path, others: list[str]) -> tuple[dict, list]:
    """`--repeat` rounds of every method, order flipped every other round (load drifts)."""
    runs: dict[str, list[dict[str, Any]]] = {"dataloader": [], **{key: [] for key in others}}
    order: list[str] = []
    for r in range(max(1, args.repeat)):
        methods = ["dataloader", *others]
        for key in (methods[::-1] if r % 2 else methods):
            m = with_retry(lambda: run_dataloader(tmp / "src", args) if key == "dataloader"
                           else run_ours(shards, args, int(key.split("_")[1]), tmp / "ray",
                                         "ray_data" if key.startswith("raydata") else "stream"),
                           f"ingest: {key}")
            m["round"] = r
            runs[key].append(m)
            order.append(key)
            print(f"ingest: round {r + 1}/{args.repeat} {key:10s} epochs "
                  + " / ".join(f"{e['images_per_s']:.0f}" for e in m["epochs"])
                  + f" img/s, first batch {m['first_batch_loop_s']:.2f} s (loop), peak RSS "
                    f"{m['memory']['peak_rss_mb']:.0f} MiB, load {m['loadavg_before']}", flush=True)
    return runs, order


def _ratios(methods: dict[str, dict], others: list[str]) -> dict[str, dict]:
    dl = methods["dataloader"]
    return {key: {
        "throughput": ratio(o["images_per_s"], dl["images_per_s"]),
        "throughput_median": ratio(o["images_per_s_median"], dl["images_per_s_median"]),
        "epoch_throughput": [ratio(a, b) for a, b in zip(o["epoch_images_per_s"], dl["epoch_images_per_s"])],
        "first_batch_loop": ratio(o["first_batch_loop_s"], dl["first_batch_loop_s"]),
        "first_batch_loop_median": ratio(o["first_batch_loop_s_median"], dl["first_batch_loop_s_median"]),
        "first_batch_job": ratio(o["first_batch_job_s"], dl["first_batch_job_s"]),
        "peak_rss": ratio(o["peak_rss_mb"], dl["peak_rss_mb"]),
        "per_cpu_s": ratio(o["images_per_cpu_s_median"], dl["images_per_cpu_s_median"]),
    } for key, o in ((k, methods[k]) for k in others)}


def _targets(args: argparse.Namespace, methods: dict, ratios: dict, main: str, stall: dict | None) -> list[dict]:
    r, dl = ratios[main], methods["dataloader"]
    spread = max(methods[main]["spread"], dl["spread"])
    name = main.replace("_", " ")
    targets = [
        {"target": f"{name} workers: images/s over {args.epochs} epochs >= {TARGETS['throughput_ratio']:g} x "
                   f"DataLoader", "measured": r["throughput"],
         "pass": r["throughput"] is not None and r["throughput"] >= TARGETS["throughput_ratio"],
         "noisy": spread > NOISY_SPREAD, "spread": spread},
        {"target": f"{name} workers: time to first batch (loop start, Ray Train start-up excluded) <= "
                   f"{TARGETS['first_batch_ratio']:g} x DataLoader's", "measured": r["first_batch_loop"],
         "pass": r["first_batch_loop"] is not None and r["first_batch_loop"] <= TARGETS["first_batch_ratio"]}]
    if stall:
        targets.append({"target": f"demo training ({stall['config']}): input stall <= "
                                  f"{TARGETS['stall_fraction']:.0%} (all epochs together)",
                        "measured": stall["stall_overall"], "pass": stall["stall_overall"] <= TARGETS["stall_fraction"]})
    return targets


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    counts = [int(x) for x in str(args.workers).split(",") if x.strip()]
    rd_counts = [int(x) for x in str(args.ray_data_workers).split(",") if x.strip()]
    others = [f"ours_{n}" for n in counts] + [f"raydata_{n}" for n in rd_counts]
    tmp = Path(tempfile.mkdtemp(prefix="raymill-bench-ingest-", dir=args.workdir))
    started_ray = not ray.is_initialized()
    stall = None
    try:
        prepared = _prepare(args, tmp, counts)
        runs, order = _rounds(args, prepared["shards"], tmp, others)
        if args.stall_images:
            stall = run_stall(args, tmp)
            print(f"ingest: stall overall {stall['stall_overall']:.1%}, last verdict: {stall['last_verdict']}",
                  flush=True)
    finally:
        if started_ray:
            ray.shutdown()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    methods = {k: _summ(v) for k, v in runs.items() if v}
    ratios = _ratios(methods, others)
    return {"data": prepared["data"],
            "config": {k: getattr(args, k) for k in ("image_size", "epochs", "batch_size", "cpus_per_worker",
                                                      "decode_threads", "prefetch_batches", "shuffle_buffer_rows",
                                                      "dl_workers", "repeat")},
            "workers": counts, "ray_data_workers": rd_counts, "cores": os.cpu_count(),
            "ray_start_s": prepared["ray_start_s"], "methods": methods, "ratios": ratios,
            "targets": _targets(args, methods, ratios, f"ours_{max(counts)}", stall), "order": order,
            "stall": stall, "runs": runs}



if __name__ == "__main__":  # quick manual run without the runner
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    print(render(run(ap.parse_args())))
