"""Tune stage: a real ASHA search over TorchTrainer trials on the shared 2-CPU Ray.

Every trial is a Ray Train run (20-40 s of fixed start-up here), so one search serves all the
tests: 4 samples of lr x precision, one worker per trial, one trial at a time (which trial reaches
an ASHA rung first must not depend on timing; test_trials_fill_two_cpus_beside_the_data_reserve
covers concurrency). lr=1e-5 learns nothing, so ASHA stops such a trial at its first rung once a good one
has been recorded; a sampled precision=fp16 passes config validation but raises in the worker on
CPU (a trial that fails at run time). The search is interrupted once a first trial has finished
(SIGUSR1, Tune's stop signal) and resumed by calling the stage again.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stages import etl, predict, tune
from stages import streaming
from workflow import demo_data
from workflow.core.config import ConfigError, load_config
from tests.conftest import REPO

# tune.seed=19 samples, in trial order: (1e-5, fp32) (0.01, fp16) (0.01, fp32) (1e-5, fp32).
# Trial 0 (bad) sets rung 1; trial 1 fails; trial 2 (good) passes; trial 3 (bad) falls below the
# rung's median and is stopped. fp32 is listed 3 times to weight it.
SPACE = ("tune.search_space={lr: {type: choice, values: [0.01, 0.00001]}, "
         "precision: {type: choice, values: [fp32, fp32, fp32, fp16]}}")
BASE = ["etl.image_size=16", "etl.shard_max_rows=64", "train.width=8", "train.batch_size=16",
        "train.optimizer=adamw", "train.max_failures=0", "tune.max_failures=0", "tune.num_samples=4",
        "tune.max_epochs=3", "tune.grace_period=1", "tune.reduction_factor=2", "tune.scheduler=asha",
        "tune.seed=19", "train.augment.flip=true", "tune.max_concurrent_trials=1", SPACE]


def _cfg(*extra):
    return load_config(REPO / "configs/smoke.yaml", BASE + list(extra))


def _trials_csv(out: Path) -> dict[str, dict]:
    with open(out / "trials.csv", newline="") as f:
        return {row["trial_id"]: row for row in csv.DictReader(f)}


def _finished_trials(out: Path) -> int:
    done = 0
    for result in (out / "ray" / "tune").glob("trial-*/result.json"):
        lines = result.read_text().splitlines()
        try:
            done += bool(lines) and json.loads(lines[-1]).get("done") is True
        except ValueError:  # a line being written
            pass
    return done


def _interrupt_after_first_finished_trial(out: Path, sent: list, deadline_s: float = 600) -> None:
    """SIGUSR1 once one trial has finished (another is then still running or not started): the
    resumed search must keep the finished one as it is and continue the others."""
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        if _finished_trials(out) >= 1:
            if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):  # Tune's handler
                os.kill(os.getpid(), signal.SIGUSR1)
                sent.append(time.time())
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, ray_session):
    root = tmp_path_factory.mktemp("tune")
    demo_data.generate(root / "src", images=300, seed=1, classes=3)
    return etl.run(_cfg().etl, str(root / "src"), str(root / "ds"))


@pytest.fixture(scope="module")
def search(dataset, tmp_path_factory):
    """(trials after the interruption, Tune result files then, resumed artifact, output folder)."""
    cfg = _cfg()
    out = tmp_path_factory.mktemp("search") / "tune"
    sent: list = []
    watcher = threading.Thread(target=_interrupt_after_first_finished_trial, args=(out, sent), daemon=True)
    watcher.start()
    with pytest.raises(tune.TuneInterrupted, match="to resume it"):
        tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    watcher.join()
    assert sent, "the search was never interrupted"
    assert not (out / "manifest.json").exists(), "an interrupted search must not publish"
    before = _trials_csv(out)
    results = {p.parent.name: p.read_bytes() for p in (out / "ray" / "tune").glob("*/result.json")}
    checks: list = []
    with pytest.MonkeyPatch.context() as mp:  # the resumed search runs to the end and publishes
        verify = etl.verify
        mp.setattr(etl, "verify", lambda *a, **k: checks.append(a) or verify(*a, **k))
        artifact = tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    assert len(checks) == 1, "the data (every shard re-hashed) must be checked once per search"
    return before, results, artifact, out


def test_resume_after_interruption_keeps_finished_trials(search):
    before, results, artifact, out = search
    finished = {t: r for t, r in before.items() if r["status"] == "TERMINATED"}
    assert finished, f"no trial had finished before the interruption: {before}"
    assert len(before) < 4 or any(r["status"] == "UNFINISHED" for r in before.values()), before
    after = _trials_csv(out)
    assert len(after) == 4 and set(before) <= set(after)
    for trial_id, row in finished.items():  # not re-run: same wall time, same result rows
        assert (after[trial_id]["wall_s"], after[trial_id]["epochs_run"]) == (row["wall_s"], row["epochs_run"])
        (folder,) = [name for name in results if trial_id in name]
        assert (out / "ray" / "tune" / folder / "result.json").read_bytes() == results[folder]
    assert {r["status"] for r in after.values()} <= {"TERMINATED", "ERROR"}
    assert artifact.manifest["kind"] == "raymill.tune" and (out / "manifest.json").is_file()


def test_no_placement_group_is_left_reserved_after_asha_stops_trials(search):
    """Trials that ASHA stopped (or the interruption ended) free their trainers' placement groups
    by Ray Train's own cleaner (State API, served by the dashboard), with no raymill code."""
    from ray.util.state import list_placement_groups

    _, _, _, out = search
    assert any(r["outcome"] == "stopped_early" for r in _trials_csv(out).values())
    deadline, held = time.time() + 60, None
    while time.time() < deadline:  # the cleaner polls; give it a few rounds
        held = list_placement_groups(filters=[("state", "=", "CREATED")], detail=True)
        if not held:
            break
        time.sleep(2)
    assert not held, f"placement groups still reserved after the search: {held}"


def test_asha_stops_a_trial_early_and_exports_a_loadable_model(search, dataset):
    _, _, artifact, out = search
    rows = _trials_csv(out)
    stopped = [r for r in rows.values() if r["outcome"] == "stopped_early"]
    assert stopped and all(int(r["epochs_run"]) < 3 and r["stopped_early"] == "True" for r in stopped)
    assert all(float(r["lr"]) == 1e-5 for r in stopped), "ASHA stopped a good trial"
    m = artifact.manifest["metrics"]
    assert m["trials"] == 4 and m["stopped_early"] == len(stopped) and 0 <= m["test_acc"] <= 1
    best = json.loads((out / "best.json").read_text())
    assert best["params"]["lr"] == 0.01 and best["params"]["precision"] == "fp32"
    assert best["metric"] == "val_acc" and best["value"] == m["best_val_acc"]
    assert Path(best["checkpoint"]).is_dir() and best["checkpoint"].startswith(str(out / "ray"))
    assert (out / "search.png").read_bytes()[:4] == b"\x89PNG" and (out / "trials.md").is_file()
    model, info = predict.load_model(str(out))
    assert info["classes"] == dataset.manifest["classes"] and info["tune"]["trial_id"] == best["trial_id"]
    (ref,) = streaming.shard_refs(dataset.manifest, dataset.path, "test", "parquet")[:1]
    key, label, image = streaming.read_shard(ref.uri, "parquet")[0]
    pixels = predict.preprocess(image, info)
    (pred,) = predict.predict_arrays(model, info, [pixels])
    assert pred["class_name"] in info["classes"] and len(pred["top_k"]) == 3
    assert np.isclose(sum(p["probability"] for p in pred["top_k"]), 1.0, atol=1e-4)


def test_a_trial_that_raises_is_recorded_and_the_search_goes_on(search):
    _, _, artifact, out = search
    rows = _trials_csv(out)
    failed = [r for r in rows.values() if r["status"] == "ERROR"]
    assert len(failed) == 1 and failed[0]["precision"] == "fp16" and failed[0]["outcome"] == "failed"
    assert "fp16" in failed[0]["error"], failed[0]["error"]
    assert sum(r["status"] == "TERMINATED" for r in rows.values()) == 3
    assert artifact.manifest["metrics"]["failed"] == 1
    assert "| ERROR | failed |" in (out / "trials.md").read_text()


def test_a_search_made_with_another_config_is_refused_naming_the_key(search, dataset):
    _, _, artifact, out = search
    published = (out / "manifest.json").read_bytes()
    cfg = _cfg("tune.grace_period=2")
    with pytest.raises(ConfigError, match=r"tune\.grace_period: 1 -> 2.*use a new output folder"):
        tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    assert (out / "manifest.json").read_bytes() == published
    assert (out / "ray" / "tune.fingerprint.json").exists()


def test_config_errors_name_the_key(dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"tune\.search_space\.lr\.type"):
        load_config(REPO / "configs/smoke.yaml", ["tune.search_space.lr.type=gaussian"])
    cfg = _cfg("tune.search_space={batch_size: {type: randint, lower: 0, upper: 64}}")
    with pytest.raises(ConfigError, match=r"tune\.search_space\.batch_size: value 0"):
        tune.run(cfg.tune, cfg.train, dataset, str(tmp_path / "a"), ray_cfg=cfg.ray)
    cfg = _cfg("tune.search_space={num_workers: {type: randint, lower: 1, upper: 3}}")
    with pytest.raises(ConfigError, match=r"tune\.search_space\.num_workers.*tune\.workers_per_trial"):
        tune.run(cfg.tune, cfg.train, dataset, str(tmp_path / "b"), ray_cfg=cfg.ray)
    # 2 workers x 1 CPU per trial cannot fit beside the Ray Data reserve on 2 CPUs
    cfg = _cfg("tune.workers_per_trial=2", "train.cpus_per_worker=1")
    with pytest.raises(ConfigError, match=r"tune\.workers_per_trial=2 x 1 CPU but only 1\.49 CPUs"):
        tune.run(cfg.tune, cfg.train, dataset, str(tmp_path / "c"), ray_cfg=cfg.ray)
    assert not (tmp_path / "c" / "ray").exists()
    cfg = _cfg("tune.search_space={epochs: {type: choice, values: [2, 5]}}")
    with pytest.raises(ConfigError, match=r"tune\.search_space\.epochs: value 5 exceeds tune\.max_epochs=3"):
        tune.run(cfg.tune, cfg.train, dataset, str(tmp_path / "d"), ray_cfg=cfg.ray)


@pytest.mark.parametrize("override, fix", [("tune.handoff=retrain", "raymill train")])
def test_removed_modes_are_config_errors_that_name_the_fix(override, fix):
    with pytest.raises(ConfigError, match=rf"{override.replace('.', '[.]')} was removed.*{fix}"):
        load_config(REPO / "configs/smoke.yaml", [override])


def test_default_search_space_covers_augmentation_and_length():
    cfg = load_config(REPO / "configs/smoke.yaml").tune
    assert {"lr", "weight_decay", "augment.flip", "augment.random_resized_crop", "epochs"} <= set(cfg.search_space)
    assert max(cfg.search_space["epochs"].values) == cfg.max_epochs  # smoke: max_epochs 3
    assert load_config(None).train.augment.flip is False


def test_trials_fill_two_cpus_beside_the_data_reserve():
    from workflow.core import session

    cfg = load_config(REPO / "configs/smoke.yaml")
    plan = session.plan_trials(cfg.tune, cfg.train, {"CPU": 2.0, "GPU": 0.0}, cfg.ray.data_reserved_cpus)
    assert plan.concurrent_trials == 2 and 0.7 <= plan.workers.cpus_per_worker < 0.75
    used = 2 * (plan.workers.cpus_per_worker + session.TRIAL_DRIVER_CPUS)
    assert used <= 2.0 - cfg.ray.data_reserved_cpus + 1e-9
    big = session.plan_trials(cfg.tune, cfg.train, {"CPU": 16.0, "GPU": 0.0}, 0.5)
    # stream trials share what is left: 2 trials x 7.74 CPUs, each decoding in 8 processes
    assert big.concurrent_trials == cfg.tune.num_samples and big.workers.cpus_per_worker == 7.74
    assert big.workers.decode_processes == 8
