"""The HTTP face of the Serve app: a FastAPI ingress that checks requests and calls the model.

Endpoints (under the app's route prefix, "/" by default; OpenAPI page at /docs):
  POST /predict   raw image body (Content-Type image/jpeg|png|webp) or multipart/form-data with a
                  file field -> {class_name, class_index, top_k, model_version, latency_ms}
  GET  /healthz   {"status": "ok", "pid": a model replica's pid, "ingress_pid", "version"}
  GET  /metadata  {classes, image_size, architecture, version, ...}
  /v2/...         the Open Inference Protocol (KServe v2), N images a request: stages/serve/v2.py

Every request the app rejects gets a JSON body {"error": reason, "detail": ...} and a 4xx, or
503 when the model side fails (the detail never echoes exception text; the replica log has it),
or 503 `overloaded` with Retry-After past what the model side can hold (`admission`), answered
before the body is read. Serve's own plain-text 503 is then left for floods past 2 x SHED_ROOM.
The body limit is enforced while the bytes stream in, before any multipart parsing or decode.
The model runs in its own deployment (stages.serve.replica.Classifier); a call whose model replica dies
mid-request is retried here on another replica (prediction is idempotent), so a replica kill
costs latency, not a failed request.
"""
# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime.
import asyncio
import contextlib
import logging
import math
import os
import time
from typing import Any, Awaitable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from stages.common.config import ServeConfig
from stages.serve import draining as serve_drain
from stages.serve import v2 as serve_v2
from stages.serve.body import HTTPError, first_file, printable, read_body
from stages.serve.v2 import V2Error

__all__ = ["Ingress", "HTTPError", "admission", "running_share", "SHED_ROOM", "guarded", "guarded_v2", "within",
           "request_deadline", "IMAGE_STATUS", "MEDIA_TYPES"]

log = logging.getLogger(__name__)

# Pillow format name -> the raw-body Content-Type that announces it.
MEDIA_TYPES = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "BMP": "image/bmp",
               "GIF": "image/gif", "TIFF": "image/tiff"}
# BadImage.reason -> HTTP status; reasons not listed are 400 (the bytes are not a usable image).
IMAGE_STATUS = {"unsupported_format": 415, "decompression_bomb": 413, "too_large": 413}
# Health routes answer HEAD too, as HTTP asks of every GET route: load balancers probe with it.
_PROBE = ["GET", "HEAD"]
# A model replica that dies under a call is replaced; the retry goes to a live one meanwhile.
_MODEL_ATTEMPTS = 3
_ROUTE_ERRORS = {404: "not_found", 405: "method_not_allowed"}
# Serve's proxy times a request out from its arrival at the proxy (serve.request_timeout_s, or the
# client's x-request-timeout-seconds header, which it honours first) and then answers a plain-text
# 408. The ingress answers in JSON this much earlier (at most a quarter of the limit), as long as
# the request reached it sooner than that after the proxy took it: the router's hop is milliseconds
# unless a flood queues it.
_TIMEOUT_MARGIN_S = 1.0
_TIMEOUT_HEADER = "x-request-timeout-seconds"
_MODEL_METHODS = ("classify", "classify_many", "health", "metadata")
# Requests an ingress replica takes beyond its admission only to answer them itself with the JSON
# 503 (a coroutine each; no body is read). Serve's router queues as many more in front of it; past
# admission + 2 x SHED_ROOM Serve's proxy sheds in plain text.
SHED_ROOM = 1024
RETRY_AFTER = {"Retry-After": "1"}
_STOPPING = ("this endpoint is stopping: it answers the requests it took, and no new ones; retry (another "
             "replica of the service, or this endpoint once it is started again)")
V2_MEDIA = ("", "application/json", "application/octet-stream")  # what /v2/.../infer accepts
_V2_ROUTES = ("GET /v2, /v2/health/live, /v2/health/ready, /v2/models/{name}[/versions/{version}][/ready]; "
              "POST /v2/models/{name}[/versions/{version}]/infer")


async def guarded(work: Awaitable[JSONResponse]) -> JSONResponse:
    """Await a handler's work; every failure becomes a JSON 4xx/503, never Serve's bare 500."""
    try:
        return await work
    except HTTPError as e:
        return e.response()
    except Exception:  # a bug or a sick model: the client gets no internals, the log gets all
        log.exception("request failed inside the app")
        return HTTPError(503, "internal_error", "the server failed on this request; retry later").response()


async def guarded_v2(work: Awaitable[Response]) -> Response:
    """`guarded` for the /v2 routes: failures become the protocol's `{"error": "..."}` body."""
    try:
        return await work
    except V2Error as e:
        return JSONResponse({"error": printable(e.message)}, e.status)
    except HTTPError as e:  # the shared checks (body size, model failure) in the protocol's shape
        return JSONResponse({"error": printable(f"{e.error}: {e.detail}")}, e.status, e.headers)
    except Exception:
        log.exception("v2 request failed inside the app")
        return JSONResponse({"error": "the server failed on this request; retry later"}, 503)


# No redirect from "/predict/" to "/predict": Starlette's 307 names the client's own Host header
# and carries no body; a wrong path gets the JSON 404 that lists the routes, as every other does.
app = FastAPI(title="raymill", description="Image classification (see README, 'Serving')", redirect_slashes=False)


def _is_v2(request: Request) -> bool:
    return "v2" in request.url.path.split("/")


@app.exception_handler(StarletteHTTPException)
async def _route_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown paths and methods: FastAPI's own 404/405 (with Allow), in the app's JSON shape, or
    # under /v2 in the protocol's, which is all a v2 client (tritonclient) reads.
    where = f"{request.method} {request.url.path}: {exc.detail}"
    if _is_v2(request):
        return JSONResponse({"error": f"{where}; this server's Open Inference Protocol routes: {_V2_ROUTES}"},
                            exc.status_code, exc.headers)
    error = _ROUTE_ERRORS.get(exc.status_code, "http_error")
    return HTTPError(exc.status_code, error, f"{where}; try POST /predict, GET /healthz, GET /metadata, GET /docs, "
                     f"or the Open Inference Protocol: {_V2_ROUTES}", exc.headers).response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    if _is_v2(request):
        return JSONResponse({"error": str(exc.errors())[:300]}, 400)
    return HTTPError(400, "bad_request", str(exc.errors())[:300]).response()


def request_deadline(headers: Any, default_s: Optional[float]) -> Optional[float]:
    """The ingress's deadline for this request: `default_s` (serve.request_timeout_s), or the
    client's header when it is a finite number > 0 that shortens it. Serve's proxy honours any
    value (0, NaN or 1e9: no limit), so a client had turned the server's timeout off; the ingress
    keeps it, and answers in JSON."""
    try:
        seconds = float(headers.get(_TIMEOUT_HEADER, "nan"))
    except ValueError:
        return default_s
    if not (seconds > 0 and math.isfinite(seconds)):
        return default_s
    return seconds if default_s is None else min(seconds, default_s)


async def within(work: Awaitable[Response], request: Request, default_s: Optional[float]) -> Response:
    """`work`, or the JSON answer to a request past its deadline, before Serve's proxy gives its
    plain-text 408: 408 `request_timeout` while the body is still arriving (the client is slow),
    504 `model_timeout` with Retry-After once it has (the model side is)."""
    limit = request_deadline(request.headers, default_s)
    if limit is None or not math.isfinite(limit):
        return await work
    try:
        return await asyncio.wait_for(work, limit - min(_TIMEOUT_MARGIN_S, limit / 4))
    except TimeoutError:
        if getattr(request.state, "body_read", False):
            raise HTTPError(504, "model_timeout", f"the model did not answer within this request's {limit:g} s "
                            f"(serve.request_timeout_s or the {_TIMEOUT_HEADER} header); retry later",
                            RETRY_AFTER) from None
        # the rest of its body may still come: the connection is closed after the answer (RFC 9110)
        raise HTTPError(408, "request_timeout", f"the request body did not arrive within this request's {limit:g} s "
                        f"(serve.request_timeout_s or the {_TIMEOUT_HEADER} header)", {"Connection": "close"}) from None


class _Local:
    """A model method in this process, called like a DeploymentHandle method: `.remote(...)`."""

    def __init__(self, method: Any):
        self.remote = method


def running_share(cfg: ServeConfig) -> int:
    """One ingress replica's share of the requests the model replicas run at once."""
    replicas = cfg.max_replicas if cfg.autoscaling else cfg.num_replicas
    return -(-replicas * cfg.max_ongoing_requests // cfg.ingress_replicas)


def _media_type(request: Request) -> str:
    """The request's Content-Type without its parameters, lower-case; "" when none is named."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def admission(cfg: ServeConfig) -> Optional[int]:
    """Image requests one ingress replica holds at once: its running share, which read their bodies
    and call the model, plus serve.max_queued_requests waiting for one of those places, with no body
    read yet (as they had waited in Serve's queue). None: unbounded (serve.max_queued_requests=-1)
    or the model in the ingress (Serve's proxy sheds)."""
    if cfg.max_queued_requests < 0 or not cfg.model_deployment:
        return None
    return running_share(cfg) + cfg.max_queued_requests


@serve.deployment
@serve.ingress(app)
class Ingress:
    """One ingress replica: HTTP checks here, decode and forward pass in the model deployment."""

    def __init__(self, model: Any, cfg: ServeConfig, model_path: Optional[str] = None, s3: Any = None,
                 weights_sha256: Optional[str] = None):
        self.cfg = cfg
        # in_flight: image requests taken (admitted, queued or running), not yet answered
        self.admission, self.in_flight, self.draining = admission(cfg), 0, False
        # Bodies this replica reads at once: its running share (Serve's proxy buffers every passed-on one)
        self.running = asyncio.Semaphore(running_share(cfg))
        if model is None:  # serve.model_deployment=false: the model lives in this replica (one hop less)
            # Imported here, not at the top: with a model deployment the ingress replica never
            # runs the model, and torch (through the replica) took its RSS from 213 to 396 MB.
            from stages.serve.replica import Classifier

            local = Classifier(cfg, model_path, s3, weights_sha256)
            self.model = {name: _Local(getattr(local, name)) for name in _MODEL_METHODS}
        else:  # one handle per model method, made once (each attribute access builds a new handle)
            self.model = {name: getattr(model, name) for name in _MODEL_METHODS}
        # upper-case Pillow names already (config.ImageFormats), as MEDIA_TYPES keys them
        self.media_types = {MEDIA_TYPES[f] for f in cfg.allowed_formats if f in MEDIA_TYPES}
        # Serve calls this inside the replica's event loop: the task lives as long as the replica
        self._drain_watch = asyncio.get_running_loop().create_task(serve_drain.follow(cfg.app_name, self))

    @app.post("/predict", summary="Classify one image (raw body or multipart file)")
    async def predict(self, request: Request) -> JSONResponse:
        return await guarded(within(self._predict(request), request, self.cfg.request_timeout_s))

    @app.api_route("/healthz", methods=_PROBE, summary="Liveness, with a model replica's pid and the model version")
    async def healthz(self) -> JSONResponse:
        async def work() -> JSONResponse:
            if self.draining:  # load balancers take a stopping endpoint out of rotation
                raise HTTPError(503, "shutting_down", _STOPPING, RETRY_AFTER)
            health = await self._call("health")
            return JSONResponse({"status": "ok", **health, "ingress_pid": os.getpid()})
        return await guarded(work())

    @app.get("/metadata", summary="Classes, input size, architecture, version, limits")
    async def metadata(self) -> JSONResponse:
        async def work() -> JSONResponse:
            return JSONResponse(await self._call("metadata"))
        return await guarded(work())

    @app.get("/v2", summary="Open Inference Protocol: server metadata")
    async def v2_server(self) -> JSONResponse:
        from importlib.metadata import version  # cheap, and only this route needs it

        return JSONResponse(serve_v2.server_metadata(version("raymill")))

    @app.api_route("/v2/health/live", methods=_PROBE, summary="Open Inference Protocol: the server is live")
    async def v2_live(self) -> JSONResponse:
        return JSONResponse({"live": True})

    @app.api_route("/v2/health/ready", methods=_PROBE, summary="Open Inference Protocol: a model replica answers")
    async def v2_ready(self) -> Response:
        return await guarded_v2(self._v2_ready(self.cfg.model_name))

    @app.api_route("/v2/models/{name}/ready", methods=_PROBE, summary="Open Inference Protocol: the model is ready")
    async def v2_model_ready(self, name: str) -> Response:
        return await guarded_v2(self._v2_ready(name))

    @app.get("/v2/models/{name}", summary="Open Inference Protocol: model metadata")
    async def v2_model(self, name: str) -> Response:
        return await guarded_v2(self._v2_metadata(name, None))

    @app.post("/v2/models/{name}/infer", summary="Open Inference Protocol: classify N images")
    async def v2_infer(self, name: str, request: Request) -> Response:
        return await guarded_v2(within(self._v2_infer(name, None, request), request, self.cfg.request_timeout_s))

    # The same three with the version that the model metadata lists (`versions`), as the protocol
    # allows and tritonclient sends when a caller passes model_version.
    @app.get("/v2/models/{name}/versions/{version}", summary="Open Inference Protocol: model version metadata")
    async def v2_model_version(self, name: str, version: str) -> Response:
        return await guarded_v2(self._v2_metadata(name, version))

    @app.api_route("/v2/models/{name}/versions/{version}/ready", methods=_PROBE,
                   summary="Open Inference Protocol: the version is ready")
    async def v2_version_ready(self, name: str, version: str) -> Response:
        return await guarded_v2(self._v2_ready(name, version))

    @app.post("/v2/models/{name}/versions/{version}/infer", summary="Open Inference Protocol: infer on a version")
    async def v2_version_infer(self, name: str, version: str, request: Request) -> Response:
        return await guarded_v2(within(self._v2_infer(name, version, request), request,
                                       self.cfg.request_timeout_s))

    async def _v2_model(self, name: str, version: Optional[str]) -> None:
        """Refuse (404) a model name, or a version, that this server does not serve."""
        if name != self.cfg.model_name:
            raise V2Error(404, f"unknown model '{name}'; this server serves '{self.cfg.model_name}'")
        if version is not None:
            served = str((await self._call("health"))["version"] or "")
            if version != served:
                raise V2Error(404, f"model '{name}' has no version '{version}'; this server serves "
                                   f"version '{served}' (GET /v2/models/{name} lists it)")

    async def _v2_metadata(self, name: str, version: Optional[str]) -> JSONResponse:
        await self._v2_model(name, version)
        return JSONResponse(serve_v2.model_metadata(name, await self._call("metadata")))

    async def _v2_ready(self, name: str, version: Optional[str] = None) -> JSONResponse:
        if self.draining:
            raise V2Error(503, f"shutting_down: {_STOPPING}")
        await self._v2_model(name, version)
        if version is None:  # else _v2_model has asked a model replica already
            await self._call("health")
        return JSONResponse({"name": name, "ready": True})

    async def _v2_infer(self, name: str, version: Optional[str], request: Request) -> Response:
        await self._v2_model(name, version)  # before reading the body: a wrong name costs no upload
        # JSON, the binary extension's bytes, or none named (tritonclient names none). Not a browser
        # form's or text/plain, which a page on another site may POST here without asking (/predict
        # refuses them too)
        media = _media_type(request)
        if media not in V2_MEDIA:
            raise V2Error(415, f"unsupported_media_type: Content-Type '{media}'; send application/json, or "
                               "application/octet-stream with the binary extension's Inference-Header-Content-Length")
        async with self._admitted():
            return await self._v2_answer(name, request)

    async def _v2_answer(self, name: str, request: Request) -> Response:
        body = await read_body(request, self.cfg.max_body_bytes)
        parsed = serve_v2.parse_infer(body, request.headers.get(serve_v2.HEADER), self.cfg.max_images_per_request)
        answer = await self._call("classify_many", parsed.images)
        if "error" in answer:  # the model replica judged one image's bytes
            raise V2Error(IMAGE_STATUS.get(answer["error"], 400),
                          f"input '{serve_v2.INPUT}' element {answer['index']}: {answer['error']}: {answer['detail']}")
        content, headers = serve_v2.encode_infer(answer["results"], parsed, name, str(answer["model_version"] or ""))
        return Response(content, 200, headers)

    @contextlib.asynccontextmanager
    async def _admitted(self):
        """A place among the requests the model side can hold, or the JSON 503 before the body is
        read. Serve's router had shed a flood in plain text (381 of 400, 2 cores; README, Serving).
        Once the endpoint drains, the JSON 503 `shutting_down`, the connection closed after it."""
        if self.draining:
            raise HTTPError(503, "shutting_down", _STOPPING, {**RETRY_AFTER, "Connection": "close"})
        if self.admission is not None and self.in_flight >= self.admission:
            raise HTTPError(503, "overloaded", f"{self.in_flight} requests are in progress, as many as the model "
                            f"replicas and their queue hold (serve.max_ongoing_requests, serve.max_queued_requests); "
                            f"retry later", RETRY_AFTER)
        self.in_flight += 1
        try:
            if self.admission is None:
                yield
            else:
                async with self.running:  # queued requests wait here, their bodies unread
                    yield
        finally:
            self.in_flight -= 1

    async def _predict(self, request: Request) -> JSONResponse:
        async with self._admitted():
            return await self._predict_admitted(request)

    async def _predict_admitted(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        result = await self._call("classify", await self._image_bytes(request))
        if "error" in result:  # the model replica judged the bytes: not an image it accepts
            raise HTTPError(IMAGE_STATUS.get(result["error"], 400), result["error"], result["detail"])
        result["latency_ms"] = round((time.perf_counter() - started) * 1000, 2)
        return JSONResponse(result)

    async def _image_bytes(self, request: Request) -> bytes:
        """The image's bytes from a raw body or the first file of a multipart form."""
        media = _media_type(request)
        if media == "multipart/form-data":
            return await first_file(await read_body(request, self.cfg.max_body_bytes), request)
        if media in self.media_types:
            return await read_body(request, self.cfg.max_body_bytes)
        accepted = ", ".join(sorted(self.media_types) + ["multipart/form-data"])
        raise HTTPError(415, "unsupported_media_type", f"Content-Type '{media or '(none)'}'; send one of: {accepted}")

    async def _call(self, method: str, *args: Any) -> Any:
        """A model-deployment call, retried on another replica when the one it reached died."""
        for attempt in range(1, _MODEL_ATTEMPTS + 1):
            try:
                return await self.model[method].remote(*args)
            except BackPressureError:  # the handle's queue is full (another ingress replica's share ran over)
                raise HTTPError(503, "overloaded", "the model replicas' queue is full "
                                "(serve.max_queued_requests); retry later", RETRY_AFTER) from None
            except (RayActorError, ActorUnavailableError) as e:
                if attempt == _MODEL_ATTEMPTS:
                    raise
                log.warning("model replica lost during %s (%s); retrying on another replica (attempt %d)",
                            method, type(e).__name__, attempt + 1)
                await asyncio.sleep(0.05 * attempt)
            except Exception:  # the model side raised: the replica is unwell, not the request
                log.exception("model call %s failed", method)
                raise HTTPError(503, "model_error", "the model failed on this request; retry later") from None
