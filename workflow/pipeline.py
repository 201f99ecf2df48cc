"""The single entrypoint: ETL -> train -> (tune) -> batch inference -> (serve), straight-line.

Each stage writes into `<run.dir>/<stage>/`. A stage whose published manifest has the same config
and inputs is reused (and says so); `run.force` recomputes. An interrupted stage (no manifest)
resumes when its config is unchanged: Ray Train restores from its own checkpoints.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

import yaml

from workflow import session, storage
from workflow.artifacts import Artifact, config_hash, load_artifact
from workflow.config import Config, section_dict

__all__ = ["run", "stage"]

log = logging.getLogger(__name__)


def stage(name: str, cfg: Config, section: Any, inputs: dict[str, Any],
          build: Callable[[str], Artifact]) -> tuple[Artifact, bool]:
    """Run `build(out)` unless `out` already holds this stage's output for the same config+inputs."""
    out = storage.join(cfg.run.dir, name)
    fs, root = storage.filesystem(out, cfg.s3)
    key = {"config_hash": config_hash(section_dict(section)), "inputs": inputs}
    marker = storage.join(root, "stage.json")
    same = fs.exists(marker) and storage.read_json(fs, marker) == key
    if same and not cfg.run.force and fs.exists(storage.join(root, "manifest.json")):
        log.info("%s: reusing %s (inputs and config unchanged; --force recomputes)", name, out)
        return load_artifact(out, s3=cfg.s3), True
    if fs.exists(root) and (cfg.run.force or not same):
        fs.rm(root, recursive=True)  # stale or changed: never resume into another config's state
    storage.write_bytes_atomic(fs, marker, json.dumps(key).encode())
    return build(out), False


def run(cfg: Config, serve: bool = False) -> dict[str, Any]:
    """ETL -> train -> (tune) -> infer on the test split -> (serve). Returns the report."""
    from stages import etl, infer, train

    started = time.perf_counter()
    _write_config(cfg)
    session.start(cfg.ray)
    timings: dict[str, float] = {}

    t = time.perf_counter()
    data, _ = stage("etl", cfg, cfg.etl, {"source": cfg.run.source},
                    lambda out: etl.run(cfg.etl, cfg.run.source, out, s3=cfg.s3, overwrite=True))
    timings["etl"] = time.perf_counter() - t

    t = time.perf_counter()
    if cfg.tune.enabled:
        from stages import tune

        model, _ = stage("tune", cfg, cfg.tune, {"data": data.manifest["run_id"], "train": section_dict(cfg.train)},
                         lambda out: tune.run(cfg.tune, cfg.train, data, out, seed=cfg.run.seed,
                                              ray_cfg=cfg.ray, s3=cfg.s3))
        timings["tune"] = time.perf_counter() - t
    else:
        model, _ = stage("train", cfg, cfg.train, {"data": data.manifest["run_id"], "seed": cfg.run.seed},
                         lambda out: train.run(cfg.train, data, out, seed=cfg.run.seed, ray_cfg=cfg.ray, s3=cfg.s3))
        timings["train"] = time.perf_counter() - t

    t = time.perf_counter()
    preds, _ = stage("infer", cfg, cfg.infer, {"model": model.manifest["created_at"], "data": data.path},
                     lambda out: infer.run(cfg.infer, model.path, data.path, out, s3=cfg.s3))
    timings["infer"] = time.perf_counter() - t

    serve_stats = _serve_and_probe(cfg, model, data) if serve else None
    from workflow import report

    return report.write(cfg, data, model, preds, serve_stats, timings, time.perf_counter() - started)


def _write_config(cfg: Config) -> None:
    fs, root = storage.filesystem(cfg.run.dir, cfg.s3)
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    storage.write_bytes_atomic(fs, storage.join(root, "config.yaml"), text.encode())


def _serve_and_probe(cfg: Config, model: Artifact, data: Artifact) -> dict[str, Any]:
    """Start the endpoint, send it real test-split images over HTTP, report latency."""
    from stages import serve

    url = serve.start(cfg.serve, model.path, s3=cfg.s3)
    log.info("serve: %s/predict is up (POST an image; see README)", url)
    return probe(url, data, cfg.s3, cfg.infer.split)


def probe(url: str, data: Artifact, s3: Any, split: str, requests: int = 50) -> dict[str, Any]:
    """Sequential real HTTP requests with the split's stored JPEG/PNG bytes; latency percentiles."""
    import urllib.request

    import numpy as np

    from stages import data as sd

    refs = sd.shard_refs(data.manifest, data.path, split, "tar") or \
        sd.shard_refs(data.manifest, data.path, split, "parquet")
    cache = sd.ShardCache("~/.cache/raymill/shards", 20e9, s3)
    rows = [r for ref in refs[:2] for r in sd.read_shard(cache.local_path(ref), ref.format)][:requests]
    if storage.stored_raw(data.manifest, refs[0].format):
        raise ValueError("probe needs encoded images; keep tar in etl.formats")
    codec = "image/png" if data.manifest["config"]["codec"] == "png" else "image/jpeg"
    latencies, correct = [], 0
    for key, label, image in rows:
        request = urllib.request.Request(f"{url}/predict", data=image, headers={"Content-Type": codec})
        t = time.perf_counter()
        with urllib.request.urlopen(request, timeout=30) as response:
            body = json.loads(response.read())
        latencies.append((time.perf_counter() - t) * 1000)
        correct += body["class_index"] == label
    stats = {"url": url, "requests": len(rows), "p50_ms": float(np.percentile(latencies, 50)),
             "p99_ms": float(np.percentile(latencies, 99)), "accuracy": correct / max(1, len(rows))}
    log.info("serve: %d requests, p50 %.1f ms, p99 %.1f ms, accuracy %.3f", stats["requests"],
             stats["p50_ms"], stats["p99_ms"], stats["accuracy"])
    return stats
