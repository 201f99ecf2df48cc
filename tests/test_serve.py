"""Online serving over real HTTP: good requests, hostile input, overload, a burst of
pixel-heavy uploads. (Replica kill and rolling update: tests/test_serve_rollout.py.)

One Serve app (the main one) serves most tests; a second, tiny-capacity app on the same proxy
is used for the overload burst. No training: the model is an untrained small_cnn saved here.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from stages.serve import app as serve_stage
from stages.serve import http as serve_http
from stages.serve import replica as serve_replica
from tests.conftest import bomb_png, free_port, image_bytes, many_scans_jpeg
# The /v2 (Open Inference Protocol) tests run here, against this module's served app: no second Serve start.
from tests.serve_v2_cases import *  # noqa: F401,F403
from stages.common.config import ServeConfig

CLASSES = ["bird", "cat", "dog"]
MAX_BODY = 200_000
JPEG = {"content-type": "image/jpeg"}


def _save_model(out, version: str) -> str:
    from stages.model.publish import save_model
    from stages.model.zoo import build_model

    info = {"architecture": "small_cnn", "width": 8, "dropout": 0.0, "classes": CLASSES, "image_size": 32,
            "resize": "crop", "mean": [0.5] * 3, "std": [0.25] * 3, "version": version}
    save_model(str(out), build_model("small_cnn", 3, width=8).state_dict(), info)
    return str(out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _save_model(tmp_path_factory.mktemp("model"), "test-1")


@pytest.fixture(scope="module")
def app(ray_session, model_dir):
    """The main app: (config, base URL, replica pid at start). Serve is shut down afterwards."""
    from ray import serve

    # 5 MP at most, 768 MB per replica: (768 - 512) MB / (5 MP x 16 B) = 3 concurrent decodes (the
    # replica's own memory, measured at its start, is less than 512 MB: small_cnn).
    cfg = ServeConfig(port=free_port(), app_name="test-serve", max_body_bytes=MAX_BODY,
                      max_image_pixels=5_000_000, max_request_pixels=12_000_000, replica_memory_mb=768,
                      request_timeout_s=30.0)
    url = serve_stage.start(cfg, model_dir)
    pid = httpx.get(f"{url}/healthz").json()["pid"]
    yield cfg, url, pid
    serve.shutdown()


@pytest.fixture
def client(app):
    with httpx.Client(base_url=app[1], timeout=30) as c:
        yield c


def _image(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(buf, format=fmt)
    return buf.getvalue()


def _multipart(boundary: str, parts: list[tuple[str, bytes]]) -> bytes:
    """A hand-built multipart body; `parts` are (header lines, content)."""
    body = b"".join(f"--{boundary}\r\n{head}\r\n\r\n".encode() + data + b"\r\n" for head, data in parts)
    return body + f"--{boundary}--\r\n".encode()


def _check_prediction(body: dict) -> None:
    assert body["class_name"] in CLASSES and body["class_name"] == CLASSES[body["class_index"]]
    assert len(body["top_k"]) == 3 and body["top_k"][0]["class_index"] == body["class_index"]
    assert abs(sum(k["probability"] for k in body["top_k"]) - 1) < 1e-4
    assert body["model_version"] == "test-1" and body["latency_ms"] > 0


# --- pure helpers (no Serve) ------------------------------------------------------------------

def test_decode_budget_admits_decodes_by_size_in_arrival_order():
    """Small images decode many at once; a large one waits its turn and is not overtaken; one
    over the budget runs alone; a request cancelled while it waits leaves the budget whole."""
    from stages.serve.decode_budget import DECODE_BYTES_PER_PIXEL, DecodeBudget, decode_cost

    assert decode_cost(image_bytes(1), ("JPEG",), 10**6) == 80 * 60 * DECODE_BYTES_PER_PIXEL
    assert decode_cost(b"not an image", ("JPEG",), 10**6) == 0  # fails at the header, before pixels
    photo = image_bytes(4, size=(4000, 3000))  # a 12 MP JPEG decodes at 1/8 of each side for a 224 px model
    assert decode_cost(photo, ("JPEG",), 10**8, 224) == 500 * 375 * DECODE_BYTES_PER_PIXEL
    assert decode_cost(photo, ("JPEG",), 10**8) == 4000 * 3000 * DECODE_BYTES_PER_PIXEL  # no size: in full

    async def scenario() -> tuple[list[str], int, DecodeBudget]:
        budget, order, held = DecodeBudget(100), [], []

        async def decode(name: str, nbytes: int, hold_s: float = 0.02) -> None:
            async with budget.reserve(nbytes):
                order.append(name)
                held.append(budget.used)
                await asyncio.sleep(hold_s)

        small = [asyncio.create_task(decode(f"s{i}", 10)) for i in range(10)]
        await asyncio.sleep(0)
        big, late = asyncio.create_task(decode("big", 95)), asyncio.create_task(decode("late", 10))
        await asyncio.gather(*small, big, late)
        await decode("huge", 10_000)  # over the budget: alone
        blocker = asyncio.create_task(decode("blocker", 100, hold_s=0.2))
        await asyncio.sleep(0.01)
        waiter = asyncio.create_task(decode("waiter", 50))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return order, max(held), budget

    order, peak, budget = asyncio.run(scenario())
    assert order[:10] == [f"s{i}" for i in range(10)] and order[10:] == ["big", "late", "huge", "blocker"]
    assert peak == 100 and budget.used == 0


def test_small_images_have_a_lane_that_large_ones_never_block():
    """Decodes of at most 1/16 of a worst case use their own budget (a quarter of one): a small
    image sent behind a queue of large ones decodes at once, and large ones keep their order."""
    from stages.serve.decode_budget import DecodeLanes

    async def scenario() -> list[str]:
        lanes, order = DecodeLanes(capacity=2 * 640, worst_case=640), []
        assert (lanes.quick_max, lanes.quick.capacity) == (40, 160)

        async def decode(name: str, nbytes: int) -> None:
            async with lanes.lane(nbytes).reserve(nbytes):
                order.append(name)
                await asyncio.sleep(0.05 if nbytes > 40 else 0.001)

        large = [asyncio.create_task(decode(f"L{i}", 640)) for i in range(4)]  # 2 at a time
        await asyncio.sleep(0.01)
        await asyncio.gather(*[decode(f"s{i}", 40) for i in range(6)], *large)  # 4 small at a time
        return order

    order = asyncio.run(scenario())
    assert order.index("s5") < order.index("L2"), order  # every small one before the third large one
    assert [n for n in order if n.startswith("L")] == ["L0", "L1", "L2", "L3"]


def test_a_cancelled_decode_holds_its_budget_until_its_thread_ends():
    """A client that hangs up cancels its request, not the thread decoding its image: the budget
    stays taken until the thread is done, so hung-up uploads cannot pile decodes past the memory."""
    from stages.serve.decode_budget import DecodeBudget

    async def scenario() -> list[int]:
        budget, seen = DecodeBudget(100), []
        request = asyncio.create_task(budget.run(80, time.sleep, 0.3))
        await asyncio.sleep(0.05)
        request.cancel()
        await asyncio.sleep(0.05)
        seen.append(budget.used)  # cancelled, but its thread still sleeps
        with pytest.raises(asyncio.CancelledError):
            await request
        seen.append(budget.used)
        return seen

    assert asyncio.run(scenario()) == [80, 0]



def test_deployment_options_and_decode_slots():
    from stages.common.config import ConfigError

    fixed = serve_stage.deployment_options(ServeConfig(num_replicas=3, max_queued_requests=5))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_queued_requests"] == 5
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0, "memory": 2048 * 2**20}
    assert fixed["logging_config"] == {"enable_access_log": True}
    assert serve_stage.deployment_options(ServeConfig(access_log=False))["logging_config"] == {"enable_access_log": False}
    scaled = serve_stage.deployment_options(ServeConfig(autoscaling=True, min_replicas=1, max_replicas=4,
                                                        use_gpu=True))
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4}
    assert "num_replicas" not in scaled and scaled["ray_actor_options"]["num_gpus"] == 1
    with pytest.raises(ConfigError, match="min_replicas"):
        serve_stage.deployment_options(ServeConfig(autoscaling=True, min_replicas=3, max_replicas=2))
    assert serve_stage.base_url(ServeConfig(host="0.0.0.0", port=9)) == "http://127.0.0.1:9"
    # what one ingress replica lets through: its share of the replicas' running requests + its queue
    assert serve_http.admission(ServeConfig(num_replicas=3, max_ongoing_requests=4, max_queued_requests=5)) == 17
    assert serve_http.admission(ServeConfig(autoscaling=True, max_replicas=4, max_ongoing_requests=3,
                                            max_queued_requests=1, ingress_replicas=5)) == 4  # ceil(12 / 5) + 1
    assert serve_http.admission(ServeConfig(max_queued_requests=-1)) is None
    assert serve_http.admission(ServeConfig(model_deployment=False)) is None
    # defaults: (2048 - 512) MB over 40 MP x 16 B per decode -> 2; never below 1; explicit wins
    assert serve_replica.decode_slots(ServeConfig()) == 2
    assert serve_replica.decode_slots(ServeConfig(replica_memory_mb=256)) == 1
    assert serve_replica.decode_slots(ServeConfig(decode_slots=5)) == 5
    # a replica whose model holds more (measured at its start): (2048 - 1200) MB over 640 MB -> 1
    assert serve_replica.decode_slots(ServeConfig(), base_mb=1200) == 1
    assert serve_stage.ingress_env(ServeConfig()) == {}
    to = serve_stage.ingress_env(ServeConfig(ingress="throughput_optimized", max_body_bytes=10 * 2**20))
    assert to["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert int(to["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) > 10 * 2**20


def test_a_replica_decodes_apart_from_its_batches_only_on_a_cuda_device(model_dir, caplog):
    """The GPU batching path (decode per request, batch the forward pass) is chosen by the
    replica's device: serve.use_gpu on a machine where torch sees no CUDA device stays on the
    CPU path. tests/gpu runs the other side on a GPU."""
    import torch

    cpu = serve_replica.Classifier(ServeConfig(), model_dir)
    # The decode budget is what serve.replica_memory_mb leaves beside what the replica holds, measured
    # at its start: here with an 800 MB ballast in it (a big model's weights, as it were), past REPLICA_BASE_MB.
    ballast = np.ones(800 * 2**20, np.uint8)
    cfg = ServeConfig(replica_memory_mb=8192, max_image_pixels=16_000_000)  # 256 MB a worst-case decode
    heavy = serve_replica.Classifier(cfg, model_dir)
    assert heavy.base_mb > 800 > serve_replica.REPLICA_BASE_MB  # the process's own memory, the ballast in it
    assert heavy.slots == serve_replica.decode_slots(cfg, heavy.base_mb) < serve_replica.decode_slots(cfg) < 32
    with caplog.at_level(logging.WARNING, logger="stages.serve.replica"):
        tight = serve_replica.Classifier(ServeConfig(replica_memory_mb=heavy.base_mb + 100), model_dir)
    del ballast
    assert tight.slots == 1 and "Raise serve.replica_memory_mb" in caplog.text
    gpu_asked = serve_replica.Classifier(ServeConfig(use_gpu=True), model_dir)
    assert cpu.device.type == "cpu" and not cpu._decode_apart
    assert gpu_asked._decode_apart == torch.cuda.is_available() == (gpu_asked.device.type == "cuda")
    threads = torch.get_num_threads()  # serve.torch_threads: the replica's process, here this one
    try:
        serve_replica.Classifier(ServeConfig(torch_threads=threads + 1), model_dir)
        assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)


def test_a_replica_serves_only_the_weights_its_app_was_deployed_with(model_dir):
    """A replica Serve restarts after a republish had served the new model beside the old one."""
    deployed = json.loads((Path(model_dir) / "model.json").read_text())["weights_sha256"]
    assert serve_replica.Classifier(ServeConfig(), model_dir, None, deployed).info["weights_sha256"] == deployed
    with pytest.raises(RuntimeError, match="other weights .* than this app was deployed with"):
        serve_replica.Classifier(ServeConfig(), model_dir, None, "f" * 64)


def test_failures_inside_the_app_are_never_500_and_leak_nothing(model_dir, monkeypatch):
    """Bad bytes -> an error result; a failing handler -> 503 whose body holds no exception text."""
    replica = serve_replica.Classifier(ServeConfig(batching=False), model_dir)
    ok = asyncio.run(replica.classify(image_bytes(1)))
    assert ok["class_name"] in CLASSES and ok["model_version"] == "test-1"
    assert asyncio.run(replica.classify(b"not an image"))["error"] == "not_an_image"
    with monkeypatch.context() as m:
        m.setattr("stages.serve.replica.preprocess", lambda *a: [][1])
        assert asyncio.run(replica.classify(image_bytes(1)))["error"] == "bad_image"

    async def secret_failure():
        raise RuntimeError("secret-path /etc/raymill/token")

    r = asyncio.run(serve_http.guarded(secret_failure()))
    assert r.status_code == 503 and b"secret" not in r.body
    assert json.loads(r.body)["error"] == "internal_error"


# --- good requests ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["jpeg", "png", "bmp", "multipart", "multipart-png-any-field"])
def test_predict_ok(client, kind):
    if kind == "jpeg":
        r = client.post("/predict", content=image_bytes(1), headers=JPEG)
    elif kind == "png":
        r = client.post("/predict", content=image_bytes(2, fmt="png"), headers={"content-type": "image/png"})
    elif kind == "bmp":  # ETL trains on BMP files by default, so serve takes them too
        r = client.post("/predict", content=_image("BMP"), headers={"content-type": "image/bmp"})
    elif kind == "multipart":
        r = client.post("/predict", files={"file": ("x.jpg", image_bytes(3), "image/jpeg")})
    else:  # a text field first, the file under an arbitrary name
        r = client.post("/predict", data={"note": "hi"}, files={"upload": ("x.png", image_bytes(4, fmt="png"))})
    assert r.status_code == 200, r.text
    _check_prediction(r.json())


def _gzip(data: bytes) -> bytes:
    pack = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    return pack.compress(data) + pack.flush()


def test_same_image_same_answer_raw_multipart_and_compressed(client):
    data = image_bytes(5)
    raw = client.post("/predict", content=data, headers=JPEG).json()
    form = client.post("/predict", files={"f": ("a.jpg", data, "image/jpeg")}).json()
    assert raw["top_k"] == form["top_k"]
    two_members = _gzip(data[:100]) + _gzip(data[100:])  # RFC 1952: one body, several members
    for encoding, body in (("gzip", _gzip(data)), ("deflate", zlib.compress(data)), ("gzip", two_members),
                           ("deflate, gzip", _gzip(zlib.compress(data))), ("gzip, identity", _gzip(data))):
        r = client.post("/predict", content=body, headers={**JPEG, "content-encoding": encoding})
        assert r.status_code == 200 and r.json()["top_k"] == raw["top_k"], (encoding, r.text)
    # two Content-Encoding lines are the list "gzip, gzip" (RFC 9110), not the first line alone
    r = client.post("/predict", content=_gzip(_gzip(data)),
                    headers=[*JPEG.items(), ("content-encoding", "gzip"), ("content-encoding", "gzip")])
    assert r.status_code == 200 and r.json()["top_k"] == raw["top_k"], r.text


def test_healthz_and_metadata(client, app):
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["pid"] == app[2]
    for path in ("/healthz", "/v2/health/live", "/v2/health/ready", "/v2/models/raymill/ready"):
        head = client.head(path)  # what a load balancer's probe sends: the GET's status, no body
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)
    meta = client.get("/metadata").json()
    assert meta["classes"] == CLASSES and meta["image_size"] == 32
    assert meta["architecture"] == "small_cnn" and meta["version"] == "test-1"
    assert meta["engine"] == "onnxruntime"  # serve.engine=auto on a CPU: not a silent fall back to torch


def test_concurrent_requests_are_batched_correctly(app):
    """Concurrent requests share batches; each still gets its own image's answer."""
    images = [image_bytes(100 + i) for i in range(12)]
    with httpx.Client(base_url=app[1], timeout=30) as c:
        alone = [c.post("/predict", content=img, headers=JPEG).json()["top_k"] for img in images]

    async def together():
        async with httpx.AsyncClient(base_url=app[1], timeout=30) as ac:
            return await asyncio.gather(*[ac.post("/predict", content=img, headers=JPEG) for img in images])

    for single, r in zip(alone, asyncio.run(together())):
        assert r.status_code == 200
        assert [k["class_index"] for k in r.json()["top_k"]] == [k["class_index"] for k in single]


# --- hostile input ---------------------------------------------------------------------------

_good = image_bytes(9, size=(200, 150))
_boundary = "raymillboundary"
_form = f"multipart/form-data; boundary={_boundary}"
BAD = {
    # id: (request kwargs, status, error)
    "empty": (dict(content=b"", headers=JPEG), 400, "empty_file"),
    "not-an-image": (dict(content=b"hello, not a photo\n" * 50, headers={"content-type": "image/png"}),
                     400, "not_an_image"),
    "truncated-jpeg": (dict(content=_good[: len(_good) // 2], headers=JPEG), 400, "truncated"),
    "tiff-bytes": (dict(content=_image("TIFF"), headers=JPEG), 415, "unsupported_format"),
    "gif-bytes": (dict(content=_image("GIF"), headers={"content-type": "image/png"}), 415,
                  "unsupported_format"),
    "gif-content-type": (dict(content=_image("GIF"), headers={"content-type": "image/gif"}), 415,
                         "unsupported_media_type"),
    "text-plain": (dict(content=_good, headers={"content-type": "text/plain"}), 415,
                   "unsupported_media_type"),
    "json": (dict(json={"image": "base64..."}), 415, "unsupported_media_type"),
    "no-content-type": (dict(content=_good), 415, "unsupported_media_type"),
    "multipart-no-boundary": (dict(content=b"--x\r\n\r\nabc\r\n--x--\r\n",
                                   headers={"content-type": "multipart/form-data"}), 400, "malformed_multipart"),
    "multipart-unterminated": (dict(content=f"--{_boundary}\r\nContent-Disposition: form-data; name=a; "
                                    f"filename=a.jpg\r\n\r\n".encode() + _good, headers={"content-type": _form}),
                               400, "missing_file"),  # python-multipart drops an unfinished part
    "multipart-garbage": (dict(content=b"\x00\x01garbage" * 100, headers={"content-type": _form}),
                          400, "malformed_multipart"),
    "multipart-no-file": (dict(content=_multipart(_boundary, [('Content-Disposition: form-data; name="a"', b"1")]),
                               headers={"content-type": _form}), 400, "missing_file"),
    "multipart-tiff": (dict(files={"f": ("a.tif", _image("TIFF"), "image/tiff")}), 415, "unsupported_format"),
    "multipart-bomb": (dict(files={"f": ("b.png", bomb_png(), "image/png")}), 413, "decompression_bomb"),
    "too-large": (dict(content=os.urandom(MAX_BODY + 1), headers=JPEG), 413, "too_large"),
    # chunked transfer: no Content-Length, so only counting streamed bytes catches it
    "too-large-chunked": (dict(headers=JPEG), 413, "too_large"),  # body added per run: iterators are single-use
    "multipart-too-large": (dict(files={"f": ("a.jpg", os.urandom(MAX_BODY), "image/jpeg")}), 413, "too_large"),
    "bomb": (dict(content=bomb_png(), headers={"content-type": "image/png"}), 413, "decompression_bomb"),
    "multipart-five-files": (dict(files=[("f", (f"{i}.jpg", _good, "image/jpeg")) for i in range(5)]), 400,
                             "too_many_files"),
    # a second image was dropped without a word (one answer, 200)
    "multipart-two-files": (dict(files=[("file", ("a.jpg", _good, "image/jpeg")), ("file", ("b.jpg", _good, "image/jpeg"))]),
                            400, "too_many_files"),
    "gzip-bomb": (dict(content=_gzip(bytes(MAX_BODY * 50)), headers={**JPEG, "content-encoding": "gzip"}), 413,
                  "too_large"),  # 10 MB of zeros in a 10 KB body: refused as it inflates, not after
    "gzip-corrupt": (dict(content=_gzip(_good)[:-40], headers={**JPEG, "content-encoding": "gzip"}), 400,
                     "bad_content_encoding"),
    "brotli": (dict(content=_good, headers={**JPEG, "content-encoding": "br"}), 415, "unsupported_content_encoding"),
    "gzip-then-brotli": (dict(content=_good, headers={**JPEG, "content-encoding": "gzip, br"}), 415,
                         "unsupported_content_encoding"),
    "nested-gzip-bomb": (dict(content=_gzip(_gzip(bytes(MAX_BODY * 50))),
                              headers={**JPEG, "content-encoding": "gzip, gzip"}), 413, "too_large"),
    "gzip-then-junk": (dict(content=_gzip(_good) + b"junk", headers={**JPEG, "content-encoding": "gzip"}), 400,
                       "bad_content_encoding"),
    # 200x150 px, 130 scans: decode time grows with each (a 36 MP one of 2,000 took 24 s)
    "jpeg-many-scans": (dict(content=many_scans_jpeg(), headers=JPEG), 413, "decompression_bomb"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_request(client, name):
    kwargs, status, error = BAD[name]
    if name == "too-large-chunked":
        kwargs = {**kwargs, "content": iter([os.urandom(50_000)] * 5)}
    r = client.post("/predict", **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["error"] == error and "detail" in body
    assert body["detail"] != "HTTPException", "the parser's reason was lost"


@pytest.mark.parametrize("method,path,status,error", [
    ("GET", "/nowhere", 404, "not_found"),
    ("POST", "/predict/extra", 404, "not_found"),
    ("POST", "/predict/", 404, "not_found"),  # not a 307 to the client's own Host header
    ("GET", "/predict", 405, "method_not_allowed"),
    ("PUT", "/predict", 405, "method_not_allowed"),
    ("POST", "/healthz", 405, "method_not_allowed"),
    ("DELETE", "/metadata", 405, "method_not_allowed"),
])
def test_unknown_route_and_method(client, method, path, status, error):
    r = client.request(method, path)
    assert r.status_code == status and r.json()["error"] == error
    assert "POST /predict" in r.json()["detail"] and "/v2/models/{name}" in r.json()["detail"]  # every route
    if status == 405:
        assert r.headers["allow"]


def test_replica_survives_bad_requests(client, app):
    """After every hostile request above, the same replica process still answers correctly."""
    assert client.get("/healthz").json()["pid"] == app[2]
    r = client.post("/predict", content=image_bytes(11), headers=JPEG)
    assert r.status_code == 200
    _check_prediction(r.json())


def test_request_timeout_under_the_ingress_margin_is_408_from_proxy(client):
    """A limit of 1 ms (Serve's per-request header, which any client can send) runs out before the
    request reaches the ingress: Serve's proxy answers it, 408 with a text body."""
    r = client.post("/predict", content=image_bytes(12), headers={**JPEG, "x-request-timeout-seconds": "0.001"})
    assert r.status_code == 408 and "timed out" in r.text


def test_a_clients_deadline_header_can_shorten_the_servers_timeout_never_lift_it():
    assert serve_http.request_deadline({}, 10.0) == 10.0
    assert serve_http.request_deadline({"x-request-timeout-seconds": "2.5"}, 10.0) == 2.5
    assert serve_http.request_deadline({"x-request-timeout-seconds": "2.5"}, None) == 2.5
    for lifted in ("abc", "0", "-1", "nan", "inf", "100000"):  # Serve's proxy would wait without end
        assert serve_http.request_deadline({"x-request-timeout-seconds": lifted}, 10.0) == 10.0


def test_a_deadline_is_408_while_the_body_arrives_and_504_after():
    """`within` on real asyncio: a request slower than its limit gets the JSON answer a quarter of
    the limit early (before the proxy's plain text), 408 or 504 by where the time went."""
    from starlette.requests import Request

    def request() -> Request:
        return Request({"type": "http", "method": "POST", "path": "/predict",
                        "headers": [(b"x-request-timeout-seconds", b"0.4")]})

    async def answer(req: Request):
        started = time.perf_counter()
        response = await serve_http.guarded(serve_http.within(asyncio.sleep(5), req, 30.0))
        return response, time.perf_counter() - started

    slow_client, waited = asyncio.run(answer(request()))
    assert slow_client.status_code == 408 and json.loads(slow_client.body)["error"] == "request_timeout"
    assert 0.25 < waited < 0.4, waited
    read = request()
    read.state.body_read = True
    slow_model, _ = asyncio.run(answer(read))
    assert slow_model.status_code == 504 and slow_model.headers["retry-after"] == "1"
    assert json.loads(slow_model.body)["error"] == "model_timeout"


def test_a_slow_upload_gets_the_json_408_before_the_proxy_times_it_out(app):
    """A client that announces 5,000 bytes and sends 100: the ingress answers JSON 408 at 1.5 s of
    its 2 s limit; Serve's proxy would have answered plain text at 2 s."""
    import socket

    host, port = app[1].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        started = time.perf_counter()
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: test\r\nContent-Type: image/jpeg\r\n"
                     b"Content-Length: 5000\r\nx-request-timeout-seconds: 2\r\n\r\n" + image_bytes(1)[:100])
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        waited = time.perf_counter() - started
        closed = sock.recv(65536) == b""  # the unread rest of its body may still come: closed after the 408
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"application/json" in head.lower() and json.loads(body)["error"] == "request_timeout", reply
    assert waited < 2.0, waited
    assert b"connection: close" in head.lower() and closed, head


# --- overload and failure --------------------------------------------------------------------

def test_overload_sheds_with_503_never_500(app, model_dir):
    """200 concurrent requests at a deployment that holds 1 running + 2 queued: the rest get the
    app's JSON 503, answered by the ingress (admission 3) before their bodies are read."""
    cfg = ServeConfig(port=app[0].port, app_name="test-overload", batching=False, max_ongoing_requests=1,
                      max_queued_requests=2, cpus_per_replica=0.25)
    url = serve_stage.start(cfg, model_dir, route_prefix="/overload")

    async def burst():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as ac:
            return await asyncio.gather(*[ac.post("/predict", content=image_bytes(i % 7), headers=JPEG)
                                          for i in range(200)])

    try:
        answers = asyncio.run(burst())
    finally:
        serve_stage.shutdown(cfg)
    codes = Counter(r.status_code for r in answers)
    assert codes[200] >= 1 and codes[503] > 0, codes
    assert set(codes) <= {200, 503}, codes
    # every 503 is the app's JSON with Retry-After, not Serve's plain-text backpressure answer
    plain = [(r.headers, r.text) for r in answers if r.status_code == 503 and not (
        r.headers.get("content-type") == "application/json" and r.json()["error"] == "overloaded"
        and r.headers.get("retry-after") == "1")]
    assert not plain, (len(plain), plain[:2])


def _big_png(seed: int) -> bytes:
    """~20 KB on the wire, 4 megapixels once decoded."""
    buf = io.BytesIO()
    Image.new("RGB", (2000, 2000), (seed % 256, 80, 160)).save(buf, format="PNG")
    return buf.getvalue()


def test_pixel_heavy_burst_is_bounded_by_decode_slots(app):
    """32 small bodies of 4 MP each at once: every answer 200 or 503, the same replica process
    survives, and its memory stays inside serve.replica_memory_mb (3 decodes at a time)."""
    import psutil

    _, url, pid = app
    bodies = [_big_png(i) for i in range(32)]
    assert max(len(b) for b in bodies) < 100_000
    assert httpx.get(f"{url}/metadata", timeout=30).json()["decode_slots"] == 3
    peak, done = [0], threading.Event()

    def sample() -> None:
        proc = psutil.Process(pid)
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.02)

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=32)) as ac:
            return await asyncio.gather(*[ac.post("/predict", content=b, headers={"content-type": "image/png"})
                                          for b in bodies])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        codes = Counter(r.status_code for r in asyncio.run(burst()))
    finally:
        done.set()
        sampler.join()
    assert set(codes) <= {200, 503} and codes[200] > 0, codes
    assert httpx.get(f"{url}/healthz", timeout=30).json()["pid"] == pid
    assert peak[0] < 768 * 2**20, f"replica peaked at {peak[0] / 2**20:.0f} MB"
    print(f"32 x 4 MP PNG: {dict(codes)}, replica peak RSS {peak[0] / 2**20:.0f} MB")


def test_small_photos_are_answered_while_large_images_queue(app):
    """12 legal 5 MP PNGs (3 decode at a time, ~20 KB each) and then 10 small JPEGs: each small
    one is answered before the last large one. In one queue every small photo waited for the
    large ones ahead of it (a 36 MP flood held them past Serve's timeout: all 408)."""
    _, url, _ = app
    big = io.BytesIO()
    Image.new("RGB", (2236, 2236), (30, 200, 60)).save(big, format="PNG")
    done: dict[str, float] = {}

    async def post(ac, name: str, body: bytes, kind: str) -> int:
        r = await ac.post("/predict", content=body, headers={"content-type": kind})
        done[name] = time.perf_counter()
        return r.status_code

    async def flood():
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=32)) as ac:
            large = [asyncio.create_task(post(ac, f"L{i}", big.getvalue(), "image/png")) for i in range(12)]
            await asyncio.sleep(0.3)  # the large ones are in the replica's queue
            small = await asyncio.gather(*[post(ac, f"s{i}", image_bytes(i), "image/jpeg") for i in range(10)])
            return small, await asyncio.gather(*large)

    small, large = asyncio.run(flood())
    assert set(small) == {200} and set(large) == {200}, (small, large)
    last_small, last_large = max(done[f"s{i}"] for i in range(10)), max(done[f"L{i}"] for i in range(12))
    assert last_small < last_large, f"the small photos waited for the large images ({last_small - last_large:+.2f} s)"


def test_openapi_docs(client):
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/predict", "/healthz", "/metadata"} <= set(paths)


def test_model_inside_the_ingress_replica(app, model_dir):
    """serve.model_deployment=false: one deployment answers /predict, /healthz and /metadata."""
    cfg = ServeConfig(port=app[0].port, app_name="test-onehop", model_deployment=False, replica_memory_mb=768)
    url = serve_stage.start(cfg, model_dir, route_prefix="/onehop")
    try:
        r = httpx.post(f"{url}/predict", content=image_bytes(7), headers=JPEG, timeout=30)
        health = httpx.get(f"{url}/healthz", timeout=30).json()
        bad = httpx.post(f"{url}/predict", content=b"nope", headers=JPEG, timeout=30)
        tensor = {"name": "images", "datatype": "BYTES", "shape": [2],
                  "data": [base64.b64encode(image_bytes(i)).decode() for i in (7, 8)]}
        v2 = httpx.post(f"{url}/v2/models/raymill/infer", json={"inputs": [tensor]}, timeout=30)
    finally:
        serve_stage.shutdown(cfg)
    assert r.status_code == 200, r.text
    _check_prediction(r.json())
    assert v2.status_code == 200 and v2.json()["outputs"][1]["data"][0] == r.json()["class_index"], v2.text
    assert health["pid"] == health["ingress_pid"]
    assert bad.status_code == 400 and bad.json()["error"] == "not_an_image"
