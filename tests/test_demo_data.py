"""Tests for workflow.demo_data: the built-in synthetic ImageFolder dataset."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from workflow import demo_data
from workflow.demo_data import CLASS_NAMES, generate

N = 120  # small but enough for both formats in every run; keeps the module well under 15 s


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo") / "data"
    return out, generate(out, N, seed=0)


def test_class_names():
    assert len(CLASS_NAMES) == 10
    assert len(set(CLASS_NAMES)) == 10
    assert all(n.isidentifier() and n == n.lower() for n in CLASS_NAMES)


def test_same_seed_same_bytes_different_seed_differs(dataset, tmp_path):
    out, _ = dataset
    again = generate(tmp_path / "again", N, seed=0)
    a, b = _digests(out), _digests(tmp_path / "again")
    assert a == b and len(a) == N
    assert again["bytes"] == sum(p.stat().st_size for p in out.rglob("*") if p.is_file())

    generate(tmp_path / "other", N, seed=1)
    c = _digests(tmp_path / "other")
    assert len(c) == N
    assert set(a.values()).isdisjoint(c.values())


def test_rewrite_in_place_is_identical(tmp_path):
    out = tmp_path / "d"
    generate(out, 20, seed=3, classes=4)
    first = _digests(out)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.*")}
    generate(out, 20, seed=3, classes=4)
    assert _digests(out) == first
    # identical bytes are not rewritten: a second `make run` re-ran ETL (its listing's mtimes changed)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.*")} == stamps
    # other args: no stale files from the first call are left behind, foreign files are kept
    (out / "README.txt").write_text("mine")
    generate(out, 10, seed=3, classes=2, png_fraction=1.0)
    files = _digests(out)
    assert set(files) == {"README.txt"} | {
        f"{c}/{c}_{i:05d}.png" for i, c in ((i, CLASS_NAMES[i % 2]) for i in range(10))
    }
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(CLASS_NAMES[:2])


def test_layout_counts_formats(dataset):
    out, info = dataset
    assert info["images"] == N
    assert info["classes"] == list(CLASS_NAMES)
    assert info["out"] == str(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(CLASS_NAMES)

    counts = Counter()
    exts = Counter()
    sizes = set()
    modes = set()
    total = 0
    for d in out.iterdir():
        files = sorted(d.iterdir())
        assert files == sorted(files, key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        for p in files:
            assert p.name.startswith(d.name + "_")
            assert p.suffix in (".jpg", ".png")
            counts[d.name] += 1
            exts[p.suffix] += 1
            total += p.stat().st_size
            with Image.open(p) as im:
                assert im.format == ("JPEG" if p.suffix == ".jpg" else "PNG")
                im.load()  # fully decodable, not just a valid header
                sizes.add(im.size)
                modes.add(im.mode)
                assert all(48 <= s <= 160 for s in im.size)
                assert not im.info.get("exif")
    assert set(counts.values()) == {N // 10}
    assert exts[".jpg"] > 0 and exts[".png"] > 0
    assert 0.1 < exts[".png"] / N < 0.5  # about png_fraction=0.3
    assert "RGB" in modes
    assert len(sizes) > N // 2  # sizes vary, independently per side
    assert len({w for w, _ in sizes}) > 10 and len({h for _, h in sizes}) > 10
    assert info["bytes"] == total


def test_uneven_split_and_fewer_classes(tmp_path):
    info = generate(tmp_path / "d", 13, classes=3, png_fraction=0.0)
    assert info["classes"] == list(CLASS_NAMES[:3])
    counts = {c: len(list((tmp_path / "d" / c).iterdir())) for c in info["classes"]}
    assert counts == {CLASS_NAMES[0]: 5, CLASS_NAMES[1]: 4, CLASS_NAMES[2]: 4}
    assert all(p.suffix == ".jpg" for p in (tmp_path / "d").rglob("*.*"))


def test_fixed_size_all_jpeg(tmp_path):
    info = generate(tmp_path / "d", 10, seed=5, size=(500, 375), png_fraction=0.0)
    files = sorted((tmp_path / "d").rglob("*.*"))
    assert len(files) == 10 and info["images"] == 10
    for p in files:
        assert p.suffix == ".jpg"
        with Image.open(p) as im:
            assert im.format == "JPEG" and im.size == (500, 375) and im.mode == "RGB"


def test_all_png(tmp_path):
    generate(tmp_path / "d", 30, seed=2, png_fraction=1.0)
    files = list((tmp_path / "d").rglob("*.*"))
    assert len(files) == 30 and all(p.suffix == ".png" for p in files)
    modes = set()
    for p in files:
        with Image.open(p) as im:
            assert im.format == "PNG"
            modes.add(im.mode)
    assert modes <= {"RGB", "RGBA", "P"} and len(modes) > 1


def test_shape_contrasts_with_background(tmp_path):
    # the class signal is strong: somewhere in a circle image (the shape) the colour is far from
    # the corner colour (always background: the shape is kept >= its radius from every edge)
    import numpy as np

    generate(tmp_path / "d", 60, seed=7, size=(128, 96), png_fraction=0.0, classes=1)
    for p in (tmp_path / "d" / "circle").iterdir():
        with Image.open(p) as im:
            a = np.asarray(im.convert("RGB").resize((32, 24), Image.BOX), dtype=np.float32)
        corner = a[0, 0]
        far = np.linalg.norm(a - corner, axis=-1)
        assert far.max() > 100, p.name
        assert (far > 60).mean() > 0.08, p.name  # shape covers a good part of the image


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(images=5, classes=10), "images"),
        (dict(images=0), "images"),
        (dict(classes=11), "classes"),
        (dict(classes=0), "classes"),
        (dict(png_fraction=-0.1), "png_fraction"),
        (dict(png_fraction=1.5), "png_fraction"),
        (dict(png_fraction=float("nan")), "png_fraction"),
        (dict(seed=-1), "seed"),
        (dict(size=(0, 10)), "size"),
        (dict(size=(500,)), "size"),
        (dict(images=2.5), "images"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    out = tmp_path / "d"
    with pytest.raises(ValueError, match=match):
        generate(out, **kwargs)
    assert not out.exists()  # validated before touching the disk


def test_no_heavy_imports():
    code = "import sys, workflow.demo_data; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(demo_data.__file__).parents[1])
