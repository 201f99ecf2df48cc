"""Tune without a search: the checks of a search's config, the trial plan, the hand-off's ranking,
the trial summaries and the console line, on hand-made trials and checkpoints (no Ray)."""
from __future__ import annotations

import copy
import json
import pickle

import pytest

from stages.common.config import ConfigError, load_config
from stages.tune import checks as tune_checks
from stages.tune import stage as tune
from tests.conftest import REPO
from tests.test_tune import _cfg


def test_a_loaded_optimiser_takes_this_runs_lr_momentum_and_weight_decay():
    """What a PBT exploit relies on, on real torch objects: after loading a donor's optimiser and
    schedule, the trial's own values apply, at the schedule's position."""
    import types

    import torch

    from stages.train.finetune import optimizer as _optimizer
    from stages.train.loop import Worker, make_schedule
    from stages.common.config import TrainConfig

    def state(cfg: TrainConfig, steps: int):
        model = torch.nn.Linear(2, 2)
        opt = _optimizer(cfg, model)
        schedule = make_schedule(opt, 2, 10)
        for _ in range(steps):
            opt.step()
            schedule.step()
        return opt, schedule

    donor, mine = TrainConfig(lr=0.1, momentum=0.5, weight_decay=1e-3), TrainConfig(lr=0.01, momentum=0.9, weight_decay=1e-5)
    opt, schedule = state(mine, 0)
    donor_opt, donor_schedule = state(donor, 4)
    opt.load_state_dict(donor_opt.state_dict())
    schedule.load_state_dict(donor_schedule.state_dict())
    w = types.SimpleNamespace(cfg=mine, optimizer=opt, schedule=schedule)
    Worker.apply_hyperparameters(w)
    (group,) = opt.param_groups
    assert group["lr"] == pytest.approx(0.01 * schedule.lr_lambdas[0](4)) and schedule.last_epoch == 4
    assert (group["momentum"], group["weight_decay"]) == (0.9, 1e-5)
    opt.step()
    schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * schedule.lr_lambdas[0](5))


def test_a_search_that_would_rank_or_share_wrongly_is_refused_before_it_runs():
    # val_loss by mode max had handed on the worst model (exit 0); unset, the mode follows the metric
    assert _cfg("tune.metric=val_loss").tune.mode == "min"
    # a nested key set with --set nests it ("augment.type: Field required" had said nothing useful)
    nested = load_config(REPO / "configs/smoke.yaml", ["tune.search_space.augment.flip={type: choice, values: [true]}"])
    assert list(nested.tune.search_space) == ["augment.flip"]
    with pytest.raises(ConfigError, match=r"tune\.mode=max ranks val_loss the wrong way round.*set tune\.mode=min"):
        tune.check_search(_cfg("tune.metric=val_loss", "tune.mode=max").tune, _cfg().train)
    # a sampled ingest=ray_data had failed every such trial; a sampled use_gpu was recorded, not used
    for key, values in (("ingest", "[stream, ray_data]"), ("use_gpu", "[false, true]")):
        cfg = _cfg(f"tune.search_space={{{key}: {{type: choice, values: {values}}}}}")
        with pytest.raises(ConfigError, match=rf"tune\.search_space\.{key}: every trial of a search shares "
                                              rf"train\.{key}.*--set train\.{key}="):
            tune.check_search(cfg.tune, cfg.train)
    # a uniform range over a whole-number key: its ends passed, every draw failed every trial, with a
    # TypeError of Ray's copy of the error ("missing 1 required positional argument: 'problems'")
    cfg = _cfg("tune.search_space={width: {type: uniform, lower: 4, upper: 12}}")
    with pytest.raises(ConfigError, match=r"train\.width takes whole numbers.*\{type: randint, lower: 4, upper: 12\}"):
        tune.check_search(cfg.tune, cfg.train)
    refused = tune_checks._InvalidTrialConfig({"width": 4.5}, "width: not an integer")
    assert copy.copy(refused).problems == pickle.loads(pickle.dumps(refused)).problems == "width: not an integer"


@pytest.mark.parametrize("override, fix", [("tune.handoff=retrain", "raymill train")])
def test_removed_modes_are_config_errors_that_name_the_fix(override, fix):
    with pytest.raises(ConfigError, match=rf"{override.replace('.', '[.]')} was removed.*{fix}"):
        load_config(REPO / "configs/smoke.yaml", [override])


def test_pbt_searches_one_length_and_explores_the_optimiser():
    cfg = load_config(REPO / "configs/smoke.yaml", ["tune.scheduler=pbt"])
    assert "epochs" not in cfg.tune.search_space and "lr" in cfg.tune.search_space
    assert set(tune.param_space(cfg.tune, cfg.train)) >= {"lr", "momentum", "weight_decay"}
    with pytest.raises(ConfigError, match=r"tune\.search_space\.epochs: PBT"):
        tune.check_search(_cfg("tune.scheduler=pbt", "tune.search_space={epochs: {type: choice, values: [1, 3]}}").tune,
                          cfg.train)
    with pytest.raises(ConfigError, match=r"tune\.perturbation_interval=3 is not below tune\.max_epochs=3"):
        tune.check_search(_cfg("tune.scheduler=pbt", "tune.perturbation_interval=3").tune, cfg.train)


def test_default_search_space_covers_augmentation_and_length():
    cfg = load_config(REPO / "configs/smoke.yaml").tune
    assert {"lr", "weight_decay", "augment.flip", "augment.random_resized_crop", "epochs"} <= set(cfg.search_space)
    assert max(cfg.search_space["epochs"].values) == cfg.max_epochs  # smoke: max_epochs 3
    assert load_config(None).train.augment.flip is False


def test_trials_fill_two_cpus_beside_the_data_reserve():
    from stages.common import session

    cfg = load_config(REPO / "configs/smoke.yaml")
    plan = session.plan_trials(cfg.tune, cfg.train, {"CPU": 2.0, "GPU": 0.0}, cfg.ray.data_reserved_cpus)
    assert plan.concurrent_trials == 2 and 0.7 <= plan.workers.cpus_per_worker < 0.75
    used = 2 * (plan.workers.cpus_per_worker + session.TRIAL_DRIVER_CPUS)
    assert used <= 2.0 - cfg.ray.data_reserved_cpus + 1e-9
    big = session.plan_trials(cfg.tune, cfg.train, {"CPU": 16.0, "GPU": 0.0}, 0.5)
    # stream trials share what is left: 2 trials x 7.74 CPUs, each decoding in 8 processes
    assert big.concurrent_trials == cfg.tune.num_samples and big.workers.cpus_per_worker == 7.74
    assert big.workers.decode_processes == 8
    with pytest.raises(ConfigError, match=r"only 0.49 CPUs are free of 1 .*: give Ray more CPUs \(ray.num_cpus"):
        session.plan_trials(cfg.tune, cfg.train, {"CPU": 1.0, "GPU": 0.0}, 0.5)  # one trial worker already
    # the same, before a local Ray starts (it had waited for Ray and ETL); a cluster's room waits for Ray
    from stages.tune.checks import check_room

    one_cpu = cfg.ray.model_copy(update={"num_cpus": 1})
    with pytest.raises(ConfigError, match=r"only 0.49 CPUs are free of 1 "):
        check_room(cfg.tune, cfg.train, one_cpu)
    check_room(cfg.tune, cfg.train, one_cpu.model_copy(update={"address": "auto"}))
    check_room(cfg.tune, cfg.train, cfg.ray.model_copy(update={"num_cpus": 2}))
    # use_gpu on a cluster of no GPU: said so (it had said "only 1.49 CPUs are free")
    gpu = cfg.train.model_copy(update={"use_gpu": True})
    with pytest.raises(ConfigError, match=r"train.use_gpu=true: .* GPU, and the cluster has 0; "
                                          r"set train.use_gpu=false"):
        session.plan_trials(cfg.tune, gpu, {"CPU": 2.0, "GPU": 0.0}, cfg.ray.data_reserved_cpus)
    # 8 GPUs and 8 CPUs: a trial on each GPU, each worker below 1 CPU (7 at 1 CPU had left a GPU idle)
    eight = cfg.tune.model_copy(update={"num_samples": 8})
    plan = session.plan_trials(eight, gpu, {"CPU": 8.0, "GPU": 8.0, "node_cpus_per_gpu": 1.0}, 0.5)
    assert plan.concurrent_trials == 8 and 0.7 <= plan.workers.cpus_per_worker < 1.0, plan


def test_the_best_entry_is_handed_on_only_from_a_checkpoint_that_still_holds_it(tmp_path):
    """A PBT trial that exploited a donor numbers its checkpoints from the donor's, so the folder an
    earlier epoch reported can hold a later epoch (seen: checkpoint_000001 overwritten): that
    entry is passed over for the next best whose checkpoint holds what it scored."""
    from stages.common.config import TuneConfig
    from stages.tune import results

    def checkpoint(name: str, epoch: int, val_acc: float) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"epoch": epoch, "step": 0, "val": {"val_acc": val_acc}}))
        return str(folder)

    overwritten = checkpoint("checkpoint_000001", 3, 0.40)  # reported as epoch 1 at 0.90
    holds = checkpoint("checkpoint_000002", 2, 0.80)
    trials = [{"trial_id": "a", "status": "TERMINATED",
               "candidates": [{"epoch": 1, "value": 0.90, "checkpoint_path": overwritten},
                              {"epoch": 2, "value": 0.80, "checkpoint_path": holds},
                              {"epoch": 4, "value": 0.95, "checkpoint_path": str(tmp_path / "gone")}]}]
    best = results.pick_best(trials, TuneConfig(), str(tmp_path), None)
    assert best["entry"]["checkpoint_path"] == holds and best["entry"]["value"] == 0.80
    # a tie of val_acc goes to the better val_loss, not to the earlier epoch (which had val_loss 1e7)
    early, late = checkpoint("checkpoint_000003", 1, 0.5), checkpoint("checkpoint_000004", 3, 0.5)
    tied = [{"trial_id": "b", "status": "TERMINATED", "candidates": [
        {"epoch": 1, "value": 0.5, "checkpoint_path": early, "tie": tune_checks.tie_value({"val_loss": 1.07e7}, "val_acc")},
        {"epoch": 3, "value": 0.5, "checkpoint_path": late, "tie": tune_checks.tie_value({"val_loss": 2.1}, "val_acc")}]}]
    assert results.pick_best(tied, TuneConfig(), str(tmp_path), None)["entry"]["checkpoint_path"] == late


def test_every_trial_recorded_finished_is_finished_not_only_the_first(tmp_path):
    """A loop variable had reused the name of the finished trials' set: from the second trial on,
    the check was a substring test on the first trial's outcome ("completed"), and a resumed
    search whose trials ran to their end (saved done:false by Tune) stayed UNFINISHED for good."""
    import types

    import pandas as pd

    from stages.common.config import TrainConfig, TuneConfig
    from stages.tune import results

    ray_dir = tmp_path / "ray"
    grid = []
    for trial_id in ("aaaa1", "bbbb2", "cccc3"):
        results.mark_finished(str(ray_dir), trial_id, None)
        frame = pd.DataFrame([{"epoch": e, "position_step": 0, "val_acc": 0.5 + e / 10} for e in (1, 2)])
        grid.append(types.SimpleNamespace(path=str(ray_dir / f"trial-{trial_id}"), error=None, config={"lr": 0.1},
                                          metrics={"done": False, "epoch": 2}, metrics_dataframe=frame))
    # a resumed trial whose Tune record kept only its epoch 1 (seen after a PBT resume) while its own
    # checkpoints hold epoch 2: the row had said stopped_early with best epoch 1 beside 2 epochs run
    grid[2].metrics_dataframe = grid[2].metrics_dataframe.iloc[:1]
    kept = ray_dir / "trial-cccc3" / "checkpoint_000001"
    kept.mkdir(parents=True)
    (kept / "meta.json").write_text(json.dumps({"epoch": 2, "step": 0, "val": {"val_acc": 0.9}}))
    cfg = TuneConfig(max_epochs=2, search_space={"lr": {"type": "loguniform", "lower": 0.01, "upper": 0.2}})
    rows = results.summaries(grid, cfg, TrainConfig(epochs=2), str(ray_dir), None)
    assert [(r["trial_id"], r["status"], r["outcome"]) for r in rows] == \
        [(t, "TERMINATED", "completed") for t in ("aaaa1", "bbbb2", "cccc3")]
    assert (rows[2]["epochs_run"], rows[2]["best_epoch"], rows[2]["best"]) == (2, 2, 0.9)
    # an ASHA trial that ran to its end (no finished record: the scheduler stopped it at its last
    # report) whose restore failed after a driver kill: Tune says ERROR; its checkpoints hold both
    # epochs, so it is finished (it had been "failed", its best epoch out of the running)
    frame = pd.DataFrame([{"epoch": 1, "position_step": 0, "val_acc": 0.6}])
    lost = types.SimpleNamespace(path=str(ray_dir / "trial-dddd4"), config={"lr": 0.1}, metrics={"epoch": 1},
                                 error=ValueError("Could not recover from checkpoint as it does not exist"),
                                 metrics_dataframe=frame)
    for epoch in (1, 2):
        kept = ray_dir / "trial-dddd4" / f"checkpoint_00000{epoch}"
        kept.mkdir(parents=True)
        (kept / "meta.json").write_text(json.dumps({"epoch": epoch, "step": 0, "val": {"val_acc": 0.6 + epoch / 10}}))
    row = results.summaries([lost], cfg, TrainConfig(epochs=2), str(ray_dir), None)[0]
    assert (row["status"], row["outcome"], row["error"], row["best"]) == ("TERMINATED", "completed", "", 0.8), row


def test_a_trials_line_names_its_best_epoch_and_a_resumed_search_counts_on(caplog):
    """The line had shown the last epoch's value alone (val_acc 0.1282 beside a best of 0.1538 in
    trials.csv), and a resumed search numbered its trials from 1 again."""
    import logging
    import types

    from stages.tune.console import TrialLines

    lines = TrialLines(total=3, max_epochs=3, metric="val_acc", keys=["lr"])
    ended = types.SimpleNamespace(status="TERMINATED")
    trial = types.SimpleNamespace(trial_id="t1", status="RUNNING", config={"lr": 0.1}, last_result={})
    lines.on_step_begin(0, [ended, trial])
    for epoch, value in ((1, 0.5), (2, 0.7), (3, 0.6)):
        trial.last_result = {"epoch": epoch, "position_step": 0, "val_acc": value}
        lines.on_trial_result(0, [trial], trial, trial.last_result)
    lines.on_trial_result(0, [trial], trial, {"epoch": 3, "position_step": 5, "val_acc": -1.0})  # mid-epoch
    with caplog.at_level(logging.INFO, logger="stages.tune.console"):
        lines.on_trial_complete(0, [trial], trial)
    assert "tune: 2/3 trial t1 completed after 3/3 epoch(s), val_acc 0.6, best 0.7 at epoch 2; lr=0.1" in caplog.text
