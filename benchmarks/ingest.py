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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import NOISY_SPREAD, REPO, fmt, md_table, ratio, start_ray, targets_table, with_retry

__all__ = ["add_arguments", "run", "render"]

TARGETS = {"throughput_ratio": 2.0, "first_batch_ratio": 1.5, "stall_fraction": 0.05}


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


# ------------------------------------------------------------------------------------------
# ours: the training stage's reader inside a Ray Train worker, no model
# ------------------------------------------------------------------------------------------

def _drain(prefetch, mean, std) -> tuple[int, float | None, int]:
    """Consume one epoch as training would (normalised tensors, labels): (images, first batch time, batches)."""
    import torch

    from stages.model.predict import to_batch

    n, t_first, batches_seen = 0, None, 0
    for batch, arrays in prefetch:
        x = to_batch(arrays, mean, std, torch.device("cpu"), False, False)
        y = torch.tensor([s[1] for s in batch], dtype=torch.long)
        if x.shape[0] != y.shape[0]:
            raise RuntimeError(f"batch of {x.shape[0]} images but {y.shape[0]} labels")
        n += len(batch)
        batches_seen += 1
        if t_first is None:
            t_first = time.time()
    return n, t_first, batches_seen


def _ours_loop(config: dict[str, Any]) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    from stages.feed import streaming
    from stages.feed.decode_pool import DecodeSpec
    from stages.common import storage

    t_loop = time.time()  # after the imports, as in the DataLoader process
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(config["cpus_per_worker"] + 0.5)))  # as stages.train.loop.Worker
    refs = [streaming.ShardRef(**r) for r in config["shards"]]
    seed, size, bs, a = config["seed"], config["image_size"], config["batch_size"], config["augment"]
    distributed = dist.is_available() and dist.is_initialized() and world > 1

    reads: list[float] = []

    def open_rows(ref):
        t = time.perf_counter()
        rows = streaming.read_shard(storage.local_path(ref.uri), ref.format)  # in place, as ShardCache does
        reads.append(time.perf_counter() - t)
        return rows

    warm = None
    if config.get("ingest") == "ray_data":
        from stages.common.config import TrainConfig
        from stages.feed.ray_data import WarmEpochs, equal_rows

        cfg = TrainConfig(batch_size=bs, prefetch_batches=config["prefetch_batches"], epochs=config["epochs"],
                          shuffle_buffer_rows=config["shuffle_buffer_rows"])
        steps = streaming.steps_per_epoch(equal_rows(sum(r.rows for r in refs), world), world, bs)
        warm = WarmEpochs(cfg, seed, rank, ray.train.get_dataset_shard, steps)
    epochs = []
    for epoch in range(config["epochs"]):
        if distributed:
            dist.barrier()
        t0, cpu0 = time.time(), time.process_time()
        batches = streaming.epoch_batches(refs, open_rows, seed, epoch, rank, world, bs,
                                          config["shuffle_buffer_rows"])  # = stages.train.loop.Worker
        decode = DecodeSpec(size, False, seed, epoch, True, a["scale_min"], a["random_resized_crop"],
                            a["flip"]).decoder()
        reads.clear()
        if warm is not None:  # = stages.feed.worker_feeds.WorkerFeeds.train_feed
            prefetch = warm.epoch(epoch)
        else:
            prefetch = streaming.Prefetcher(batches, decode, config["decode_threads"], config["prefetch_batches"])
        n, t_first, batches_seen = _drain(prefetch, a["mean"], a["std"])
        epochs.append({"start": t0, "first": t_first, "end": time.time(), "images": n,
                       "batches": batches_seen, "wait_s": prefetch.wait_s,
                       "cpu_s": time.process_time() - cpu0,  # this worker process, all its threads
                       "first_read_s": reads[0] if reads else None, "reads_s": sum(reads)})
    mine = {"rank": rank, "loop_start": t_loop, "epochs": epochs}
    everyone = [mine]
    if distributed:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    _report({"ranks_json": json.dumps(everyone), "world": world}, rank)


def _report(metrics: dict[str, Any], rank: int) -> None:
    """ray.train.report with a tiny checkpoint from rank 0: Ray Train V2 keeps in Result.metrics only
    the metrics reported together with a checkpoint."""
    import ray.train

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "metrics.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder) if rank == 0 else None)


def _tree_cpu_s() -> float:
    """CPU seconds of this process and every descendant (the local Ray: trainer, Ray Data tasks)."""
    import psutil

    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def run_ours(shards: list[dict], args: argparse.Namespace, workers: int, storage: Path,
             ingest: str = "stream") -> dict[str, Any]:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from benchmarks.common import MemorySampler, loadavg
    from stages.feed import ray_data as ingest_ray
    from stages.common.config import AugmentConfig, TrainConfig

    config = {"shards": shards, "seed": args.seed, "image_size": args.image_size, "batch_size": args.batch_size,
              "epochs": args.epochs, "decode_threads": args.decode_threads,
              "prefetch_batches": args.prefetch_batches, "shuffle_buffer_rows": args.shuffle_buffer_rows,
              "cpus_per_worker": args.cpus_per_worker, "augment": AugmentConfig().model_dump(mode="json"),
              "ingest": ingest}
    datasets = None
    if ingest == "ray_data":
        cfg = TrainConfig(batch_size=args.batch_size, ingest="ray_data", epochs=args.epochs)
        datasets = ingest_ray.build_train_datasets(cfg, shards, seed=args.seed, image_size=args.image_size,
                                                   raw=False, s3=None)[0]
    trainer = TorchTrainer(
        _ours_loop, train_loop_config=config, datasets=datasets,
        scaling_config=ray.train.ScalingConfig(num_workers=workers,
                                               resources_per_worker={"CPU": args.cpus_per_worker}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=ray.train.RunConfig(name=f"ingest-{workers}-{time.time_ns()}", storage_path=str(storage)))
    load = loadavg()
    with MemorySampler(0.1, ray=True) as sampler:
        t_launch, cpu0 = time.time(), _tree_cpu_s()
        result = trainer.fit()
        t_done, tree_cpu_s = time.time(), _tree_cpu_s() - cpu0
    if result.error:
        raise RuntimeError(f"ours ({workers} workers) failed: {result.error}") from result.error
    ranks = json.loads(result.metrics["ranks_json"])
    out = _epochs_from_ranks(ranks, t_launch)
    if ingest == "ray_data":  # decode runs in Ray Data tasks, outside the worker processes
        out["images_per_cpu_s"] = round(out["images"] / max(tree_cpu_s, 1e-9), 1)
    out.update(method=f"{'raydata' if ingest == 'ray_data' else 'ours'}_{workers}", workers=workers,
               tree_cpu_s=round(tree_cpu_s, 2), job_wall_s=round(t_done - t_launch, 2),
               loadavg_before=load, memory=sampler.summary(),
               wait_s=[round(sum(r["epochs"][e]["wait_s"] for r in ranks) / len(ranks), 3)
                       for e in range(len(ranks[0]["epochs"]))])
    return out


def _epochs_from_ranks(ranks: list[dict], t_launch: float) -> dict[str, Any]:
    """Whole-job epoch rates from per-rank timestamps: images of all ranks over first start -> last end."""
    epochs = []
    for e in range(len(ranks[0]["epochs"])):
        rows = [r["epochs"][e] for r in ranks]
        start, end = min(x["start"] for x in rows), max(x["end"] for x in rows)
        images, cpu = sum(x["images"] for x in rows), sum(x["cpu_s"] for x in rows)
        epochs.append({"images": images, "seconds": round(end - start, 3),
                       "images_per_s": round(images / max(end - start, 1e-9), 1),
                       "first_batch_s": round(max(x["first"] - x["start"] for x in rows), 3),
                       "cpu_s": round(cpu, 3),
                       # the slowest rank's first shard read, and shard reads per rank (mean)
                       "first_read_s": round(max(x["first_read_s"] or 0 for x in rows), 3),
                       "reads_s": round(sum(x["reads_s"] for x in rows) / len(rows), 3)})
    loop_first = max(r["epochs"][0]["first"] - r["loop_start"] for r in ranks)
    job_first = max(r["epochs"][0]["first"] for r in ranks) - t_launch
    startup = max(r["loop_start"] for r in ranks) - t_launch
    return {"epochs": epochs, **_totals(epochs), "first_batch_loop_s": round(loop_first, 3),
            "first_batch_job_s": round(job_first, 3), "startup_s": round(startup, 3)}


def _totals(epochs: list[dict]) -> dict[str, Any]:
    images, seconds = sum(e["images"] for e in epochs), sum(e["seconds"] for e in epochs)
    cpu = sum(e["cpu_s"] for e in epochs)
    return {"images": images, "seconds": round(seconds, 3), "images_per_s": round(images / max(seconds, 1e-9), 1),
            "cpu_s": round(cpu, 3), "images_per_cpu_s": round(images / max(cpu, 1e-9), 1)}


# ------------------------------------------------------------------------------------------
# baseline: PyTorch DataLoader over the raw JPEG ImageFolder, in its own process
# ------------------------------------------------------------------------------------------

class JpegFolder:
    """A plain map-style dataset (DataLoader needs only __len__ and __getitem__).

    Same pixels pipeline as ours: decode_rgb (centre crop, JPEG draft) and stages.feed.streaming.augment
    with the same parameters and a per-(seed, epoch, index) RNG.
    """

    def __init__(self, root: str, size: int, seed: int, augment: dict[str, Any]):
        root_path = Path(root)
        self.classes = sorted(d.name for d in root_path.iterdir() if d.is_dir())
        self.items = [(str(f), i) for i, c in enumerate(self.classes)
                      for f in sorted((root_path / c).iterdir()) if f.is_file()]
        self.size, self.seed, self.augment, self.epoch = size, seed, augment, 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        import numpy as np
        import torch

        from stages.feed.streaming import augment
        from stages.etl.images import decode_rgb

        path, label = self.items[index]
        with open(path, "rb") as f:
            pixels = decode_rgb(f.read(), self.size)
        a = self.augment
        rng = np.random.default_rng([self.seed, self.epoch, index])
        pixels = augment(pixels, rng, a["scale_min"], a["random_resized_crop"], a["flip"])
        return torch.from_numpy(pixels), label


def _cpu_with_children() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def dataloader_child(spec_json: str) -> None:
    """Entry point of the DataLoader process; prints one JSON line with its timings."""
    t_start = time.time()
    spec = json.loads(spec_json)
    import numpy  # noqa: F401  what a training script imports up front; forked workers inherit it
    import torch
    from torch.utils.data import DataLoader

    import stages.feed.streaming  # noqa: F401
    import stages.etl.images  # noqa: F401

    t_imported = time.time()
    a = spec["augment"]
    mean = torch.tensor(a["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(a["std"]).view(1, 3, 1, 1)
    t_loop = time.time()
    dataset = JpegFolder(spec["src"], spec["image_size"], spec["seed"], a)
    loader = DataLoader(dataset, batch_size=spec["batch_size"], shuffle=True, num_workers=spec["num_workers"],
                        generator=torch.Generator().manual_seed(spec["seed"]))
    epochs = []
    for epoch in range(spec["epochs"]):
        dataset.epoch = epoch  # workers are forked per epoch (not persistent) and see this value
        t0, cpu0 = time.time(), _cpu_with_children()
        n, t_first, batches = 0, None, 0
        for x, y in loader:
            # the same work as stages.train.loop.to_batch after its np.stack
            x = x.permute(0, 3, 1, 2).float().div_(255)
            x = ((x - mean) / std).contiguous()
            assert x.shape[0] == y.shape[0]
            n += x.shape[0]
            batches += 1
            if t_first is None:
                t_first = time.time()
        t_end = time.time()
        # exhausting the iterator joined its workers, so their CPU time is in RUSAGE_CHILDREN now
        epochs.append({"start": t0, "first": t_first, "end": t_end, "images": n, "batches": batches,
                       "cpu_s": _cpu_with_children() - cpu0})
    print("RESULT " + json.dumps({"process_start": t_start, "imported": t_imported, "loop_start": t_loop,
                                  "epochs": epochs, "torch_threads": torch.get_num_threads()}), flush=True)


def run_dataloader(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import MemorySampler, loadavg
    from stages.common.config import AugmentConfig

    spec = {"src": str(src), "image_size": args.image_size, "seed": args.seed, "batch_size": args.batch_size,
            "num_workers": args.dl_workers, "epochs": args.epochs,
            "augment": AugmentConfig().model_dump(mode="json")}
    cmd = [sys.executable, "-c", "import sys; from benchmarks.ingest import dataloader_child; "
           "dataloader_child(sys.argv[1])", json.dumps(spec)]
    load = loadavg()
    with MemorySampler(0.1, ray=False) as sampler:
        t_launch = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO), timeout=600)
        t_done = time.time()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"DataLoader process failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    epochs = [{"images": e["images"], "seconds": round(e["end"] - e["start"], 3),
               "images_per_s": round(e["images"] / max(e["end"] - e["start"], 1e-9), 1),
               "first_batch_s": round(e["first"] - e["start"], 3), "cpu_s": round(e["cpu_s"], 3)}
              for e in r["epochs"]]
    return {"method": "dataloader", "epochs": epochs, **_totals(epochs),
            "first_batch_loop_s": round(r["epochs"][0]["first"] - r["loop_start"], 3),
            "first_batch_job_s": round(r["epochs"][0]["first"] - t_launch, 3),
            "startup_s": round(r["loop_start"] - t_launch, 3),
            "imports_s": round(r["imported"] - r["process_start"], 3),
            "job_wall_s": round(t_done - t_launch, 2), "loadavg_before": load, "memory": sampler.summary(),
            "torch_threads_main": r["torch_threads"], "num_workers": args.dl_workers}


# ------------------------------------------------------------------------------------------
# part 3: input stall of the demo training (configs/default.yaml)
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------

_LABEL = {"dataloader": "DataLoader({w} workers), raw JPEGs"}


def _table(result: dict[str, Any]) -> list[str]:
    d, c, methods, ratios = result["data"], result["config"], result["methods"], result["ratios"]
    epochs = c["epochs"]
    lines = [
        f"Training ingest, no model step: {d['images']:,} JPEGs of {d['source_size'][0]}x{d['source_size'][1]} px "
        f"(mean {d['mean_file_kb']} KiB) read for {epochs} epochs as {c['image_size']} px batches of "
        f"{c['batch_size']} (per worker), with the training augmentation (random resized crop, flip) and "
        f"normalisation. ours: the training stage's reader over {d['shards']} parquet shards "
        + (f"of {'/'.join(str(x) for x in d['rows_per_shard'])} rows " if d.get("rows_per_shard") else "") +
        f"({d['parquet_mb']} MiB, JPEG q90 at {c['image_size']} px) inside a Ray Train TorchTrainer "
        f"({c['cpus_per_worker']} CPU per worker, {c['decode_threads']} decode threads, "
        f"{c['prefetch_batches']} batches prefetched). DataLoader: `torch.utils.data.DataLoader(num_workers="
        f"{c['dl_workers']}, shuffle=True)` over the JPEG folder, decode_rgb (centre crop, JPEG draft) + the "
        f"same augment, in a fresh process. {c['repeat']} rounds, order alternating; best run of each reported "
        f"(medians in brackets).",
        "",
        "| method | " + " | ".join(f"epoch {e + 1} images/s" for e in range(epochs)) +
        f" | {epochs} epochs images/s | ours ÷ DataLoader | images per CPU-s | first batch, loop (s) | "
        "first batch, job (s) | epoch 2 first batch (s) | RSS start → peak (MiB) |",
        "|---|" + "---:|" * epochs + "---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = ([f"ours_{n}" for n in result["workers"]] + [f"raydata_{n}" for n in result.get("ray_data_workers", [])]
             + ["dataloader"])
    for key in order:
        m = methods.get(key)
        if not m:
            continue
        label = {"ours": "ours (stream), {} worker(s)", "raydata": "Ray Data ingest, {} worker(s)",
                 "dataloader": f"DataLoader, {c['dl_workers']} workers"}[key.split("_")[0]].format(key.split("_")[-1])
        rel = "1.00" if key == "dataloader" else fmt(ratios[key]["throughput"], 2)
        lines.append(
            f"| {label} | " + " | ".join(f"{fmt(x)} ({fmt(y)})" for x, y in
                                        zip(m["epoch_images_per_s"], m["epoch_images_per_s_median"])) +
            f" | {fmt(m['images_per_s'])} ({fmt(m['images_per_s_median'])}) | {rel} | "
            f"{fmt(m.get('images_per_cpu_s'))} ({fmt(m.get('images_per_cpu_s_median'))}) | "
            f"{fmt(m['first_batch_loop_s'], 3)} ({fmt(m['first_batch_loop_s_median'], 3)}) | "
            f"{fmt(m['first_batch_job_s'], 2)} ({fmt(m['first_batch_job_s_median'], 2)}) | "
            f"{fmt(m['epoch2_first_batch_s'], 3)} | {fmt(m['start_rss_mb'])} → {fmt(m['peak_rss_mb'])} |")
    return lines


def _notes(result: dict[str, Any]) -> list[str]:
    d, c, methods, ratios = result["data"], result["config"], result["methods"], result["ratios"]
    epochs = c["epochs"]
    main = f"ours_{max(result['workers'])}"
    r, dl, o = ratios[main], methods["dataloader"], methods[main]
    lines = [
        f"- Time to first batch, **loop** (the target's measure): from the start of the per-worker "
        f"loop, after its imports, to the first normalised batch (ours: the slowest rank; it includes reading the first shards "
        f"and filling the {c['shuffle_buffer_rows']}-row shuffle buffer; DataLoader: listing the folder, "
        f"forking {c['dl_workers']} workers and their first batches). **Job**: from the launch to the first "
        f"batch: ours from `TorchTrainer.fit()` with Ray already up (Ray Train start-up: controller, worker "
        f"actors, gloo process group, {fmt(o['startup_s'], 1)} s at best), DataLoader from the subprocess "
        f"launch (Python start-up and `import torch`, {fmt(dl['startup_s'], 1)} s at best). "
        f"Ratio ours ÷ DataLoader on the job measure: {fmt(r['first_batch_job'], 1)} x. "
        f"`ray.init` ({result['ray_start_s']} s, once per process) is in neither.",
        f"- Per-epoch ratios ours ({main.split('_')[1]} workers) ÷ DataLoader: "
        + ", ".join(f"epoch {i + 1} {fmt(x, 2)}" for i, x in enumerate(r["epoch_throughput"]))
        + f". An epoch's time runs from the start of its iteration to its last batch, so epoch 1 carries the "
          f"first-batch latency; the DataLoader forks its workers again every epoch (not persistent, the default).",
        f"- Images per CPU-s: images over the CPU seconds spent in the loop (ours: the Ray Train worker "
        f"processes, all threads; DataLoader: its main process plus its worker processes), medians "
        f"ours ÷ DataLoader {fmt(r.get('per_cpu_s'), 2)} x. Other load on the machine moves this much less "
        f"than images/s; it is blind to idle cores. Verdicts are flagged noisy when the fastest and slowest "
        f"run of one method differ by more than x{NOISY_SPREAD}.",
        f"- Peak memory (psutil, summed RSS sampled every 0.1 s): ours counts the driver and every `ray::` "
        f"process (Train controller, workers, and idle pooled workers left from the ETL), {fmt(o['peak_rss_mb'])} "
        f"MiB ({fmt(o['peak_rss_tree_mb'])} MiB with Ray's daemons); DataLoader counts the driver (which has "
        f"Ray and the ETL imported, {fmt(dl['start_rss_mb'])} MiB) plus its process and workers, "
        f"{fmt(dl['peak_rss_mb'])} MiB, of which the DataLoader's own processes {fmt(dl['peak_rss_workers_mb'])} MiB. "
        f"Shared pages count once per process: upper bounds.",
        f"- Why ours is faster per image: ETL already decoded the {d['source_size'][0]}x{d['source_size'][1]} "
        f"JPEGs and stored {c['image_size']} px ones, so training decodes a ~{c['image_size']} px JPEG instead "
        f"of a full-size one (JPEG draft already cuts the full-size decode to 1/4 scale). The ETL cost "
        f"({d['etl_s']} s here, once) is not in these numbers.",
        "- Absolute rates move with other load on the 2-core machine (the load average before every run is "
        "in the JSON); the methods are interleaved, so the ratios of runs taken side by side are the result.",
    ]
    reads = [x for x in o.get("first_read_s", []) if x is not None]
    later = [x for x in o.get("later_first_read_s", []) if x is not None]
    if reads and later:
        lines.insert(1, f"- The first shard read in a fresh worker process took {fmt(max(reads), 3)} s at worst "
                     f"({', '.join(fmt(x, 3) for x in reads)} per run, slowest rank), against {fmt(max(later), 3)} s "
                     f"at worst in epoch {epochs}: it is part of ours' first batch (the shuffle buffer needs rows "
                     f"before anything is decoded).")
    return lines


def _stall_lines(s: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"### Input stall of the demo training ({s['config']})",
        "",
        f"`stages.train.stage.run` with {s['config']} on a {s['images']:,}-image demo set "
        f"(`workflow.demo_data.generate`, random sizes, 30% PNG) after its ETL ({s['train_rows']} train rows, "
        f"parquet {s['parquet_encoding']}): {s['train_config']['num_workers']} workers, "
        f"{s['train_config']['model']} width {s['train_config']['width']}, batch {s['train_config']['batch_size']}, "
        f"{s['train_config']['decode_threads']} decode threads, {s['train_config']['prefetch_batches']} batches "
        f"prefetched. From its metrics.jsonl (stall = time waiting for input / (waiting + computing), "
        f"averaged over ranks):",
        "",
        "| epoch | images/s | waiting s | computing s | stall | verdict |", "|---:|---:|---:|---:|---:|---|",
    ]
    for e in s["epochs"]:
        lines.append(f"| {e['epoch']} | {fmt(e['images_per_s'])} | {fmt(e['wait_s'], 2)} | "
                     f"{fmt(e['compute_s'], 2)} | {e['stall_fraction']:.1%} | {e['verdict']} |")
    lines += [
        "",
        f"- All epochs together: stall {s['stall_overall']:.1%}; worst epoch {s['stall_max']:.1%}"
        + (f", worst after the first {s['stall_max_after_first']:.1%}" if s["stall_max_after_first"] is not None else "")
        + f"; {s['epochs_over_target']} of {len(s['epochs'])} epochs above {TARGETS['stall_fraction']:.0%}. "
          f"Verdict of the last epoch: \"{s['last_verdict']}\". Test accuracy {s['test_acc']:.3f}; "
          f"training took {s['train_s']} s (Ray Train start-up and export included).",
    ]
    return lines


def _paper_model(result: dict[str, Any]) -> list[str]:
    """What each path would sustain on a GPU node with N spare cores plus M CPU-only nodes, from
    the measured images per CPU-second (decode + augment + the path's own overhead)."""
    methods = result["methods"]
    stream = methods.get(f"ours_{max(result['workers'])}", {}).get("images_per_cpu_s_median")
    rd_key = next((k for k in methods if k.startswith("raydata")), None)
    ray_data = methods[rd_key].get("images_per_cpu_s_median") if rd_key else None
    if not stream:
        return []
    rows = []
    for spare, cpu_nodes, cores in ((4, 0, 0), (8, 0, 0), (4, 2, 16), (8, 4, 32)):
        rows.append([spare, f"{cpu_nodes} x {cores}" if cpu_nodes else "-", fmt(spare * stream, 0),
                     fmt((spare + cpu_nodes * cores) * ray_data, 0) if ray_data else "-"])
    c = result["config"]
    return ["", f"Paper model ({c['image_size']} px, per-image cost from the medians above: stream "
                f"{fmt(1e6 / stream, 0)} µs, Ray Data {fmt(1e6 / ray_data, 0) if ray_data else '-'} µs of CPU per image, "
                f"everything included). stream decodes only on the training node's spare cores; Ray Data on "
                f"every CPU in the cluster. Network and the object-store hop are not modelled; at 224 px "
                f"decode costs roughly 10-25x more per image.", ""] + md_table(
        ["spare cores on the GPU node", "CPU nodes x cores", "stream images/s", "ray_data images/s"], rows)


def render(result: dict[str, Any]) -> str:
    lines = (_table(result) + [""] + targets_table(result["targets"], 3) + [""] + _notes(result)
             + _paper_model(result))
    if result.get("stall"):
        lines += _stall_lines(result["stall"])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # quick manual run without the runner
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    print(render(run(ap.parse_args())))
