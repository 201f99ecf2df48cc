"""The functions Ray Data's tasks run for train.ingest=ray_data: read rows -> decoded, augmented pixels.

They live apart from stages.feed.ray_data, which imports torch (the feed's batches, the meters):
Ray pickles a map function by its module, so each new task worker imported that module, and torch
with it, before its first block. Here only numpy, Pillow (stages.feed.streaming) and ray, which
the worker already holds. On 2 cores, a fresh Ray's first pass over the demo's train split took
3.7-3.9 s when its task workers also imported the old home, 1.9-2.1 s without (`python -m
benchmarks coldstart`); epoch 1 of a 4-epoch `raymill train --set train.ingest=ray_data` on the
demo took 5.1-5.6 s before this module and 2.9-3.2 s after (two commits run alternately, by hand).
"""
from __future__ import annotations

import time

import numpy as np

from stages.feed import streaming

__all__ = ["from_webdataset", "decode_batch", "augment_batch", "decode_augment_batch"]


def from_webdataset(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ray's WebDataset columns (__key__, cls, jpg|png) -> the parquet layout (key, label, image)."""
    images = batch["jpg"] if "jpg" in batch else batch["png"]
    return {"key": batch["__key__"], "label": np.array([int(c) for c in batch["cls"]], np.int64),
            "image": images}


def decode_batch(batch: dict[str, np.ndarray], image_size: int, raw: bool) -> dict[str, np.ndarray]:
    """Stored image bytes -> uint8 HWC pixels."""
    return _decoded(batch, np.stack([streaming.decode_sample(b, image_size, raw) for b in batch["image"]]))


def _decoded(batch: dict[str, np.ndarray], images: np.ndarray) -> dict[str, np.ndarray]:
    """The decoded batch's columns. Node id and wall time show where and when decoding ran: the
    placement test and the cache check (no decode inside a cached epoch) read them."""
    import ray  # here, not at the top: importing the train stage must not import Ray (exposure.py)

    n, node = len(images), ray.get_runtime_context().get_node_id()
    return {"key": batch["key"], "label": batch["label"].astype(np.int64), "image": images,
            "decode_node": np.array([node] * n), "decoded_at": np.full(n, time.time())}


def augment_batch(batch: dict[str, np.ndarray], scale_min: float, crop: bool,
                  flip: bool) -> dict[str, np.ndarray]:
    """The training augmentation of stages.feed.streaming.augment, per row.

    Fresh entropy, not (seed, epoch, key) as in the stream path: a Ray Data task is not told
    which epoch it serves. ray_data runs are therefore not bit-reproducible.
    """
    rng = np.random.default_rng()
    return {**batch, "image": np.stack([streaming.augment(p, rng, scale_min, crop, flip) for p in batch["image"]])}


def decode_augment_batch(batch: dict[str, np.ndarray], image_size: int, raw: bool, scale_min: float,
                         crop: bool, flip: bool) -> dict[str, np.ndarray]:
    """decode_batch then augment_batch in one call: the batch's pixels are stacked once, not twice."""
    rng = np.random.default_rng()  # fresh entropy, as augment_batch
    return _decoded(batch, np.stack([streaming.augment(streaming.decode_sample(b, image_size, raw), rng,
                                                       scale_min, crop, flip) for b in batch["image"]]))
