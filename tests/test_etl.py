"""ETL on real generated image files, including broken ones; shards read back by independent readers."""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from stages.etl import stage as etl
from stages.etl.images import REASONS
from stages.etl.integrity import verify
from stages.etl.images import decode_rgb
from stages.common import storage
from stages.common.artifacts import data_fingerprint
from stages.common.config import ConfigError, EtlConfig, S3Config
from tests.conftest import BAD_FILES, FlakyS3Proxy, make_tree

CFG = EtlConfig(image_size=32, shard_max_rows=10)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return root, make_tree(root)


@pytest.fixture(scope="module")
def published(tree, tmp_path_factory, ray_session):
    out = tmp_path_factory.mktemp("out") / "ds"
    return etl.run(CFG, str(tree[0]), str(out))


def test_counts_add_up_and_every_bad_file_is_quarantined(tree, published):
    m = published.manifest
    written = tree[1]
    good = [rel for rel, why in written.items() if why == "ok"]
    assert m["totals"] == {"files_in": len(written), "rows_out": len(good),
                           "quarantined": len(BAD_FILES), "hidden_skipped": 0}
    lines = (Path(published.path) / m["quarantine"]["path"]).read_text().splitlines()
    reasons = {q["path"]: q["reason"] for q in map(json.loads, lines)}
    assert set(reasons.values()) <= set(REASONS)  # the documented vocabulary (README's quarantine reasons)
    assert reasons == {rel: why for rel, why in written.items() if why != "ok"}
    assert m["classes"] == ["bird", "cat", "dog"]
    assert sum(sum(c.values()) for c in m["counts"].values()) == len(good)


def test_parquet_reads_with_pyarrow_and_labels_match_folders(tree, published):
    m = published.manifest
    rows = []
    for shard in m["shards"]:
        if shard["format"] == "parquet":
            table = pq.read_table(Path(published.path) / shard["path"])
            assert table.num_rows == shard["rows"]
            rows += table.to_pylist()
    assert len(rows) == m["totals"]["rows_out"]
    for r in rows:
        assert m["classes"][r["label"]] == r["path"].split("/")[0]
        assert decode_rgb(r["image"], 32).shape == (32, 32, 3)
    # the stored pixels are the source's, resized: compare against a fresh decode
    sample = rows[0]
    expected = decode_rgb((tree[0] / sample["path"]).read_bytes(), 32).astype(int)
    assert np.abs(decode_rgb(sample["image"], 32).astype(int) - expected).mean() < 8


def test_the_parquet_folder_reads_whole_with_a_split_column(published):
    """As a user reads it, with no manifest: the tar shards had sat in the same folder (pandas
    failed on them) and the split was only in the file names."""
    import pandas as pd

    m = published.manifest
    frame = pd.read_parquet(Path(published.path) / "shards" / "parquet")
    assert len(frame) == m["totals"]["rows_out"]
    by_split = frame.groupby("split", observed=True).size().to_dict()
    assert by_split == {split: sum(counts.values()) for split, counts in m["counts"].items() if sum(counts.values())}
    assert {p.parent.name for p in (Path(published.path) / "shards" / "tar").rglob("*.tar")} <= \
        {f"split={split}" for split in m["counts"]}


def test_tar_shards_read_with_webdataset_library(published):
    import webdataset as wds

    m = published.manifest
    tars = [str(Path(published.path) / s["path"]) for s in m["shards"] if s["format"] == "tar"]
    samples = list(wds.WebDataset(tars, shardshuffle=False).decode("rgb8"))
    assert len(samples) == m["totals"]["rows_out"]
    for s in samples:
        assert s["jpg"].shape == (32, 32, 3)
        assert m["classes"][int(s["cls"])] == s["json"]["class"] == s["json"]["path"].split("/")[0]
    keys = [s["__key__"] for s in samples]
    assert len(set(keys)) == len(keys)


def test_tar_shards_read_with_ray_data(published, ray_session):
    import ray.data

    m = published.manifest
    tars = [str(Path(published.path) / s["path"]) for s in m["shards"] if s["format"] == "tar"]
    rows = ray.data.read_webdataset(tars, decoder=None).take_all()
    assert len(rows) == m["totals"]["rows_out"]
    assert all(int(r["cls"]) == json.loads(r["json"])["label"] for r in rows)


def test_rerun_is_deterministic_and_refuses_existing_output(tree, published, tmp_path):
    with pytest.raises(etl.OutputExistsError, match="--overwrite"):
        etl.run(CFG, str(tree[0]), published.path)
    # the other engine: Ray Data's map (`published` ran plain Ray tasks, a tree of fewer files)
    with warnings.catch_warnings(record=True) as caught:  # a clean console: no deprecation of our own call
        warnings.simplefilter("always")
        again = etl.run(CFG.model_copy(update={"ray_data_min_files": 0}), str(tree[0]), str(tmp_path / "again"))
    assert not [w for w in caught if "ray_remote_args" in str(w.message)], [str(w.message) for w in caught]
    import ray.data  # ETL's own dataset runs without per-operator reservation; later ones are not told so

    assert ray.data.DataContext.get_current().op_resource_reservation_enabled, "ETL's Ray Data setting leaked"
    digest = lambda a: sorted((s["split"], s["format"], s["first_key"], s["sha256"]) for s in a.manifest["shards"])
    assert digest(again) == digest(published)
    assert again.manifest["run_id"] != published.manifest["run_id"]
    # Same images and config, new run id in every shard name: the same content fingerprint.
    assert data_fingerprint(again.manifest) == data_fingerprint(published.manifest)


def test_a_given_listing_is_the_one_etl_reads_and_records(tree, tmp_path, ray_session):
    """`raymill run` lists its source once (workflow.preflight) and hands the listing to ETL, which
    must shard exactly those files and record that listing's fingerprint, not list the tree again."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tree[0], src)
    listing = etl.discover(str(src), None, CFG.follow_symlinks, CFG.layout)
    first = next(p for p in sorted(src.rglob("*")) if p.is_file() and p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    shutil.copy(first, first.with_name("added-after-the-listing" + first.suffix))  # ETL is not told of it
    artifact = etl.run(CFG, str(src), str(tmp_path / "out"), listing=listing)
    m = artifact.manifest
    rows = sum(n for split in m["counts"].values() for n in split.values())
    assert rows + m["quarantine"]["count"] == len(listing.files) + len(listing.rejected)
    assert etl.discover(str(src), None, CFG.follow_symlinks, CFG.layout).fingerprint != listing.fingerprint


def test_overwrite_publishes_new_run_and_removes_old_shards(tree, tmp_path, ray_session, caplog):
    out = tmp_path / "ds"
    first = etl.run(CFG, str(tree[0]), str(out))
    (out / "notes.txt").write_text("the user's, not ours")
    # a manifest edited to name a file outside the output: the overwrite must not delete it
    victim = tmp_path / "victim.txt"
    victim.write_text("not in the output")
    planted = json.loads((out / "manifest.json").read_text())
    planted["shards"].append({**planted["shards"][0], "path": "../victim.txt"})
    (out / "manifest.json").write_text(json.dumps(planted))
    second = etl.run(CFG.model_copy(update={"image_size": 16}), str(tree[0]), str(out), overwrite=True)
    assert victim.exists()
    assert "were not written by raymill etl and are left in place (notes.txt)" in caplog.text  # kept, and said
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    expected = {s["path"] for s in second.manifest["shards"]} | {second.manifest["quarantine"]["path"],
                                                                  "manifest.json", "notes.txt"}
    assert files == expected
    assert first.manifest["run_id"] not in "".join(files)
    assert verify(str(out)) == []


def test_split_is_stable_when_files_are_added(tree, tmp_path):
    from stages.etl.stage import split_of

    fractions = CFG.split
    names = [f"c/{i}.jpg" for i in range(2000)]
    before = {n: split_of(n, fractions) for n in names}
    after = {n: split_of(n, fractions) for n in names + [f"c/new{i}.jpg" for i in range(500)]}
    assert all(after[n] == s for n, s in before.items())
    share = sum(s == "train" for s in before.values()) / len(before)
    assert 0.75 < share < 0.85


def test_verify_names_every_damaged_shard(published, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(published.path, copy)
    shards = [s["path"] for s in published.manifest["shards"]]
    assert verify(str(copy)) == []
    truncated, flipped, deleted = shards[0], shards[1], shards[2]
    data = (copy / truncated).read_bytes()
    (copy / truncated).write_bytes(data[: len(data) // 2])
    data = bytearray((copy / flipped).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / flipped).write_bytes(bytes(data))
    (copy / deleted).unlink()
    problems = "\n".join(verify(str(copy)))
    assert f"truncated or resized: {truncated}" in problems
    assert f"altered: {flipped}" in problems
    assert f"missing: {deleted}" in problems
    assert len(problems.splitlines()) == 3
    # a manifest that lists a shard twice, and one that points outside the output
    manifest = json.loads((copy / "manifest.json").read_text())
    good = next(s for s in manifest["shards"] if s["path"] not in (truncated, flipped, deleted))
    manifest["shards"] += [good, {**good, "path": "../../etc/hostname"}]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    problems = "\n".join(verify(str(copy)))
    assert f"the {good['format']} shards hold {manifest['totals']['rows_out'] + 2 * good['rows']} rows" in problems
    assert "outside the output: '../../etc/hostname'" in problems


def test_a_second_check_hashes_nothing_and_a_rewritten_shard_is_still_named(published, tmp_path, monkeypatch):
    """verify_once: a clean full check leaves a stamp; while every listed file keeps its size and
    mtime, the next check reads no shard. Rewriting a shard changes its mtime, so the full check
    runs again and names it with the message train refuses with."""
    from stages.etl import integrity

    monkeypatch.setattr(integrity, "STAMP_DIR", tmp_path / "stamps")
    copy = tmp_path / "copy"
    shutil.copytree(published.path, copy)
    shard = copy / published.manifest["shards"][0]["path"]
    assert integrity.verify_once(str(copy)) == [] and len(list((tmp_path / "stamps").iterdir())) == 1
    # Known answer: bytes changed behind the stamp's back (size and mtime put back) go unnoticed,
    # which shows that the second check hashed nothing.
    original, stat = shard.read_bytes(), shard.stat()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert integrity.verify_once(str(copy)) == []
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # an ordinary rewrite
    assert f"altered: {shard.relative_to(copy)}" in "\n".join(integrity.verify_once(str(copy)))
    shard.write_bytes(original)  # repaired: a full check again, and a fresh stamp
    assert integrity.verify_once(str(copy)) == [] == integrity.verify_once(str(copy))


def test_too_many_bad_files_fails_and_publishes_nothing(tree, tmp_path, ray_session):
    out = tmp_path / "ds"
    with pytest.raises(etl.EtlError, match="max_bad_fraction"):
        etl.run(CFG.model_copy(update={"max_bad_fraction": 0.05}), str(tree[0]), str(out))
    assert not out.exists() or not any(out.rglob("*")), list(out.rglob("*"))  # not even an empty shards/
    (out / "shards").mkdir(parents=True)  # a killed run's shard (no manifest): --overwrite replaces it
    (out / "shards" / "train-killed.parquet").write_bytes(b"half a shard")
    assert etl.run(CFG, str(tree[0]), str(out), overwrite=True).manifest["totals"]["rows_out"] > 0
    with pytest.raises(etl.EtlError, match=r"1 of 201 files \(0\.5%\) are bad"):  # it had read "(0%)"
        etl._check_bad_fraction(CFG.model_copy(update={"max_bad_fraction": 0.0}),
                                [{"reason": "decode_error", "path": "cat/a.jpg"}], 201, str(out))
    # the files are named (nothing is published, so no quarantine file lists them): the first ten
    bad = [{"reason": "truncated", "path": f"cat/{i:02d}.jpg"} for i in range(12)]
    with pytest.raises(etl.EtlError, match=r"cat/00.jpg \(truncated\); .*cat/09.jpg \(truncated\); and 2 more"):
        etl._check_bad_fraction(CFG.model_copy(update={"max_bad_fraction": 0.0}), bad, 201, str(out))
    # not one image: a wrong input (exit 2), whatever the threshold; raising it had published 0 rows
    with pytest.raises(etl.NoImagesError, match=r"none of the 12 files is an image") as refused:
        etl._check_bad_fraction(CFG.model_copy(update={"max_bad_fraction": 1.0}), bad, 12, str(out))
    assert "max_bad_fraction" not in str(refused.value)


def test_etl_leaves_the_stamp_so_the_first_train_hashes_nothing(tree, tmp_path, monkeypatch, ray_session):
    """ETL hashed every shard as it wrote it: its output is stamped as a clean check leaves it (the
    first train had re-hashed them all). Known answer as above: bytes flipped behind the stamp's back
    go unnoticed; an ordinary rewrite is named. Stamps are pruned to the most recently used."""
    from stages.etl import integrity

    monkeypatch.setattr(integrity, "STAMP_DIR", tmp_path / "stamps")
    out = tmp_path / "ds"
    art = etl.run(CFG, str(tree[0]), str(out))
    assert len(list((tmp_path / "stamps").iterdir())) == 1
    shard = out / art.manifest["shards"][0]["path"]
    original, stat = shard.read_bytes(), shard.stat()
    shard.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert integrity.verify_once(str(out)) == []
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert f"altered: {shard.relative_to(out)}" in "\n".join(integrity.verify_once(str(out)))
    monkeypatch.setattr(integrity, "STAMPS_KEPT", 2)
    for i in range(3):
        integrity._write_stamp(tmp_path / "stamps" / f"other{i}.json", {"files": {}})
    assert len(list((tmp_path / "stamps").glob("*.json"))) == 2


def test_a_killed_runs_output_takes_the_same_command_again(tree, tmp_path, ray_session):
    """A folder holding only a killed run's files (raymill's names, no manifest) is no dataset: the
    same command runs again without --overwrite (it had been refused, "is not empty"), and its
    publish removes them."""
    killed = tmp_path / "ds" / "shards" / "parquet" / "split=train" / "train-00000-00-20990101T000000-abcdef.parquet"
    killed.parent.mkdir(parents=True)
    killed.write_bytes(b"half a shard")
    art = etl.run(CFG, str(tree[0]), str(tmp_path / "ds"))
    assert art.manifest["totals"]["rows_out"] > 0 and not killed.exists()


def test_a_class_name_of_two_lines_is_refused_naming_the_folder(tmp_path):
    """labels.txt holds a class a line: a folder 'new\\nline' had shifted every exported label after it."""
    make_tree(tmp_path / "src", per_class=1, bad=False, classes=("cat", "new\nline"))
    with pytest.raises(ConfigError, match=r"class folder 'new\\nline' has a line break.*rename the folder"):
        etl.discover(str(tmp_path / "src"))


def test_missing_and_empty_inputs_say_what_was_looked_for(tmp_path):
    with pytest.raises(etl.InputNotFoundError, match="does not exist"):
        etl.discover(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(etl.InputNotFoundError, match="<class_name>"):  # exit 2: a wrong --input
        etl.discover(str(tmp_path / "empty"))


def test_s3_round_trip(tree, s3_bucket, ray_session):
    endpoint, bucket = s3_bucket
    s3 = S3Config(endpoint_url=endpoint)
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.put(str(tree[0]) + "/", f"{bucket}/raw/", recursive=True)
    for marker in ("raw/", "raw/cat/", "raw/cat/2024/"):  # what the console's "Create folder" writes
        fs.pipe(f"{bucket}/{marker}", b"")
    art = etl.run(CFG, f"s3://{bucket}/raw", f"s3://{bucket}/ds", s3=s3)
    assert art.manifest["totals"]["quarantined"] == len(BAD_FILES)  # markers are no files, not bad ones
    assert art.manifest["totals"]["files_in"] == len(tree[1])
    assert verify(f"s3://{bucket}/ds", s3) == []
    rows = fs.cat_file(f"{bucket}/ds/{art.manifest['quarantine']['path']}").decode().splitlines()
    # the same reasons as from a local tree: an empty object too (S3 refuses its ranged read: 416)
    assert {q["path"]: q["reason"] for q in map(json.loads, rows)} == {k: v[1] for k, v in BAD_FILES.items()}
    shard = next(s for s in art.manifest["shards"] if s["format"] == "parquet")
    with fs.open(f"{bucket}/ds/{shard['path']}", "rb") as f:
        assert pq.read_table(f).num_rows == shard["rows"]


@pytest.mark.parametrize("ray_data_min_files", [20_000, 0], ids=["ray_tasks", "ray_data"])
def test_s3_failure_mid_write_publishes_nothing(tree, s3_bucket, ray_session, ray_data_min_files):
    endpoint, bucket = s3_bucket
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.put(str(tree[0]) + "/", f"{bucket}/raw/", recursive=True)
    proxy = FlakyS3Proxy(int(endpoint.rsplit(":", 1)[1]), allow_puts=2)
    s3 = S3Config(endpoint_url=proxy.url, max_attempts=1)  # botocore's 5 attempts took 70 s to fail here
    assert storage.filesystem(f"s3://{bucket}/x", s3)[0].config_kwargs["retries"] == {"max_attempts": 1}
    try:
        with pytest.raises(etl.EtlError, match="nothing was published"):
            etl.run(CFG.model_copy(update={"ray_data_min_files": ray_data_min_files}), f"s3://{bucket}/raw",
                    f"s3://{bucket}/ds", s3=s3)
    finally:
        proxy.close()
    assert proxy.puts > 2
    fs.invalidate_cache()
    assert fs.find(f"{bucket}/ds") == []  # no manifest, no shard, nothing left behind


def test_only_the_allowed_formats_parsers_read_untrusted_bytes():
    """Pillow tried every plugin's header parser on any bytes before the allow-list was checked; a
    format left out is now named by its signature without its parser running. A BMP whose header
    declares a negative width (read unsigned) is corrupt, not a bomb; EPS (Ghostscript) is refused."""
    import io
    import struct

    from PIL import Image

    from stages.common.config import ConfigError, load_config
    from stages.etl.pixels import BadImage, open_image

    def encoded(fmt: str) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (4, 4)).save(out, fmt)
        return out.getvalue()

    allowed = ("JPEG", "PNG")
    for fmt, reason in (("TIFF", "unsupported_format"), ("PPM", "unsupported_format"), ("PNG", None)):
        try:
            open_image(encoded(fmt), allowed, 10**6)
            said = None
        except BadImage as e:
            said = e.reason
        assert said == reason, (fmt, said)
    negative = bytearray(encoded("BMP"))
    struct.pack_into("<i", negative, 18, -5)
    with pytest.raises(BadImage, match="corrupt: the header declares 4294967291x4 px"):
        open_image(bytes(negative), ("BMP",), 10**7)
    with pytest.raises(ConfigError, match="Ghostscript"):
        load_config(None, ["etl.allowed_formats=[PNG, EPS]"])
