"""ETL stage: an ImageFolder tree (local or s3://) -> checksummed parquet and WebDataset tar shards.

Layout of the work (measured, see benchmarks/RESULTS.md): the driver lists paths and plans one
Ray Data row per shard; each task opens, decodes and writes its own files and returns only
metadata. Image bytes never travel through the object store, so memory stays flat as input grows.

Publishing: shards carry the run id in their names and `manifest.json` is written last, in one
atomic write. A reader sees the old output or the new one, never a mix or a partial shard.
"""
from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from stages.common import console, session, storage
from stages.common.artifacts import Artifact, base_manifest, new_run_id
from stages.common.config import ConfigError, EtlConfig, section_dict
from stages.common.locks import output_lock
from stages.etl import checks, integrity
from stages.etl.checks import (InputNotFoundError, OutputExistsError, check_apart, check_output,  # noqa: F401 (API)
                               preflight)
from stages.etl import layout as layouts
from stages.etl import publish as publishing
from stages.etl import shards
from stages.etl import sources

__all__ = ["run", "EtlError", "NoImagesError", "OutputExistsError", "InputNotFoundError", "discover", "split_of", "sample_key",
           "check_apart", "preflight", "check_output"]

log = logging.getLogger(__name__)


class EtlError(RuntimeError):
    """The ETL job failed; nothing was published."""


@dataclass(frozen=True)
class Listing:
    classes: list[str]
    files: list[tuple[str, int]]  # (path relative to source as the OS names it, size in bytes) in class folders
    rejected: list[dict[str, Any]]  # quarantine rows found by listing (loose files, links, FIFOs): never read
    hidden: int  # dotfiles such as .DS_Store, skipped and counted
    fingerprint: str = ""  # names, sizes and mtimes of everything listed: changes when the source does
    layout: layouts.Layout = layouts.Layout()  # <class>/<image>, or split by its folders
    unlabelled_files: int = 0  # files in a split folder without class folders: left out


def discover(source: str, s3: Any | None = None, follow_symlinks: str = "inside_source",
             layout: str = "auto") -> Listing:
    """List an ImageFolder tree: the class is the first folder under `source`, or the second in a
    tree split by its folders (`<split>/<class>/`, stages.etl.layout; `layout`: etl.layout)."""
    fs, root = storage.filesystem(source, s3)
    checks.input_folder(fs, root, source)
    entries, hidden = sources.list_tree(fs, root, follow_symlinks)
    linked = sources.skipped_linked_folders(fs, root, entries)
    if linked:  # once a run: `raymill run` hands its one listing to ETL
        log.warning("etl: %s in '%s' link(s) to folders that etl.follow_symlinks=%s does not follow: not read as "
                    "classes; set etl.follow_symlinks=always to read them", linked, source, follow_symlinks)
    tree = layouts.detect((e.rel for e in entries if not e.problem), sources.top_folders(fs, root), layout)
    files, rejected, classes, spellings, left_out = [], [], set(), {}, 0
    for entry in entries:
        if tree.left_out(entry.rel):
            left_out += 1
            continue
        if entry.problem:
            rejected.append(sources.entry_row(entry))
        elif (folder := tree.class_folder(entry.rel)) is None:
            rejected.append(sources.entry_row(replace(entry, problem=(
                "outside_class_folder", f"file is not inside a {tree.where()} folder"))))
        else:
            name = sources.class_name(folder)
            classes.add(name)
            spellings.setdefault(name, set()).add(folder)
            files.append((entry.rel, entry.size))
    if not files:
        seen = "; ".join(f"{r['path']} ({r['detail'] or r['reason']})" for r in rejected[:3])
        raise InputNotFoundError(f"no image files found under '{source}/{tree.where()}'; expected ImageFolder "
                                 f"layout (one sub-folder per class)" + (
                                     f" — found {len(rejected)} other file(s), e.g. {seen}" if rejected else ""))
    sources.check_spellings(spellings)
    # An empty class folder is a class too, as torchvision's ImageFolder counts it: the label space
    # is the folders (_log_summary names every class without a usable image)
    folders = [f for split in tree.splits for f in sources.top_folders(fs, storage.join(root, split))] \
        if tree.splits else sources.top_folders(fs, root)
    empty = sorted(set(folders) - classes)
    sources.check_printable(classes | set(empty))
    return Listing(sorted(classes | set(empty)), files, rejected, hidden, sources.tree_fingerprint(entries, empty),
                   tree, left_out)


def sample_key(relpath: str) -> str:
    """Stable id of a source file: dot-free (WebDataset keys) and independent of the run."""
    return storage.sha256_bytes(sources.name_bytes(relpath))[:20]


def split_of(relpath: str, fractions: Any) -> str:
    """Hash-based split: adding files never moves an existing file to another split."""
    u = int(storage.sha256_bytes(b"split:" + sources.name_bytes(relpath))[:16], 16) / 16**16
    if u < fractions.train:
        return "train"
    return "val" if u < fractions.train + fractions.val else "test"


def plan_tasks(listing: Listing, cfg: EtlConfig, parallelism: int = 8) -> list[dict[str, Any]]:
    """One task per shard. Files are ordered by key, a hash, so shards mix classes.

    Shards hold at most etl.shard_max_rows rows, and fewer when that would leave fewer than
    `parallelism` (etl.min_shards) tasks; it is config, not the cluster's size, so the same
    config gives the same shards anywhere. One 1,000-row task on a 2,000-image job would keep a core idle for half
    the run (measured, benchmarks/RESULTS.md).
    """
    label_of = {name: i for i, name in enumerate(listing.classes)}
    by_split: dict[str, list[tuple[str, str, int, int]]] = {"train": [], "val": [], "test": []}
    for rel, size in listing.files:
        label = label_of[sources.class_of(rel, listing.layout.depth)]
        by_split[listing.layout.split_of(rel, cfg.split, split_of)].append((sample_key(rel), rel, label, size))
    rows_per_task = max(1, min(cfg.shard_max_rows, math.ceil(len(listing.files) / parallelism)))
    tasks = []
    for split, items in by_split.items():
        items.sort()
        for index, start in enumerate(range(0, len(items), rows_per_task)):
            tasks.append({"split": split, "index": index, "items": items[start:start + rows_per_task]})
    return tasks


def run(cfg: EtlConfig, source: str, out: str, *, s3: Any | None = None,
        overwrite: bool = False, listing: Listing | None = None) -> Artifact:
    """Run ETL from `source` into `out` and return the published artifact.

    The output is locked for the run (stages.common.locks): a second run on it exits 2 naming this one.
    `listing`: discover(source, ...) with this cfg's follow_symlinks and layout, when the caller has
    it (`raymill run` keys the stage by its fingerprint); else ETL lists the source itself.
    """
    preflight(source, out, s3, overwrite)
    session.start_if_needed()  # a library call first: before the task check, outside the stage's clock
    _check_task_fits(cfg)
    with output_lock(out, "etl", s3):
        return _run_locked(cfg, source, out, s3, overwrite, listing)


def _check_task_fits(cfg: EtlConfig) -> None:
    """Refuse a task size no node can run: Ray Data would wait for it forever."""
    import ray

    from stages.common import cluster

    nodes = cluster.node_resources() if ray.is_initialized() else []
    if nodes and cluster.units_that_fit({"CPU": cfg.cpus_per_task}, nodes) == 0:
        largest = max(n.get("CPU", 0.0) for n in nodes)
        raise ConfigError(f"etl.cpus_per_task={cfg.cpus_per_task:g} exceeds the CPUs of every node (the "
                          f"largest has {largest:g}): its tasks would wait forever; lower etl.cpus_per_task")


def _run_locked(cfg: EtlConfig, source: str, out: str, s3: Any | None, overwrite: bool,
                listing: Listing | None) -> Artifact:
    started = time.perf_counter()
    listing = listing if listing is not None else discover(source, s3, cfg.follow_symlinks, cfg.layout)
    for level, line in layouts.advice(listing.layout, source, [rel for rel, _ in listing.files], listing.classes,
                                      cfg.layout, listing.unlabelled_files):
        log.log(level, "etl: %s", line)
    out_fs, out_root = storage.filesystem(out, s3)
    previous = checks.used_output(out_fs, out_root, out, overwrite)
    run_id = new_run_id()
    tasks = plan_tasks(listing, cfg, parallelism=cfg.min_shards)
    refused = f" (and {len(listing.rejected)} refused while listing)" if listing.rejected else ""
    log.info("etl: %d files in %d classes%s -> %d shard task(s), run %s",
             len(listing.files), len(listing.classes), refused, len(tasks), run_id)
    publishing_started = False
    try:
        results = _execute(tasks, cfg, source, out, s3, run_id, listing.classes, len(listing.files))
        quarantine = _quarantine_rows(results, listing)
        _check_bad_fraction(cfg, quarantine, len(listing.files) + len(listing.rejected), out)
        manifest = _manifest(cfg, source, run_id, listing, results, quarantine, started)
        quarantine_rel = shards.quarantine_path(run_id)
        manifest["quarantine"] = _write_quarantine(out_fs, out_root, quarantine_rel, quarantine)
        publishing_started = True
        publishing.publish(out, manifest, s3, out_fs, out_root)
    except BaseException:
        # A manifest write can raise after the store committed it (an S3 response timeout): then
        # the manifest names these shards, and deleting them would publish a dataset with holes.
        # Before the publish step no manifest of this run can exist: asking a dead endpoint had said
        # "cannot tell whether the manifest was published" over a run that never tried.
        if not publishing_started or publishing.published_run(out_fs, out_root) not in (run_id, "unknown"):
            publishing.remove_run_files(out_fs, out_root, run_id)
        raise
    publishing.remove_stale(out_fs, out_root, manifest, previous)
    integrity.stamp_written(out)  # the first train reads no shard to check it
    _log_summary(manifest)
    return Artifact("etl", str(out).rstrip("/"), manifest)


# A shard task whose worker died (its node lost, a decoder that crashed the process) runs again this
# often on either engine, then ETL fails and publishes nothing. Ray Data's own default is to retry
# without end, which a file that kills its decoder every time would turn into a hang.
TASK_RETRIES = 3


def _execute(tasks, cfg: EtlConfig, source: str, out: str, s3, run_id: str, classes: list[str], files: int):
    """Every shard task's result (stages.etl.shards.process_task), through Ray Data, or as plain
    Ray tasks below etl.ray_data_min_files: each task is a whole shard's work and returns only
    metadata, so both are the same map; Ray Data's start is a fixed cost that a small job notices."""
    fn_kwargs = {"cfg": section_dict(cfg), "source": source, "out": out,
                 "s3": storage.s3_options(s3), "run_id": run_id, "classes": classes}
    rows = [{"task": json.dumps(t)} for t in tasks]
    engine = _with_ray_data if files >= cfg.ray_data_min_files else _as_ray_tasks
    try:
        return [json.loads(row["result"]) for row in engine(rows, fn_kwargs, cfg.cpus_per_task)]
    except Exception as e:
        raise EtlError(f"ETL task failed, nothing was published: {console.root_cause(e)}") from e


def _with_ray_data(rows: list[dict], fn_kwargs: dict, cpus: float) -> list[dict]:
    import ray.data

    console.quiet_ray()

    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows)))
    # Ray 2.60 deprecates map's **ray_remote_args (gone in 2.64) but names no max_retries parameter
    # in their place, and its default (-1) retries a task without end (upstream gap, in the notes).
    # A filter, not catch_warnings(): that swaps the process's filters under the threads beside ETL.
    warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
    ds = ds.map(shards.process_task, fn_kwargs=fn_kwargs, num_cpus=cpus, max_retries=TASK_RETRIES)
    # Each row is a whole shard's work and returns only metadata, so Ray Data's per-operator
    # reservation (which held this pipeline to one task at a time here) buys nothing. On this
    # dataset's own context: set on the process's, it reached every later dataset of the process
    # (a benchmark's Ray Data feed ran 1.7x faster after an ETL in the same process).
    ds.context.op_resource_reservation_enabled = False
    return list(ds.iter_rows())


def _as_ray_tasks(rows: list[dict], fn_kwargs: dict, cpus: float) -> list[dict]:
    """One Ray task a row (Ray queues what the CPUs cannot run yet). On the first failure the
    others are cancelled and awaited, so that none writes a shard after the caller cleans up."""
    import ray

    task = ray.remote(num_cpus=cpus, max_retries=TASK_RETRIES)(_process_row)
    kwargs = ray.put(fn_kwargs)
    refs = [task.remote(row, kwargs) for row in rows]
    try:
        return ray.get(refs)
    except BaseException:
        for ref in refs:
            ray.cancel(ref)
        ray.wait(refs, num_returns=len(refs), timeout=60)
        raise


def _process_row(row: dict, fn_kwargs: dict) -> dict:
    return shards.process_task(row, **fn_kwargs)


def _quarantine_rows(results, listing: Listing) -> list[dict[str, Any]]:
    rows = [q for r in results for q in r["quarantine"]]
    rows += listing.rejected
    return sorted(rows, key=lambda q: q["path"])


BAD_SHOWN = 10  # bad files a refused ETL names


class NoImagesError(ConfigError):
    """Not one file of the input is an image this ETL reads: the input is wrong (exit 2)."""


def _check_bad_fraction(cfg: EtlConfig, quarantine: list, files_in: int, out: str) -> None:
    fraction = len(quarantine) / max(1, files_in)
    if fraction > cfg.max_bad_fraction or len(quarantine) >= files_in:
        reasons = Counter(q["reason"] for q in quarantine).most_common()
        # the files themselves: with nothing published there is no quarantine file to read them from
        shown = "; ".join(f"{q['path']} ({q['reason']})" for q in quarantine[:BAD_SHOWN])
        more = f"; and {len(quarantine) - BAD_SHOWN} more" if len(quarantine) > BAD_SHOWN else ""
        if len(quarantine) >= files_in:  # raising the threshold had published a dataset of 0 rows
            raise NoImagesError(f"none of the {files_in} files is an image this ETL reads; reasons: "
                                f"{dict(reasons)}: {shown}{more}. Point --input at the image folder (or "
                                f"add the files' format to etl.allowed_formats); nothing was published to '{out}'")
        raise EtlError(f"{len(quarantine)} of {files_in} files ({_percent(fraction)}) are bad, over "
                       f"etl.max_bad_fraction={cfg.max_bad_fraction}; reasons: {dict(reasons)}: {shown}{more}. "
                       f"Fix the input or raise etl.max_bad_fraction; nothing was published to '{out}'")


def _percent(fraction: float) -> str:
    """'0.5%' where '.0%' printed '0%' for 1 bad file of 201 (a refusal that read as no reason),
    and '100%' for 995 of 1000."""
    if fraction in (0, 1):
        return f"{fraction:.0%}"
    return "<0.1%" if fraction < 0.001 else ">99.9%" if fraction > 0.999 else f"{fraction:.1%}"


def _manifest(cfg, source, run_id, listing, results, quarantine, started) -> dict[str, Any]:
    shard_list = sorted((s for r in results for s in r["shards"]), key=lambda s: s["path"])
    counts: dict[str, dict[str, int]] = {"train": {}, "val": {}, "test": {}}
    for r in results:
        for name, n in r["counts"].items():
            counts[r["split"]][name] = counts[r["split"]].get(name, 0) + n
    rows_out = sum(sum(c.values()) for c in counts.values())
    seconds = time.perf_counter() - started
    manifest = base_manifest("etl", section_dict(cfg), {"source": str(source),
                                                       "source_listing": listing.fingerprint})
    manifest.update({
        "run_id": run_id, "classes": listing.classes, "layout": listing.layout.record(listing.unlabelled_files),
        "image_shape": [cfg.image_size, cfg.image_size, 3],
        # every class in every split, 0 where it has none (`counts[split][cls]` had raised KeyError)
        "counts": {split: {name: c.get(name, 0) for name in sorted({*listing.classes, *c})}
                   for split, c in counts.items()},
        "shards": shard_list,
        "totals": {"files_in": len(listing.files) + len(listing.rejected), "rows_out": rows_out,
                   "quarantined": len(quarantine), "hidden_skipped": listing.hidden},
        "duplicates": _duplicates(results),
        "metrics": {"seconds": round(seconds, 3), "images_per_s": round(rows_out / seconds, 1),
                    "mb_written": round(sum(s["bytes"] for s in shard_list) / 1e6, 3)},
    })
    totals = manifest["totals"]
    if totals["files_in"] != totals["rows_out"] + totals["quarantined"]:  # not assert: python -O drops those
        raise EtlError(f"files_in={totals['files_in']} != rows_out={totals['rows_out']} + quarantined="
                       f"{totals['quarantined']}: a file was lost; nothing was published. Please report this")
    return manifest


def _duplicates(results) -> dict[str, Any]:
    """Rows whose source bytes another row's repeat (the same sha256): each is a row of its own, and
    a copy in another split than its first lets val/test score images the model trained on. A copy
    in another class folder than its first is a label conflict: one of the two labels is wrong."""
    first: dict[str, tuple[str, str, int]] = {}
    copies, across, conflicts, examples, conflicting = 0, 0, 0, [], []
    for r in sorted(results, key=lambda r: ("train", "val", "test").index(r["split"])):  # stable: train first
        for digest, path, label in r.get("digests", ()):
            if digest not in first:
                first[digest] = (r["split"], path, label)
                continue
            copies += 1
            if label != first[digest][2]:
                conflicts += 1
                conflicting += [f"{path} = {first[digest][1]}"][:3 - len(conflicting)]
                continue
            across += first[digest][0] != r["split"]
            if len(examples) < 3:
                examples.append(f"{path} = {first[digest][1]}")
    # across_splits and examples: the copies within one class (the label conflicts are counted apart)
    return {"copies": copies, "across_splits": across, "examples": examples, "label_conflicts": conflicts,
            "conflict_examples": conflicting}


def _write_quarantine(fs, root: str, relative: str, quarantine: list) -> dict[str, Any]:
    data = "".join(json.dumps(q, sort_keys=True) + "\n" for q in quarantine).encode()
    storage.write_bytes_atomic(fs, storage.join(root, relative), data)
    return {"path": relative, "count": len(quarantine), "sha256": storage.sha256_bytes(data),
            "bytes": len(data), "reasons": dict(Counter(q["reason"] for q in quarantine))}


def _log_summary(m: dict[str, Any]) -> None:
    t, x = m["totals"], m["metrics"]
    log.info("etl: files_in=%d rows_out=%d quarantined=%d images/s=%.1f MB_written=%.2f seconds=%.1f",
             t["files_in"], t["rows_out"], t["quarantined"], x["images_per_s"], x["mb_written"], x["seconds"])
    empty = [c for c in m["classes"] if not any(counts.get(c) for counts in m["counts"].values())]
    if empty:  # still a class (the label space is the folders), but a model never sees one of it
        log.warning("etl: %d class(es) have no usable image (%s; the folder is empty or every file was "
                    "quarantined); a model trained on this data never learns them: fix or remove those folders",
                    len(empty), console.some(empty))
    if (dup := m.get("duplicates") or {}).get("label_conflicts"):
        log.warning("etl: %d image(s) repeat the bytes of an image in another class folder (e.g. %s): one of each "
                    "pair is labelled wrong, and a model is trained to answer both; move or remove the wrong one",
                    dup["label_conflicts"], "; ".join(dup["conflict_examples"]))
    if dup.get("copies", 0) > dup.get("label_conflicts", 0):
        log.warning("etl: %d image(s) repeat another's bytes (e.g. %s)%s",
                    dup["copies"] - dup.get("label_conflicts", 0), "; ".join(dup["examples"]),
                    f"; {dup['across_splits']} of them in another split than their copy, so val/test scores count "
                    "images the model trained on: remove the copies" if dup["across_splits"] else
                    ": each is a row of its own (remove the copies to weigh each image once)")
    if len(m["classes"]) == 1:  # it trains to accuracy 1.000 and answers that class for any image
        log.warning("etl: one class (%s): a classifier needs at least two class folders", m["classes"][0])
    untrained = [c for c in m["classes"] if c not in empty and not m["counts"]["train"].get(c)]
    if untrained:  # a split hashes each file: a class of a few images can miss the train split
        log.warning("etl: %d class(es) have images but none in the train split (%s), so a model never learns "
                    "them: %s", len(untrained), console.some(untrained),
                    layouts.more_rows_fix(m.get("layout"), "train", untrained[:10]))
    if sum(m["counts"]["train"].values()) and not sum(m["counts"]["val"].values()):  # not only train's refusal
        log.warning("etl: the val split is empty, and `raymill train` refuses such data (it ranks its checkpoints "
                    "by val_acc): %s", layouts.more_rows_fix(m.get("layout"), "val", m["classes"]))
