"""The single entrypoint: ETL -> train -> (tune) -> batch inference -> (export) -> (serve), straight-line.

Each stage writes into `<run.dir>/<stage>/`, holding its lock. A stage whose published manifest is
the one it published, with the same config and inputs (for ETL: a listing fingerprint of the
source), is reused (and says so); `run.force` recomputes. An interrupted stage (no manifest)
resumes when its config is unchanged: the train stage restores from its own checkpoints.
"""
from __future__ import annotations

import json
import logging
import time
import urllib.request
from typing import Any, Callable

import numpy as np

from stages import etl, infer, train, tune
from stages.common import cluster, session, storage, tracking
from stages.common.artifacts import MANIFEST, Artifact, config_hash, content_config, data_fingerprint, listed_files
from stages.common.config import Config, ConfigError, section_dict
from stages.common.locks import LOCK_NAME, STAGE_RECORD, output_lock
from stages.feed import streaming
from stages.model import init_source
from workflow import preflight, report
from workflow.preflight import needed_splits

__all__ = ["run", "stage", "export_stage", "unread_files"]

log = logging.getLogger(__name__)


def stage(name: str, cfg: Config, section: Any, inputs: dict[str, Any],
          build: Callable[[str], Artifact], stale: Callable[[dict], str | None] = lambda m: None,
          ready: Callable[[], Any] = lambda: None) -> tuple[Artifact, bool]:
    """Run `build(out)` unless `out` already holds this stage's output for the same config+inputs.

    Reuse needs all three: the marker written with the output names this config and these inputs;
    the manifest is the very one published then (its sha256), so a manual overwrite is noticed;
    and the manifest's own config_hash is this config's. `stale(manifest)`: a reason the inputs
    cannot show to build again anyway. `ready()` runs before `build` only (Ray's start: a reused
    stage needs no cluster).
    """
    out = storage.join(cfg.run.dir, name)
    fs, root = storage.filesystem(out, cfg.s3)
    key = {"config_hash": config_hash(content_config(section_dict(section))), "inputs": inputs}
    with output_lock(out, name, cfg.s3):
        marker_path, manifest_path = storage.join(root, STAGE_RECORD), storage.join(root, MANIFEST)
        marker = storage.read_json_if_any(fs, marker_path, {})
        same = marker.get("key") == key
        if same and not cfg.run.force and (published := storage.read_small_if_any(fs, manifest_path)) is not None:
            manifest = json.loads(published)
            unchanged = marker.get("manifest_sha256") == storage.sha256_bytes(published)
            if unchanged and manifest.get("config_hash") == key["config_hash"] and not _missing(fs, root, published):
                if (why := stale(manifest)) is None:
                    log.info("%s: reusing %s (inputs and config unchanged; --force recomputes)", name, out)
                    # the bytes just checked against the record: reading them again was a GET more on S3
                    return Artifact(manifest["kind"].removeprefix("raymill."), out.rstrip("/"), manifest), True
                log.info("%s: %s; running it again", name, why)
            else:
                log.info("%s: %s was replaced, or files it lists are gone, since this run published it; "
                         "recomputing", name, manifest_path)
            same = False
        if cfg.run.force or not same:
            _clear(fs, root, bool(marker))  # stale or changed: never resume into another config's state
        storage.write_bytes_atomic(fs, marker_path, json.dumps({"key": key}).encode())
        ready()
        artifact = build(out)
        published = storage.read_small(fs, manifest_path)
        marker = {"key": key, "manifest_sha256": storage.sha256_bytes(published)}
        storage.write_bytes_atomic(fs, marker_path, json.dumps(marker).encode())
        return artifact, False


def unread_files(manifest: dict) -> str | None:
    """The source's fingerprint (names, sizes, mtimes) does not change when a permission is fixed:
    files the last ETL could not read might be readable now."""
    if unread := (manifest.get("quarantine") or {}).get("reasons", {}).get("read_error"):
        return f"the last ETL could not read {unread} file(s) of the source (read_error), which may be readable now"
    return None


def _missing(fs, root: str, published: bytes) -> list[str]:
    """Files the published manifest lists that are gone (one listing, not a request per file): a
    run had reused a train folder whose model.pt was deleted, and reported it."""
    present = set(storage.files_under(fs, root))
    return [f for f in listed_files(json.loads(published)) if f not in present]


def _clear(fs, root: str, ours: bool) -> None:
    """Delete the stage folder's contents, except the lock this run holds on it. Only a folder this
    pipeline wrote (`ours`: it holds a stage.json) is cleared; one with other files is refused: a
    run.dir/etl made by hand had its files deleted without a word."""
    if not fs.exists(root):
        return
    paths = [p for p in storage.children(fs, root) if p.rstrip("/").rsplit("/", 1)[-1] != LOCK_NAME]
    if paths and not ours:
        raise ConfigError(f"'{root}' holds files raymill run did not write (no stage.json), e.g. "
                          f"'{paths[0]}'; move them, or choose another run.dir")
    for path in paths:
        fs.rm(path, recursive=True)


def run(cfg: Config, serve: bool = False, inputs: preflight.Inputs | None = None,
        started: float | None = None) -> dict[str, Any]:
    """ETL -> train -> (tune) -> infer on the test split -> (export) -> (serve). Returns the report.
    `inputs`: what `preflight.start(cfg)` returned (the CLI runs it before this module's imports);
    else it runs here. `started`: the caller's perf_counter() at its start (the report's total is
    the wait the caller saw). Ray starts at the first stage that must compute (`RayOnDemand`)."""
    with output_lock(cfg.run.dir, "pipeline", cfg.s3):  # the CLI took it first (re-entrant)
        return _run_locked(cfg, serve, inputs, time.perf_counter() if started is None else started)


def _run_locked(cfg: Config, serve: bool, inputs: preflight.Inputs | None, started: float) -> dict[str, Any]:
    """One run a run.dir: a second `raymill run` into it, with another source, had re-run ETL under
    the first one's training (its shards gone: FileNotFoundError, then advice to rerun)."""
    if inputs is None:
        inputs = preflight.start(cfg, serve)
    ray_up = preflight.RayOnDemand(cfg)
    if serve:  # replicas the nodes could never hold: refused before ETL. Training ends before the
        ray_up()  # endpoint starts, so each plans alone (and runs with and without --serve share models)
        session.plan_serve(cfg.serve, cluster.node_resources(), say=False)
    timings: dict[str, float] = {}
    reused: dict[str, bool] = {}

    t = time.perf_counter()
    before = t - started - ray_up.take()  # the command's start to ETL's: its imports and checks
    data, reused["etl"] = stage("etl", cfg, cfg.etl, inputs.sources,
                                lambda out: etl.run(cfg.etl, cfg.run.source, out, s3=cfg.s3, overwrite=True,
                                                    listing=inputs.listing), stale=unread_files, ready=ray_up)
    timings["etl"] = time.perf_counter() - t - ray_up.take()  # a stage's row counts its own work
    needed_splits(cfg, data.manifest.get("counts", {}))
    fingerprint = data_fingerprint(data.manifest)  # content, not run id: a same-bytes ETL re-run keeps models

    t = time.perf_counter()
    init = init_source.reuse_inputs(cfg.train.init_from, cfg.s3)  # the init weights' content, not their path
    if cfg.tune.enabled:
        model, reused["tune"] = stage("tune", cfg, cfg.tune, {"data": fingerprint, "train": section_dict(cfg.train), **init},
                         lambda out: tracking.tune(cfg, data, out, lambda callbacks: tune.run(
                             cfg.tune, cfg.train, data, out, seed=cfg.run.seed, ray_cfg=cfg.ray, s3=cfg.s3,
                             callbacks=callbacks), store=cfg.run.dir), ready=ray_up)
        timings["tune"] = time.perf_counter() - t - ray_up.take()
    else:
        model, reused["train"] = stage("train", cfg, cfg.train, {"data": fingerprint, "seed": cfg.run.seed, **init},
                         lambda out: tracking.train(cfg, data, out, lambda run: train.run(
                             cfg.train, data, out, seed=cfg.run.seed, ray_cfg=cfg.ray, s3=cfg.s3, tracking=run),
                             store=cfg.run.dir), ready=ray_up)
        timings["train"] = time.perf_counter() - t - ray_up.take()
    _earlier_model(cfg, "tune" if cfg.tune.enabled else "train")

    t = time.perf_counter()
    preds, reused["infer"] = stage("infer", cfg, cfg.infer, {"model": model.manifest["created_at"], "data": data.path,
                                                    "data_fingerprint": fingerprint},
                          lambda out: infer.run(cfg.infer, model.path, data.path, out, s3=cfg.s3,
                                                start_ray=ray_up, cpus=cfg.ray.num_cpus))  # small: no Ray
    if not reused["infer"]:
        tracking.log_infer(cfg, model.path, preds)
    timings["infer"] = time.perf_counter() - t - ray_up.take()

    exported = None
    if cfg.export.enabled:
        t = time.perf_counter()
        exported, reused["export"] = export_stage(cfg, model)
        timings["export"] = time.perf_counter() - t

    serve_stats = _serve_and_probe(cfg, model, data) if serve else None
    return report.write(cfg, data, model, preds, serve_stats, timings, time.perf_counter() - started,
                        {name for name, again in reused.items() if again}, before_s=before, ray_s=ray_up.seconds,
                        exported=exported)


def _earlier_model(cfg: Config, used: str) -> None:
    """Say so when run.dir also holds the other model stage's output, from a run with tune.enabled
    the other way: the report and infer use `used`'s, and nothing said which one was current."""
    other = "train" if used == "tune" else "tune"
    fs, root = storage.filesystem(cfg.run.dir, cfg.s3)
    if fs.exists(storage.join(root, other, MANIFEST)):
        log.info("%s: %s/%s/ is an earlier run's model (tune.enabled=%s then); this run's is %s/", used, cfg.run.dir,
                 other, str(other == "tune").lower(), used)


def export_stage(cfg: Config, model: Artifact) -> tuple[Artifact, bool]:
    """The published model as ONNX/TorchScript in a Triton model repository, <run.dir>/export."""
    from stages.model import export  # here: it imports torch, which a run of reused stages never loads

    name = cfg.export.name or cfg.tracking.model_name
    return stage("export", cfg, cfg.export, {"model": model.manifest["created_at"], "model_path": model.path,
                                             "name": name},
                 lambda out: export.run(cfg.export, model.path, out, name=name, s3=cfg.s3, stage_folder=True))


def _serve_and_probe(cfg: Config, model: Artifact, data: Artifact) -> dict[str, Any]:
    """Start the endpoint, send it real test-split images over HTTP, report latency."""
    from stages import serve  # here: Ray Serve and FastAPI cost a run without --serve 0.7 s of imports
    from stages.serve import endpoint

    url = serve.start(cfg.serve, model.path, s3=cfg.s3)
    endpoint.warn_if_exposed(cfg.serve)
    log.info("serve: %s/predict is up; probing it with test images (it ends with this run: `raymill serve --model "
             "%s` keeps one up)", url, model.path)
    return probe(url, data, cfg.s3, cfg.infer.split)


def probe(url: str, data: Artifact, s3: Any, split: str, requests: int = 50) -> dict[str, Any]:
    """Sequential real HTTP requests with the split's stored JPEG/PNG bytes; latency percentiles."""
    refs = streaming.shard_refs(data.manifest, data.path, split, "tar") or \
        streaming.shard_refs(data.manifest, data.path, split, "parquet")
    cache = streaming.ShardCache(streaming.CACHE_DIR, streaming.CACHE_MAX_BYTES, s3)
    if not refs or storage.stored_raw(data.manifest, refs[0].format):
        raise ValueError(f"probe needs encoded images of split '{split}'; keep tar in etl.formats")
    rows: list = []
    for ref in refs:  # shards until there are enough (the first two had capped 40 requests at 17)
        rows += streaming.read_shard(cache.local_path(ref), ref.format)
        if len(rows) >= requests:
            break
    distinct = len(rows)
    if not distinct:
        raise ValueError(f"probe: split '{split}' holds no images to send")
    rows = [rows[i % distinct] for i in range(requests)]  # a split smaller than `requests`: sent again
    codec = "image/png" if data.manifest["config"]["codec"] == "png" else "image/jpeg"
    latencies, right = [], {}  # by image: one sent twice had counted twice (0.140 beside test_acc 0.129)
    for key, label, image in rows:
        request = urllib.request.Request(f"{url}/predict", data=image, headers={"Content-Type": codec})
        t = time.perf_counter()
        with urllib.request.urlopen(request, timeout=30) as response:
            body = json.loads(response.read())
        latencies.append((time.perf_counter() - t) * 1000)
        right.setdefault(key, body["class_index"] == label)
    stats = {"url": url, "requests": len(rows), "p50_ms": float(np.percentile(latencies, 50)),
             "p99_ms": float(np.percentile(latencies, 99)), "accuracy": sum(right.values()) / max(1, len(right))}
    log.info("serve: %d requests (%d distinct images), p50 %.1f ms, p99 %.1f ms, accuracy %.3f (of the distinct "
             "images)", stats["requests"], len(right), stats["p50_ms"], stats["p99_ms"], stats["accuracy"])
    return stats
