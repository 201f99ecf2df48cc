"""Ray Data ingest (train.ingest=ray_data): read, decode and augment on any CPU of the cluster.

The default ingest (stages/feed/streaming.py) decodes inside each training worker: exact mid-epoch resume,
but input throughput is capped by the spare cores of the node that holds the accelerator. Here
the ETL shards are read by Ray Data (read_parquet, or read_webdataset for tar), decoded and
augmented in `map_batches` tasks that request `train.data_cpus_per_task` CPUs each and may run
on CPU-only nodes, and streamed to the workers through the object store
(TorchTrainer(datasets=...) -> get_dataset_shard("train").iter_torch_batches(...)).

The price: Ray Data's iterator cannot resume mid-epoch (ray-project/ray #37633, #48224), so a
failure restarts the interrupted epoch from its first batch with the last checkpoint's weights
(`RESUME`). Train's DataConfig splits with streaming_split(equal=True): every rank gets the same
row count, and up to world_size - 1 rows per epoch are dropped to get there.
"""
from __future__ import annotations

import logging
import itertools
import re
import threading
import time
from typing import Any, Callable

import numpy as np

from stages.feed import ray_udfs as udfs
from stages.feed.feeds import FedBatch
from stages.feed.meters import StartWaits
from stages.common import console, session, storage
from stages.common.artifacts import Artifact, write_manifest
from stages.common.config import ConfigError, TrainConfig

__all__ = ["RESUME", "SPLITS", "check_plan", "decode_rows", "reserve_per_operator", "build_train_dataset",
           "build_train_datasets", "equal_rows", "ShardBatches", "WarmEpochs"]

log = logging.getLogger(__name__)

RESUME = {
    "stream": "exact: a failure resumes at the checkpoint's step; every sample once per epoch",
    "ray_data": "epoch-granular: a failure restarts the interrupted epoch from its first batch with the "
                "last checkpoint's weights; rows consumed before that checkpoint are seen twice in that "
                "epoch (ray-project/ray #37633)",
}
SPLITS = ("train", "train_odd")  # the datasets of even and odd epochs (build_train_datasets)
MAP_BATCH_ROWS = 64  # rows per decode/augment call when a read block is too big to decode at once
# Ray fuses the read with the decode only when map_batches takes whole blocks (batch_size=None);
# with a batch size the encoded rows cross the object store between two tasks. One block per
# shard, decoded in the task that read it: Ray Data alone 1,791 -> 2,071 img/s, first batch
# 0.76 -> 0.59 s (4,787 images at 224 px, 200-row shards, 2-core box). A block's pixels live in
# that task at once, so shards past this many decoded bytes keep the split, unfused plan.
FUSED_BLOCK_BYTES = 192 * 2**20
# Rows per read block, at least, in the split plan: Ray's default aims for 200+ blocks, so 64
# shards of 200 rows became 50-row blocks that each decode task bundled and re-sliced into 64-row
# batches. One block per 256 rows fed an input-bound step 1,168-1,246 -> 1,263-1,344 img/s.
BLOCK_ROWS = 4 * MAP_BATCH_ROWS
# Ray Data's per-operator reservation (DataContext.op_resource_reservation_enabled, on by default)
# held the decode to fewer tasks than the CPUs run: the train dataset alone made 1,110-1,550 img/s
# with it and 2,080-2,290 without, alternated in one process (6,392 images at 224 px, 0.5 CPU a
# task, 2-core box, 2026-11-29). But without it Ray 2.60 also drops its object-store budget: ahead
# of a slow consumer (50 ms a batch of 32) it filled a 400 MB store to 316-345 MB, against 173-200
# MB with it, and a big epoch would spill to disk. So the reservation is left off only when every
# dataset's decoded epoch fits in this share of the object store (Ray's own limit without it).
RUN_AHEAD_SHARE = 0.25


def reserve_per_operator(shards: list[dict], image_size: int, datasets: int) -> bool:
    """Whether the train datasets keep Ray Data's per-operator reservation: unless `datasets`
    decoded epochs (uint8 pixels) fit in RUN_AHEAD_SHARE of the cluster's object store."""
    import ray

    decoded = sum(s["rows"] for s in shards) * image_size * image_size * 3
    return datasets * decoded > RUN_AHEAD_SHARE * ray.cluster_resources().get("object_store_memory", 0)


def decode_rows(shards: list[dict], image_size: int) -> int | None:
    """Rows per decode call: None (a whole read block, fused with its read) when the biggest
    shard's pixels fit in FUSED_BLOCK_BYTES, else MAP_BATCH_ROWS."""
    biggest = max(s["rows"] for s in shards) * image_size * image_size * 3
    return None if biggest <= FUSED_BLOCK_BYTES else MAP_BATCH_ROWS


def check_plan(cfg: TrainConfig, data_reserved_cpus: float) -> None:
    """Refuse Ray Data task sizes that could never be scheduled beside the trainer (2-CPU deadlock)."""
    if cfg.ingest != "ray_data":
        return
    if (cfg.data_cpus_per_task or 0) > data_reserved_cpus + 1e-9:
        raise ConfigError(
            f"train.data_cpus_per_task={cfg.data_cpus_per_task:g} exceeds ray.data_reserved_cpus="
            f"{data_reserved_cpus:g}: with the trainer holding the rest, Ray Data's decode tasks "
            f"would wait forever; lower train.data_cpus_per_task or raise ray.data_reserved_cpus")
    if cfg.checkpoint_every_steps:
        log.warning("train.checkpoint_every_steps=%d with train.ingest=ray_data: resume is "
                    "epoch-granular, so after a failure the interrupted epoch restarts from its first "
                    "batch (rows before the checkpoint are seen twice). Use train.ingest=stream for "
                    "exact mid-epoch resume", cfg.checkpoint_every_steps)


def equal_rows(total: int, world: int) -> int:
    """Rows per epoch after streaming_split(equal=True): a multiple of the world size."""
    return total // world * world


def _read(shards: list[dict], seed: int, cpus: float, s3: dict | None, rows: int | None):
    import ray.data
    from ray.data import DataContext, FileShuffleConfig

    console.quiet_ray()

    remote_uris = [s["uri"] for s in shards if s["uri"].startswith("s3://")]
    fs = storage.pyarrow_filesystem(remote_uris[0], s3)[0] if remote_uris else None  # s3.* settings, retries too
    paths = [s["uri"][len("s3://"):] if fs else s["uri"] for s in shards]
    # File order seeded per epoch: Ray reseeds with (seed, execution index) on every execution.
    shuffle = FileShuffleConfig(seed=seed, reseed_after_execution=True)
    if shards[0]["format"] == "parquet":
        ctx = DataContext.get_current()
        # Ray 2.60's default parquet reader (datasource V2) plans its ListFiles step as a 1-CPU task
        # whatever num_cpus says; beside a trainer that leaves 0.5 CPU free it never runs (seen
        # here: a hung epoch). The V1 reader honours num_cpus for every task.
        default, ctx.use_datasource_v2 = ctx.use_datasource_v2, False
        # its file-sampling progress bar is drawn here, in the driver, before any execution
        bars, ctx.enable_progress_bars = ctx.enable_progress_bars, ctx.enable_progress_bars and console.verbose()
        try:
            split = -(-sum(s["rows"] for s in shards) // BLOCK_ROWS)
            blocks = len(paths) if rows is None else max(len(paths), split)  # None: a block per shard
            ds = ray.data.read_parquet(paths, filesystem=fs, shuffle=shuffle, num_cpus=cpus,
                                       override_num_blocks=blocks)
        finally:
            ctx.use_datasource_v2, ctx.enable_progress_bars = default, bars
        return ds.select_columns(["key", "label", "image"])
    ds = ray.data.read_webdataset(paths, filesystem=fs, decoder=None, shuffle=shuffle, num_cpus=cpus)
    return ds.map_batches(udfs.from_webdataset, batch_size=rows, num_cpus=cpus)


def build_train_dataset(cfg: TrainConfig, shards: list[dict], *, seed: int, image_size: int, raw: bool,
                        s3: dict | None) -> tuple[Any, dict[str, Any]]:
    """One lazy train Dataset (a benchmark's single pass), and what to report about it."""
    datasets, info = build_train_datasets(cfg.model_copy(update={"epochs": 1}), shards, seed=seed,
                                          image_size=image_size, raw=raw, s3=s3)
    return datasets[SPLITS[0]], info


def build_train_datasets(cfg: TrainConfig, shards: list[dict], *, seed: int, image_size: int, raw: bool,
                         s3: dict | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The lazy train Datasets for TorchTrainer(datasets=...): one per name in SPLITS (one when
    train.epochs is 1), and what to report about them.

    Two datasets, so two split coordinators: even epochs read SPLITS[0], odd ones SPLITS[1], and
    each worker starts the next epoch's execution on the other coordinator while this one trains
    (WarmEpochs). One coordinator runs one execution at a time and starts it only when every rank
    asks, after the epoch before: on an H100 that cold start left the GPU idle 2.3 s of every
    5.7 s epoch (0.58 of its limit).
    """
    cpus, a = cfg.data_cpus_per_task or session.DATA_TASK_CPUS, cfg.augment  # train.py passes the plan's
    augment = {"scale_min": a.scale_min, "crop": a.random_resized_crop, "flip": a.flip}
    info: dict[str, Any] = {"ingest": "ray_data", "resume": RESUME["ray_data"],
                            "data_cpus_per_task": cpus, "object_store_cache": cfg.object_store_cache}
    rows, decode = decode_rows(shards, image_size), {"image_size": image_size, "raw": raw}
    names = SPLITS if cfg.epochs > 1 else SPLITS[:1]
    if cfg.object_store_cache:
        decoded = _read(shards, seed, cpus, s3, rows).map_batches(udfs.decode_batch, fn_kwargs=decode,
                                                                   batch_size=rows, num_cpus=cpus)
        cached = _cached(decoded, info)
        datasets = {name: cached.map_batches(udfs.augment_batch, fn_kwargs=augment, batch_size=rows, num_cpus=cpus)
                    for name in names}
    else:  # one UDF, pixels stacked once: first batch 0.9 -> 0.65 s, +5% images/s (224 px, 2-core box)
        # Each dataset its own file-order seed: Ray reseeds it per execution with hash((seed, index)).
        datasets = {name: _read(shards, seed + i * 1_000_003, cpus, s3, rows).map_batches(
            udfs.decode_augment_batch, fn_kwargs={**decode, **augment}, batch_size=rows, num_cpus=cpus)
            for i, name in enumerate(names)}
    info["reserve_per_operator"] = reserve = reserve_per_operator(shards, image_size, len(datasets))
    for ds in datasets.values():
        # Every epoch runs this dataset inside Train's split coordinator actor, whose stdout reaches
        # the terminal: its progress bars would print a screen per epoch. --verbose brings them back.
        ds.context.enable_progress_bars = console.verbose()
        ds.context.op_resource_reservation_enabled = reserve
    return datasets, info


def _cached(decoded, info: dict[str, Any]):
    """`decoded`, materialised in the object store; its size and fill time go into `info`."""
    import ray

    started = time.perf_counter()
    # Decoded once, before epoch 1, while no trainer holds CPUs; every epoch then reads these
    # blocks. Past the object store's capacity Ray spills them to local disk by itself.
    capacity = ray.cluster_resources().get("object_store_memory", 0)
    decoded = decoded.materialize()
    size = decoded.size_bytes()
    fits = size <= capacity
    info.update(cache_bytes=size, object_store_bytes=int(capacity), cache_fits=fits,
                cache_fill_s=round(time.perf_counter() - started, 2))
    log.info("object-store cache: %.1f MB of decoded train images %s (%.1f MB free), %.1f s",
             size / 1e6, "cached in memory" if fits else "did NOT fit: Ray spills the rest to disk",
             capacity / 1e6, info["cache_fill_s"])
    return decoded


_BLOCKED = re.compile(r"blocked by Ray Data iter_batches: ([\d.]+)(s|ms|us)")


def _blocked_s(stats: str) -> float | None:
    """Ray Data's own 'user thread blocked' time from DataIterator.stats(), in seconds."""
    match = _BLOCKED.search(stats or "")
    if not match:
        return None
    return float(match.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[match.group(2)]


class _Collate:
    """numpy batch -> (keys, labels, uint8 NHWC images, decode nodes, decode times); to_batch
    normalises on the training device."""

    def __call__(self, batch: dict[str, np.ndarray]):
        return (list(batch["key"]), batch["label"], batch["image"], set(batch["decode_node"]),
                batch["decoded_at"])


class _Started:
    """One epoch's iteration of this rank's shard, begun in a thread: the thread waits at the split
    coordinator's barrier (every rank asks for the epoch) and for the first batch, while Ray Data
    runs on ahead of the consumer up to its own backpressure."""

    _END = object()

    def __init__(self, shard, cfg: TrainConfig, seed: int, epoch: int, rank: int):
        from ray.data.collate_fn import NumpyBatchCollateFn

        collate = type("Collate", (_Collate, NumpyBatchCollateFn), {})()
        self.shard, self.started_at = shard, time.time()
        self.blocked_before = _blocked_s(shard.stats()) or 0.0  # Ray's counter spans epochs
        # Local shuffle buffer seeded per (seed, epoch, rank), after the per-epoch file order.
        self.batches = iter(shard.iter_torch_batches(
            batch_size=cfg.batch_size, prefetch_batches=cfg.prefetch_batches,
            local_shuffle_buffer_size=cfg.shuffle_buffer_rows,
            local_shuffle_seed=(seed * 1_000_003 + epoch * 1_009 + rank) % 2**31,
            collate_fn=collate, device="cpu"))
        self.first: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fetch_first, name=f"raymill-epoch-{epoch}", daemon=True)
        self.thread.start()

    def _fetch_first(self) -> None:
        try:
            self.first = next(self.batches, self._END)
        except BaseException as e:  # raised in the training thread, where the epoch is read
            self.error = e

    def take_first(self) -> Any:
        """The first batch (waiting for it), or _END for an empty epoch."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.first


class WarmEpochs:
    """A worker's epochs of Ray Data: each begins while the one before trains.

    Epoch e reads the split of dataset SPLITS[e % 2]. Once train.next_epoch_at of epoch e's
    `steps` batches are here, the iteration of epoch e + 1 starts on the other split: all ranks
    reach its coordinator's barrier during epoch e, so its execution fills while e trains, and
    its first batch is waiting when the loop asks. Resume is unchanged: a restarted worker group
    starts at its checkpoint's epoch.
    """

    def __init__(self, cfg: TrainConfig, seed: int, rank: int, shard_of: Callable[[str], Any], steps: int = 1):
        self.cfg, self.seed, self.rank, self.shard_of, self.steps = cfg, seed, rank, shard_of, steps
        # Batches of this epoch before the next begins (train.next_epoch_at; None: at its end). Begun
        # at the first batch (0), the next epoch's execution ran a whole epoch ahead and took this
        # one's CPUs: epoch 1 fell to 682 img/s on an H100 (epochs 2-3: 3,920) and to 211 on the
        # 2-core box; halfway was the fastest there over 4 epochs (benchmarks cpu_user).
        self.at = max(1, int(steps * cfg.next_epoch_at)) if cfg.next_epoch_at < 1 else None
        self.next: tuple[int, _Started] | None = None

    def start(self, epoch: int) -> _Started:
        return _Started(self.shard_of(SPLITS[epoch % len(SPLITS)]), self.cfg, self.seed, epoch, self.rank)

    def epoch(self, epoch: int) -> "ShardBatches":
        ahead = bool(self.next and self.next[0] == epoch)
        started = self.next[1] if ahead else self.start(epoch)
        self.next = None
        after = (lambda: self.begin(epoch + 1)) if epoch + 1 < self.cfg.epochs and self.at else None
        return ShardBatches(started, on_batch=(self.at, after) if after else None, half=max(1, self.steps // 2),
                            ahead=ahead)

    def begin(self, epoch: int) -> None:
        """Start `epoch`'s execution now (once); epoch(epoch) then reads it."""
        if self.next is None:
            self.next = (epoch, self.start(epoch))


class ShardBatches:
    """One epoch of this rank's Ray Data shard as stages.feed.feeds.FedBatch, like every other feed.

    `rows` holds (key, label, None) per row; `images` the augmented uint8 images. `wait_s` is the
    time the training thread waited for input; `start_wait_s` the part of it before the first batch,
    `early_wait_s` the part before batch `half` (the first included), `late_wall_s` the wall from
    batch `half` on: a wait that is mostly early while the rest keeps up is an execution starting,
    one spread over the epoch is Ray Data's rate (meters.verdict).
    """

    def __init__(self, started: _Started, on_batch: tuple[int, Callable[[], None]] | None = None,
                 half: int = 1, ahead: bool = False):
        self.started, self.on_batch, self.half = started, on_batch, half  # on_batch (n, f): f() once n batches are here
        self.ahead = ahead  # its execution began while the epoch before trained (WarmEpochs)
        self.wait_s, self.start_wait_s, self.early_wait_s = 0.0, 0.0, 0.0
        self.late_wall_s = 0.0
        self.decode_nodes, self.decoded_in_epoch = set(), 0

    def _batches(self):
        begun = time.perf_counter()
        first = self.started.take_first()
        self.start_wait_s = time.perf_counter() - begun
        if first is _Started._END:
            return
        n, call = self.on_batch or (0, None)
        for i, batch in enumerate(itertools.chain([first], self.started.batches), 1):
            if i == n:
                call()  # the next epoch's execution starts now, beside this one
            yield batch

    def __iter__(self):
        batches, late_from = self._batches(), None
        for i in itertools.count():
            started = time.perf_counter()
            if i == self.half:
                late_from = started
            try:
                keys, labels, images, nodes, decoded_at = next(batches)
            except StopIteration:
                if late_from is not None:  # the second half's wall, its last step included
                    self.late_wall_s = time.perf_counter() - late_from
                return
            waited = time.perf_counter() - started
            self.wait_s += waited
            if i < self.half:
                self.early_wait_s += waited
            self.decode_nodes |= nodes
            # rows decoded since this epoch's execution began (0 when the object-store cache served them)
            self.decoded_in_epoch += int((decoded_at >= self.started.started_at).sum())
            yield FedBatch([(k, int(y), None) for k, y in zip(keys, labels)], np.asarray(images))

    def close(self) -> None:
        pass  # Ray Data's iterator owns its threads

    def capacity(self) -> None:
        return None  # Ray Data's decode runs elsewhere; its wait is what the loop sees

    def stats(self) -> dict[str, Any]:
        """This epoch's Ray Data iterator wait, the part of it before the first batch, where decoding
        ran, and how many of this rank's rows were decoded during the epoch's execution."""
        blocked = _blocked_s(self.started.shard.stats())
        blocked = None if blocked is None else round(blocked - self.started.blocked_before, 3)
        return {"ray_data_blocked_s": blocked, "ray_data_start_wait_s": round(self.start_wait_s, 3),
                "ray_data_early_wait_s": round(self.early_wait_s, 3),
                "ray_data_late_wall_s": round(self.late_wall_s, 3),
                "decode_nodes": sorted(self.decode_nodes), "rows_decoded_in_epoch": self.decoded_in_epoch}


def waits(feed) -> list[float]:
    """An epoch's Ray Data wait in parts (before the first batch, in the first half, in the second
    half, and the second half's wall), to sum over ranks; [] for the other feeds."""
    if not isinstance(feed, ShardBatches):
        return []
    return [feed.start_wait_s, feed.early_wait_s, feed.wait_s - feed.early_wait_s, feed.late_wall_s,
            float(feed.ahead)]


def judged_waits(sums: list[float], world: int, cfg: TrainConfig) -> StartWaits | None:
    """meters.verdict's ray_waits: means over ranks, as its other times (rank 0's own: "5.6 s of the 5.3 s wait")."""
    if not sums:
        return None
    start, early, late, late_wall, ahead = (v / world for v in sums)
    return StartWaits(start, early, late / late_wall if late_wall > 0 else None, cfg.next_epoch_at < 1,
                      ahead >= 0.5)


def annotate(artifact, ingest: dict[str, Any], s3: Any | None = None):
    """Add the ingest path, its resume semantics and cache report to a published train manifest."""
    manifest = {**artifact.manifest, "ingest": ingest}
    write_manifest(artifact.path, manifest, s3)
    return Artifact(artifact.stage, artifact.path, manifest)
