"""Training's refusals that need neither torch nor Ray, and where a run's state lives: the CLI
checks them before Ray's start and MLflow's store, with nothing heavy imported (torch's import had
come before the lock: a refusal took 1.4 s, not 0.3 s); stages.train.stage checks them again."""
from __future__ import annotations

import logging
from typing import Any, Sequence

from stages.common import fingerprint, storage
from stages.common.artifacts import Artifact
from stages.common.locks import foreign_files
from stages.common.config import ConfigError, TrainConfig, section_dict
from stages.etl import integrity
from stages.etl.checks import check_format
from stages.etl.layout import more_rows_fix
from stages.model.sizes import check_image_size

__all__ = ["TrainError", "check_rows", "check_shards", "check_state", "check_output_files", "run_name",
           "state_location"]

log = logging.getLogger("stages.train.stage")  # the stage's lines


_SAID: set[tuple[str, int]] = set()


class TrainError(RuntimeError):
    """Training failed or diverged; the message says where the last good checkpoint is."""


def check_shards(data: Artifact, s3: Any | None = None) -> None:
    """A local ETL output's shards as its manifest lists them (integrity.verify_once: re-hashed only
    where changed since a clean check); TrainError naming each damaged one. Remote shards are checked
    as the cache fetches them. The CLI checks before Ray's start and MLflow's store (a damaged shard
    had been refused 9 s later, leaving OUT/mlflow.db with a FAILED run); the stage again (a stamp)."""
    if not storage.is_remote(data.path):
        if problems := integrity.verify_once(data.path, s3):
            raise TrainError(f"refusing to train on '{data.path}': {'; '.join(problems)}. "
                             f"Re-run ETL (raymill etl --overwrite)")


def check_rows(cfg: TrainConfig, data: Artifact, model_names: Sequence[str] = ()) -> None:
    """The refusals the ETL manifest alone decides (no shard is read): the models' image size, the
    shard format, train rows of two classes or more, val rows. `raymill train` and `tune` call it
    before Ray's start and MLflow's store (a one-class refusal had come after Ray's start, 12 s, and
    left a fresh output folder holding an mlflow.db); check_data calls it again."""
    manifest = data.manifest
    check_image_size(model_names or [cfg.model], manifest["config"]["image_size"])
    check_format(manifest, data.path, cfg.data_format)
    if not any(s["split"] == "train" and s["format"] == cfg.data_format for s in manifest["shards"]):
        raise ConfigError(f"'{data.path}' has no train rows; re-run ETL with a larger etl.split.train, or add images")
    learned = sorted(c for c, n in manifest.get("counts", {}).get("train", {}).items() if n)
    if len(learned) < 2:  # it would train to accuracy 1.000 and answer that class for any image
        others = [c for c in manifest["classes"] if c not in learned]
        fix = (more_rows_fix(manifest.get("layout"), "train", others) if len(manifest["classes"]) > 1
               else "give each class its own folder (ETL's log names the folder to read when they sit one "
                    "level lower)")
        raise ConfigError(f"'{data.path}' has train rows of one class only ({', '.join(learned)}); a classifier "
                          f"needs two or more: {fix}")
    rows = sum(manifest.get("counts", {}).get("train", {}).values())
    if cfg.batch_size > rows and (data.path, cfg.batch_size) not in _SAID:  # once a process: the CLI checks first
        _SAID.add((data.path, cfg.batch_size))  # one step an epoch, of all rows: allowed, but rarely meant
        log.warning("train: train.batch_size=%d is more than the %d train rows: each epoch is one step of them "
                    "all; set train.batch_size to %d or less (%s)", cfg.batch_size, rows, rows // 4 if rows >= 8 else rows,
                    "a quarter of them: at least 4 steps an epoch" if rows >= 8 else "at most the rows")
    if not sum(manifest.get("counts", {}).get("val", {}).values()):  # val_acc 0.000 of 0 images had
        # ranked the checkpoints, and the first epoch's model was published
        raise ConfigError(f"'{data.path}' has no val rows, and the published checkpoint is the best by "
                          f"val_acc: {more_rows_fix(manifest.get('layout'), 'val', manifest['classes'])}, then "
                          "re-run ETL")


def run_name(cfg: TrainConfig, out: str) -> str:
    """Ray Train run name of the output `out`: the run restores from it when it is unchanged.

    Under `<out>/ray` the folder already belongs to `out`; a shared `train.storage_path` holds
    many outputs' runs, so the name carries a short hash of the output URI.
    """
    if cfg.storage_path is None:
        return "train"
    return f"train-{storage.sha256_bytes(str(out).rstrip('/').encode())[:10]}"


def state_location(cfg: TrainConfig, out: str) -> tuple[str, str]:
    """Where `out`'s Ray Train run state lives: the storage URI and the run's name in it."""
    return cfg.storage_path or storage.join(out, "ray"), run_name(cfg, out)


def check_state(cfg: TrainConfig, data: Artifact, out: str, seed: int, s3: Any | None = None) -> None:
    """Run state in `out` made by another config or data, refused before Ray's start and MLflow's
    store (the stage's guard said it after both). With init weights the stage checks it: their
    content is part of the fingerprint, read there."""
    if not cfg.init_from:
        state_uri, name = state_location(cfg, out)
        fingerprint.refuse_foreign(state_uri, name, fingerprint.for_train(section_dict(cfg), seed, data.manifest), s3)


# What a train or tune output holds (stages.model.publish, stages.tune.results, the run state, MLflow's
# SQLite store and its artifacts); model.pt counts as one only beside model.json or the run state.
OUTPUT_FILES = frozenset({"manifest.json", "model.json", "curves.png", "metrics.jsonl", "ledger.json", "tracking.json",
                          "best.json", "search.png", "trials.csv", "trials.md",
                          "mlflow.db", "mlflow.db-journal", "mlflow.db-wal", "mlflow.db-shm"})  # SQLite's own too
OUTPUT_FOLDERS = frozenset({"ray", "mlartifacts"})


def check_output_files(out: str, stage: str, s3: Any | None = None) -> None:
    """Refuse an output folder holding files that raymill `stage` (train or tune) did not write: a
    project folder's notes, or a model.pt of the user's own, which publishing had overwritten (etl
    and infer refused such a folder; train and tune wrote beside and over its files)."""
    fs, root = storage.filesystem(out, s3)
    if not fs.isdir(root):
        return
    top = {p.rstrip("/").rsplit("/", 1)[-1] for p in storage.children(fs, root)}
    if "manifest.json" in top:  # a published output: the lock's kind check names whose (another stage's)
        return

    def own(rel: str) -> bool:
        first = rel.split("/", 1)[0]
        return first in OUTPUT_FOLDERS or rel in OUTPUT_FILES or \
            (rel == "model.pt" and bool({"model.json", "ray"} & top))

    if foreign := foreign_files(out, own, s3):
        raise ConfigError(f"output '{out}' holds files that raymill {stage} did not write (e.g. '{foreign[0]}'); "
                          f"choose an empty or new --output")
