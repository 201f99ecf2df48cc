"""Batch inference stage: an exported model over ETL shards or a raw image folder (local or s3://).

Layout of the work (the ETL lesson, PLATFORM.md): the driver plans small work items (one per shard,
or one per raw file, a few hundred to a block); each Ray Data actor loads the model once, then opens
and decodes its own files. Image bytes never cross the object store; only prediction rows do.

Preprocessing is the project's one eval transform: `predict.preprocess` for raw files (what ETL
stores for training) and `data.decode_sample` for shards, so batch inference, serving and the
train stage's test evaluation agree prediction for prediction.
"""
from __future__ import annotations

import io
import json
import logging
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from workflow.core import session, storage
from workflow.core.artifacts import MANIFEST, Artifact, base_manifest, load_artifact, write_manifest
from workflow.core.config import InferConfig, section_dict
from workflow.core.locks import output_lock
from stages import predict, sources, streaming
from stages.etl import InputNotFoundError, root_cause, sample_key
from stages.images import BadImage

__all__ = ["run", "InferError", "Predictor", "SCHEMA", "map_batches_kwargs"]

log = logging.getLogger(__name__)

FILES_PER_BLOCK = 256  # raw files per Ray Data block: big enough to amortise a call, small enough to spread
MAX_FILE_BYTES = 64 * 10**6  # same limit as etl.max_file_mb's default: larger files are not read

SCHEMA = pa.schema([("key", pa.string()), ("path", pa.string()), ("true_class", pa.string()),
                    ("class_name", pa.string()), ("class_index", pa.int32()),
                    ("top_k_classes", pa.list_(pa.string())), ("top_k_probs", pa.list_(pa.float64())),
                    ("error", pa.string()), ("error_detail", pa.string())])


class InferError(RuntimeError):
    """Batch inference failed; nothing was published."""


@dataclass(frozen=True)
class Plan:
    kind: str  # "etl" (shards of one split) or "images" (raw files)
    items: list[dict[str, Any]]  # work items, one Ray Data row each
    blocks: int
    rows: int  # prediction rows the output must hold: one per sample, errors included
    reader: dict[str, Any]  # how the actors read the items (Predictor kwargs)
    inputs: dict[str, Any]  # provenance for the manifest


def run(cfg: InferConfig, model_path: str, source: str, out: str, *, s3: Any | None = None) -> Artifact:
    """Predict every image of `source` with the model in `model_path`; publish into `out`.

    `out` is locked for the run, and refused when it holds another stage's output (exit 2).
    """
    with output_lock(out, "infer", s3):
        return _run_locked(cfg, model_path, source, out, s3)


def _run_locked(cfg: InferConfig, model_path: str, source: str, out: str, s3: Any | None) -> Artifact:
    started = time.perf_counter()
    # Actors may run in another working directory or on another node: hand them absolute paths.
    model_path, source = (u if storage.is_remote(u) else storage.local_path(u) for u in (model_path, source))
    _, info = predict.load_model(model_path, s3)  # fail fast, before any Ray work
    plan = _plan(cfg, source, info, s3)
    out_fs, out_root = storage.filesystem(out, s3)
    if out_fs.exists(storage.join(out_root, MANIFEST)):
        out_fs.rm_file(storage.join(out_root, MANIFEST))  # unpublish: never old manifest + new files
    log.info("infer: %d %s item(s) in %d block(s), %d actor(s)", len(plan.items), plan.kind, plan.blocks,
             cfg.num_actors)
    table = _execute(cfg, model_path, plan, s3).sort_by([("path", "ascending"), ("key", "ascending")])
    if table.num_rows != plan.rows:  # every input must come back exactly once, errors included
        raise InferError(f"expected {plan.rows} prediction rows, got {table.num_rows}; nothing was published")
    metrics = _metrics(table, info["classes"], time.perf_counter() - started)
    inputs = {"model": model_path, "source": source, "model_sha256": info["weights_sha256"],
              "model_version": info.get("version"), **plan.inputs}
    manifest = _publish(cfg, out, s3, table, metrics, inputs, plan.kind, info["classes"])
    log.info("infer: rows=%d errors=%d accuracy=%s images/s=%.1f seconds=%.1f", metrics["rows"],
             metrics["errors"], metrics.get("accuracy"), metrics["images_per_s"], metrics["seconds"])
    return Artifact("infer", str(out).rstrip("/"), manifest)


def _publish(cfg: InferConfig, out: str, s3: Any | None, table: pa.Table, metrics: dict, inputs: dict,
             kind: str, classes: list[str]) -> dict[str, Any]:
    """Write predictions and metrics, then the manifest (the publish step, last); return it."""
    fs, root = storage.filesystem(out, s3)
    files = {"predictions.parquet": _parquet_bytes(table),
             "metrics.json": json.dumps(metrics, indent=2).encode()}
    for name, payload in files.items():
        storage.write_bytes_atomic(fs, storage.join(root, name), payload)
    manifest = base_manifest("infer", section_dict(cfg), inputs)
    manifest.update({"source_kind": kind, "classes": classes,
                     "metrics": {k: v for k, v in metrics.items() if k != "confusion"},  # the CLI prints these
                     "files": {n: {"bytes": len(b), "sha256": storage.sha256_bytes(b)}
                               for n, b in files.items()}})
    write_manifest(out, manifest, s3)
    return manifest


def _plan(cfg: InferConfig, source: str, info: dict, s3: Any | None) -> Plan:
    fs, root = storage.filesystem(source, s3)
    if not fs.exists(root):
        raise InputNotFoundError(f"input '{source}' does not exist; pass an ETL output or an image folder")
    if fs.exists(storage.join(root, MANIFEST)):
        return _plan_shards(cfg, load_artifact(source, "etl", s3), info)
    return _plan_files(cfg, fs, root, source)


def _plan_shards(cfg: InferConfig, data: Artifact, info: dict) -> Plan:
    """One item per shard of `cfg.split`; parquet when ETL wrote it (one read, no tar parsing)."""
    m = data.manifest
    fmt = "parquet" if "parquet" in m["config"]["formats"] else "tar"
    refs = streaming.shard_refs(m, data.path, cfg.split, fmt)
    if not refs:
        raise InferError(f"ETL output '{data.path}' has no {fmt} shards for split '{cfg.split}' "
                         f"(counts: {m['counts']}); choose another infer.split")
    raw = storage.stored_raw(m, fmt)
    if raw and m["config"]["image_size"] != info["image_size"]:
        raise InferError(f"'{data.path}' stores raw {m['config']['image_size']} px pixels but the model "
                         f"expects {info['image_size']} px; re-run ETL at that size or with encoded parquet")
    items = [asdict(r) for r in refs]
    return Plan("etl", items, len(items), sum(r.rows for r in refs),
                {"mode": "etl", "raw": raw, "etl_classes": m["classes"]},
                {"format": fmt, "split": cfg.split, "data_run_id": m.get("run_id")})


def _plan_files(cfg: InferConfig, fs, root: str, source: str) -> Plan:
    """Every non-hidden entry is an item: links out of the folder, FIFOs and unreadable files come
    back as error rows (never read, never dropped); a non-UTF-8 name travels as hex bytes."""
    entries, hidden = sources.list_tree(fs, root, "inside_source")
    items = []
    for e in entries:
        name = sources.shown(e.rel)
        reason, detail = e.problem or ("", "")
        items.append({"path": name, "name_hex": "" if name == e.rel else sources.name_bytes(e.rel).hex(),
                      "size": e.size, "reason": reason, "detail": detail})
    if not items:
        raise InferError(f"no files under '{source}'; pass an image folder or an ETL output")
    blocks = max(min(len(items), cfg.num_actors), math.ceil(len(items) / FILES_PER_BLOCK))
    return Plan("images", items, blocks, len(items), {"mode": "images", "source": source},
                {"files": len(items), "hidden_skipped": hidden})


def map_batches_kwargs(cfg: InferConfig, plan: Plan, resources: dict[str, float]) -> dict[str, Any]:
    """Ray Data's map_batches arguments for the Predictor actors (no Predictor, no data).

    batch_size is explicit: one call per block's worth of work items, as batch_size=None would
    give, because Ray Data refuses batch_size=None when the actors ask for GPUs (infer.use_gpu).
    The actors are a fixed pool, each holding its GPU (session.plan_infer) for the whole run.
    """
    import ray.data

    return {"batch_size": max(1, math.ceil(len(plan.items) / plan.blocks)), "batch_format": "pyarrow",
            "compute": ray.data.ActorPoolStrategy(size=cfg.num_actors), **session.plan_infer(cfg, resources)}


def _execute(cfg: InferConfig, model_path: str, plan: Plan, s3: Any | None) -> pa.Table:
    import ray.data

    kwargs = {"model_path": model_path, "s3": storage.s3_options(s3), "top_k": cfg.top_k,
              "batch_size": cfg.batch_size, "use_gpu": cfg.use_gpu,
              "threads": max(1, int(cfg.cpus_per_actor)), **plan.reader}
    ds = ray.data.from_items(plan.items, override_num_blocks=plan.blocks)
    ds = ds.map_batches(Predictor, fn_constructor_kwargs=kwargs,
                        **map_batches_kwargs(cfg, plan, session.cluster_resources()))
    try:
        tables = list(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    except Exception as e:
        raise InferError(f"batch inference failed, nothing was published: {root_cause(e)}") from e
    return pa.concat_tables(tables).cast(SCHEMA) if tables else SCHEMA.empty_table()


class Predictor:
    """Ray Data actor: loads the model once, then reads, decodes and predicts its work items."""

    def __init__(self, *, model_path: str, s3: dict, mode: str, top_k: int, batch_size: int, use_gpu: bool,
                 threads: int, source: str | None = None, raw: bool = False, etl_classes: list | None = None):
        torch.set_num_threads(threads)  # the actor's CPU share, not every core of the node
        self.model, self.info = predict.load_model(model_path, s3)
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model.to(self.device)
        self.mode, self.top_k, self.batch_size, self.raw = mode, top_k, batch_size, raw
        self.etl_classes, self.known = list(etl_classes or []), set(self.info["classes"])
        self.fs, self.root = storage.filesystem(source, s3) if source else (None, None)
        self.cache = streaming.ShardCache(streaming.CACHE_DIR, streaming.CACHE_MAX_BYTES, s3)
        self.pool = ThreadPoolExecutor(max_workers=threads)  # Pillow releases the GIL while decoding

    def __call__(self, batch: pa.Table) -> pa.Table:
        samples = [s for item in batch.to_pylist() for s in self._samples(item)]
        rows: list[dict[str, Any]] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start:start + self.batch_size]  # read lazily: one batch of bytes at a time
            rows += self._predict(chunk, list(self.pool.map(self._decode, chunk)))
        return pa.Table.from_pylist(rows, schema=SCHEMA)

    def _samples(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        if self.mode == "images":
            rel = bytes.fromhex(item["name_hex"]).decode("utf-8", "surrogateescape") if item["name_hex"] \
                else item["path"]
            parent = item["path"].split("/")[-2] if "/" in item["path"] else None
            return [{"key": sample_key(rel), "path": item["path"], "rel": rel, "size": item["size"],
                     "reason": item["reason"], "detail": item["detail"],
                     "true_class": parent if parent in self.known else None}]
        ref = streaming.ShardRef(**item)
        return [{"key": key, "path": path, "image": image, "true_class": self.etl_classes[label]}
                for key, path, label, image in streaming.read_shard(self.cache.local_path(ref), ref.format, with_path=True)]

    def _decode(self, sample: dict[str, Any]) -> tuple[np.ndarray | None, str | None, str | None]:
        """(pixels, None, None), or (None, reason, detail) for an unusable image."""
        try:
            if "image" in sample:
                return streaming.decode_sample(sample["image"], self.info["image_size"], self.raw), None, None
            if sample["reason"]:  # a link out of the folder, a FIFO, a device: never read
                return None, sample["reason"], sample["detail"]
            if sample["size"] > MAX_FILE_BYTES:  # not even read: one huge file must not sink the actor
                return None, "too_large", f"{sample['size']} bytes > {MAX_FILE_BYTES}"
            data = sources.read_capped(self.fs, self.root, sample["rel"], MAX_FILE_BYTES, "inside_source")
            return predict.preprocess(data, self.info), None, None
        except BadImage as e:
            return None, e.reason, e.detail
        except OSError as e:  # decoding turns its own errors into BadImage; this is the read
            return None, "read_error", f"{type(e).__name__}: {e}"

    def _predict(self, chunk: list[dict], decoded: list[tuple]) -> list[dict[str, Any]]:
        good = [i for i, d in enumerate(decoded) if d[0] is not None]
        preds = predict.predict_arrays(self.model, self.info, [decoded[i][0] for i in good], self.top_k,
                                      self.device)
        by_index = dict(zip(good, preds))
        return [_row(s, by_index.get(i), *decoded[i][1:]) for i, s in enumerate(chunk)]


def _row(sample: dict, pred: dict | None, error: str | None, detail: str | None) -> dict[str, Any]:
    """One output row; prediction columns stay null for an error row."""
    row = {"key": sample["key"], "path": sample["path"], "true_class": sample["true_class"],
           "error": error, "error_detail": detail}
    if pred is not None:
        row.update(class_name=pred["class_name"], class_index=pred["class_index"],
                   top_k_classes=[t["class_name"] for t in pred["top_k"]],
                   top_k_probs=[t["probability"] for t in pred["top_k"]])
    return row


def _metrics(table: pa.Table, classes: list[str], seconds: float) -> dict[str, Any]:
    """Counts, accuracy over labelled predicted rows, confusion matrix[true][predicted] in class order."""
    true, pred = table["true_class"].to_pylist(), table["class_name"].to_pylist()
    errors = [e for e in table["error"].to_pylist() if e]
    pairs = [(t, p) for t, p in zip(true, pred) if t is not None and p is not None]
    order = list(classes) + sorted({t for t, _ in pairs} - set(classes))  # data classes the model lacks
    index = {c: i for i, c in enumerate(order)}
    matrix = [[0] * len(order) for _ in order]
    for t, p in pairs:
        matrix[index[t]][index[p]] += 1
    metrics: dict[str, Any] = {"rows": table.num_rows, "errors": len(errors), "labelled": len(pairs)}
    if pairs:  # absent, not null, when no row has a known label
        metrics["correct"] = sum(t == p for t, p in pairs)
        metrics["accuracy"] = metrics["correct"] / len(pairs)
    metrics.update({"error_reasons": dict(sorted(Counter(errors).items())), "seconds": round(seconds, 3),
                    "images_per_s": round(table.num_rows / max(seconds, 1e-9), 1),
                    "confusion": {"classes": order, "matrix": matrix}})
    return metrics


def _parquet_bytes(table: pa.Table) -> bytes:
    pq.write_table(table, sink := io.BytesIO(), compression="zstd")
    return sink.getvalue()
