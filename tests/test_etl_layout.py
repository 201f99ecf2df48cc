"""ETL on a tree its makers already split (`<split>/<class>/<image>`, stages.etl.layout): the
class is the second folder and each image keeps its split; other trees are read as before."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stages.common.config import ConfigError, EtlConfig, S3Config
from stages.etl import stage as etl
from stages.etl.integrity import verify
from stages.etl.layout import split_named_classes
from tests.conftest import image_bytes

CFG = EtlConfig(image_size=16, shard_max_rows=10)


def _split_tree(root: Path, per_split: dict[str, int], classes=("cat", "dog")) -> dict[str, str]:
    """{relative path: its split folder} for `per_split` images of each class under each folder."""
    written = {}
    for s_index, (folder, n) in enumerate(per_split.items()):
        for c_index, name in enumerate(classes):
            (root / folder / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                rel = f"{folder}/{name}/{name}_{i:03d}.jpg"
                (root / rel).write_bytes(image_bytes(100 * s_index + 10 * c_index + i, size=(40, 30)))
                written[rel] = folder
    return written


def test_a_split_tree_keeps_its_splits_and_takes_classes_from_the_folder_below(tmp_path, ray_session):
    written = _split_tree(tmp_path / "src", {"train": 6, "Validation": 2, "test": 3})
    (tmp_path / "src" / "train" / "bird").mkdir()  # an empty class folder is a class, as ImageFolder's
    (tmp_path / "src" / "train" / "labels.csv").write_text("not an image in a class folder")
    art = etl.run(CFG, str(tmp_path / "src"), str(tmp_path / "ds"))
    m = art.manifest
    assert m["classes"] == ["bird", "cat", "dog"]
    assert m["counts"] == {"train": {"bird": 0, "cat": 6, "dog": 6}, "val": {"bird": 0, "cat": 2, "dog": 2},
                           "test": {"bird": 0, "cat": 3, "dog": 3}}
    quarantine = (Path(art.path) / m["quarantine"]["path"]).read_text().splitlines()
    assert [(q["path"], q["reason"]) for q in map(json.loads, quarantine)] == [("train/labels.csv",
                                                                                "outside_class_folder")]
    split_of_folder = {"train": "train", "Validation": "val", "test": "test"}
    for shard in (s for s in m["shards"] if s["format"] == "parquet"):
        for row in pq.read_table(Path(art.path) / shard["path"]).to_pylist():
            folder, name, _ = row["path"].split("/")
            assert written[row["path"]] == folder and shard["split"] == split_of_folder[folder]
            assert m["classes"][row["label"]] == name
    assert verify(art.path) == []
    assert m["layout"] == {"kind": "splits", "folders": {"Validation": "val", "test": "test", "train": "train"},
                           "unlabelled_folders": [], "unlabelled_files": 0}


def test_a_test_folder_of_unlabelled_images_is_left_out_and_test_is_carved_from_train(tmp_path, ray_session):
    """A Kaggle-style tree: `train/<class>/` and `test/` of unlabelled images. Those cannot be
    scored, and quarantined they would count as bad files (past etl.max_bad_fraction here)."""
    _split_tree(tmp_path / "src", {"train": 12})
    (tmp_path / "src" / "test").mkdir()
    for i in range(30):
        (tmp_path / "src" / "test" / f"{i:04d}.jpg").write_bytes(image_bytes(500 + i, size=(40, 30)))
    art = etl.run(CFG, str(tmp_path / "src"), str(tmp_path / "ds"))
    m = art.manifest
    assert m["classes"] == ["cat", "dog"] and m["totals"]["files_in"] == 24 and m["totals"]["quarantined"] == 0
    assert m["layout"] == {"kind": "splits", "folders": {"train": "train"}, "unlabelled_folders": ["test"],
                           "unlabelled_files": 30}
    assert sum(m["counts"]["test"].values()) > 0 and sum(map(sum, (c.values() for c in m["counts"].values()))) == 24


def test_a_split_tree_without_val_carves_val_from_train_alone(tmp_path):
    _split_tree(tmp_path / "src", {"train": 60, "test": 5})
    listing = etl.discover(str(tmp_path / "src"))
    assert listing.classes == ["cat", "dog"] and listing.layout.splits == {"train": "train", "test": "test"}
    placed = {rel: task["split"] for task in etl.plan_tasks(listing, CFG) for _, rel, _, _ in task["items"]}
    by_folder = Counter((rel.split("/")[0], split) for rel, split in placed.items())
    assert by_folder[("test", "test")] == 10 and by_folder[("train", "test")] == 0
    # val gets etl.split.val / (train + val) of train/: 1/9 of 120 images, within the hash's spread
    assert 5 <= by_folder[("train", "val")] <= 24 and sum(by_folder.values()) == 130


def test_other_trees_are_read_as_class_folders(tmp_path):
    # classes that happen to be called train and test, with their images right inside: classes
    for name in ("train", "test"):
        (tmp_path / "flat" / name).mkdir(parents=True)
        (tmp_path / "flat" / name / "a.jpg").write_bytes(image_bytes(1))
    flat = etl.discover(str(tmp_path / "flat"))
    assert flat.classes == ["test", "train"]  # and ETL says what that trains:
    assert "the classes test, train are named like splits" in split_named_classes(flat.classes, flat.layout)
    _split_tree(tmp_path / "split", {"train": 1, "val": 1})
    # etl.layout=classes reads split folders as classes, as before
    asked = etl.discover(str(tmp_path / "split"), layout="classes")
    assert asked.classes == ["train", "val"] and split_named_classes(asked.classes, asked.layout, "classes") is None
    # a top folder that is not a split's name: every top folder is a class
    (tmp_path / "split" / "extra" / "x").mkdir(parents=True)
    (tmp_path / "split" / "extra" / "x" / "b.jpg").write_bytes(image_bytes(2))
    mixed = etl.discover(str(tmp_path / "split"))
    assert mixed.classes == ["extra", "train", "val"] and split_named_classes(mixed.classes, mixed.layout) is None


def test_a_layout_that_cannot_be_read_is_refused_naming_the_fix(tmp_path):
    _split_tree(tmp_path / "cls", {"cat": 1, "dog": 1}, classes=("x",))
    with pytest.raises(ConfigError, match="etl.layout=splits, but the input has no train folder of class folders"):
        etl.discover(str(tmp_path / "cls"), layout="splits")
    _split_tree(tmp_path / "twice", {"train": 1, "val": 1, "valid": 1})
    with pytest.raises(ConfigError, match="name one split twice; merge them, or rename one"):
        etl.discover(str(tmp_path / "twice"))


def test_a_split_tree_on_s3(tmp_path, s3_bucket):
    """An object store lists no folders, only keys: the layout comes from the keys."""
    import s3fs

    endpoint, bucket = s3_bucket
    _split_tree(tmp_path / "src", {"train": 2, "val": 1})
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.put(str(tmp_path / "src") + "/", f"{bucket}/raw/", recursive=True)
    listing = etl.discover(f"s3://{bucket}/raw", S3Config(endpoint_url=endpoint))
    assert listing.classes == ["cat", "dog"] and listing.layout.splits == {"train": "train", "val": "val"}
    assert sorted(rel.split("/")[0] for rel, _ in listing.files) == ["train"] * 4 + ["val"] * 2


def test_one_wrapper_folder_around_the_classes_is_named_with_the_fix():
    from stages.etl.layout import Layout, wrapper_hint

    rels = ["dataset/cat/a.jpg", "dataset/dog/b.jpg", "dataset/dog/c.jpg"]
    assert "point the input (--input, or run.source) at 's3://b/raw/dataset'" in wrapper_hint("s3://b/raw/", rels, Layout())
    assert wrapper_hint("/d", ["train/" + r for r in rels], Layout({"train": "train"})) is None
    assert wrapper_hint("/d", rels + ["dataset/loose.jpg"], Layout()) is None  # images in the class folder too
    assert wrapper_hint("/d", rels + ["other/x.jpg"], Layout()) is None  # two classes
    assert wrapper_hint("/d", ["dataset/2024/a.jpg"], Layout()) is None  # one folder below: no classes to name


def test_stray_folders_beside_train_are_named_and_macos_zip_folders_are_hidden(tmp_path):
    _split_tree(tmp_path / "src", {"train": 1, "val": 1})
    (tmp_path / "src" / "__MACOSX" / "train" / "cat").mkdir(parents=True)  # macOS zip's resource forks
    (tmp_path / "src" / "__MACOSX" / "train" / "cat" / "._cat_000.jpg").write_bytes(b"\0\5\26\7")
    (tmp_path / "src" / "models").mkdir()  # empty: holds nothing to read
    listing = etl.discover(str(tmp_path / "src"))
    assert listing.layout.splits == {"train": "train", "val": "val"} and listing.classes == ["cat", "dog"]
    (tmp_path / "src" / "notes").mkdir()
    (tmp_path / "src" / "notes" / "n.jpg").write_bytes(image_bytes(9))
    listing = etl.discover(str(tmp_path / "src"))  # a folder of files that names no split: classes, said
    assert listing.classes == ["models", "notes", "train", "val"] and listing.layout.strays == ("notes",)
    assert "top folder(s) notes that name no split" in listing.layout.describe()
    import logging

    from stages.etl.layout import advice

    said = advice(listing.layout, "/src", [rel for rel, _ in listing.files], listing.classes, "auto", 0)
    assert [(level, "notes" in line) for level, line in said] == [(logging.WARNING, True)]
    with pytest.raises(ConfigError, match="etl.layout=splits, but top folder.s. notes name no split"):
        etl.discover(str(tmp_path / "src"), layout="splits")


def test_shares_a_split_tree_supplies_are_not_needed_and_zero_shares_carve_nothing(tmp_path):
    from types import SimpleNamespace

    from stages.common.config import load_config
    from stages.etl.layout import Layout
    from tests.conftest import REPO
    from workflow import preflight

    cfg = load_config(REPO / "configs/smoke.yaml", ["etl.split.train=1", "etl.split.val=0", "etl.split.test=0"])
    with pytest.raises(ConfigError, match="etl.split.val=0"):
        preflight.needed_splits(cfg)
    preflight.needed_splits(cfg, given={"train", "val", "test"})  # the tree's own val/ and test/
    shares = SimpleNamespace(train=0.0, val=0.0, test=1.0)
    tree = Layout({"train": "train", "test": "test"})
    assert {tree.split_of(f"train/c/{i}.jpg", shares, etl.split_of) for i in range(50)} == {"train"}


def test_nas_thumbnails_and_windows_caches_are_hidden_not_images(tmp_path):
    """A Synology copy holds `@eaDir/<image>/SYNOFILE_THUMB_*.jpg` beside every image: read, each
    photo came back several times and a test image's thumbnail landed in train."""
    for cls, seed in (("cat", 1), ("dog", 2)):
        (tmp_path / "src" / cls / "@eaDir" / "a.jpg").mkdir(parents=True)
        (tmp_path / "src" / cls / "a.jpg").write_bytes(image_bytes(seed))
        (tmp_path / "src" / cls / "@eaDir" / "a.jpg" / "SYNOFILE_THUMB_S.jpg").write_bytes(image_bytes(seed))
        (tmp_path / "src" / cls / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (tmp_path / "src" / "#recycle" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "#recycle" / "cat" / "old.jpg").write_bytes(image_bytes(3))
    listing = etl.discover(str(tmp_path / "src"))
    assert listing.classes == ["cat", "dog"] and [rel for rel, _ in listing.files] == ["cat/a.jpg", "dog/a.jpg"]


def test_outputs_are_written_with_the_umask_not_mkstemps_0600(tmp_path):
    """Another user (or a Ray worker under another uid) could not read a dataset or a model."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import fsspec, os, sys; from stages.common.storage import write_bytes_atomic; "
            "write_bytes_atomic(fsspec.filesystem('file'), sys.argv[1], b'x'); print(oct(os.stat(sys.argv[1]).st_mode & 0o777))")
    for umask, mode in ((0o022, "0o644"), (0o077, "0o600"), (0o002, "0o664")):
        out = subprocess.run([sys.executable, "-c", f"import os; os.umask({umask}); exec({code!r})",
                              str(tmp_path / f"f{umask}")], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.stdout.strip() == mode, (umask, out.stdout, out.stderr[-500:])


def test_a_damaged_exif_block_decodes_without_a_warning_line(tmp_path):
    """Pillow's "Corrupt EXIF data" UserWarning reached the console from every ETL task; the pixels decode."""
    import subprocess
    import sys

    from tests.conftest import REPO

    good = image_bytes(4)
    bad = good[:2] + b"\xff\xe1\x00\x20Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x05" + b"\xff" * 14 + good[2:]
    (tmp_path / "bad.jpg").write_bytes(bad)
    code = ("import sys; from stages.etl import images; "
            "print(images.decode_rgb(open(sys.argv[1], 'rb').read(), 32).shape)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bad.jpg")], capture_output=True, text=True,
                         cwd=REPO)
    assert out.stdout.strip() == "(32, 32, 3)" and not out.stderr, out.stderr[-500:]


def test_a_class_missing_from_train_and_an_empty_val_are_warned_with_the_fix_that_applies(tmp_path, ray_session,
                                                                                           caplog):
    """In a split tree the etl.split share of a split with a folder is not used: the fix for a class
    with no train image is that folder; val, carved from train/ here, takes its share."""
    from stages.common.config import SplitFractions

    _split_tree(tmp_path / "src", {"train": 4, "test": 2})
    (tmp_path / "src" / "test" / "bird").mkdir()
    for i in range(2):
        (tmp_path / "src" / "test" / "bird" / f"b{i}.jpg").write_bytes(image_bytes(900 + i, size=(40, 30)))
    cfg = CFG.model_copy(update={"split": SplitFractions(train=1.0, val=0.0, test=0.0)})
    m = etl.run(cfg, str(tmp_path / "src"), str(tmp_path / "ds")).manifest
    assert set(m["counts"]["val"].values()) == {0} and m["counts"]["train"]["bird"] == 0
    assert all(set(c) == set(m["classes"]) for c in m["counts"].values())  # every class in every split
    assert "1 class(es) have images but none in the train split (bird), so a model never learns them: add images to " \
           "train/bird/" in caplog.text
    assert "the val split is empty, and `raymill train` refuses such data (it ranks its checkpoints by val_acc): " \
           "add images to those class folders, or raise etl.split.val (the val split is hashed from its train/ " \
           "folder)" in caplog.text


def test_copies_of_an_image_are_counted_and_one_across_splits_is_warned_of(tmp_path, ray_session, caplog):
    """The same bytes under two names are two rows; a copy in test/ of a train/ image lets the test
    score count an image the model trained on."""
    _split_tree(tmp_path / "src", {"train": 4, "test": 2})
    src = tmp_path / "src"
    (src / "test" / "cat" / "again.jpg").write_bytes((src / "train" / "cat" / "cat_001.jpg").read_bytes())
    (src / "train" / "dog" / "twin.jpg").write_bytes((src / "train" / "dog" / "dog_002.jpg").read_bytes())
    # and one under another class: a label conflict, said apart (one of the two labels is wrong)
    (src / "train" / "dog" / "not_a_dog.jpg").write_bytes((src / "train" / "cat" / "cat_002.jpg").read_bytes())
    m = etl.run(CFG, str(src), str(tmp_path / "ds")).manifest
    assert (m["duplicates"]["copies"], m["duplicates"]["across_splits"], m["duplicates"]["label_conflicts"]) == (3, 1, 1)
    assert "test/cat/again.jpg = train/cat/cat_001.jpg" in m["duplicates"]["examples"]
    assert "etl: 1 image(s) repeat the bytes of an image in another class folder" in caplog.text
    assert {"train/dog/not_a_dog.jpg = train/cat/cat_002.jpg",
            "train/cat/cat_002.jpg = train/dog/not_a_dog.jpg"} & set(m["duplicates"]["conflict_examples"])
    assert "etl: 2 image(s) repeat another's bytes" in caplog.text
    assert "1 of them in another split than their copy, so val/test scores count images the model trained on" \
           in caplog.text
