"""A model replica's decode memory as a byte budget that each decode draws on by its own size.

`serve.decode_slots` counts worst-case images (`serve.max_image_pixels`, 40 M px: 640 MB of
decode at most). Counting every decode as a worst case held a /v2 request's images on an H100
node to 2 decodes at once: 448 images/s at 32 images a request with the GPU about 10% busy
(benchmarks/RESULTS.md, serve_gpu), while a 500x375 photo needs 0.5% of a slot. So each decode
now reserves its own header's pixels x DECODE_BYTES_PER_PIXEL from the same budget (slots x the
worst case), and the replica still never decodes more than that budget at once. Reservations
are granted in arrival order, so a large image is never overtaken forever by small ones.

Small images have a lane of their own (`DecodeLanes`): a decode of at most 1/16 of a worst case
(2.5 M px at the defaults) draws on a separate budget of 1/4 of one. In one shared queue, 20
uploads of a 120 KB, 36 M px PNG (1.3 s of decode each, legal under the limits) held 30 small
photos sent beside them until Serve's 10 s timeout: every one got 408 (2-core box). Neither lane
can take the other's memory, so neither waits on the other; the replica's budget counts both.
"""
from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, TypeVar

from stages.etl.images import open_image
from stages.etl.pixels import draft

__all__ = ["DecodeBudget", "DecodeLanes", "DECODE_BYTES_PER_PIXEL", "decode_cost", "quick_lane_bytes"]

T = TypeVar("T")

# Peak decode memory per source pixel: a 20 KB 4-megapixel PNG peaked at ~61 MB in Pillow
# (decode buffer, RGB copy, resize source): ~15 B/px, rounded up.
DECODE_BYTES_PER_PIXEL = 16


def quick_lane_bytes(worst_case: int) -> int:
    """The small images' lane: a quarter of one worst-case decode (`worst_case` bytes)."""
    return worst_case // 4


def decode_cost(data: bytes, allowed_formats: tuple[str, ...], max_pixels: int, size: int | None = None) -> int:
    """Bytes a decode of `data` can take at its peak, from its header alone. Bytes whose header
    does not parse cost nothing: their decode fails at the same parse, before any pixel. With the
    model's `size`, a JPEG costs what its draft decode holds (stages.etl.pixels.draft: 1/8 of each
    side for a 12 MP photo and a 224 px model), not its full size."""
    try:
        img = open_image(data, allowed_formats, max_pixels)
        if size:
            draft(img, size)  # the decode's own rule, so the cost is what it will hold
        width, height = img.size
    except Exception:  # BadImage, or a header that parses but whose draft fails: the decode fails the same way
        return 0
    return width * height * DECODE_BYTES_PER_PIXEL


class DecodeBudget:
    """At most `capacity` bytes of decodes at once, first come first served, on one event loop.
    A single decode larger than the budget runs alone."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.used = 0
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    @asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        nbytes = min(max(0, nbytes), self.capacity)
        ticket = asyncio.get_running_loop().create_future()
        self._waiting.append((nbytes, ticket))
        self._grant()
        try:
            await ticket
        except asyncio.CancelledError:  # the request went away while it waited
            if ticket.done() and not ticket.cancelled():  # granted as it was cancelled: give it back
                self.used -= nbytes
            self._grant()
            raise
        try:
            yield
        finally:
            self.used -= nbytes
            self._grant()

    def _grant(self) -> None:
        while self._waiting:
            nbytes, ticket = self._waiting[0]
            if ticket.cancelled():
                self._waiting.popleft()
                continue
            if self.used + nbytes > self.capacity:
                return  # the head waits for room; nobody behind it jumps the queue
            self._waiting.popleft()
            self.used += nbytes
            ticket.set_result(None)

    async def run(self, nbytes: int, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in a worker thread within `nbytes` of the budget, held until the thread ends.
        Serve cancels a request whose client went away, but its thread decodes on: releasing at
        the cancel would let clients that post huge images and hang up take the replica past its
        memory, one worker thread at a time."""
        async with self.reserve(nbytes):
            work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                while not work.done():  # a second cancel must not free what the thread still uses
                    try:
                        await asyncio.wait([work])
                    except asyncio.CancelledError:
                        pass
                raise


class DecodeLanes:
    """Two budgets: `quick` for images of at most 1/16 of a worst-case decode, `large` (`capacity`
    bytes, as before) for the rest. `lane(nbytes)` picks the one a decode of that size uses."""

    def __init__(self, capacity: int, worst_case: int):
        self.large = DecodeBudget(capacity)
        self.quick = DecodeBudget(quick_lane_bytes(worst_case))
        self.quick_max = max(1, worst_case // 16)

    def lane(self, nbytes: int) -> DecodeBudget:
        return self.quick if nbytes <= self.quick_max else self.large

    async def run(self, nbytes: int, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` within `nbytes` of the lane that size belongs to (DecodeBudget.run)."""
        return await self.lane(nbytes).run(nbytes, fn, *args)
