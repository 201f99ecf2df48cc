"""MLflow tracking against real MLflow: a real `mlflow server` on 127.0.0.1 and the SQLite store.

The runs are queried back with MlflowClient: params, per-epoch metrics, artifacts, the registered
model, infer accuracy in the model's run, and parent/child runs for a Tune search. The pipeline
test is also the end-to-end `raymill run --serve` test (with stage reuse on rerun). One test kills
the server mid-run: training still finishes, with one tracking warning.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, answers_ok, free_port
from stages.common import tracking, tracking_guard
from stages.train.epoch_log import EpochLog
from workflow import demo_data
from stages.common.config import load_config

MLFLOW = str(Path(sys.executable).with_name("mlflow"))


class Server:
    """A real `mlflow server` process on 127.0.0.1 with its own SQLite store and artifact folder."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = open(root / "server.log", "wb")
        self.proc = subprocess.Popen(
            [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
             "--artifacts-destination", str(root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT)
        # slow on a loaded 2-core machine
        if answers_ok(f"{self.uri}/health", 120, alive=lambda: self.proc.poll() is None):
            return
        assert self.proc.poll() is None, (root / "server.log").read_text()[-2000:]
        self.stop()
        raise RuntimeError(f"mlflow server did not answer in 120 s: {(root / 'server.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def mlflow_server(tmp_path):
    server = Server(tmp_path)
    yield server
    server.stop()


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _runs(uri: str, experiment: str = "raymill") -> list:
    client = _client(uri)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


@pytest.mark.slow
def test_pipeline_with_serve_tracks_on_a_server_then_reuses_every_stage(tmp_path, ray_session, mlflow_server,
                                                                        caplog):
    """`raymill run --serve` end to end, tracked on a real MLflow server; then reruns that reuse
    every stage, or all but the one whose config changed (one pipeline run serves all three checks)."""
    from ray import serve as ray_serve

    from stages.serve import app as serve
    from workflow import pipeline

    demo_data.generate(tmp_path / "src", images=160, seed=3)
    overrides = [f"run.source={tmp_path / 'src'}", f"run.dir={tmp_path / 'run'}", f"tracking.uri={mlflow_server.uri}",
                 "tracking.experiment=pipeline-test", "tracking.model_name=pipeline-test",
                 f"serve.port={free_port()}", "serve.app_name=pipeline-test"]
    cfg = load_config(REPO / "configs/smoke.yaml", overrides)
    try:
        report = pipeline.run(cfg, serve=True)
    finally:
        serve.shutdown(cfg.serve)
        ray_serve.shutdown()  # Serve's proxy keeps its port for the whole Ray session
    _check_run_folder(tmp_path / "run", report, rows=160)
    # the probe sends every test image (a split under 50 images, some twice): by image, serve's
    # answers score as batch inference's (by request, a repeat had counted twice)
    assert report["serve"]["accuracy"] == pytest.approx(report["test_accuracy"]), report["serve"]

    client = _client(mlflow_server.uri)
    (run,) = _runs(mlflow_server.uri, "pipeline-test")
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags["raymill.stage"] == "train"
    # params: resolved train config, data manifest hash and counts, code version
    params = run.data.params
    assert params["train.epochs"] == "2" and params["train.batch_size"] == "16"
    assert params["data.rows_train"] != "0" and len(params["data.manifest_hash"]) == 16
    assert params["code.raymill"] and params["seed"] == "0"
    # per-epoch metrics from rank 0: one point per epoch, steps 1..epochs
    for key in ("train_loss", "train_acc", "val_acc", "images_per_s", "stall_fraction"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2], key
    assert 0 <= run.data.metrics["test_acc"] <= 1
    shown = json.loads((Path(report["outputs"]["model"]) / "manifest.json").read_text())["metrics"]
    for key in ("images_per_s", "stall_fraction"):  # the run's figures, as the manifest says them
        assert run.data.metrics[f"run_{key}"] == pytest.approx(shown[key]), key
    assert run.data.metrics["infer_accuracy"] == pytest.approx(report["test_accuracy"])
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"model.json", "curves.png", "manifest.json"} <= names
    version = client.get_model_version("pipeline-test", "1")  # an MLflow pyfunc, logged through the server
    assert version.run_id == run_id and version.source.startswith("models:/")
    held = client.list_logged_model_artifacts(version.source.split("/")[-1], "artifacts")
    assert {a.path for a in held} == {"artifacts/model.json", "artifacts/model.pt"}
    # the model folder and the report point at the run
    assert tracking.find(report["outputs"]["model"])["run_id"] == run_id
    assert run_id in (tmp_path / "run" / "report.md").read_text()

    caplog.set_level(logging.INFO)
    again = pipeline.run(cfg)  # same config and inputs: nothing is recomputed
    reused = [r.getMessage() for r in caplog.records if "reusing" in r.getMessage()]
    assert len(reused) == 3, reused
    assert [r["reused"] for r in again["stages"]] == [True] * 3 and again["table"].count("| reused (unchanged") == 3
    changed = load_config(REPO / "configs/smoke.yaml", overrides + ["infer.top_k=2"])
    caplog.clear()
    pipeline.run(changed)  # only the stage whose config changed runs again
    reused = [r.getMessage().split(":")[0] for r in caplog.records if "reusing" in r.getMessage()]
    assert reused == ["etl", "train"]
    assert len(_runs(mlflow_server.uri, "pipeline-test")) == 1, "a reused train stage must not start a run"


def _check_run_folder(run: Path, report: dict, rows: int) -> None:
    for name in ("config.yaml", "report.json", "report.md", "etl/manifest.json", "train/model.pt",
                 "infer/predictions.parquet"):
        assert (run / name).exists(), name
    saved = json.loads((run / "report.json").read_text())
    assert saved["stages"][0]["rows"] == rows and [s["stage"] for s in saved["stages"]] == ["etl", "train", "infer"]
    assert saved["serve"]["requests"] > 0 and saved["serve"]["p50_ms"] > 0
    assert 0 <= saved["test_accuracy"] <= 1 and 0 <= saved["input_stall_fraction"] <= 1
    assert report["test_accuracy"] == saved["test_accuracy"]


@pytest.mark.slow
def test_server_down_mid_run_training_finishes_with_one_warning(tmp_path, ray_session, mlflow_server, caplog,
                                                                capfd):
    from stages.etl import stage as etl
    from stages.train import stage as train

    demo_data.generate(tmp_path / "src", images=120, seed=5)
    cfg = load_config(REPO / "configs/smoke.yaml", [f"tracking.uri={mlflow_server.uri}",
                                                    "tracking.experiment=down-test", "train.epochs=3"])
    data = etl.run(cfg.etl, str(tmp_path / "src"), str(tmp_path / "etl"))

    def fit(handle):
        assert handle is not None  # the run started while the server was up
        mlflow_server.stop()  # ... and now it is gone for the rest of the run
        return train.run(cfg.train, data, str(tmp_path / "train"), ray_cfg=cfg.ray, tracking=handle)

    caplog.set_level(logging.WARNING, logger="stages.common.tracking")
    started = time.monotonic()
    artifact = tracking.train(cfg, data, str(tmp_path / "train"), fit)
    assert artifact.manifest["metrics"]["epochs"] == 3 and (tmp_path / "train" / "model.pt").exists()
    assert not (tmp_path / "train" / tracking.TRACKING_FILE).exists()  # nothing to point at
    driver = [r.getMessage() for r in caplog.records if r.name == "stages.common.tracking"]
    assert len(driver) == 1 and mlflow_server.uri in driver[0] and "tracking.enabled=false" in driver[0]
    time.sleep(2)  # Ray forwards worker output asynchronously
    # Worker lines carry Ray's "(<actor> pid=...)" prefix (a Train worker, or the one-worker host's
    # actor); the driver's own line may be on stderr too when an earlier test configured the CLI's
    # console handler in this process.
    worker = sum(1 for line in capfd.readouterr().err.splitlines()
                 if " pid=" in line and f"tracking: MLflow at {mlflow_server.uri} failed" in line)
    assert worker <= 1  # rank 0 warns at most once in its process, not once per epoch
    assert time.monotonic() - started < 600


def _checkpoint(run_folder, epoch: int, history: list[dict], meta: str | None = None) -> None:
    folder = run_folder / f"checkpoint-e{epoch:03d}-s000000-a"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(meta or json.dumps({"epoch": epoch, "history": history}))


def test_sqlite_store_default_resume_and_disabled(tmp_path):
    cfg = load_config(None, [])
    folder = tmp_path / "out"
    handle = tracking.start(cfg.tracking, str(folder), "unit", {"raymill.stage": "train"})
    assert handle["uri"] == f"sqlite:///{folder.resolve() / 'mlflow.db'}"
    tracking.log_params(handle, {"train": {"lr": 0.1, "augment": {"flip": True}}, "tags": [1, 2]})
    run_folder = tmp_path / "ray" / "train"  # Ray Train's run folder, as stages.train.loop fills it
    with EpochLog(handle, str(run_folder), poll_s=0.05) as epochs:
        for epoch in (1, 2, 3):
            history = [{"epoch": e, "train_loss": 1.0 / e, "val_acc": 0.1 * e, "verdict": "text is not a metric"}
                       for e in range(1, epoch + 1)]
            _checkpoint(run_folder, epoch, history)
            if epoch == 2:
                _checkpoint(run_folder, 3, history, meta="{\"epoch\": 3, \"hist")  # still being copied
                deadline = time.monotonic() + 10
                while epochs.logged < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.2)
                assert epochs.logged == 2  # the complete one is logged while training; the partial waits
                (run_folder / "checkpoint-e003-s000000-a").rename(run_folder / "partial")
    assert epochs.logged == 3
    with EpochLog(handle, str(run_folder), poll_s=0.05) as resumed:  # a resumed run: nothing again
        assert resumed.logged == 3
    again = tracking.start(cfg.tracking, str(folder), "unit", {"raymill.stage": "train"})
    assert again["run_id"] == handle["run_id"]  # an unfinished run in the same folder is resumed
    tracking.end(handle)
    client = _client(handle["uri"])
    run = client.get_run(handle["run_id"])
    assert run.data.params == {"train.lr": "0.1", "train.augment.flip": "True", "tags": "[1, 2]"}
    assert [m.value for m in client.get_metric_history(handle["run_id"], "val_acc")] == pytest.approx([0.1, 0.2, 0.3])
    assert "verdict" not in run.data.metrics
    assert run.info.artifact_uri.startswith((folder.resolve() / "mlartifacts").as_uri())
    fresh = tracking.start(cfg.tracking, str(folder), "unit", {"raymill.stage": "train"})
    assert fresh["run_id"] != handle["run_id"]  # a finished run is never reopened
    off = load_config(None, ["tracking.enabled=false"])
    assert tracking.train(off, None, str(folder), lambda handle: handle) is None  # fit(None), no MLflow


def test_unreachable_server_warns_once_and_never_raises(caplog):
    cfg = load_config(None, [f"tracking.uri=http://127.0.0.1:{free_port()}", "tracking.timeout_s=1"])
    caplog.set_level(logging.WARNING, logger="stages.common.tracking")
    started = time.monotonic()
    assert tracking.start(cfg.tracking, "unused", "x", {}) is None
    handle = {"uri": cfg.tracking.uri, "run_id": "0" * 32, "timeout_s": 1}
    tracking.log_metrics(handle, {"train_loss": 1.0}, step=1)
    tracking.end(handle)
    assert len(caplog.records) == 1 and "failed" in caplog.records[0].getMessage()
    assert time.monotonic() - started < 30  # no retry storm against a dead server


@pytest.mark.slow
def test_tune_parent_run_with_one_child_per_trial(tmp_path, ray_session, mlflow_server):
    from ray import tune

    def trial(config: dict) -> None:  # defined here: shipped to Tune's workers by value
        import time

        import ray.tune

        for epoch in range(1, 5):  # poor trials (low quality) are stopped by ASHA at epoch 1
            ray.tune.report({"epoch": epoch, "val_acc": config["quality"] * epoch / 4, "test_acc": 0.5})
            time.sleep(0.2)

    cfg = load_config(None, [f"tracking.uri={mlflow_server.uri}", "tracking.experiment=tune-test"])
    parent = tracking.start(cfg.tracking, str(tmp_path), "search", {"raymill.stage": "tune"})
    callbacks = tracking.tune_callbacks(parent, cfg.tracking, max_epochs=4)
    tuner = tune.Tuner(
        tune.with_resources(trial, {"CPU": 0.5}),
        param_space={"quality": tune.grid_search([1.0, 0.1, 0.2])},  # the best first: ASHA cuts the rest
        tune_config=tune.TuneConfig(metric="val_acc", mode="max", max_concurrent_trials=1,
                                    scheduler=tune.schedulers.ASHAScheduler(max_t=4, grace_period=1,
                                                                            reduction_factor=2,
                                                                            time_attr="epoch")),
        run_config=tune.RunConfig(name="tracking-test", storage_path=str(tmp_path / "ray"), callbacks=callbacks))
    grid = tuner.fit()
    tracking.end(parent)
    assert len(grid) == 3 and not grid.errors

    runs = _runs(mlflow_server.uri, "tune-test")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent["run_id"]]
    assert len(children) == 3 and len(runs) == 4  # the parent and one child per trial
    outcomes = {r.data.params["quality"]: (r.data.tags["raymill.outcome"], r.info.status) for r in children}
    assert outcomes["1.0"] == ("completed", "FINISHED")
    assert outcomes["0.1"] == outcomes["0.2"] == ("stopped_early", "KILLED")  # ASHA-stopped, visibly
    child = children[0]
    assert len(_client(mlflow_server.uri).get_metric_history(child.info.run_id, "val_acc")) >= 1
    assert not any(k.startswith("test_") for r in children for k in r.data.metrics)  # the hand-off's only


def test_a_pbt_exploit_logs_the_explored_config_as_metrics_and_tracking_goes_on(tmp_path, caplog):
    # MLflow params are write-once: re-logging the explored lr as a param raised, and the one
    # warning switched tracking off for the rest of the search (parent run and model included)
    from ray.tune.experiment import Trial

    from stages.common.tracking_tune import TrialLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = TrialLogger(tracking_uri=uri, experiment_name="pbt", max_epochs=4, tags={})
    logger.setup()
    trial = Trial("trainable", config={"lr": 0.1, "momentum": 0.9, "model": "cnn"}, stub=True, trial_id="t1")
    logger.log_trial_start(trial)
    trial.set_config({"lr": 0.12, "momentum": 0.9, "model": "cnn"})  # what PBT does before restarting it
    caplog.set_level(logging.WARNING, logger="stages.common.tracking")
    logger.log_trial_start(trial)
    assert not tracking_guard.has_failed(uri) and not caplog.records
    client = _client(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pbt").experiment_id])
    run_id = run.info.run_id
    assert client.get_run(run_id).data.params["lr"] == "0.1"  # the trial's starting point
    assert [m.value for m in client.get_metric_history(run_id, "config.lr")] == [0.1, 0.12]


def test_the_mlflow_outcome_is_trials_mds_rule_a_trials_own_epochs_and_divergence(tmp_path):
    # the tag had its own rule: it compared with tune.max_epochs (a searched `epochs` of 2 read
    # "stopped_early") and knew no "diverged" (a NaN loss read "completed", FINISHED)
    from ray.tune.experiment import Trial

    from stages.common.tracking_tune import TrialLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = TrialLogger(tracking_uri=uri, experiment_name="ends", max_epochs=4, tags={})
    logger.setup()
    ends = {"short": ({"epochs": 2}, {"epoch": 2}), "nan": ({}, {"epoch": 1, "stopped": "nan_loss"}),
            "cut": ({}, {"epoch": 1}), "whole": ({}, {"epoch": 4})}
    for name, (config, last) in ends.items():
        trial = Trial("trainable", config={"name": name, **config}, stub=True, trial_id=name)
        logger.log_trial_start(trial)
        trial.update_last_result({"training_iteration": last["epoch"], **last})
        logger.log_trial_end(trial)
    client = _client(uri)
    runs = client.search_runs([client.get_experiment_by_name("ends").experiment_id])
    got = {r.data.params["name"]: (r.data.tags["raymill.outcome"], r.info.status) for r in runs}
    assert got == {"short": ("completed", "FINISHED"), "nan": ("diverged", "FAILED"),
                   "cut": ("stopped_early", "KILLED"), "whole": ("completed", "FINISHED")}


def test_an_ad_hoc_infer_is_a_child_run_and_leaves_the_models_infer_accuracy(tmp_path):
    from stages.common.artifacts import Artifact

    cfg = load_config(None, [])
    model = tmp_path / "train"
    handle = tracking.start(cfg.tracking, str(model), "unit", {"raymill.stage": "train"})
    tracking.log_metrics(handle, {"infer_accuracy": 0.9})  # the pipeline's infer on its test split
    tracking.end(handle)
    (model / tracking.TRACKING_FILE).write_text(json.dumps(handle))
    preds = Artifact("infer", str(tmp_path / "preds"), {"metrics": {"accuracy": 0.5, "rows": 3}})
    tracking.log_infer(cfg, str(model), preds, own_run=True)
    client = _client(handle["uri"])
    assert client.get_run(handle["run_id"]).data.metrics["infer_accuracy"] == 0.9
    (child,) = client.search_runs([handle["experiment_id"]], f"tags.`mlflow.parentRunId` = '{handle['run_id']}'")
    assert child.data.metrics == {"infer_accuracy": 0.5, "infer_rows": 3} and child.info.status == "FINISHED"
    assert child.data.tags["raymill.output"] == str(tmp_path / "preds")


def test_a_refused_stage_leaves_no_mlflow_run(tmp_path):
    # a train refused for another config in its output had left a FAILED run per attempt
    from stages.common.artifacts import Artifact
    from stages.common.config import ConfigError

    cfg = load_config(None, [])
    data = Artifact("etl", str(tmp_path / "etl"), {"counts": {"train": {"a": 1}}, "classes": ["a"]})

    def refused(handle):
        assert handle is not None  # its run had started
        raise ConfigError("'out/ray/train' holds run state made with another config")

    with pytest.raises(ConfigError):
        tracking.train(cfg, data, str(tmp_path / "train"), refused)
    client = _client(tracking.store_uri(cfg.tracking, str(tmp_path / "train")))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    assert client.search_runs([experiment.experiment_id]) == []


def test_epoch_log_reads_the_one_worker_hosts_checkpoint_names(tmp_path):
    """Tune numbers the trial's checkpoints (stages/train/solo.py): the newest is the highest
    number, not the last in text order (checkpoint_000010 after checkpoint_000009)."""
    for index, epochs in ((2, 1), (9, 2), (10, 3)):
        folder = tmp_path / f"checkpoint_{index:06d}"
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"history": [{"epoch": e} for e in range(1, epochs + 1)]}))
    (tmp_path / "params.json").write_text("{}")  # Tune's own files beside them are passed over
    assert [h["epoch"] for h in EpochLog(None, str(tmp_path))._new_history()] == [1, 2, 3]


def test_an_interrupted_searchs_trial_runs_end_killed_and_a_resume_goes_on_in_them(tmp_path):
    # after Ctrl-C the in-flight trials' runs had stayed RUNNING for good, and the resume started a
    # second child run for each of them
    from ray.tune.experiment import Trial

    from stages.common.tracking_tune import TrialLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tags = {"mlflow.parentRunId": "parent-1", "raymill.stage": "tune-trial"}
    first = TrialLogger(tracking_uri=uri, experiment_name="resume", max_epochs=4, tags=dict(tags))
    first.setup()
    trial = Trial("trainable", config={"lr": 0.1}, stub=True, trial_id="t1")
    first.log_trial_start(trial)
    trial.set_status(Trial.RUNNING)
    first.on_experiment_end([trial])  # Tune's cleanup, interrupted search
    client = _client(uri)
    experiment = client.get_experiment_by_name("resume").experiment_id
    (run,) = client.search_runs([experiment])
    assert run.info.status == "KILLED"
    again = TrialLogger(tracking_uri=uri, experiment_name="resume", max_epochs=4, tags=dict(tags))
    again.setup()  # the resumed search: a fresh callback (Tune unpickles it) and the same trial
    again.log_trial_start(trial)
    (resumed,) = client.search_runs([experiment])
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "RUNNING"
    trial.set_status(Trial.TERMINATED)
    again.on_experiment_end([trial])
    assert client.get_run(run.info.run_id).info.status == "RUNNING"  # ended by log_trial_end, not here


def test_a_stopped_searchs_trial_runs_end_with_it(tmp_path):
    """After a search's Ctrl-C Tune did not call the trial logger's end: its in-flight trials' child
    runs had stayed RUNNING for good. The parent's end takes its RUNNING children with it."""
    cfg = load_config(None, [])
    parent = tracking.start(cfg.tracking, str(tmp_path), "search", {"raymill.stage": "tune"})
    client = _client(parent["uri"])
    running = client.create_run(parent["experiment_id"], tags={"mlflow.parentRunId": parent["run_id"]})
    done = client.create_run(parent["experiment_id"], tags={"mlflow.parentRunId": parent["run_id"]})
    client.set_terminated(done.info.run_id, status="FINISHED")
    tracking._end_children(parent, "KILLED")
    assert client.get_run(running.info.run_id).info.status == "KILLED"
    assert client.get_run(done.info.run_id).info.status == "FINISHED"


def test_the_ui_hint_can_be_pasted_for_a_path_with_a_space():
    import shlex

    from stages.common.tracking import ui_command

    said = ui_command("sqlite:////tmp/tr dir ü/mlflow.db")
    assert shlex.split(said)[:4] == ["mlflow", "ui", "--backend-store-uri", "sqlite:////tmp/tr dir ü/mlflow.db"], said
