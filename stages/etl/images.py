"""Decoding untrusted image bytes, shared by ETL, training, batch inference and serving.

One function decides what a "bad image" is, so the ETL quarantine and the HTTP 4xx codes agree.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from stages.etl import pixels

__all__ = ["BadImage", "open_image", "decode_rgb", "encode", "REASONS", "MAX_JPEG_SCANS"]

# Pillow's own guard raises only above 2x MAX_IMAGE_PIXELS; we check our limit ourselves
# before decoding, so lift Pillow's and silence its warning.
Image.MAX_IMAGE_PIXELS = None
warnings.simplefilter("ignore", Image.DecompressionBombWarning)
# A damaged EXIF block (Pillow's TiffImagePlugin: "Corrupt EXIF data.", "Possibly corrupt EXIF ...")
# loses only the orientation tag; the pixels decode. Printed by every ETL task and replica, it read
# as an error in a clean run.
warnings.filterwarnings("ignore", message="(possibly )?corrupt exif", category=UserWarning)

REASONS = ("empty_file", "too_large", "not_an_image", "unsupported_format", "truncated",
           "decompression_bomb", "corrupt", "read_error", "outside_class_folder", "decode_error",
           "not_a_regular_file", "symlink_outside_source", "symlink_not_followed", "symlink_loop",
           "symlink_broken")


# Scans a JPEG may hold. Decode time grows with scans x pixels, not with file size: a 435 KB
# 36 MP progressive JPEG that repeats its last scan 2,000 times took 24 s in libjpeg, holding a
# serve replica's decode thread past any request timeout. An ordinary progressive JPEG has about
# 10 scans (libjpeg's default script), a baseline one 1 to 3; libjpeg-turbo's `djpeg -maxscans`
# exists for the same reason. The bytes FF DA begin a scan and appear nowhere else: the entropy-
# coded data stuffs every FF with 00, so counting them counts scans (an EXIF thumbnail's included).
MAX_JPEG_SCANS = 100


# Leading bytes that only these formats write. Pillow says "cannot identify" both for bytes that are
# no image and for an image whose header is damaged; the signature tells the two apart.
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
               (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))


def _signature(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((fmt for magic, fmt in _SIGNATURES if data.startswith(magic)), None)


class BadImage(ValueError):
    """Bytes that are not a usable image; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def open_image(data: bytes, allowed_formats: tuple[str, ...], max_pixels: int) -> Image.Image:
    """Parse the header only: format and size are checked before any pixel is decoded."""
    if not data:
        raise BadImage("empty_file", "0 bytes")
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        if (fmt := _signature(data)) is not None:  # e.g. a PNG whose IHDR fails its CRC: damaged, not foreign
            raise BadImage("corrupt", f"a {fmt} signature, but its header does not parse") from None
        raise BadImage("not_an_image", "no known image signature") from None
    except Exception as e:  # Pillow raises many types on malformed headers
        raise BadImage("corrupt", f"{type(e).__name__}: {e}") from None
    # A JPEG with an MPF segment (phones, some cameras) opens as MPO; its first frame is the JPEG.
    fmt = "JPEG" if img.format == "MPO" else img.format
    if fmt not in allowed_formats:
        raise BadImage("unsupported_format", f"{img.format}; allowed: {', '.join(allowed_formats)}")
    width, height = img.size
    if width * height > max_pixels:
        raise BadImage("decompression_bomb", f"{width}x{height} px exceeds {max_pixels} px")
    if fmt == "JPEG" and (scans := data.count(b"\xff\xda")) > MAX_JPEG_SCANS:
        raise BadImage("decompression_bomb", f"a JPEG of {scans} scans (at most {MAX_JPEG_SCANS}): its decode "
                                             f"time grows with every scan; re-encode it")
    return img


def decode_rgb(data: bytes, size: int, *, resize: str = "crop",
               allowed_formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "BMP"),
               max_pixels: int = 89_478_485) -> np.ndarray:
    """Decode to an RGB uint8 array of shape (size, size, 3): the checks of `open_image`, then
    stages.etl.pixels (the rules an exported model's clients get as preprocess.py).

    crop: scale the shorter side to `size` and take the centre square; stretch: ignore aspect.
    """
    img = open_image(data, allowed_formats, max_pixels)
    try:
        pixels.load(img, size)
    except Exception as e:
        reason = "truncated" if "truncated" in str(e).lower() or isinstance(e, EOFError) else "corrupt"
        raise BadImage(reason, f"{type(e).__name__}: {e}") from None
    try:
        return pixels.square(img, size, resize)
    except Exception as e:  # any other decoder failure is this file's problem, never the job's
        raise BadImage("decode_error", f"{type(e).__name__}: {e}") from None


def encode(array: np.ndarray, codec: str, jpeg_quality: int = 90) -> bytes:
    """Encode an RGB uint8 array as JPEG or PNG (deterministic bytes for the same input)."""
    buf = io.BytesIO()
    img = Image.fromarray(array, "RGB")
    if codec == "jpeg":
        img.save(buf, format="JPEG", quality=jpeg_quality)
    elif codec == "png":
        img.save(buf, format="PNG", compress_level=1)
    else:
        raise ValueError(f"unknown codec '{codec}'; use jpeg or png")
    return buf.getvalue()
