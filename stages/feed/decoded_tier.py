"""The decoded tier: a rank's decoded, resized, pre-augmentation training pixels kept in memory.

Why: decoding JPEGs is the input path's whole CPU cost. A data set that fits is decoded once
(during the first epoch, by the decode pool, at no extra decode cost) and later epochs augment
the kept pixels as batched tensor ops on the device (random resized crop + flip as one
`grid_sample`), so the CPUs no longer bound the rate (the seeds: keep small data on the GPU).

Semantics, stated because they differ from the stream path:
- each rank keeps the rows of its epoch-1 range (`streaming.rank_pieces` at epoch 0) and
  reshuffles them every epoch with a permutation seeded by (seed, epoch, rank): exactly-once per
  epoch holds, but rows no longer move between ranks from epoch to epoch;
- augmentation parameters come from a generator seeded by (seed, epoch, rank, step), so a
  resumed run sees the same pixels; a restarted worker refills the tier first (one decode pass).
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from stages.feed.feeds import FedBatch

__all__ = ["DecodedTier", "TierFeed", "place", "augment_batch"]

log = logging.getLogger(__name__)


def place(mode: str, rows: int, size: int, device: torch.device, gpu_share: float,
          host_gb: float) -> str | None:
    """Where a tier of `rows` images fits: "gpu", "host", or None (the reason is logged)."""
    need = rows * size * size * 3
    if mode in ("auto", "gpu") and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if need <= gpu_share * total:
            return "gpu"
        log.info("decoded tier: %.2f GiB does not fit in %.0f%% of the GPU's %.0f GiB "
                 "(train.decoded_tier_gpu_share)", need / 2**30, gpu_share * 100, total / 2**30)
    if mode in ("auto", "host") or device.type != "cuda":
        if need <= host_gb * 1e9:
            return "host"
        log.warning("decoded tier: %.2f GB exceeds train.decoded_tier_host_gb=%g; training streams "
                    "every epoch (raise the key, or shrink etl.image_size)", need / 1e9, host_gb)
    return None


def augment_batch(pixels: torch.Tensor, generator: torch.Generator, scale_min: float, crop: bool,
                  flip: bool) -> torch.Tensor:
    """Random resized crop (area in [scale_min, 1], aspect in [3/4, 4/3]) and horizontal flip of
    a uint8 NHWC batch; returns uint8 NHWC. On a GPU, one affine `grid_sample` for the batch; on
    a CPU, the same boxes in whole pixels, resized in uint8 (5x cheaper there)."""
    n = pixels.shape[0]
    if n == 0 or not (crop or flip):
        return pixels
    u = torch.rand((n, 4), generator=generator, dtype=torch.float64)  # drawn on the CPU: portable
    if crop:
        area = scale_min + (1 - scale_min) * u[:, 0]
        log_ratio = math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * u[:, 1]
        w = torch.sqrt(area * torch.exp(log_ratio)).clamp(max=1.0)
        h = torch.sqrt(area / torch.exp(log_ratio)).clamp(max=1.0)
    else:
        w = h = torch.ones(n, dtype=torch.float64)
    # crop centre in [-1, 1] coordinates, so the box stays inside the image
    cx, cy = (1 - w) * (2 * u[:, 2] - 1), (1 - h) * (2 * u[:, 3] - 1)
    sign = torch.where(torch.rand(n, generator=generator, dtype=torch.float64) < 0.5, -1.0, 1.0) if flip \
        else torch.ones(n, dtype=torch.float64)
    if pixels.device.type == "cpu":
        return _crops_on_cpu(pixels, w, h, cx, cy, sign)
    theta = torch.zeros((n, 2, 3), dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = w * sign, cx, h, cy
    x = pixels.permute(0, 3, 1, 2).float()
    theta = theta.float().pin_memory().to(x.device, non_blocking=True)  # no wait for the stream
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def _crops_on_cpu(pixels: torch.Tensor, w, h, cx, cy, sign) -> torch.Tensor:
    """The same boxes, cut in whole pixels and resized in uint8 one image at a time: on a CPU,
    uint8 bilinear `interpolate` took 0.24 ms an image at 224 px, `grid_sample` in float 1.17."""
    size = pixels.shape[1]
    out = torch.empty_like(pixels)
    for i in range(pixels.shape[0]):
        bw, bh = max(1, round(float(w[i]) * size)), max(1, round(float(h[i]) * size))
        x0 = min(size - bw, max(0, round((float(cx[i]) + 1) / 2 * size - bw / 2)))
        y0 = min(size - bh, max(0, round((float(cy[i]) + 1) / 2 * size - bh / 2)))
        box = pixels[i, y0:y0 + bh, x0:x0 + bw].permute(2, 0, 1).unsqueeze(0)
        resized = F.interpolate(box, size=(size, size), mode="bilinear", align_corners=False, antialias=False)
        out[i] = (resized.flip(-1) if sign[i] < 0 else resized)[0].permute(1, 2, 0)
    return out


class DecodedTier:
    """`rows` decoded images of one rank, indexed by their position in its epoch-1 stream."""

    def __init__(self, rows: int, size: int, where: str, device: torch.device):
        self.where, self.device = where, device
        store = device if where == "gpu" else torch.device("cpu")
        self.pixels = torch.empty((rows, size, size, 3), dtype=torch.uint8, device=store)
        if where == "host" and device.type == "cuda":
            self.pixels = self.pixels.pin_memory()  # batches copy to the GPU without staging
        self.meta: list[tuple | None] = [None] * rows
        self.filled = 0

    @property
    def ready(self) -> bool:
        return self.filled == len(self.meta)

    def put(self, position: int, rows: list[tuple], plain: np.ndarray) -> None:
        """Keep the pre-augmentation pixels of `rows`, which sit at `position`.. of the stream."""
        if not len(rows):
            return
        self.pixels[position:position + len(rows)].copy_(torch.from_numpy(plain), non_blocking=False)
        for i, row in enumerate(rows):
            if self.meta[position + i] is None:
                self.filled += 1
            self.meta[position + i] = (row[0], row[1])

    def feed(self, seed: int, epoch: int, rank: int, batch_size: int, start_step: int, steps: int,
             augment: dict[str, Any]) -> "TierFeed":
        return TierFeed(self, seed, epoch, rank, batch_size, start_step, steps, augment)

    def nbytes(self) -> int:
        return self.pixels.numel()


class TierFeed:
    """One epoch of batches from a full tier: a seeded permutation, augmented on the device."""

    def __init__(self, tier: DecodedTier, seed: int, epoch: int, rank: int, batch_size: int,
                 start_step: int, steps: int, augment: dict[str, Any]):
        self.tier_store, self.augment = tier, augment
        self.tier = f"decoded-{tier.where}"
        self.seed, self.epoch, self.rank = seed, epoch, rank
        self.batch_size, self.start_step, self.steps = batch_size, start_step, steps
        self.wait_s, self._stop = 0.0, threading.Event()
        order = torch.Generator().manual_seed(_mix(seed, epoch, rank, -1))
        self.order = torch.randperm(len(tier.meta), generator=order)
        # Indices for a GPU-held tier live on the GPU: one copy an epoch. A pageable host->GPU copy
        # per batch waits for the stream, i.e. for the last step's kernels, and shows as input wait.
        self._order_on_store = self.order.to(tier.pixels.device)

    def batches(self) -> Iterator[FedBatch]:
        a, tier = self.augment, self.tier_store
        for step in range(self.start_step, self.steps):
            rows = slice(step * self.batch_size, (step + 1) * self.batch_size)
            index = self.order[rows]
            pixels = _gather(tier, index, self._order_on_store[rows])
            generator = torch.Generator().manual_seed(_mix(self.seed, self.epoch, self.rank, step))
            images = augment_batch(pixels, generator, a["scale_min"], a["random_resized_crop"], a["flip"])
            yield FedBatch([tier.meta[i] for i in index.tolist()], images)

    def __iter__(self) -> Iterator[FedBatch]:
        """On a GPU the ops are queued on the device in the loop's thread (launching them takes
        microseconds); on a CPU they are the work itself, so a thread runs them 2 batches ahead
        (torch releases the GIL inside them) and the loop waits only when it catches up."""
        cuda = self.tier_store.device.type == "cuda"
        source = self.batches() if cuda else _ahead(self.batches(), 2, self._stop)
        while True:
            started = time.perf_counter()
            fed = next(source, None)
            self.wait_s += time.perf_counter() - started
            if fed is None:
                return
            yield fed

    def close(self) -> None:
        self._stop.set()

    def capacity(self) -> None:
        return None


def _gather(tier: DecodedTier, index: torch.Tensor, index_on_store: torch.Tensor) -> torch.Tensor:
    """The batch's kept pixels on the training device, without a host sync: a host-held tier
    bound for a GPU is gathered into pinned memory and copied asynchronously (torch's pinned
    allocator keeps the buffer until the copy is done)."""
    if tier.pixels.device.type == tier.device.type:  # "cuda:0" is not "cuda"
        return tier.pixels[index_on_store]
    # otherwise the tier is on the host and the device a GPU (DecodedTier keeps no other pairing)
    staged = torch.empty((len(index), *tier.pixels.shape[1:]), dtype=torch.uint8, pin_memory=True)
    torch.index_select(tier.pixels, 0, index, out=staged)
    return staged.to(tier.device, non_blocking=True)


def _ahead(items: Iterator[Any], depth: int, stop: threading.Event) -> Iterator[Any]:
    """`items`, produced by a background thread up to `depth` ahead; its errors re-raised here.
    Setting `stop` ends the thread (an epoch abandoned part-way leaves nothing running)."""
    out: queue.Queue = queue.Queue(maxsize=depth)

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def fill() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as e:
            put(e)
        put(StopIteration())

    threading.Thread(target=fill, daemon=True, name="raymill-tier").start()
    while not isinstance(item := out.get(), StopIteration):
        if isinstance(item, BaseException):
            raise item
        yield item


def _mix(seed: int, epoch: int, rank: int, step: int) -> int:
    """A 63-bit seed from the four numbers (torch generators take one integer)."""
    return int(np.random.SeedSequence([seed, epoch, rank, step + 1]).generate_state(2, np.uint64)[0] >> 1)
