"""Fingerprints of what made a run's saved state, checked before anything resumes into it.

Ray Train (and Tune) resume automatically when a run folder holds state, whatever config the
new run has. Without a check, a re-run with another learning rate "resumes" a finished run,
trains nothing and publishes the old model under the new config. So every resumable state
folder gets a `<name>.fingerprint.json` beside it: the config keys that shape the result plus
the data's content fingerprint. A run whose fingerprint differs is refused (ConfigError, exit
2) with the fix; checkpoints carry the same fingerprint so a worker refuses a foreign one too.

One mechanism for every stage: `compute` hashes any JSON-able parts minus the keys a stage
lets change on resume, `guard` compares it with what a state folder was made with.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Iterable

from stages.common import storage
from stages.common.artifacts import config_hash, data_fingerprint
from stages.common.config import ConfigError

__all__ = ["Fingerprint", "TRAIN_RESUMABLE", "compute", "for_train", "differences", "mismatch",
           "guard", "refuse_foreign", "holds_state", "recorded", "clear"]

log = logging.getLogger(__name__)

# train.* keys that may change between a run and its resume. They decide where, on what and
# how robustly the run executes, not which rows are seen in which order or the maths applied:
# - retries and retention: max_failures, num_to_keep, checkpoint_every_steps (only when a
#   position is saved, never the position's meaning);
# - placement: num_workers, min_workers, cpus_per_worker, gpus_per_worker, use_gpu, host (who
#   runs the loop: the same checkpoints either way, stages/train/solo.py). A world
#   size change is the elastic path the checkpoint already handles (the epoch restarts);
# - input plumbing: decode_threads, decode_processes (pixels do not depend on who decodes them),
#   prefetch_batches, pin_memory, cache_dir, cache_max_gb,
#   storage_path (the state's location, not its content).
# Everything else is fingerprinted. Notably epochs and max_steps: they set the cosine LR
# schedule's length, so "two more epochs" is a different run. So are batch_size (resume skips
# step * batch_size rows), lr, optimizer, model, seed, precision and ledger.
TRAIN_RESUMABLE = frozenset({
    "max_failures", "num_to_keep", "checkpoint_every_steps", "num_workers", "min_workers",
    "cpus_per_worker", "gpus_per_worker", "use_gpu", "decode_threads", "decode_processes", "prefetch_batches",
    "pin_memory", "cache_dir", "cache_max_gb", "storage_path", "host"})

SUFFIX = ".fingerprint.json"
DEFAULT_FIX = "use a new --output, or pass --overwrite to discard that state and start over"


@dataclass(frozen=True)
class Fingerprint:
    """A digest plus the parts it was computed from (kept so a mismatch can name the keys)."""
    digest: str
    parts: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "parts": self.parts}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def compute(parts: dict[str, Any], ignore: Iterable[str] = ()) -> Fingerprint:
    """Fingerprint JSON-able `parts` without the dotted keys in `ignore` (e.g. "train.max_failures")."""
    skip = set(ignore)

    def prune(value: Any, prefix: str) -> Any:
        if not isinstance(value, dict):
            return value
        return {k: prune(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in value.items()
                if (f"{prefix}.{k}" if prefix else str(k)) not in skip}
    # A JSON round trip: tuples become lists, so a fingerprint read back from disk compares equal.
    kept = json.loads(json.dumps(prune(parts, "")))
    return Fingerprint(config_hash(kept), kept)


def for_train(train_section: dict[str, Any], seed: int, data_manifest: dict[str, Any],
              init_sha256: str | None = None) -> Fingerprint:
    """What makes a training run's checkpoints: train config (minus TRAIN_RESUMABLE), seed, data
    content, and the content of its init weights (train.init_from names only where they are)."""
    parts = {"train": train_section, "seed": seed, "data": data_fingerprint(data_manifest),
             # Ray Train's saved checkpoint list ranks by the `score_*` metrics (stages.train.checkpointing):
             # state saved before them lacks the keys, and Ray ranks such checkpoints last (max) or first
             # (min), deleting a run's best epoch: refused, with --overwrite as the fix
             "checkpoints_ranked_by": "score_<metric>"}
    if init_sha256:  # absent without init weights: the fingerprints of earlier runs stay valid
        parts["init"] = {"sha256": init_sha256}
    return compute(parts, ignore=[f"train.{k}" for k in TRAIN_RESUMABLE])


def differences(old: dict[str, Any], new: dict[str, Any], limit: int = 6) -> list[str]:
    """'key: old -> new' for each dotted key whose value differs (at most `limit`)."""
    a, b = _flatten(old), _flatten(new)

    def show(flat: dict[str, Any], key: str) -> str:
        return repr(flat[key]) if key in flat else "unset"
    changed = [f"{k}: {show(a, k)} -> {show(b, k)}" for k in sorted(set(a) | set(b))
               if k not in a or k not in b or a[k] != b[k]]
    return changed[:limit] + ([f"... {len(changed) - limit} more"] if len(changed) > limit else [])


def mismatch(stored: dict[str, Any] | None, expected: Fingerprint) -> str | None:
    """None when `stored` (a Fingerprint.as_dict() read back) is `expected`, else what differs."""
    if not stored or "digest" not in stored:
        return "it records no fingerprint (made by an older raymill or another program)"
    if stored["digest"] == expected.digest:
        return None
    return "; ".join(differences(stored.get("parts", {}), expected.parts)) or "the fingerprint differs"


def holds_state(state_uri: str, name: str, s3: Any | None = None) -> bool:
    """Whether `<state_uri>/<name>` holds run state (what `guard` would check, before it records)."""
    fs, root = storage.filesystem(state_uri, s3)
    return _has_state(fs, storage.join(root, name))


def _has_state(fs, folder: str) -> bool:
    try:
        return fs.isdir(folder) and bool(storage.children(fs, folder))
    except FileNotFoundError:
        return False


def guard(state_uri: str, name: str, fp: Fingerprint, s3: Any | None = None, *, overwrite: bool = False,
          fix: str = DEFAULT_FIX) -> bool:
    """Before a run resumes into `<state_uri>/<name>`: refuse state made by another fingerprint.

    With `overwrite`, that state is discarded first. Records `fp` for a fresh folder. Returns
    True when existing state will be resumed. Raises ConfigError naming what differs and `fix`.
    """
    if overwrite:
        clear(state_uri, name, s3)
    if refuse_foreign(state_uri, name, fp, s3, fix=fix):
        log.info("resuming %s: its fingerprint %s matches", storage.join(state_uri, name), fp.digest)
        return True
    fs, root = storage.filesystem(state_uri, s3)
    storage.write_bytes_atomic(fs, storage.join(root, name + SUFFIX), json.dumps(fp.as_dict(), indent=2).encode())
    return False


def refuse_foreign(state_uri: str, name: str, fp: Fingerprint, s3: Any | None = None, *,
                   fix: str = DEFAULT_FIX) -> bool:
    """Whether `<state_uri>/<name>` holds run state, refusing (ConfigError) state another
    fingerprint made. Writes nothing: a command checks it before Ray's start and MLflow's store."""
    fs, root = storage.filesystem(state_uri, s3)
    if not _has_state(fs, storage.join(root, name)):
        return False
    problem = mismatch(recorded(state_uri, name, s3), fp)
    if problem:
        raise ConfigError(f"'{storage.join(state_uri, name)}' holds run state made with another config "
                          f"or data ({problem}); resuming it would publish a model this config did "
                          f"not make: {fix}")
    return True


def recorded(state_uri: str, name: str, s3: Any | None = None) -> dict[str, Any] | None:
    """The fingerprint recorded beside `<state_uri>/<name>` (Fingerprint.as_dict()), or None."""
    fs, root = storage.filesystem(state_uri, s3)
    stored = storage.read_json_if_any(fs, storage.join(root, name + SUFFIX))
    return stored if isinstance(stored, dict) else None


def clear(state_uri: str, name: str, s3: Any | None = None) -> None:
    """Delete `<state_uri>/<name>` (checkpoints, Ray's run state) and its fingerprint file."""
    fs, root = storage.filesystem(state_uri, s3)
    for path in (storage.join(root, name), storage.join(root, name + SUFFIX)):
        if fs.exists(path):
            fs.rm(path, recursive=True)
            log.info("overwrite: removed %s", path)
