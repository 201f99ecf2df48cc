"""Online serving: a Ray Serve app that classifies one image per HTTP request.

Endpoints (under the app's route prefix, "/" by default):
  POST /predict   raw image body (Content-Type image/jpeg|png|webp) or multipart/form-data
                  with a file field -> {class_name, class_index, top_k, model_version, latency_ms}
  GET  /healthz   {"status": "ok", "pid": replica pid, "version": model version}
  GET  /metadata  {classes, image_size, architecture, version}

Every request the app rejects gets a JSON body {"error": reason, "detail": ...} and a 4xx
(or 503 when the model itself fails); the app never answers 500. Serve's proxy answers a few
cases itself with a plain-text body: 503 past max_queued_requests, 408 past request_timeout_s,
and 500 when a replica dies under an in-flight request. Note: the proxy honours a client's
`x-request-timeout-seconds` header over request_timeout_s (0 disables it), so put a reverse
proxy that strips it in front when the timeout is a protection, not just a default.
"""
from __future__ import annotations

import asyncio
import email
import email.message
import email.utils
import logging
import os
import time
from typing import Any, Awaitable, Callable

import numpy as np
from ray import serve
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from workflow.config import ConfigError, ServeConfig

__all__ = ["start", "shutdown", "build_app", "deployment_options", "base_url", "Classifier",
           "HTTPError", "read_body", "first_file", "IMAGE_STATUS", "MEDIA_TYPES"]

log = logging.getLogger(__name__)

# Pillow format name -> the raw-body Content-Type that announces it.
MEDIA_TYPES = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "BMP": "image/bmp",
               "GIF": "image/gif", "TIFF": "image/tiff"}

# BadImage.reason -> HTTP status; reasons not listed are 400 (the bytes are not a usable image).
IMAGE_STATUS = {"unsupported_format": 415, "decompression_bomb": 413, "too_large": 413}

# Placeholder batch settings; each replica sets the configured ones in __init__ (serve.batch
# arguments are fixed at class definition, its setters are per process, i.e. per replica).
_DEFAULT_BATCH_SIZE, _DEFAULT_BATCH_WAIT_S = 16, 0.005


class HTTPError(Exception):
    """A request the app rejects: becomes `{"error": error, "detail": detail}` with `status`."""

    def __init__(self, status: int, error: str, detail: str = "", headers: dict[str, str] | None = None):
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail, self.headers = status, error, detail, headers

    def response(self) -> JSONResponse:
        """The JSON error response for this rejection."""
        return JSONResponse({"error": self.error, "detail": self.detail}, self.status, self.headers)


class Classifier:
    """One Serve replica: loads the model once, then decodes, batches and classifies requests."""

    def __init__(self, cfg: ServeConfig, model_path: str, s3: Any | None = None):
        import torch

        from stages.export import load_model

        self.cfg = cfg
        self.device = torch.device("cuda" if cfg.use_gpu else "cpu")
        model, self.info = load_model(model_path, s3)
        self.model = model.to(self.device)
        self.formats = tuple(f.upper() for f in cfg.allowed_formats)
        self.media_types = {MEDIA_TYPES[f] for f in self.formats if f in MEDIA_TYPES}
        self._predict_batch.set_max_batch_size(cfg.max_batch_size)
        self._predict_batch.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        self.routes: dict[str, dict[str, Callable[[Request], Awaitable[Response]]]] = {
            "/predict": {"POST": self.predict}, "/healthz": {"GET": self.healthz},
            "/metadata": {"GET": self.metadata}}
        # Warm-up: the first forward pass pays for lazy allocator/kernel set-up; not a user's request.
        size = self.info["image_size"]
        self._predict([np.zeros((size, size, 3), np.uint8)])

    async def __call__(self, request: Request) -> Response:
        """Serve's HTTP entry point: route, and turn every failure into a JSON 4xx/503."""
        try:
            return await self._route(request)(request)
        except HTTPError as e:
            return e.response()
        except Exception as e:  # last resort: a bug here must not turn into Serve's bare 500
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            return HTTPError(503, "internal_error", f"{type(e).__name__}: {e}").response()

    def _route(self, request: Request) -> Callable[[Request], Awaitable[Response]]:
        path = _app_path(request)
        methods = self.routes.get(path)
        if methods is None:
            raise HTTPError(404, "not_found", f"no endpoint {path}; try POST /predict, GET /healthz, "
                                              "GET /metadata")
        if request.method not in methods:
            allowed = ", ".join(methods)
            raise HTTPError(405, "method_not_allowed", f"{request.method} {path}; allowed: {allowed}",
                            {"Allow": allowed})
        return methods[request.method]

    async def healthz(self, request: Request) -> Response:
        """Liveness, with the replica's pid so a restart is visible to clients and tests."""
        return JSONResponse({"status": "ok", "pid": os.getpid(), "version": self.info.get("version")})

    async def metadata(self, request: Request) -> Response:
        """What the model expects and answers: classes, input size, architecture, version."""
        info = self.info
        return JSONResponse({"classes": info["classes"], "image_size": info["image_size"],
                             "architecture": info["architecture"], "version": info.get("version"),
                             "batching": self.cfg.batching, "max_batch_size": self.cfg.max_batch_size,
                             "allowed_formats": list(self.formats)})

    async def predict(self, request: Request) -> Response:
        """Classify one image; latency_ms is time spent in this replica (not the proxy)."""
        started = time.perf_counter()
        data = await self._image_bytes(request)
        array = await self._preprocess(data)
        result = await self._infer(array)
        return JSONResponse({**result, "model_version": self.info.get("version"),
                             "latency_ms": round((time.perf_counter() - started) * 1000, 2)})

    async def _image_bytes(self, request: Request) -> bytes:
        """The image's bytes from a raw body or the first file of a multipart form."""
        content_type = request.headers.get("content-type", "")
        media = content_type.split(";", 1)[0].strip().lower()
        if media == "multipart/form-data":
            return first_file(await read_body(request, self.cfg.max_body_bytes), content_type)
        if media in self.media_types:
            return await read_body(request, self.cfg.max_body_bytes)
        accepted = ", ".join(sorted(self.media_types) + ["multipart/form-data"])
        raise HTTPError(415, "unsupported_media_type",
                        f"Content-Type '{media or '(none)'}'; send one of: {accepted}")

    async def _preprocess(self, data: bytes) -> np.ndarray:
        """Decode per request, off the event loop, so a bad image fails only its own request."""
        from stages.export import preprocess
        from stages.images import BadImage

        try:
            return await asyncio.to_thread(preprocess, data, self.info, self.formats,
                                           self.cfg.max_image_pixels)
        except BadImage as e:
            raise HTTPError(IMAGE_STATUS.get(e.reason, 400), e.reason, e.detail) from None
        except Exception as e:  # hostile bytes can trip any decoder path; still the request's fault
            raise HTTPError(400, "bad_image", f"{type(e).__name__}: {e}") from None

    async def _infer(self, array: np.ndarray) -> dict[str, Any]:
        """One image's prediction, through the batch queue when batching is on."""
        try:
            if self.cfg.batching:
                return await self._predict_batch(array)
            return (await asyncio.to_thread(self._predict, [array]))[0]
        except Exception as e:  # the replica is unwell, not the request: 503 invites a retry
            log.exception("model failed")
            raise HTTPError(503, "model_error", f"{type(e).__name__}: {e}") from None

    @serve.batch(max_batch_size=_DEFAULT_BATCH_SIZE, batch_wait_timeout_s=_DEFAULT_BATCH_WAIT_S)
    async def _predict_batch(self, arrays: list[np.ndarray]) -> list[dict[str, Any]]:
        # The forward pass runs in a thread so the replica keeps accepting and decoding requests.
        return await asyncio.to_thread(self._predict, arrays)

    def _predict(self, arrays: list[np.ndarray]) -> list[dict[str, Any]]:
        """Blocking forward pass over a list of decoded images."""
        from stages.export import predict_arrays

        return predict_arrays(self.model, self.info, arrays, self.cfg.top_k, self.device)


def _app_path(request: Request) -> str:
    """The request path below the app's route prefix, without a trailing slash."""
    path, root = request.scope.get("path", "/"), request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return "/" + path.strip("/")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes.

    Content-Length is checked first (cheap), then bytes are counted as they stream in, because
    a chunked upload has no Content-Length and Serve's proxy enforces no size limit of its own.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise HTTPError(400, "bad_content_length", f"Content-Length '{declared}' is not a number")
        if int(declared) > limit:
            raise HTTPError(413, "too_large", f"Content-Length {int(declared)} exceeds {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, "too_large", f"body exceeds {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise HTTPError(400, "client_disconnected", "the body ended early") from None
    return b"".join(chunks)


def first_file(body: bytes, content_type: str) -> bytes:
    """Content of the first file part of a multipart/form-data body (RFC 7578).

    Parsed here rather than with python-multipart (not installed) and after the size-checked
    read, so a form can't bypass max_body_bytes. A part is a file when it has a filename or an
    image/* Content-Type; the field name doesn't matter.
    """
    try:
        return _first_file(body, content_type)
    except HTTPError:
        raise
    except Exception as e:  # whatever a hostile form trips in the parser is the form's fault
        raise HTTPError(400, "malformed_multipart", f"{type(e).__name__}: {e}") from None


def _first_file(body: bytes, content_type: str) -> bytes:
    """first_file's parser: may raise anything on hostile input; first_file maps that to 400."""
    boundary = _header_param(content_type, "content-type", "boundary")
    if not boundary:
        raise HTTPError(400, "malformed_multipart", "multipart/form-data without a boundary parameter")
    delimiter = b"--" + boundary.encode("latin-1")
    start, end = body.find(delimiter), body.find(b"\r\n" + delimiter + b"--")
    if start < 0 or end < start:
        raise HTTPError(400, "malformed_multipart", "opening or closing boundary not found")
    for part in body[start + len(delimiter):end].split(b"\r\n" + delimiter):
        head, sep, content = part.partition(b"\r\n\r\n")
        if not sep:
            raise HTTPError(400, "malformed_multipart", "a part has no header block")
        headers = email.message_from_bytes(head.strip() + b"\r\n\r\n")
        if headers.get_filename() is not None or headers.get_content_type().startswith("image/"):
            return content
    raise HTTPError(400, "missing_file", "no file part in the form; send the image as a file field")


def _header_param(value: str, header: str, param: str) -> str | None:
    """A parameter of a header value (quoted or RFC 2231 encoded), e.g. a multipart boundary."""
    msg = email.message.Message()
    msg[header] = value
    found = msg.get_param(param, header=header)
    return email.utils.collapse_rfc2231_value(found) if found else None


def deployment_options(cfg: ServeConfig) -> dict[str, Any]:
    """Serve deployment options for `cfg`: replicas or autoscaling, overload limits, resources."""
    options: dict[str, Any] = {
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "max_queued_requests": cfg.max_queued_requests,  # past it the proxy answers 503
        "ray_actor_options": {"num_cpus": cfg.cpus_per_replica, "num_gpus": 1 if cfg.use_gpu else 0},
    }
    if cfg.autoscaling:
        if cfg.min_replicas > cfg.max_replicas:
            raise ConfigError(f"serve.min_replicas={cfg.min_replicas} exceeds serve.max_replicas="
                              f"{cfg.max_replicas}; set min_replicas <= max_replicas")
        options["autoscaling_config"] = {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas}
    else:
        options["num_replicas"] = cfg.num_replicas
    return options


def build_app(cfg: ServeConfig, model_path: str, s3: Any | None = None):
    """The bound Serve application (not yet running)."""
    return serve.deployment(Classifier).options(**deployment_options(cfg)).bind(cfg, model_path, s3)


def base_url(cfg: ServeConfig) -> str:
    """The URL a local client uses; a wildcard bind address is reached through loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(cfg.host, cfg.host)
    return f"http://{host}:{cfg.port}"


def start(cfg: ServeConfig, model_path: str, *, s3: Any | None = None, blocking: bool = False,
          route_prefix: str = "/") -> str:
    """Deploy the classifier as Serve app `cfg.app_name` and return its base URL.

    Starts Ray (defaults: local, dashboard off) if the caller hasn't. host, port and
    request_timeout_s are per Ray cluster: Serve keeps the first values it started with and
    logs a warning when later ones differ. With `blocking`, serves until Ctrl-C, then deletes the app.
    """
    import ray

    if not ray.is_initialized():
        from workflow import session
        from workflow.config import RayConfig

        session.start(RayConfig())
    serve.start(http_options={"host": cfg.host, "port": cfg.port, "request_timeout_s": cfg.request_timeout_s})
    serve.run(build_app(cfg, model_path, s3), name=cfg.app_name, route_prefix=route_prefix)
    url = base_url(cfg) + route_prefix.rstrip("/")
    log.info("serve: app '%s' at %s (POST /predict, GET /healthz, GET /metadata)", cfg.app_name, url)
    if blocking:
        try:
            while True:
                time.sleep(3600)
        finally:
            shutdown(cfg)
    return url


def shutdown(cfg: ServeConfig) -> None:
    """Delete the app; Serve itself (proxy, controller) keeps running for other apps."""
    from ray.serve.exceptions import RayServeException

    try:
        serve.delete(cfg.app_name)
    except RayServeException:  # Serve isn't running: nothing to delete
        pass
