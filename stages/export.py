"""Publishing a trained model: plain `model.pt` + `model.json` that load without Ray.

Used by the Train stage (best checkpoint by val accuracy) and the Tune stage (best trial).
"""
from __future__ import annotations

import io
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.checkpoint_io import load_plain
from workflow import storage
from workflow.artifacts import Artifact, base_manifest, config_hash, write_manifest
from workflow.config import section_dict

__all__ = ["publish", "load_model", "evaluate_split", "save_model", "preprocess", "predict_arrays", "model_info"]

log = logging.getLogger(__name__)


def _read_checkpoint(checkpoint) -> tuple[dict, dict, dict[str, list]]:
    """(state dict, meta, merged ledger) of a Ray checkpoint."""
    with checkpoint.as_directory() as tmp:
        folder = Path(tmp)
        state = load_plain(folder / "state.pt")["model"]  # plain tensors only: never unpickle code
        meta = json.loads((folder / "meta.json").read_text())
        ledger: dict[str, list] = {}
        for part in sorted(folder.glob("ledger-rank*.json")):
            for epoch, keys in json.loads(part.read_text()).items():
                ledger.setdefault(epoch, []).extend(keys)
    return state, meta, ledger


def save_model(out: str, state: dict, model_info: dict, s3: Any | None = None) -> None:
    fs, root = storage.filesystem(out, s3)
    buf = io.BytesIO()
    torch.save(state, buf)
    storage.write_bytes_atomic(fs, storage.join(root, "model.pt"), buf.getvalue())
    model_info = {**model_info, "weights_sha256": storage.sha256_bytes(buf.getvalue())}
    storage.write_bytes_atomic(fs, storage.join(root, "model.json"), json.dumps(model_info, indent=2).encode())


def load_model(path: str, s3: Any | None = None) -> tuple[torch.nn.Module, dict]:
    """Load an exported model folder (a train/tune output, or any folder with model.pt+model.json)."""
    from stages.models import build_model

    fs, root = storage.filesystem(path, s3)
    if not fs.exists(storage.join(root, "model.json")):
        raise FileNotFoundError(f"no model.json in '{path}'; pass a train or tune output folder")
    info = json.loads(fs.cat_file(storage.join(root, "model.json")))
    data = fs.cat_file(storage.join(root, "model.pt"))
    if storage.sha256_bytes(data) != info["weights_sha256"]:
        raise ValueError(f"model.pt in '{path}' does not match model.json's checksum; re-export it")
    model = build_model(info["architecture"], len(info["classes"]), info["width"], info["dropout"])
    model.load_state_dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
    return model.eval(), info


@torch.no_grad()
def evaluate_split(model: torch.nn.Module, refs: list, info: dict, raw: bool, s3=None,
                   cache_dir: str = "~/.cache/raymill/shards", batch_size: int = 256) -> dict[str, float]:
    """Accuracy of `model` over shards `refs`, in one process (the driver)."""
    from stages import data as sd
    from stages.train_loop import to_batch

    cache = sd.ShardCache(cache_dir, 20e9, s3)
    correct = seen = 0
    for ref in refs:
        rows = sd.read_shard(cache.local_path(ref), ref.format)
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            x = to_batch([sd.decode_sample(r[2], info["image_size"], raw) for r in batch],
                         info["mean"], info["std"], torch.device("cpu"), False, False)
            y = torch.tensor([r[1] for r in batch])
            correct += int((model(x).argmax(1) == y).sum())
            seen += len(batch)
    return {"acc": correct / max(1, seen), "rows": seen}


def _best(result) -> tuple[Any, dict]:
    scored = [(m.get("val_acc", -1.0), c, m) for c, m in (result.best_checkpoints or [])]
    scored = [s for s in scored if s[0] >= 0] or [(0, result.checkpoint, result.metrics)]
    _, checkpoint, metrics = max(scored, key=lambda s: s[0])
    return checkpoint, metrics


def _curves(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot(epochs, [h["train_loss"] for h in history], label="train")
    ax1.plot(epochs, [h["val_loss"] for h in history], label="val")
    ax1.set(xlabel="epoch", ylabel="loss")
    ax2.plot(epochs, [h["train_acc"] for h in history], label="train")
    ax2.plot(epochs, [h["val_acc"] for h in history], label="val")
    ax2.set(xlabel="epoch", ylabel="accuracy", ylim=(0, 1))
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def model_info(train_cfg, data: Artifact, extra: dict) -> dict[str, Any]:
    etl_cfg = data.manifest["config"]
    return {"architecture": train_cfg.model, "width": train_cfg.width, "dropout": train_cfg.dropout,
            "classes": data.manifest["classes"], "image_size": etl_cfg["image_size"],
            "resize": etl_cfg["resize"], "mean": list(train_cfg.augment.mean),
            "std": list(train_cfg.augment.std), "data": data.path,
            "data_manifest_hash": config_hash(data.manifest), **extra}


def publish(cfg, data: Artifact, out: str, result, plan, loop_config: dict, seconds: float,
            s3: Any | None = None) -> Artifact:
    """Export the best checkpoint, evaluate it on the test split, write curves and the manifest."""
    from stages import data as sd

    _, meta, ledger = _read_checkpoint(result.checkpoint)
    best_checkpoint, best_metrics = _best(result)
    state, best_meta, _ = _read_checkpoint(best_checkpoint)
    info = model_info(cfg, data, {"val_acc": best_metrics.get("val_acc"), "epoch": best_meta["epoch"],
                                  "version": f"{best_meta['epoch']}-{config_hash(state_hash(state))}"})
    save_model(out, state, info, s3)
    model, info = load_model(out, s3)
    test_refs = [sd.ShardRef(**r) for r in loop_config["shards"]["test"]]
    test = evaluate_split(model, test_refs, info, loop_config["raw"], loop_config["s3"], cfg.cache_dir)
    history = meta["history"]
    fs, root = storage.filesystem(out, s3)
    files = {"metrics.jsonl": "".join(json.dumps(h) + "\n" for h in history).encode()}
    if cfg.ledger:
        files["ledger.json"] = json.dumps(ledger).encode()
    with tempfile.TemporaryDirectory() as tmp:
        _curves(history, Path(tmp) / "curves.png")
        files["curves.png"] = (Path(tmp) / "curves.png").read_bytes()
    for name, payload in files.items():
        storage.write_bytes_atomic(fs, storage.join(root, name), payload)
    last = history[-1] if history else {}
    manifest = base_manifest("train", section_dict(cfg), {"data": data.path,
                             "data_manifest_hash": info["data_manifest_hash"], "seed": loop_config["seed"]})
    manifest.update({
        "resource_plan": plan.as_dict(), "checkpoint": {"best": best_checkpoint.path,
                                                        "latest": result.checkpoint.path},
        "model": {"path": "model.pt", "info": "model.json", "architecture": cfg.model},
        "metrics": {"test_acc": test["acc"], "test_rows": test["rows"], "best_val_acc": info["val_acc"],
                    "epochs": len(history), "seconds": round(seconds, 1),
                    "images_per_s": last.get("images_per_s"), "stall_fraction": last.get("stall_fraction"),
                    "verdict": last.get("verdict")},
        "files": sorted(files) + ["model.pt", "model.json"]})
    write_manifest(out, manifest, s3)
    m = manifest["metrics"]
    print(f"[raymill] train: test_acc {m['test_acc']:.3f} on {m['test_rows']} images, best val_acc "
          f"{m['best_val_acc']:.3f}, {m['seconds']:.0f}s; bottleneck: stall {m['stall_fraction'] or 0:.1%}, "
          f"{m['verdict']}", flush=True)
    return Artifact("train", str(out).rstrip("/"), manifest)


def state_hash(state: dict) -> dict:
    """A small JSON-able fingerprint of a state dict, for the model version string."""
    return {k: float(v.float().sum()) for k, v in list(state.items())[:8]}


def preprocess(data: bytes, info: dict, allowed_formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "BMP"),
               max_pixels: int = 89_478_485) -> np.ndarray:
    """The eval transform for raw image bytes: identical to what ETL stored for training.

    Raises stages.images.BadImage (with .reason) for unusable bytes.
    """
    from stages.images import decode_rgb

    return decode_rgb(data, info["image_size"], resize=info.get("resize", "crop"),
                      allowed_formats=allowed_formats, max_pixels=max_pixels)


@torch.no_grad()
def predict_arrays(model: torch.nn.Module, info: dict, arrays: list[np.ndarray], top_k: int = 3,
                   device: torch.device | None = None) -> list[dict[str, Any]]:
    """Class predictions for uint8 RGB arrays of the model's input size (one dict per array)."""
    from stages.train_loop import to_batch

    if not arrays:
        return []
    device = device or torch.device("cpu")
    x = to_batch(arrays, info["mean"], info["std"], device, False, False)
    probs = torch.softmax(model(x).float(), dim=1).cpu()
    k = min(top_k, probs.shape[1])
    values, indices = probs.topk(k, dim=1)
    classes = info["classes"]
    return [{"class_index": int(idx[0]), "class_name": classes[int(idx[0])],
             "top_k": [{"class_name": classes[int(i)], "class_index": int(i), "probability": float(p)}
                       for p, i in zip(vals, idx)]} for vals, idx in zip(values, indices)]
