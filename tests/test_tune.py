"""Tune stage: real ASHA and PBT searches on the shared 2-CPU Ray.

A one-worker trial runs the training loop inside its Tune function (no TorchTrainer), so a trial
costs seconds and the module runs three small searches:
- `search`: ASHA over 4 samples of lr x precision, one trial at a time, interrupted (Tune's stop
  signal, sent by a callback as soon as a first trial completes) and resumed by calling the stage
  again. A sampled precision=fp16 passes config validation but raises in the trial on CPU.
- `asha`: the same search without the interruption. Tune does not save a scheduler's state with
  the experiment (only trials, searcher and callbacks), so after a resume ASHA's rungs start
  empty; whether it stops a trial is checked on a search that runs in one go. lr=1e-5 learns
  nothing, so ASHA stops such a trial at its first rung once a good one has been recorded.
- `pbt`: PBT over 4 trials, 2 at a time, stopped after a few epoch reports and resumed.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from ray.tune import Callback

from stages.etl import stage as etl
from stages.etl import integrity
from stages.model import predict
from stages.tune import stage as tune
from stages.feed import streaming
from workflow import demo_data
from stages.common.config import ConfigError, load_config
from tests.conftest import REPO, lock_held, stray_decode_processes

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


class StopOnce(Callback):
    """Sends Tune's stop signal (SIGUSR1) to this process once: when a first trial completes
    (`after_reports=0`), or at the n-th epoch-end report. Tune keeps a search's callbacks for its
    resume, so `marker` (a file) makes sure the resumed search is not stopped again."""

    def __init__(self, marker: Path, after_reports: int = 0):
        self.marker, self.after_reports, self.reports = marker, after_reports, 0

    def _stop(self) -> None:
        if not self.marker.exists():
            self.marker.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_trial_complete(self, iteration, trials, trial, **info):
        if self.after_reports == 0:
            self._stop()

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.reports += result.get("position_step") == 0
        if self.after_reports and self.reports >= self.after_reports:
            self._stop()


def _interrupted_then_resumed(cfg, dataset, out: Path, after_reports: int = 0):
    """(trials.csv after the interruption, result files then, the resumed search's artifact)."""
    marker = out.parent / f"{out.name}.stopped"
    with pytest.raises(tune.TuneInterrupted, match="to resume it"):
        tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray,
                 callbacks=[StopOnce(marker, after_reports)])
    assert marker.exists(), "the search was never interrupted"
    assert not (out / "manifest.json").exists(), "an interrupted search must not publish"
    before = _trials_csv(out)
    results = {p.parent.name: p.read_bytes() for p in (out / "ray" / "tune").glob("*/result.json")}
    return before, results


@pytest.fixture(scope="module", autouse=True)
def before_searches(ray_session) -> dict[str, set[str]]:
    """Actors and placement groups alive before this module's searches (autouse: set up first).
    The session's Ray is shared: a `train.run` of another module leaves its TrainController alive
    while its driver holds the trainer (seen in the full suite, with Ray's own TorchConfig too)."""
    import ray
    from ray.util.state import list_actors, list_placement_groups

    at = ray.get_runtime_context().gcs_address  # this session's Ray, not the newest one on the machine
    return {"actors": {a.actor_id for a in list_actors(address=at, filters=[("state", "=", "ALIVE")], detail=True)},
            "groups": {g.placement_group_id for g in list_placement_groups(address=at, filters=[("state", "=", "CREATED")])}}


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
    before, results = _interrupted_then_resumed(cfg, dataset, out)
    checks: list = []
    with pytest.MonkeyPatch.context() as mp:  # the resumed search runs to the end and publishes
        verify_once = integrity.verify_once
        mp.setattr(integrity, "verify_once", lambda *a, **k: checks.append(a) or verify_once(*a, **k))
        artifact = tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    assert len(checks) == 1, "the data must be checked once per search"
    return before, results, artifact, out


@pytest.fixture(scope="module")
def asha(dataset, tmp_path_factory):
    """(artifact, output folder) of the ASHA search run in one go."""
    cfg = _cfg()
    out = tmp_path_factory.mktemp("asha") / "tune"
    return tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray), out


# PBT only exploits between trials that are running at once, so all 4 run together (0.35 CPU
# each) and a wider model makes an epoch long enough for them to overlap on 2 cores.
PBT = ["tune.scheduler=pbt", "tune.num_samples=4", "tune.max_epochs=4", "tune.perturbation_interval=1",
       "tune.max_concurrent_trials=4", "train.cpus_per_worker=0.35", "train.width=32", "train.optimizer=sgd",
       "tune.search_space={lr: {type: loguniform, lower: 0.001, upper: 0.1}}"]


@pytest.fixture(scope="module")
def pbt(dataset, tmp_path_factory):
    """(trials after the interruption, resumed artifact, output folder) of a PBT search stopped
    at its 3rd epoch report (trials are then mid-way) and resumed."""
    cfg = _cfg(*PBT)
    out = tmp_path_factory.mktemp("pbt") / "tune"
    before, _ = _interrupted_then_resumed(cfg, dataset, out, after_reports=3)
    return before, tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray), out


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


def test_pbt_stopped_and_resumed_accounts_for_every_trial_and_hands_on_its_model(pbt, dataset):
    before, artifact, out = pbt
    assert len(before) < 4 or any(r["status"] == "UNFINISHED" for r in before.values()), before
    rows = _trials_csv(out)
    assert len(rows) == 4 and {r["status"] for r in rows.values()} == {"TERMINATED"}, rows
    assert {"lr", "momentum", "weight_decay"} <= set(next(iter(rows.values())))
    assert artifact.manifest["config"]["scheduler"] == "pbt" and artifact.manifest["metrics"]["trials"] == 4
    _served_like_a_trained_model(out, dataset)


def test_pbt_exploits_a_donor_checkpoint_and_trains_with_its_own_explored_params(pbt):
    """A trial restarted from another trial's checkpoint must train with its own (explored) lr:
    every trial has the same schedule, so reported lr / config lr is the same at a given epoch
    in every trial, exploited or not. A donor's lr carried over in the optimiser state breaks it."""
    _, _, out = pbt
    rows = [r for f in (out / "ray" / "tune").glob("trial-*/result.json")
            for r in map(json.loads, f.read_text().splitlines()) if r.get("position_step") == 0]
    ratios: dict[int, set] = {}
    for r in rows:
        ratios.setdefault(r["epoch"], set()).add(round(r["lr"] / r["config"]["lr"], 6))
    assert ratios and all(len(v) == 1 for v in ratios.values()), ratios
    # Tune's own log of each exploit: [target, donor, ..., donor's config, explored config]
    exploits = [json.loads(line) for line in (out / "ray" / "tune" / "pbt_global.txt").read_text().splitlines()]
    assert exploits and all(e[-1] != e[-2] for e in exploits), "PBT never exploited a donor"
    # trials.csv names the values each trial's last report trained with (it had shown a donor's)
    last = {f.parent.name.removeprefix("trial-"): json.loads(lines[-1])["config"]
            for f in (out / "ray" / "tune").glob("trial-*/result.json") if (lines := f.read_text().splitlines())}
    assert last, "no trial reported"
    for trial_id, row in _trials_csv(out).items():  # a trial with no report yet keeps its sampled config
        if trial_id in last:
            assert float(row["lr"]) == pytest.approx(last[trial_id]["lr"], rel=1e-5), (trial_id, row, last[trial_id])
    # no exploit after the last epoch: it had reported epoch 4 twice, the second with a donor's weights
    # under settings that never trained (trials.csv and best.json then named them)
    finals = {f.parent.name: sum(1 for r in map(json.loads, f.read_text().splitlines())
                                 if r.get("position_step") == 0 and r.get("epoch") == 4)
              for f in (out / "ray" / "tune").glob("trial-*/result.json")}
    assert all(n <= 1 for n in finals.values()), finals


def test_searches_leave_no_trial_actor_placement_group_or_decode_process(before_searches, search, asha, pbt):
    """Trials that ASHA stopped, that PBT restarted, that failed, or that the interruption ended
    leave nothing behind (State API, and the machine's process table for decode pools)."""
    import ray
    from ray.util.state import list_actors, list_placement_groups

    at = ray.get_runtime_context().gcs_address  # this session's Ray, not the newest one on the machine
    ours = ("ImplicitFunc", "raymill_trial", "TrainController", "RayTrainWorker")
    deadline, actors, groups = time.time() + 60, None, None
    while time.time() < deadline:
        actors = [a.class_name for a in list_actors(address=at, filters=[("state", "=", "ALIVE")], detail=True)
                  if any(name in a.class_name for name in ours) and a.actor_id not in before_searches["actors"]]
        groups = [g for g in list_placement_groups(address=at, filters=[("state", "=", "CREATED")], detail=True)
                  if g.placement_group_id not in before_searches["groups"]]
        if not actors and not groups:
            break
        time.sleep(2)
    assert not actors, f"trial actors still alive after the searches: {actors}"
    assert not groups, f"placement groups still reserved after the searches: {groups}"
    assert not stray_decode_processes(), "decode processes outlived their trials"


def test_asha_stops_a_trial_early_and_exports_a_loadable_model(asha, dataset):
    artifact, out = asha
    rows = _trials_csv(out)
    stopped = [r for r in rows.values() if r["outcome"] == "stopped_early"]
    assert stopped and all(int(r["epochs_run"]) < 3 and r["stopped_early"] == "True" for r in stopped)
    assert all(float(r["lr"]) == 1e-5 for r in stopped), "ASHA stopped a good trial"
    m = artifact.manifest["metrics"]
    assert m["trials"] == 4 and m["stopped_early"] == len(stopped) and 0 <= m["test_acc"] <= 1
    best = json.loads((out / "best.json").read_text())
    assert best["params"]["lr"] == 0.01 and best["params"]["precision"] == "fp32"
    assert m["startup_s_median"] is not None and set(artifact.manifest["startup_s"]) == set(rows)
    assert artifact.manifest["resource_plan"]["trial_in_function"] is True
    _served_like_a_trained_model(out, dataset)


def _served_like_a_trained_model(out: Path, dataset) -> None:
    """best.json names a checkpoint of the search, and model.pt predicts on a stored test image
    through predict (the path `raymill serve` and `infer` load)."""
    best = json.loads((out / "best.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert best["metric"] == "val_acc" and best["value"] == manifest["metrics"]["best_val_acc"]
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


def test_trials_that_ended_before_max_epochs_stay_finished_after_a_resume(dataset, tmp_path):
    """A trial whose function returns before tune.max_epochs is `done` only in Tune's memory: after
    an interruption every rerun had read it as unfinished (Tune did not run it again) and refused
    to publish. stages.tune.finished records it."""
    cfg = _cfg("tune.num_samples=2", "tune.scheduler=fifo", "tune.max_epochs=2",
               "tune.search_space={epochs: {type: choice, values: [1]}}")
    out = tmp_path / "tune"
    before, _ = _interrupted_then_resumed(cfg, dataset, out)
    assert [r["status"] for r in before.values()].count("TERMINATED") >= 1, before
    artifact = tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    assert artifact.manifest["kind"] == "raymill.tune"
    rows = _trials_csv(out)
    assert {r["status"] for r in rows.values()} == {"TERMINATED"}
    # the record a restored search reads (Tune's saved last result of such a trial says done: false)
    assert {p.name for p in (out / "ray" / "tune" / "finished").iterdir()} == set(rows)


def test_a_search_made_with_another_config_is_refused_naming_the_key(search, dataset):
    _, _, artifact, out = search
    published = (out / "manifest.json").read_bytes()
    cfg = _cfg("tune.grace_period=2")
    with pytest.raises(ConfigError, match=r"tune\.grace_period: 1 -> 2.*use a new output folder"):
        tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    assert (out / "manifest.json").read_bytes() == published
    assert (out / "ray" / "tune.fingerprint.json").exists()
    # the same check the CLI makes before Ray's start and MLflow's store (it had come after both)
    with pytest.raises(ConfigError, match=r"tune\.grace_period: 1 -> 2.*use a new output folder"):
        tune.check_state(cfg.tune, cfg.train, dataset, str(out), 0)
    same = _cfg()
    tune.check_state(same.tune, same.train, dataset, str(out), 0)  # its own config: resumable


def test_a_second_search_into_a_held_output_is_refused_before_anything_runs(dataset, tmp_path):
    """tune.run holds its output's lock, as train.run does: another process's search there is
    refused naming it, and nothing is written beside its lock."""
    from stages.common import locks

    out = tmp_path / "held"
    with lock_held(out, "tune") as holder:
        cfg = _cfg()
        with pytest.raises(locks.OutputLockedError, match=f"pid {holder.pid}"):
            tune.run(cfg.tune, cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
        assert sorted(p.name for p in out.iterdir()) == [locks.LOCK_NAME]


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
    with pytest.raises(ConfigError, match=r"tune\.workers_per_trial=2 x 1 CPU \(and 0\.01 for its driver\) but only "
                                          r"1\.49 CPUs.*: lower tune\.workers_per_trial, lower train\.cpus_per_worker"):
        tune.run(cfg.tune, cfg.train, dataset, str(tmp_path / "c"), ray_cfg=cfg.ray)
    assert not (tmp_path / "c" / "ray").exists()
    cfg = _cfg("tune.search_space={epochs: {type: choice, values: [2, 5]}}")
    with pytest.raises(ConfigError, match=r"tune\.search_space\.epochs: value 5 exceeds tune\.max_epochs=3"):
        tune.run(cfg.tune, cfg.train, dataset, str(tmp_path / "d"), ray_cfg=cfg.ray)


def test_a_reused_trial_actor_hands_out_the_same_model_and_rng_as_a_fresh_build():
    """`reuse_actors` keeps one model per shape in the actor: a later trial must start from the
    same weights and the same torch RNG state as a fresh seeded build would give it."""
    import torch

    from stages.model.zoo import build_model
    from stages.train.run_hooks import TuneHooks

    hooks = object.__new__(TuneHooks)  # no Ray needed to build models

    def seeded_build():
        torch.manual_seed(7)
        return hooks.build(("small_cnn", 3, 8, 0.0, 7, False), lambda: build_model("small_cnn", 3, 8))

    first = seeded_build()
    fresh = {k: v.clone() for k, v in first.state_dict().items()}
    after_fresh = torch.rand(3)
    with torch.no_grad():  # the first trial trains it
        next(first.parameters()).add_(1.0)
    again = seeded_build()
    assert again is first, "the actor's model was rebuilt, not reused"
    assert all(torch.equal(again.state_dict()[k], v) for k, v in fresh.items())
    assert torch.equal(torch.rand(3), after_fresh)


def test_a_search_whose_every_trial_diverges_says_so(dataset, tmp_path):
    # one trial, lr 1e12: it diverges in epoch 1; the error said only "First errors: none recorded"
    cfg = _cfg("tune.num_samples=1", "tune.max_epochs=1", "tune.scheduler=fifo",
               "tune.search_space={lr: {type: choice, values: [1.0e12]}}", "train.optimizer=sgd")
    with pytest.raises(tune.TuneError, match="1 diverged .* lower tune.search_space.lr"):
        tune.run(cfg.tune, cfg.train, dataset, str(tmp_path / "tune"), seed=0, ray_cfg=cfg.ray)


