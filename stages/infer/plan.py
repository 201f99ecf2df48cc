"""What a batch inference job reads: its work items (one per shard of an ETL output's split, or one
per raw file of a folder, in blocks), how many rows come back, and what the manifest records of
them. Planned on the driver before any Ray work (stages.infer.stage)."""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from stages.common import storage
from stages.common.artifacts import Artifact, load_artifact, manifest_kind
from stages.common.config import ConfigError, InferConfig
from stages.etl import checks, integrity, layout as layouts, sources
from stages.etl.stage import InputNotFoundError
from stages.feed import streaming

__all__ = ["Plan", "plan", "spread", "FILES_PER_BLOCK", "InferError"]

log = logging.getLogger(__name__)

FILES_PER_BLOCK = 256  # raw files per Ray Data block: big enough to amortise a call, small enough to spread


class InferError(RuntimeError):
    """Batch inference failed; nothing was published."""


@dataclass(frozen=True)
class Plan:
    kind: str  # "etl" (shards of one split) or "images" (raw files)
    items: list[dict[str, Any]]  # work items, one Ray Data row each
    blocks: int
    rows: int  # prediction rows the output must hold: one per sample, errors included
    reader: dict[str, Any]  # how the actors read the items (Predictor kwargs)
    inputs: dict[str, Any]  # provenance for the manifest

    def counted(self) -> str:
        where = "file(s)" if self.kind == "images" else f"row(s) in {len(self.items)} shard(s)"
        return f"{self.rows} image {where}"


def plan(cfg: InferConfig, source: str, info: dict, s3: Any | None) -> Plan:
    """The work items and their rows; a folder's files in blocks of FILES_PER_BLOCK (`spread`
    splits them further once the number of readers is known)."""
    fs, root = storage.filesystem(source, s3)
    if not fs.exists(root):
        raise InputNotFoundError(f"input '{source}' does not exist; pass an ETL output or an image folder")
    if _raymill_kind(fs, root) == "raymill.etl":
        # As train checks it (a stamp skips the re-hash while nothing changed): a damaged shard gave
        # rows blamed on their images ("corrupt") and changed probabilities, exit 0
        if problems := integrity.verify_once(source, s3):
            raise InferError(f"refusing to predict from '{source}': {'; '.join(problems)}. Re-run ETL "
                             f"(raymill etl --overwrite); `raymill verify {source}` lists what changed")
        return _plan_shards(cfg, load_artifact(source, "etl", s3), info)
    if not fs.isdir(root):
        raise InputNotFoundError(f"input '{source}' is a file; pass an ETL output or an image folder")
    # as ETL refuses them: a `raymill run` folder, or one holding an ETL output, had been predicted as
    # images (its curves.png and shards as error rows), exit 0
    checks.image_input(source, s3, fix="pass an image folder or an ETL output as --data")
    return _plan_files(fs, root, source, sources.read_rules(info), cfg.split)


def _layout(fs, root: str, entries: list, trained: str) -> layouts.Layout:
    """The folder's layout, for labels only: a folder that no layout reads cleanly (`val/` beside
    `valid/`) is predicted all the same, labelled by its first folders."""
    try:
        return layouts.detect((e.rel for e in entries if not e.problem), sources.top_folders(fs, root),
                              "classes" if trained == "classes" else "auto")
    except ConfigError:
        return layouts.Layout()


def spread(plan: Plan, parallel: int) -> Plan:
    """`parallel`: how many workers read at once (actors, or decode tasks): raw files get at least
    that many blocks (an ETL output's items are its shards, a block each)."""
    if plan.kind != "images":
        return plan
    return replace(plan, blocks=max(plan.blocks, min(len(plan.items), parallel)))


def _raymill_kind(fs, folder: str) -> str | None:
    """The kind a raymill manifest names; None for no manifest, or a manifest.json that is some
    other tool's file among the images (the folder is then read as images)."""
    kind = manifest_kind(fs, folder)
    if kind not in (None, "raymill.etl"):
        raise InputNotFoundError(f"'{folder}' is a {kind} output; pass an ETL output or an image folder")
    return kind


def _plan_shards(cfg: InferConfig, data: Artifact, info: dict) -> Plan:
    """One item per shard of `cfg.split`; parquet when ETL wrote it (one read, no tar parsing)."""
    m = data.manifest
    fmt = "parquet" if "parquet" in m["config"]["formats"] else "tar"
    refs = streaming.shard_refs(m, data.path, cfg.split, fmt)
    if not refs:  # rows a split, not the class-by-split counts (tens of KB at 2,000 classes)
        rows = {split: sum(counts.values()) for split, counts in m["counts"].items()}
        raise ConfigError(f"ETL output '{data.path}' has no {fmt} shards for split '{cfg.split}' "
                          f"(rows: {rows}); choose another infer.split")
    raw, stored = storage.stored_raw(m, fmt), m["config"]["image_size"]
    if raw and stored != info["image_size"]:
        raise ConfigError(f"'{data.path}' stores raw {stored} px pixels but the model expects "
                          f"{info['image_size']} px; re-run ETL at that size or with encoded parquet")
    if stored < info["image_size"]:  # predicted all the same, but on blurred inputs the model never saw
        log.warning("infer: '%s' stores images at %d px and the model expects %d px: they are upscaled, which "
                    "costs accuracy; re-run ETL with etl.image_size=%d", data.path, stored, info["image_size"],
                    info["image_size"])
    items = [asdict(r) for r in refs]
    return Plan("etl", items, len(items), sum(r.rows for r in refs),
                {"mode": "etl", "raw": raw, "etl_classes": m["classes"]},
                {"format": fmt, "split": cfg.split, "data_run_id": m.get("run_id")})


def _plan_files(fs, root: str, source: str, rules: dict[str, Any], split: str) -> Plan:
    """Every non-hidden entry is an item: links out of the folder (as the training data's
    etl.follow_symlinks judged them), FIFOs and unreadable files come back as error rows (never
    read, never dropped); a non-UTF-8 name travels as hex bytes. A file's label is its class
    folder's, found as the training data's etl.layout finds it (`<class>/` or `<split>/<class>/`).
    A tree split by its folders gives `split`'s files only, as an ETL output does (its training
    images had been scored with the rest: a "test" accuracy of 0.927 over all three splits)."""
    entries, hidden = sources.list_tree(fs, root, rules["follow_symlinks"])
    tree = _layout(fs, root, entries, rules["layout"])
    if tree.splits:
        entries = _split_only(entries, tree, split, source)
    items = []
    for e in entries:
        name = sources.shown(e.rel)
        reason, detail = e.problem or ("", "")
        items.append({"path": name, "name_hex": "" if name == e.rel else sources.name_bytes(e.rel).hex(),
                      "size": e.size, "reason": reason, "detail": detail})
    if not items:
        raise InputNotFoundError(f"no files under '{source}'; pass an image folder or an ETL output")
    return Plan("images", items, math.ceil(len(items) / FILES_PER_BLOCK), len(items),
                {"mode": "images", "source": source, "class_depth": tree.depth},
                {"files": len(items), "hidden_skipped": hidden})


def _split_only(entries: list, tree: layouts.Layout, split: str, source: str) -> list:
    folders = [top for top, named in tree.splits.items() if named == split]
    if not folders:
        raise ConfigError(f"'{source}' is split by its folders ({', '.join(sorted(tree.splits))}) and none is "
                          f"infer.split={split}; set infer.split to one of {sorted(set(tree.splits.values()))}")
    kept = [e for e in entries if e.rel.split("/", 1)[0] in folders]
    log.info("infer: '%s' is split by its folders: predicting the %d file(s) of %s/ (infer.split=%s), not the "
             "%d of the other splits", source, len(kept), "/, ".join(folders), split, len(entries) - len(kept))
    return kept
