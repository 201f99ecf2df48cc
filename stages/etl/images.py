"""Decoding untrusted image bytes, shared by ETL, training, batch inference and serving.

One function decides what a "bad image" is, so the ETL quarantine and the HTTP 4xx codes agree.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from stages.etl import pixels
from stages.etl.pixels import MAX_JPEG_SCANS, BadImage, open_image  # noqa: F401 (re-exported: the checks' home)

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


def decode_rgb(data: bytes, size: int, *, resize: str = "crop",
               allowed_formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "BMP"),
               max_pixels: int = 89_478_485) -> np.ndarray:
    """Decode to an RGB uint8 array of shape (size, size, 3): the checks of `open_image`, then
    stages.etl.pixels (the rules an exported model's clients get as preprocess.py); BadImage with
    its reason for unusable bytes.

    crop: scale the shorter side to `size` and take the centre square; stretch: ignore aspect.
    """
    return pixels.checked(data, size, resize, allowed_formats, max_pixels)


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
