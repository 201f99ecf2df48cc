"""Batch inference stage: an exported model over ETL shards or a raw image folder (local or s3://).

Layout of the work (ETL's lesson: small tasks, not one per node): the driver plans small work items (one per shard,
or one per raw file, a few hundred to a block). Two plans (`infer.decode`, session.plan_infer):
- `actor` (the CPU default): each Ray Data actor loads the model once, then opens and decodes its
  own files. Image bytes never cross the object store; only prediction rows do.
- `tasks` (the GPU default): Ray Data CPU tasks read and decode (stages.infer.decode), and a pool
  of actors holding the devices only predicts, infer.batch_size images a call. Decoded pixels
  cross the object store, and the GPU no longer waits for JPEG decoding on its actor's few CPUs.
Both report the device's busy time (CUDA events around the forward pass, stages.feed.meters).

Preprocessing is the one eval transform: `transform.preprocess` for raw files (what ETL stores) and
`streaming.decode_sample` for shards, so infer, serve and train's test evaluation agree prediction for prediction.
"""
from __future__ import annotations

import io
import json
import logging
import math
import sys
import time
from collections import Counter
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from stages.common import console, session, storage
from stages.common.artifacts import Artifact, base_manifest, unpublish, write_manifest
from stages.common.config import ConfigError, InferConfig, section_dict
from stages.common.locks import foreign_files, output_lock
from stages.infer import decode as infer_decode
from stages.infer import plan as planning
from stages.infer.plan import InferError, Plan
from stages.infer.predictors import BUSY, ENGINE, SCHEMA, BatchPredictor, Predictor
from stages.model import predict, runtime
from stages.etl.stage import check_apart

__all__ = ["run", "InferError", "Predictor", "BatchPredictor", "SCHEMA", "map_batches_kwargs"]

log = logging.getLogger(__name__)
# metrics.decode (the manifest's word) as the log lines say it: "decode in in-process" read as a typo
DECODE_WHERE = {"in-process": "this process", "actor": "the predictor actors", "tasks": "Ray Data tasks"}

# What an infer output holds (`_publish`); a folder with other files is not one.
OUTPUT_FILES = frozenset({"manifest.json", "metrics.json", "predictions.parquet"})


def run(cfg: InferConfig, model_path: str, source: str, out: str, *, s3: Any | None = None,
        start_ray: Callable[[], Any] | None = None, cpus: float | None = None) -> Artifact:
    """Predict every image of `source` with the model in `model_path`; publish into `out`.

    `out` is locked for the run, and refused when it holds another stage's output (exit 2).
    `start_ray` is called once the job is known to need Ray: a job small enough for this process
    (`_in_process`) never starts it (`raymill infer` of 158 images: 3.3 s, against 9.3 s when Ray
    started first). `cpus` (ray.num_cpus) caps the threads of a job run in this process.
    """
    check_apart(source, out)  # predictions written among the images would be read as images next time
    if foreign := foreign_files(out, OUTPUT_FILES.__contains__, s3):  # someone's folder, not an infer output
        raise ConfigError(f"output '{out}' holds files that raymill infer did not write (e.g. '{foreign[0]}'); "
                          f"choose an empty or new --output")
    with output_lock(out, "infer", s3):
        return _run_locked(cfg, model_path, source, out, s3, start_ray, cpus)


def _run_locked(cfg: InferConfig, model_path: str, source: str, out: str, s3: Any | None,
                start_ray: Callable[[], Any] | None, cpus: float | None) -> Artifact:
    started = time.perf_counter()
    # Actors may run in another working directory or on another node: hand them absolute paths.
    model_path, source = (u if storage.is_remote(u) else storage.local_path(u) for u in (model_path, source))
    model, info = predict.load_model(model_path, s3)  # fail fast, before any Ray work
    plan = planning.plan(cfg, source, info, s3)
    if here := _in_process(cfg, plan):
        decode = {"decode": "in-process", "num_actors": 1, "decode_tasks": 0}
        log.info("infer: %s in this process (at most infer.local_max_rows=%d; Ray Data's start would outweigh "
                 "them)", plan.counted(), cfg.local_max_rows)
    else:  # infer.engine=onnxruntime that cannot run this model: exit 2 here, before Ray or an actor starts
        runtime.check_engine(model, info, cfg.engine, "infer.engine")
        # a library call with no Ray yet: Ray as raymill starts it (loopback, token), not ray.data's
        # auto-init (every interface, all cores, no word)
        start_ray = start_ray or session.start_if_needed
        ray_started = time.perf_counter()  # Ray's start is not the stage's work: metrics' seconds leave it out
        start_ray()
        started += time.perf_counter() - ray_started
        resources = session.cluster_resources()
        decode = session.plan_infer(cfg, resources)  # refuses a plan Ray could never run, before any work
        plan = planning.spread(plan, max(decode["num_actors"], decode["decode_tasks"]))
        if decode["decode"] == "actor":  # each reads its own blocks: none left idle (map_batches_kwargs)
            decode["num_actors"] = min(decode["num_actors"], plan.blocks)
        at_a_time = f" ({decode['decode_tasks']} at a time)" if decode["decode_tasks"] else ""
        log.info("infer: %s in %d block(s), %d actor(s), decode in %s%s", plan.counted(),
                 plan.blocks, decode["num_actors"], DECODE_WHERE[decode["decode"]], at_a_time)
    if here:  # this process predicts with the model it has just read
        table, wall_s = _execute_here(cfg, model_path, plan, (model, info), s3, cpus)
    else:
        del model  # the driver's copy: the job's workers load their own
        table, wall_s = _execute(cfg, model_path, plan, info, resources, s3)
    table, busy_s, engines = _extras(table)
    table = table.sort_by([("path", "ascending"), ("key", "ascending")])
    if table.num_rows != plan.rows:  # every input must come back exactly once, errors included
        raise InferError(f"expected {plan.rows} prediction rows, got {table.num_rows}; nothing was published")
    metrics = _metrics(table, info["classes"], time.perf_counter() - started)
    if metrics["rows"] and metrics["errors"] == metrics["rows"]:  # a table of errors answers nothing
        raise InferError(f"none of the {metrics['rows']} file(s) of '{source}' is an image this model reads "
                         f"({metrics['error_reasons']}); pass an ETL output (the folder holding manifest.json, "
                         f"not its shards/) or a folder of images. Nothing was published")
    metrics.update(_device_metrics(cfg, decode, metrics["rows"] - metrics["errors"], busy_s, wall_s))
    metrics["engine"] = "+".join(engines) or metrics["engine"]  # what ran; planned when nothing predicted
    inputs = {"model": model_path, "source": source, "model_sha256": info["weights_sha256"],
              "model_version": info.get("version"), **plan.inputs}
    unpublish(out, s3)  # only now: an interrupted or failed rerun leaves the last result published
    manifest = _publish(cfg, out, s3, table, metrics, inputs, plan.kind, info["classes"])
    unlabelled = metrics["rows"] - metrics["errors"] - metrics["labelled"]  # no class folder the model knows
    log.info("infer: %d images in %.1f s (%.1f img/s), device busy %.2f s (%.0f%% of wall), decode in %s; "
             "errors=%d accuracy=%s over %d labelled%s", metrics["rows"], metrics["seconds"], metrics["images_per_s"],
             metrics["device_busy_s"], 100 * metrics["device_utilisation"], DECODE_WHERE[metrics["decode"]],
             metrics["errors"], console.score(metrics.get("accuracy")), metrics["labelled"],
             f" ({unlabelled} predicted without a class the model knows)" if unlabelled else "")
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


def map_batches_kwargs(cfg: InferConfig, plan: Plan, resources: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Ray Data's map_batches arguments for each stage, in order (no model, no data): `decode`
    (infer.decode=tasks only: CPU tasks) and `predict` (the actor pool).

    Every batch_size is explicit: Ray Data refuses batch_size=None when the actors ask for GPUs
    (infer.use_gpu). Work items go one block's worth to a call (to the decode tasks, or to actors
    that decode); decoded images reach the predicting actors infer.batch_size at a time. The actors
    are a fixed pool, each holding its GPU for the whole run; the decode tasks get the CPUs the
    pool leaves (session.plan_infer). Ray Data fuses a task stage into the next actor stage when
    both ask for the same resources, so on a CPU with equal CPU requests the actors decode after all.
    """
    import ray.data

    console.quiet_ray()

    res = session.plan_infer(cfg, resources)
    items = {"batch_size": max(1, math.ceil(len(plan.items) / plan.blocks)), "batch_format": "pyarrow"}
    pool: dict[str, Any] = {"num_gpus": res["num_gpus"]}
    # Ray Data gives a GPU map 1 CPU when num_cpus is left out, and warns that naming both is
    # "experimental": name the CPUs only where they differ from that
    if not (res["num_gpus"] and res["num_cpus"] == 1):
        pool["num_cpus"] = res["num_cpus"]
    if res["decode"] == "actor":  # no more actors than blocks: Ray Data warns of the idle ones
        actors = max(1, min(res["num_actors"], plan.blocks))
        return {"predict": {**items, **pool, "compute": ray.data.ActorPoolStrategy(size=actors)}}
    pool["compute"] = ray.data.ActorPoolStrategy(size=res["num_actors"])
    return {"decode": {**items, "num_cpus": res["decode_cpus"],  # nor decode tasks than blocks
                       "compute": ray.data.TaskPoolStrategy(size=max(1, min(res["decode_tasks"], plan.blocks)))},
            "predict": {"batch_size": cfg.batch_size, "batch_format": "pyarrow", **pool}}


def _in_process(cfg: InferConfig, plan: Plan) -> bool:
    """A small job runs in this process: Ray Data's start and an actor's (a process, torch, the
    model; on a GPU, CUDA too) cost seconds that its few images never pay back. Only where nothing
    asked for Ray's layout (infer.decode and infer.num_actors unset) and this process can use the
    device it was asked for."""
    return (plan.rows <= cfg.local_max_rows and cfg.decode == "auto" and cfg.num_actors is None
            and (not cfg.use_gpu or torch.cuda.is_available()))


def _execute_here(cfg: InferConfig, model_path: str, plan: Plan, loaded: tuple[torch.nn.Module, dict],
                  s3: Any | None, cpus: float | None) -> tuple[pa.Table, float]:
    """The plan's items through the actor class Ray Data would start, called in this process:
    the same reads, decode and predictions, row for row. torch's thread count is put back after."""
    threads = torch.get_num_threads()
    started = time.perf_counter()
    try:
        predictor = Predictor(model_path=model_path, loaded=loaded, s3=storage.s3_options(s3), top_k=cfg.top_k,
                              use_gpu=cfg.use_gpu, batch_size=cfg.batch_size, **plan.reader,
                              threads=_local_threads(cpus), engine=_local_engine(cfg))
        table = predictor(pa.Table.from_pylist(plan.items)) if plan.items else _empty()
    except ConfigError:  # infer.engine=onnxruntime that cannot run this model: exit 2, the key named
        raise
    except Exception as e:  # as from the actors: the cause, and nothing published
        raise InferError(f"batch inference failed, nothing was published: {console.root_cause(e)}") from e
    finally:
        torch.set_num_threads(threads)
    return table, time.perf_counter() - started


def _empty() -> pa.Table:
    return SCHEMA.append(BUSY).append(ENGINE).empty_table()


def _extras(table: pa.Table) -> tuple[pa.Table, float, list[str]]:
    """The prediction rows without the actors' extra columns: (rows, device busy seconds summed over
    the actors, the engines that ran)."""
    busy_s = float(pc.sum(table["busy_s"]).as_py() or 0.0)
    engines = sorted(set(table["engine"].to_pylist()) - {None})
    return table.drop_columns(["busy_s", "engine"]).cast(SCHEMA), busy_s, engines


def _local_engine(cfg: InferConfig) -> str:
    """A job this small runs in torch unless infer.engine names another: for small_cnn and resnet18 at
    64 px, onnxruntime's first export of a model (5.5-7 s, 2-core box) outweighs what it saves on at
    most local_max_rows images. Not for resnet50 at 224 px (36 ms an image saved, RESULTS.md engines):
    infer.engine=onnxruntime there."""
    return "torch" if cfg.engine == "auto" else cfg.engine


def _local_threads(cpus: float | None) -> int:
    """torch threads for a job in this process: this machine's cores (its cgroup quota too), at
    most `cpus` (ray.num_cpus) and, where this process already runs a Ray driver (`raymill run`),
    at most Ray's CPUs."""
    cores = session.local_cpus() if cpus is None else min(session.local_cpus(), max(1, int(cpus)))
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        cores = min(cores, int(session.cluster_resources().get("CPU", 1)))
    return max(1, cores)


def _execute(cfg: InferConfig, model_path: str, plan: Plan, info: dict, resources: dict[str, float],
             s3: Any | None) -> tuple[pa.Table, float]:
    """Run the plan: (the actors' rows, with their extra columns; wall seconds)."""
    import ray.data

    console.quiet_ray()

    stages = map_batches_kwargs(cfg, plan, resources)
    actor = {"model_path": model_path, "weights_sha256": info["weights_sha256"], "s3": storage.s3_options(s3),
             "top_k": cfg.top_k, "use_gpu": cfg.use_gpu,
             "threads": max(1, int(cfg.cpus_per_actor)), "engine": cfg.engine}
    ds = ray.data.from_items(plan.items, override_num_blocks=plan.blocks)
    if "decode" in stages:
        ds = ds.map_batches(infer_decode.decode_batch, **stages["decode"], fn_kwargs={
            "info": info, "s3": actor["s3"], "reader": plan.reader, "rows_per_batch": cfg.batch_size})
        ds = ds.map_batches(BatchPredictor, fn_constructor_kwargs=actor, **stages["predict"])
    else:
        ds = ds.map_batches(Predictor, fn_constructor_kwargs={**actor, "batch_size": cfg.batch_size, **plan.reader},
                            **stages["predict"])
    started = time.perf_counter()
    try:
        tables = list(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    except Exception as e:
        raise InferError(f"batch inference failed, nothing was published: {console.root_cause(e)}") from e
    wall_s = time.perf_counter() - started
    return (pa.concat_tables(tables) if tables else _empty()), wall_s


def _metrics(table: pa.Table, classes: list[str], seconds: float) -> dict[str, Any]:
    """Counts, accuracy over labelled predicted rows, and the confusion's nonzero cells
    `[true, predicted, count]` (by count, then class order). A dense class-by-class matrix had grown
    with the square of the classes whatever the rows: 44 MB for 198 rows of a 2,000-class model,
    9 GB of memory at 10,000 classes."""
    true, pred = table["true_class"].to_pylist(), table["class_name"].to_pylist()
    errors = [e for e in table["error"].to_pylist() if e]
    pairs = [(t, p) for t, p in zip(true, pred) if t is not None and p is not None]
    order = list(classes) + sorted({t for t, _ in pairs} - set(classes))  # data classes the model lacks
    index = {c: i for i, c in enumerate(order)}
    cells = sorted(Counter(pairs).items(), key=lambda c: (-c[1], index[c[0][0]], index[c[0][1]]))
    metrics: dict[str, Any] = {"rows": table.num_rows, "errors": len(errors), "labelled": len(pairs)}
    if pairs:  # absent, not null, when no row has a known label
        metrics["correct"] = sum(t == p for t, p in pairs)
        metrics["accuracy"] = metrics["correct"] / len(pairs)
    metrics.update({"error_reasons": dict(sorted(Counter(errors).items())), "seconds": round(seconds, 3),
                    "images_per_s": round(table.num_rows / max(seconds, 1e-9), 1),
                    "confusion": {"classes": order, "cells": [[t, p, n] for (t, p), n in cells]}})
    return metrics


def _device_metrics(cfg: InferConfig, plan: dict, predicted: int, busy_s: float, wall_s: float) -> dict[str, Any]:
    """The device's share of the run, as training reports it (stages.feed.meters): busy seconds summed
    over the actors (CUDA events around each forward pass; on a CPU, the forward pass's wall time)
    against the actors' wall (`predict_wall_s` x `actors`, the planned pool, from the plan's start
    to its last row: model loads and waits for decoded images count as idle). `engine`: as planned;
    the caller puts in what the actors report they ran."""
    asked = _local_engine(cfg) if plan["decode"] == "in-process" else cfg.engine
    engine = runtime.resolve(asked, "cuda" if cfg.use_gpu else "cpu")
    return {"decode": plan["decode"], "device": "cuda" if cfg.use_gpu else "cpu", "engine": engine,
            "actors": plan["num_actors"],
            "predict_wall_s": round(wall_s, 3), "device_busy_s": round(busy_s, 4),
            "device_utilisation": round(min(1.0, busy_s / max(wall_s * plan["num_actors"], 1e-9)), 4),
            "device_images_per_s": round(predicted / max(busy_s, 1e-9), 1)}


def _parquet_bytes(table: pa.Table) -> bytes:
    pq.write_table(table, sink := io.BytesIO(), compression="zstd")
    return sink.getvalue()
