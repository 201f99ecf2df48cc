"""What `raymill run` checks and starts before the stages' own imports.

The checks need neither torch nor Ray: a bad run.source, run.dir or split fails in a second, with
nothing written and nothing started. Ray starts at the first stage that must compute
(`RayOnDemand`), in the main thread (`ray.init` mostly waits for the processes it spawns) while a
thread imports torch and Ray Train (`_BESIDE_RAY`), which the stages after it need: on the 2-core
demo torch and `ray.init` took 5.0 s + 1.0 s one after the other, and 5.1 s side by side.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import yaml

from stages import etl
from stages.common import session, storage, tracking
from stages.common.config import Config, ConfigError
from stages.common.locks import LOCK_NAME, output_lock
from stages.etl.checks import image_input, output_outside_outputs
from stages.model import init_source
from stages.model.sizes import check_image_size
from stages.tune.checks import check_room, check_search

__all__ = ["Inputs", "start", "RayOnDemand", "check_init_source", "beside_ray", "needed_splits",
           "etl_inputs", "locked_before_ray"]

log = logging.getLogger(__name__)

# Imported here, before any thread starts: torch's import chain shares these with ray.init's and with
# MLflow's (tracking.warm_up), and two threads importing one package's modules at once can each wait
# on a lock the other holds (Python then raises _DeadlockError in one of them).
_SHARED = ("numpy", "ray", "argparse", "cmath", "email.parser", "gettext", "grp", "http.client", "mmap",
           "multiprocessing", "multiprocessing.reduction", "pkgutil", "pprint", "runpy", "tarfile", "timeit",
           "tqdm", "unicodedata", "urllib.request", "unittest", "difflib")
# Imported in a thread while Ray starts: torch, which every stage after it needs, then Ray Train's
# TorchTrainer (ray.air, pandas, Ray Data's modules), which the train stage had imported in
# `build_trainer` while the driver did nothing else: 0.63 s of the demo's train stage; both finish
# inside `ray.init`'s ~4-6 s on 2 cores. Ray Train's chain shares pandas, pyarrow and protobuf with
# MLflow's warm-up: no module of either imports the other's, so neither can wait on the other in a
# cycle, and were one to fail anyway, only torch's error is the run's (`_import_into`).
_BESIDE_RAY = ("torch", "ray.train.torch")


class Inputs(NamedTuple):
    """What ETL reads. `sources` keys the ETL stage (the source and its listing fingerprint);
    `listing` is the listing that fingerprint was taken from, handed to ETL so that a run lists its
    source once: `raymill run` had listed it twice (here, then in ETL), I/O that grows with the data,
    and could record one listing's fingerprint beside shards made from another."""
    sources: dict[str, Any]
    listing: etl.Listing


def start(cfg: Config, serve: bool = False) -> Inputs:
    """Check the run's config and inputs and write config.yaml. Returns ETL's inputs; Ray is not
    started here (`RayOnDemand`). `serve`: the run ends serving its model (`raymill run --serve`)."""
    # a model that cannot take etl.image_size would fail every trainer after ETL
    models = run_models(cfg)
    check_image_size(models, cfg.etl.image_size)
    check_init_source(cfg, models)
    if cfg.tune.enabled:  # a search that cannot work: refused before Ray and ETL (it had been 13 s later)
        check_search(cfg.tune, cfg.train)
        check_room(cfg.tune, cfg.train, cfg.ray)
    if serve:
        check_serve_room(cfg)
    session.check_ray(cfg.ray)  # before config.yaml, ETL and MLflow's store
    etl.check_apart(cfg.run.source, cfg.run.dir, "run.dir")
    image_input(cfg.run.source, cfg.s3)  # not another stage's output: had failed after Ray's start
    output_outside_outputs(cfg.run.dir, cfg.s3, "run.dir")  # had written config.yaml and mlflow.db there first
    listing = _listing(cfg)  # a missing or unreadable run.source fails here, before anything is written
    needed_splits(cfg, given=set(listing.layout.splits.values()))
    _check_run_dir(cfg)
    _write_config(cfg)
    return Inputs(etl_inputs(cfg, listing), listing)


def run_models(cfg: Config) -> list[str]:
    """Every train.model `raymill run` trains: a search's, or train.model."""
    return cfg.tune.models(cfg.train.model) if cfg.tune.enabled else [cfg.train.model]


class RayOnDemand:
    """Ray, with torch imported beside it and MLflow's store warming (`beside_ray`), started once,
    when the first stage must compute: a `raymill run` whose every stage was reused had started Ray
    for nothing (7.7 s of a 7.7 s rerun, 2-core box). Calling it returns the cluster's resources.
    `take()` hands the seconds of a start not yet counted to the stage that paid them, so a stage's
    row counts its own work and the run's split names Ray's start (`seconds`, None: not started)."""

    def __init__(self, cfg: Config):
        self.cfg, self.seconds, self._untaken, self._resources = cfg, None, 0.0, {}

    def __call__(self) -> dict[str, float]:
        if self.seconds is None:
            t = time.perf_counter()
            self._resources = beside_ray(self.cfg, self.cfg.run.dir, run_models(self.cfg))
            self.seconds = self._untaken = time.perf_counter() - t
        return self._resources

    def take(self) -> float:
        seconds, self._untaken = self._untaken, 0.0
        return seconds


def check_serve_room(cfg: Config) -> None:
    """`raymill run --serve` whose replicas a local Ray's CPUs (ray.num_cpus, else at most this
    machine's) could never hold: refused before Ray starts, as the run refuses it once Ray is up (it
    had been, after Ray's start, leaving config.yaml and an empty mlflow.db). A cluster's nodes, Ray's
    memory and a GPU plan are known only to Ray: the run checks those (session.plan_serve)."""
    if cfg.ray.address is not None or cfg.serve.use_gpu:
        return
    cpus = float(cfg.ray.num_cpus or session.local_cpus())  # affinity and cgroup quota, as Ray counts them
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # nor more memory
    session.plan_serve(cfg.serve, [{"CPU": cpus, "GPU": 0.0, "memory": memory}], say=False)


def check_init_source(cfg: Config, models: list[str]) -> None:
    """train.init_from's path, checksum, file kind and wholeness, and a raymill model's architecture
    against `models` (those that will train), before Ray starts (no torch needed): a wrong path had
    been refused ~20 s later, once Ray and the trainer were up (2-core box)."""
    if cfg.train.init_from:
        width = None if "width" in cfg.tune.search_space else cfg.train.width  # a search's own widths
        init_source.check(cfg.train.init_from, cfg.s3, tuple(models), width)


def check_local_gpus(cfg: Config) -> None:
    """train.use_gpu where a local Ray would have no GPU: refused before Ray's start and MLflow's store
    (it had been refused by the plan after both, leaving OUT/mlflow.db). A cluster's GPUs, and a
    ray.num_gpus the user set, are known only to Ray: the plan checks those."""
    if not cfg.train.use_gpu or cfg.ray.address is not None or cfg.ray.num_gpus is not None:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("train.use_gpu=true, but this machine has no GPU torch can use, and a local Ray "
                          "(ray.address unset) has only this machine's; set train.use_gpu=false, or join a "
                          "cluster with GPUs (ray.address)")


def beside_ray(cfg: Config, store: str, models: Sequence[str] = ()) -> dict[str, float]:
    """Start Ray in this thread while torch and Ray Train import in a thread beside it, and MLflow's
    store in `store` opens in another (`raymill run` at its first stage that computes; `raymill
    train` and `tune` before their stage, which had imported torch, opened MLflow's run, then
    started Ray). Returns the cluster's resources."""
    for name in _SHARED:  # before any thread of ours imports: MLflow's below shares them too
        importlib.import_module(name)
    warm = functools.partial(tracking.warm_up, cfg.tracking, store)  # beside Ray's start (and ETL's)
    check = _backbone_check(cfg, models)
    if check is None:
        warm()
    failed: list[BaseException] = []
    then = None if check is None else functools.partial(_checked_then, check, warm)
    importer = threading.Thread(target=_import_into, args=(_BESIDE_RAY, failed, then), name="raymill-import-torch",
                                daemon=True)
    importer.start()
    try:
        resources = session.start(cfg.ray)
    finally:  # never leave the interpreter to exit in the middle of torch's import
        importer.join()
    if failed:  # torch's own error, not a later import's of a half-loaded package
        raise failed[0]
    return resources


def _backbone_check(cfg: Config, models: Sequence[str]) -> Callable[[], None] | None:
    """The tensor check of a local train.init_from weights file (init_weights.check_backbone), or
    None: no init weights, a raymill folder (its model.json's architecture was checked before Ray:
    check_init_source), or a remote file (its one download is the stage's)."""
    uri = cfg.train.init_from
    if not uri or not models or storage.is_remote(uri) or init_source.kind_of(uri, look=True) == "raymill":
        return None

    def check() -> None:
        from stages.model.init_weights import check_backbone

        check_backbone(cfg.train, models, "width" in cfg.tune.search_space)
    return check


def _checked_then(check: Callable[[], None], warm: Callable[[], None]) -> None:
    """`check`, then MLflow's warm-up, which creates the store: a refused init file leaves none. Any
    other error of the check is left to the stage's own (init_weights.prepare), which says it."""
    try:
        check()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001: see above
        log.debug("preflight: init weights not checked ahead (%s); the train stage checks them", e)
    warm()


def _import_into(names: tuple[str, ...], failed: list[BaseException], then: Callable[[], None] | None = None) -> None:
    """Import `names` in order, calling `then` after the first. Only the first one's error, and
    `then`'s, are the run's (torch's, the init check's); the rest are a head start that the stage
    imports again where it needs them, raising there if they fail."""
    try:
        importlib.import_module(names[0])
        if then is not None:
            then()
    except Exception as e:  # noqa: BLE001: raised in the main thread, where the CLI reports it
        failed.append(e)
        return
    for name in names[1:]:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001: e.g. an import lock cycle with a thread beside it
            log.debug("preflight: %s not imported ahead (%s); the train stage imports it", name, e)


def needed_splits(cfg: Config, counts: dict[str, dict[str, int]] | None = None, given: set[str] = frozenset()) -> None:
    """ConfigError unless training, validation and infer.split each get rows: by etl.split before
    ETL (except the `given` splits, which a tree split by its folders supplies), by the rows ETL
    wrote after it (a small tree can leave a split empty). A pipeline whose test split was empty
    had trained for minutes and then failed in infer."""
    needs = {"train": "the model learns from it", "val": "the published checkpoint is the best by val_acc",
             cfg.infer.split: f"infer.split={cfg.infer.split} reads it"}
    for split, why in needs.items():
        share = getattr(cfg.etl.split, split)
        if counts is None and share <= 0 and split not in given:
            raise ConfigError(f"etl.split.{split}=0 but the pipeline needs {split} rows ({why}); give "
                              f"etl.split.{split} a share")
        if counts is not None and sum(counts.get(split, {}).values()) == 0:
            raise ConfigError(f"ETL put no images in the {split} split ({why}); raise etl.split.{split} "
                              f"(now {share:g}) or add images to {cfg.run.source}")


def etl_inputs(cfg: Config, listing=None) -> dict[str, Any]:
    """What ETL reads: the source path and a listing fingerprint (names, sizes, mtimes), so added or
    changed images are noticed without hashing every file. `listing`: the source's, when listed."""
    return {"source": cfg.run.source, "source_listing": (listing or _listing(cfg)).fingerprint}


def _listing(cfg: Config):
    return etl.discover(cfg.run.source, cfg.s3, cfg.etl.follow_symlinks, cfg.etl.layout)


def _check_run_dir(cfg: Config) -> None:
    """Refuse a run.dir that holds files but no config.yaml (every pipeline run writes one first):
    report.md, config.yaml and the stage folders there would overwrite someone else's files."""
    fs, root = storage.filesystem(cfg.run.dir, cfg.s3)
    if fs.exists(root) and not fs.isdir(root):
        raise ConfigError(f"run.dir '{cfg.run.dir}' is a file; choose a folder")
    entries = [p for p in (storage.children(fs, root) if fs.exists(root) else [])  # a folder marker is no file,
               if p.rstrip("/").rsplit("/", 1)[-1] != LOCK_NAME]  # nor the run's own lock
    if entries and not fs.exists(storage.join(root, "config.yaml")):
        raise ConfigError(f"run.dir '{cfg.run.dir}' holds files that no raymill run wrote (no config.yaml), "
                          f"e.g. '{entries[0]}'; choose an empty or new run.dir")
    if entries and not _written_by_a_run(fs, storage.join(root, "config.yaml")):  # a project's own config.yaml
        raise ConfigError(f"run.dir '{cfg.run.dir}' holds a config.yaml that no raymill run wrote (it is not a "
                          f"raymill config); a run would replace it: choose an empty or new run.dir")


def _written_by_a_run(fs, path: str) -> bool:
    """Whether `path` is a config.yaml a raymill run wrote (`_write_config`: every section of the
    config tree; an older raymill's had fewer): any config.yaml had made a folder a run's, and the
    run replaced a project's own."""
    try:
        data = yaml.safe_load(fs.cat_file(path))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"run", "etl", "train"} <= set(data) <= set(Config.model_fields)


def _write_config(cfg: Config) -> None:
    fs, root = storage.filesystem(cfg.run.dir, cfg.s3)
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    try:
        storage.write_bytes_atomic(fs, storage.join(root, "config.yaml"), text.encode())
    except FileNotFoundError as e:  # s3fs: "The specified bucket does not exist"
        if not storage.is_remote(cfg.run.dir):
            raise
        raise ConfigError(f"run.dir '{cfg.run.dir}' cannot be written: {e}; create the bucket, or fix the s3:// "
                          "path that names it") from None


def warn_unused_read_keys(cfg: Config, model_path: str, command: str) -> None:
    """Log which ETL read keys of this config (--set or --config) `command` ignores: it reads image
    files with the model's own rules (model.json `read`). Quiet when model.json cannot be read: the
    command's own check says why."""
    import json

    from stages.etl.sources import unused_read_settings

    try:
        fs, root = storage.filesystem(model_path, cfg.s3)
        info = json.loads(fs.cat_file(storage.join(root, "model.json")))
    except (OSError, ValueError):
        return
    if ignored := unused_read_settings(cfg.etl.model_dump(mode="json"), info):
        log.warning("%s reads image files with the rules of the model's own ETL (model.json `read`), so %s %s "
                    "nothing here; retrain on data read that way to change them", command, ", ".join(ignored),
                    "does" if len(ignored) == 1 else "do")


@contextlib.contextmanager
def locked_before_ray(cfg, data, out: str, overwrite: bool, stage: str, models: list[str]):
    """The output's lock for the whole command, then Ray's start with torch's import beside it
    (beside_ray), unless `out` already holds a published output: the stage then reuses it,
    or refuses to overwrite it, and needs no Ray. Data the manifest shows unfit (train.check_rows),
    and an output that is a file, another stage's, or another run's (locked), are refused first
    (exit 2), before anything starts or is written there (MLflow's store). The stage takes the same
    lock again inside (it nests); a locked output had waited for Ray's start (4-6 s) to be refused."""
    from stages.common.artifacts import manifest_kind
    from stages.train.checks import check_output_files, check_rows, check_shards, check_state  # no torch, Ray
    from stages.tune.checks import check_state as check_search_state

    check_rows(cfg.train, data, models)  # image size, format, classes, val rows: the manifest's facts
    check_init_source(cfg, models)
    check_output_files(out, stage, cfg.s3)  # a folder of someone's files, before MLflow's store opens there
    session.check_ray(cfg.ray)  # ray.address answers, ray.dashboard_host is this machine's: before it too
    check_shards(data, cfg.s3)  # a damaged shard: before Ray and MLflow's store (a stamp makes it instant again)
    with output_lock(out, stage, cfg.s3):  # checks the output's kind too
        fs, root = storage.filesystem(out, cfg.s3)
        if overwrite or manifest_kind(fs, root) is None:
            if stage == "train" and not overwrite:  # run state another config or data made: before Ray
                check_state(cfg.train, data, out, cfg.run.seed, cfg.s3)
            elif stage == "tune":
                check_search_state(cfg.tune, cfg.train, data, out, cfg.run.seed, cfg.s3)
            check_local_gpus(cfg)
            beside_ray(cfg, out, models)
        yield
