"""Publishing a trained model: plain `model.pt` + `model.json` that load without Ray.

Used by the Train stage (best checkpoint by val accuracy) and the Tune stage (best trial).
"""
from __future__ import annotations

import io
import json
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from stages.feed import meters, streaming
from stages.model.checkpoint_io import CheckpointRefused, damage, load_plain
from stages.etl.sources import READ_KEYS
from stages.model.predict import evaluate_split, load_model
from stages.common import console, storage
from stages.common.artifacts import Artifact, base_manifest, config_hash, data_fingerprint, unpublish, write_manifest
from stages.common.config import TrainConfig, section_dict

__all__ = ["publish", "save_model", "model_info", "init_lineage", "init_inputs", "state_hash", "read_checkpoint", "curves", "test_metrics"]

log = logging.getLogger(__name__)


def read_checkpoint(checkpoint) -> tuple[dict, dict, dict[str, list]]:
    """(state dict, meta, merged ledger) of a Ray checkpoint."""
    with checkpoint.as_directory() as tmp:
        folder = Path(tmp)
        if problem := damage(folder):  # the digests written with it: never publish changed weights
            raise CheckpointRefused(f"checkpoint {checkpoint.path} is {problem}; nothing was published. Train "
                                    f"again (--overwrite)")
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


def _best(result) -> tuple[Any, dict]:
    """The best epoch-end checkpoint by val_acc: a mid-epoch one carries the previous epoch's val_acc
    beside later weights, and a tie had handed it on as that epoch's model."""
    scored = [(m.get("val_acc", -1.0), c, m) for c, m in (result.best_checkpoints or [])
              if m.get("position_step", 0) == 0]
    scored = [s for s in scored if s[0] >= 0] or [(0, result.checkpoint, result.metrics)]
    _, checkpoint, metrics = max(scored, key=lambda s: s[0])
    return checkpoint, metrics


def test_metrics(best_metrics: dict, out: str, loop_config: dict, cache_dir: str,
                 s3: Any | None = None) -> dict[str, Any]:
    """The published model's test accuracy: scored by the training workers on their devices
    (stages.train.loop) when the best checkpoint carries it, else here on the driver's CPU
    (a checkpoint written by an older raymill), which the manifest says."""
    if "test_acc" in best_metrics:  # no test image scores nothing: None, not an accuracy of 0
        return {"acc": best_metrics["test_acc"] if best_metrics["test_rows"] else None,
                "rows": best_metrics["test_rows"], "where": "workers", "seconds": best_metrics.get("test_seconds")}
    model, info = load_model(out, s3, publishing=True)  # no manifest yet: a tune output had been refused here
    refs = [streaming.ShardRef(**r) for r in loop_config["shards"]["test"]]
    log.warning("train: the best checkpoint has no test score; scoring the test split on the driver's CPU")
    scored = evaluate_split(model, refs, info, loop_config["raw"], loop_config["s3"], cache_dir)
    return {**scored, "acc": scored["acc"] if scored["rows"] else None, "where": "driver"}


def _import_pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def warm_up_curves() -> None:
    """Import matplotlib (about 0.8 s of the 1 s that `curves` took on 2 cores) in a thread while
    the driver only waits for training, so that publishing does not pay for it. A later import
    waits for this one under Python's import lock, so the two never race."""
    threading.Thread(target=_import_pyplot, name="raymill-curves", daemon=True).start()


def curves(history: list[dict], path: Path) -> None:
    plt = _import_pyplot()

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
            # how ETL read the training images: `raymill infer` on a raw folder reads the same way
            "read": {k: etl_cfg[k] for k in READ_KEYS if k in etl_cfg},
            "data_manifest_hash": config_hash(data.manifest), **extra}


def init_lineage(loop_config: dict) -> dict[str, Any]:
    """model.json's record of the weights a run started from (train.init_from), if any."""
    init = (loop_config.get("init") or {}).get("record")
    if not init:
        return {}
    keys = ("source", "kind", "sha256", "bytes", "head", "normalisation", "unwrapped")  # unwrapped: a checkpoint's
    return {"lineage": {"init": {k: init[k] for k in keys if init.get(k) is not None and init.get(k) != []}}}


def init_inputs(loop_config: dict) -> dict[str, str]:
    """The manifest input that names the init weights by content (stages.train.stage.init_inputs)."""
    init = (loop_config.get("init") or {}).get("record")
    return {"init_sha256": init["sha256"]} if init else {}


def publish(cfg, data: Artifact, out: str, result, plan, loop_config: dict, seconds: float,
            s3: Any | None = None, timings: dict[str, float] | None = None) -> Artifact:
    """Export the best checkpoint, evaluate it on the test split, write curves and the manifest.
    `timings`: where the stage's wall went (stages.train.timings reads them), publishing added."""
    started = time.perf_counter()
    _, meta, ledger = read_checkpoint(result.checkpoint)
    best_checkpoint, best_metrics = _best(result)
    state, best_meta, _ = read_checkpoint(best_checkpoint)
    # the config the workers trained with: mean/std may come from the init weights (model.json tells
    # infer and serve); the manifest keeps the config as given, which reuse and resume compare
    trained = TrainConfig.model_validate(loop_config["train"])
    info = model_info(trained, data, {"val_acc": best_metrics.get("val_acc"), "epoch": best_meta["epoch"],
                                      "version": f"{best_meta['epoch']}-{config_hash(state_hash(state))}",
                                      **init_lineage(loop_config)})
    unpublish(out, s3)
    fs, root = storage.filesystem(out, s3)
    save_model(out, state, info, s3)
    test = test_metrics(best_metrics, out, loop_config, cfg.cache_dir, s3)
    history = meta["history"]
    files = {"metrics.jsonl": "".join(json.dumps(h) + "\n" for h in history).encode()}
    if cfg.ledger:
        files["ledger.json"] = json.dumps(ledger).encode()
    with tempfile.TemporaryDirectory() as tmp:
        curves(history, Path(tmp) / "curves.png")
        files["curves.png"] = (Path(tmp) / "curves.png").read_bytes()
    for name, payload in files.items():
        storage.write_bytes_atomic(fs, storage.join(root, name), payload)
    last = history[-1] if history else {}
    manifest = base_manifest("train", section_dict(cfg), {"data": data.path,
                             "data_manifest_hash": info["data_manifest_hash"],
                             "data_fingerprint": data_fingerprint(data.manifest), "seed": loop_config["seed"],
                             **init_inputs(loop_config)})
    manifest.update({
        "resource_plan": plan.as_dict(), "checkpoint": {"best": best_checkpoint.path,
                                                        "latest": result.checkpoint.path},
        "model": {"path": "model.pt", "info": "model.json", "architecture": cfg.model},
        "init": (loop_config.get("init") or {}).get("record"),
        "metrics": {"test_acc": test["acc"], "test_rows": test["rows"], "test_scored_in": test["where"],
                    "best_val_acc": info["val_acc"],
                    "epochs": len(history), "seconds": round(seconds, 1),
                    **meters.over_epochs(history), "tier": last.get("tier")},
        "files": sorted(files) + ["model.pt", "model.json"],
        "timings": {**(timings or {}), "publish_s": time.perf_counter() - started}})
    write_manifest(out, manifest, s3)
    m = manifest["metrics"]
    log.info("train: test_acc %s on %d images, best val_acc %s, %.0fs; over its %d epoch(s) %s img/s, stall "
             "%.1f%%; bottleneck in %d of them: %s", console.score(m["test_acc"]), m["test_rows"],
             console.score(m["best_val_acc"]), m["seconds"], len(history), f"{m['images_per_s'] or 0:,.0f}",
             100 * (m["stall_fraction"] or 0), len(m["verdict_epochs"]), m["verdict"])
    return Artifact("train", str(out).rstrip("/"), manifest)


def state_hash(state: dict) -> dict:
    """A small JSON-able fingerprint of a state dict, for the model version string."""
    return {k: float(v.float().sum()) for k, v in list(state.items())[:8]}
