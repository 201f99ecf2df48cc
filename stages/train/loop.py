"""The per-worker training function run by Ray Train (one process per DDP rank).

Exactly-once data across restarts: the checkpoint stores (epoch, step) plus each rank's ledger
of consumed keys; the sample stream is a pure function of (seed, epoch, rank, world), so a
restarted worker rebuilds it and skips what the checkpoint already covers.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

from stages.feed import feeds, meters, streaming
from stages.feed.worker_feeds import WorkerFeeds
from stages.feed import ray_data as ingest_ray
from stages.model.zoo import build_model
from stages.model.predict import to_batch
from stages.train import checkpointing, finetune
from stages.train.run_hooks import TrainHooks
from stages.common import console
from stages.common.config import ConfigError, TrainConfig

__all__ = ["train_loop", "precision_plan", "to_batch", "make_schedule"]

log = logging.getLogger(__name__)


def precision_plan(precision: str, device_type: str) -> tuple[torch.dtype | None, bool]:
    """(autocast dtype or None, use GradScaler). fp16 needs loss scaling; bf16 does not.

    auto: bf16 where the device runs it natively (a CUDA GPU that supports it), else fp32.
    """
    if precision == "auto":
        fast = device_type == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16" if fast else "fp32"
    if precision == "fp32":
        return None, False
    if precision == "bf16":
        return torch.bfloat16, False
    if device_type != "cuda":
        raise ConfigError("train.precision=fp16 needs a GPU (train.use_gpu=true); use bf16 on CPU")
    return torch.float16, True


def make_schedule(optimizer, warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Worker:
    """State of one rank: model, optimiser, data position, ledger and timing counters."""

    def __init__(self, config: dict[str, Any], hooks):
        import ray

        self.cfg, self.hooks = TrainConfig(**config["train"]), hooks
        self.seed, self.classes, self.size = config["seed"], config["classes"], config["image_size"]
        self.raw, self.free_cpus = config["raw"], config.get("free_cpus")
        self.rank, self.world, self.device = hooks.rank, hooks.world, hooks.device
        # trial start (the Tune function's first line, time.time()) -> first batch: a trial's start-up
        self.started_at, self.first_batch_at = config.get("started_at"), None
        self.nodes = self.gather(ray.get_runtime_context().get_node_id())  # placement, for the report
        # One token per attempt (rank 0's) in every checkpoint name: after an elastic restart the
        # step restarts at 0, and a reused name let Ray's num_to_keep delete, by path, a folder a
        # newer checkpoint shared; deleting it again crashed Train's controller.
        self.attempt = self.gather(os.urandom(4).hex())[0]
        torch.manual_seed(self.seed)  # identical init everywhere; DDP also broadcasts rank 0's
        torch.set_num_threads(config.get("torch_threads", 1))  # the plan's, GPU workers too
        # unset: on, for GPUs (the measured default) and CPUs alike (small_cnn at 224 px on
        # the 2-core box: step 1.45 -> 1.21 ms an image, to_batch 0.50 -> 0.25)
        self.channels_last = True if self.cfg.channels_last is None else self.cfg.channels_last
        self.refs = {split: [streaming.ShardRef(**r) for r in refs] for split, refs in config["shards"].items()}
        self.total = sum(r.rows for r in self.refs["train"])
        if self.cfg.ingest == "ray_data":  # streaming_split(equal=True) evens out the ranks
            self.total = ingest_ray.equal_rows(self.total, self.world)
        self.steps = streaming.steps_per_epoch(self.total, self.world, self.cfg.batch_size)
        if self.cfg.max_steps:
            self.steps = min(self.steps, self.cfg.max_steps)
        self.cache = streaming.ShardCache(self.cfg.cache_dir, self.cfg.cache_max_gb * 1e9, config["s3"])
        self.epoch, self.step, self.history, self.ledger = 0, 0, [], {}
        self.carried: dict[str, Any] | None = None  # this rank's sums so far in a mid-epoch checkpoint
        self.val = {"val_loss": float("nan"), "val_acc": -1.0}
        # Before the model: the decode pool's processes start beside DDP's wrap (torch._dynamo's import, ~1 s)
        self.input = WorkerFeeds(self.cfg, config, self.rank, self.world, self.device, self.refs, self.total,
                                 self.steps, self.open_rows, fresh=hooks.get_checkpoint() is None)
        try:
            self.build_model(config)
        except BaseException:  # the pool's processes end with the worker that failed to start
            self.input.close()
            raise
        self.model_at = time.time()  # the stage's timings split the worker's set-up here
        self.fingerprint = config.get("fingerprint")  # what made this run; checkpoints carry it
        self.rank_metric = config.get("rank_metric", "val_acc")  # what picks the published checkpoint
        self.attempt_marks: dict[str, Any] | None = None  # set by train_loop; the attempt's first row carries them

    def build_model(self, config: dict[str, Any]) -> None:
        """Model (init weights, DDP), optimiser, schedule and precision of this rank."""
        shape = (self.cfg.model, len(self.classes), self.cfg.width, self.cfg.dropout, self.seed, self.channels_last)
        model = self.hooks.build(shape, self.new_model)
        finetune.load_init(model, config.get("init"), self.cfg.model)  # before DDP; a checkpoint restores over it
        self.model = self.hooks.prepare_model(model)
        self.optimizer = finetune.optimizer(self.cfg, self.net)  # one group, or head + backbone
        self.backbone, self.frozen = finetune.backbone_params(self.net, self.cfg.model), False
        self.schedule = make_schedule(self.optimizer, int(self.cfg.warmup_epochs * self.steps),
                                      self.cfg.epochs * self.steps)
        self.autocast_dtype, use_scaler = precision_plan(self.cfg.precision, self.device.type)
        self.scaler = torch.amp.GradScaler(self.device.type) if use_scaler else None

    def new_model(self) -> torch.nn.Module:
        model = build_model(self.cfg.model, len(self.classes), self.cfg.width, self.cfg.dropout)
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

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
        return to_batch(arrays, a.mean, a.std, self.device, self.channels_last, self.cfg.pin_memory)

    # ---- steps ------------------------------------------------------------------------------
    def train_epoch(self, epoch: int, start_step: int) -> dict[str, float] | None:
        """Run the rest of `epoch`; returns epoch metrics, or None if the loss went non-finite."""
        self.model.train()
        self.frozen = finetune.frozen(self.cfg, epoch)  # train.freeze_epochs: the head only
        if self.frozen:
            finetune.freeze_norms(self.net, self.cfg.model)
        feed, meter = self.input.train_feed(epoch, start_step), meters.StepMeter(self.device)
        # loss and correct stay on the device: a float()/int() per step would sync the GPU. A run
        # resumed mid-epoch starts from the sums its checkpoint carried: the row covers the epoch.
        carried = self.carried if self.carried and self.carried["epoch"] == epoch and start_step else {}
        sums = torch.tensor([carried.get("loss_sum", 0.0), carried.get("correct", 0.0)], dtype=torch.float64,
                            device=self.device)
        seen, started, self.report_s = 0, time.perf_counter(), 0.0
        try:
            for step, fed in enumerate(feed, start=start_step):
                if self.first_batch_at is None:
                    self.first_batch_at = time.time()
                meter.start()
                self.step_once(fed, step, sums)
                meter.stop()
                self.input.keep(epoch, step, fed)
                seen += len(fed.rows)
                self.step = step + 1
                if self.cfg.ledger:
                    self.ledger.setdefault(str(epoch), []).extend(s[0] for s in fed.rows)
                every = self.cfg.checkpoint_every_steps
                if every and self.step % every == 0 and self.step < self.steps:
                    if not self.all_finite(sums):
                        return None
                    t1 = time.perf_counter()
                    self.carried = {"epoch": epoch, "loss_sum": float(sums[0]), "correct": float(sums[1]),
                                    "seen": carried.get("seen", 0) + seen}
                    self.report(epoch, self.step, {"epoch": epoch, "samples_seen": seen, "val_acc": -1.0})
                    self.report_s += time.perf_counter() - t1
        finally:
            feed.close()
        if not self.all_finite(sums):
            return None
        wall = time.perf_counter() - started - self.report_s  # checkpoint I/O is not training
        self.carried = None  # the epoch is done: its end-of-epoch checkpoint carries no sums
        return self.epoch_metrics(feed, meter, sums, seen, wall, carried.get("seen", 0))

    def step_once(self, fed: feeds.FedBatch, step: int, sums: torch.Tensor) -> None:
        """One optimiser step on `fed`; adds its summed loss and correct count to `sums`."""
        x = self.batch(fed.images)
        y = torch.tensor([s[1] for s in fed.rows], dtype=torch.long).to(self.device, non_blocking=True)
        global_rows = sum(streaming.batch_sizes_at(step, self.total, self.world, self.cfg.batch_size))
        with self.autocast():
            logits = self.model(x)
            summed = F.cross_entropy(logits.float(), y, reduction="sum",
                                     label_smoothing=self.cfg.label_smoothing)
        # DDP averages gradients over ranks; scaling by world/global_rows makes the result the
        # exact mean over the global batch, even when ranks hold unequal (or empty) batches.
        loss = summed * self.world / max(1, global_rows)
        self.optimizer.zero_grad(set_to_none=True)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.frozen:  # no gradient: the step leaves the backbone bit-identical (stages.train.finetune)
            finetune.drop_grads(self.backbone)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.schedule.step()
        with torch.no_grad():  # a non-finite loss makes sums[0] non-finite: checked per report
            sums[0] += summed.detach().double()
            sums[1] += (logits.argmax(1) == y).sum()

    def epoch_metrics(self, feed, meter: meters.StepMeter, sums: torch.Tensor, seen: int,
                      wall: float, carried_seen: int = 0) -> dict[str, Any]:
        """The epoch's row: rates, the three clocks (stages.feed.meters) and the verdict, over all ranks.
        Loss and accuracy count the rows a resumed epoch carried; rates only this attempt's."""
        loss_sum, correct = sums.tolist()
        waits = ingest_ray.waits(feed)  # Ray Data's: its wait's parts, summed over ranks like the rest
        totals = self.all_sum([loss_sum, correct, seen, feed.wait_s, meter.busy_s(), wall, carried_seen, *waits])
        per_rank = [v / self.world for v in totals[2:6]]
        times, capacity = meters.EpochTimes(int(per_rank[0]), *per_rank[1:]), feed.capacity()
        device = "GPU" if self.device.type == "cuda" else "CPU"
        rows = max(1, totals[2] + totals[6])
        row = {"train_loss": totals[0] / rows, "train_acc": totals[1] / rows,
               "images_per_s": totals[2] / max(wall, 1e-9), "wait_s": times.wait_s,
               "compute_s": times.busy_s, "wall_s": times.wall_s, "stall_fraction": times.stall,
               "local_wall_s": wall,  # this rank's own (rank 0's in the published history): train.timings
               "device_utilisation": times.utilisation, "device_images_per_s": times.device_images_per_s,
               "tier": getattr(feed, "tier", self.cfg.ingest),
               "verdict": meters.verdict(times, device, self.cfg.ingest, capacity, getattr(feed, "tier", None),
                                         self.world, ingest_ray.judged_waits(totals[7:], self.world, self.cfg),
                                         self.free_cpus),
               "lr": self.optimizer.param_groups[0]["lr"]}
        if capacity:
            row["decode_images_per_s"] = capacity["images_per_s"]
        return {**(feed.stats() if self.cfg.ingest == "ray_data" else {}), **row}

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def all_finite(self, sums: torch.Tensor) -> bool:
        bad = 0.0 if bool(torch.isfinite(sums[0])) else 1.0
        return self.all_sum([bad])[0] == 0

    @torch.no_grad()
    def evaluate(self, split: str) -> dict[str, float]:
        """Loss and accuracy over `split`, sharded across the ranks and summed: on their device,
        decoded by their pool. The unwrapped module: DDP's forward broadcasts buffers, a
        collective that would hang when ranks hold different numbers of eval batches."""
        self.model.eval()
        feed = self.input.eval_feed(split)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        try:
            for fed in feed:
                x = self.batch(fed.images)
                y = torch.tensor([s[1] for s in fed.rows], dtype=torch.long).to(self.device, non_blocking=True)
                with self.autocast():
                    logits = self.net(x).float()
                sums += torch.stack([F.cross_entropy(logits, y, reduction="sum").double(),
                                     (logits.argmax(1) == y).sum().double(),
                                     torch.tensor(float(len(fed.rows)), dtype=torch.float64, device=self.device)])
        finally:
            feed.close()
        loss_sum, correct, seen = self.all_sum(sums.tolist())
        return {f"{split}_loss": loss_sum / max(1, seen), f"{split}_acc": correct / max(1, seen),
                f"{split}_rows": int(seen)}

    # ---- checkpoints ------------------------------------------------------------------------
    def report(self, epoch: int, step: int, metrics: dict[str, Any]) -> None:
        checkpointing.save(self, epoch, step, metrics)

    def restore(self) -> bool:
        return checkpointing.restore(self)

    def apply_hyperparameters(self) -> None:
        """This run's lr, momentum and weight decay over a loaded optimiser and schedule (PBT's
        explored values win over the donor's; stages.train.finetune.apply_hyperparameters)."""
        finetune.apply_hyperparameters(self.cfg, self.optimizer, self.schedule)

    def startup(self) -> dict[str, float]:
        """Seconds from trial start to its first batch, for the first epoch report of a trial."""
        if self.started_at is None or self.first_batch_at is None:
            return {}
        startup = {"startup_s": round(self.first_batch_at - self.started_at, 3),
                   "first_batch_at": self.first_batch_at}
        self.started_at = None  # reported once per trial attempt
        return startup


def train_loop(config: dict[str, Any], hooks=None) -> None:
    """The training loop: resume if a checkpoint exists, then train the remaining epochs.

    `hooks` (stages.train.run_hooks) say where it reports and restores: a Ray Train rank (the default)
    or a one-worker Tune trial."""
    loop_at = time.time()  # this attempt's start on the worker: the stage's timings split Ray's start from ours
    console.quiet_train_worker()
    w = Worker(config, hooks or TrainHooks())
    try:
        # the attempt's first row says when its train function started, and whether it resumed
        # (the rows before it are an earlier attempt's: stages.train.timings splits no such run)
        marks = {"loop_at": loop_at, "model_at": w.model_at, "resumed": w.restore(), "ready_at": time.time()}
        w.attempt_marks = {k: v for k, v in marks.items() if v is not False}  # "resumed" only when it did
        _epochs(w, config)
    finally:  # the decode processes end with the loop, whether it returns or raises
        w.input.close()


def _epochs(w: Worker, config: dict[str, Any]) -> None:
    for epoch in range(w.epoch, w.cfg.epochs):
        # ray_data resume is epoch-granular: the interrupted epoch restarts from its first batch
        start = w.step if epoch == w.epoch and w.cfg.ingest == "stream" else 0
        if start >= w.steps:
            continue
        metrics = w.train_epoch(epoch, start)
        evaluated = time.perf_counter()
        val = w.evaluate("val") if metrics is not None else None
        # a finite training loss can still leave NaN weights (the epoch's last steps): a val loss
        # that is not finite stops the run too, before this epoch's checkpoint can be the best
        if metrics is None or not math.isfinite(val["val_loss"]):
            w.hooks.report({"stopped": "nan_loss", "epoch": epoch, "step": w.step, **w.val}, None)
            return
        w.val = val
        row = {"epoch": epoch + 1, **metrics, **w.val, "eval_s": time.perf_counter() - evaluated,
               "report_s": w.report_s, **w.startup()}  # report_s: its mid-epoch checkpoints
        # The test split is scored here, in the workers on their device, whenever this epoch's
        # checkpoint may be the one published (the best of the metric that picks it so far, ties
        # included: val_acc, or a search's val_loss): publish then reads test_acc from the best
        # checkpoint's metrics instead of re-scoring on the driver.
        if w.rank_metric == "val_loss":
            best = w.val["val_loss"] <= min((h["val_loss"] for h in w.history), default=math.inf)
        else:
            best = w.val["val_acc"] >= max((h["val_acc"] for h in w.history), default=-1.0)
        if best:
            started = time.perf_counter()
            row.update(w.evaluate("test"), test_seconds=time.perf_counter() - started)
        # cache counters after evaluation, so each epoch's row covers all of its reads
        row.update(cache_hits=w.cache.hits, cache_misses=w.cache.misses, worker_nodes=w.nodes)
        if w.cfg.ledger:  # counted, not hidden: ray_data repeats rows of an interrupted epoch
            keys = [k for part in w.gather(w.ledger.get(str(epoch), [])) for k in part]
            row["ledger_duplicates"] = len(keys) - len(set(keys))
        w.history.append(row)
        row.update(w.attempt_marks or {})
        w.attempt_marks = None
        row["at"] = time.time()  # before this epoch's report: the stage's timings (train.timings)
        if w.rank == 0:  # its MLflow points: the driver logs them from the checkpoint (train.epoch_log)
            console.epoch(row, w.cfg.epochs)
        w.epoch, w.step = epoch + 1, 0
        w.report(epoch + 1, 0, row)
