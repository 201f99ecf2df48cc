"""Decode and augment in worker processes, outside the training process's GIL.

Why processes: on a 16-core GPU node, Pillow decode + random-resized-crop in 12 threads of the
training process gave 1,275 img/s and 12 processes 6,063 (measured on an H100 node); the threads also
held the GIL the training thread needs between kernel launches. This follows torch's DataLoader
workers: results land in shared memory, not in pickles (and so do the encoded inputs), and the
parent decides the sample order, so the workers only decode (mosaicml/streaming's "elastic
determinism").

Memory: `depth` batch slots in one `multiprocessing.sharedctypes.RawArray`, and as many inboxes. On Linux that is an
mmap of a /dev/shm file that is unlinked at once, so nothing is left behind even after a SIGKILL.
Children: started with `forkserver` (fork is unsafe after CUDA is initialised); each one exits
within `WATCHDOG_S` of its parent's death, so a killed Ray worker leaves no orphans.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.sharedctypes
import os
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from stages.feed import streaming
from stages.feed.pipe_pool import PipePool

__all__ = ["DecodeSpec", "DecodePool", "WATCHDOG_S"]

log = logging.getLogger(__name__)

WATCHDOG_S = 0.5
NICE = 5
# What the parent's main module imports when the pool runs in a Ray worker (see DecodePool).
_MAIN_DEPENDENCIES = ("ray",)


@dataclass(frozen=True)
class DecodeSpec:
    """How one epoch's samples become pixels: the training transform, or the eval one.

    `keep_plain` also returns the decoded, resized, pre-augmentation pixels (the decoded tier's
    fill). Augmentation draws from an RNG seeded by (seed, epoch, key) (streaming.sample_rng),
    so the pixels do not depend on which process decodes a sample.
    """
    size: int
    raw: bool
    seed: int = 0
    epoch: int = 0
    augment: bool = False
    scale_min: float = 0.08
    crop: bool = False
    flip: bool = False
    keep_plain: bool = False

    def decoder(self) -> Callable[[tuple], np.ndarray]:
        """One sample -> its pixels under this spec (threads use it; the processes, `pixels`)."""
        return lambda sample: self.pixels(sample)[0]

    def pixels(self, sample: tuple) -> tuple[np.ndarray, np.ndarray]:
        """(transformed, pre-augmentation) pixels of one (key, label, image) sample."""
        plain = streaming.decode_sample(sample[2], self.size, self.raw)
        if not self.augment:
            return plain, plain
        rng = streaming.sample_rng(self.seed, self.epoch, sample[0])
        return streaming.augment(plain, rng, self.scale_min, self.crop, self.flip), plain


# ---- child side ------------------------------------------------------------------------------
_CHILD: dict[str, Any] = {}


def _child_init(buffer, slot_shape: tuple[int, ...], inbox, parent_pid: int) -> None:
    # The parent owns shutdown: Ctrl-C reaches the whole process group, and a child that died of
    # it would turn a clean stop into a BrokenProcessPool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _CHILD["slots"] = np.frombuffer(buffer, dtype=np.uint8).reshape(slot_shape)
    _CHILD["inbox"] = np.frombuffer(inbox, dtype=np.uint8).reshape(slot_shape[0], -1)
    threading.Thread(target=_watch_parent, args=(parent_pid, os.getppid()), daemon=True).start()


def _yield_to_the_loop() -> None:
    """Below the training loop: when cores are short, the loop (launching kernels, or computing
    on a CPU) is never queued behind a decoder, and decoders take every cycle it leaves. Linux's
    SCHED_IDLE does exactly that (a nice level only weights the share: a decoder beside the loop
    still took a quarter of its core); elsewhere, nice."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(NICE)


def _watch_parent(parent_pid: int, first_ppid: int) -> None:
    """Exit when the parent is gone. A pool worker blocks on its task queue, whose write end it
    also holds, so it would never see EOF and would outlive a SIGKILLed parent forever."""
    while True:
        time.sleep(WATCHDOG_S)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        if os.getppid() != first_ppid:  # re-parented: the parent (or the forkserver) died
            os._exit(0)


def _decode_chunk(slot: int, offset: int, samples: Sequence[tuple], spec: DecodeSpec) -> float:
    """Decode `samples` into rows offset.. of `slot`; returns the CPU seconds it took."""
    if not _CHILD.get("yielded"):  # at the first batch, not at start: a pool starting beside a
        _yield_to_the_loop()          # busy training loop would wait for idle cores to start
        _CHILD["yielded"] = True
    started = time.process_time()
    slots, inbox = _CHILD["slots"], _CHILD["inbox"][slot]
    for i, sample in enumerate(samples):
        if isinstance(sample[2], tuple):  # (start, end) of its bytes in the slot's inbox
            sample = (sample[0], sample[1], inbox[sample[2][0]:sample[2][1]].tobytes())
        slots[slot, 0, offset + i], plain = spec.pixels(sample)
        if spec.keep_plain:
            slots[slot, 1, offset + i] = plain
    return time.process_time() - started


# ---- parent side -----------------------------------------------------------------------------
class DecodePool:
    """`processes` decode processes writing into `depth` shared slots of `batch_size` images.

    Start it once per training worker (start-up is 0.1-1 s) and close it when the worker ends;
    `submit` decodes one batch into a free slot, `view` reads a slot, `release` frees it.
    """

    def __init__(self, processes: int, batch_size: int, image_size: int, depth: int,
                 keep_plain: bool = False, start_method: str = "forkserver"):
        if processes < 1:
            raise ValueError(f"a decode pool needs at least 1 process, got {processes}")
        self.processes, self.batch_size, self.depth = processes, batch_size, max(1, depth)
        self.shape = (self.depth, 2 if keep_plain else 1, batch_size, image_size, image_size, 3)
        buffer = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, int(np.prod(self.shape)))
        self._slots = np.frombuffer(buffer, dtype=np.uint8).reshape(self.shape)
        # Each slot's encoded input bytes travel in shared memory too, as large as its decoded
        # images (a raw-encoded sample's size; a JPEG is a tenth of it). Pickled through the
        # executor's pipes, they were 64 KB writes by threads of this process, each taking the
        # GIL back from the loop: its steps ran ~15% slower beside the feed (2-core box).
        inbox = multiprocessing.sharedctypes.RawArray(ctypes.c_uint8, self.depth * batch_size * image_size ** 2 * 3)
        self._inbox = np.frombuffer(inbox, dtype=np.uint8).reshape(self.depth, -1)
        self._free = _SlotQueue(self.depth)
        started = time.perf_counter()
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # The fork server (one per process, started by the first pool) imports this module
            # once; each child is then a fork of it, not a fresh import. Each child still re-runs
            # the parent's main module (CPython 3.11's fork server drops "__main__" from its
            # preload: it keeps a 'main_path' key that get_preparation_data never sets). In a Ray
            # worker that main is Ray's worker script, so Ray is preloaded too: a child then
            # started in 0.01 s, not 0.27 (in a reused Tune actor, 2-core box).
            context.set_forkserver_preload([*_MAIN_DEPENDENCIES, __name__])
        # Children fed through pipes (stages.feed.pipe_pool), not a ProcessPoolExecutor: its queues'
        # named semaphores outlived Ray workers in /dev/shm and made tracebacks at a search's end.
        self._pool: PipePool | None = PipePool(processes, context, _child_init,
                                               (buffer, self.shape, inbox, os.getpid()))
        self.start_s = time.perf_counter() - started
        log.debug("decode pool: %d processes (%s) in %.2f s, %d slots of %d images, %.0f MiB shared",
                  processes, start_method, self.start_s, self.depth, batch_size, self._slots.nbytes / 2**20)

    def acquire(self, stop: threading.Event) -> int | None:
        """A free slot, or None once `stop` is set."""
        return self._free.get(stop)

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def submit(self, slot: int, samples: list[tuple], spec: DecodeSpec) -> list[Future]:
        """Decode `samples` into `slot`, in as few contiguous chunks as keep every process busy
        when all slots are in flight. Few, large tasks: the executor queues only a few tasks ahead
        and refills from a thread of this process, which waits for the GIL while the loop holds it;
        with small tasks the decoders ran dry (measured: 0.87 -> see benchmarks feed)."""
        if len(samples) > self.batch_size:
            raise ValueError(f"batch of {len(samples)} exceeds the pool's slot of {self.batch_size}")
        chunks = -(-self.processes // self.depth)
        chunk = max(1, -(-len(samples) // chunks))
        samples = self._to_inbox(slot, samples)
        return [self._pool.submit(_decode_chunk, slot, start, samples[start:start + chunk], spec)
                for start in range(0, len(samples), chunk)]

    def _to_inbox(self, slot: int, samples: list[tuple]) -> list[tuple]:
        """Copy each sample's bytes into `slot`'s inbox, leaving (key, label, (start, end)); a
        sample that no longer fits travels pickled, as it is."""
        inbox, at, out = self._inbox[slot], 0, []
        for sample in samples:
            image = sample[2]
            if isinstance(image, (bytes, bytearray, memoryview)) and at + len(image) <= inbox.size:
                inbox[at:at + len(image)] = np.frombuffer(image, np.uint8)
                out.append((sample[0], sample[1], (at, at + len(image))))
                at += len(image)
            else:
                out.append(sample)
        return out

    def view(self, slot: int, rows: int, plain: bool = False) -> np.ndarray:
        """The decoded images of `slot`: valid until the slot is released."""
        return self._slots[slot, 1 if plain else 0, :rows]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "DecodePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SlotQueue:
    """Free slot numbers; a blocked `get` gives up when its stop event is set."""

    def __init__(self, n: int):
        self._cond = threading.Condition()
        self._items = list(range(n))

    def get(self, stop: threading.Event) -> int | None:
        with self._cond:
            while not self._items:
                if stop.is_set():
                    return None
                self._cond.wait(0.1)
            return None if stop.is_set() else self._items.pop(0)

    def put(self, slot: int) -> None:
        with self._cond:
            self._items.append(slot)
            self._cond.notify()

