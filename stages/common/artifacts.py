"""Artifacts: what a stage returns, and the `manifest.json` that makes every output folder explain itself."""
from __future__ import annotations

import datetime as dt
import functools
import json
import platform
import subprocess
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from stages.common import locks, storage
from stages.common.config import ConfigError

__all__ = ["Artifact", "MANIFEST", "InputNotPublishedError", "load_input",
           "ModelNotFoundError", "check_model_folder", "checksum_mismatch", "code_version",
           "new_run_id", "write_manifest", "load_artifact", "find_published", "published_output", "made_from",
           "base_manifest", "config_hash", "content_config", "data_fingerprint", "manifest_kind"]

MANIFEST = storage.MANIFEST


@dataclass(frozen=True)
class Artifact:
    """A published stage output: its folder URI and its manifest."""
    stage: str
    path: str
    manifest: dict[str, Any] = field(repr=False)

    def uri(self, relative: str) -> str:
        return storage.join(self.path, relative)


@functools.cache
def code_version() -> dict[str, str]:
    """raymill version plus the git commit when running from a checkout (provenance)."""
    try:
        version = metadata.version("raymill")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    info = {"raymill": version, "python": platform.python_version()}
    repo = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        if sha:
            info["git_commit"] = sha
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def new_run_id() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


# what new_run_id makes, for recognising a run's files by name
RUN_ID_PATTERN = r"\d{8}T\d{6}-[0-9a-f]{6}"


def config_hash(section: dict[str, Any]) -> str:
    return storage.sha256_bytes(json.dumps(section, sort_keys=True).encode())[:16]


def data_fingerprint(manifest: dict[str, Any]) -> str:
    """What an ETL output *contains*, independent of where and when it was written.

    Checkpoints, searches and stage reuse compare this, so re-running the same ETL on the same
    images (a new run id in the shard names) keeps old checkpoints valid, and new data does not.
    """
    shards = sorted((s["split"], s["format"], s["rows"], s["sha256"]) for s in manifest.get("shards", []))
    config = manifest.get("config")
    return config_hash({"classes": manifest.get("classes"), "config": content_config(config) if config else config,
                        "shards": shards})


# Config keys that choose how a stage does its work, never what it makes (etl.ray_data_min_files).
# Left out of every hash that decides reuse: an output made before such a key existed keeps its
# fingerprint and its reuse, and changing the key recomputes nothing.
_HOW_NOT_WHAT = ("ray_data_min_files",)


def content_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a stage's section) less the keys that change how it works, not what it makes."""
    return {k: v for k, v in config.items() if k not in _HOW_NOT_WHAT}


# 2 (2026-11-29): ETL shards under shards/<format>/split=<split>/; a train or tune manifest's
# images_per_s, stall_fraction and verdict cover all epochs (verdict_epochs names them; 1: the last
# epoch's); train's inputs name the data_fingerprint. Readers take both: paths come from the manifest.
SCHEMA_VERSION = 2


def base_manifest(stage: str, config: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    return {"kind": f"raymill.{stage}", "schema_version": SCHEMA_VERSION,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "code": code_version(), "config": config, "config_hash": config_hash(content_config(config)),
            "inputs": inputs}


def write_manifest(out: str, manifest: dict[str, Any], s3: Any | None = None) -> None:
    """Write `out/manifest.json` atomically. It is the publish step: write it last.

    A run that lost its S3 output lock to another run (see locks.ensure_held) publishes nothing."""
    locks.ensure_held(out, s3)
    fs, path = storage.filesystem(out, s3)
    data = json.dumps(manifest, indent=2, sort_keys=False).encode()
    storage.write_bytes_atomic(fs, storage.join(path, MANIFEST), data)


def unpublish(out: str, s3: Any | None = None) -> None:
    """Remove `out/manifest.json` before a run rewrites the folder's files: an --overwrite killed
    mid-write must leave no manifest at all, never the old run's manifest over new files."""
    fs, root = storage.filesystem(out, s3)
    if fs.exists(storage.join(root, MANIFEST)):
        fs.rm_file(storage.join(root, MANIFEST))


def manifest_kind(fs, folder: str) -> str | None:
    """The kind ('raymill.etl', ...) that `folder`'s manifest.json names; None for no manifest, or
    one that is some other tool's file (not JSON, not an object, no raymill kind)."""
    try:
        kind = (storage.read_json_if_any(fs, storage.join(folder, MANIFEST)) or {}).get("kind")
    except (ValueError, AttributeError, IsADirectoryError):  # not JSON, not an object, a folder of that name
        return None
    return kind if isinstance(kind, str) and kind.startswith("raymill.") else None


def load_artifact(path: str, stage: str | None = None, s3: Any | None = None) -> Artifact:
    """Load a published output folder; a folder without a manifest was never published."""
    fs, root = storage.filesystem(path, s3)
    try:
        manifest = storage.read_json_if_any(fs, storage.join(root, MANIFEST))
        kind = manifest.get("kind", "") if manifest is not None else None
    except (ValueError, AttributeError):  # empty, cut short, or JSON but no object: had been a bare JSONDecodeError
        raise ValueError(f"'{path}' holds a {MANIFEST} that is not a raymill manifest (empty, cut short or "
                         f"another tool's); re-run the stage that made it") from None
    if manifest is None:
        raise FileNotFoundError(f"no {MANIFEST} in '{path}': not a published raymill output "
                                f"(run the stage that makes it first)")
    if stage and kind != f"raymill.{stage}":
        raise ValueError(f"'{path}' holds a {kind or 'unknown'} output, not raymill.{stage}")
    return Artifact(kind.removeprefix("raymill."), str(path).rstrip("/"), manifest)


def find_published(out: str, stage: str, config: dict[str, Any], inputs: dict[str, Any],
                   s3: Any | None = None) -> Artifact | None:
    """What `stage` already published in `out` from this config and these inputs, or None.

    A finished stage is handed back, not re-fitted: re-fitting re-published the same model and
    registered it in MLflow again, and a restored Tune snapshot can run its last trial again."""
    done = published_output(out, stage, s3)
    return done if done is not None and made_from(done, config, inputs) else None


def published_output(out: str, stage: str, s3: Any | None = None) -> Artifact | None:
    """`out`'s published output of `stage`, or None (none, another kind, or not a manifest)."""
    try:
        return load_artifact(out, stage, s3)
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def made_from(done: Artifact, config: dict[str, Any], inputs: dict[str, Any]) -> bool:
    """Whether a published output was made from this config and these inputs."""
    have = done.manifest.get("inputs")
    return (isinstance(have, dict) and done.manifest.get("config") == config
            and all(have.get(k) == v for k, v in inputs.items()))


def listed_files(manifest: dict[str, Any]) -> list[str]:
    """The files a published manifest names, relative to its folder: `files` (a list, or a dict
    keyed by name), ETL's shards and its quarantine file."""
    files = manifest.get("files") or []
    named = list(files) if isinstance(files, (list, dict)) else []
    named += [s["path"] for s in manifest.get("shards") or [] if isinstance(s, dict) and "path" in s]
    quarantine = manifest.get("quarantine")
    if isinstance(quarantine, dict) and quarantine.get("path"):
        named.append(quarantine["path"])
    return [str(n) for n in named]


class InputNotPublishedError(ConfigError):
    """A command's input folder is not the published output it needs (exit 2, with the command that makes it)."""


def load_input(path: str, stage: str, s3: Any | None = None, flag: str = "--data") -> Artifact:
    """`load_artifact` for a command's input: a folder that is not `stage`'s published output is a
    usage error naming the fix (a raw image folder to `raymill train` had been exit 1, "failed")."""
    try:
        return load_artifact(path, stage, s3)
    except FileNotFoundError:
        if not _exists(path, s3):  # a typo, or a bucket that is not there: not a folder of images to ETL
            raise InputNotPublishedError(f"{flag} '{path}' does not exist; pass a raymill {stage} output folder"
                                         + (" (check the bucket and the prefix)" if storage.is_remote(path) else "")
                                         ) from None
        fix = (f"; for a folder of images, run `raymill etl --input {path} --output <dataset>` first and pass "
               f"<dataset> (or `raymill run`)") if stage == "etl" else f"; pass a raymill {stage} output folder"
        raise InputNotPublishedError(f"{flag} '{path}' is not a published raymill {stage} output (no {MANIFEST})"
                                     f"{fix}") from None
    except ValueError as e:
        raise InputNotPublishedError(f"{flag} '{path}': {e}") from None


def _exists(path: str, s3: Any | None) -> bool:
    try:
        fs, root = storage.filesystem(path, s3)
        return bool(fs.exists(root))
    except Exception:  # cannot tell (a refused request): say what the listing said
        return True


class ModelNotFoundError(ConfigError):
    """The model folder named holds no exported model (model.json)."""


def checksum_mismatch(path: str) -> ValueError:
    """The one message for a model.pt whose bytes are not the ones model.json names."""
    return ValueError(f"model.pt in '{path}' does not match model.json's checksum (changed or cut short since it "
                      f"was published); copy the folder again, or train again (`raymill train --overwrite`)")


def check_model_folder(path: str, s3: Any | None = None, flag: str = "--model", weights: bool | str = False) -> None:
    """ModelNotFoundError (exit 2) unless `path` holds an exported model's model.json; with `weights`,
    unless its model.pt is there too, and (unless `weights` is "present": the command hashes it as
    it loads it) ValueError unless it matches model.json's checksum (streamed: ~0.3 s for resnet50's
    98 MB). Needs neither torch nor Ray, so a command checks it before starting either:
    `raymill serve --model` with a wrong path, or a damaged model.pt, had started Ray and Serve and
    failed the deploy after 42-43 s with "Failed to update the deployments", exit 1 (2-core box)."""
    fs, root = storage.filesystem(path, s3)
    if (data := storage.read_small_if_any(fs, storage.join(root, "model.json"))) is None:
        inside = [s for s in ("tune", "train") if fs.exists(storage.join(root, s, "model.json"))]  # a run folder
        raise ModelNotFoundError(f"no model.json in '{path}'; pass a train or tune output folder as {flag}"
                                 + (f" (e.g. {storage.join(path, inside[0])})" if inside else ""))
    try:
        info = json.loads(data)
        info = info if isinstance(info, dict) else None
    except ValueError:  # had been a bare JSONDecodeError, exit 1
        info = None
    if info is None:
        raise ModelNotFoundError(f"model.json in '{path}' is not a raymill model.json (not JSON, or cut short); copy "
                                 f"the folder again, or train again (`raymill train --overwrite`)")
    if not fs.exists(storage.join(root, MANIFEST)) and fs.isdir(storage.join(root, "ray")):  # its run state
        raise ModelNotFoundError(f"'{path}' is a train or tune output that has not been published (no {MANIFEST}: "
                                 f"killed, or still running); rerun the same `raymill train` (or tune) to finish it")
    if not weights:
        return
    if not fs.exists(storage.join(root, "model.pt")):
        raise ModelNotFoundError(f"'{path}' holds model.json but no model.pt; pass a train or tune output folder "
                                 f"as {flag}")
    if weights == "present":
        return
    if storage.sha256_file(fs, storage.join(root, "model.pt"))[0] != info.get("weights_sha256"):
        raise checksum_mismatch(path)
