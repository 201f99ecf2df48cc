"""Streaming, resumable sample streams over ETL shards, shared by training and inference.

Why not Ray Data's iterator here: it cannot resume mid-epoch (ray-project/ray #37633, #48224).
This reader follows mosaicml/streaming instead: the epoch's shard order is a pure function of
(seed, epoch); each rank takes a contiguous row range of that order, reads its shards
sequentially and shuffles in a bounded buffer with its own seeded RNG. A position is then just
(epoch, step): on resume the same stream is rebuilt and the consumed rows are skipped undecoded.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import numpy as np

from stages.common import storage
from stages.common.config import TrainConfig
from stages.etl import shards
from stages.etl.images import decode_rgb

__all__ = ["ShardRef", "ShardRefused", "shard_refs", "ShardCache", "rank_pieces", "iter_samples", "steps_per_epoch",
           "epoch_batches",
           "batch_sizes_at", "decode_sample", "augment", "sample_rng", "Prefetcher"]


class ShardRefused(ValueError):
    """A shard whose bytes are not the ones ETL wrote: a retry or a rerun reads the same bytes, so
    the train stage says this message, not "rerun to resume" (stages.model.checkpoint_io.refusal_in)."""

log = logging.getLogger(__name__)


# The shard cache's defaults are TrainConfig's (train.cache_dir, train.cache_max_gb); the driver's
# evaluation, batch inference and the pipeline's probe use the same cache when no config is at hand.
CACHE_DIR: str = TrainConfig.model_fields["cache_dir"].default
CACHE_MAX_BYTES: float = TrainConfig.model_fields["cache_max_gb"].default * 1e9


@dataclass(frozen=True)
class ShardRef:
    uri: str
    format: str
    rows: int
    bytes: int
    sha256: str


def shard_refs(manifest: dict, root: str, split: str, fmt: str) -> list[ShardRef]:
    refs = [ShardRef(storage.join(root, s["path"]), s["format"], s["rows"], s["bytes"], s["sha256"])
            for s in manifest["shards"] if s["split"] == split and s["format"] == fmt]
    return sorted(refs, key=lambda r: r.uri)


class ShardCache:
    """Local-disk tier under object storage: remote shards are fetched once, verified by sha256.

    Files are named by checksum, so a later run over the same data reuses them. Least recently
    used files are evicted past `max_bytes`. Local shards are read in place.
    """

    # (path, inode) of cached files whose sha256 this process has checked: process-wide, so
    # every cache object (training, evaluation) hashes a file once; a replaced file is rechecked.
    _verified: ClassVar[set[tuple[str, int]]] = set()

    def __init__(self, cache_dir: str, max_bytes: float, s3: Any | None = None):
        self.dir = Path(os.path.expanduser(cache_dir))
        self.max_bytes, self.s3 = max_bytes, s3
        self.hits = self.misses = 0

    def local_path(self, ref: ShardRef) -> str:
        if not storage.is_remote(ref.uri):
            return storage.local_path(ref.uri)
        path = self.dir / f"{ref.sha256}.{ref.format}"
        if path.exists() and path.stat().st_size == ref.bytes and self._trusted(path, ref):
            self.hits += 1
            os.utime(path)  # LRU order
            return str(path)
        self.misses += 1
        self.dir.mkdir(parents=True, exist_ok=True)
        fs, remote = storage.filesystem(ref.uri, self.s3)
        tmp = path.with_suffix(f".tmp-{os.getpid()}-{threading.get_ident()}")
        fs.get_file(remote, str(tmp))
        digest, size = storage.sha256_file(storage.filesystem(str(tmp))[0], str(tmp))
        if digest != ref.sha256 or size != ref.bytes:
            tmp.unlink(missing_ok=True)
            raise ShardRefused(f"shard {ref.uri} fails its checksum ({size} bytes, sha256 {digest[:12]}...); "
                               f"the data changed since ETL: run `raymill verify` and re-run ETL")
        os.replace(tmp, path)
        self._verified.add((str(path), path.stat().st_ino))
        self._evict()
        return str(path)

    def _trusted(self, path: Path, ref: ShardRef) -> bool:
        """A cached file's content is its name's sha256. Hashed once per process per file: the
        cache folder outlives runs and may be shared, so a right-sized file is not proof."""
        try:
            if (str(path), path.stat().st_ino) in self._verified:
                return True
            digest, _ = storage.sha256_file(storage.filesystem(str(path))[0], str(path))
        except FileNotFoundError:  # evicted by another process meanwhile: fetch it
            return False
        if digest != ref.sha256:
            log.warning("shard cache: %s does not match its sha256 (%s...); fetching it again",
                        path, digest[:12])
            path.unlink(missing_ok=True)
            return False
        self._verified.add((str(path), path.stat().st_ino))
        return True

    def _evict(self) -> None:
        files = sorted(self.dir.glob("*.*"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files[:-1]:  # never the file just fetched
            if total <= self.max_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)


def read_shard(path: str, fmt: str, with_path: bool = False) -> list[tuple]:
    """All (key, label, image bytes) rows of one local shard, in stored order.

    `with_path` gives (key, source path, label, image bytes): batch inference names rows by the
    file they came from.
    """
    columns = ["key", "path", "label", "image"] if with_path else ["key", "label", "image"]
    fs = storage.filesystem(path)[0]
    if fmt == "parquet":
        table = shards.read_parquet_table(fs, path, columns)
        return list(zip(*(table[c].to_pylist() for c in columns)))
    with open(path, "rb") as f:
        return [tuple(s.get(c) for c in columns) for s in shards.iter_tar(f)]


def rank_pieces(refs: list[ShardRef], seed: int, epoch: int, rank: int, world: int,
                shuffle: bool) -> list[tuple[ShardRef, int, int]]:
    """This rank's contiguous row range of the epoch's shard order, as (shard, start, stop)."""
    order = list(refs)
    if shuffle:
        random.Random(f"shards:{seed}:{epoch}").shuffle(order)
    total = sum(r.rows for r in order)
    lo, hi = total * rank // world, total * (rank + 1) // world
    pieces, offset = [], 0
    for ref in order:
        start, stop = max(lo - offset, 0), min(hi - offset, ref.rows)
        if start < stop:
            pieces.append((ref, start, stop))
        offset += ref.rows
    return pieces


def steps_per_epoch(total_rows: int, world: int, batch_size: int) -> int:
    return math.ceil(math.ceil(total_rows / world) / batch_size)


def batch_sizes_at(step: int, total_rows: int, world: int, batch_size: int) -> list[int]:
    """Per-rank batch sizes at `step`: ranks differ by one row at most, so a last batch can be empty."""
    rows = [total_rows * (r + 1) // world - total_rows * r // world for r in range(world)]
    return [max(0, min(batch_size, n - step * batch_size)) for n in rows]


def iter_samples(pieces, open_rows: Callable[[ShardRef], list], seed: int, epoch: int, rank: int,
                 buffer_rows: int, shuffle: bool) -> Iterator[tuple[str, int, bytes]]:
    """Sequential shard reads, then a bounded shuffle buffer. Deterministic for its arguments."""
    rng = random.Random(f"buffer:{seed}:{epoch}:{rank}")
    buffer: list = []
    for ref, start, stop in pieces:
        for row in open_rows(ref)[start:stop]:
            if not shuffle:
                yield row
                continue
            buffer.append(row)
            if len(buffer) >= buffer_rows:
                i = rng.randrange(len(buffer))
                buffer[i], buffer[-1] = buffer[-1], buffer[i]
                yield buffer.pop()
    rng.shuffle(buffer)
    yield from buffer


def decode_sample(image: bytes, size: int, raw: bool) -> np.ndarray:
    if raw:
        return np.frombuffer(image, dtype=np.uint8).reshape(size, size, 3)
    return decode_rgb(image, size)


def augment(pixels: np.ndarray, rng: np.random.Generator, scale_min: float, crop: bool,
            flip: bool) -> np.ndarray:
    """Random resized crop (area in [scale_min, 1], aspect in [3/4, 4/3]) and horizontal flip."""
    from PIL import Image

    size = pixels.shape[0]
    if crop:
        area = size * size * rng.uniform(scale_min, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = int(round(min(size, math.sqrt(area * aspect))))
        h = int(round(min(size, math.sqrt(area / aspect))))
        x, y = int(rng.integers(0, size - w + 1)), int(rng.integers(0, size - h + 1))
        img = Image.fromarray(pixels).resize((size, size), Image.Resampling.BILINEAR, box=(x, y, x + w, y + h))
        pixels = np.asarray(img)
    if flip and rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    return np.ascontiguousarray(pixels)


def epoch_batches(refs: list[ShardRef], open_rows: Callable[[ShardRef], list], seed: int, epoch: int,
                  rank: int, world: int, batch_size: int, buffer_rows: int, start_step: int = 0,
                  steps: int | None = None) -> Iterator[list]:
    """This rank's training batches of (key, label, image) for `epoch`, from step `start_step`.

    The training worker and the ingest benchmark both read through this: shard order, then the
    shuffle buffer, both pure functions of (seed, epoch, rank), so a resumed run skips exactly the
    rows it has seen. `steps` stops after that many steps in all; None reads until the rows run out.
    """
    pieces = rank_pieces(refs, seed, epoch, rank, world, shuffle=True)
    stream = iter_samples(pieces, open_rows, seed, epoch, rank, buffer_rows, shuffle=True)
    stream = itertools.islice(stream, start_step * batch_size, None)  # resume: skip undecoded
    step = start_step
    while steps is None or step < steps:
        batch = list(itertools.islice(stream, batch_size))
        if not batch and steps is None:
            return
        yield batch
        step += 1


def sample_rng(seed: int, epoch: int, key: str) -> np.random.Generator:
    """The augmentation RNG of one sample in one epoch: the same in every process and attempt."""
    return np.random.default_rng([seed, epoch, int(key[:15], 16)])


class Prefetcher:
    """Decode batches on background threads, `depth` batches ahead; time spent waiting is measured."""

    def __init__(self, batches: Iterator[list], decode: Callable[[Any], np.ndarray], threads: int,
                 depth: int):
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._pool = ThreadPoolExecutor(max_workers=threads)
        self._thread = threading.Thread(target=self._fill, args=(batches, decode), daemon=True)
        self._thread.start()

    def _fill(self, batches, decode) -> None:
        try:
            for batch in batches:
                arrays = list(self._pool.map(decode, batch))
                self._queue.put((batch, arrays))
        except BaseException as e:  # surfaced in the consumer, not lost in a thread
            self._queue.put(e)
        self._queue.put(None)

    def __iter__(self):
        while True:
            started = time.perf_counter()
            item = self._queue.get()
            self.wait_s += time.perf_counter() - started
            if item is None:
                self._pool.shutdown(wait=False)
                return
            if isinstance(item, BaseException):
                raise item
            yield item
