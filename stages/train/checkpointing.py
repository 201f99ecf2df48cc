"""A rank's checkpoints: written with each file's sha256, and resumed from the newest one whose
files are whole. A damaged newest checkpoint (a flipped bit, a cut-short copy) is named and the
one before it is used: the same seed and position give the same model, so nothing is lost but
the epochs since. Functions of the loop's `Worker` (stages.train.loop), which holds the state."""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from stages.model.checkpoint_io import (CheckpointRefused, damage, load_plain, older_checkpoints, read_meta,
                                        rng_state, set_rng_state, write_digests)

__all__ = ["save", "restore"]

log = logging.getLogger(__name__)


def score_key(metric: str) -> str:
    """What checkpoint retention ranks by (`checkpoint_score_attribute`) for `metric`."""
    return f"score_{metric}"


def scores(val: dict[str, Any], step: int) -> dict[str, float]:
    """Retention's ranking: an epoch-end checkpoint's validation metrics; a mid-epoch one carries the
    previous epoch's values (w.val) and ranks last, or it tied with that epoch's checkpoint and could
    evict it (a search by val_loss lost its best epoch; Ray always keeps the newest checkpoint)."""
    if step == 0 and val:
        return {score_key(k): float(v) for k, v in val.items() if k in ("val_acc", "val_loss")}
    return {score_key("val_acc"): -1.0, score_key("val_loss"): 1e30}


def save(w, epoch: int, step: int, metrics: dict[str, Any]) -> None:
    """Checkpoint position (epoch, step) and report; a barrier every rank reaches together."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if w.rank == 0:
            torch.save({"model": w.net.state_dict(), "optimizer": w.optimizer.state_dict(),
                        "schedule": w.schedule.state_dict(), "scaler": w.scaler.state_dict() if w.scaler else None},
                       folder / "state.pt")
        torch.save(rng_state(w.device), folder / f"rng-rank{w.rank}.pt")
        (folder / f"ledger-rank{w.rank}.json").write_text(json.dumps(w.ledger))
        (folder / f"sums-rank{w.rank}.json").write_text(json.dumps(w.carried))  # mid-epoch only
        write_digests(folder, w.rank)
        if w.rank == 0:  # written last: a checkpoint without meta.json is incomplete
            meta = {"epoch": epoch, "step": step, "world": w.world, "history": w.history, "val": w.val,
                    "fingerprint": w.fingerprint}
            (folder / "meta.json").write_text(json.dumps(meta))
        metrics = {**w.val, **metrics, "position_epoch": epoch, "position_step": step, **scores(w.val, step)}
        w.hooks.report(metrics, tmp, f"checkpoint-e{epoch:03d}-s{step:06d}-{w.attempt}")


def restore(w) -> bool:
    """Resume from the run's newest whole checkpoint; False when there is none (a fresh start).
    Every rank walks the same checkpoints and checks the same files, so all pick the same one."""
    checkpoint = w.hooks.get_checkpoint()
    if checkpoint is None:
        return False
    damaged: list[str] = []
    for candidate in _candidates(checkpoint):
        with candidate.as_directory() as tmp:
            folder = Path(tmp)
            if problem := damage(folder):
                damaged.append(f"{candidate.path} ({problem})")
                continue
            # Fingerprint first: a foreign checkpoint's files are never even loaded.
            _load(w, folder, read_meta(folder, candidate.path, w.fingerprint))
        if w.rank == 0:
            if damaged:  # a warning, which reaches the console: Ray had named the damaged one as resumed from
                log.warning("train: skipped damaged checkpoint(s): %s; resumed from %s (epoch %d, step %d) instead",
                            "; ".join(damaged), candidate.path, w.epoch, w.step)
            log.info("train: resumed from %s at epoch %d step %d", candidate.path, w.epoch, w.step)
        return True
    raise CheckpointRefused(f"no whole checkpoint to resume from: {'; '.join(damaged)}. Delete those folders to "
                            f"start over, or pass --overwrite")


def _candidates(checkpoint):
    yield checkpoint
    yield from older_checkpoints(checkpoint)  # listed only when the newest is damaged


def _load(w, folder: Path, meta: dict[str, Any]) -> None:
    state = load_plain(folder / "state.pt", map_location=w.device)
    w.net.load_state_dict(state["model"])
    w.optimizer.load_state_dict(state["optimizer"])
    w.schedule.load_state_dict(state["schedule"])
    if w.scaler and state["scaler"]:
        w.scaler.load_state_dict(state["scaler"])
    w.apply_hyperparameters()
    w.epoch, w.history, w.val = meta["epoch"], meta["history"], meta["val"]
    if meta["world"] == w.world:
        set_rng_state(load_plain(folder / f"rng-rank{w.rank}.pt"), w.device)
        w.ledger = json.loads((folder / f"ledger-rank{w.rank}.json").read_text())
        w.step = meta["step"]
        sums = folder / f"sums-rank{w.rank}.json"  # absent in checkpoints of older raymill
        w.carried = json.loads(sums.read_text()) if sums.exists() else None
    else:
        # Elastic restart with another world size: rank row ranges move, so the exact position
        # can't carry over. Restart the epoch; the weights and optimizer do.
        w.step, w.ledger = 0, {}
        if w.rank == 0:
            log.info("train: world size changed %s -> %s; epoch %d restarts from its first step",
                     meta["world"], w.world, w.epoch + 1)
