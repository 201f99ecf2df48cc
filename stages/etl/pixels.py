"""An image's model-input pixels, as ETL, training, `raymill infer`, serve and MLflow compute them.

This file imports only Pillow and numpy: `raymill export` copies it beside the exported model as
`preprocess.py`, so a client outside raymill (Triton's, an edge device's) feeds the graph the very
pixels raymill would. The README's recipe without it (convert("RGB"), then resize) disagreed with
`raymill infer` on 3 rules: JPEG draft decoding (up to 113/255 per pixel on the demo's photos, one
class flipped), transparent pixels (dropped, not white) and 16-bit PNGs (clipped, not scaled).

    from preprocess import pixels
    read = manifest["input"]["read"]   # the formats and the pixel limit raymill reads images with
    batch = np.stack([pixels(open("cat.jpg", "rb").read(), 224, "crop", read)])   # uint8 [N, 224, 224, 3]

(image_size, resize and read are in the export's manifest.json `input`; model.json has them too.)
With `read`, a file raymill refuses (a GIF, a decompression bomb, a JPEG of endless scans, a file
over max_file_mb) raises BadImage with raymill's reason, before any pixel is decoded; without it,
Pillow decodes what it can. Pillow's own guard refuses images over 2 x Image.MAX_IMAGE_PIXELS (179 MP)
whatever `read` says: raymill sets it to None; a client reading larger images must too.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = ["pixels", "checked", "draft", "load", "square", "open_image", "BadImage", "MAX_JPEG_SCANS"]


def pixels(data: bytes, size: int, resize: str = "crop", read: dict | None = None) -> np.ndarray:
    """Encoded image bytes -> uint8 RGB (size, size, 3). `read`: model.json's read rules (at least
    allowed_formats and max_image_pixels; max_file_mb where given), checked first (BadImage); Pillow's
    errors propagate."""
    if read is not None:
        if "max_file_mb" in read and len(data) > (cap := int(read["max_file_mb"] * 1e6)):
            raise BadImage("too_large", f"{len(data)} bytes > {cap} (the model's etl.max_file_mb)")  # as infer does
        return checked(data, size, resize, tuple(read["allowed_formats"]), int(read["max_image_pixels"]))
    img = Image.open(io.BytesIO(data))
    load(img, size)
    return square(img, size, resize)


def checked(data: bytes, size: int, resize: str, allowed_formats: tuple[str, ...], max_pixels: int) -> np.ndarray:
    """`pixels` with raymill's checks: BadImage with the reason ETL, infer and serve give (the
    header's checks in `open_image`, then `truncated`/`corrupt` for a failed decode and
    `decode_error` for anything else)."""
    img = open_image(data, allowed_formats, max_pixels)
    try:
        load(img, size)
    except Exception as e:
        raise BadImage(_failed(e), f"{type(e).__name__}: {e}") from None
    try:
        return square(img, size, resize)
    except Exception as e:  # any other decoder failure is this file's problem, never the job's
        raise BadImage("decode_error", f"{type(e).__name__}: {e}") from None


# Scans a JPEG may hold. Decode time grows with scans x pixels, not with file size: a 435 KB
# 36 MP progressive JPEG that repeats its last scan 2,000 times took 24 s in libjpeg, holding a
# serve replica's decode thread past any request timeout. An ordinary progressive JPEG has about
# 10 scans (libjpeg's default script), a baseline one 1 to 3; libjpeg-turbo's `djpeg -maxscans`
# exists for the same reason. The bytes FF DA begin a scan and appear nowhere else: the entropy-
# coded data stuffs every FF with 00, so counting them counts scans (an EXIF thumbnail's included).
MAX_JPEG_SCANS = 100


def _signature(data: bytes) -> str | None:
    """The format whose magic-byte check matches the first bytes: each Pillow plugin registers one
    beside its parser (`Image.register_open`), a comparison of the prefix that parses nothing, as
    `Image.open` reads it. Pillow says "cannot identify" both for bytes that are no image and for an
    image whose header is damaged, and only the allowed formats' parsers run (`open_image`): the
    signature tells a damaged allowed image, and one of a format left out, from no image at all."""
    Image.init()
    prefix = data[:16]
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        try:
            if accept is not None and accept(prefix):
                return fmt
        except Exception:  # a check that cannot read so short a prefix matches nothing
            continue
    return None


class BadImage(ValueError):
    """Bytes that are not a usable image; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _failed(e: Exception) -> str:
    """`truncated` for bytes that end too soon (Pillow's "image file is truncated", "Truncated File
    Read", EOFError), else `corrupt`."""
    return "truncated" if "truncated" in str(e).lower() or isinstance(e, EOFError) else "corrupt"


def open_image(data: bytes, allowed_formats: tuple[str, ...], max_pixels: int) -> Image.Image:
    """Parse the header only: format and size are checked before any pixel is decoded."""
    if not data:
        raise BadImage("empty_file", "0 bytes")
    try:  # only the allowed formats' parsers read untrusted bytes (JPEG's opens an MPO too)
        img = Image.open(io.BytesIO(data), formats=allowed_formats)
    except UnidentifiedImageError:
        if (fmt := _signature(data)) is not None and fmt not in allowed_formats:
            raise BadImage("unsupported_format", f"{fmt} (by its signature); allowed: "
                                                 f"{', '.join(allowed_formats)}") from None
        if fmt is not None:  # e.g. a PNG whose IHDR fails its CRC: damaged, not foreign
            raise BadImage("corrupt", f"a {fmt} signature, but its header does not parse") from None
        raise BadImage("not_an_image", "no known image signature") from None
    except Image.DecompressionBombError as e:  # Pillow's own guard (raymill lifts it; preprocess.py keeps it)
        raise BadImage("decompression_bomb", str(e)) from None
    except Exception as e:  # Pillow raises many types on malformed headers; a file cut inside its header
        raise BadImage(_failed(e), f"{type(e).__name__}: {e}") from None  # is "truncated" too
    # A JPEG with an MPF segment (phones, some cameras) opens as MPO; its first frame is the JPEG.
    fmt = "JPEG" if img.format == "MPO" else img.format
    if fmt not in allowed_formats:
        raise BadImage("unsupported_format", f"{img.format}; allowed: {', '.join(allowed_formats)}")
    width, height = img.size
    if max(width, height) >= 2**31:  # no format stores a side that long: a negative one read unsigned (BMP)
        raise BadImage("corrupt", f"the header declares {width}x{height} px")
    if width * height > max_pixels:
        raise BadImage("decompression_bomb", f"{width}x{height} px exceeds {max_pixels} px")
    if fmt == "JPEG" and (scans := data.count(b"\xff\xda")) > MAX_JPEG_SCANS:
        raise BadImage("decompression_bomb", f"a JPEG of {scans} scans (at most {MAX_JPEG_SCANS}): its decode "
                                             f"time grows with every scan; re-encode it")
    return img


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
