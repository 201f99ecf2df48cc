"""Tune stage: a hyperparameter search (ASHA, PBT or FIFO) over the training loop.

`Tuner(raymill_trial, param_space=..., tune_config=TuneConfig(scheduler=...))`, where each trial is
one Tune function (`_run_trial`), hosted one of two ways (`session.TrialPlan.in_function`):
- one worker (the default): the function runs `stages.train.loop.train_loop` itself with
  `run_hooks.TuneHooks`, reporting each epoch (metrics + checkpoint) through `ray.tune.report`. No
  TorchTrainer, controller or second placement group: a trial starts in about a second, and
  `reuse_actors` runs the next trial in the same actor (process, imports and model kept);
- several workers (or `train.ingest=ray_data`): the Train V2 driver pattern of Ray's guide. The
  function (0.01 CPU) builds the train stage's TorchTrainer (`stages.train.stage.build_trainer`) with
  `RunConfig(callbacks=[TuneReportCallback()])`, which forwards every `ray.train.report` to Tune.
  When a scheduler stops such a trial its controller dies with the driver and Ray Train's own
  placement-group cleaner frees the workers (it asks the State API: keep the dashboard on).
PBT's exploit is Tune's own: the trial restarts with the donor's checkpoint as its
`ray.tune.get_checkpoint()`, and the loop applies the explored lr/momentum/weight decay.
`session.plan_trials` decides how many trials run at once so the Ray Data reserve stays free.

Outputs in `out/` (written by stages.tune.results): trials.csv, trials.md, best.json, search.png,
the best model as model.pt + model.json, curves.png + metrics.jsonl of that model, and
manifest.json last. Ray state lives under `out/ray/`: the Tune experiment in `out/ray/tune` (with
one-worker trials' checkpoints), a TorchTrainer trial's Train run in `out/ray/trial-<trial id>`.

Resume: running again with the same output folder and config restores the search
(`Tuner.restore`): finished and failed trials are kept as they are, unfinished ones continue from
their last checkpoint. A different config, seed or data for the same folder is a ConfigError.
Tune does not save a scheduler's state, so a resumed ASHA or PBT starts with empty rungs/scores.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from stages.train import checkpointing, finetune
from stages.train import stage as train
from stages.train.checks import check_output_files
from stages.tune import results as tune_results
from stages.train.run_hooks import TuneHooks
from stages.train.loop import train_loop
from stages.tune.checks import (EXPERIMENT, PBT_KEYS, check_search, check_state, searched_keys,  # noqa: F401 (API)
                                 state_fix, state_key, trial_train_config)
from stages.common import console, fingerprint, session, storage, tracking_model
from stages.common.artifacts import Artifact, data_fingerprint, find_published
from stages.common.config import RayConfig, TrainConfig, TuneConfig, section_dict
from stages.common.locks import output_lock

__all__ = ["run", "published", "searched_models", "TuneError", "TuneInterrupted", "param_space", "trial_train_config", "check_search", "check_state",
           "EXPERIMENT", "searched_keys", "pbt_mutations", "PBT_KEYS"]

log = logging.getLogger(__name__)



class TuneError(RuntimeError):
    """The search ran but produced no usable model (every trial failed)."""


class TuneInterrupted(KeyboardInterrupt):
    """The search stopped before every trial finished (Ctrl-C, which Tune itself catches, or Tune's
    stop signal); running again resumes it. An interrupt: the CLI exits 130, MLflow says KILLED."""


# ---- config -------------------------------------------------------------------------------------


def param_space(cfg: TuneConfig, train_cfg: TrainConfig | None = None) -> dict[str, Any]:
    """tune.search_space -> Ray Tune sampling domains (randint includes `upper`). Under PBT the
    explored knobs that the space leaves out start from PBT's own ranges: PBT perturbs a trial's
    current value, so every trial's config must hold one."""
    from ray import tune

    space = {}
    if cfg.scheduler == "pbt":
        space = {k: tune.choice(v) if isinstance(v, list) else v
                 for k, v in pbt_mutations(cfg, train_cfg or TrainConfig()).items()}
    for key, d in cfg.search_space.items():
        if d.type == "loguniform":
            space[key] = tune.loguniform(d.lower, d.upper)
        elif d.type == "uniform":
            space[key] = tune.uniform(d.lower, d.upper)
        elif d.type == "randint":
            space[key] = tune.randint(int(d.lower), int(d.upper) + 1)
        else:
            space[key] = tune.choice(list(d.values))
    return space


_MOMENTA = [0.0, 0.5, 0.8, 0.9, 0.95, 0.99]  # a list: PBT shifts to a neighbour, never past 0.99


def pbt_mutations(cfg: TuneConfig, train_cfg: TrainConfig) -> dict[str, Any]:
    """PBT's explore step: lr and weight decay resampled from their search range (or a decade
    around train.*) or scaled by 0.8/1.2; momentum shifted along _MOMENTA."""
    from ray import tune

    def log_range(key: str, default: tuple[float, float]):
        d = cfg.search_space.get(key)
        if d is not None and d.type in ("loguniform", "uniform"):
            return tune.loguniform(d.lower, d.upper) if d.type == "loguniform" else tune.uniform(d.lower, d.upper)
        return tune.loguniform(*default)

    wd = train_cfg.weight_decay or 1e-4
    return {"lr": log_range("lr", (train_cfg.lr / 10, train_cfg.lr * 10)),
            "weight_decay": log_range("weight_decay", (wd / 10, wd * 10)), "momentum": _MOMENTA}


def searched_models(cfg: TuneConfig, train_cfg: TrainConfig) -> list[str]:
    """Every train.model a trial of the search may build."""
    return cfg.models(train_cfg.model)


def _scheduler(cfg: TuneConfig, train_cfg: TrainConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if cfg.scheduler == "asha":
        # time_attr "epoch" (completed epochs), not training_iteration: mid-epoch checkpoint
        # reports (train.checkpoint_every_steps) would otherwise count as iterations.
        return ASHAScheduler(time_attr="epoch", max_t=cfg.max_epochs, grace_period=cfg.grace_period,
                             reduction_factor=cfg.reduction_factor)
    if cfg.scheduler == "pbt":
        # Exploit: a bottom-quantile trial restarts from a top trial's latest checkpoint, which
        # Tune hands to it through `ray.tune.get_checkpoint()` (public API, no cloning code here);
        # the loop then applies the explored lr/momentum/weight decay (stages.train.loop.Worker.apply_hyperparameters).
        return PopulationBasedTraining(time_attr="epoch", perturbation_interval=cfg.perturbation_interval,
                                       hyperparam_mutations=pbt_mutations(cfg, train_cfg),
                                       quantile_fraction=0.25, resample_probability=0.25)
    return FIFOScheduler()


# ---- trial driver (runs inside a Tune trial actor) ------------------------------------------------
def _make_driver(ctx: dict):
    """The Tune function of one trial. `ctx` is plain, picklable data (it travels to the actor)."""

    def raymill_trial(config: dict) -> None:
        _run_trial(ctx, config)

    return raymill_trial


def _run_trial(ctx: dict, config: dict) -> None:
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    started_at = time.time()  # the trial's start-up is measured from here to its first batch
    tune_cfg, train_cfg = TuneConfig(**ctx["tune"]), TrainConfig(**ctx["train"])
    tcfg = trial_train_config(train_cfg, config, tune_cfg)
    loop = {**ctx["loop"], "train": section_dict(tcfg), "started_at": started_at}
    trial_id = ray.tune.get_context().get_trial_id()
    if ctx["in_function"]:  # one worker: the loop runs here, reporting to Tune itself
        train_loop(loop, TuneHooks())
        tune_results.mark_finished(ctx["ray_dir"], trial_id, ctx["s3"])
        return
    # The Train run's name must not change when this trial is retried or the search resumed:
    # Train V2 then restores the run from its own latest checkpoint.
    name = f"trial-{trial_id}"
    datasets, _ = train.ray_data_datasets(tcfg, loop, ctx["plan"])  # ray_data workers read Train's shards
    trainer = train.build_trainer(tcfg, loop, ctx["plan"],
                                  ctx["ray_dir"], name, ctx["s3"], callbacks=[TuneReportCallback()],
                                  metric=tune_cfg.metric, mode=tune_cfg.mode, datasets=datasets)
    trainer.fit()  # raises when the run fails: Tune records the trial as ERROR
    tune_results.mark_finished(ctx["ray_dir"], trial_id, ctx["s3"])


def _trial_dirname(trial) -> str:
    """Tune's folder of a trial, `trial-<id>`: results find their trial (and its Train run) by it."""
    return f"trial-{trial.trial_id}"


# ---- run ------------------------------------------------------------------------------------------
def run(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, out: str, *, seed: int = 0,
        ray_cfg: RayConfig = RayConfig(), s3: Any | None = None, callbacks: Sequence[Any] = ()) -> Artifact:
    """Search `cfg.search_space` over the trainer on ETL artifact `data`; publish the best model.

    `callbacks` go into the search's `RunConfig` (experiment trackers such as
    `stages.common.tracking_tune`'s MLflow callback); a restored search keeps those it started with.
    One search per output: the output is locked for the search, as train locks its run.
    """
    check_output_files(out, "tune", s3)  # someone's folder, not a tune output
    with output_lock(out, "tune", s3):
        return _run_locked(cfg, train_cfg, data, out, seed=seed, ray_cfg=ray_cfg, s3=s3, callbacks=callbacks)


def _run_locked(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, out: str, *, seed: int,
                ray_cfg: RayConfig, s3: Any | None, callbacks: Sequence[Any]) -> Artifact:
    started = time.perf_counter()
    check_search(cfg, train_cfg)
    if (done := published(cfg, train_cfg, data, out, seed, s3)) is not None:
        return done
    shards = train.check_data(train_cfg, data, s3, searched_models(cfg, train_cfg))  # the search's one data check
    init = train.check_init(train_cfg, data, s3, searched_models(cfg, train_cfg))  # every trial starts from it
    trained = init.train if init else train_cfg  # its mean/std where unset; key and manifest keep train_cfg
    ray_dir = storage.join(out, "ray")
    # The one resume guard of every stage: the search's config, seed and data content are recorded
    # beside its Tune state (`tune.fingerprint.json`) and a search made by others is refused, before
    # Ray's start (it had been 7-8 s later); a fresh one is recorded once its plan holds.
    key = state_key(cfg, train_cfg, data, seed, init.record["sha256"] if init else None)
    guard = lambda: fingerprint.guard(ray_dir, EXPERIMENT, fingerprint.compute(key), s3,  # noqa: E731
                                      fix=state_fix(ray_dir))
    if resumes := fingerprint.holds_state(ray_dir, EXPERIMENT, s3):
        guard()
    resources = session.start(ray_cfg)
    plan = session.plan_trials(cfg, train_cfg, resources, ray_cfg.data_reserved_cpus)
    if not resumes:  # this run holds the output's lock: no other search wrote state meanwhile
        guard()
    ctx = {"tune": section_dict(cfg), "train": section_dict(trained), "plan": plan.workers,
           "ray_dir": ray_dir, "s3": s3, "in_function": plan.in_function,
           "loop": {**train.loop_config(trained, data, shards, seed, s3, plan.workers), **finetune.shipped(init),
                    "rank_metric": cfg.metric}}  # the loop scores the test split at each best of it
    log.info("tune: %d trial(s), %s, %d at a time, %d worker(s) x %g CPU each; %g CPU kept for Ray Data",
             cfg.num_samples, cfg.scheduler, plan.concurrent_trials, plan.workers.num_workers,
             plan.workers.cpus_per_worker, ray_cfg.data_reserved_cpus)
    if callbacks:  # tracked (stages.common.tracking): the best model is logged after the search
        tracking_model.warm_up()
    grid = _fit(cfg, train_cfg, _make_driver(ctx), plan, ray_dir, s3, callbacks)
    trials = tune_results.summaries(grid, cfg, train_cfg, ray_dir, s3)
    fs, root = storage.filesystem(out, s3)
    tune_results.write_tables(fs, root, trials, cfg)
    unfinished = [t for t in trials if t["status"] not in ("TERMINATED", "ERROR")]
    if unfinished or len(trials) < cfg.num_samples:
        raise TuneInterrupted(
            f"the search stopped with {len(unfinished)} trial(s) unfinished "
            f"({', '.join(t['trial_id'] for t in unfinished) or '-'}) and "
            f"{cfg.num_samples - len(trials)} not started; run the same command with the same "
            f"output '{out}' to resume it (finished trials are kept)")
    best = tune_results.pick_best(trials, cfg, ray_dir, s3)
    if best is None:
        errors = [f"{t['trial_id']}: {t['error']}" for t in trials if t["error"]][:3]
        diverged = sum(t["outcome"] == "diverged" for t in trials)
        if scored := sum(bool(t["candidates"]) for t in trials if t["status"] == "TERMINATED"):
            raise TuneError(f"{scored} finished trial(s) scored epochs, but no checkpoint still holds a scored "
                            f"epoch (deleted, or reused by a later one: the log names each); see {out}/trials.md "
                            f"and run the search again into a new --output (or delete '{ray_dir}' to start over)")
        raise TuneError(f"all {len(trials)} trial(s) failed or reported nothing; see {out}/trials.md. "
                        + (f"{diverged} diverged (loss NaN/inf): lower tune.search_space.lr's range. "
                           if diverged else "") + f"First errors: {'; '.join(errors) or 'none recorded'}")
    return tune_results.publish(cfg, train_cfg, data, out, seed=seed, s3=s3, plan=plan, loop=ctx["loop"],
                                trials=trials, best=best, seconds_so_far=time.perf_counter() - started)


def published(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, out: str, seed: int,
               s3: Any | None) -> Artifact | None:
    """The search already published in `out` by this config, seed and data, or None.

    A finished search is not restored and re-fitted: Tune's periodic experiment snapshot can
    predate the last trial's end, and restoring it would run that trial again.
    """
    done = find_published(out, "tune", section_dict(cfg), {"seed": seed, "train": section_dict(train_cfg),
                          "data_fingerprint": data_fingerprint(data.manifest), **train.init_inputs(train_cfg, s3)}, s3)
    if done is not None:
        log.info("tune: %s already holds this search's result (same config, seed and data); reusing it", out)
    return done


def _fit(cfg: TuneConfig, train_cfg: TrainConfig, driver, plan: session.TrialPlan, ray_dir: str, s3,
         callbacks: Sequence[Any] = ()):
    """Start the search, or resume the one saved in `ray_dir` (its fingerprint checked before Ray's start)."""
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from stages.tune import console as tune_console  # imports Ray: only when a search runs

    pafs, base = storage.pyarrow_filesystem(ray_dir, s3)
    experiment = f"{base}/{EXPERIMENT}"
    trainable = tune.with_resources(driver, plan.trial_resources(train_cfg.worker_resources))
    if tune.Tuner.can_restore(experiment, storage_filesystem=pafs):
        log.info("tune: resuming the search in %s/%s (finished trials are kept)", ray_dir, EXPERIMENT)
        tune_console.verbosity()  # its switches: a restored RunConfig keeps `verbose`, not them (a resume
        # had drawn Tune's configuration box, its TensorBoard hint and its snapshot warnings)
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_unfinished=True,
                                   resume_errored=False, storage_filesystem=pafs)
    else:
        tuner = tune.Tuner(
            trainable, param_space=param_space(cfg, train_cfg),
            tune_config=tune.TuneConfig(
                metric=cfg.metric, mode=cfg.mode, num_samples=cfg.num_samples,
                scheduler=_scheduler(cfg, train_cfg), trial_dirname_creator=_trial_dirname,
                # One actor runs trial after trial: its process, imports and model are paid once.
                reuse_actors=plan.in_function,
                # Seeded sampling needs our own BasicVariantGenerator, and Tune then ignores
                # TuneConfig.max_concurrent_trials (it warns), so the limit goes to the generator.
                search_alg=BasicVariantGenerator(random_state=cfg.seed, max_concurrent=plan.concurrent_trials)),
            run_config=tune.RunConfig(
                name=EXPERIMENT, storage_path=base, storage_filesystem=pafs, verbose=tune_console.verbosity(),
                callbacks=[*callbacks, *console.tune_result_loggers(),
                           tune_console.TrialLines(cfg.num_samples, cfg.max_epochs, cfg.metric, searched_keys(cfg))],
                checkpoint_config=_checkpoints(cfg, train_cfg),
                # PBT: a trial ends at its last epoch's report, before the scheduler sees it: an exploit
                # there had cloned a donor's weights into it under settings that never trained
                stop={"position_epoch": cfg.max_epochs} if cfg.scheduler == "pbt" else None,
                failure_config=tune.FailureConfig(max_failures=cfg.max_failures)))
    with console.no_tensorboard():  # a restored search keeps the loggers it was given (tune_result_loggers)
        return tuner.fit()  # a trial that raises is recorded as ERROR; fit itself does not raise


def _checkpoints(cfg: TuneConfig, train_cfg: TrainConfig):
    """Retention of the checkpoints that one-worker trials report to Tune (a TorchTrainer trial
    keeps its own). PBT keeps them all: a donor's checkpoint must outlive the exploit that reads it."""
    from ray import tune

    keep = None if cfg.scheduler == "pbt" else train_cfg.num_to_keep
    return tune.CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute=checkpointing.score_key(cfg.metric),
                                 checkpoint_score_order=cfg.mode)
