"""Built-in demo dataset: deterministic, learnable synthetic images in ImageFolder layout.

``generate(out)`` writes ``out/<class_name>/<class_name>_<index:05d>.jpg|.png`` where the
class is the *shape* drawn in the image (circle, square, triangle, ...). Everything else --
image size, background (solid / gradient / low-frequency noise), hues, contrast polarity,
position, scale, aspect, rotation, pixel noise, file format and PNG mode (RGB / RGBA / palette)
-- is random, so the folder looks like a small, messy real-world one.

Learnable by design: shapes span 55-85% of the short side and sit inside the centred square
(a centre-crop loader never cuts them), and shape vs background always differ by >= 85 luma
(dark-on-light or light-on-dark, any hues). With the project's SmallCNN (width 32) at 64x64,
SGD lr 0.05, 8 epochs on 1,200 of the default 1,500 images, held-out accuracy is ~0.96-0.99.

Determinism: image ``i`` depends only on ``(seed, i, classes, size, png_fraction)`` through
``numpy.random.default_rng([seed, i])``; masks use only IEEE-exact arithmetic, encoders run
with fixed settings and write no metadata, so the same arguments give byte-identical files
(for a given Pillow / libjpeg / zlib build).

Only numpy and Pillow are imported here (no torch / ray) so the CLI command that calls this
starts fast.
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageFilter

log = logging.getLogger(__name__)

__all__ = ["CLASS_NAMES", "generate"]

CLASS_NAMES: tuple[str, ...] = (
    "circle",
    "square",
    "triangle",
    "cross",
    "ring",
    "star",
    "diamond",
    "hstripes",
    "vstripes",
    "checker",
)

MIN_SIDE, MAX_SIDE = 48, 160  # random image side range (inclusive) when size is None
JPEG_QUALITY = 90
PNG_COMPRESS_LEVEL = 6
MAX_ROTATION_DEG = 10.0  # small, so square/diamond and hstripes/vstripes stay distinct

_FILE_RE = re.compile(r"^(?P<cls>[a-z]+)_(?P<idx>\d{5,})\.(?:jpg|png)$")


# --------------------------------------------------------------------------------------------
# shapes: each maps normalised, rotated coordinates (u, v) -- the shape's radius is 1 -- to a
# boolean mask. v points down (image convention).
# --------------------------------------------------------------------------------------------


def _circle(u, v, rng):
    return u * u + v * v <= 1.0


def _ring(u, v, rng):
    rr = u * u + v * v
    inner = rng.uniform(0.45, 0.6)
    return (rr <= 1.0) & (rr >= inner * inner)


def _square(u, v, rng):
    return np.maximum(np.abs(u), np.abs(v)) <= 0.8


def _diamond(u, v, rng):
    return np.abs(u) + np.abs(v) <= 1.0


def _triangle(u, v, rng):
    # equilateral, apex up, inscribed in the unit circle: inside iff p . (-vertex_k) <= 1/2
    m = v <= 0.5  # vertex (0, -1)
    s3 = math.sqrt(3.0) / 2.0
    m &= (-s3 * u - 0.5 * v) <= 0.5  # vertex (s3, 0.5)
    m &= (s3 * u - 0.5 * v) <= 0.5  # vertex (-s3, 0.5)
    return m


def _cross(u, v, rng):
    w = rng.uniform(0.25, 0.35)
    au, av = np.abs(u), np.abs(v)
    return ((au <= w) & (av <= 1.0)) | ((av <= w) & (au <= 1.0))


def _in_polygon(u, v, verts):
    """Even-odd point-in-polygon test, vectorised; only + - * / and compares (bit-reproducible)."""
    inside = np.zeros(np.broadcast_shapes(u.shape, v.shape), dtype=bool)
    for (xi, yi), (xj, yj) in zip(verts, verts[1:] + verts[:1]):
        if yi == yj:
            continue
        crosses = (yi > v) != (yj > v)
        inside ^= crosses & (u < (xj - xi) * (v - yi) / (yj - yi) + xi)
    return inside


# five-pointed star, point up, outer radius 1, inner radius 0.45 (a bit fatter than regular)
_STAR = [
    ((1.0 if k % 2 == 0 else 0.45) * math.cos(-math.pi / 2 + k * math.pi / 5),
     (1.0 if k % 2 == 0 else 0.45) * math.sin(-math.pi / 2 + k * math.pi / 5))
    for k in range(10)
]


def _star(u, v, rng):
    return _in_polygon(u, v, _STAR)


def _bands(t, n):
    # t in [-1, 1] -> band index 0..n-1; even bands are foreground
    b = np.floor((t + 1.0) * (n / 2.0)).astype(np.int32)
    return (b % 2) == 0


def _hstripes(u, v, rng):
    n = int(rng.choice((5, 7)))
    return (np.maximum(np.abs(u), np.abs(v)) <= 0.9) & _bands(v / 0.9, n)


def _vstripes(u, v, rng):
    n = int(rng.choice((5, 7)))
    return (np.maximum(np.abs(u), np.abs(v)) <= 0.9) & _bands(u / 0.9, n)


def _checker(u, v, rng):
    n = int(rng.choice((4, 5)))
    bu = np.floor((u / 0.9 + 1.0) * (n / 2.0)).astype(np.int32)
    bv = np.floor((v / 0.9 + 1.0) * (n / 2.0)).astype(np.int32)
    return (np.maximum(np.abs(u), np.abs(v)) <= 0.9) & (((bu + bv) % 2) == 0)


_SHAPES = {
    "circle": _circle,
    "square": _square,
    "triangle": _triangle,
    "cross": _cross,
    "ring": _ring,
    "star": _star,
    "diamond": _diamond,
    "hstripes": _hstripes,
    "vstripes": _vstripes,
    "checker": _checker,
}
assert tuple(_SHAPES) == CLASS_NAMES


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


_LUMA = np.array([0.299, 0.587, 0.114])


def _tone(rng: np.random.Generator, light: bool) -> np.ndarray:
    """Random colour of any hue and saturation with a dark (luma 10-85) or light (170-245) tone.

    Dark and light tones are >= 85 luma apart, which keeps every shape clearly visible
    whatever the hues; both polarities occur, so the class is the shape, not the brightness.
    """
    c = rng.uniform(0, 255, size=3)
    c *= 255.0 / max(c.max(), 1.0)  # full-brightness version of a random hue/saturation
    luma = float(_LUMA @ c)
    target = rng.uniform(170, 245) if light else rng.uniform(10, 85)
    if luma >= target:
        return c * (target / luma)  # darken
    return 255.0 - (255.0 - c) * ((255.0 - target) / (255.0 - luma))  # lighten towards white


def _background(rng: np.random.Generator, w: int, h: int, light: bool) -> Image.Image:
    """Random dark or light RGB background: solid, gradient or low-frequency noise."""
    kind = rng.integers(3)  # 0 solid, 1 gradient, 2 low-frequency noise
    base = _tone(rng, light)
    if kind == 0:
        grid = base.reshape(1, 1, 3)
    elif kind == 1:
        # a linear ramp between two colours; bilinear upscaling of the 2x2 corner grid is exact
        other = _tone(rng, light)
        ang = rng.uniform(0, 2 * math.pi)
        t = np.array([[0.0, math.cos(ang)], [math.sin(ang), math.cos(ang) + math.sin(ang)]])
        t = (t - t.min()) / (t.max() - t.min())
        grid = base + t[..., None] * (other - base)
    else:
        cells = int(rng.integers(3, 9))
        grid = np.clip(base + rng.uniform(15, 35) * rng.uniform(-1, 1, size=(cells, cells, 3)), 0, 255)
    grid8 = np.ascontiguousarray(np.rint(grid), dtype=np.uint8)
    if grid8.shape[:2] == (1, 1):
        return Image.new("RGB", (w, h), tuple(int(c) for c in grid8[0, 0]))
    return Image.fromarray(grid8, "RGB").resize((w, h), Image.BILINEAR)


def _render(rng: np.random.Generator, cls: str, w: int, h: int) -> Image.Image:
    """RGB image of a ``cls`` shape on a random background (heavy lifting in Pillow's C code)."""
    # strong luminance contrast, either polarity, any hues
    light_bg = bool(rng.random() < 0.5)
    img = _background(rng, w, h, light_bg)
    fg = tuple(int(round(c)) for c in _tone(rng, not light_bg))

    short = min(w, h)
    r = 0.5 * short * rng.uniform(0.55, 0.85)  # shape diameter 55-85% of the short side
    # keep the shape inside the centred short-side square, so a centre-crop loader
    # (stages.etl.images.decode_rgb's default) never cuts it off
    cx = rng.uniform((w - short) / 2 + r, (w + short) / 2 - r)
    cy = rng.uniform((h - short) / 2 + r, (h + short) / 2 - r)
    theta = math.radians(rng.uniform(-MAX_ROTATION_DEG, MAX_ROTATION_DEG))
    sx, sy = rng.uniform(0.9, 1.1, size=2)

    # evaluate the mask only on the shape's bounding box (plus a margin for the edge blur)
    blur = max(0.5, short / 300.0)
    ext = r * 1.2 + blur + 2
    x0, x1 = max(0, int(cx - ext)), min(w, int(math.ceil(cx + ext)) + 1)
    y0, y1 = max(0, int(cy - ext)), min(h, int(math.ceil(cy + ext)) + 1)
    dx = (np.arange(x0, x1, dtype=np.float32) + 0.5 - cx)[None, :]
    dy = (np.arange(y0, y1, dtype=np.float32) + 0.5 - cy)[:, None]
    c, s = math.cos(theta), math.sin(theta)
    u = (dx * c + dy * s) / (r * sx)
    v = (dy * c - dx * s) / (r * sy)
    box = _SHAPES[cls](u, v, rng).astype(np.uint8) * np.uint8(255)
    # cheap anti-aliasing: soften the hard edge a little, then paste the colour through it
    mask = Image.fromarray(box, "L").filter(ImageFilter.BoxBlur(blur))
    img.paste(fg, (x0, y0, x1, y1), mask)

    # additive pixel noise, uniform in [-amp, amp], the same on all channels
    amp = int(rng.integers(0, 13))
    if amp > 0:
        noise = Image.frombytes("L", (w, h), rng.bytes(w * h))
        noise = noise.point([(i * (2 * amp + 1)) >> 8 for i in range(256)]).convert("RGB")
        img = ImageChops.add(img, noise, 1.0, -amp)
    return img


def _encode(rng: np.random.Generator, im: Image.Image, png: bool) -> bytes:
    buf = io.BytesIO()
    if not png:
        im.save(buf, format="JPEG", quality=JPEG_QUALITY, optimize=False, progressive=False)
        return buf.getvalue()
    mode = rng.choice(3, p=(0.6, 0.2, 0.2))  # RGB, RGBA, palette
    if mode == 1:
        # opaque alpha (like most RGBA photos/screenshots): any RGBA->RGB conversion, whether it
        # drops alpha or composites onto white, yields the same picture and keeps the contrast
        im = im.convert("RGBA")
    elif mode == 2:
        ncol = int(rng.choice((64, 128, 256)))
        im = im.quantize(colors=ncol, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    im.save(buf, format="PNG", optimize=False, compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def _check_args(images, seed, size, png_fraction, classes) -> tuple[int, int] | None:
    if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)):
        raise ValueError(f"classes must be an integer, got {classes!r}")
    if not 1 <= classes <= len(CLASS_NAMES):
        raise ValueError(
            f"classes={classes} is out of range: the demo dataset has {len(CLASS_NAMES)} shapes "
            f"({', '.join(CLASS_NAMES)}); pass classes between 1 and {len(CLASS_NAMES)}"
        )
    if isinstance(images, bool) or not isinstance(images, (int, np.integer)):
        raise ValueError(f"images must be an integer, got {images!r}")
    if images < classes:
        raise ValueError(
            f"images={images} is fewer than classes={classes}: every class needs at least one "
            f"image; pass images >= {classes} or lower classes"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    try:
        f = float(png_fraction)
    except (TypeError, ValueError):
        raise ValueError(f"png_fraction must be a number in [0, 1], got {png_fraction!r}") from None
    if not 0.0 <= f <= 1.0:  # also rejects NaN
        raise ValueError(
            f"png_fraction={png_fraction!r} is outside [0, 1]: pass e.g. 0.3 for 30% PNG files, "
            "0.0 for all JPEG, 1.0 for all PNG"
        )
    if size is None:
        return None
    try:
        w, h = size
    except (TypeError, ValueError):
        raise ValueError(f"size must be a (width, height) pair or None, got {size!r}") from None
    for side in (w, h):
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)) or not 16 <= side <= 8192:
            raise ValueError(
                f"size={size!r} is invalid: pass (width, height) with integer sides in [16, 8192], "
                "e.g. size=(500, 375), or size=None for random sizes"
            )
    return int(w), int(h)


def generate(
    out: str | os.PathLike,
    images: int = 1500,
    seed: int = 0,
    *,
    size: tuple[int, int] | None = None,
    png_fraction: float = 0.3,
    classes: int = 10,
) -> dict:
    """Write `images` images spread evenly over `classes` classes; return {"images": n, "classes":
    [...], "bytes": total, "out": str(out), "written": the files written (the rest were there already)}.

    Image ``i`` (0-based) belongs to class ``CLASS_NAMES[i % classes]`` and is written to
    ``out/<class>/<class>_<i:05d>.jpg`` (or ``.png``, with probability ``png_fraction``).
    ``size=(w, h)`` fixes every image's size; by default each side is random in [48, 160].

    ``out`` is created if needed. Files of a previous call in ``out`` are rewritten where their bytes
    differ (identical ones are left, mtime and all: `raymill run` reuses its ETL then); leftover
    files that *this module's naming scheme* produced (``<class>/<class>_NNNNN.jpg|png`` inside a
    shape-named folder) but that this call does not write are removed, so re-generating with
    other arguments never mixes two datasets. Nothing else in ``out`` is touched.
    """
    fixed = _check_args(images, seed, size, png_fraction, classes)
    images, seed, classes = int(images), int(seed), int(classes)
    png_fraction = float(png_fraction)
    names = list(CLASS_NAMES[:classes])

    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (out_path / name).mkdir(exist_ok=True)

    written: set[Path] = set()
    total = changed = 0
    for i in range(images):
        rng = np.random.default_rng([seed, i])
        is_png = bool(rng.random() < png_fraction)
        rw, rh = (int(x) for x in rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2))
        w, h = fixed if fixed is not None else (rw, rh)
        cls = names[i % classes]
        data = _encode(rng, _render(rng, cls, w, h), is_png)
        path = out_path / cls / f"{cls}_{i:05d}.{'png' if is_png else 'jpg'}"
        if not (path.is_file() and path.read_bytes() == data):  # the same bytes keep their mtime: a
            path.write_bytes(data)  # second `make run` had re-run ETL (the listing's mtimes had changed)
            changed += 1
        written.add(path)
        total += len(data)

    _remove_stale(out_path, written)
    if others := sorted(p.name for p in out_path.iterdir() if p.is_dir() and p.name not in CLASS_NAMES):
        log.warning("demo-data: '%s' also holds folders that are not demo classes (%s): ETL would read them "
                    "as classes beside the demo's; generate into an empty or new folder", out, ", ".join(others[:3]))
    return {"images": images, "classes": names, "bytes": total, "out": str(out), "written": changed}


def _remove_stale(out_path: Path, written: set[Path]) -> None:
    for name in CLASS_NAMES:
        d = out_path / name
        if not d.is_dir():
            continue
        for p in d.iterdir():
            m = _FILE_RE.match(p.name)
            if m and m["cls"] == name and p.is_file() and p not in written:
                p.unlink()
        if not any(d.iterdir()):
            d.rmdir()
