"""Prediction with a published model: the one eval transform, batching, and accuracy over a split.

Batch inference (`stages.infer.stage`), online serving (`stages.serve.app`) and the accuracy written after
training and tuning all go through these functions, so the three can never disagree.
"""
from __future__ import annotations

import functools
import io
import json
from typing import Any

import numpy as np
import torch

from stages.feed import streaming
from stages.model.transform import preprocess  # re-exported: the eval transform, torch-free
from stages.model.zoo import from_info
from stages.common import storage
from stages.common.artifacts import (ModelNotFoundError, check_model_folder,  # noqa: F401 (re-exported)
                                     checksum_mismatch)

__all__ = ["to_batch", "load_model", "ModelNotFoundError", "preprocess", "predict_arrays", "evaluate_split"]


def to_batch(arrays, mean, std, device: torch.device, channels_last: bool,
             pin_memory: bool) -> torch.Tensor:
    """uint8 NHWC images -> normalised float NCHW on `device` (normalised there, after the copy).

    `arrays`: a list of HWC arrays, one NHWC array (a decode pool's slot: copied out here, so the
    slot is free when this returns), or a uint8 tensor already on the device (the decoded tier).
    """
    if isinstance(arrays, torch.Tensor):
        x = arrays
    elif isinstance(arrays, np.ndarray):  # Ray Data's batches are read-only views: torch needs a copy
        x = torch.from_numpy(arrays if arrays.flags.writeable else arrays.copy())
    else:
        size = arrays[0].shape[0] if arrays else 1
        x = torch.from_numpy(np.stack(arrays)) if arrays else torch.zeros((0, size, size, 3), dtype=torch.uint8)
    if pin_memory and device.type == "cuda" and x.device.type == "cpu":
        x = x.pin_memory()  # a copy: the non-blocking transfer below never reads the caller's buffer
    x = x.to(device, non_blocking=True).permute(0, 3, 1, 2)
    # (x / 255 - mean) / std as one multiply-add after the float conversion: two passes over the
    # batch instead of five (on a CPU it was 0.73 ms an image at 224 px, half of a small step).
    scale, bias = _affine(tuple(mean), tuple(std), device)
    x = torch.addcmul(bias, x.float(), scale)
    # NHWC data permuted to NCHW is already channels_last in memory; keep it or make it contiguous.
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    std_t, mean_t = torch.tensor(std, dtype=torch.float32), torch.tensor(mean, dtype=torch.float32)
    scale, bias = 1.0 / (255.0 * std_t), -mean_t / std_t
    return scale.view(1, 3, 1, 1).to(device), bias.view(1, 3, 1, 1).to(device)


def load_model(path: str, s3: Any | None = None, publishing: bool = False) -> tuple[torch.nn.Module, dict]:
    """Load an exported model folder (a train/tune output, or any folder with model.pt+model.json).
    `publishing`: the stage publishing `path` reads its model before the manifest exists."""
    if not publishing:
        check_model_folder(path, s3)  # a usage error (exit 2), as a wrong --data is
    fs, root = storage.filesystem(path, s3)
    info = json.loads(fs.cat_file(storage.join(root, "model.json")))
    data = fs.cat_file(storage.join(root, "model.pt"))
    if storage.sha256_bytes(data) != info["weights_sha256"]:
        raise checksum_mismatch(path)
    return from_info(info, torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)), info


@torch.no_grad()
def predict_arrays(model, info: dict, arrays: list[np.ndarray] | np.ndarray, top_k: int = 3,
                   device: torch.device | None = None, meter: Any = None) -> list[dict[str, Any]]:
    """Class predictions for uint8 RGB arrays of the model's input size (one dict per array).

    `model`: a torch module, or what stages.model.runtime.for_device returned for it.
    `meter` (a stages.feed.meters.StepMeter) times the forward pass alone, when given.
    """
    if len(arrays) == 0:
        return []
    device = device or torch.device("cpu")
    if isinstance(model, torch.nn.Module):
        x = to_batch(arrays, info["mean"], info["std"], device, False, False)
    else:  # stages.model.runtime.OnnxForward: uint8 pixels in, the normalisation inside its graph
        x = arrays if isinstance(arrays, np.ndarray) else np.stack(arrays)
    if meter is not None:
        meter.start()
    logits = model(x)
    if meter is not None:
        meter.stop()
    logits = logits if isinstance(logits, torch.Tensor) else torch.from_numpy(logits)
    probs = torch.softmax(logits.float(), dim=1).cpu()
    k = min(top_k, probs.shape[1])
    values, indices = probs.topk(k, dim=1)
    classes = info["classes"]
    return [{"class_index": int(idx[0]), "class_name": classes[int(idx[0])],
             "top_k": [{"class_name": classes[int(i)], "class_index": int(i), "probability": float(p)}
                       for p, i in zip(vals, idx)]} for vals, idx in zip(values, indices)]


@torch.no_grad()
def evaluate_split(model: torch.nn.Module, refs: list, info: dict, raw: bool, s3=None,
                   cache_dir: str = streaming.CACHE_DIR, batch_size: int = 256) -> dict[str, float]:
    """Accuracy of `model` over shards `refs`, in one process (the driver)."""
    from stages.feed import streaming
    cache = streaming.ShardCache(cache_dir, streaming.CACHE_MAX_BYTES, s3)
    correct = seen = 0
    for ref in refs:
        rows = streaming.read_shard(cache.local_path(ref), ref.format)
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            x = to_batch([streaming.decode_sample(r[2], info["image_size"], raw) for r in batch],
                         info["mean"], info["std"], torch.device("cpu"), False, False)
            y = torch.tensor([r[1] for r in batch])
            correct += int((model(x).argmax(1) == y).sum())
            seen += len(batch)
    return {"acc": correct / max(1, seen), "rows": seen}
