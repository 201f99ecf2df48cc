"""Train stage: Ray Train DDP over the ETL shards (or, for one worker on one node, one Tune trial
actor: stages/train/solo.py), then export the best model for inference.

Outputs in `out/`: manifest.json, metrics.jsonl, curves.png, model.pt + model.json (loadable
without Ray), ledger.json (when train.ledger), and the run's state under `ray/` (Ray Train's run
folder, or Tune's experiment).
"""
from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from typing import Any, Sequence

from stages.train import capacity, checkpointing
from stages.feed import ray_data as ingest_ray
from stages.model import init_weights, publish
from stages.model.sizes import check_image_size
from stages.model.checkpoint_io import refusal_in
from stages.train import finetune, solo
from stages.train.checks import (TrainError, check_output_files, check_rows, check_shards, check_state,  # noqa: F401
                                 run_name, state_location)
from stages.train.epoch_log import EpochLog
from stages.train.loop import train_loop
from stages.common import cluster, console, fingerprint, session, storage
from stages.common import tracking_model
from stages.common.tracking import log_params
from stages.common.artifacts import Artifact, config_hash, data_fingerprint, made_from, published_output
from stages.common.config import RayConfig, TrainConfig, section_dict
from stages.common.locks import output_lock

__all__ = ["run", "published", "TrainError", "check_rows", "check_state", "check_data", "check_init", "init_inputs", "check_image_size", "loop_config", "build_trainer", "run_name"]

log = logging.getLogger(__name__)


def check_data(cfg: TrainConfig, data: Artifact, s3, model_names: Sequence[str] = ()) -> dict[str, list[dict]]:
    """check_rows, then verify the ETL output (local: re-hashed unless a stamp shows it unchanged
    since a clean check) and list its shards per split.
    `model_names`: the models that will train on it (a search's), train.model when empty."""
    manifest = data.manifest
    check_rows(cfg, data, model_names)
    check_shards(data, s3)
    # Absolute: Ray Train workers run in their own working directory, not the driver's.
    root = data.path if storage.is_remote(data.path) else storage.local_path(data.path)
    shards = {}
    for split in ("train", "val", "test"):
        shards[split] = [{"uri": storage.join(root, s["path"]), "format": s["format"],
                          "rows": s["rows"], "bytes": s["bytes"], "sha256": s["sha256"]}
                         for s in manifest["shards"] if s["split"] == split and s["format"] == cfg.data_format]
    return shards


def check_init(cfg: TrainConfig, data: Artifact, s3, model_names: Sequence[str] = ()) -> init_weights.InitPlan | None:
    """train.init_from read and checked against every model that will train on `data` (a search's
    `model_names`, train.model when empty), before any worker starts: a ConfigError (exit 2) names
    the keys and the fix. None without init weights. The train stage and every search call it."""
    if cfg.freeze_epochs >= cfg.epochs:  # allowed (a linear probe), but easy to set by mistake
        log.warning("train: train.freeze_epochs=%d >= train.epochs=%d: the backbone stays frozen for the whole run "
                    "and only the head trains; lower train.freeze_epochs to fine-tune the backbone too",
                    cfg.freeze_epochs, cfg.epochs)
    if cfg.init_from is None:
        return None
    return init_weights.prepare(cfg, data.manifest["classes"], s3, model_names or [cfg.model])


def init_inputs(cfg: TrainConfig, s3) -> dict[str, str]:
    """What a published output records of its init weights, to be reused only for the same content."""
    return init_weights.reuse_inputs(cfg.init_from, s3)


def loop_config(cfg: TrainConfig, data: Artifact, shards: dict, seed: int, s3: Any | None,
                plan: session.WorkerPlan) -> dict[str, Any]:
    """What every worker of `stages.train.loop` receives (plain, picklable data)."""
    return {"train": section_dict(cfg), "seed": seed, "classes": data.manifest["classes"],
            "image_size": data.manifest["config"]["image_size"], "shards": shards,
            "s3": storage.s3_options(s3), "raw": storage.stored_raw(data.manifest, cfg.data_format),
            "cpus_per_worker": plan.cpus_per_worker, "decode_processes": plan.decode_processes,
            "torch_threads": plan.torch_threads,  # CPUs no worker holds: whether the verdict's "more CPUs" can be had
            "free_cpus": max(0.0, plan.total_cpus - plan.data_reserved_cpus - plan.cpus_per_worker * plan.num_workers)}


def ray_data_datasets(cfg: TrainConfig, loop: dict[str, Any],
                      plan: session.WorkerPlan) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """TorchTrainer's `datasets` for train.ingest=ray_data (None for stream) and the ingest report;
    the train stage and each Tune trial of several workers build them from the loop config."""
    if cfg.ingest != "ray_data":
        return None, {"ingest": "stream", "resume": ingest_ray.RESUME["stream"]}
    planned = cfg.model_copy(update={"data_cpus_per_task": plan.data_cpus_per_task})
    return ingest_ray.build_train_datasets(planned, loop["shards"]["train"], seed=loop["seed"], raw=loop["raw"],
                                           image_size=loop["image_size"], s3=loop["s3"])


def build_trainer(cfg: TrainConfig, loop: dict, plan: session.WorkerPlan, storage_uri: str, name: str,
                  s3: Any | None = None, callbacks: Sequence[Any] = (), metric: str = "val_acc",
                  mode: str = "max", datasets: dict | None = None):
    """The TorchTrainer of one training run; the train stage and every Tune trial use it.

    `storage_uri` + `name` identify the run: Train V2 restores it from its latest checkpoint
    when both are unchanged. `callbacks` are Train callbacks (a Tune trial passes
    `TuneReportCallback`). Checkpoints are ranked by `metric`, best kept.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    from stages.train.controller_hook import QuietController
    from stages.train.ddp_rendezvous import LoopbackTorchConfig

    fs, path = storage.pyarrow_filesystem(storage_uri, s3)
    workers = (plan.min_workers, plan.num_workers) if plan.min_workers else plan.num_workers
    resources = plan.resources(cfg.worker_resources)
    return TorchTrainer(
        _entry, train_loop_config=loop, datasets=datasets,
        scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=plan.use_gpu,
                                               resources_per_worker=resources),
        torch_config=LoopbackTorchConfig(backend="nccl" if plan.use_gpu else "gloo"),
        run_config=ray.train.RunConfig(
            name=name, storage_path=path, storage_filesystem=fs, callbacks=[QuietController(), *callbacks],
            logging_config=console.train_logging_config(),
            failure_config=ray.train.FailureConfig(**capacity.failure_config_kwargs(
                cfg.max_failures, cfg.capacity_timeout_s)),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=cfg.num_to_keep, checkpoint_score_attribute=checkpointing.score_key(metric),
                checkpoint_score_order=mode)))


def _entry(config: dict) -> None:
    train_loop(config)


def run(cfg: TrainConfig, data: Artifact, out: str, *, seed: int = 0, ray_cfg: RayConfig = RayConfig(),
        s3: Any | None = None, overwrite: bool = False, tracking: dict | None = None) -> Artifact:
    """Train on the ETL artifact `data`; publish the best model to `out`.

    Resumes the run state in `out` only if the same config and data made it (else ConfigError);
    `overwrite` discards that state first. One run per output: the output is locked for the run.
    `tracking` is the MLflow run that each epoch's metrics go to (stages.train.epoch_log), or None.
    """
    check_output_files(out, "train", s3)  # someone's folder, not a train output
    with output_lock(out, "train", s3):  # one run per output; refuses another stage's folder
        return _run_locked(cfg, data, out, seed=seed, ray_cfg=ray_cfg, s3=s3, overwrite=overwrite,
                           tracking=tracking)


def published(cfg: TrainConfig, data: Artifact, out: str, seed: int, s3: Any | None = None) -> Artifact | None:
    """The model this config, seed and data already published in `out`, or None. The data is
    compared by content (its shards' digests), as tune's and `raymill run`'s reuse are: an ETL
    rerun over the same images (a new run id, a new manifest) had republished the same model with
    this call's seconds and registered it in MLflow again."""
    inputs, config = {"seed": seed, **init_inputs(cfg, s3)}, section_dict(cfg)
    done = published_output(out, "train", s3)
    if done is not None and not made_from(done, config,
                                          {**inputs, "data_fingerprint": data_fingerprint(data.manifest)}):
        # a model published before manifests named the fingerprint: by the data manifest's hash, or
        # by its run state's fingerprint (data content), kept beside the checkpoints (an ETL rerun to
        # the new layout had republished every older model and registered it in MLflow again)
        older = "data_fingerprint" not in (done.manifest.get("inputs") or {})
        if not (older and (made_from(done, config, {**inputs, "data_manifest_hash": config_hash(data.manifest)})
                           or made_from(done, config, inputs) and _state_made_by(cfg, out, seed, data, s3))):
            done = None
    if done is not None:
        log.info("train: %s already holds this run's model (same config, seed and data); reusing it "
                 "(--overwrite trains again)", out)
    return done


def _state_made_by(cfg: TrainConfig, out: str, seed: int, data: Artifact, s3: Any | None) -> bool:
    """Whether `out`'s run state records this config, seed and data content (the fingerprint file
    `fingerprint.guard` writes beside it). Not with init weights: their content is read to train."""
    if cfg.init_from:
        return False
    stored = fingerprint.recorded(*state_location(cfg, out), s3) or {}
    return stored.get("digest") == fingerprint.for_train(section_dict(cfg), seed, data.manifest).digest


def _host(cfg: TrainConfig, plan: session.WorkerPlan, state_uri: str, name: str, resumes: bool,
          s3: Any | None) -> str:
    """The run's host: the one its saved state was made by (a resume goes on where it was), else
    session.train_host's choice for this plan."""
    if not resumes:
        host = session.train_host(cfg, plan, len(cluster.node_resources()))
    else:
        host = "tune_trial" if solo.holds_state(state_uri, name, s3) else "ray_train"
        if cfg.host not in ("auto", host):
            log.warning("train: %s was started with train.host=%s; it resumes there (--overwrite starts over "
                        "with train.host=%s)", storage.join(state_uri, name), host, cfg.host)
        if host == "tune_trial" and plan.num_workers != 1:
            log.warning("train: %s was started by one worker in a Tune trial actor; it resumes there with "
                        "one worker (the plan has %d; --overwrite starts over with them)",
                        storage.join(state_uri, name), plan.num_workers)
    if host == "tune_trial" and not resumes:
        log.info("train: one worker on one node: its loop runs in a Tune trial actor, without Ray Train's "
                 "controller and worker group (train.host=ray_train keeps them)")
    return host


def _data_replaced(data: Artifact, s3: Any | None) -> str | None:
    """Why resuming cannot help when the ETL output was replaced under the run (its shards gone):
    "rerun the same command" had led to a refusal of the state as another data's."""
    try:
        now = published_output(data.path, "etl", s3)
    except Exception:  # unreadable now: the failure's own message stands
        return None
    if now is not None and now.manifest.get("run_id") == data.manifest.get("run_id"):
        return None
    return (f"its data '{data.path}' was replaced during the run (an ETL --overwrite: the shards it read are "
            f"gone); train again on the new data with --overwrite")


FULL_BELOW = 64 * 2**20  # free bytes under which a failed run's disk is called full


def _disk_full(cfg: TrainConfig, out: str) -> str | None:
    """Why resuming cannot help yet when the disk holding the run state (local) is full: a run there
    had ended in "UnpicklingError: pickle data was truncated" after its retries, no word of the disk."""
    place = cfg.storage_path or out
    if storage.is_remote(place):
        return None
    try:
        free = shutil.disk_usage(storage.local_path(place)).free
    except OSError:
        return None
    if free >= FULL_BELOW:
        return None
    return (f"the disk holding '{place}' is full ({free / 2**20:.0f} MiB free; checkpoints need room): free "
            f"space there (or set train.storage_path elsewhere), then rerun the same command to resume")


def _fit(cfg: TrainConfig, fit, plan: session.WorkerPlan, out: str, data: Artifact, s3: Any | None = None):
    """`fit()`'s result, or the error a user acts on: where the last good checkpoint is, what a
    refused checkpoint or a missing node needs, how to resume after Ctrl-C."""
    resume = f"rerun the same command to resume from the last checkpoint in {out}"
    # Train V2 and Tune install their own SIGINT handlers and leave them after a fit that ended
    # normally: the next Ctrl-C (publish, infer, serve) then only logged "Stop signal received".
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    try:
        result = fit()
    except (SystemExit, KeyboardInterrupt) as e:  # Ctrl-C: Train V2's own SIGINT handler aborts the
        # run, and the ray.get it interrupted raises SystemExit(1); the CLI had exited 1 saying nothing
        raise KeyboardInterrupt(resume) from e
    except Exception as e:  # Train V2 raises once train.max_failures retries are used up
        if refusal := refusal_in(e):  # a refused checkpoint: rerunning cannot help, say why
            raise TrainError(refusal) from e
        if capacity.is_capacity_timeout(e):  # a lost node was never replaced: say what is missing
            raise capacity.capacity_error(plan, cfg.capacity_timeout_s, out,
                                          worker_resources=cfg.worker_resources) from e
        raise TrainError(f"training failed after train.max_failures={cfg.max_failures} retries; "
                         f"{_data_replaced(data, s3) or _disk_full(cfg, out) or resume}: {solo.first_line(e)}") from e
    finally:
        if main and handler is not None:
            signal.signal(signal.SIGINT, handler)
    if result.error:  # Tune's trial (stages.train.solo) returns its error; a refused checkpoint is one
        if refusal := refusal_in(result.error):
            raise TrainError(refusal) from result.error
        last = result.checkpoint.path if result.checkpoint else "none"
        why = _data_replaced(data, s3) or _disk_full(cfg, out) or resume
        raise TrainError(f"training failed after train.max_failures={cfg.max_failures} retries "
                         f"(last good checkpoint: {last}); {why}: {solo.first_line(result.error)}") from result.error
    return result


def _run_locked(cfg: TrainConfig, data: Artifact, out: str, *, seed: int, ray_cfg: RayConfig,
                s3: Any | None, overwrite: bool, tracking: dict | None) -> Artifact:
    started = time.perf_counter()
    if not overwrite and (done := published(cfg, data, out, seed, s3)) is not None:
        return done
    shards = check_data(cfg, data, s3)
    init = check_init(cfg, data, s3)  # before Ray starts; `trained`: its mean/std where unset
    trained = init.train if init else cfg
    state_uri, name = state_location(cfg, out)
    made_by = fingerprint.for_train(section_dict(cfg), seed, data.manifest, init.record["sha256"] if init else None)
    resumes = fingerprint.guard(state_uri, name, made_by, s3, overwrite=overwrite)
    ingest_ray.check_plan(cfg, ray_cfg.data_reserved_cpus)
    resources = session.start(ray_cfg)
    plan = session.plan_workers(cfg, resources, ray_cfg.data_reserved_cpus)
    loop = {**loop_config(trained, data, shards, seed, s3, plan), "fingerprint": made_by.as_dict(),
            **finetune.shipped(init)}
    if init and tracking:
        # the mean/std the workers use: train.augment's params are the config as given
        log_params(tracking, {"init": {k: init.record[k] for k in ("sha256", "kind", "head", "normalisation",
                                                                   "mean", "std")}})
    host = _host(cfg, plan, state_uri, name, resumes, s3)
    if host == "tune_trial":
        attempt = solo.Attempt(cfg, loop, plan, state_uri, name, s3)
        fit, run_uri = attempt.fit, attempt.run_uri
        ingest = {"ingest": "stream", "resume": ingest_ray.RESUME["stream"]}
    else:
        datasets, ingest = ray_data_datasets(trained, loop, plan)
        fit = build_trainer(cfg, loop, plan, state_uri, name, s3, datasets=datasets).fit
        run_uri = storage.join(state_uri, name)
    publish.warm_up_curves()  # beside fit(): the driver only waits there
    if tracking:
        tracking_model.warm_up()  # MLflow's requirement check, 2.9 s of publishing on 2 cores
    timings = {"before_fit_s": time.perf_counter() - started, "fit_started_at": time.time(), "host": host}
    with EpochLog(tracking, run_uri, s3):  # the epochs' MLflow points
        result = _fit(cfg, fit, plan, out, data, s3)
        timings["fit_ended_at"] = time.time()  # before the epochs' last MLflow points (EpochLog's exit)
    # The loop ends early only when the loss (or val loss) stops being finite. Its report of that
    # carries no checkpoint, and Train V2's result keeps only checkpointed metrics: the sign is a
    # last checkpoint short of train.epochs (or none at all when epoch 1 diverged).
    done = (result.metrics or {}).get("epoch", 0)
    if (result.metrics or {}).get("stopped") == "nan_loss" or done < cfg.epochs:
        last = result.checkpoint.path if result.checkpoint else "none"
        raise TrainError(f"loss became NaN/inf in epoch {done + 1}; stopped, nothing published. Last good "
                         f"checkpoint: {last}. Lower train.lr or use precision=fp32")
    artifact = publish.publish(cfg, data, out, result, plan, loop, time.perf_counter() - started, s3, timings)
    return ingest_ray.annotate(artifact, ingest, s3)
