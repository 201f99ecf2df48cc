"""The one eval transform: raw image bytes -> the uint8 pixels a model of `info` was trained on.

Apart from stages.model.predict (which re-exports it) because it needs no torch: batch inference's
Ray Data decode tasks import this, and each new task worker had imported torch through predict
before its first image.
"""
from __future__ import annotations

import numpy as np

from stages.etl.images import decode_rgb

__all__ = ["preprocess"]


def preprocess(data: bytes, info: dict, allowed_formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "BMP"),
               max_pixels: int = 89_478_485) -> np.ndarray:
    """The eval transform for raw image bytes: identical to what ETL stored for training.

    Raises stages.etl.images.BadImage (with .reason) for unusable bytes.
    """
    return decode_rgb(data, info["image_size"], resize=info.get("resize", "crop"),
                      allowed_formats=allowed_formats, max_pixels=max_pixels)
