"""A search's config checked against itself and the train config it varies: no torch, no Ray, so
that `raymill run` and `raymill tune` refuse a search that cannot work before Ray starts (the
pipeline had run ETL first: 13 s on 2 cores). Also the train config of one trial."""
from __future__ import annotations

import math
import typing
from typing import Any

from stages.common import fingerprint, session, storage
from stages.common.artifacts import Artifact, data_fingerprint
from stages.common.config import ConfigError, RayConfig, TrainConfig, TuneConfig, section_dict
from stages.common.config_parts import SET_BY_TUNE, SHARED_IN_SEARCH

__all__ = ["check_search", "check_room", "check_state", "state_key", "state_fix", "trial_train_config",
           "searched_keys", "tie_value", "METRICS", "PBT_KEYS", "EXPERIMENT"]

EXPERIMENT = "tune"  # Tune experiment folder under out/ray

METRICS = ("val_acc", "val_loss")  # present in every report of the train loop, mid-epoch ones too
BETTER = {"val_acc": "max", "val_loss": "min"}  # the mode each metric ranks by
PBT_KEYS = ("lr", "momentum", "weight_decay")  # what PBT explores: the optimiser's knobs


def searched_keys(cfg: TuneConfig) -> list[str]:
    """The train.* keys a trial's config sets: the search space, plus PBT's explored knobs."""
    return list(cfg.search_space) + [k for k in PBT_KEYS if cfg.scheduler == "pbt" and k not in cfg.search_space]


class _InvalidTrialConfig(ConfigError):
    def __init__(self, params: dict, problems: str):
        super().__init__(f"sampled params {params} make an invalid train config: {problems}")
        self.params, self.problems = params, problems

    def __reduce__(self):  # copied and pickled whole: Ray's copy had called it with the message alone
        return type(self), (self.params, self.problems)


def tie_value(values: Any, metric: str) -> float:
    """The other validation metric, lower better: it breaks a tie of `metric` (val_acc ties are
    common on small val splits: an earlier epoch with val_loss 1e7 had won one)."""
    other = next(m for m in METRICS if m != metric)
    value = values.get(other) if hasattr(values, "get") else None
    if value is None or not math.isfinite(float(value)):
        return math.inf
    return float(value) if BETTER[other] == "min" else -float(value)


def _set_nested(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def trial_train_config(train_cfg: TrainConfig, params: dict[str, Any], cfg: TuneConfig) -> TrainConfig:
    """The train config of one trial: `train_cfg` + sampled params; `tune.max_epochs` epochs
    unless train.epochs is itself searched."""
    from pydantic import ValidationError

    data = section_dict(train_cfg)
    data["epochs"] = cfg.max_epochs
    for key, value in params.items():
        _set_nested(data, key, value)
    data.update(num_workers=cfg.workers_per_trial, min_workers=None)
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


def _whole_numbers(key: str) -> bool:
    """Whether train.<key> (top level) is an integer field."""
    field = TrainConfig.model_fields.get(key)
    return field is not None and int in (typing.get_args(field.annotation) or (field.annotation,))


def check_room(cfg: TuneConfig, train_cfg: TrainConfig, ray_cfg: RayConfig) -> None:
    """Before a local Ray starts, its CPUs are known (ray.num_cpus, else at most this machine's): a
    search with no room for one trial is refused then, with the fixes (`ray.num_cpus=1` had been
    refused after Ray's start and ETL). A cluster's room, and a GPU plan, wait for Ray."""
    if ray_cfg.address is not None or train_cfg.use_gpu:
        return
    cpus = float(ray_cfg.num_cpus or session.local_cpus())  # affinity and cgroup quota, as Ray counts them
    session.plan_trials(cfg, train_cfg, {"CPU": cpus, "GPU": 0.0}, ray_cfg.data_reserved_cpus, say=False)


def check_search(cfg: TuneConfig, train_cfg: TrainConfig) -> None:
    """Reject a search that cannot work before any trial starts; messages name the tune.* key."""
    if cfg.metric not in METRICS:
        raise ConfigError(f"tune.metric={cfg.metric!r} is not in every report of a trial (mid-epoch ones carry "
                          f"only validation metrics); use one of {list(METRICS)}")
    if cfg.mode != BETTER[cfg.metric]:  # val_loss by max had handed on the worst model, exit 0
        raise ConfigError(f"tune.mode={cfg.mode} ranks {cfg.metric} the wrong way round: the best {cfg.metric} is the "
                          f"{'highest' if BETTER[cfg.metric] == 'max' else 'lowest'}; set tune.mode="
                          f"{BETTER[cfg.metric]} (or leave tune.mode unset: it follows tune.metric)")
    if cfg.scheduler == "asha" and cfg.grace_period > cfg.max_epochs:
        raise ConfigError(f"tune.grace_period={cfg.grace_period} exceeds tune.max_epochs={cfg.max_epochs}: "
                          f"ASHA could never stop a trial early; lower grace_period")
    if cfg.scheduler == "pbt" and cfg.perturbation_interval >= cfg.max_epochs:
        raise ConfigError(f"tune.perturbation_interval={cfg.perturbation_interval} is not below "
                          f"tune.max_epochs={cfg.max_epochs}: PBT would never exploit; lower it")
    if cfg.scheduler == "pbt" and "epochs" in cfg.search_space:
        raise ConfigError("tune.search_space.epochs: PBT compares trials and clones one into another at "
                          "the same epoch, so every trial runs tune.max_epochs; remove it from the space")
    for key, dist in cfg.search_space.items():
        if key in SET_BY_TUNE:
            raise ConfigError(f"tune.search_space.{key}: train.{key} is set by {SET_BY_TUNE[key]} in a "
                              f"search; remove it from the search space")
        if key in SHARED_IN_SEARCH:
            raise ConfigError(f"tune.search_space.{key}: every trial of a search shares train.{key} (its plan and "
                              f"checks are made once); set --set train.{key}=... for the whole search instead")
        if dist.type == "randint" and (dist.lower != int(dist.lower) or dist.upper != int(dist.upper)):
            raise ConfigError(f"tune.search_space.{key}: randint needs integer lower/upper, got "
                              f"{dist.lower:g}..{dist.upper:g}")
        if dist.type in ("uniform", "loguniform") and _whole_numbers(key):  # the ends are whole: the draws are not
            raise ConfigError(f"tune.search_space.{key}: train.{key} takes whole numbers, and a {dist.type} range draws "
                              f"fractions; write {{type: randint, lower: {dist.lower:g}, upper: {dist.upper:g}}}")
        for value in _probe_values(dist):  # the range ends (or every choice) must be valid values
            if key == "epochs" and isinstance(value, (int, float)) and value > cfg.max_epochs:
                raise ConfigError(f"tune.search_space.epochs: value {value!r} exceeds tune.max_epochs="
                                  f"{cfg.max_epochs}, the budget of a trial; lower it or raise tune.max_epochs")
            try:
                trial_train_config(train_cfg, {key: value}, cfg)
            except _InvalidTrialConfig as e:
                raise ConfigError(f"tune.search_space.{key}: value {value!r} is not a valid train.{key} "
                                  f"({e.problems})") from None


def state_key(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, seed: int, init_sha256: str | None) -> dict:
    """What a search's state is made by: its config, the trainer's, the seed, the data's content, the
    init weights' content."""
    return {"tune": section_dict(cfg), "train": section_dict(train_cfg), "seed": seed,
            "data_fingerprint": data_fingerprint(data.manifest),
            **({"init_sha256": init_sha256} if init_sha256 else {})}


def state_fix(ray_dir: str) -> str:
    return f"use a new output folder, or delete '{ray_dir}' to start over"


def check_state(cfg: TuneConfig, train_cfg: TrainConfig, data: Artifact, out: str, seed: int,
                s3: Any | None = None) -> None:
    """A search's state in `out` made by another config or data, refused before Ray's start and
    MLflow's store (as train.check_state). With init weights the stage checks it (their content)."""
    if not train_cfg.init_from:
        ray_dir = storage.join(out, "ray")
        made_by = fingerprint.compute(state_key(cfg, train_cfg, data, seed, None))
        fingerprint.refuse_foreign(ray_dir, EXPERIMENT, made_by, s3, fix=state_fix(ray_dir))
