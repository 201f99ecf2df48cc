"""The one interface between a training loop and its input: an epoch of `FedBatch`es.

Every ingest path yields the same thing: the rows in the stream's order, their uint8 NHWC
images (host numpy, or a device tensor from the decoded tier), and a `wait_s` counter of how
long the loop waited. The paths:
- `PoolFeed`: this worker's own shard reader, decoded by a `DecodePool` (processes);
- `ThreadFeed`: the same reader decoded by threads of the training process (train.decode_processes=0);
- `stages.feed.ray_data.ShardBatches`: Ray Data decodes on any CPU of the cluster;
- `stages.feed.decoded_tier.TierFeed`: decoded pixels kept in memory, augmented as tensor ops.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from stages.feed import streaming
from stages.feed.decode_pool import DecodePool, DecodeSpec

__all__ = ["FedBatch", "PoolFeed", "ThreadFeed"]


@dataclass
class FedBatch:
    """One step's input. `images` is valid until the next batch is requested."""
    rows: list[tuple]  # (key, label, ...) per sample, in the stream's order
    images: Any  # uint8 NHWC: numpy on the host, or a torch tensor already on the device
    plain: np.ndarray | None = None  # pre-augmentation pixels of the same rows (decoded tier fill)


class PoolFeed:
    """One epoch of `batches` decoded by `pool`, yielded in the order of `batches`.

    A feeder thread reads shards (I/O, the shuffle buffer) and hands each batch to the pool as
    soon as a slot is free, so at most `pool.depth` batches are in flight: memory is bounded.
    """

    def __init__(self, pool: DecodePool, batches: Iterator[list], spec: DecodeSpec):
        self.pool, self.spec = pool, spec
        self.wait_s = self.decode_cpu_s = 0.0
        self.images = 0
        self._pending: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(batches,), daemon=True,
                                        name="raymill-feed")
        self._thread.start()

    def _fill(self, batches: Iterator[list]) -> None:
        try:
            for batch in batches:
                slot = self.pool.acquire(self._stop)
                if slot is None:
                    return
                futures = self.pool.submit(slot, batch, self.spec) if batch else []
                self._pending.put((batch, slot, futures))
        except BaseException as e:  # surfaced in the consumer, not lost in a thread
            self._pending.put(e)
        finally:
            self._pending.put(None)

    def __iter__(self) -> Iterator[FedBatch]:
        held = None
        try:
            while True:
                if held is not None:
                    self.pool.release(held)
                    held = None
                started = time.perf_counter()
                item = self._pending.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, held, futures = item
                self.decode_cpu_s += sum(f.result() for f in futures)
                self.wait_s += time.perf_counter() - started
                self.images += len(batch)
                plain = self.pool.view(held, len(batch), plain=True) if self.spec.keep_plain else None
                yield FedBatch(batch, self.pool.view(held, len(batch)), plain)
        finally:
            if held is not None:
                self.pool.release(held)
            self.close()

    def close(self) -> None:
        """Stop reading, let in-flight decodes finish and free their slots (the pool lives on)."""
        self._stop.set()
        self._thread.join()
        while not self._pending.empty():
            item = self._pending.get_nowait()
            if isinstance(item, tuple):
                for f in item[2]:
                    f.exception()  # wait; its error belongs to an epoch nobody reads any more
                self.pool.release(item[1])

    def capacity(self) -> dict[str, float] | None:
        """What the pool's processes can deliver: processes / (decode CPU seconds per image)."""
        if not self.images or self.decode_cpu_s <= 0:
            return None
        return {"processes": self.pool.processes,
                "images_per_s": self.pool.processes * self.images / self.decode_cpu_s}


class ThreadFeed:
    """The same batches decoded by threads of this process (the old path, kept to compare)."""

    def __init__(self, batches: Iterator[list], spec: DecodeSpec, threads: int, depth: int):
        self._prefetch = streaming.Prefetcher(batches, spec.decoder(), threads, depth)

    @property
    def wait_s(self) -> float:
        return self._prefetch.wait_s

    def __iter__(self) -> Iterator[FedBatch]:
        for batch, arrays in self._prefetch:
            size = arrays[0].shape[0] if arrays else 1
            yield FedBatch(batch, np.stack(arrays) if arrays else np.zeros((0, size, size, 3), np.uint8))

    def close(self) -> None:
        pass

    def capacity(self) -> None:
        return None  # threads share the GIL with the loop: no capacity can be claimed


class KeptFeed:
    """One pass of an eval split's `feed`, whose batches go to `on_kept` when the pass ran to its
    end within `budget` bytes: the eval transform draws nothing random, so a later pass can replay
    the same pixels (ListFeed)."""

    def __init__(self, feed, budget: int, on_kept: Callable[[list[FedBatch]], None]):
        self.feed, self.budget, self.on_kept = feed, budget, on_kept

    def __iter__(self) -> Iterator[FedBatch]:
        kept: list[FedBatch] | None = []
        size = 0
        for fed in self.feed:
            size += getattr(fed.images, "nbytes", 0)
            if kept is not None and size <= self.budget:  # a copy: the pool reuses its slots
                kept.append(FedBatch(fed.rows, np.array(fed.images, copy=True)))
            else:
                kept = None
            yield fed
        if kept is not None:
            self.on_kept(kept)

    def close(self) -> None:
        self.feed.close()


class ListFeed:
    """Batches already decoded, replayed."""

    def __init__(self, batches: list[FedBatch]):
        self.batches = batches

    def __iter__(self) -> Iterator[FedBatch]:
        return iter(self.batches)

    def close(self) -> None:
        pass
