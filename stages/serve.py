"""Online serving: a Ray Serve app that classifies one image per /predict request, or N per
Open Inference Protocol request (/v2/models/<serve.model_name>/infer, stages/serve_v2.py).

Two deployments in one app: `Ingress` (stages/serve_http.py: FastAPI, limits, JSON errors, retry
on a lost model replica) and `Classifier` here (decode, dynamic batching, forward pass). Decode
runs in the model replica, in a thread, at most `decode_slots(cfg)` at once, so that concurrent
small-but-huge-in-pixels uploads cannot take the replica past its memory.

Serve's proxy answers a few cases itself with a plain-text body: 503 past max_queued_requests and
408 past request_timeout_s. Note: the proxy honours a client's `x-request-timeout-seconds` header
over request_timeout_s (0 disables it), so put a reverse proxy that strips it in front when the
timeout is a protection, not just a default.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import numpy as np
from ray import serve

from stages.decode_budget import DECODE_BYTES_PER_PIXEL, DecodeBudget, decode_cost
from stages.serve_endpoint import base_url
from stages.images import BadImage
from stages.predict import load_model, predict_arrays, preprocess
from workflow.core import cluster, session
from workflow.core.config import ConfigError, RayConfig, ServeConfig

__all__ = ["start", "update", "shutdown", "build_app", "deployment_options", "base_url", "Classifier",
           "decode_slots", "ingress_env", "apply_ingress_env", "DECODE_BYTES_PER_PIXEL", "REPLICA_BASE_MB"]

log = logging.getLogger(__name__)

# A model replica's resident memory before any decode (Python, torch, Ray worker, small model).
REPLICA_BASE_MB = 512
# Placeholder batch settings; each replica sets the configured ones in __init__ (serve.batch
# arguments are fixed at class definition, its setters are per process, i.e. per replica).
_DEFAULT_BATCH_SIZE, _DEFAULT_BATCH_WAIT_S = 16, 0.005
# Longest wait for other work to free room for a replica before `start` refuses the plan.
ROOM_WAIT_S = 30.0
SHUTDOWN_WAIT_S = 30.0  # how long stopping `raymill serve` waits for the app's replicas to go


def decode_slots(cfg: ServeConfig) -> int:
    """How many worst-case images (serve.max_image_pixels) one replica decodes at once: its memory
    budget over one such decode. Smaller images draw on that budget by their own size."""
    if cfg.decode_slots:
        return cfg.decode_slots
    per_decode = cfg.max_image_pixels * DECODE_BYTES_PER_PIXEL
    free = (cfg.replica_memory_mb - REPLICA_BASE_MB) * 2**20
    return max(1, min(cfg.max_ongoing_requests, free // per_decode))


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

    def __init__(self, cfg: ServeConfig, model_path: str, s3: Any | None = None):
        import torch

        self.cfg = cfg
        self.device = torch.device("cuda" if cfg.use_gpu and torch.cuda.is_available() else "cpu")
        if cfg.use_gpu and self.device.type == "cpu":  # Ray declared a GPU that torch cannot see
            log.warning("serve.use_gpu: this replica holds %g GPU but torch sees no CUDA device "
                        "(CUDA_VISIBLE_DEVICES=%s); it runs on the CPU", cfg.gpus_per_replica,
                        os.environ.get("CUDA_VISIBLE_DEVICES"))
        model, self.info = load_model(model_path, s3)
        self.model = model.to(self.device)
        self.formats = cfg.allowed_formats  # upper-case Pillow names (config.ImageFormats)
        self._slot = cfg.max_image_pixels * DECODE_BYTES_PER_PIXEL  # one worst-case decode
        self.decodes = DecodeBudget(decode_slots(cfg) * self._slot)
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

    async def classify(self, data: bytes) -> dict[str, Any]:
        """{class_name, class_index, top_k, model_version}, or {error, detail} for unusable bytes."""
        # A request that finds the replica idle has nobody to share a batch with: it skips
        # serve.batch's queue (its hand-offs cost a lone request ~1.5 ms, c=1 on the 2-core box)
        # and runs decode + forward in one thread hop. Concurrent requests are batched as before.
        lone, self._in_flight = self._in_flight == 0, self._in_flight + 1
        try:
            if self.cfg.batching and not lone:
                result = await (self._classify_decoded(data) if self._decode_apart else self._classify_batch(data))
            else:
                # The forward pass runs in this thread too: a whole worst-case slot, so unbatched
                # requests keep at most decode_slots forward passes (and their activations) at once.
                result = (await self.decodes.run(self._slot, self._decode_and_predict, [data]))[0]
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
                "max_image_pixels": cfg.max_image_pixels, "decode_slots": decode_slots(cfg),
                "top_k": min(cfg.top_k, len(info["classes"])), "max_images": cfg.max_images_per_request,
                "device": self.device.type}

    async def _decode(self, data: bytes, cost: int | None = None) -> tuple[np.ndarray | None, dict[str, Any] | None]:
        """Decode off the event loop, within the replica's decode memory (stages.decode_budget);
        `cost` when the caller already read it from the headers."""
        return await self.decodes.run(self._cost(data) if cost is None else cost, self._decode_now, data)

    def _cost(self, data: bytes) -> int:
        return decode_cost(data, self.formats, self.cfg.max_image_pixels)

    def _decode_now(self, data: bytes) -> tuple[np.ndarray | None, dict[str, Any] | None]:
        """(pixels, None), or (None, {error, detail}) for bytes that are not a usable image."""
        try:
            return preprocess(data, self.info, self.formats, self.cfg.max_image_pixels), None
        except BadImage as e:
            return None, {"error": e.reason, "detail": e.detail}
        except Exception as e:  # hostile bytes can trip any decoder path; still the request's fault
            return None, {"error": "bad_image", "detail": f"the decoder failed ({type(e).__name__})"}

    @serve.batch(max_batch_size=_DEFAULT_BATCH_SIZE, batch_wait_timeout_s=_DEFAULT_BATCH_WAIT_S)
    async def _classify_batch(self, images: list[bytes]) -> list[dict[str, Any]]:
        # One thread hop a batch, not one a request: the batch's decodes and its forward pass run
        # in one worker thread, so the replica's event loop keeps accepting requests. A hop per
        # request for the decode cost this replica 0.6 CPU ms a request more (4.6 vs 4.0 at 32
        # concurrent requests, 2-core box). The batch decodes one image at a time, so it holds
        # its largest image's share of the decode budget (the memory /v2 shares) while it does.
        return await self.decodes.run(max(self._cost(data) for data in images), self._decode_and_predict, images)

    async def _classify_decoded(self, data: bytes) -> dict[str, Any]:
        array, error = await self._decode(data)
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


def deployment_options(cfg: ServeConfig, plan: session.ServePlan | None = None) -> dict[str, Any]:
    """The model deployment's options: replicas or autoscaling, overload limits, resources.

    `plan` (session.plan_serve) may turn the rollout surge off where it can never be scheduled.
    """
    gpus = cfg.gpus_per_replica if cfg.use_gpu else 0
    options: dict[str, Any] = {
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "max_queued_requests": cfg.max_queued_requests,  # past it callers get 503
        # old replicas serve until replacements are up (0: replaced in place, see session.plan_serve)
        "max_surge_percent": cfg.max_surge_percent if plan is None else plan.max_surge_percent,
        # A killed replica is noticed at the next health check (default every 10 s): check often,
        # so the replacement starts within seconds (the ingress retries calls meanwhile).
        "health_check_period_s": 2.0,
        "logging_config": {"enable_access_log": cfg.access_log},
        "ray_actor_options": {"num_cpus": cfg.cpus_per_replica, "num_gpus": gpus,
                              "memory": cfg.replica_memory_mb * 2**20},
    }
    if cfg.autoscaling:
        if cfg.min_replicas > cfg.max_replicas:
            raise ConfigError(f"serve.min_replicas={cfg.min_replicas} exceeds serve.max_replicas="
                              f"{cfg.max_replicas}; set min_replicas <= max_replicas")
        options["autoscaling_config"] = {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas}
    else:
        options["num_replicas"] = cfg.num_replicas
    return options


def build_app(cfg: ServeConfig, model_path: str, s3: Any | None = None, plan: session.ServePlan | None = None):
    """The bound Serve application (not yet running): ingress -> model deployment, or one
    deployment holding both when serve.model_deployment is false."""
    from stages.serve_http import Ingress  # serve_http imports Classifier from here: not at the top

    if not cfg.model_deployment:
        return Ingress.options(**deployment_options(cfg, plan)).bind(None, cfg, model_path, s3)
    model = serve.deployment(Classifier).options(**deployment_options(cfg, plan)).bind(cfg, model_path, s3)
    ingress = Ingress.options(num_replicas=cfg.ingress_replicas, max_queued_requests=cfg.max_queued_requests,
                              max_ongoing_requests=cfg.max_ongoing_requests,
                              max_surge_percent=cfg.max_surge_percent,
                              logging_config={"enable_access_log": cfg.access_log},
                              ray_actor_options={"num_cpus": cfg.ingress_cpus})
    return ingress.bind(model, cfg)


def ingress_env(cfg: ServeConfig) -> dict[str, str]:
    """Environment Serve reads once at start-up for `serve.ingress`; set it before ray.init.

    "throughput_optimized" is Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED=1 bundle (gRPC proxy->replica,
    direct ingress on 127.0.0.1, user code on the replica's loop). gRPC's default 4 MB message
    cap is raised past max_body_bytes so a body the app accepts always reaches it.
    """
    if cfg.ingress == "proxy":
        return {}
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(cfg.max_body_bytes + 2**20)}


def apply_ingress_env(cfg: ServeConfig) -> None:
    """Export ingress_env(cfg) for a Ray this process is about to start (not for one running)."""
    import ray

    env = ingress_env(cfg)
    if ray.is_initialized() and any(os.environ.get(k) != v for k, v in env.items()):
        log.warning("serve.ingress=%s needs %s before Ray starts; Ray is already running, so the "
                    "running ingress mode stays", cfg.ingress, env)
    os.environ.update(env)


def start(cfg: ServeConfig, model_path: str, *, s3: Any | None = None, route_prefix: str = "/",
          wait_for_room_s: float = ROOM_WAIT_S) -> str:
    """Deploy the classifier as Serve app `cfg.app_name` and return its base URL.

    Starts Ray (defaults: local) if the caller hasn't. host, port and request_timeout_s are per
    Ray cluster: Serve keeps the first values it started with. When the app is already running,
    this is a rolling update to `model_path` (see `update`). A plan that the nodes could never
    hold is refused at once; one that other work leaves no room for, after `wait_for_room_s`.
    """
    import ray

    if not ray.is_initialized():
        apply_ingress_env(cfg)
        session.start(RayConfig())
    plan = _plan_with_room(cfg, wait_for_room_s)
    if plan.warning:
        log.warning("serve: %s", plan.warning)
    serve.start(http_options={"host": cfg.host, "port": cfg.port, "request_timeout_s": cfg.request_timeout_s})
    serve.run(build_app(cfg, model_path, s3, plan), name=cfg.app_name, route_prefix=route_prefix)
    url = base_url(cfg) + route_prefix.rstrip("/")
    log.info("serve: app '%s' at %s (POST /predict, GET /healthz, GET /metadata, GET /docs; Open Inference "
             "Protocol: POST /v2/models/%s/infer)", cfg.app_name, url, cfg.model_name)
    return url


def _plan_with_room(cfg: ServeConfig, wait_s: float) -> session.ServePlan:
    """The serve plan on what is free now beside other apps, trainers and trials, waited for up
    to `wait_s` (an app deleted a moment ago, or a run ending, frees its share within seconds).
    Only on a Ray this process started (its dashboard, no autoscaler): on a joined cluster the
    autoscaler may add the room, so the plan is made on the nodes' totals, as Ray sees them."""
    if session.dashboard_url() is None:
        return session.plan_serve(cfg, cluster.node_resources())
    deadline, never_checked = time.monotonic() + wait_s, True
    while True:
        nodes, held = cluster.free_node_resources(own_app=cfg.app_name)
        try:
            return session.plan_serve(cfg, nodes, held)
        except ConfigError:
            if not held or time.monotonic() >= deadline:  # nothing else holds room: it never fits
                raise
        if never_checked:  # what the nodes could never hold is refused at once, not waited for
            session.plan_serve(cfg, cluster.node_resources())
            never_checked = False
        time.sleep(1.0)


def update(cfg: ServeConfig, model_path: str, *, s3: Any | None = None, route_prefix: str = "/") -> str:
    """Roll a running app to `model_path` with no failed request (Serve's rolling update).

    With serve.max_surge_percent (default 100) Serve starts the replacement replicas first, then
    drains the old ones (each finishes its in-flight requests), so the app never has fewer
    replicas than configured; the surge needs that much spare CPU, GPU and memory for the rollout.
    Where it can never fit (session.plan_serve), replicas are replaced in place, with a warning.
    """
    return start(cfg, model_path, s3=s3, route_prefix=route_prefix)


def shutdown(cfg: ServeConfig, wait_s: float = SHUTDOWN_WAIT_S) -> None:
    """Delete the app; Serve itself (proxy, controller) keeps running for other apps.

    `serve.delete` asks the controller at once, then polls until the replicas are gone. A replica
    that drains slowly (a loaded node) must not keep Ctrl-C or SIGTERM from ending the process, so
    the poll is bounded: past `wait_s` the controller goes on deleting without this process.
    """
    from ray.serve.exceptions import RayServeException

    done = threading.Event()

    def delete() -> None:
        try:
            serve.delete(cfg.app_name)
        except RayServeException:  # Serve isn't running: nothing to delete
            pass
        except Exception:  # logged: this runs on the way out, after the caller's own error if any
            log.exception("serve: deleting app %r failed", cfg.app_name)
        finally:
            done.set()

    threading.Thread(target=delete, name="raymill-serve-delete", daemon=True).start()
    if not done.wait(wait_s):
        log.warning("serve: app %r is still stopping after %.0f s; Serve's controller finishes deleting it",
                    cfg.app_name, wait_s)
