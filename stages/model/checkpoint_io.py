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
from typing import Any, Iterator

import numpy as np
import torch

from stages.common import fingerprint, storage

__all__ = ["CheckpointRefused", "load_plain", "read_meta", "rng_state", "set_rng_state", "refusal_in",
           "write_digests", "damage", "older_checkpoints"]

# stages.feed.streaming's refusal of a shard whose bytes changed since ETL, by name: retrying cannot help
SHARD_REFUSED = "stages.feed.streaming.ShardRefused"
DIGESTS = "files-rank{}.json"  # each rank's files and their sha256, written after them (meta.json last)


class CheckpointRefused(RuntimeError):
    """A checkpoint that must not be loaded: unsafe content, another run's fingerprint, or half-written."""


def refusal_in(error: BaseException) -> str | None:
    """The worker's CheckpointRefused (or ShardRefused) message, when that is why a fit failed; else None.

    `ray.train.WorkerGroupError.worker_failures` (public) maps each rank to its exception; a Tune
    trial's error (stages.train.solo) is the failure itself. If a wrapper with traceback text comes
    instead, its `module.CheckpointRefused: ...` line counts.
    """
    prefixes = [f"{CheckpointRefused.__module__}.{CheckpointRefused.__qualname__}: ", SHARD_REFUSED + ": "]
    failures = getattr(error, "worker_failures", None) or {"trial": error}
    for failure in failures.values():
        for line in str(failure).splitlines():  # first: Ray's RayTaskError(CheckpointRefused) is one too,
            for prefix in prefixes:  # and its str() is the remote traceback
                if line.startswith(prefix):
                    return line[len(prefix):]
        cause = getattr(failure, "cause", failure)  # a Tune trial's RayTaskError: what the actor raised
        if isinstance(cause, CheckpointRefused) or f"{type(cause).__module__}.{type(cause).__qualname__}" == SHARD_REFUSED:
            return str(cause)
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
    if missing := _missing(folder):  # whole files: the caller checked them (`damage`), once
        raise CheckpointRefused(f"checkpoint {where} is incomplete (missing {', '.join(missing)}); refusing to load it")
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


def _sha256(path: Path) -> str:
    return storage.sha256_file(storage.filesystem(str(path))[0], str(path))[0]


def _missing(folder: Path) -> list[str]:
    """meta.json is written last: without it (or state.pt) a checkpoint is half-written."""
    return [n for n in ("meta.json", "state.pt") if not (folder / n).exists()]


def write_digests(folder: Path, rank: int) -> None:
    """Each file this rank wrote into its part of a checkpoint, with its sha256 (rank 0 writes
    meta.json after this): a resume checks them before loading a byte (`damage`)."""
    sums = {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != "meta.json"}
    (folder / DIGESTS.format(rank)).write_text(json.dumps(sums))


def damage(folder: Path) -> str | None:
    """What makes a checkpoint folder unusable, or None: meta.json or state.pt missing (half-written),
    meta.json unreadable, or a file that every rank's digests list missing or changed (a bit flip
    had been resumed silently into another model; a truncated state.pt had failed every retry).
    A checkpoint of an older raymill lists no digests: its files are taken as they are."""
    if missing := _missing(folder):
        return f"incomplete (missing {', '.join(missing)})"
    try:
        world = int(json.loads((folder / "meta.json").read_text())["world"])
        listings = [folder / DIGESTS.format(r) for r in range(world)] if (folder / DIGESTS.format(0)).exists() else []
        for listing in listings:
            if not listing.exists():
                return f"incomplete (missing {listing.name})"
            for name, digest in json.loads(listing.read_text()).items():
                if not (folder / name).is_file():
                    return f"incomplete (missing {name})"
                if _sha256(folder / name) != digest:
                    return f"damaged: {name} does not match the sha256 written with it (changed or cut short since)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    return None


def older_checkpoints(checkpoint) -> Iterator[Any]:
    """The run's checkpoints beside `checkpoint` (the same folder) at an earlier position, newest
    first: where a resume goes when the newest is damaged. Read with the checkpoint's own
    filesystem (`Checkpoint.path`, `.filesystem`); a folder whose meta.json does not read is skipped."""
    import pyarrow.fs as pafs

    fs, here = checkpoint.filesystem, checkpoint.path.rstrip("/")
    positions = {}
    for info in fs.get_file_info(pafs.FileSelector(here.rsplit("/", 1)[0])):
        if info.type != pafs.FileType.Directory:
            continue
        try:
            with fs.open_input_stream(f"{info.path}/meta.json") as f:
                meta = json.loads(f.read())
            positions[info.path.rstrip("/")] = (int(meta["epoch"]), int(meta["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    latest = positions.pop(here, None)
    for path, position in sorted(positions.items(), key=lambda item: item[1], reverse=True):
        if latest is None or position < latest:
            yield type(checkpoint)(path, filesystem=fs)
