"""The one place raymill talks to MLflow: runs, params, per-epoch metrics, artifacts, the model.

A run is a small JSON-able handle (`{"uri", "run_id", ...}`). The driver logs a training run's
per-epoch metrics itself, from the checkpoints Train commits (stages.train.epoch_log): Ray Train V2
rejects logger callbacks, and MLflow in a worker cost its training CPU. Tracking never fails a
stage: the first error in a process logs one warning with the fix, and tracking stays off in that
process from then on.

Default store: SQLite in the run folder (MLflow 3's own default backend; its file store is
deprecated). `tracking.uri` points every process at one server instead, which clusters need.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from stages.common import locks, storage, tracking_model
from stages.common.tracking_guard import failed as _failed, guarded as _guarded, warn_once as _warn_once
from stages.common.artifacts import Artifact, code_version, config_hash
from stages.common.config import Config, ConfigError, TrackingConfig, section_dict

__all__ = ["Handle", "store_uri", "start", "log_params", "log_metrics", "epoch_metrics", "last_step", "warm_up", "log_files",
           "register_model", "end", "train", "tune", "tune_callbacks", "log_infer", "find",
           "ui_command", "TRACKING_FILE"]

log = logging.getLogger(__name__)

Handle = dict[str, Any]  # {"uri", "run_id", "experiment_id", "timeout_s", "resumed"}: JSON, crosses processes
TRACKING_FILE = "tracking.json"  # next to model.pt: which MLflow run made this model
RUN_FIGURES = ("images_per_s", "stall_fraction", "device_utilisation")  # a train manifest's, over all epochs
EPOCH_METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "images_per_s", "stall_fraction",
                 "wait_s", "compute_s", "device_utilisation", "decode_images_per_s", "test_acc", "lr")


def store_uri(cfg: TrackingConfig, folder: str) -> str | None:
    """`tracking.uri`, else SQLite in `folder`; None (tracking off) for a remote folder without a server."""
    if cfg.uri:
        return cfg.uri
    if storage.is_remote(folder):
        _warn_once(folder, f"tracking: no tracking.uri and '{folder}' is remote, so there is no place for "
                           f"an SQLite store; set tracking.uri=http://<host>:5000 (see README). Not tracked")
        return None
    path = Path(storage.local_path(folder)).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / 'mlflow.db'}"


def ui_command(uri: str) -> str:
    """The command that browses `uri`: MLflow's UI on loopback for a local store (`make run`
    installs the `ui` extra, full mlflow, which the skinny client lacks: flask and the web app)."""
    if uri.startswith("sqlite:"):
        return f"mlflow ui --backend-store-uri {shlex.quote(uri)} --host 127.0.0.1 --port 5000"  # a path with a space
    return f"open {uri}"


def _client(uri: str, timeout_s: float = 5.0):
    # A dead server must cost one short request, not MLflow's default of 7 retries with backoff.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, timeout_s))))
    from mlflow import MlflowClient

    if os.environ.get("RAYMILL_VERBOSE") != "1":  # schema set-up chatter on first use of a store;
        for name in ("alembic", "mlflow"):  # after the import: importing mlflow configures its logger
            logging.getLogger(name).setLevel(logging.WARNING)
        # log_model (tracking_model): its artifact copies draw tqdm bars, and ending its fluent run
        # prints "View run ... at" to stdout, which holds only the CLI's summary
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _experiment_id(client, name: str, uri: str, folder: str | None) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    # SQLite: artifacts beside the database, not in ./mlruns of whatever directory we run from.
    # A server stores (or proxies) artifacts itself.
    location = None
    if uri.startswith("sqlite:") and folder:
        location = Path(storage.local_path(folder)).resolve().joinpath("mlartifacts").as_uri()
    return client.create_experiment(name, artifact_location=location)


def start(cfg: TrackingConfig, folder: str, run_name: str, tags: dict[str, str],
          parent: Handle | None = None) -> Handle | None:
    """Start an MLflow run for the output `folder`, or resume the unfinished one it already has."""
    uri = store_uri(cfg, folder)
    if uri is None or uri in _failed:
        return None
    probe: Handle = {"uri": uri, "run_id": "", "timeout_s": cfg.timeout_s}
    return _start(probe, cfg, folder, run_name, tags, parent)


def warm_up(cfg: TrackingConfig, folder: str) -> None:
    """Import mlflow and open (on a first run: create and migrate) the store in a thread, while the
    pipeline starts Ray and runs ETL: 3.8 s of the 2-core demo's critical path before. The first
    real call waits for it (`_start`), so the two never touch a new store at once."""
    if not cfg.enabled or (not cfg.uri and storage.is_remote(folder)):
        return
    uri = store_uri(cfg, folder)
    if uri is not None and uri not in _WARMING:
        _WARMING[uri] = threading.Thread(target=_warm, args=(uri, cfg.timeout_s), name="raymill-mlflow-warm",
                                         daemon=True)
        _WARMING[uri].start()


def _warm(uri: str, timeout_s: float) -> None:
    try:
        _client(uri, timeout_s).search_experiments(max_results=1)
    except Exception:  # noqa: BLE001: the real call that follows fails the same way and warns once
        log.debug("tracking: warming %s failed", uri, exc_info=True)


_WARMING: dict[str, threading.Thread] = {}


def settle(timeout_s: float = 60.0) -> None:
    """Wait for warm-ups that no stage joined (the command failed before its first MLflow call): a
    process that exits in the middle of a new store's creation leaves a half-migrated mlflow.db."""
    for uri in list(_WARMING):
        _WARMING.pop(uri).join(timeout=timeout_s)


@_guarded()
def _start(probe: Handle, cfg: TrackingConfig, folder: str, run_name: str, tags: dict[str, str],
           parent: Handle | None) -> Handle:
    uri = probe["uri"]
    if (warming := _WARMING.pop(uri, None)) is not None:
        warming.join(timeout=max(30.0, 4 * cfg.timeout_s))
    client = _client(uri, cfg.timeout_s)
    experiment_id = _experiment_id(client, cfg.experiment, uri, folder)
    output = storage.local_path(folder) if not storage.is_remote(folder) else folder
    output = str(Path(output).resolve()) if not storage.is_remote(folder) else output
    # Ray Train resumes an interrupted stage in the same folder with the same config: so does this.
    same = f"tags.`raymill.output` = '{output}' and attributes.status != 'FINISHED'"
    if "raymill.config_hash" in tags:
        same += f" and tags.`raymill.config_hash` = '{tags['raymill.config_hash']}'"
    previous = client.search_runs([experiment_id], same, max_results=1)
    if previous:
        run = previous[0]
        client.update_run(run.info.run_id, status="RUNNING")
        log.info("tracking: resuming MLflow run %s", run.info.run_id)
    else:
        all_tags = {**tags, "raymill.output": output, "raymill.git_commit": code_version().get("git_commit", "")}
        if parent:
            all_tags["mlflow.parentRunId"] = parent["run_id"]
        run = client.create_run(experiment_id, tags=all_tags, run_name=run_name)
    return {"uri": uri, "run_id": run.info.run_id, "experiment_id": experiment_id,
            "timeout_s": cfg.timeout_s, "resumed": bool(previous)}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return flat


@_guarded()
def log_params(handle: Handle, params: dict[str, Any]) -> None:
    """Log a nested dict as `a.b` params (values as text, MLflow's 6000-character limit)."""
    from mlflow.entities import Param

    client = _client(handle["uri"], handle["timeout_s"])
    run = client.get_run(handle["run_id"])
    have = run.data.params
    items = [Param(k, v[:6000]) for k, v in _flatten(params).items() if k not in have]  # resume: keep first
    for start_at in range(0, len(items), 100):  # MLflow's batch limit is 100 params
        client.log_batch(handle["run_id"], params=items[start_at:start_at + 100])


@_guarded()
def log_metrics(handle: Handle, metrics: dict[str, Any], step: int | None = None) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
    _client(handle["uri"], handle["timeout_s"]).log_batch(handle["run_id"], metrics=items)


@_guarded()
def last_step(handle: Handle, key: str) -> int | None:
    """The highest step `key` has in the run (0 when it has none): where a resumed run's epochs go on."""
    history = _client(handle["uri"], handle["timeout_s"]).get_metric_history(handle["run_id"], key)
    return max((m.step for m in history), default=0)


def epoch_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """The MLflow metrics of one epoch's history row (stages.train.loop): EPOCH_METRICS only."""
    return {k: row[k] for k in EPOCH_METRICS if k in row}


@_guarded()
def log_files(handle: Handle, files: dict[str, str | bytes], artifact_path: str | None = None) -> None:
    """Upload `{name: local path or bytes}` into the run's artifacts (under `artifact_path`)."""
    client = _client(handle["uri"], handle["timeout_s"])
    with tempfile.TemporaryDirectory() as tmp:
        for name, content in files.items():
            local = Path(tmp) / name
            local.write_bytes(content if isinstance(content, bytes) else Path(content).read_bytes())
            client.log_artifact(handle["run_id"], str(local), artifact_path)


@_guarded()
def register_model(handle: Handle, name: str, files: dict[str, bytes]) -> str:
    """Log `files` (model.pt + model.json) as the run's MLflow pyfunc model and register it as a new
    version of `name` (stages/common/tracking_model); returns the version."""
    _client(handle["uri"], handle["timeout_s"])  # request limits and quiet loggers, as for every call
    return tracking_model.log_model(handle["uri"], handle["run_id"], files, registered_name=name)


@_guarded()
def _discard(handle: Handle) -> None:
    """A refused stage did no work: a run started for it is deleted (each refusal had left a FAILED
    run beside the real ones); a resumed run, which holds an earlier attempt's history, is ended."""
    client = _client(handle["uri"], handle["timeout_s"])
    client.set_terminated(handle["run_id"], status="FAILED")  # a deleted run had stayed RUNNING in the store
    if not handle.get("resumed"):
        client.delete_run(handle["run_id"])


@_guarded()
def end(handle: Handle, status: str = "FINISHED") -> None:
    _client(handle["uri"], handle["timeout_s"]).set_terminated(handle["run_id"], status=status)


@_guarded()
def _end_children(handle: Handle, status: str) -> None:
    """A stopped parent's child runs still RUNNING end with it: after a search's Ctrl-C, Tune did not
    call the trial logger's end (its in-flight trials' runs had stayed RUNNING for good). A resume
    takes each up again (stages.common.tracking_tune.TrialLogger)."""
    client = _client(handle["uri"], handle["timeout_s"])
    for run in client.search_runs([handle["experiment_id"]], max_results=10_000, filter_string=(
            f"tags.`mlflow.parentRunId` = '{handle['run_id']}' and attributes.status = 'RUNNING'")):
        client.set_terminated(run.info.run_id, status=status)


# ---- stage runs: what the pipeline and the CLI call ---------------------------------------------
def _data_params(data: Artifact) -> dict[str, Any]:
    counts = data.manifest.get("counts", {})
    return {"path": data.path, "manifest_hash": config_hash(data.manifest),
            "classes": len(data.manifest.get("classes", [])),
            **{f"rows_{split}": sum(c.values()) for split, c in counts.items()}}


def _finish(cfg: Config, handle: Handle | None, artifact: Artifact, s3: Any | None) -> None:
    """After publish: final metrics, artifacts, the registered model, and `tracking.json` beside it."""
    if handle is None:
        return
    fs, root = storage.filesystem(artifact.path, s3)

    def read(*names: str) -> dict[str, bytes]:
        return {n: fs.cat_file(storage.join(root, n)) for n in names if fs.exists(storage.join(root, n))}

    final = artifact.manifest.get("metrics", {})  # a train run's per-epoch names keep their histories;
    per_epoch = EPOCH_METRICS if artifact.stage == "train" else ()  # a search's run has none (test_acc was lost)
    # the run's feed figures (over all its epochs, as the manifest and console say them) under names of
    # their own: MLflow shows a per-epoch name's last epoch (995 img/s beside the manifest's 828)
    log_metrics(handle, {k: v for k, v in final.items() if k not in per_epoch}
                | {f"run_{k}": final[k] for k in RUN_FIGURES if k in per_epoch and final.get(k) is not None})
    log_files(handle, read("model.json", "curves.png", "manifest.json", "search.png", "trials.md"))
    version = register_model(handle, cfg.tracking.model_name, read("model.pt", "model.json"))
    end(handle, "FINISHED")
    if handle["uri"] in _failed:
        return  # nothing to point at: the run is incomplete
    record = {**{k: v for k, v in handle.items() if k != "resumed"},
              "model_name": cfg.tracking.model_name if version else None, "model_version": version}
    storage.write_bytes_atomic(fs, storage.join(root, TRACKING_FILE), json.dumps(record, indent=2).encode())
    log.info("tracking: MLflow run %s%s; browse with: %s", handle["run_id"],
             f", model {cfg.tracking.model_name} v{version}" if version else "", ui_command(handle["uri"]))


def _tracked(cfg: Config, data: Artifact, out: str, store: str | None, stage: str,
             section: dict[str, Any], body: Callable[[Handle | None], Artifact],
             reuse: Callable[[], Artifact | None] | None) -> Artifact:
    if not cfg.tracking.enabled:
        return body(None)
    # The stage's output lock first (the stage takes it again, re-entrantly): a second run refused
    # for a busy output had resumed the running job's MLflow run and marked it FAILED.
    with locks.output_lock(out, stage, cfg.s3):
        if reuse is not None and (done := reuse()) is not None:
            return done  # its MLflow run and model version stand: a new run had registered it again
        # run.name unset: the folder's ("demo" had named every user's runs)
        handle = start(cfg.tracking, store or out, f"{cfg.run.named(store or out)}-{stage}",
                       {"raymill.stage": stage, "raymill.config_hash": config_hash(section)})
        log_params(handle, {stage: section, "seed": cfg.run.seed, "data": _data_params(data),
                            "code": code_version()})
        try:
            artifact = body(handle)
        except ConfigError:  # refused before any work (another config in the output, a bad key)
            _discard(handle)
            raise
        except KeyboardInterrupt:  # Ctrl-C, or a search stopped before its end (TuneInterrupted)
            _end_children(handle, "KILLED")
            end(handle, "KILLED")
            raise
        except BaseException:
            _end_children(handle, "FAILED")
            end(handle, "FAILED")
            raise
        _finish(cfg, handle, artifact, cfg.s3)
    return artifact


def train(cfg: Config, data: Artifact, out: str, fit: Callable[[Handle | None], Artifact],
          store: str | None = None, reuse: Callable[[], Artifact | None] | None = None) -> Artifact:
    """Run `fit(handle)` (the train stage) as one MLflow run in the store of `store` (default `out`).

    `fit` logs each epoch into the handle's run (stages.train.epoch_log). `reuse()`,
    called under the output's lock, returns the model `out` already holds for this run, if any:
    then nothing is fitted or tracked again.
    """
    return _tracked(cfg, data, out, store, "train", section_dict(cfg.train), fit, reuse)


def tune(cfg: Config, data: Artifact, out: str, fit: Callable[[list], Artifact],
         store: str | None = None, reuse: Callable[[], Artifact | None] | None = None) -> Artifact:
    """Run `fit(callbacks)` (the tune stage) as a parent MLflow run; each trial becomes a child run.
    `reuse` as for `train`."""
    section = {**section_dict(cfg.tune), "train": section_dict(cfg.train)}
    return _tracked(cfg, data, out, store, "tune", section,
                    lambda parent: fit(tune_callbacks(parent, cfg.tracking, cfg.tune.max_epochs)), reuse)


def find(model_path: str, s3: Any | None = None) -> dict[str, Any] | None:
    """The MLflow run recorded beside a published model (`tracking.json`), if any."""
    fs, root = storage.filesystem(model_path, s3)
    path = storage.join(root, TRACKING_FILE)
    return storage.read_json(fs, path) if fs.exists(path) else None


def log_infer(cfg: Config, model_path: str, preds: Artifact, own_run: bool = False) -> None:
    """Batch inference's accuracy goes into the MLflow run of the model it used (the pipeline's
    infer on its own test split), or with `own_run` into a child run of it (`raymill infer` on any
    data: each such run had overwritten the model run's infer_accuracy with its own)."""
    if not cfg.tracking.enabled:
        return
    handle = find(model_path, cfg.s3)
    if handle is None:
        log.info("tracking: %s has no %s (trained untracked); infer metrics not tracked", model_path,
                 TRACKING_FILE)
        return
    target = _child_run(handle, {"mlflow.parentRunId": handle["run_id"], "raymill.stage": "infer",
                                 "raymill.output": preds.path}) if own_run else handle
    metrics = preds.manifest.get("metrics", {})
    log_metrics(target, {f"infer_{k}": metrics[k] for k in ("accuracy", "rows", "errors", "images_per_s")
                         if k in metrics})
    log_files(target, {"infer_manifest.json": json.dumps(preds.manifest, indent=2).encode()})
    if own_run:
        end(target, "FINISHED")


@_guarded()
def _child_run(parent: Handle, tags: dict[str, str]) -> Handle:
    client = _client(parent["uri"], parent["timeout_s"])
    run = client.create_run(parent["experiment_id"], tags=tags, run_name="infer")
    return {**parent, "run_id": run.info.run_id}


def tune_callbacks(parent: Handle | None, cfg: TrackingConfig, max_epochs: int) -> list:
    """Callbacks for the Tuner's `RunConfig(callbacks=...)`: one child MLflow run per trial under `parent`.

    Ray's `MLflowLoggerCallback`, guarded like the rest of this module, and ending a trial that the
    scheduler stopped before `max_epochs` as KILLED with tag `raymill.outcome=stopped_early`.
    """
    if parent is None:
        return []
    from stages.common.tracking_tune import TrialLogger  # imports Ray: only when a search runs

    return [TrialLogger(tracking_uri=parent["uri"], experiment_name=cfg.experiment, max_epochs=max_epochs,
                        tags={"mlflow.parentRunId": parent["run_id"], "raymill.stage": "tune-trial"})]

