"""Tune stage: a hyperparameter search in which every trial is one Ray Train (DDP) run.

Pattern (Ray 2.60, Train V2): `Tuner(driver, param_space=..., tune_config=TuneConfig(scheduler=...))`.
`driver` is a small Tune function (0.01 CPU) that builds a TorchTrainer over the train stage's
per-worker loop; the trainer's `RunConfig(callbacks=[TuneReportCallback()])` forwards every
`ray.train.report` (metrics plus `checkpoint_path`) to Tune, so ASHA sees each epoch. Only the
trainer workers hold CPUs, and `session.plan_trials` caps concurrent trials so the Ray Data
reserve stays free (no 2-CPU deadlock).

Outputs in `out/`: trials.csv, trials.md, best.json, search.png, the best model as model.pt +
model.json (loadable without Ray, like the train stage's), curves.png + metrics.jsonl of that
model, and manifest.json last. Ray state lives under `out/ray/`: the Tune experiment in
`out/ray/tune`, each trial's Train run in `out/ray/trial-<trial id>`.

Resume: running again with the same output folder and config restores the search
(`Tuner.restore`): finished and failed trials are kept as they are, unfinished ones continue from
their last Train checkpoint. A different config for the same folder is a ConfigError.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import time
from typing import Any

from workflow import console, session, storage
from workflow.artifacts import Artifact, base_manifest, config_hash, data_fingerprint, write_manifest
from workflow.config import ConfigError, RayConfig, TrainConfig, TuneConfig, section_dict

__all__ = ["run", "TuneError", "TuneInterrupted", "param_space", "trial_train_config", "check_search"]

log = logging.getLogger(__name__)

EXPERIMENT = "tune"  # Tune experiment folder under out/ray
# The trial's driver only launches and watches its trainer. Tune refuses a trial with no
# resources at all (an empty head bundle), so it asks for a token 0.01 CPU.
DRIVER_CPUS = 0.01
METRICS = ("val_acc", "val_loss")  # present in every report of the train loop, mid-epoch ones too
_SET_BY_TUNE = {"epochs": "tune.max_epochs", "num_workers": "tune.workers_per_trial",
                "min_workers": "tune.workers_per_trial"}
_PBT_MUTABLE = ("lr", "weight_decay", "momentum")  # optimiser settings a restored trial can change


class TuneError(RuntimeError):
    """The search ran but produced no usable model (every trial failed)."""


class TuneInterrupted(RuntimeError):
    """The search stopped before every trial finished; running again resumes it."""


class _InvalidTrialConfig(ConfigError):
    def __init__(self, params: dict, problems: str):
        super().__init__(f"sampled params {params} make an invalid train config: {problems}")
        self.problems = problems


# ---- config -------------------------------------------------------------------------------------
def _set_nested(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def trial_train_config(train_cfg: TrainConfig, params: dict[str, Any], cfg: TuneConfig) -> TrainConfig:
    """The train config of one trial: `train_cfg` + sampled params, `tune.max_epochs` epochs."""
    from pydantic import ValidationError

    data = section_dict(train_cfg)
    for key, value in params.items():
        _set_nested(data, key, value)
    data.update(epochs=cfg.max_epochs, num_workers=cfg.workers_per_trial, min_workers=None)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        bad = "; ".join(f"train.{'.'.join(map(str, i['loc']))}: {i['msg']} (got {i.get('input')!r})"
                        for i in e.errors())
        raise _InvalidTrialConfig(params, bad) from None


def _probe_values(dist) -> list[Any]:
    if dist.type == "choice":
        return list(dist.values)
    if dist.type == "randint":
        return [int(dist.lower), int(dist.upper)]
    return [dist.lower, dist.upper]


def check_search(cfg: TuneConfig, train_cfg: TrainConfig) -> None:
    """Reject a search that cannot work before any trial starts; messages name the tune.* key."""
    if cfg.metric not in METRICS:
        raise ConfigError(f"tune.metric={cfg.metric!r} is not reported by every epoch of a trial; "
                          f"use one of {list(METRICS)}")
    if cfg.scheduler == "asha" and cfg.grace_period > cfg.max_epochs:
        raise ConfigError(f"tune.grace_period={cfg.grace_period} exceeds tune.max_epochs={cfg.max_epochs}: "
                          f"ASHA could never stop a trial early; lower grace_period")
    if not cfg.search_space:
        raise ConfigError("tune.search_space is empty; add e.g. tune.search_space.lr: "
                          "{type: loguniform, lower: 0.005, upper: 0.2}")
    for key, dist in cfg.search_space.items():
        if key in _SET_BY_TUNE:
            raise ConfigError(f"tune.search_space.{key}: train.{key} is set by {_SET_BY_TUNE[key]} in a "
                              f"search; remove it from the search space")
        if dist.type == "randint" and (dist.lower != int(dist.lower) or dist.upper != int(dist.upper)):
            raise ConfigError(f"tune.search_space.{key}: randint needs integer lower/upper, got "
                              f"{dist.lower:g}..{dist.upper:g}")
        for value in _probe_values(dist):  # the range ends (or every choice) must be valid values
            try:
                trial_train_config(train_cfg, {key: value}, cfg)
            except _InvalidTrialConfig as e:
                raise ConfigError(f"tune.search_space.{key}: value {value!r} is not a valid train.{key} "
                                  f"({e.problems})") from None
    if cfg.scheduler == "pbt":
        fixed = sorted(set(cfg.search_space) - set(_PBT_MUTABLE))
        if fixed:
            raise ConfigError(f"tune.scheduler=pbt perturbs a running trial, which can only change "
                              f"{list(_PBT_MUTABLE)}; remove {fixed} from tune.search_space or use asha/fifo")


def param_space(cfg: TuneConfig) -> dict[str, Any]:
    """tune.search_space -> Ray Tune sampling domains (randint includes `upper`)."""
    from ray import tune

    space = {}
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


def _scheduler(cfg: TuneConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if cfg.scheduler == "asha":
        # time_attr "epoch" (completed epochs), not training_iteration: mid-epoch checkpoint
        # reports (train.checkpoint_every_steps) would otherwise count as iterations.
        return ASHAScheduler(time_attr="epoch", max_t=cfg.max_epochs, grace_period=cfg.grace_period,
                             reduction_factor=cfg.reduction_factor)
    if cfg.scheduler == "pbt":
        return PopulationBasedTraining(time_attr="epoch", perturbation_interval=cfg.grace_period,
                                       hyperparam_mutations=param_space(cfg))
    return FIFOScheduler()


# ---- trial driver (runs inside a Tune trial actor) ------------------------------------------------
def _trial_trainer(tcfg: TrainConfig, loop_config: dict, plan, ctx: dict, name: str, callbacks: list,
                   entry):
    """A TorchTrainer like stages.train._trainer, named per trial and with Tune callbacks."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from stages.train import pyarrow_filesystem

    fs, path = pyarrow_filesystem(ctx["ray_dir"], ctx["s3"])
    resources = {"CPU": plan.cpus_per_worker, **({"GPU": plan.gpus_per_worker} if plan.use_gpu else {})}
    return TorchTrainer(
        entry, train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(num_workers=plan.num_workers, use_gpu=plan.use_gpu,
                                               resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if plan.use_gpu else "gloo"),
        run_config=ray.train.RunConfig(
            name=name, storage_path=path, storage_filesystem=fs, callbacks=callbacks,
            logging_config=console.train_logging_config(),
            failure_config=ray.train.FailureConfig(max_failures=tcfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=tcfg.num_to_keep, checkpoint_score_attribute=ctx["metric"],
                checkpoint_score_order=ctx["mode"])))


# The Train run of the trial this actor process drives. A trial actor runs one trial at a time.
_RUN: dict[str, Any] = {}


class _AbortTrainRunOnStop:
    """Mixin for the trial's FunctionTrainable (via the function's `__mixins__`).

    When Tune stops a trial (ASHA early stop, PBT pause, an interrupted search), it calls the
    trainable's `cleanup` and then ends the actor. The TorchTrainer's controller actor dies with
    it, and the workers' placement group, created by that controller, would then stay reserved
    until the Ray job ends: Train's own PlacementGroupCleaner needs the State API, which is off
    without the dashboard. Two trials later the cluster has no CPU left. So `cleanup` first
    aborts the Train run the way Ctrl-C does (`controller.abort`): workers stop, the group is freed.
    """

    def cleanup(self):
        try:
            super().cleanup()
        finally:
            _abort_train_run()


def _abort_train_run(timeout_s: float = 60.0) -> None:
    import ray
    from ray.util.queue import Empty

    if not _RUN.get("fitting"):
        return
    _RUN["aborted"] = True
    try:
        controller = _RUN["controller"].get(timeout=3)
    except Empty:
        return  # stopped before its controller started: nothing reserved yet
    try:
        ray.get(controller.abort.remote(), timeout=timeout_s)
    except Exception:  # abort ends by exiting the controller actor, which raises here
        pass
    log.info("aborted the Train run of a stopped trial")


def _callback_classes():
    """Train callbacks, defined lazily so importing this module does not import Ray."""
    import ray
    from ray.train.v2.api.callback import UserCallback

    try:  # a developer hook: Train runs non-UserCallbacks from RunConfig.callbacks as they are
        from ray.train.v2._internal.execution.callback import ControllerCallback
    except ImportError:  # moved in another Ray: no abort on stop; the reaper still frees groups
        log.warning("ray.train ControllerCallback not found; stopped trials are not aborted")
        ControllerCallback = UserCallback  # noqa: N806 - a base that never sees after_controller_start

    class SendControllerHandle(ControllerCallback):
        def __init__(self, queue):
            self.queue = queue

        def after_controller_start(self, train_run_context):
            self.queue.put(ray.get_runtime_context().current_actor)

    class ForwardReports(UserCallback):
        """Send rank 0's reported metrics and checkpoint path to the trial driver (PBT only)."""

        def __init__(self, queue):
            self.queue = queue

        def after_report(self, run_context, metrics, checkpoint):
            path = checkpoint.path if checkpoint else None
            self.queue.put(({**metrics[0], **({"checkpoint_path": path} if path else {})}, path))

    return SendControllerHandle, ForwardReports


class _PlacementGroupReaper:
    """Frees workers' placement groups that Train controllers of this job left behind.

    Normally a Train run frees its group itself (at its end, or by `_AbortTrainRunOnStop`). A
    driver killed before it could abort (a crash, or Tune's 5 s limit when it stops every trial
    of an interrupted search) leaves its controller's group reserved until the Ray job ends,
    and the next trial then waits for CPUs forever. A group whose creator actor is dead can never
    be used by it again; such groups of this job are removed when a trial fails and after the
    search. Ray exposes the creator only in its GCS table (`ray._private`), so a Ray upgrade that
    changes it turns this into a logged no-op, not an error.
    """

    def reap(self, why: str = "search over") -> int:
        import ray
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        try:
            from ray._private.state import state
            from ray.core.generated import gcs_pb2

            job = ray.get_runtime_context().get_job_id()
            accessor = state._connect_and_get_accessor()
            rows = [gcs_pb2.PlacementGroupTableData.FromString(raw)
                    for raw in accessor.get_placement_group_table()]
        except Exception as e:  # an internal API moved
            log.warning("cannot list placement groups to free leftovers (%s)", e)
            return 0
        removed = 0
        for row in rows:
            if (row.state == gcs_pb2.PlacementGroupTableData.REMOVED or row.is_detached
                    or not row.creator_actor_dead or row.creator_job_id.hex() != job):
                continue
            # Only groups of a dead Train controller: Tune's own trial groups, made by this
            # driver process, count as "creator actor dead" too (their creator is no actor).
            try:
                creator = accessor.get_actor_info(ray.ActorID(row.creator_actor_id))
                creator = gcs_pb2.ActorTableData.FromString(creator) if creator else None
            except Exception:  # no actor id (made by a driver or task)
                continue
            if (creator is None or not creator.class_name.endswith("TrainController")
                    or creator.state != gcs_pb2.ActorTableData.DEAD):
                continue
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(row.placement_group_id)))
                removed += 1
            except Exception:  # removed meanwhile
                pass
        if removed:
            log.warning("freed %d placement group(s) left by stopped trial runs (%s)", removed, why)
        return removed

    def callback(self):
        from ray.tune import Callback

        class Reap(Callback):
            # When a trial starts, errs or is retried, and every 15 s: a dead controller's
            # group is freed well within Train's 60 s worker-start timeout (which it retries).
            def __init__(self, reaper):
                self.reaper, self.next_s = reaper, 0.0

            def __getstate__(self):  # the saved search (tuner.pkl) keeps no live object
                return {"reaper": None, "next_s": 0.0}

            def _reap(self, why: str) -> None:
                if self.reaper:
                    self.next_s = time.monotonic() + 15
                    self.reaper.reap(why)

            def on_trial_start(self, iteration, trials, trial, **info):
                self._reap(f"trial {trial.trial_id} starts")

            def on_trial_error(self, iteration, trials, trial, **info):
                self._reap(f"trial {trial.trial_id} failed")

            def on_trial_recover(self, iteration, trials, trial, **info):
                self._reap(f"trial {trial.trial_id} is retried")

            def on_step_end(self, iteration, trials, **info):
                if time.monotonic() >= self.next_s:
                    self._reap("periodic")

        return Reap(self)


def _fit_trial(trainer) -> None:
    """trainer.fit(), except that a run aborted because Tune stopped the trial is no error."""
    try:
        trainer.fit()
    except Exception:
        if _RUN.get("aborted"):
            return
        raise
    finally:
        _RUN["fitting"] = False


def _make_driver(ctx: dict):
    """The Tune function of one trial. `ctx` is plain, picklable data (it travels to the actor).

    The closure only calls module-level code: cloudpickle copies the globals a closure uses,
    and `_RUN` must be the module's own dict, the one `_AbortTrainRunOnStop.cleanup` sees.
    """

    def raymill_trial(config: dict) -> None:
        _run_trial(ctx, config)

    raymill_trial.__mixins__ = (_AbortTrainRunOnStop,)
    return raymill_trial


def _run_trial(ctx: dict, config: dict) -> None:
    import ray.tune
    from ray.util.queue import Queue

    tune_cfg, train_cfg = TuneConfig(**ctx["tune"]), TrainConfig(**ctx["train"])
    tcfg = trial_train_config(train_cfg, config, tune_cfg)
    loop_config = {**ctx["loop"], "train": section_dict(tcfg),
                   "pbt": tune_cfg.scheduler == "pbt"}
    trial_id = ray.tune.get_context().get_trial_id()
    # The Train run's name must not change when this trial is retried or the search resumed:
    # Train V2 then restores the run from its own latest checkpoint.
    name = f"trial-{trial_id}"
    send_handle, _ = _callback_classes()
    controller = Queue(actor_options={"num_cpus": 0})
    _RUN.clear()
    _RUN.update(controller=controller, fitting=True, aborted=False)
    if tune_cfg.scheduler == "pbt":
        _pbt_trial(tcfg, loop_config, ctx, name, send_handle(controller))
        return
    from ray.tune.integration.ray_train import TuneReportCallback

    callbacks = [TuneReportCallback(), send_handle(controller)]
    _fit_trial(_trial_trainer(tcfg, loop_config, ctx["plan"], ctx, name, callbacks, _trial_entry))


def _pbt_trial(tcfg: TrainConfig, loop_config: dict, ctx: dict, name: str, send_handle) -> None:
    """PBT needs Tune-level checkpoints to clone, which TuneReportCallback does not forward.

    Here a callback forwards (metrics, checkpoint path) through a Ray queue, and this driver
    reports both with `ray.tune.report(checkpoint=...)`. A trial restarted by PBT (or by a retry)
    gets that checkpoint from `ray.tune.get_checkpoint()` and starts a new Train run from it, with
    its (possibly perturbed) optimiser settings applied after the restore.
    """
    import threading

    import ray.tune
    from ray.util.queue import Empty, Queue

    from stages.train import pyarrow_filesystem

    start = ray.tune.get_checkpoint()
    if start is not None:
        loop_config = {**loop_config, "init_checkpoint": start}
        name = f"{name}-from-{config_hash({'path': start.path})[:8]}"
    fs, _ = pyarrow_filesystem(ctx["ray_dir"], ctx["s3"])
    queue = Queue(maxsize=1, actor_options={"num_cpus": 0})
    _, forward = _callback_classes()
    trainer = _trial_trainer(tcfg, loop_config, ctx["plan"], ctx, name, [forward(queue), send_handle],
                             _trial_entry)
    failure: list[BaseException] = []

    def fit() -> None:
        try:
            _fit_trial(trainer)
        except BaseException as e:  # re-raised in this (the trial's) thread below
            failure.append(e)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    while thread.is_alive() or not queue.empty():
        try:
            metrics, path = queue.get(timeout=1.0)
        except Empty:
            continue
        checkpoint = ray.tune.Checkpoint(path, filesystem=fs) if path else None
        ray.tune.report(metrics, checkpoint=checkpoint)
    if failure:
        raise failure[0]


def _trial_entry(config: dict) -> None:
    """Per-worker entry of a trial."""
    config = dict(config)
    if config.pop("pbt", False):
        _pbt_entry(config)
    else:
        from stages.train import _entry

        _entry(config)


def _pbt_entry(config: dict) -> None:
    """Per-worker entry for PBT trials: start from the cloned checkpoint, keep this trial's lr.

    The train loop restores only from `ray.train.get_checkpoint()` and loads the optimiser state
    (lr, weight decay) from it, so this worker process points that function at the cloned
    checkpoint when the run has none of its own, and re-applies the trial's settings after.
    """
    import ray.train

    from stages import train_loop

    init = config.get("init_checkpoint")
    if init is not None and ray.train.get_checkpoint() is None:
        ray.train.get_checkpoint = lambda: init  # this worker process only
    restore = train_loop.Worker.restore

    def restore_then_apply(self) -> None:
        restore(self)
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["initial_lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
            if "momentum" in group:
                group["momentum"] = cfg.momentum
        self.schedule.base_lrs = [cfg.lr] * len(self.optimizer.param_groups)
        factor = self.schedule.lr_lambdas[0](self.schedule.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr * factor

    train_loop.Worker.restore = restore_then_apply
    train_loop.train_loop(config)


# ---- run ------------------------------------------------------------------------------------------
def run(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, out: str, *, seed: int = 0,
        ray_cfg: RayConfig = RayConfig(), s3: Any | None = None, callbacks: list = ()) -> Artifact:
    """Search `cfg.search_space` over the trainer on ETL artifact `data`; publish the best model."""
    from stages import train

    started = time.perf_counter()
    check_search(cfg, train_cfg)
    shards = train._check_data(train_cfg, data, s3)
    resources = session.start(ray_cfg)
    plan = session.plan_trials(cfg, train_cfg, resources, ray_cfg.data_reserved_cpus)
    etl_cfg = data.manifest["config"]
    ray_dir = storage.join(out, "ray")
    ctx = {"tune": section_dict(cfg), "train": section_dict(train_cfg), "plan": plan.workers,
           "ray_dir": ray_dir, "s3": s3, "metric": cfg.metric, "mode": cfg.mode,
           "loop": {"seed": seed, "classes": data.manifest["classes"], "image_size": etl_cfg["image_size"],
                    "shards": shards, "s3": storage.s3_options(s3),
                    "raw": train_cfg.data_format == "parquet" and etl_cfg["parquet_encoding"] == "raw",
                    "cpus_per_worker": plan.workers.cpus_per_worker}}
    print(f"[raymill] tune: {cfg.num_samples} trial(s), {cfg.scheduler}, {plan.concurrent_trials} at a time, "
          f"{plan.workers.num_workers} worker(s) x {plan.workers.cpus_per_worker:g} CPU each; "
          f"{ray_cfg.data_reserved_cpus:g} CPU kept for Ray Data", flush=True)
    grid = _fit(cfg, train_cfg, data, seed, plan, ctx, ray_dir, s3, callbacks)
    trials = _summaries(grid, cfg, ctx)
    fs, root = storage.filesystem(out, s3)
    _write_tables(fs, root, trials, cfg)
    unfinished = [t for t in trials if t["status"] not in ("TERMINATED", "ERROR")]
    if unfinished or len(trials) < cfg.num_samples:
        raise TuneInterrupted(
            f"the search stopped with {len(unfinished)} trial(s) unfinished "
            f"({', '.join(t['trial_id'] for t in unfinished) or '-'}) and "
            f"{cfg.num_samples - len(trials)} not started; run the same command with the same "
            f"output '{out}' to resume it (finished trials are kept)")
    best = _pick_best(trials, cfg, ctx)
    if best is None:
        errors = [f"{t['trial_id']}: {t['error']}" for t in trials if t["error"]][:3]
        raise TuneError(f"all {len(trials)} trial(s) failed or reported nothing; see {out}/trials.md. "
                        f"First errors: {'; '.join(errors) or 'none recorded'}")
    return _publish(cfg, train_cfg, data, out, seed, ray_cfg, s3, plan, trials, best,
                    time.perf_counter() - started)


def _fit(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, seed: int, plan, ctx: dict,
         ray_dir: str, s3, callbacks: list = ()):
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from stages.train import pyarrow_filesystem

    pafs, base = pyarrow_filesystem(ray_dir, s3)
    experiment = f"{base}/{EXPERIMENT}"
    reaper = _PlacementGroupReaper()
    trainable = tune.with_resources(_make_driver(ctx), {"CPU": DRIVER_CPUS})
    key = {"tune": section_dict(cfg), "train": section_dict(train_cfg), "seed": seed,
           "data_manifest_hash": data_fingerprint(data.manifest)}  # content, not run id: re-runs match
    fs, root = storage.filesystem(ray_dir, s3)
    key_path = storage.join(root, "search.json")
    if tune.Tuner.can_restore(experiment, storage_filesystem=pafs):
        previous = storage.read_json(fs, key_path) if fs.exists(key_path) else None
        if previous != key:
            raise ConfigError(f"'{ray_dir}/{EXPERIMENT}' holds a search with another config, seed or data; "
                              f"use a new output folder, or delete '{ray_dir}' to start over")
        print(f"[raymill] tune: resuming the search in {ray_dir}/{EXPERIMENT} (finished trials are kept)",
              flush=True)
        tuner = tune.Tuner.restore(experiment, trainable=trainable, resume_unfinished=True,
                                   resume_errored=False, storage_filesystem=pafs)
        # The run config comes back from the saved search, with an inert copy of the reaper's
        # callback; give it this run's reaper (no public API for this on restore).
        local = getattr(tuner, "_local_tuner", None)
        if local is not None:
            local.get_run_config().callbacks = [reaper.callback(), *callbacks]
    else:
        storage.write_bytes_atomic(fs, key_path, json.dumps(key, indent=2).encode())
        tuner = tune.Tuner(
            trainable, param_space=param_space(cfg),
            tune_config=tune.TuneConfig(
                metric=cfg.metric, mode=cfg.mode, num_samples=cfg.num_samples,
                scheduler=_scheduler(cfg),
                # Seeded sampling. Tune ignores TuneConfig.max_concurrent_trials when search_alg
                # is a BasicVariantGenerator (it logs a warning), so the limit goes here.
                search_alg=BasicVariantGenerator(random_state=cfg.seed,
                                                 max_concurrent=plan.concurrent_trials)),
            run_config=tune.RunConfig(
                name=EXPERIMENT, storage_path=base, storage_filesystem=pafs, verbose=1,
                callbacks=[reaper.callback(), *callbacks],  # callbacks: tracking.tune_callbacks
                failure_config=tune.FailureConfig(max_failures=cfg.max_failures)))
    try:
        return tuner.fit()  # a trial that raises is recorded as ERROR; fit itself does not raise
    finally:
        reaper.reap()  # no trial runs now: nothing may stay reserved


# ---- results --------------------------------------------------------------------------------------
def _pyarrow_fs(ctx: dict):
    import pyarrow.fs as pafs

    from stages.train import pyarrow_filesystem

    fs, base = pyarrow_filesystem(ctx["ray_dir"], ctx["s3"])
    return fs or pafs.LocalFileSystem(), base


def _checkpoint_history(ctx: dict, trial_id: str, metric: str) -> list[dict[str, Any]]:
    """Epoch-end checkpoints that the trial's Train runs kept, with the metric from meta.json.

    Tune's own record misses a report that was in flight when a search was interrupted (the
    Train run still saved that epoch's checkpoint), so the kept checkpoints complete it.
    """
    import re

    import pyarrow.fs as pafs

    fs, base = _pyarrow_fs(ctx)
    runs = [i for i in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
            if i.type == pafs.FileType.Directory and re.fullmatch(rf"trial-{re.escape(trial_id)}(-from-\w+)?",
                                                                   i.base_name)]
    found = []
    for run in runs:
        for item in fs.get_file_info(pafs.FileSelector(run.path, allow_not_found=True)):
            m = re.fullmatch(r"checkpoint-e(\d+)-s0+(-[0-9a-f]+)?", item.base_name)
            if not m or item.type != pafs.FileType.Directory:
                continue
            try:
                with fs.open_input_stream(f"{item.path}/meta.json") as f:
                    value = json.loads(f.read()).get("val", {}).get(metric)
            except (OSError, ValueError):  # incomplete checkpoint: meta.json is written last
                continue
            if value is not None and not _nan(value) and int(m.group(1)) >= 1:
                found.append({"epoch": int(m.group(1)), "value": float(value), "checkpoint_path": item.path})
    return found


def _summaries(grid, cfg: TuneConfig, ctx: dict) -> list[dict[str, Any]]:
    """One dict per trial: params, status, per-epoch history of the metric, best value, timing."""
    # ResultGrid builds its Results from these trials in this order; only Trial has the status.
    trials = grid._experiment_analysis.trials
    rows = []
    for trial, result in zip(trials, grid):
        df = result.metrics_dataframe
        history, diverged = [], False
        if df is not None and len(df) and "epoch" in df:
            diverged = bool("stopped" in df and (df["stopped"] == "nan_loss").any())
            ends = df[df["position_step"].fillna(-1) == 0] if "position_step" in df else df.iloc[0:0]
            for _, r in ends.iterrows():
                if r["epoch"] >= 1 and r.get(cfg.metric) is not None and not _nan(r[cfg.metric]):
                    history.append({"epoch": int(r["epoch"]), "value": float(r[cfg.metric]),
                                    "checkpoint_path": r.get("checkpoint_path")})
        # epochs_run is what the scheduler saw; `kept` adds checkpoints Tune was never told about
        # (a report in flight at an interruption, or the epoch a stopped run finished meanwhile).
        epochs_run = max((h["epoch"] for h in history), default=0)
        seen = {h["epoch"] for h in history}
        kept = [h for h in _checkpoint_history(ctx, trial.trial_id, cfg.metric) if h["epoch"] not in seen]
        candidates = sorted(history + kept, key=lambda h: h["epoch"])
        pick = max if cfg.mode == "max" else min
        best = pick(history or candidates, key=lambda h: h["value"]) if candidates else None
        status = trial.status
        if status == "TERMINATED" and not (result.metrics or {}).get("done"):
            # Tune marks the trials it stops on an interrupted search TERMINATED in memory (the
            # saved state says RUNNING, so a restore resumes them); a finished trial's last
            # result, by completion or a scheduler stop, is marked done.
            status = "UNFINISHED"
        if status == "ERROR":
            outcome = "failed"
        elif status != "TERMINATED":
            outcome = status.lower()
        elif diverged:
            outcome = "diverged"
        elif epochs_run < cfg.max_epochs:
            outcome = "stopped_early"
        else:
            outcome = "completed"
        error = str(result.error).strip().splitlines()[-1][:300] if result.error else ""
        wall = (result.metrics or {}).get("time_total_s")
        rows.append({"trial_id": trial.trial_id, "status": status, "outcome": outcome,
                     "params": {k: trial.config.get(k) for k in cfg.search_space},
                     "best": best["value"] if best else None, "best_epoch": best["epoch"] if best else None,
                     "epochs_run": epochs_run, "stopped_early": outcome == "stopped_early",
                     "wall_s": round(float(wall), 1) if wall is not None else None, "error": error,
                     "history": history, "candidates": candidates, "last": {k: v for k, v in (result.metrics or {}).items()
                                                  if k in ("images_per_s", "stall_fraction", "verdict")}})
    return rows


def _nan(value) -> bool:
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return True


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _write_tables(fs, root: str, trials: list[dict], cfg: TuneConfig) -> None:
    keys = list(cfg.search_space)
    header = ["trial_id", "status", "outcome", *keys, f"best_{cfg.metric}", "best_epoch", "epochs_run",
              "stopped_early", "wall_s", "error"]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    table = []
    for t in trials:
        row = [t["trial_id"], t["status"], t["outcome"], *[_fmt(t["params"][k]) for k in keys],
               _fmt(t["best"]), _fmt(t["best_epoch"]), t["epochs_run"], t["stopped_early"],
               _fmt(t["wall_s"]), t["error"]]
        writer.writerow(row)
        table.append(row)
    md = [f"# Tune trials ({cfg.scheduler}, metric {cfg.metric} {cfg.mode}, max {cfg.max_epochs} epochs)", "",
          "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in table]
    counts = {o: sum(t["outcome"] == o for t in trials) for o in
              ("completed", "stopped_early", "diverged", "failed")}
    md += ["", ", ".join(f"{n} {o.replace('_', ' ')}" for o, n in counts.items()), ""]
    storage.write_bytes_atomic(fs, storage.join(root, "trials.csv"), buf.getvalue().encode())
    storage.write_bytes_atomic(fs, storage.join(root, "trials.md"), "\n".join(md).encode())


def _checkpoint_exists(path: str, ctx: dict) -> bool:
    import pyarrow.fs as pafs

    fs, _ = _pyarrow_fs(ctx)
    return fs.get_file_info(f"{path}/meta.json").type != pafs.FileType.NotFound


def _pick_best(trials: list[dict], cfg: TuneConfig, ctx: dict) -> dict | None:
    """(trial, history entry with an existing checkpoint) of the best epoch over all trials."""
    candidates = [(h, t) for t in trials if t["status"] == "TERMINATED" for h in t["candidates"]
                  if isinstance(h["checkpoint_path"], str)]
    sign = -1 if cfg.mode == "max" else 1
    # best value first; ties: the earlier epoch, then the earlier trial
    candidates.sort(key=lambda c: (sign * c[0]["value"], c[0]["epoch"], trials.index(c[1])))
    for entry, trial in candidates:  # retention may have deleted some epochs' checkpoints
        if _checkpoint_exists(entry["checkpoint_path"], ctx):
            return {"trial": trial, "entry": entry}
    return None


def _search_png(trials: list[dict], cfg: TuneConfig) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for t in trials:
        if not t["history"]:
            continue
        epochs = [h["epoch"] for h in t["history"]]
        values = [h["value"] for h in t["history"]]
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in t["params"].items())
        (line,) = ax.plot(epochs, values, marker=".", label=f"{t['trial_id'][-5:]} {params}"[:60])
        if t["outcome"] == "stopped_early":
            ax.plot(epochs[-1], values[-1], marker="x", markersize=10, color=line.get_color())
    failed = [t["trial_id"][-5:] for t in trials if t["outcome"] == "failed"]
    stopped = sum(t["outcome"] == "stopped_early" for t in trials)
    title = f"{cfg.scheduler}: {len(trials)} trials, {stopped} stopped early (x)"
    if failed:
        title += f", failed: {', '.join(failed)}"
    ax.set(xlabel="epoch", ylabel=cfg.metric, title=title)
    ax.set_xticks(range(1, cfg.max_epochs + 1))
    ax.grid(alpha=0.3)
    if any(t["history"] for t in trials):
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _publish(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, out: str, seed: int,
             ray_cfg: RayConfig, s3, plan, trials: list[dict], best: dict, seconds_so_far: float) -> Artifact:
    import tempfile
    from pathlib import Path

    import ray.train

    from stages import data as sd
    from stages import export, train
    from stages.train import pyarrow_filesystem

    started = time.perf_counter()
    trial, entry = best["trial"], best["entry"]
    tcfg = trial_train_config(train_cfg, trial["params"], cfg)
    pafs, _ = pyarrow_filesystem(storage.join(out, "ray"), s3)
    state, meta, _ = export._read_checkpoint(ray.train.Checkpoint(entry["checkpoint_path"], filesystem=pafs))
    search_val_acc = meta.get("val", {}).get("val_acc")
    fs, root = storage.filesystem(out, s3)
    best_json = {"trial_id": trial["trial_id"], "params": trial["params"], "metric": cfg.metric,
                 "value": entry["value"], "epoch": entry["epoch"], "checkpoint": entry["checkpoint_path"],
                 "train_config": section_dict(tcfg), "handoff": cfg.handoff}
    files: dict[str, bytes] = {"best.json": json.dumps(best_json, indent=2).encode(),
                               "search.png": _search_png(trials, cfg)}
    if cfg.handoff == "retrain":
        # A fresh model with the best params, and the train section's own epochs and workers.
        params = {k: v for k, v in section_dict(tcfg).items() if k not in _SET_BY_TUNE}
        model_cfg = TrainConfig.model_validate({**section_dict(train_cfg), **params})
        final = train.run(model_cfg, data, storage.join(out, "final"), seed=seed, ray_cfg=ray_cfg, s3=s3)
        ffs, froot = storage.filesystem(final.path, s3)
        for name in ("model.pt", "model.json", "curves.png", "metrics.jsonl"):
            files[name] = ffs.cat_file(storage.join(froot, name))
        fm = final.manifest["metrics"]
        test = {"acc": fm["test_acc"], "rows": fm["test_rows"]}
        model_val_acc, last, source = fm["best_val_acc"], fm, "retrained (out/final)"
    else:
        model_cfg, source = tcfg, "trial checkpoint"
        info = export.model_info(tcfg, data, {
            "val_acc": search_val_acc, "epoch": meta["epoch"],
            "version": f"tune-{trial['trial_id']}-{meta['epoch']}-{config_hash(export.state_hash(state))}",
            "tune": {"trial_id": trial["trial_id"], "params": trial["params"], cfg.metric: entry["value"]}})
        export.save_model(out, state, info, s3)
        model, info = export.load_model(out, s3)
        refs = [sd.ShardRef(**r) for r in train._check_data(train_cfg, data, s3)["test"]]
        raw = train_cfg.data_format == "parquet" and data.manifest["config"]["parquet_encoding"] == "raw"
        test = export.evaluate_split(model, refs, info, raw, storage.s3_options(s3), train_cfg.cache_dir)
        history = meta["history"]
        files["metrics.jsonl"] = "".join(json.dumps(h) + "\n" for h in history).encode()
        with tempfile.TemporaryDirectory() as tmp:
            export._curves(history, Path(tmp) / "curves.png")
            files["curves.png"] = (Path(tmp) / "curves.png").read_bytes()
        model_val_acc, last = search_val_acc, (history[-1] if history else {})
    for name, payload in files.items():
        storage.write_bytes_atomic(fs, storage.join(root, name), payload)
    counts = {o: sum(t["outcome"] == o for t in trials)
              for o in ("completed", "stopped_early", "diverged", "failed")}
    manifest = base_manifest("tune", section_dict(cfg), {
        "data": data.path, "data_manifest_hash": config_hash(data.manifest),
        "train": section_dict(train_cfg), "seed": seed})
    metrics = {"best_val_acc": search_val_acc, f"best_{cfg.metric}": entry["value"],
               "model_val_acc": model_val_acc, "test_acc": test["acc"], "test_rows": test["rows"],
               "trials": len(trials), **counts,
               "seconds": round(seconds_so_far + time.perf_counter() - started, 1),
               "images_per_s": last.get("images_per_s"), "stall_fraction": last.get("stall_fraction"),
               "verdict": last.get("verdict")}
    manifest.update({
        "resource_plan": {"concurrent_trials": plan.concurrent_trials, "driver_cpus": DRIVER_CPUS,
                          **plan.workers.as_dict()},
        "experiment": storage.join(out, "ray", EXPERIMENT), "best": best_json,
        "model": {"path": "model.pt", "info": "model.json", "architecture": model_cfg.model, "source": source},
        "metrics": metrics,
        "files": sorted({*files, "trials.csv", "trials.md", "model.pt", "model.json"})})
    write_manifest(out, manifest, s3)  # the publish step, last
    print(f"[raymill] tune: best {cfg.metric} {entry['value']:.3f} (trial {trial['trial_id']}, "
          f"{json.dumps(trial['params'])}); {len(trials)} trials: {counts['completed']} completed, "
          f"{counts['stopped_early']} stopped early, {counts['diverged']} diverged, {counts['failed']} failed; "
          f"test_acc {test['acc']:.3f} ({source}); {metrics['seconds']:.0f}s", flush=True)
    return Artifact("tune", str(out).rstrip("/"), manifest)
