"""ETL stage: an ImageFolder tree (local or s3://) -> checksummed parquet and WebDataset tar shards.

Layout of the work (measured, see benchmarks/RESULTS.md): the driver lists paths and plans one
Ray Data row per shard; each task opens, decodes and writes its own files and returns only
metadata. Image bytes never travel through the object store, so memory stays flat as input grows.

Publishing: shards carry the run id in their names and `manifest.json` is written last, in one
atomic write. A reader sees the old output or the new one, never a mix or a partial shard.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from workflow import storage
from workflow.artifacts import Artifact, base_manifest, new_run_id, write_manifest
from workflow.config import ConfigError, EtlConfig, section_dict
from stages import shards

__all__ = ["run", "verify", "EtlError", "OutputExistsError", "InputNotFoundError", "discover", "split_of", "sample_key"]

log = logging.getLogger(__name__)


class EtlError(RuntimeError):
    """The ETL job failed; nothing was published."""


class OutputExistsError(ConfigError):
    """The output already holds a published dataset and overwrite was not asked for."""


class InputNotFoundError(ConfigError):
    """The input path does not exist."""


@dataclass(frozen=True)
class Listing:
    classes: list[str]
    files: list[tuple[str, int]]  # (path relative to source, size in bytes) inside class folders
    outside: list[tuple[str, int]]  # files with no class folder: quarantined, never dropped
    hidden: int  # dotfiles such as .DS_Store, skipped and counted


def discover(source: str, s3: Any | None = None) -> Listing:
    """List an ImageFolder tree: the class is the first folder under `source`."""
    fs, root = storage.filesystem(source, s3)
    if not fs.exists(root):
        raise InputNotFoundError(f"input '{source}' does not exist; pass --input with a folder or s3:// prefix "
                       f"laid out as <input>/<class_name>/<image file>")
    found = fs.find(root, detail=True)
    files, outside, hidden, classes = [], [], 0, set()
    for path, info in sorted(found.items()):
        if info.get("type") == "directory":
            continue
        rel = path[len(root):].lstrip("/")
        if any(part.startswith(".") for part in rel.split("/")):
            hidden += 1
        elif "/" not in rel:
            outside.append((rel, int(info.get("size") or 0)))
        else:
            classes.add(rel.split("/", 1)[0])
            files.append((rel, int(info.get("size") or 0)))
    if not files:
        raise EtlError(f"no image files found under '{source}/<class_name>/'; expected ImageFolder "
                       f"layout (one sub-folder per class) — found {len(outside)} loose file(s)")
    return Listing(sorted(classes), files, outside, hidden)


def sample_key(relpath: str) -> str:
    """Stable id of a source file: dot-free (WebDataset keys) and independent of the run."""
    return storage.sha256_bytes(relpath.encode())[:20]


def split_of(relpath: str, fractions: Any) -> str:
    """Hash-based split: adding files never moves an existing file to another split."""
    u = int(storage.sha256_bytes(b"split:" + relpath.encode())[:16], 16) / 16**16
    if u < fractions.train:
        return "train"
    return "val" if u < fractions.train + fractions.val else "test"


def plan_tasks(listing: Listing, cfg: EtlConfig, parallelism: int = 8) -> list[dict[str, Any]]:
    """One task per shard. Files are ordered by key, a hash, so shards mix classes.

    Shards hold at most etl.shard_max_rows rows, and fewer when that would leave fewer than
    `parallelism` (etl.min_shards) tasks; it is config, not the cluster's size, so the same
    config gives the same shards anywhere. One 1,000-row task on a 2,000-image job would keep a core idle for half
    the run (measured, benchmarks/RESULTS.md).
    """
    label_of = {name: i for i, name in enumerate(listing.classes)}
    by_split: dict[str, list[tuple[str, str, int, int]]] = {"train": [], "val": [], "test": []}
    for rel, size in listing.files:
        by_split[split_of(rel, cfg.split)].append((sample_key(rel), rel, label_of[rel.split("/")[0]], size))
    rows_per_task = max(1, min(cfg.shard_max_rows, math.ceil(len(listing.files) / parallelism)))
    tasks = []
    for split, items in by_split.items():
        items.sort()
        for index, start in enumerate(range(0, len(items), rows_per_task)):
            tasks.append({"split": split, "index": index, "items": items[start:start + rows_per_task]})
    return tasks


def run(cfg: EtlConfig, source: str, out: str, *, s3: Any | None = None,
        overwrite: bool = False) -> Artifact:
    """Run ETL from `source` into `out` and return the published artifact."""
    started = time.perf_counter()
    listing = discover(source, s3)
    out_fs, out_root = storage.filesystem(out, s3)
    _check_output(out_fs, out_root, out, overwrite)
    run_id = new_run_id()
    tasks = plan_tasks(listing, cfg, parallelism=cfg.min_shards)
    log.info("etl: %d files in %d classes -> %d shard task(s), run %s",
             len(listing.files), len(listing.classes), len(tasks), run_id)
    results = []
    try:
        results = _execute(tasks, cfg, source, out, s3, run_id, listing.classes)
        quarantine = _quarantine_rows(results, listing)
        _check_bad_fraction(cfg, quarantine, len(listing.files) + len(listing.outside), out)
        manifest = _manifest(cfg, source, run_id, listing, results, quarantine, started)
        quarantine_rel = f"quarantine-{run_id}.jsonl"
        manifest["quarantine"] = _write_quarantine(out_fs, out_root, quarantine_rel, quarantine)
        write_manifest(out, manifest, s3)  # the publish step
    except BaseException:
        _remove_run_files(out_fs, out_root, run_id)
        raise
    _remove_stale(out_fs, out_root, manifest)
    _log_summary(manifest)
    return Artifact("etl", str(out).rstrip("/"), manifest)


def _check_output(fs, root: str, out: str, overwrite: bool) -> None:
    if fs.exists(storage.join(root, "manifest.json")) and not overwrite:
        raise OutputExistsError(f"output '{out}' already holds a published dataset; pass --overwrite "
                                f"to replace it (atomically), or choose another --output")
    if fs.exists(root) and not overwrite and fs.find(root):
        raise OutputExistsError(f"output '{out}' is not empty; pass --overwrite or choose an empty "
                                f"--output so two runs' shards never mix")


def _execute(tasks, cfg: EtlConfig, source: str, out: str, s3, run_id: str, classes: list[str]):
    import ray.data

    fn_kwargs = {"cfg": section_dict(cfg), "source": source, "out": out,
                 "s3": storage.s3_options(s3), "run_id": run_id, "classes": classes}
    rows = [{"task": json.dumps(t)} for t in tasks]
    # Each row is a whole shard's work and returns only metadata, so Ray Data's per-operator
    # reservation (which held this pipeline to one task at a time here) buys nothing.
    ray.data.DataContext.get_current().op_resource_reservation_enabled = False
    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows)))
    ds = ds.map(shards.process_task, fn_kwargs=fn_kwargs, num_cpus=cfg.cpus_per_task)
    try:
        return [json.loads(row["result"]) for row in ds.iter_rows()]
    except Exception as e:
        raise EtlError(f"ETL task failed, nothing was published: {_root_cause(e)}") from e


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"


def _quarantine_rows(results, listing: Listing) -> list[dict[str, Any]]:
    rows = [q for r in results for q in r["quarantine"]]
    rows += [{"path": rel, "size": size, "sha256": None, "reason": "outside_class_folder",
              "detail": "file is not inside a <class_name>/ folder"} for rel, size in listing.outside]
    return sorted(rows, key=lambda q: q["path"])


def _check_bad_fraction(cfg: EtlConfig, quarantine: list, files_in: int, out: str) -> None:
    fraction = len(quarantine) / max(1, files_in)
    if fraction > cfg.max_bad_fraction:
        reasons = Counter(q["reason"] for q in quarantine).most_common()
        raise EtlError(f"{len(quarantine)} of {files_in} files ({fraction:.0%}) are bad, over "
                       f"etl.max_bad_fraction={cfg.max_bad_fraction}; reasons: {dict(reasons)}. "
                       f"Fix the input or raise etl.max_bad_fraction; nothing was published to '{out}'")


def _manifest(cfg, source, run_id, listing, results, quarantine, started) -> dict[str, Any]:
    shard_list = sorted((s for r in results for s in r["shards"]), key=lambda s: s["path"])
    counts: dict[str, dict[str, int]] = {"train": {}, "val": {}, "test": {}}
    for r in results:
        for name, n in r["counts"].items():
            counts[r["split"]][name] = counts[r["split"]].get(name, 0) + n
    rows_out = sum(sum(c.values()) for c in counts.values())
    seconds = time.perf_counter() - started
    manifest = base_manifest("etl", section_dict(cfg), {"source": str(source)})
    manifest.update({
        "run_id": run_id, "classes": listing.classes,
        "image_shape": [cfg.image_size, cfg.image_size, 3],
        "counts": {split: dict(sorted(c.items())) for split, c in counts.items()},
        "shards": shard_list,
        "totals": {"files_in": len(listing.files) + len(listing.outside), "rows_out": rows_out,
                   "quarantined": len(quarantine), "hidden_skipped": listing.hidden},
        "metrics": {"seconds": round(seconds, 3), "images_per_s": round(rows_out / seconds, 1),
                    "mb_written": round(sum(s["bytes"] for s in shard_list) / 1e6, 3)},
    })
    totals = manifest["totals"]
    assert totals["files_in"] == totals["rows_out"] + totals["quarantined"], totals  # invariant
    return manifest


def _write_quarantine(fs, root: str, relative: str, quarantine: list) -> dict[str, Any]:
    data = "".join(json.dumps(q, sort_keys=True) + "\n" for q in quarantine).encode()
    storage.write_bytes_atomic(fs, storage.join(root, relative), data)
    return {"path": relative, "count": len(quarantine), "sha256": storage.sha256_bytes(data),
            "bytes": len(data), "reasons": dict(Counter(q["reason"] for q in quarantine))}


def _remove_run_files(fs, root: str, run_id: str) -> None:
    """Best effort: delete this run's unpublished files (the manifest never named them)."""
    try:
        for path in fs.find(root):
            if run_id in path.rsplit("/", 1)[-1]:
                fs.rm_file(path)
    except Exception as e:  # the endpoint may be the thing that failed
        log.warning("etl: could not remove unpublished files of run %s: %s", run_id, e)


def _remove_stale(fs, root: str, manifest: dict[str, Any]) -> None:
    """After an overwrite is published, delete our files the manifest no longer names.

    Only shards and quarantine reports: anything else in the folder is not ours to delete.
    """
    keep = {storage.join(root, s["path"]) for s in manifest["shards"]}
    keep.add(storage.join(root, manifest["quarantine"]["path"]))
    for path in fs.find(root):
        relative = path[len(root):].lstrip("/")
        ours = relative.startswith("shards/") or relative.startswith("quarantine-")
        if ours and path not in keep:
            fs.rm_file(path)


def _log_summary(m: dict[str, Any]) -> None:
    t, x = m["totals"], m["metrics"]
    log.info("etl: files_in=%d rows_out=%d quarantined=%d images/s=%.1f MB_written=%.2f seconds=%.1f",
             t["files_in"], t["rows_out"], t["quarantined"], x["images_per_s"], x["mb_written"], x["seconds"])


def verify(out: str, s3: Any | None = None) -> list[str]:
    """Recompute every shard's size, sha256 and row count; return one line per problem."""
    from stages.shards import count_rows
    from workflow.artifacts import load_artifact

    artifact = load_artifact(out, "etl", s3)
    fs, root = storage.filesystem(out, s3)
    problems = []
    entries = artifact.manifest["shards"] + [{**artifact.manifest["quarantine"], "format": None}]
    for entry in entries:
        path = storage.join(root, entry["path"])
        if not fs.exists(path):
            problems.append(f"missing: {entry['path']}")
            continue
        digest, size = storage.sha256_file(fs, path)
        if size != entry["bytes"]:
            problems.append(f"truncated or resized: {entry['path']} has {size} bytes, manifest says {entry['bytes']}")
        elif digest != entry["sha256"]:
            problems.append(f"altered: {entry['path']} sha256 {digest[:12]}... != manifest {entry['sha256'][:12]}...")
        elif entry["format"] and count_rows(fs, path, entry["format"]) != entry["rows"]:
            problems.append(f"row count differs: {entry['path']}")
    return problems
