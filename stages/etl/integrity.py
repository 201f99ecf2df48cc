"""Is an ETL output what its manifest says? Every shard's size, sha256 and row count.

`verify` re-hashes everything: `raymill verify`, and the first train on an output. `verify_once`
is what every train and search calls: after a clean full check it leaves a stamp (keyed by the
output's real path and its manifest's sha256, holding each listed file's size and mtime) in
~/.cache/raymill/verified, and a later run whose files all still match the stamp hashes nothing.
So a second run costs one stat a shard, not a read of the whole dataset. Anything that rewrites a
shard changes its mtime (or size), so the stamp no longer matches and the full check runs again,
and names the damaged shard as it always did.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from stages.common import storage
from stages.common.artifacts import MANIFEST, load_artifact
from stages.etl.publish import is_run_file
from stages.etl.shards import count_rows

__all__ = ["verify", "verify_once", "stamp_written", "unnamed_run_files", "STAMP_DIR"]

log = logging.getLogger(__name__)

STAMP_DIR = Path("~/.cache/raymill/verified")
STAMPS_KEPT = 256  # the most recently used; a pruned one costs its output one full check


def verify(out: str, s3: Any | None = None) -> list[str]:
    """Recompute every shard's size, sha256 and row count; return one line per problem. An
    `--overwrite` that publishes meanwhile is checked in turn: the old run's files go once the new
    manifest is published, and a check of the old one had named them missing in a whole dataset."""
    for _ in range(3):
        run_id, problems = _verify_one(out, s3)
        if not problems or load_artifact(out, "etl", s3).manifest.get("run_id") == run_id:
            return problems
    return problems


def _verify_one(out: str, s3: Any | None) -> tuple[Any, list[str]]:
    artifact = load_artifact(out, "etl", s3)  # no manifest, or another stage's: the caller's error
    fs, root = storage.filesystem(out, s3)
    manifest = artifact.manifest
    if not isinstance(manifest.get("shards"), list) or not isinstance(manifest.get("quarantine"), dict):
        return None, ["manifest.json lists no shards or no quarantine file: not an ETL manifest raymill wrote"]
    problems = _rows_add_up(manifest)
    for entry in manifest["shards"] + [{**manifest["quarantine"], "format": None}]:
        problems += _entry_problems(fs, root, entry)
    return manifest.get("run_id"), problems


def unnamed_run_files(out: str, s3: Any | None = None) -> list[str]:
    """Shard and quarantine files by raymill's names that the manifest does not name (a killed run's):
    no part of the dataset, but a folder read (`pd.read_parquet("DST/shards/parquet")`) counts them."""
    manifest = load_artifact(out, "etl", s3).manifest
    fs, root = storage.filesystem(out, s3)
    named = {s.get("path") for s in manifest.get("shards") or []} | {(manifest.get("quarantine") or {}).get("path")}
    return [p for p in storage.files_under(fs, root) if is_run_file(p) and p not in named]


def _rows_add_up(manifest: dict[str, Any]) -> list[str]:
    """Each format's shards hold every row once: a shard listed twice or left out shows here."""
    rows_out, problems = manifest.get("totals", {}).get("rows_out"), []
    for fmt in sorted({s.get("format") for s in manifest["shards"]}):
        held = sum(s.get("rows", 0) for s in manifest["shards"] if s.get("format") == fmt)
        if held != rows_out:
            problems.append(f"the {fmt} shards hold {held} rows, the manifest's totals say rows_out={rows_out}")
    return problems


def _entry_problems(fs, root: str, entry: dict[str, Any]) -> list[str]:
    rel = str(entry.get("path", ""))
    if not rel or rel.startswith("/") or ".." in rel.split("/"):  # a manifest must not point outside
        return [f"outside the output: {rel!r}"]
    path = storage.join(root, rel)
    try:
        if not fs.isfile(path):
            return [f"missing: {rel}"]
        digest, size = storage.sha256_file(fs, path)
        if size != entry["bytes"]:
            return [f"truncated or resized: {rel} has {size} bytes, manifest says {entry['bytes']}"]
        if digest != entry["sha256"]:
            return [f"altered: {rel} sha256 {digest[:12]}... != manifest {entry['sha256'][:12]}..."]
        if entry["format"] and count_rows(fs, path, entry["format"]) != entry["rows"]:
            return [f"row count differs: {rel}"]
    except (OSError, KeyError, ValueError) as e:  # unreadable, or a manifest entry without its fields
        return [f"unreadable: {rel} ({type(e).__name__})"]
    return []


def verify_once(out: str, s3: Any | None = None) -> list[str]:
    """`verify`, skipped when a stamp says this local output was verified clean and no listed file
    has changed size or mtime since. Remote outputs: [] (their shards are verified as the cache
    fetches them, stages.feed.streaming)."""
    if storage.is_remote(out):
        return []
    root, stamp, before = _stamp_now(out)  # the stats first: a file changed while it is hashed fails the next match
    if before is not None and _stamped(stamp) == before:
        log.info("etl: %s verified before and unchanged since (%d files by size and mtime)", out, len(before))
        return []
    problems = verify(out, s3)
    if not problems and before is not None:
        _write_stamp(stamp, {"output": str(root), "files": before})
    return problems


def _stamp_now(out: str) -> tuple[Path, Path, dict[str, list[int]] | None]:
    """(the local output's resolved root, its stamp's path, the stats of the files its manifest
    lists now: None when one is missing)."""
    root = Path(storage.local_path(out)).resolve()
    manifest_bytes = (root / MANIFEST).read_bytes()
    return root, _stamp_path(root, manifest_bytes), _stats(root, _listed_files(json.loads(manifest_bytes)))


def stamp_written(out: str) -> None:
    """After ETL published the local output `out`: the stamp a clean `verify` leaves. The manifest's
    digests are of the bytes ETL wrote, and a file changed since (size or mtime) is hashed again by
    the next check: the first train after an ETL had re-hashed every shard ETL had just hashed
    (2.98 s at 40k images, growing with the data)."""
    if storage.is_remote(out):
        return
    root, stamp, stats = _stamp_now(out)
    if stats is not None:
        _write_stamp(stamp, {"output": str(root), "files": stats})


def _stamped(stamp: Path) -> dict | None:
    try:
        files = json.loads(stamp.read_text()).get("files")
    except (OSError, ValueError, AttributeError):  # none yet, or torn by a crash: check everything
        return None
    try:
        os.utime(stamp)  # used: the newest stay when old ones are pruned (_write_stamp)
    except OSError:
        pass
    return files


def _listed_files(manifest: dict[str, Any]) -> list[str]:
    entries = list(manifest.get("shards") or []) + [manifest.get("quarantine") or {}]
    return sorted({str(e["path"]) for e in entries if isinstance(e, dict) and e.get("path")})


def _stats(root: Path, files: list[str]) -> dict[str, list[int]] | None:
    """{file: [size, mtime_ns]}; None when one is missing (then the full check names it)."""
    stats = {}
    for rel in files:
        try:
            st = os.stat(root / rel)
        except OSError:
            return None
        stats[rel] = [st.st_size, st.st_mtime_ns]
    return stats


def _stamp_path(root: Path, manifest_bytes: bytes) -> Path:
    key = hashlib.sha256(str(root).encode() + b"\0" + hashlib.sha256(manifest_bytes).digest()).hexdigest()
    return STAMP_DIR.expanduser() / f"{key}.json"


def _write_stamp(stamp: Path, payload: dict[str, Any]) -> None:
    """Best effort: a stamp that cannot be written only means the next run checks everything again."""
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, stamp)
        kept = sorted(stamp.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[STAMPS_KEPT:]:  # one a manifest: they had only grown (770 on a test box)
            old.unlink(missing_ok=True)
    except OSError as e:
        log.info("etl: could not write the verification stamp %s (%s); the next run re-checks", stamp, e)
