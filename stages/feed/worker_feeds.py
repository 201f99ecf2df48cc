"""Where a training worker's batches come from: one object per worker, for both ingest paths.

It owns the worker's decode pool (started once, closed with the worker), its decoded tier, and
picks each epoch's feed (stages.feed.feeds): the Ray Data shard, the tier, or this worker's own shard
reader decoded in processes (or threads). The training loop only sees `FedBatch`es.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from stages.feed import decoded_tier
from stages.feed import ray_data as ingest_ray
from stages.feed import streaming
from stages.feed import feeds
from stages.feed.decode_pool import DecodePool, DecodeSpec
from stages.common.config import TrainConfig

__all__ = ["WorkerFeeds"]

log = logging.getLogger(__name__)

# Decoded eval pixels a worker keeps to replay in later epochs (per worker, its val and test splits
# together, host memory): the demo's val split is 2 MB; at 224 px an image is 0.15 MB, so ~1,700
# images a worker; a split that does not fit is decoded every epoch, as before.
EVAL_KEEP_BYTES = 256 * 2**20


def _dataset_shard(name: str):
    import ray.train

    return ray.train.get_dataset_shard(name)


class WorkerFeeds:
    """The input side of one training rank."""

    def __init__(self, cfg: TrainConfig, config: dict[str, Any], rank: int, world: int,
                 device: torch.device, refs: dict[str, list], total: int, steps: int,
                 open_rows: Callable[[streaming.ShardRef], list], fresh: bool = False):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.seed, self.size, self.raw = config["seed"], config["image_size"], config["raw"]
        self.refs, self.total, self.steps, self.open_rows = refs, total, steps, open_rows
        self.decode_processes, self.pool = config.get("decode_processes", 0), None
        # A CPU worker's torch threads: the plan's while its decode processes share the cores, all
        # of its cores in a decoded-tier epoch, where nothing decodes (1 worker x 2 CPUs: with one
        # torch thread such an epoch ran on one of the two cores, 0.74 of the 2-core bound).
        self.threads = {"decode": config.get("torch_threads", 1),
                        "tier": max(1, int(config.get("cpus_per_worker", 1)))}
        self.tier = self.make_tier()
        self._eval_kept: dict[str, list[feeds.FedBatch]] = {}  # split -> its kept batches (eval_feed)
        self.warm = ingest_ray.WarmEpochs(cfg, self.seed, rank, _dataset_shard, steps) if cfg.ingest == "ray_data" else None
        if self.warm is not None and fresh:
            # A fresh run's epoch 1 starts now, beside the model's build and CUDA's start: Ray Data's
            # cold start had been 7.8 s before its first batch on an H100 (0.0 s since). A resumed
            # run starts at its checkpoint's epoch, in the loop.
            self.warm.begin(0)
        # The pool starts beside the rest of the worker's start (model, DDP, restore): it was 1.0 s
        # of a 2-core demo's fixed cost before the first batch. decode_pool() waits for it.
        self._starting: dict[str, Any] = {}
        if self.decode_processes > 0 and cfg.ingest == "stream":
            self._starting["thread"] = threading.Thread(target=self._start_pool, name="raymill-decode-start",
                                                        daemon=True)
            self._starting["thread"].start()

    def _start_pool(self) -> None:
        try:
            self._starting["pool"] = DecodePool(self.decode_processes, self.cfg.batch_size, self.size,
                                                self.cfg.prefetch_batches + 1,
                                                keep_plain=self.cfg.decoded_tier != "off")
        except BaseException as e:  # raised where the pool is first used, in the loop's thread
            self._starting["error"] = e

    def use_threads(self, phase: str) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads[phase])

    def train_batches(self, epoch: int, start_step: int):
        """Batches of (key, label, image) for steps start_step..steps-1 of `epoch` on this rank."""
        return streaming.epoch_batches(self.refs["train"], self.open_rows, self.seed, epoch, self.rank, self.world,
                                       self.cfg.batch_size, self.cfg.shuffle_buffer_rows, start_step, self.steps)

    def spec(self, epoch: int, train: bool) -> DecodeSpec:
        """The training transform of `epoch`, or the eval transform (decode only)."""
        a = self.cfg.augment
        if not train:
            return DecodeSpec(self.size, self.raw)
        return DecodeSpec(self.size, self.raw, self.seed, epoch, True, a.scale_min, a.random_resized_crop,
                          a.flip, keep_plain=self.tier is not None and epoch == 0)

    def make_tier(self) -> decoded_tier.DecodedTier | None:
        """This rank's decoded tier when train.decoded_tier asks for one and it fits: its rows are
        the ones this rank reads in the first epoch (capped by max_steps)."""
        if self.cfg.decoded_tier == "off" or self.cfg.ingest != "stream":
            return None
        rows = min(streaming.batch_sizes_at(0, self.total, self.world, self.total)[self.rank],
                   self.steps * self.cfg.batch_size)
        where = decoded_tier.place(self.cfg.decoded_tier, rows, self.size, self.device,
                                   self.cfg.decoded_tier_gpu_share, self.cfg.decoded_tier_host_gb)
        if where is None:
            return None
        if self.rank == 0:
            log.info("train: decoded tier in %s memory, %d images (%.2f GB) per worker", where, rows,
                     rows * self.size * self.size * 3 / 1e9)
        return decoded_tier.DecodedTier(rows, self.size, where, self.device)

    def fill_tier(self) -> None:
        """Decode this rank's first-epoch rows into the tier (a worker that restarted after the
        first epoch has an empty one): the eval transform, in the pool."""
        started, position = time.perf_counter(), 0
        feed = self.feed(self.train_batches(0, 0), self.spec(0, train=False))
        try:
            for fed in feed:
                self.tier.put(position, fed.rows, np.asarray(fed.images))
                position += len(fed.rows)
        finally:
            feed.close()
        if self.rank == 0:
            log.info("train: decoded tier filled in %.1f s", time.perf_counter() - started)

    def feed(self, batches, spec: DecodeSpec):
        """`batches` decoded by this worker's pool, or by threads when it has none."""
        if self.decode_pool():
            return feeds.PoolFeed(self.pool, batches, spec)
        return feeds.ThreadFeed(batches, spec, self.cfg.decode_threads, self.cfg.prefetch_batches)

    def decode_pool(self) -> DecodePool | None:
        """This worker's decode processes (started with the worker, waited for here), kept for every epoch."""
        if self.pool is None and self.decode_processes > 0:
            if "thread" not in self._starting:  # not started with the worker (ray_data ingest): start it now
                self._starting["thread"] = threading.Thread(target=self._start_pool, daemon=True)
                self._starting["thread"].start()
            self._starting.pop("thread").join()
            if "error" in self._starting:
                raise self._starting.pop("error")
            self.pool = self._starting.pop("pool")
            if self.rank == 0:
                # a Train worker's line: its handler adds no "[raymill]"
                log.info("[raymill] train: %d decode process(es) per worker, started in %.2f s",
                         self.decode_processes, self.pool.start_s)
        return self.pool

    def train_feed(self, epoch: int, start_step: int):
        """This epoch's feed (stages.feed.feeds): the decoded tier, this worker's own reader decoded in
        processes (or threads), or its Ray Data shard."""
        if self.warm is not None:
            return self.warm.epoch(epoch)
        if self.tier is not None and epoch > 0:
            if not self.tier.ready:
                self.fill_tier()
            self.use_threads("tier")
            return self.tier.feed(self.seed, epoch, self.rank, self.cfg.batch_size, start_step, self.steps,
                                  self.cfg.augment.model_dump())
        self.use_threads("decode")
        return self.feed(self.train_batches(epoch, start_step), self.spec(epoch, train=True))

    def eval_feed(self, split: str):
        """`split` in stored order, this rank's contiguous share, decoded for evaluation. The first
        pass's pixels are kept in memory (up to EVAL_KEEP_BYTES) and replayed by later ones: the
        demo's val split was decoded again every epoch, 0.12 s an epoch on 2 cores."""
        self.use_threads("decode")
        if split in self._eval_kept:
            return feeds.ListFeed(self._eval_kept[split])
        pieces = streaming.rank_pieces(self.refs[split], self.seed, 0, self.rank, self.world, shuffle=False)
        stream = streaming.iter_samples(pieces, self.open_rows, self.seed, 0, self.rank, 1, shuffle=False)
        batches = iter(lambda: list(itertools.islice(stream, self.cfg.batch_size)), [])
        budget = EVAL_KEEP_BYTES - sum(f.images.nbytes for kept in self._eval_kept.values() for f in kept)
        return feeds.KeptFeed(self.feed(batches, self.spec(0, train=False)), budget,
                              lambda kept: self._eval_kept.__setitem__(split, kept))

    def keep(self, epoch: int, step: int, fed: feeds.FedBatch) -> None:
        """Keep a first-epoch batch's pre-augmentation pixels in the tier (its fill)."""
        if self.tier is not None and fed.plain is not None and epoch == 0:
            self.tier.put(step * self.cfg.batch_size, fed.rows, fed.plain)

    def close(self) -> None:
        if "thread" in self._starting:  # closed before its first batch: the pool still ends
            self._starting.pop("thread").join()
            self.pool = self._starting.pop("pool", None)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
