"""ETL's checks of its input and output that need no Ray: `raymill etl` runs them before Ray's
start (~10 s on 2 cores) holding the output's lock, and `stages.etl.stage.run` again inside it."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from stages.common import storage
from stages.common.artifacts import manifest_kind
from stages.common.config import ConfigError
from stages.common.locks import LOCK_NAME, STAGE_RECORD, enclosing_output, foreign_files
from stages.etl import publish as publishing

log = logging.getLogger("stages.etl.stage")  # the stage's lines

__all__ = ["OutputExistsError", "InputNotFoundError", "check_format",
           "preflight", "check_apart", "check_output", "input_folder",
           "image_input", "output_outside_outputs", "used_output", "PUBLISHED"]


class OutputExistsError(ConfigError):
    """The output already holds a published dataset and overwrite was not asked for."""


class InputNotFoundError(ConfigError):
    """The input path does not exist, or is not what the stage reads (a file, another stage's output)."""


def input_folder(fs, root: str, source: str) -> None:
    if not fs.exists(root) or not fs.isdir(root):
        what = "is a file, not a folder" if fs.exists(root) else "does not exist"
        raise InputNotFoundError(f"input '{source}' {what}; pass --input (run.source for `raymill run`) "
                                 f"with a folder or s3:// prefix laid out as <input>/<class_name>/<image file> (or "
                                 f"<input>/<split>/<class_name>/<image file>)")


def preflight(source: str, out: str, s3: Any | None = None, overwrite: bool = False) -> None:
    """The checks that need no Ray, so `raymill etl` runs them before Ray's start (~10 s on 2 cores):
    the input is an image folder apart from the output, and a published output is replaced only
    when asked. `run` repeats them: the output may have changed while Ray started."""
    check_apart(source, out)
    image_input(source, s3)
    output_outside_outputs(out, s3)
    out_fs, out_root = storage.filesystem(out, s3)
    if not overwrite and out_fs.exists(storage.join(out_root, storage.MANIFEST)):
        raise OutputExistsError(PUBLISHED.format(out=out))


def image_input(source: str, s3: Any | None = None, fix: str | None = None) -> None:
    """The input is a folder, and not another stage's output or a folder inside one (its shards/:
    that had been "no image files found", or "100% bad files", after Ray's start), nor a `raymill
    run` folder or a folder of them (read as classes 'etl', 'train': "99% of files are bad")."""
    fix = fix or _PASS_TREE  # what to pass instead (`raymill infer` says --data)
    fs, root = storage.filesystem(source, s3)
    input_folder(fs, root, source)
    if (kind := _kind(fs, root)) is not None:
        raise ConfigError(f"input '{source}' is a {kind} output, not an image folder; {fix}")
    if storage.is_remote(source):  # a request per parent prefix: the local case is the common one
        return
    if (parent := enclosing_output(source, s3)) is not None:
        raise ConfigError(f"input '{source}' is inside the {parent[1]} output '{parent[0]}', not an image "
                          f"folder; {fix}")
    try:  # class folders only: a linked one is ETL's to follow or skip (etl.follow_symlinks)
        folders = [Path(root)] + [c for c in sorted(Path(root).iterdir()) if c.is_dir() and not c.is_symlink()]
    except OSError:  # unreadable: the listing names it
        folders = []
    for folder in folders:
        if (what := _raymill_folder(fs, folder)) is not None:
            name = "it" if folder == Path(root) else f"'{folder.name}'"
            raise ConfigError(f"input '{source}' holds raymill's own files ({name} is {what}), not an image "
                              f"folder; {fix}")


_PASS_TREE = "pass the <class>/<image> tree as --input (run.source for `raymill run`)"
_RUN_STAGES = ("etl", "train", "tune", "infer", "export")  # workflow.pipeline's stage folders


def _raymill_folder(fs, folder: Path) -> str | None:
    """What marks a local `folder` as raymill's: a stage's output (its manifest's kind), a `raymill
    run` stage folder (its stage.json, published or not: a killed run's), or a run folder (one of
    those inside)."""
    if (kind := _kind(fs, str(folder))) is not None:
        return f"a {kind} output"
    try:
        if (folder / STAGE_RECORD).is_file():
            return "a `raymill run` stage folder"
        if any((folder / stage / STAGE_RECORD).is_file() for stage in _RUN_STAGES):
            return "a `raymill run` folder"
    except OSError:
        return None
    return None


def output_outside_outputs(out: str, s3: Any | None = None, key: str = "--output") -> None:
    """Refuse an output inside another stage's output (`--output ETL/sub`, `run.dir=RUN/train/sub`):
    its files would sit among that output's, and an --overwrite of either could delete the other's.
    Local paths only (a request per parent prefix on S3)."""
    if (parent := enclosing_output(out, s3)) is not None:
        raise ConfigError(f"output '{out}' is inside the {parent[1]} output '{parent[0]}'; choose a {key} "
                          "outside it")


def _kind(fs, folder: str) -> str | None:
    try:
        return manifest_kind(fs, folder)
    except OSError:  # a folder named manifest.json (a class of that name), or one this user may not read
        return None


def check_apart(source: str, out: str, key: str = "--output") -> None:
    """Refuse an output inside the input (or the input itself): its files would become images of a
    class named after it on the next run, and --overwrite would write into the source (ETL, infer).
    `key` is what the user set the output with (`run.dir` for the pipeline)."""
    def norm(uri: str) -> str:
        return (uri.rstrip("/") if storage.is_remote(uri) else storage.local_path(uri).rstrip("/")) + "/"

    if norm(out).startswith(norm(source)):
        raise ConfigError(f"output '{out}' is inside the input '{source}'; choose a {key} outside the "
                          "input folder")


PUBLISHED = ("output '{out}' already holds a published dataset; pass --overwrite to replace it (atomically), "
             "or choose another --output")


def check_output(out: str, s3: Any | None = None, overwrite: bool = False) -> dict[str, Any] | None:
    """`run`'s output check, for a caller that holds the output's lock before Ray's start (the CLI):
    a used output or someone's files there are refused without waiting for Ray."""
    return used_output(*storage.filesystem(out, s3), out, overwrite, say=False)  # the stage says it


def used_output(fs, root: str, out: str, overwrite: bool, say: bool = True) -> dict[str, Any] | None:
    """Refuse a used output unless overwriting; return the manifest being replaced, if any."""
    manifest_path = storage.join(root, storage.MANIFEST)
    if fs.exists(manifest_path):
        if not overwrite:
            raise OutputExistsError(PUBLISHED.format(out=out))
        return storage.read_json(fs, manifest_path)
    ours = [p for p in fs.find(root) if not p.endswith("/" + LOCK_NAME)] if fs.exists(root) else []
    # --overwrite replaces an ETL output (a killed run's shards included), never someone's files:
    # written into an image tree, the tree was then refused as an input ("is a raymill.etl output")
    if ours and (foreign := foreign_files(out, publishing.is_shard_file, listed=ours)):
        raise OutputExistsError(f"output '{out}' holds files that raymill etl did not write (e.g. '{foreign[0]}'); "
                                f"--overwrite replaces only an ETL output: choose an empty or new --output")
    if ours and not overwrite and all(publishing.is_run_file(p[len(root.rstrip("/")) + 1:]) for p in ours):
        # a killed run's files, by raymill's names: this run's publish removes them (remove_stale); the
        # rerun had needed --overwrite for a folder that holds no dataset
        log.log(logging.INFO if say else logging.DEBUG, "etl: '%s' holds %d file(s) of a run that did not "
                "publish; they go once this run publishes", out, len(ours))
        return None
    if ours and not overwrite:
        raise OutputExistsError(f"output '{out}' is not empty; pass --overwrite or choose an empty "
                                f"--output so two runs' shards never mix")
    return None


def check_format(manifest: dict[str, Any], path: str, data_format: str) -> None:
    """Refuse a train.data_format the ETL output at `path` holds no shards of; cheap (its manifest
    only), so the CLI says it before Ray starts (it had been said 17 s later, after Ray's start)."""
    formats = {s["format"] for s in manifest["shards"]}
    if data_format not in formats:
        raise ConfigError(f"train.data_format={data_format} but '{path}' holds only {sorted(formats)} shards; set "
                          f"train.data_format={sorted(formats)[0]}, or re-run ETL with etl.formats holding "
                          f"{data_format}")
