"""The model replica: decode, dynamic batching and the forward pass of one Serve deployment.

Decode runs in the replica, in a thread, at most `decode_slots(cfg)` worst cases at once, so that
concurrent small-but-huge-in-pixels uploads cannot take the replica past its memory; small photos
have a lane of their own beside them (stages.serve.decode_budget.DecodeLanes). The HTTP side (limits,
JSON errors, retries) is `stages.serve.http.Ingress`; `stages.serve.app` binds the two.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np
from ray import serve

from stages.common.config import ServeConfig
from stages.etl.images import BadImage
from stages.model import runtime
from stages.model.predict import load_model, predict_arrays, preprocess
from stages.serve.decode_budget import DECODE_BYTES_PER_PIXEL, DecodeLanes, decode_cost, quick_lane_bytes

__all__ = ["Classifier", "decode_slots", "DECODE_BYTES_PER_PIXEL", "REPLICA_BASE_MB"]

log = logging.getLogger(__name__)

# A model replica's resident memory before any decode (Python, torch, Ray worker, small model), at
# least: each replica measures its own once its model is loaded and warm (a resnet50 at 224 px in
# onnxruntime: 521 MB of its own, 701 MB RSS, in a plain process), and budgets its decodes on the rest.
REPLICA_BASE_MB = 512
# Placeholder batch settings; each replica sets the configured ones in __init__ (serve.batch
# arguments are fixed at class definition, its setters are per process, i.e. per replica).
_DEFAULT_BATCH_SIZE, _DEFAULT_BATCH_WAIT_S = 16, 0.005


def decode_slots(cfg: ServeConfig, base_mb: int = REPLICA_BASE_MB) -> int:
    """How many worst-case images (serve.max_image_pixels) one replica decodes at once: its memory
    budget (serve.replica_memory_mb less `base_mb`, what it holds before any decode) over one such
    decode, less the small images' own lane (decode_budget.DecodeLanes). Smaller images draw on
    that budget by their own size."""
    if cfg.decode_slots:
        return cfg.decode_slots
    per_decode = cfg.max_image_pixels * DECODE_BYTES_PER_PIXEL
    free = (cfg.replica_memory_mb - base_mb) * 2**20 - quick_lane_bytes(per_decode)
    return max(1, min(cfg.max_ongoing_requests, free // per_decode))


def _base_mb(cfg: ServeConfig) -> int:
    """What this replica holds now, its model loaded and warm (at least REPLICA_BASE_MB), with a
    warning when serve.replica_memory_mb leaves its decodes less than one worst-case image.

    Its own memory, not the pages of files it maps (torch's and CUDA's libraries: shared with the
    node's other processes, and not what a decode grows): RSS less psutil's `shared` on Linux."""
    import psutil

    memory = psutil.Process().memory_info()
    base = max(REPLICA_BASE_MB, (memory.rss - getattr(memory, "shared", 0)) >> 20)
    room = cfg.replica_memory_mb - base
    if not cfg.decode_slots and room * 2**20 < cfg.max_image_pixels * DECODE_BYTES_PER_PIXEL:
        log.warning("this replica holds %d MB with its model loaded; serve.replica_memory_mb=%d leaves %d MB, less "
                    "than one image of serve.max_image_pixels=%d decodes in: it decodes one at a time. Raise "
                    "serve.replica_memory_mb, or lower serve.max_image_pixels", base, cfg.replica_memory_mb,
                    max(room, 0), cfg.max_image_pixels)
    return base


def _past_request_cap(costs: list[int], cfg: ServeConfig) -> dict[str, Any] | None:
    """The error naming the first image past serve.max_request_pixels, or None. Without the cap a
    /v2 request of 64 tiny 40 MP PNGs decoded for seconds while later requests queued behind it."""
    pixels = max(cfg.max_request_pixels, cfg.max_image_pixels)  # one image never trips the request cap
    total = 0
    for index, cost in enumerate(costs):
        total += cost
        if total > pixels * DECODE_BYTES_PER_PIXEL:
            return {"error": "too_large", "index": index,
                    "detail": f"the request's images hold more than serve.max_request_pixels={pixels} px "
                              "together; split the request"}
    return None


class Classifier:
    """One model replica: loads the model once, then decodes, batches and classifies images."""

    def __init__(self, cfg: ServeConfig, model_path: str, s3: Any | None = None, weights_sha256: str | None = None):
        import torch

        self.cfg = cfg
        if cfg.torch_threads:  # else Ray's OMP_NUM_THREADS: the replica's CPUs, at least 1
            torch.set_num_threads(cfg.torch_threads)
        self.device = torch.device("cuda" if cfg.use_gpu and torch.cuda.is_available() else "cpu")
        if cfg.use_gpu and self.device.type == "cpu":  # Ray declared a GPU that torch cannot see
            log.warning("serve.use_gpu: this replica holds %g GPU but torch sees no CUDA device "
                        "(CUDA_VISIBLE_DEVICES=%s); it runs on the CPU", cfg.gpus_per_replica,
                        os.environ.get("CUDA_VISIBLE_DEVICES"))
        model, self.info = load_model(model_path, s3)
        if weights_sha256 and self.info["weights_sha256"] != weights_sha256:  # not what the app was deployed with
            raise RuntimeError(f"'{model_path}' now holds other weights ({self.info['weights_sha256'][:12]}) than "
                               f"this app was deployed with ({weights_sha256[:12]}): a restarted replica refuses "
                               "to serve a second model beside the running ones; roll the app out to the new one "
                               "with `raymill serve` again")
        # On a CPU, onnxruntime: resnet18's forward pass of one image 3.27 ms against torch's 7.40 (1
        # thread, RESULTS.md engines). Threads: serve.torch_threads, else Ray's OMP_NUM_THREADS.
        self.model = runtime.for_device(model, self.info, cfg.engine, self.device, torch.get_num_threads(),
                                        key="serve.engine")
        del model  # onnxruntime's session holds its own weights: torch's copy goes before the memory is measured
        self.formats = cfg.allowed_formats  # upper-case Pillow names (config.ImageFormats)
        self._slot = cfg.max_image_pixels * DECODE_BYTES_PER_PIXEL  # one worst-case decode
        self._in_flight = 0  # classify() calls in progress on this replica
        for batched in (self._classify_batch, self._predict_batch):
            batched.set_max_batch_size(cfg.max_batch_size)
            batched.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        # On a GPU the forward pass is the device's and decoding is the CPU work: each request
        # decodes as it arrives (decode_slots at once) and only the forward pass is batched. A batch
        # that decoded its 16 images in turn made c=32 slower with batching than without on an
        # H100 (resnet50: 71 vs 103 req/s). On a CPU both share the replica's cores (see below).
        self._decode_apart = self.device.type == "cuda"
        # Warm-up: the first forward pass pays for lazy allocator/kernel set-up; not a user's request.
        size = self.info["image_size"]
        self._predict([np.zeros((size, size, 3), np.uint8)])
        self.base_mb = _base_mb(cfg)
        self.slots = decode_slots(cfg, self.base_mb)
        self.decodes = DecodeLanes(self.slots * self._slot, self._slot)

    async def classify(self, data: bytes) -> dict[str, Any]:
        """{class_name, class_index, top_k, model_version}, or {error, detail} for unusable bytes."""
        # A request that finds the replica idle has nobody to share a batch with: it skips
        # serve.batch's queue (its hand-offs cost a lone request ~1.5 ms, c=1 on the 2-core box)
        # and runs decode + forward in one thread hop. Concurrent requests are batched as before.
        # A large image (seconds of decode) goes alone through the large lane, never into a batch
        # whose small images would wait for it (stages.serve.decode_budget).
        cost = self._cost(data)
        lone, self._in_flight = self._in_flight == 0, self._in_flight + 1
        try:
            if self.decodes.lane(cost) is self.decodes.large:
                # The forward pass runs in this thread too: a whole worst-case slot, so these keep
                # at most decode_slots forward passes (and their activations) at once.
                result = (await self.decodes.large.run(self._slot, self._decode_and_predict, [data]))[0]
            elif self.cfg.batching and not lone and self._decode_apart:
                result = await self._classify_decoded(data, cost)
            elif self.cfg.batching and not lone:
                result = await self._classify_batch((data, cost))
            else:  # a quarter of the small lane each: at most 4 unbatched forward passes at once
                result = (await self.decodes.quick.run(self.decodes.quick_max, self._decode_and_predict, [data]))[0]
        finally:
            self._in_flight -= 1
        return result if "error" in result else {**result, "model_version": self.info.get("version")}

    async def classify_many(self, images: list[bytes]) -> dict[str, Any]:
        """One request's images, answered in one forward pass: {results, model_version}, or
        {error, detail, index} naming the first unusable image (the request's fault, no answers)."""
        costs = [self._cost(data) for data in images]  # headers only: nothing decodes yet
        if (over := _past_request_cap(costs, self.cfg)) is not None:
            return over
        decoded = await asyncio.gather(*(self._decode(data, cost) for cost, data in zip(costs, images)))
        for index, (_, error) in enumerate(decoded):
            if error:
                return {**error, "index": index}
        results = await asyncio.to_thread(self._predict, [array for array, _ in decoded])
        return {"results": results, "model_version": self.info.get("version")}

    async def health(self) -> dict[str, Any]:
        """This replica's pid (a restart is visible to clients and tests) and model version."""
        return {"pid": os.getpid(), "version": self.info.get("version")}

    async def metadata(self) -> dict[str, Any]:
        """What the model expects and answers: classes, input size, architecture, version, limits."""
        info, cfg = self.info, self.cfg
        return {"classes": info["classes"], "image_size": info["image_size"],
                "architecture": info["architecture"], "version": info.get("version"),
                "batching": cfg.batching, "max_batch_size": cfg.max_batch_size,
                "allowed_formats": list(self.formats), "max_body_bytes": cfg.max_body_bytes,
                "max_image_pixels": cfg.max_image_pixels, "decode_slots": self.slots,
                "top_k": min(cfg.top_k, len(info["classes"])), "max_images": cfg.max_images_per_request,
                "device": self.device.type, "engine": runtime.engine_name(self.model)}

    async def _decode(self, data: bytes, cost: int | None = None) -> tuple[np.ndarray | None, dict[str, Any] | None]:
        """Decode off the event loop, within the replica's decode memory (stages.serve.decode_budget);
        `cost` when the caller already read it from the headers."""
        return await self.decodes.run(self._cost(data) if cost is None else cost, self._decode_now, data)

    def _cost(self, data: bytes) -> int:
        return decode_cost(data, self.formats, self.cfg.max_image_pixels, self.info["image_size"])

    def _decode_now(self, data: bytes) -> tuple[np.ndarray | None, dict[str, Any] | None]:
        """(pixels, None), or (None, {error, detail}) for bytes that are not a usable image."""
        try:
            return preprocess(data, self.info, self.formats, self.cfg.max_image_pixels), None
        except BadImage as e:
            return None, {"error": e.reason, "detail": e.detail}
        except Exception as e:  # hostile bytes can trip any decoder path; still the request's fault
            return None, {"error": "bad_image", "detail": f"the decoder failed ({type(e).__name__})"}

    @serve.batch(max_batch_size=_DEFAULT_BATCH_SIZE, batch_wait_timeout_s=_DEFAULT_BATCH_WAIT_S)
    async def _classify_batch(self, items: list[tuple[bytes, int]]) -> list[dict[str, Any]]:
        # One thread hop a batch, not one a request: the batch's decodes and its forward pass run
        # in one worker thread, so the replica's event loop keeps accepting requests. A hop per
        # request for the decode cost this replica 0.6 CPU ms a request more (4.6 vs 4.0 at 32
        # concurrent requests, 2-core box). The batch decodes one image at a time, so it holds
        # its largest image's share of the decode budget (the memory /v2 shares) while it does.
        # Each item is (bytes, cost): classify() has parsed the header already.
        return await self.decodes.run(max(cost for _, cost in items), self._decode_and_predict,
                                      [data for data, _ in items])

    async def _classify_decoded(self, data: bytes, cost: int) -> dict[str, Any]:
        array, error = await self._decode(data, cost)
        return error if error is not None else await self._predict_batch(array)

    @serve.batch(max_batch_size=_DEFAULT_BATCH_SIZE, batch_wait_timeout_s=_DEFAULT_BATCH_WAIT_S)
    async def _predict_batch(self, arrays: list[np.ndarray]) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._predict, arrays)

    def _decode_and_predict(self, images: list[bytes]) -> list[dict[str, Any]]:
        """An answer per image: its prediction, or its {error, detail}; bad images do not fail the batch."""
        decoded = [self._decode_now(data) for data in images]
        arrays = [array for array, error in decoded if error is None]
        predictions = iter(self._predict(arrays) if arrays else [])
        return [error if error is not None else next(predictions) for _, error in decoded]

    def _predict(self, arrays: list[np.ndarray]) -> list[dict[str, Any]]:
        """Blocking forward pass over a list of decoded images."""
        return predict_arrays(self.model, self.info, arrays, self.cfg.top_k, self.device)


