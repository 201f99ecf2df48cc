"""The per-worker training function run by Ray Train (one process per DDP rank).

Exactly-once data across restarts: the checkpoint stores (epoch, step) plus each rank's ledger
of consumed keys; the sample stream is a pure function of (seed, epoch, rank, world), so a
restarted worker rebuilds it and skips what the checkpoint already covers.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from stages import streaming
from stages.checkpoint_io import load_plain, read_meta, rng_state, set_rng_state
from stages import ingest_ray
from stages.models import build_model
from stages.predict import to_batch
from workflow.core import console, tracking
from workflow.core.config import ConfigError, TrainConfig

__all__ = ["train_loop", "precision_plan", "stall_verdict", "to_batch", "make_schedule"]

log = logging.getLogger(__name__)


def precision_plan(precision: str, device_type: str) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None, use GradScaler). fp16 needs loss scaling; bf16 does not."""
    if precision == "fp32":
        return None, False
    if precision == "bf16":
        return torch.bfloat16, False
    if device_type != "cuda":
        raise ConfigError("train.precision=fp16 needs a GPU (train.use_gpu=true); use bf16 on CPU")
    return torch.float16, True


def stall_verdict(wait_s: float, compute_s: float, ingest: str = "stream") -> tuple[float, str]:
    """Input-stall fraction and a one-phrase verdict with the likely fix, for either ingest path."""
    stall = wait_s / max(wait_s + compute_s, 1e-9)
    if stall > 0.2 and ingest == "ray_data":
        return stall, ("input-bound: Ray Data is the weakest link; add CPU nodes or raise "
                       "ray.data_reserved_cpus, cache decoded images (train.object_store_cache=true) "
                       "or store decoded (etl.parquet_encoding=raw)")
    if stall > 0.2:
        return stall, ("input-bound: add ingest CPUs (train.decode_threads, train.cpus_per_worker), "
                       "store decoded (etl.parquet_encoding=raw), raise train.prefetch_batches, or "
                       "decode on CPU nodes with train.ingest=ray_data")
    if ingest == "ray_data":
        return stall, "compute-bound: compute is the weakest link, Ray Data keeps up"
    return stall, "compute-bound: the accelerator (or CPU) is the weakest link, input keeps up"


def make_schedule(optimizer, warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _optimizer(cfg: TrainConfig, model: torch.nn.Module):
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, nesterov=cfg.momentum > 0)


class Worker:
    """State of one rank: model, optimiser, data position, ledger and timing counters."""

    def __init__(self, config: dict[str, Any]):
        import ray
        import ray.train
        import ray.train.torch

        self.cfg = TrainConfig(**config["train"])
        self.seed, self.classes, self.size = config["seed"], config["classes"], config["image_size"]
        self.raw = config["raw"]
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.nodes = self.gather(ray.get_runtime_context().get_node_id())  # placement, for the report
        # One token per attempt (rank 0's) in every checkpoint name: after an elastic restart the
        # step restarts at 0, and a reused name let Ray's num_to_keep delete, by path, a folder a
        # newer checkpoint shared; deleting it again crashed Train's controller.
        self.attempt = self.gather(os.urandom(4).hex())[0]
        torch.manual_seed(self.seed)  # identical init everywhere; DDP also broadcasts rank 0's
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, int(config.get("cpus_per_worker", 1) + 0.5)))
        model = build_model(self.cfg.model, len(self.classes), self.cfg.width, self.cfg.dropout)
        if self.cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = ray.train.torch.prepare_model(model)
        self.optimizer = _optimizer(self.cfg, self.model)
        self.refs = {split: [streaming.ShardRef(**r) for r in refs] for split, refs in config["shards"].items()}
        self.total = sum(r.rows for r in self.refs["train"])
        if self.cfg.ingest == "ray_data":  # streaming_split(equal=True) evens out the ranks
            self.total = ingest_ray.equal_rows(self.total, self.world)
        self.steps = streaming.steps_per_epoch(self.total, self.world, self.cfg.batch_size)
        if self.cfg.max_steps:
            self.steps = min(self.steps, self.cfg.max_steps)
        self.schedule = make_schedule(self.optimizer, int(self.cfg.warmup_epochs * self.steps),
                                      self.cfg.epochs * self.steps)
        self.autocast_dtype, use_scaler = precision_plan(self.cfg.precision, self.device.type)
        self.scaler = torch.amp.GradScaler(self.device.type) if use_scaler else None
        self.cache = streaming.ShardCache(self.cfg.cache_dir, self.cfg.cache_max_gb * 1e9, config["s3"])
        self.epoch, self.step, self.history, self.ledger = 0, 0, [], {}
        self.val = {"val_loss": float("nan"), "val_acc": -1.0}
        self.fingerprint = config.get("fingerprint")  # what made this run; checkpoints carry it

    def gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        values: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        return values

    @property
    def net(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)

    def open_rows(self, ref: streaming.ShardRef) -> list:
        return streaming.read_shard(self.cache.local_path(ref), ref.format)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def batch(self, arrays) -> torch.Tensor:
        a = self.cfg.augment
        return to_batch(arrays, a.mean, a.std, self.device, self.cfg.channels_last, self.cfg.pin_memory)

    # ---- data -------------------------------------------------------------------------------
    def train_batches(self, epoch: int, start_step: int):
        """Batches of (key, label, image) for steps start_step..steps-1 of `epoch` on this rank."""
        return streaming.epoch_batches(self.refs["train"], self.open_rows, self.seed, epoch, self.rank, self.world,
                                       self.cfg.batch_size, self.cfg.shuffle_buffer_rows, start_step, self.steps)

    def decode_train(self, epoch: int):
        a = self.cfg.augment
        return streaming.train_decoder(self.seed, epoch, self.size, self.raw, a.scale_min, a.random_resized_crop,
                                       a.flip)

    def batch_source(self, epoch: int, start_step: int):
        """This epoch's (batch, arrays) pairs: this worker's own reader, or its Ray Data shard."""
        if self.cfg.ingest == "ray_data":
            import ray.train

            return ingest_ray.ShardBatches(ray.train.get_dataset_shard("train"), self.cfg, self.seed,
                                           epoch, self.rank)
        return streaming.Prefetcher(self.train_batches(epoch, start_step), self.decode_train(epoch),
                             self.cfg.decode_threads, self.cfg.prefetch_batches)

    # ---- steps ------------------------------------------------------------------------------
    def train_epoch(self, epoch: int, start_step: int) -> dict[str, float] | None:
        """Run the rest of `epoch`; returns epoch metrics, or None if the loss went non-finite."""
        self.model.train()
        prefetch = self.batch_source(epoch, start_step)
        compute_s, loss_sum, correct, seen, started = 0.0, 0.0, 0, 0, time.perf_counter()
        self.report_s = 0.0
        for step, (batch, arrays) in enumerate(prefetch, start=start_step):
            t0 = time.perf_counter()
            x = self.batch(arrays)
            y = torch.tensor([s[1] for s in batch], dtype=torch.long, device=self.device)
            global_rows = sum(streaming.batch_sizes_at(step, self.total, self.world, self.cfg.batch_size))
            with self.autocast():
                logits = self.model(x)
                summed = F.cross_entropy(logits.float(), y, reduction="sum",
                                         label_smoothing=self.cfg.label_smoothing)
            # DDP averages gradients over ranks; scaling by world/global_rows makes the result the
            # exact mean over the global batch, even when ranks hold unequal (or empty) batches.
            loss = summed * self.world / max(1, global_rows)
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                self.optimizer.step()
            self.schedule.step()
            if not self.all_finite(summed):
                return None
            compute_s += time.perf_counter() - t0
            loss_sum += float(summed.detach())
            correct += int((logits.argmax(1) == y).sum())
            seen += len(batch)
            self.step = step + 1
            if self.cfg.ledger:
                self.ledger.setdefault(str(epoch), []).extend(s[0] for s in batch)
            every = self.cfg.checkpoint_every_steps
            if every and self.step % every == 0 and self.step < self.steps:
                t1 = time.perf_counter()
                self.report(epoch, self.step, self.partial_metrics(epoch, prefetch.wait_s, compute_s, seen))
                self.report_s += time.perf_counter() - t1
        totals = self.all_sum([loss_sum, correct, seen, prefetch.wait_s, compute_s])
        elapsed = time.perf_counter() - started - self.report_s  # checkpoint I/O is not training
        stall, verdict = stall_verdict(totals[3] / self.world, totals[4] / self.world, self.cfg.ingest)
        return {**(prefetch.stats() if self.cfg.ingest == "ray_data" else {}),"train_loss": totals[0] / max(1, totals[2]), "train_acc": totals[1] / max(1, totals[2]),
                "images_per_s": totals[2] / max(elapsed, 1e-9), "wait_s": totals[3] / self.world,
                "compute_s": totals[4] / self.world, "stall_fraction": stall, "verdict": verdict,
                "lr": self.optimizer.param_groups[0]["lr"]}

    def partial_metrics(self, epoch, wait_s, compute_s, seen) -> dict[str, Any]:
        stall, verdict = stall_verdict(wait_s, compute_s, self.cfg.ingest)
        # val_acc -1: mid-epoch checkpoints never outrank epoch-end ones for "best" retention.
        return {"epoch": epoch, "samples_seen": seen, "stall_fraction": stall, "verdict": verdict,
                "val_acc": -1.0}

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def all_finite(self, loss: torch.Tensor) -> bool:
        bad = 0.0 if bool(torch.isfinite(loss.detach())) else 1.0
        return self.all_sum([bad])[0] == 0

    @torch.no_grad()
    def evaluate(self, split: str) -> dict[str, float]:
        # The unwrapped module: DDP's forward broadcasts buffers, a collective that would hang
        # when ranks hold different numbers of eval batches.
        self.model.eval()
        pieces = streaming.rank_pieces(self.refs[split], self.seed, 0, self.rank, self.world, shuffle=False)
        stream = streaming.iter_samples(pieces, self.open_rows, self.seed, 0, self.rank, 1, shuffle=False)
        loss_sum, correct, seen = 0.0, 0, 0
        while batch := list(itertools.islice(stream, self.cfg.batch_size)):
            x = self.batch([streaming.decode_sample(s[2], self.size, self.raw) for s in batch])
            y = torch.tensor([s[1] for s in batch], dtype=torch.long, device=self.device)
            with self.autocast():
                logits = self.net(x).float()
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
            seen += len(batch)
        loss_sum, correct, seen = self.all_sum([loss_sum, correct, seen])
        return {f"{split}_loss": loss_sum / max(1, seen), f"{split}_acc": correct / max(1, seen)}

    # ---- checkpoints ------------------------------------------------------------------------
    def report(self, epoch: int, step: int, metrics: dict[str, Any]) -> None:
        """Checkpoint position (epoch, step) and report; a barrier every rank reaches together."""
        import ray.train

        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            if self.rank == 0:
                torch.save({"model": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
                            "schedule": self.schedule.state_dict(),
                            "scaler": self.scaler.state_dict() if self.scaler else None},
                           folder / "state.pt")
            torch.save(rng_state(self.device), folder / f"rng-rank{self.rank}.pt")
            (folder / f"ledger-rank{self.rank}.json").write_text(json.dumps(self.ledger))
            if self.rank == 0:  # written last: a checkpoint without meta.json is incomplete
                meta = {"epoch": epoch, "step": step, "world": self.world, "history": self.history,
                        "val": self.val, "fingerprint": self.fingerprint}
                (folder / "meta.json").write_text(json.dumps(meta))
            metrics = {**self.val, **metrics, "position_epoch": epoch, "position_step": step}
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=f"checkpoint-e{epoch:03d}-s{step:06d}-{self.attempt}")

    def restore(self) -> None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return
        with checkpoint.as_directory() as tmp:
            folder = Path(tmp)
            # Fingerprint first: a foreign checkpoint's files are never even loaded.
            meta = read_meta(folder, checkpoint.path, self.fingerprint)
            same_world = meta["world"] == self.world
            state = load_plain(folder / "state.pt", map_location=self.device)
            self.net.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.schedule.load_state_dict(state["schedule"])
            if self.scaler and state["scaler"]:
                self.scaler.load_state_dict(state["scaler"])
            self.epoch, self.history, self.val = meta["epoch"], meta["history"], meta["val"]
            if same_world:
                set_rng_state(load_plain(folder / f"rng-rank{self.rank}.pt"), self.device)
                self.ledger = json.loads((folder / f"ledger-rank{self.rank}.json").read_text())
                self.step = meta["step"]
            else:
                # Elastic restart with another world size: rank row ranges move, so the exact
                # position can't carry over. Restart the epoch; the weights and optimizer do.
                self.step = 0
                self.ledger = {}
                if self.rank == 0:
                    log.info(f"train: world size changed {meta['world']} -> {self.world}; "
                          f"epoch {self.epoch + 1} restarts from its first step")
        if self.rank == 0:
            log.info(f"train: resumed from {checkpoint.path} at epoch {self.epoch} step {self.step}")


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train entry point: resume if a checkpoint exists, then train the remaining epochs."""
    console.quiet_train_worker()
    w = Worker(config)
    w.restore()
    for epoch in range(w.epoch, w.cfg.epochs):
        # ray_data resume is epoch-granular: the interrupted epoch restarts from its first batch
        start = w.step if epoch == w.epoch and w.cfg.ingest == "stream" else 0
        if start >= w.steps:
            continue
        metrics = w.train_epoch(epoch, start)
        if metrics is None:
            import ray.train

            ray.train.report({"stopped": "nan_loss", "epoch": epoch, "step": w.step, **w.val})
            return
        w.val = w.evaluate("val")
        # cache counters after validation, so each epoch's row covers all of its reads
        row = {"epoch": epoch + 1, **metrics, **w.val, "cache_hits": w.cache.hits,
               "cache_misses": w.cache.misses, "worker_nodes": w.nodes}
        if w.cfg.ledger:  # counted, not hidden: ray_data repeats rows of an interrupted epoch
            keys = [k for part in w.gather(w.ledger.get(str(epoch), [])) for k in part]
            row["ledger_duplicates"] = len(keys) - len(set(keys))
        w.history.append(row)
        if w.rank == 0:
            console.epoch(row, w.cfg.epochs)
            tracking.log_epoch(config.get("tracking"), row)
        w.epoch, w.step = epoch + 1, 0
        w.report(epoch + 1, 0, row)
