"""Issue 14: untrusted inputs cannot hang or fool the ETL, and outputs cannot be clobbered.

Real files (symlinks, a FIFO, a device, a non-UTF-8 name), real Ray, real locks across processes,
a loopback S3 (moto) for the conditional-PUT lock.
"""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stages.etl import stage as etl
from stages.etl.integrity import verify
from stages.etl import sources
from stages.model.predict import preprocess
from stages.etl.images import REASONS, BadImage, decode_rgb
from stages.common import locks, storage
from stages.common.config import EtlConfig, S3Config
from tests.conftest import free_port, image_bytes, lock_held, make_tree

CFG = EtlConfig(image_size=32, shard_max_rows=10)


def _halves(width: int, height: int) -> np.ndarray:
    """Left half red, right half blue: any rotation shows."""
    array = np.zeros((height, width, 3), np.uint8)
    array[:, : width // 2] = (220, 20, 20)
    array[:, width // 2:] = (20, 20, 220)
    return array


def _jpeg(img: Image.Image, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95, **kwargs)
    return buf.getvalue()


def test_exif_orientation_is_applied_the_same_in_etl_and_inference():
    stored = Image.fromarray(_halves(80, 40))  # pixels as the phone stored them
    exif = stored.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    with_tag = _jpeg(stored, exif=exif.tobytes())
    upright = _jpeg(stored.transpose(Image.Transpose.ROTATE_270))  # what the user sees
    expected = decode_rgb(upright, 32, resize="stretch").astype(int)
    got = decode_rgb(with_tag, 32, resize="stretch").astype(int)
    assert np.abs(got - expected).mean() < 6  # sideways, it differs by ~100
    info = {"image_size": 32, "resize": "stretch"}
    assert np.array_equal(preprocess(with_tag, info), got)  # batch and online inference decode the same


def test_16_bit_greyscale_png_is_scaled_not_clipped():
    grey = np.tile(np.linspace(0, 65535, 64).astype(np.uint16), (64, 1))
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, format="PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode == "I;16"
    pixels = decode_rgb(buf.getvalue(), 64, resize="stretch")
    assert pixels[:, :4].mean() < 10 and pixels[:, -4:].mean() > 245  # dark to light, not all white
    assert 110 < pixels.mean() < 145


def test_32_bit_grey_tiffs_are_scaled_and_an_unreadable_range_is_quarantined():
    """TIFF (etl.allowed_formats) stores float and int32 grey: convert("RGB") clipped them, so a
    float image in 0-1 trained as black."""
    ramp = np.tile(np.linspace(0, 1, 64), (64, 1))
    tiffs = {}
    for name, values, mode in [("float 0-1", ramp, "F"), ("int32 0-65535", ramp * 65535, "I"),
                               ("float 0-1e6", ramp * 1e6, "F")]:
        buf = io.BytesIO()
        Image.fromarray(values.astype(np.float32 if mode == "F" else np.int32), mode).save(buf, format="TIFF")
        assert Image.open(io.BytesIO(buf.getvalue())).mode == mode
        tiffs[name] = buf.getvalue()
    for name in ("float 0-1", "int32 0-65535"):
        got = decode_rgb(tiffs[name], 64, resize="stretch", allowed_formats=("TIFF",))
        assert got[:, :4].mean() < 10 and got[:, -4:].mean() > 245 and 110 < got.mean() < 145, name
    with pytest.raises(BadImage, match=r"decode_error: .*\[0, 1e\+06\]: raymill reads floats in 0-1"):
        decode_rgb(tiffs["float 0-1e6"], 64, allowed_formats=("TIFF",))
    # one rule per mode: a pixel's value never depends on the image's other pixels (0.8 grey had
    # turned from 204 to 1 once one pixel read 1.01); out of range is refused, not rescaled
    for values, mode, expected in [(np.full((8, 8), 0.8), "F", 204), (np.full((8, 8), 51400), "I", 200)]:
        buf = io.BytesIO()
        Image.fromarray(values.astype(np.float32 if mode == "F" else np.int32), mode).save(buf, format="TIFF")
        assert decode_rgb(buf.getvalue(), 8, allowed_formats=("TIFF",)).max() == expected
        values[0, 0] = 1.01 if mode == "F" else 70000
        buf = io.BytesIO()
        Image.fromarray(values.astype(np.float32 if mode == "F" else np.int32), mode).save(buf, format="TIFF")
        with pytest.raises(BadImage, match="decode_error"):
            decode_rgb(buf.getvalue(), 8, allowed_formats=("TIFF",))


@pytest.mark.parametrize("mode,key", [("L", 0), ("RGB", (0, 0, 0)), ("P", 0), ("LA", None), ("I;16", 0)])
def test_transparent_pixels_are_white_whichever_way_the_png_says_so(mode, key):
    img = Image.new(mode, (32, 32), 0 if mode in ("L", "P", "I;16") else (0, 0) if mode == "LA" else (0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG", **({} if key is None else {"transparency": key}))  # tRNS, or an alpha channel
    assert decode_rgb(buf.getvalue(), 16).min() == 255


def test_mpo_jpeg_is_accepted_as_jpeg():
    first, second = Image.fromarray(_halves(40, 40)), Image.new("RGB", (40, 40), (0, 255, 0))
    buf = io.BytesIO()
    first.save(buf, format="MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(buf.getvalue())).format == "MPO"
    got = decode_rgb(buf.getvalue(), 32).astype(int)
    assert np.abs(got - decode_rgb(_jpeg(first), 32).astype(int)).mean() < 3  # the first frame


def test_a_damaged_header_is_corrupt_and_foreign_bytes_are_not_an_image():
    """Pillow says "cannot identify" for both; the file's signature tells them apart."""
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    data = bytearray(png.getvalue())
    data[29] ^= 0xFF  # a byte of IHDR's CRC (8 signature + 4 length + 4 type + 13 data = 29)
    jpeg = b"\xff\xd8\xff\xe0" + bytes(40)
    for damaged, fmt in [(bytes(data), "PNG"), (jpeg, "JPEG"), (b"RIFF\0\0\0\0WEBPVP8 " + bytes(20), "WEBP")]:
        with pytest.raises(BadImage) as e:
            decode_rgb(damaged, 16)
        assert e.value.reason == "corrupt", (fmt, e.value)
    for foreign in (b"this is a text file\n", b"\x89PNX" + bytes(40)):
        with pytest.raises(BadImage, match="not_an_image"):
            decode_rgb(foreign, 16)


def test_the_exported_decode_with_read_rules_refuses_for_raymills_reasons():
    """preprocess.py (stages/etl/pixels.py) with the model's `read` gives the reasons ETL, infer and
    serve give, also where Pillow's own guards differ from raymill's: a bomb past Pillow's limit had
    been `corrupt`, a cut-short JPEG a bare OSError."""
    import struct
    import zlib

    from stages.etl import pixels

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    huge = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
    jpeg = io.BytesIO()
    Image.effect_noise((64, 64), 64).convert("RGB").save(jpeg, format="JPEG")
    read = {"allowed_formats": ["JPEG", "PNG"], "max_image_pixels": 89_478_485}
    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 89_478_485  # Pillow's default, as a client's process has it (raymill lifts it)
    try:
        for data, reason in [(huge + chunk(b"IEND", b""), "decompression_bomb"),
                             (jpeg.getvalue()[:len(jpeg.getvalue()) // 2], "truncated")]:
            with pytest.raises(BadImage) as e:
                pixels.pixels(data, 16, "crop", read)
            assert e.value.reason == reason
            with pytest.raises(BadImage) as ours:
                decode_rgb(data, 16, allowed_formats=("JPEG", "PNG"))
            assert ours.value.reason == reason
    finally:
        Image.MAX_IMAGE_PIXELS = limit


@pytest.fixture
def hostile_tree(tmp_path):
    """A class tree plus everything that must not be read as an image."""
    root, outside = tmp_path / "src", tmp_path / "outside"
    make_tree(root, per_class=4, bad=False)
    outside.mkdir()
    (outside / "secret.jpg").write_bytes(image_bytes(5))
    (outside / "lion_000.jpg").write_bytes(image_bytes(6))
    os.symlink(outside / "secret.jpg", root / "cat" / "escape.jpg")
    os.symlink("/dev/zero", root / "cat" / "zero.jpg")
    os.symlink(root / "dog" / "dog_000.jpg", root / "cat" / "inside.jpg")  # inside the tree: followed
    os.mkfifo(root / "dog" / "pipe.jpg")
    os.symlink(root / "dog" / "gone.jpg", root / "dog" / "dangling.jpg")  # a link to nothing
    os.symlink(outside, root / "lion")  # a class folder that is a link out of the tree
    (root / os.fsdecode(b"bird/caf\xe9.jpg")).write_bytes(image_bytes(7))  # not UTF-8
    return root


def test_links_fifos_devices_and_bad_names_are_quarantined_not_read(hostile_tree, tmp_path, ray_session):
    started = time.monotonic()
    art = etl.run(CFG, str(hostile_tree), str(tmp_path / "ds"))  # a FIFO read would block forever
    assert time.monotonic() - started < 120
    m = art.manifest
    rows = (Path(art.path) / m["quarantine"]["path"]).read_text().splitlines()
    reasons = {q["path"]: q["reason"] for q in map(json.loads, rows)}
    assert set(reasons.values()) <= set(REASONS)
    assert reasons == {"cat/escape.jpg": "symlink_outside_source", "cat/zero.jpg": "symlink_outside_source",
                       "dog/pipe.jpg": "not_a_regular_file", "lion": "symlink_outside_source",
                       "dog/dangling.jpg": "symlink_broken"}
    assert m["classes"] == ["bird", "cat", "dog"]  # the linked class folder is a row, not silently gone
    assert m["totals"]["rows_out"] == 3 * 4 + 2  # + cat/inside.jpg + the non-UTF-8 name, keyed by bytes
    import pyarrow.parquet as pq

    paths = [p for s in m["shards"] if s["format"] == "parquet"
             for p in pq.read_table(Path(art.path) / s["path"])["path"].to_pylist()]
    assert "bird/caf\\xe9.jpg" in paths and "cat/inside.jpg" in paths
    assert verify(art.path) == []


def test_symlink_policy_and_read_cap(hostile_tree, caplog):
    with caplog.at_level("WARNING", logger="stages.etl.stage"):
        never = etl.discover(str(hostile_tree), follow_symlinks="never")
    # the linked class folder is named with the key to change (it had been one quarantine row)
    assert "['lion'] in" in caplog.text and "set etl.follow_symlinks=always" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="stages.etl.stage"):
        etl.discover(str(hostile_tree), follow_symlinks="never")  # a notebook's second ETL: said again
    assert "['lion'] in" in caplog.text  # (`raymill run` lists once: workflow.preflight.Inputs)
    assert {q["path"]: q["reason"] for q in never.rejected}["cat/inside.jpg"] == "symlink_not_followed"
    always = etl.discover(str(hostile_tree), follow_symlinks="always")
    assert "lion/secret.jpg" in [rel for rel, _ in always.files]  # followed when asked
    fs = storage.filesystem(str(hostile_tree))[0]
    with pytest.raises(sources.BadImage, match="not_a_regular_file"):  # not read until MemoryError
        sources.read_capped(fs, str(hostile_tree), "cat/zero.jpg", 10**6, "always")
    with pytest.raises(sources.BadImage, match="too_large"):  # the cap holds whatever the listing said
        sources.read_capped(fs, str(hostile_tree), "bird/bird_000.jpg", 100, "inside_source")


def test_files_in_check_survives_python_dash_o(tmp_path):
    for name in ("1.jpg", "2.jpg"):
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "a" / name).write_bytes(image_bytes(1))
    listing = etl.discover(str(tmp_path))
    results = [{"split": "train", "shards": [], "quarantine": [], "counts": {"a": 1}}]  # one file lost
    with pytest.raises(etl.EtlError, match="files_in=2 != rows_out=1"):
        etl._manifest(CFG, "src", "run", listing, results, [], time.perf_counter())


def test_second_run_on_a_locked_output_exits_2_naming_the_holder(tmp_path, ray_session, capsys):
    from workflow.__main__ import main

    src, out = tmp_path / "src", tmp_path / "ds"
    make_tree(src, per_class=3, bad=False)
    with lock_held(out, "etl") as holder:  # dies holding the lock: the lock file stays behind
        with pytest.raises(locks.OutputLockedError, match=f"pid {holder.pid}"):
            etl.run(CFG, str(src), str(out))
        assert main(["etl", "--input", str(src), "--output", str(out)]) == 2
        assert f"pid {holder.pid}" in capsys.readouterr().err
    assert (out / locks.LOCK_NAME).exists()
    art = etl.run(CFG, str(src), str(out))  # stale: taken over
    assert verify(art.path) == [] and not (out / locks.LOCK_NAME).exists()


def _s3_output(s3_bucket, name: str):
    """(S3Config, s3:// output, a fresh s3fs, that output's lock key) on the loopback moto server."""
    import s3fs

    endpoint, bucket = s3_bucket
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    return S3Config(endpoint_url=endpoint), f"s3://{bucket}/{name}", fs, f"{bucket}/{name}/{locks.LOCK_NAME}"


def test_the_lock_is_re_entrant_for_its_thread_only(tmp_path):
    """Two threads of one process (a notebook's, an app server's) had both passed the lock, and each
    ETL removed the other's shards as a killed run's: a published dataset with 9 shards missing."""
    import threading

    out, held, done, seen = str(tmp_path / "ds"), threading.Event(), threading.Event(), []

    def holder():
        with locks.output_lock(out, "etl"), locks.output_lock(out, "etl"):  # the CLI's, then the stage's
            held.set()
            done.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(30)
        with pytest.raises(locks.OutputLockedError, match="another thread of this process"):
            with locks.output_lock(out, "etl"):
                seen.append("passed")
    finally:
        done.set()
        thread.join()
    assert not seen
    with locks.output_lock(out, "etl"):  # free again once the holding thread let go
        pass


def test_s3_lock_is_a_conditional_put_with_stale_takeover(s3_bucket):
    s3, out, fs, key = _s3_output(s3_bucket, "ds")
    with locks.output_lock(out, "etl", s3):
        held = json.loads(fs.cat_file(key))
        assert held["pid"] == os.getpid() and held["kind"] == "etl"
        with pytest.raises(FileExistsError):  # what a second run's create gets: If-None-Match holds
            fs.pipe_file(key, b"{}", mode="create")
    assert not fs.exists(key)
    other = {"owner": "ann", "host": "node-7", "pid": 4242, "kind": "train", "since": "earlier",
             "heartbeat_unix": time.time()}
    fs.pipe_file(key, json.dumps(other).encode())
    with pytest.raises(locks.OutputLockedError, match="ann on host node-7, pid 4242"):
        with locks.output_lock(out, "etl", s3):
            pass
    fs.pipe_file(key, json.dumps({**other, "heartbeat_unix": time.time() - locks.STALE_AFTER_S - 1}).encode())
    with locks.output_lock(out, "etl", s3):  # the holder stopped refreshing: taken over
        assert json.loads(fs.cat_file(key))["pid"] == os.getpid()


def test_a_run_that_lost_its_s3_lock_publishes_nothing(s3_bucket):
    from stages.common.artifacts import write_manifest

    s3, out, fs, key = _s3_output(s3_bucket, "lost")
    with locks.output_lock(out, "etl", s3):
        write_manifest(out, {"stage": "etl", "run": 1}, s3)  # still ours: published
        # Our heartbeats failed long enough that another run took the lock over (what _S3Lock.acquire
        # does to a stale lock); we are still running and about to publish.
        other = {"owner": "bob", "host": "node-9", "pid": 99, "kind": "etl", "since": "now",
                 "heartbeat_unix": time.time()}
        fs.pipe_file(key, json.dumps(other).encode(), IfMatch=fs.info(key)["ETag"])
        with pytest.raises(locks.OutputLockedError, match="taken over by a raymill etl run of bob on host node-9"):
            write_manifest(out, {"stage": "etl", "run": 2}, s3)
    assert json.loads(fs.cat_file(key.replace(locks.LOCK_NAME, "manifest.json")))["run"] == 1
    assert json.loads(fs.cat_file(key))["owner"] == "bob", "the new holder's lock must stay"


def test_a_run_that_fails_as_its_s3_endpoint_dies_reports_its_own_error(caplog):
    """The endpoint gone mid-run: releasing the lock fails too, and that error once replaced the
    run's own (the user read about '.raymill.lock', not about the write that failed)."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="gone")
    with pytest.raises(OSError, match="the shard write failed"):
        with locks.output_lock("s3://gone/ds", "etl", S3Config(endpoint_url=endpoint)):
            server.stop()
            raise OSError("the shard write failed")
    assert "could not release the lock on 's3://gone/ds'" in caplog.text


def test_manifest_committed_despite_an_error_keeps_its_shards_and_others_files(tmp_path, ray_session,
                                                                            monkeypatch):
    src, out = tmp_path / "src", tmp_path / "ds"
    make_tree(src, per_class=3, bad=False)
    etl.run(CFG, str(src), str(out))
    killed = out / "shards" / "train-00000-00-20990101T000000-abcdef.parquet"
    killed.write_bytes(b"a killed run's shard")
    foreign = out / "shards" / "notes.txt"
    foreign.write_bytes(b"a user's file")
    from stages.etl import publish

    real = publish.write_manifest

    def committed_then_timed_out(*args, **kwargs):
        real(*args, **kwargs)
        raise TimeoutError("read timeout on the PUT response")

    monkeypatch.setattr(publish, "write_manifest", committed_then_timed_out)
    second = etl.run(CFG.model_copy(update={"image_size": 16}), str(src), str(out), overwrite=True)
    assert verify(str(out)) == []  # the published manifest's shards are all there
    assert json.loads((out / "manifest.json").read_text())["run_id"] == second.manifest["run_id"]
    named = {s["path"] for s in second.manifest["shards"]} | {second.manifest["quarantine"]["path"]}
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    # The replaced run's files are gone, and a killed run's shard (raymill's name, no manifest names it:
    # a folder read would count its rows); a file of another name is not ours to delete.
    assert on_disk == named | {"manifest.json", str(foreign.relative_to(out))}


def test_a_link_to_a_class_folder_is_the_alias_whatever_the_listing_order(tmp_path):
    # "a_alias" sorts (and may be listed) before the real "zz_real": the real folder keeps its class
    make_tree(tmp_path / "src", per_class=2, bad=False, classes=("zz_real", "other"))
    (tmp_path / "src" / "a_alias").symlink_to("zz_real")
    listing = etl.discover(str(tmp_path / "src"))
    assert listing.classes == ["other", "zz_real"]
    assert [(r["path"], r["reason"]) for r in listing.rejected] == [("a_alias", "symlink_loop")]


def test_a_folder_that_cannot_be_listed_is_quarantined_not_fatal(tmp_path):
    # A path past PATH_MAX fails to list for root too (a chmod-000 folder does only for other users)
    make_tree(tmp_path / "src", per_class=2, bad=False, classes=("a", "b"))
    fd = os.open(tmp_path / "src" / "a", os.O_RDONLY)
    for _ in range(20):  # 20 names of 250 bytes: past 4,096 bytes of path
        os.mkdir("d" * 250, dir_fd=fd)
        deeper = os.open("d" * 250, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(fd)
    listing = etl.discover(str(tmp_path / "src"))
    assert len(listing.files) == 4 and listing.classes == ["a", "b"]
    [row] = listing.rejected
    assert row["reason"] == "read_error" and row["path"].startswith("a/ddd") and "not listed" in row["detail"]


def test_paths_etl_cannot_use_exit_2_before_anything_is_written(tmp_path, ray_session):
    src = tmp_path / "src"
    make_tree(src, per_class=2, bad=False)
    cases = {str(src / "etl-out"): "is inside the input", str(src): "is inside the input"}
    for out, words in cases.items():
        with pytest.raises(etl.ConfigError, match=words):
            etl.run(EtlConfig(image_size=16), str(src), out)
    with pytest.raises(etl.InputNotFoundError, match="is a file, not a folder"):
        etl.run(EtlConfig(image_size=16), str(src / "bird" / "bird_000.jpg"), str(tmp_path / "o1"))
    (tmp_path / "o0").mkdir()  # an ETL output given as the input: once "100% bad files", exit 1
    (tmp_path / "o0" / "manifest.json").write_text('{"kind": "raymill.etl"}')
    with pytest.raises(etl.ConfigError, match="is a raymill.etl output, not an image folder"):
        etl.run(EtlConfig(image_size=16), str(tmp_path / "o0"), str(tmp_path / "o1"))
    with pytest.raises(etl.ConfigError, match="etl.cpus_per_task=64 exceeds the CPUs of every node"):
        etl.run(EtlConfig(image_size=16, cpus_per_task=64), str(src), str(tmp_path / "o2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o0", "src"]
    assert not (src / "etl-out").exists()


def test_two_folders_that_print_alike_are_refused_not_merged(tmp_path):
    # b'caf\xe9' (Latin-1, not UTF-8) prints as 'caf\\xe9', which a folder may also be named
    for name in (b"caf\xe9", b"caf\\xe9"):
        folder = os.path.join(os.fsencode(tmp_path / "src"), name)
        os.makedirs(folder)
        Path(os.fsdecode(os.path.join(folder, b"a.jpg"))).write_bytes(image_bytes(1))
    with pytest.raises(etl.ConfigError, match="both show as class"):
        etl.discover(str(tmp_path / "src"))


def test_an_output_that_is_a_file_or_holds_another_tools_manifest_is_a_config_error(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(locks.OutputKindError, match="is a file; --output names a folder"):
        locks.check_output_kind(str(tmp_path / "a-file"), "etl")
    for i, text in enumerate(("[1, 2]", "{not json")):  # once AttributeError and JSONDecodeError: exit 1
        (tmp_path / f"o{i}").mkdir()
        (tmp_path / f"o{i}" / "manifest.json").write_text(text)
        with pytest.raises(locks.OutputKindError, match="non-raymill output"):
            locks.check_output_kind(str(tmp_path / f"o{i}"), "etl")
    # inside a published output (train and infer had written among an ETL output's shards)
    (tmp_path / "ds" / "shards").mkdir(parents=True)
    (tmp_path / "ds" / "manifest.json").write_text('{"kind": "raymill.etl"}')
    for kind in ("train", "infer", "export", "etl"):
        with pytest.raises(locks.OutputKindError, match=f"is inside the raymill.etl output '{tmp_path / 'ds'}'"):
            with locks.output_lock(str(tmp_path / "ds" / "shards" / "out"), kind):
                pass
    # one that cannot be made (a name too long, a level or 17 of them): exit 2, no folder left
    for out in (tmp_path / "new" / ("x" * 300), tmp_path / "deep" / "/".join(["y" * 240] * 17)):
        with pytest.raises(locks.OutputKindError, match=r"cannot be created or written \(File name too long\)"):
            with locks.output_lock(str(out), "etl"):
                pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "ds", "o0", "o1"]
    assert [p.name for p in (tmp_path / "ds" / "shards").iterdir()] == []


def test_a_class_with_no_usable_image_is_named_in_a_warning(tmp_path, ray_session, caplog):
    make_tree(tmp_path / "src", per_class=3, bad=False, classes=("bird", "cat"))
    (tmp_path / "src" / "broken").mkdir()
    (tmp_path / "src" / "broken" / "x.jpg").write_bytes(b"not an image")
    (tmp_path / "src" / "empty").mkdir()  # as torchvision's ImageFolder counts it: a class
    (tmp_path / "src" / ".hidden").mkdir()  # hidden: not a class
    with caplog.at_level("WARNING", logger="stages.etl.stage"):
        art = etl.run(EtlConfig(image_size=16, max_bad_fraction=0.5), str(tmp_path / "src"), str(tmp_path / "out"))
    assert art.manifest["classes"] == ["bird", "broken", "cat", "empty"]  # the label space is the folders
    assert "2 class(es) have no usable image (broken, empty;" in caplog.text
    before = etl.discover(str(tmp_path / "src"), None, "inside_source").fingerprint
    (tmp_path / "src" / "empty2").mkdir()  # another class: the source changed, no cached answer holds
    assert etl.discover(str(tmp_path / "src"), None, "inside_source").fingerprint != before


def test_one_class_name_in_two_unicode_forms_is_one_class(tmp_path, ray_session, caplog):
    """A folder copied from macOS is named in NFD ('e' + a combining accent), one made elsewhere in
    NFC: the same name to a person, so one class, and infer's true class matches either spelling."""
    from stages.infer.decode import Reader

    nfc, nfd = "caf\u00e9", "cafe\u0301"
    make_tree(tmp_path / "src", per_class=4, bad=False, classes=("bird", nfc))
    (tmp_path / "src" / nfd).mkdir()
    for f in sorted((tmp_path / "src" / nfc).iterdir())[:2]:
        (tmp_path / "src" / nfd / f"mac-{f.name}").write_bytes(f.read_bytes())
    with caplog.at_level("WARNING", logger="stages.etl.stage"):
        art = etl.run(EtlConfig(image_size=16), str(tmp_path / "src"), str(tmp_path / "out"))
    assert art.manifest["classes"] == ["bird", nfc]
    assert sum(c.get(nfc, 0) for c in art.manifest["counts"].values()) == 6
    assert "two Unicode forms" in caplog.text and ascii(nfd) in caplog.text
    reader = Reader({"classes": ["bird", nfd]}, {}, mode="images", raw=True)  # a model named in NFD
    for folder in (nfc, nfd):
        item = {"path": f"{folder}/x.jpg", "name_hex": "", "size": 1, "reason": None, "detail": None}
        assert reader.samples(item)[0]["true_class"] == nfd  # the model's own spelling


def test_a_folder_named_manifest_json_is_not_an_output(tmp_path):
    """Above the input or as a class folder: it had failed ETL's preflight with IsADirectoryError, exit 1."""
    from stages.etl import checks

    (tmp_path / "manifest.json").mkdir()
    make_tree(tmp_path / "data", per_class=2, bad=False)
    (tmp_path / "data" / "manifest.json").mkdir()
    checks.image_input(str(tmp_path / "data"))
