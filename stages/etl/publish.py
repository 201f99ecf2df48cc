"""Publishing an ETL output, and the files around it: the manifest written last (the publish
step), a failed run's files removed, and an overwritten output's old shards deleted after the new
manifest is out (stages.etl.stage)."""
from __future__ import annotations

import logging
from typing import Any

from stages.common import storage
from stages.common.artifacts import write_manifest
from stages.common.locks import STAGE_RECORD
from stages.etl import shards

__all__ = ["publish", "published_run", "remove_run_files", "remove_stale", "prune_empty_folders", "is_shard_file", "is_run_file"]

log = logging.getLogger("stages.etl.stage")  # the stage's lines, under the stage's logger


def publish(out: str, manifest: dict[str, Any], s3: Any | None, fs, root: str) -> None:
    """Write the manifest: the publish step. A write that raised after the store committed it
    (a response timeout on S3) is a publish, not a failure: the manifest names these shards."""
    try:
        write_manifest(out, manifest, s3)
    except Exception as e:
        if published_run(fs, root) != manifest["run_id"]:
            raise
        log.warning("etl: the manifest write raised %s: %s, but the store committed it; published",
                    type(e).__name__, e)


def published_run(fs, root: str) -> str | None:
    """run_id of the manifest in `root` now; None when there is none; "unknown" when unreadable."""
    try:
        fs.invalidate_cache(root)
        return storage.read_json(fs, storage.join(root, storage.MANIFEST)).get("run_id")
    except FileNotFoundError:
        return None
    except Exception as e:  # the endpoint that just failed may still be failing: keep the files
        log.warning("etl: cannot tell whether the manifest was published (%s); keeping this run's files; "
                    "check with: raymill verify", e)
        return "unknown"


def remove_run_files(fs, root: str, run_id: str) -> None:
    """Best effort: delete this run's unpublished files (the manifest never named them)."""
    try:
        for path in fs.find(root):
            if run_id in path.rsplit("/", 1)[-1]:
                fs.rm_file(path)
        prune_empty_folders(fs, root)
    except Exception as e:  # the endpoint may be the thing that failed
        log.warning("etl: could not remove unpublished files of run %s: %s", run_id, e)


def remove_stale(fs, root: str, manifest: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """After an overwrite is published, delete the files of the manifest it replaced.

    Those files, and the shards of killed runs (raymill's own file names: `<split>-<task>-<part>-
    <run_id>` and `quarantine-<run_id>`, named by no manifest): this run holds the output's lock,
    so no other ETL writes here, and a folder read (`pd.read_parquet("DST/shards/parquet")`, as the
    README offers) had counted a killed run's rows with the published ones (520 rows for 200). Any
    other file is left in place and named.
    """
    keep = {s["path"] for s in manifest["shards"]} | {manifest["quarantine"]["path"]}
    named = set()
    if previous:
        named = {s["path"] for s in previous.get("shards", [])} | {previous.get("quarantine", {}).get("path")}
    for relative in sorted(named - keep - {None}):  # a planted '../x' or '/x' names no shard of ours
        if is_shard_file(relative) and ".." not in relative.split("/") and fs.exists(storage.join(root, relative)):
            fs.rm_file(storage.join(root, relative))
    fs.invalidate_cache(root)
    listed = storage.files_under(fs, root)
    killed = [p for p in listed if is_run_file(p) and p not in keep]
    for relative in killed:
        fs.rm_file(storage.join(root, relative))
    prune_empty_folders(fs, root)
    if killed:
        log.info("etl: removed %d file(s) of killed runs that no manifest names (%s)", len(killed),
                 ", ".join(p.rsplit("/", 1)[-1] for p in killed[:3]))
    # someone's files beside a published output (a new output with them is refused before it starts)
    if foreign := [p for p in listed if not (is_run_file(p) or p in (storage.MANIFEST, STAGE_RECORD)
                                             or p.rsplit("/", 1)[-1].startswith("."))]:
        log.warning("etl: %d file(s) in '%s' were not written by raymill etl and are left in place (%s); they "
                    "are no part of the dataset, which manifest.json lists", len(foreign), storage.shown(fs, root),
                    ", ".join(foreign[:3]))


def prune_empty_folders(fs, root: str) -> None:
    """Remove the folders under shards/ that hold no file any more (a local output: S3 has no
    folders), deepest first, then shards/ itself when empty."""
    shards = storage.join(root, "shards")
    if not storage.is_local(fs) or not fs.isdir(shards):  # an object store's rmdir is a bucket's
        return
    folders = [d for d, _, _ in fs.walk(shards)]
    for folder in sorted(folders, key=lambda d: -d.count("/")):
        if fs.isdir(folder) and not fs.ls(folder):
            fs.rmdir(folder)


def is_run_file(relative: str) -> bool:
    """A shard or quarantine file an ETL run of raymill writes, by its place and name."""
    return is_shard_file(relative) and bool(shards.RUN_FILE.search(relative))


def is_shard_file(relative: str) -> bool:
    return relative.startswith("shards/") or relative.startswith("quarantine-")
