"""Shard files: the ETL task that writes them, and the readers every later stage shares.

Parquet columns: key (str), path (str), label (int32), image (binary: encoded JPEG/PNG bytes, or
raw uint8 HWC when etl.parquet_encoding=raw), sha256 (str, of the source file).
Tar shards use the WebDataset layout: `<key>.<jpg|png>`, `<key>.cls`, `<key>.json`, in key order.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from stages.common import artifacts, storage
from stages.etl import sources
from stages.etl.images import BadImage, decode_rgb, encode

__all__ = ["process_task", "shard_path", "parquet_bytes", "tar_bytes", "read_parquet_table", "iter_tar",
           "count_rows", "SCHEMA"]

SCHEMA = pa.schema([("key", pa.string()), ("path", pa.string()), ("label", pa.int32()),
                    ("image", pa.binary()), ("sha256", pa.string())])
ROW_GROUP_ROWS = 128  # small row groups: readers stream a shard without holding all of it


def shard_path(fmt: str, split: str, name: str) -> str:
    """`shards/<format>/split=<split>/<name>.<format>`: one folder per format, so
    `pd.read_parquet("DST/shards/parquet")` (or Ray Data's, Spark's, DuckDB's reader) reads the whole
    set with a `split` column from the hive-style folder, where a flat folder mixed tar files in."""
    return f"shards/{fmt}/split={split}/{name}.{fmt}"


def shard_name(split: str, index: int, part: int, run_id: str) -> str:
    """A shard's file name, less its format's suffix: the split, the task, the part, the run."""
    return f"{split}-{index:05d}-{part:02d}-{run_id}"


def quarantine_path(run_id: str) -> str:
    return f"quarantine-{run_id}.jsonl"


# the names above, for any run: what a killed run can have left (stages.etl.publish.is_run_file)
RUN_FILE = re.compile(rf"(?:^|/)(?:[a-z]+-\d{{5}}-\d{{2}}-|quarantine-){artifacts.RUN_ID_PATTERN}"
                      r"\.(?:parquet|tar|jsonl)$")


def process_task(row: dict[str, Any], *, cfg: dict, source: str, out: str, s3: dict,
                 run_id: str, classes: list[str]) -> dict[str, str]:
    """One shard task (Ray Data map fn, or a plain Ray task): decode its files, write its shards, return metadata."""
    task = json.loads(row["task"])
    src_fs, src_root = storage.filesystem(source, s3)
    out_fs, out_root = storage.filesystem(out, s3)
    good, quarantine = [], []
    for key, rel, label, size in task["items"]:
        record = _load_one(src_fs, src_root, key, rel, label, size, cfg)
        (quarantine if "reason" in record else good).append(record)
    shard_meta = []
    for part, rows in enumerate(_split_by_bytes(good, cfg["shard_max_mb"] * 1e6)):
        name = shard_name(task["split"], task["index"], part, run_id)
        for fmt in cfg["formats"]:
            data = parquet_bytes(rows, cfg) if fmt == "parquet" else tar_bytes(rows, cfg, classes)
            relative = shard_path(fmt, task["split"], name)
            storage.write_bytes_atomic(out_fs, storage.join(out_root, relative), data)
            shard_meta.append({"path": relative, "split": task["split"], "format": fmt,
                               "rows": len(rows), "bytes": len(data),
                               "sha256": hashlib.sha256(data).hexdigest(),
                               "first_key": rows[0]["key"], "last_key": rows[-1]["key"]})
    counts: dict[str, int] = {}
    for r in good:
        counts[classes[r["label"]]] = counts.get(classes[r["label"]], 0) + 1
    result = {"split": task["split"], "shards": shard_meta, "quarantine": quarantine, "counts": counts,
              "digests": [[r["sha256"][:16], r["path"], r["label"]] for r in good]}  # the driver looks for copies
    return {"result": json.dumps(result)}


def _load_one(fs, root: str, key: str, rel: str, label: int, size: int, cfg: dict) -> dict[str, Any]:
    """A good row, or a quarantine row: no exception from reading or decoding one file fails the job."""
    bad = {"path": sources.shown(rel), "size": size, "sha256": None}
    cap_bytes = int(cfg["max_file_mb"] * 1e6)
    if size > cap_bytes:
        return {**bad, "reason": "too_large", "detail": f"{size} bytes > etl.max_file_mb"}
    try:
        data = sources.read_capped(fs, root, rel, cap_bytes, cfg["follow_symlinks"])
    except BadImage as e:
        return {**bad, "reason": e.reason, "detail": e.detail}
    except Exception as e:
        return {**bad, "reason": "read_error", "detail": f"{type(e).__name__}: {e}"}
    bad["sha256"] = hashlib.sha256(data).hexdigest()
    try:
        pixels = decode_rgb(data, cfg["image_size"], resize=cfg["resize"],
                            allowed_formats=tuple(cfg["allowed_formats"]),
                            max_pixels=cfg["max_image_pixels"])
    except BadImage as e:
        return {**bad, "reason": e.reason, "detail": e.detail}
    except Exception as e:  # decode_rgb maps what it knows; anything else is still this file's fault
        return {**bad, "reason": "decode_error", "detail": f"{type(e).__name__}: {e}"}
    return {"key": key, "path": sources.shown(rel), "label": label, "sha256": bad["sha256"], "pixels": pixels}


def _split_by_bytes(rows: list[dict], max_bytes: float) -> Iterator[list[dict]]:
    """Roll over to a new shard when the decoded size passes etl.shard_max_mb."""
    current, current_bytes = [], 0
    for r in rows:
        if current and current_bytes + r["pixels"].nbytes > max_bytes:
            yield current
            current, current_bytes = [], 0
        current.append(r)
        current_bytes += r["pixels"].nbytes
    if current:
        yield current


def _image_bytes(r: dict, cfg: dict, raw: bool) -> bytes:
    if raw:
        return r["pixels"].tobytes()
    if "encoded" not in r:
        r["encoded"] = encode(r["pixels"], cfg["codec"], cfg["jpeg_quality"])
    return r["encoded"]


def parquet_bytes(rows: list[dict], cfg: dict) -> bytes:
    raw = cfg["parquet_encoding"] == "raw"
    table = pa.table({"key": [r["key"] for r in rows], "path": [r["path"] for r in rows],
                      "label": pa.array([r["label"] for r in rows], pa.int32()),
                      "image": pa.array([_image_bytes(r, cfg, raw) for r in rows], pa.binary()),
                      "sha256": [r["sha256"] for r in rows]}, schema=SCHEMA)
    sink = pa.BufferOutputStream()
    # Encoded images don't compress further; skip the CPU. Small metadata columns get zstd.
    compression = {"key": "zstd", "path": "zstd", "label": "zstd", "sha256": "zstd",
                   "image": "none" if not raw else "lz4"}
    pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS, compression=compression)
    return sink.getvalue().to_pybytes()


def tar_bytes(rows: list[dict], cfg: dict, classes: list[str]) -> bytes:
    ext = "jpg" if cfg["codec"] == "jpeg" else "png"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for r in rows:  # rows are in key order; Ray's reader needs that (ray-project/ray#44068)
            meta = {"path": r["path"], "label": r["label"], "class": classes[r["label"]],
                    "sha256": r["sha256"]}
            for name, data in ((f"{r['key']}.cls", str(r["label"]).encode()),
                               (f"{r['key']}.{ext}", _image_bytes(r, cfg, raw=False)),
                               (f"{r['key']}.json", json.dumps(meta, sort_keys=True).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, 0  # fixed: same bytes each run
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def read_parquet_table(fs, path: str, columns: list[str] | None = None) -> pa.Table:
    with fs.open(path, "rb") as f:
        # ParquetFile, not read_table: read_table imports pyarrow.dataset on first use, which
        # cost up to 0.6 s inside the first training batch of a fresh worker (measured).
        return pq.ParquetFile(f).read(columns=columns)


def iter_tar(fileobj) -> Iterator[dict[str, Any]]:
    """Yield {"key", "label", "image", "path", "sha256"} from a WebDataset tar in member order."""
    sample: dict[str, Any] = {}
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.rpartition("/")[2].partition(".")
            if sample and sample["key"] != key:
                yield sample
                sample = {}
            sample["key"] = key
            data = tar.extractfile(member).read()
            if ext == "cls":
                sample["label"] = int(data)
            elif ext == "json":
                meta = json.loads(data)
                sample["path"], sample["sha256"] = meta.get("path"), meta.get("sha256")
            else:
                sample["image"] = data
    if sample:
        yield sample


def count_rows(fs, path: str, fmt: str) -> int:
    if fmt == "parquet":
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata.num_rows
    with fs.open(path, "rb") as f:
        return sum(1 for _ in iter_tar(f))
