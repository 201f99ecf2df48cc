"""Reading and decoding batch inference's work items, for either plan (`infer.decode`):

- `actor`: the predicting actor calls `Reader` itself (stages.infer.predictors.Predictor);
- `tasks`: Ray Data CPU tasks run `decode_batch` and hand uint8 pixels to an actor pool that only
  predicts (stages.infer.predictors.BatchPredictor), so a GPU actor never decodes JPEGs on its few CPU
  threads while the GPU waits.

Both give every sample exactly one row: an unusable file is a row with its error reason, never an
exception, and both use the project's one eval transform (`stages.model.transform.preprocess`,
`streaming.decode_sample`), so the two plans predict the same.
"""
from __future__ import annotations

import itertools
import unicodedata
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from stages.model.transform import preprocess
from stages.etl import sources
from stages.feed import streaming
from stages.etl.stage import sample_key
from stages.etl.images import BadImage
from stages.common import storage

__all__ = ["Reader", "decode_batch", "pixels", "DECODED"]


class Reader:
    """Turns one work item (a shard, or one raw file) into samples, and a sample into pixels."""

    def __init__(self, info: dict, s3: dict, *, mode: str, source: str | None = None, raw: bool = False,
                 etl_classes: list | None = None, class_depth: int = 0):
        self.info, self.mode, self.raw = info, mode, raw
        self.class_depth = class_depth  # 1: a raw folder split by its folders (stages.etl.layout)
        self.etl_classes = list(etl_classes or [])
        # a class folder's name -> the model's class: both in NFC, as ETL names classes
        self.known = {unicodedata.normalize("NFC", c): c for c in info["classes"]}
        self.fs, self.root = storage.filesystem(source, s3) if source else (None, None)
        self.rules = sources.read_rules(info)
        self.cache = streaming.ShardCache(streaming.CACHE_DIR, streaming.CACHE_MAX_BYTES, s3)

    def samples(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        if self.mode == "images":
            rel = bytes.fromhex(item["name_hex"]).decode("utf-8", "surrogateescape") if item["name_hex"] \
                else item["path"]
            return [{"key": sample_key(rel), "path": item["path"], "rel": rel, "size": item["size"],
                     "reason": item["reason"], "detail": item["detail"],
                     "true_class": self.known.get(sources.class_of(item["path"], self.class_depth))}]
        ref = streaming.ShardRef(**item)
        # ETL's class names through the model's, as for a raw folder: a class the model lacks is no label
        return [{"key": key, "path": path, "image": image,
                 "true_class": self.known.get(unicodedata.normalize("NFC", self.etl_classes[label]))}
                for key, path, label, image in streaming.read_shard(self.cache.local_path(ref), ref.format,
                                                                    with_path=True)]

    def decode(self, sample: dict[str, Any]) -> tuple[np.ndarray | None, str | None, str | None]:
        """(pixels, None, None), or (None, reason, detail) for an unusable image."""
        try:
            if "image" in sample:
                return streaming.decode_sample(sample["image"], self.info["image_size"], self.raw), None, None
            if sample["reason"]:  # a link out of the folder, a FIFO, a device: never read
                return None, sample["reason"], sample["detail"]
            rules, cap = self.rules, int(self.rules["max_file_mb"] * 1e6)
            if sample["size"] > cap:  # not even read: one huge file must not sink the worker
                return None, "too_large", f"{sample['size']} bytes > {cap}"
            data = sources.read_capped(self.fs, self.root, sample["rel"], cap, rules["follow_symlinks"])
            return preprocess(data, self.info, tuple(rules["allowed_formats"]),
                                      rules["max_image_pixels"]), None, None
        except BadImage as e:
            return None, e.reason, e.detail
        except OSError as e:  # decoding turns its own errors into BadImage; this is the read
            return None, "read_error", f"{type(e).__name__}: {e}"


# What a decode task hands the predicting actors: one row per sample, pixels as size x size x 3
# uint8 bytes (null on an error row). An explicit Arrow schema: numpy object columns that happen
# to be all None in a batch lose their string type on the way through Ray Data.
DECODED = pa.schema([("key", pa.string()), ("path", pa.string()), ("true_class", pa.string()),
                     ("error", pa.string()), ("error_detail", pa.string()), ("pixels", pa.binary())])


def decode_batch(batch: pa.Table, *, info: dict, s3: dict, reader: dict, rows_per_batch: int) -> Iterator[pa.Table]:
    """Ray Data task (infer.decode=tasks): work items -> DECODED rows, `rows_per_batch` at a time
    (a shard of thousands of images never sits decoded in one piece)."""
    read = Reader(info, s3, **reader)
    samples = (s for item in batch.to_pylist() for s in read.samples(item))
    while chunk := list(itertools.islice(samples, rows_per_batch)):
        decoded = [read.decode(s) for s in chunk]
        columns = {name: [s[name] for s in chunk] for name in ("key", "path", "true_class")}
        yield pa.Table.from_pydict({**columns, "error": [d[1] for d in decoded], "error_detail": [d[2] for d in decoded],
                                    "pixels": [None if d[0] is None else d[0].tobytes() for d in decoded]},
                                   schema=DECODED)


def pixels(column: pa.ChunkedArray, rows: list[int], size: int) -> np.ndarray:
    """The N x size x size x 3 uint8 images of `rows` (none of them an error row), one copy."""
    if not rows:
        return np.zeros((0, size, size, 3), dtype=np.uint8)
    values = column.take(rows).combine_chunks()
    _, offsets, data = values.buffers()  # validity, int32 offsets, the bytes
    start = int(np.frombuffer(offsets, np.int32, count=1, offset=4 * values.offset)[0])
    return np.frombuffer(data, np.uint8, count=len(rows) * size * size * 3,
                         offset=start).reshape(-1, size, size, 3)
