"""How an ImageFolder tree is laid out: `<class>/<image>`, or already split, `<split>/<class>/<image>`.

Many datasets come split by their makers (most Kaggle and Hugging Face image-folder exports;
ImageNet's once its val/ is sorted into class folders). Read as `<class>/<image>`, such a tree
trains a classifier of the folders `train`, `val` and `test`: it reports a plausible accuracy and
is worthless. So a tree with a `train/` of class folders, whose other top folders holding files
all name splits too, is read as split (`etl.layout=auto`): the class is the second folder, and
each image keeps the split its makers gave it. A split the tree lacks is carved from `train/` by
the same hash as an unsplit tree's (`etl.split` shares), so a `train/` + `test/` tree still gets a
val split to pick checkpoints by. `etl.layout=classes` reads such folders as classes after all.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterable

from stages.common.config import ConfigError
from stages.etl.sources import shown

__all__ = ["Layout", "SPLIT_FOLDERS", "detect", "advice", "wrapper_hint", "split_named_classes", "more_rows_fix"]

# Folder names (any case) that name a split, and the split they name.
SPLIT_FOLDERS = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val",
                 "dev": "val", "test": "test", "testing": "test"}


@dataclass(frozen=True)
class Layout:
    """`splits`: {top folder as listed: the split it names}; empty for a `<class>/<image>` tree.
    `unlabelled`: split folders holding images but no class folder (a Kaggle `test/` of unlabelled
    images): left out, as no label can be read, and their split is carved from `train/`."""
    splits: dict[str, str] = field(default_factory=dict)
    unlabelled: tuple[str, ...] = ()
    # Top folders that name no split beside a train/ of class folders (read as classes: say so)
    strays: tuple[str, ...] = ()

    @property
    def depth(self) -> int:
        """How many folders come before the class folder."""
        return 1 if self.splits else 0

    def class_folder(self, rel: str) -> str | None:
        """The folder that names `rel`'s class, or None when `rel` lies outside any class folder."""
        parts = rel.split("/")
        return parts[self.depth] if len(parts) > self.depth + 1 else None

    def left_out(self, rel: str) -> bool:
        """Whether `rel` lies in an unlabelled split folder."""
        return rel.split("/", 1)[0] in self.unlabelled

    def record(self, unlabelled_files: int = 0) -> dict[str, Any]:
        """The manifest's account of how the tree was read."""
        if not self.splits:
            return {"kind": "classes"}
        return {"kind": "splits", "folders": dict(sorted(self.splits.items())),
                "unlabelled_folders": list(self.unlabelled), "unlabelled_files": unlabelled_files}

    def where(self) -> str:
        """Where a file must lie, for messages."""
        return "<split>/<class_name>/" if self.splits else "<class_name>/"

    def describe(self, unlabelled_files: int = 0) -> str:
        """One line for the log: how the tree was read, and how to read it otherwise."""
        if self.strays:
            return (f"the input has a train/ folder of class folders, but also top folder(s) "
                    f"{', '.join(map(shown, self.strays))} that name no split, so every top folder is read as a "
                    "class; if train/ (val/, test/) hold the splits, move the others out of the input")
        tops = sorted(map(shown, self.splits))
        line = (f"the input is split by its folders ({', '.join(f'{t}/' for t in tops)}): each image keeps its "
                f"split, and its class is the folder below (etl.layout=classes reads {' and '.join(tops)} as classes)")
        if self.unlabelled:
            line += (f"; {unlabelled_files} file(s) in {', '.join(f'{shown(t)}/' for t in self.unlabelled)} lie in no "
                     "class folder: unlabelled, left out")
        return line

    def split_of(self, rel: str, fractions: Any, hashed_split) -> str:
        """The split of the file at `rel`: its split folder's, or, for a file in `train/`, the hashed
        split among train and the splits the tree has no folder for (shares as in `fractions`)."""
        if not self.splits:
            return hashed_split(rel, fractions)
        given = self.splits[rel.split("/", 1)[0]]
        return given if given != "train" else hashed_split(rel, self._carved(fractions))

    def _carved(self, fractions: Any) -> SimpleNamespace:
        """`fractions` over train and the splits without a folder, renormalised: a tree with a
        `test/` folder carves only val from `train/`, at val / (train + val)."""
        present = set(self.splits.values())
        shares = {s: getattr(fractions, s) if s == "train" or s not in present else 0.0 for s in ("train", "val", "test")}
        total = sum(shares.values())
        if total <= 0:  # etl.split.train=0 with no split to carve: train/ stays train
            return SimpleNamespace(train=1.0, val=0.0, test=0.0)
        return SimpleNamespace(**{s: v / total for s, v in shares.items()})


def detect(rels: Iterable[str], top_folders: Iterable[str], layout: str) -> Layout:
    """The tree's layout from its files' relative paths and its top folders (empty ones included),
    as `etl.layout` (auto|classes|splits) asks."""
    rels = list(rels)
    holding = {r.split("/", 1)[0] for r in rels if "/" in r}  # as the OS names them: the files' paths
    if layout == "classes":
        return Layout()
    named = {t: SPLIT_FOLDERS.get(t.lower()) for t in holding | set(top_folders)}
    labelled = {r.split("/", 1)[0] for r in rels if r.count("/") >= 2}  # with images in folders below
    has_train = any(named[t] == "train" for t in labelled)
    strays = tuple(sorted(t for t in holding if not named[t]))  # an empty folder holds nothing to read
    if layout == "splits" and not has_train:
        raise ConfigError(f"etl.layout=splits, but the input has no train folder of class folders (split folder "
                          f"names: {', '.join(sorted(SPLIT_FOLDERS))}); lay it out as <split>/<class_name>/<image>, "
                          "or set etl.layout=auto")
    if layout == "splits" and strays:
        raise ConfigError(f"etl.layout=splits, but top folder(s) {', '.join(map(shown, strays))} name no split "
                          f"(split folder names: {', '.join(sorted(SPLIT_FOLDERS))}); move them out of the input, "
                          "or set etl.layout=auto")
    if not has_train:
        return Layout()
    if strays:  # read as classes, as before; the stage says why
        return Layout(strays=strays)
    if len({named[t] for t in holding}) != len(holding):
        raise ConfigError(f"the input's folders {', '.join(sorted(map(shown, holding)))} name one split twice; "
                          "merge them, or rename one")
    # an empty split folder, or one of unlabelled images, gives its split nothing: it is carved
    return Layout({t: named[t] for t in labelled}, tuple(sorted(holding - labelled)))


def advice(layout: Layout, source: str, rels: list[str], classes: list[str], asked: str,
           unlabelled_files: int) -> list[tuple[int, str]]:
    """(log level, line) for how the tree was read: a split tree's account (info), and a warning
    for each reading that is likely not what the user meant (stray folders beside train/, one
    wrapper folder around the classes, classes named like splits)."""
    lines = [(logging.INFO, layout.describe(unlabelled_files))] if layout.splits else []
    if layout.strays:
        lines.append((logging.WARNING, layout.describe()))
    for hint in (wrapper_hint(source, rels, layout), split_named_classes(classes, layout, asked)):
        if hint:
            lines.append((logging.WARNING, hint))
    return lines


def wrapper_hint(source: str, rels: list[str], layout: Layout) -> str | None:
    """For a `<class>/` tree of one class folder whose every image lies in folders below it (an
    archive unpacked into `<input>/dataset/<class>/`): the fix, naming the folder to read instead."""
    if layout.splits or not rels:
        return None
    folders = {r.split("/")[0] for r in rels}
    below = {r.split("/")[1] for r in rels if r.count("/") > 1}
    if len(folders) != 1 or len(below) < 2 or any(r.count("/") <= 1 for r in rels):
        return None
    names = ", ".join(map(shown, sorted(below)[:4])) + (", ..." if len(below) > 4 else "")
    return (f"the one class folder holds every image in folders below it ({names}): if those are the "
            f"classes (or train/, val/), point the input (--input, or run.source) at "
            f"'{source.rstrip('/')}/{shown(folders.pop())}'")


def split_named_classes(classes: list[str], layout: Layout, asked: str = "auto") -> str | None:
    """For a `<class>/` tree whose classes include `train` and another split's name: the warning
    that it trains a classifier of those folders. Under `etl.layout=auto` such a tree was not read
    as split, so its `train/` holds its images right inside (labels in file names, as Kaggle's
    cats-vs-dogs, or unlabelled images); `etl.layout=classes` asked for it, and is not warned."""
    named = [c for c in classes if SPLIT_FOLDERS.get(c.lower())]
    if asked == "classes" or layout.splits or layout.strays or len(named) < 2 or \
            "train" not in {SPLIT_FOLDERS[c.lower()] for c in named}:
        return None
    return (f"the classes {', '.join(named)} are named like splits: a model trained on this data tells those "
            "folders apart. If they are splits, lay the images out as <split>/<class_name>/<image>")


def more_rows_fix(recorded: dict | None, split: str, classes: list[str]) -> str:
    """How to give `split` rows of `classes`, from a manifest's `layout` record: a split tree's
    own folder takes images (its etl.split share is not used); any other split is hashed from the
    files at its etl.split share."""
    folders = (recorded or {}).get("folders") or {}
    folder = next((shown(name) for name, given in sorted(folders.items()) if given == split), None)
    if folder is not None:
        return f"add images to {', '.join(f'{folder}/{c}/' for c in classes)}"
    train = next((shown(name) for name, given in sorted(folders.items()) if given == "train"), None)
    source = f"its {train}/ folder" if train else "the files"
    return f"add images to those class folders, or raise etl.split.{split} (the {split} split is hashed from {source})"

