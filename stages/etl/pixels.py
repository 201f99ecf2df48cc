"""An image's model-input pixels, as ETL, training, `raymill infer`, serve and MLflow compute them.

This file imports only Pillow and numpy: `raymill export` copies it beside the exported model as
`preprocess.py`, so a client outside raymill (Triton's, an edge device's) feeds the graph the very
pixels raymill would. The README's recipe without it (convert("RGB"), then resize) disagreed with
`raymill infer` on 3 rules: JPEG draft decoding (up to 113/255 per pixel on the demo's photos, one
class flipped), transparent pixels (dropped, not white) and 16-bit PNGs (clipped, not scaled).

    from preprocess import pixels
    batch = np.stack([pixels(open("cat.jpg", "rb").read(), 224, "crop")])   # uint8 [N, 224, 224, 3]

(image_size and resize are in the export's manifest.json `input`, and in model.json.)
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

__all__ = ["pixels", "draft", "load", "square"]


def pixels(data: bytes, size: int, resize: str = "crop") -> np.ndarray:
    """Encoded image bytes -> uint8 RGB (size, size, 3). Pillow's errors propagate as they are."""
    img = Image.open(io.BytesIO(data))
    load(img, size)
    return square(img, size, resize)


def load(img: Image.Image, size: int) -> None:
    """Decode an opened image's pixels, at `draft`'s scale."""
    draft(img, size)
    img.load()


def draft(img: Image.Image, size: int) -> None:
    """Set an opened image's decode scale; decodes nothing, and `img.size` then says what a decode
    holds. A JPEG decodes in libjpeg's draft mode, at 1/2, 1/4 or 1/8 scale where that still covers
    `size` (about 2x faster for large photos, the same quality); other formats at full size."""
    if img.format in ("JPEG", "MPO"):
        img.draft("RGB", (size, size))


def square(img: Image.Image, size: int, resize: str = "crop") -> np.ndarray:
    """A loaded image -> uint8 RGB (size, size, 3): EXIF orientation applied (phones store pixels
    sideways plus a tag), then crop (the shorter side scaled to `size`, the centre square) or
    stretch (both sides, aspect ignored), bilinear."""
    sixteen_bit = img.mode.startswith("I;16") or (img.mode == "I" and img.format == "PNG")
    img = ImageOps.exif_transpose(img)  # first: a TIFF's orientation is in tags a new image lacks
    if img.mode in ("F", "I") and not sixteen_bit:  # a TIFF's 32-bit float or integer grey
        img = _wide_grey(img)
    return _resize(_to_rgb(img, sixteen_bit), size, resize)


def _wide_grey(img: Image.Image) -> Image.Image:
    """32-bit grey (TIFF) -> 8-bit: convert("RGB") clipped it, so floats in 0-1 came out black.
    One rule per mode, whatever else the image holds (a rule picked by the image's own maximum
    made one pixel at 1.01 turn a 0.8 grey from 204 to 1): floats are 0-1, scaled by 255;
    integers are 16-bit values, scaled by 1/257. Values outside that range are refused, not guessed."""
    values = np.asarray(img, dtype=np.float32)  # exact for the ranges read (float32 is F's own type)
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    top = 1.0 if img.mode == "F" else 65535.0
    if finite.size < values.size or low < 0 or high > top:
        odd = " with NaN or inf" if finite.size < values.size else ""
        reads = "floats in 0-1" if img.mode == "F" else "integers in 0-65535"
        raise ValueError(f"32-bit grey pixels in [{low:g}, {high:g}]{odd}: raymill reads {reads}; "
                         "store the image with 8- or 16-bit pixels")
    scaled = values * 255.0 if img.mode == "F" else values / 257.0
    return Image.fromarray(np.rint(scaled).astype(np.uint8), "L")


def _resize(img: Image.Image, size: int, resize: str) -> np.ndarray:
    width, height = img.size
    if resize == "crop":
        side = min(width, height)
        box = ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)
    else:
        box = (0, 0, width, height)
    if img.size != (size, size) or box != (0, 0, width, height):
        img = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
    return np.asarray(img, dtype=np.uint8)


def _to_rgb(img: Image.Image, sixteen_bit: bool = False) -> Image.Image:
    if sixteen_bit:
        # 16-bit greyscale: convert("RGB") clips every value above 255 to white; scale instead.
        # Its tRNS names one 16-bit grey as transparent: white, as for the 8-bit modes below.
        values = np.asarray(img, dtype=np.uint32)
        grey = (values // 257).astype(np.uint8)
        if isinstance(img.info.get("transparency"), int):
            grey[values == img.info["transparency"]] = 255
        return Image.fromarray(grey, "L").convert("RGB")
    # Transparent pixels become white, not whatever colour the encoder left under alpha 0.
    # L, RGB and P PNGs may name a transparent colour (tRNS) instead of carrying an alpha channel.
    if img.mode in ("RGBA", "LA") or (img.mode in ("P", "L", "RGB") and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")
