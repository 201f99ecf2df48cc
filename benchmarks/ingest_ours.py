"""The ingest benchmark's `ours` and `raydata` methods: the training stage's reader inside a Ray Train
worker, no model (benchmarks/ingest.py says what each measures)."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def _drain(prefetch, mean, std) -> tuple[int, float | None, int]:
    """Consume one epoch as training would (normalised tensors, labels): (images, first batch time, batches)."""
    import torch

    from stages.model.predict import to_batch

    n, t_first, batches_seen = 0, None, 0
    for item in prefetch:  # the stream's Prefetcher yields (rows, pixels); Ray Data's ShardBatches a FedBatch
        batch, arrays = (item.rows, item.images) if hasattr(item, "rows") else item
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
