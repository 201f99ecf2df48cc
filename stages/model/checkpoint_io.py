"""Reading and writing the files of a training checkpoint without trusting them.

Checkpoints may sit in a shared bucket. `torch.load` with weights_only off unpickles, and an
unpickled file can run any code on every worker that loads it. So everything in a checkpoint
is plain data: tensors, numbers, strings, lists and dicts (model, SGD/AdamW optimiser, LR
schedule, GradScaler, RNG states), loaded with `weights_only=True`; anything else is refused.
"""
from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.common import fingerprint

__all__ = ["CheckpointRefused", "load_plain", "read_meta", "rng_state", "set_rng_state", "refusal_in"]


class CheckpointRefused(RuntimeError):
    """A checkpoint that must not be loaded: unsafe content, another run's fingerprint, or half-written."""


def refusal_in(error: BaseException) -> str | None:
    """The worker's CheckpointRefused message, when that is why a fit failed; else None.

    `ray.train.WorkerGroupError.worker_failures` (public) maps each rank to its exception; a Tune
    trial's error (stages.train.solo) is the failure itself. If a wrapper with traceback text comes
    instead, its `module.CheckpointRefused: ...` line counts.
    """
    prefix = f"{CheckpointRefused.__module__}.{CheckpointRefused.__qualname__}: "
    failures = getattr(error, "worker_failures", None) or {"trial": error}
    for failure in failures.values():
        for line in str(failure).splitlines():  # first: Ray's RayTaskError(CheckpointRefused) is one too,
            if line.startswith(prefix):  # and its str() is the remote traceback
                return line[len(prefix):]
        if isinstance(failure, CheckpointRefused):
            return str(failure)
    return None


def load_plain(path: Path, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True; a file needing arbitrary unpickling is refused, never run."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message suggests turning weights_only off, which is exactly what must not happen here;
        # keep only the line naming the refused object.
        lines = [line for line in str(e).splitlines() if "unsupported" in line.lower()]
        reason = lines[0].strip() if lines else type(e).__name__
        raise CheckpointRefused(
            f"checkpoint file {path} holds objects that are not plain tensors or numbers, and loading "
            f"it would run their code; refused ({reason}). Someone or something wrote it outside "
            f"raymill: delete that checkpoint folder, or start over with `raymill train --overwrite`"
        ) from None


def read_meta(folder: Path, where: str, expected: dict[str, Any] | None) -> dict[str, Any]:
    """meta.json of a complete checkpoint, refused unless made by the `expected` fingerprint.

    `expected` is a Fingerprint.as_dict(); None skips the check (Tune's PBT clones checkpoints
    between trials with other hyperparameters on purpose).
    """
    missing = [n for n in ("meta.json", "state.pt") if not (folder / n).exists()]
    if missing:  # meta.json is written last: without it the checkpoint is half-written
        raise CheckpointRefused(f"checkpoint {where} is incomplete (missing {missing}); refusing to load it")
    meta = json.loads((folder / "meta.json").read_text())
    if expected is not None:
        wanted = fingerprint.Fingerprint(expected["digest"], expected["parts"])
        problem = fingerprint.mismatch(meta.get("fingerprint"), wanted)
        if problem:
            raise CheckpointRefused(f"checkpoint {where} was made by another config or data ({problem}); "
                                    f"use a new --output, or pass --overwrite to start over")
    return meta


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG a step may draw from, as tensors and plain lists (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, next_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "python": {"version": version, "words": list(words), "gauss": next_gauss}}
    if device.type == "cuda":  # dropout on the GPU draws from the device's generator
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["gauss"]))
    if "python" in state:
        p = state["python"]
        random.setstate((p["version"], tuple(p["words"]), p["gauss"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
