"""The Open Inference Protocol (KServe v2) on the served app: the real `tritonclient.http` client
and raw HTTP against the live endpoint of tests/test_serve.py.

Imported by tests/test_serve.py, so these tests run in that module and share its served app (its
module-scoped `app` fixture): no Serve start of their own.
"""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from stages.serve import v2 as serve_v2
from tests.conftest import image_bytes

__all__ = ["test_v2_encoding_is_what_tritonclient_decodes", "test_v2_tritonclient_ready_metadata_and_infer",
           "test_v2_tritonclient_gets_4xx", "test_v2_bad_requests", "test_v2_unknown_routes_answer_in_the_protocol_shape",
           "test_v2_versioned_routes_and_compressed_requests"]

MODEL = "raymill"
OUTPUTS = list(serve_v2.OUTPUTS)


def _client(url: str):
    import tritonclient.http as triton

    return triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=60.0)


def _images_input(images, datatype: str = "BYTES", shape=None):
    import tritonclient.http as triton

    array = np.array(images, dtype=object) if datatype == "BYTES" else np.asarray(images)
    tensor = triton.InferInput("images", list(shape or array.shape), datatype)
    tensor.set_data_from_numpy(array.reshape(shape or array.shape), binary_data=True)
    return tensor


def test_v2_encoding_is_what_tritonclient_decodes():
    """Binary and JSON outputs, encoded here, decode in the real client to the same tensors."""
    from tritonclient.http import InferResult

    results = [{"class_name": n, "class_index": i, "top_k": [{"class_index": i, "probability": 0.75},
                                                             {"class_index": 2, "probability": 0.25}]}
               for i, n in enumerate(["bird", "cat"])]
    for binary in (False, True):
        request = serve_v2.InferRequest("r1", [b"a", b"b"], {name: binary for name in OUTPUTS})
        body, headers = serve_v2.encode_infer(results, request, MODEL, "v1")
        length = headers.get(serve_v2.HEADER)
        result = InferResult.from_response_body(body, header_length=int(length) if length else None)
        assert (length is not None) == binary
        assert result.as_numpy("class_name").tolist() == ([b"bird", b"cat"] if binary else ["bird", "cat"])
        assert result.as_numpy("class_index").tolist() == [0, 1]
        assert result.as_numpy("top_k_index").shape == (2, 2)
        assert result.as_numpy("top_k_probability").dtype == np.float32
        assert result.get_response()["id"] == "r1"
    packed = serve_v2.pack_bytes([b"", b"\x00\xff", b"jpeg"])
    assert serve_v2.split_bytes(packed) == [b"", b"\x00\xff", b"jpeg"]
    with pytest.raises(serve_v2.V2Error, match="declares 9 bytes"):
        serve_v2.split_bytes(packed[:-8] + b"\x09\x00\x00\x00jpeg")


def test_v2_tritonclient_ready_metadata_and_infer(app):
    """Readiness, metadata, and 3 images in one request (JSON and binary outputs): each image gets
    the answer /predict gives it alone."""
    from tritonclient.http import InferRequestedOutput

    _, url, _ = app
    client = _client(url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert not client.is_model_ready("nope")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = client.get_model_metadata(MODEL)
    assert meta["inputs"] == [{"name": "images", "datatype": "BYTES", "shape": [-1]}]
    engine = httpx.get(f"{url}/metadata", timeout=30).json()["engine"]  # the platform that answers, named alike
    assert meta["platform"] == {"onnxruntime": "onnxruntime_onnx", "torch": "pytorch_libtorch"}[engine]
    assert {o["name"]: o["shape"] for o in meta["outputs"]}["top_k_probability"] == [-1, 3]
    images = [image_bytes(400 + i) for i in range(3)]
    alone = [httpx.post(f"{url}/predict", content=data, headers={"content-type": "image/jpeg"}, timeout=30).json()
             for data in images]
    for binary in (False, True):
        outputs = [InferRequestedOutput(name, binary_data=binary) for name in OUTPUTS]
        result = client.infer(MODEL, [_images_input(images)], outputs=outputs, request_id=f"b{binary}")
        names = [n.decode() if isinstance(n, bytes) else n for n in result.as_numpy("class_name")]
        assert names == [a["class_name"] for a in alone]
        assert result.as_numpy("class_index").tolist() == [a["class_index"] for a in alone]
        assert result.as_numpy("top_k_index").tolist() == [[k["class_index"] for k in a["top_k"]] for a in alone]
        probabilities = [[k["probability"] for k in a["top_k"]] for a in alone]
        assert np.allclose(result.as_numpy("top_k_probability"), probabilities, atol=1e-5)
        assert result.get_response()["model_version"] == "test-1"
    default = client.infer(MODEL, [_images_input(images[:1])])  # no outputs named: all, binary
    assert default.as_numpy("class_index").tolist() == [alone[0]["class_index"]]


def test_v2_tritonclient_gets_4xx(app):
    from tritonclient.utils import InferenceServerException

    client, good = _client(app[1]), [image_bytes(410), image_bytes(411)]
    cases = {  # what: (model, input, status, words in the error)
        "wrong shape": (MODEL, _images_input([good], shape=[1, 2]), "400", "shape [N]"),
        "wrong datatype": (MODEL, _images_input(np.ones(2, np.float32), "FP32"), "400", "datatype 'FP32'"),
        "wrong model name": ("nope", _images_input(good), "404", "unknown model 'nope'"),
        "non-image bytes": (MODEL, _images_input([good[0], b"not an image at all"]), "400",
                            "element 1: not_an_image"),
    }
    for what, (model, tensor, status, words) in cases.items():
        with pytest.raises(InferenceServerException) as raised:
            client.infer(model, [tensor])
        assert raised.value.status() == status and words in raised.value.message(), (what, raised.value)


def _png_of(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (width, height), 128).save(buf, format="PNG")
    return buf.getvalue()


def _body(header: dict, binary: bytes = b"") -> tuple[bytes, dict]:
    text = json.dumps(header).encode()
    return text + binary, ({serve_v2.HEADER: str(len(text))} if binary else {})


_JPEG = image_bytes(420)
_B64 = base64.b64encode(_JPEG).decode()
_ONE = {"name": "images", "datatype": "BYTES", "shape": [1]}
_FLAT_4MP = base64.b64encode(_png_of(2000, 2000)).decode()
V2_BAD = {  # id: ((body, headers), status, words in the error)
    "bad json": ((b"{not json", {}), 400, "does not parse"),
    "no inputs": (_body({"outputs": []}), 400, "exactly one tensor"),
    "wrong input name": (_body({"inputs": [{**_ONE, "name": "x", "data": [_B64]}]}), 400, "unknown input 'x'"),
    "count mismatch": (_body({"inputs": [{**_ONE, "shape": [2], "data": [_B64]}]}), 400, "holds 1 element"),
    "not base64": (_body({"inputs": [{**_ONE, "data": ["%%%"]}]}), 400, "not base64"),
    "header too long": ((b"{}", {serve_v2.HEADER: "999"}), 400, "not a length within"),
    "binary size mismatch": (_body({"inputs": [{**_ONE, "parameters": {"binary_data_size": 3}}]},
                                   serve_v2.pack_bytes([_JPEG])), 400, "binary_data_size 3"),
    "unknown output": (_body({"inputs": [{**_ONE, "data": [_B64]}], "outputs": [{"name": "logits"}]}), 400,
                       "unknown output 'logits'"),
    "too many images": (_body({"inputs": [{**_ONE, "shape": [65], "data": [_B64] * 65}]}), 413,
                        "max_images_per_request=64"),
    "oversized body": ((b" " * 200_001, {}), 413, "max_body_bytes"),
    "json nested too deep": ((b"[" * 5000 + b"]" * 5000, {}), 400, "does not parse"),
    "output name not a string": (_body({"inputs": [{**_ONE, "data": [_B64]}], "outputs": [{"name": ["x"]}]}), 400,
                                 "unknown output ['x']"),
    "non-ASCII digit header length": ((b"{}", {serve_v2.HEADER: "\u00b2".encode("latin-1")}), 400,
                                      "not a length within"),
    # a lone surrogate is legal JSON: quoted in the error, it once made the error itself a 500
    "lone surrogate as input name": (_body({"inputs": [{**_ONE, "name": "\ud800", "data": [_B64]}]}), 400,
                                     "unknown input '\\ud800'"),
    "lone surrogate as datatype": (_body({"inputs": [{**_ONE, "datatype": "\ud800", "data": [_B64]}]}), 400,
                                   "has datatype"),
    "id not a string": (_body({"id": {"a": [1]}, "inputs": [{**_ONE, "data": [_B64]}]}), 400, "'id' must be a string"),
    "id too long": (_body({"id": "x" * 257, "inputs": [{**_ONE, "data": [_B64]}]}), 400, "at most 256 characters"),
    "shape [true]": (_body({"inputs": [{**_ONE, "shape": [True], "data": [_B64]}]}), 400, "send shape [N]"),
    "output named twice": (_body({"inputs": [{**_ONE, "data": [_B64]}],
                                  "outputs": [{"name": "class_name"}, {"name": "class_name"}]}), 400, "requested twice"),
    "binary_data as a string": (_body({"inputs": [{**_ONE, "data": [_B64]}], "outputs": [
        {"name": "class_name", "parameters": {"binary_data": "false"}}]}), 400, "send true or false"),
    "output parameters not an object": (_body({"inputs": [{**_ONE, "data": [_B64]}],
                                               "outputs": [{"name": "class_name", "parameters": "x"}]}), 400,
                                        "must be an object"),
    # 4 x 2000x2000 px (tiny PNGs): the 4th passes the app's serve.max_request_pixels=12 M (headers only)
    "past the request's pixels": (_body({"inputs": [{**_ONE, "shape": [4], "data": [_FLAT_4MP] * 4}]}), 413,
                                  "element 3: too_large"),
    "brotli body": ((b"{}", {"content-encoding": "br"}), 415, "unsupported_content_encoding"),
    # what a page on another site may POST without asking: refused before the body is read
    "text/plain body": (_body({"inputs": [{**_ONE, "data": [_B64]}]})[0:1] + ({"content-type": "text/plain"},), 415,
                        "Content-Type 'text/plain'"),
    "form body": ((b"a=1", {"content-type": "application/x-www-form-urlencoded"}), 415, "unsupported_media_type"),
}


def test_v2_bad_requests(app):
    """Raw HTTP: each malformed request gets the protocol's {"error": ...} and a 4xx; a good JSON
    (base64) request answers in JSON."""
    url = f"{app[1]}/v2/models/{MODEL}/infer"
    with httpx.Client(timeout=30) as client:
        for what, ((content, headers), status, words) in V2_BAD.items():
            r = client.post(url, content=content, headers=headers)
            assert r.status_code == status and words in r.json()["error"], (what, r.status_code, r.text)
            assert list(r.json()) == ["error"], what
        ok = client.post(url, json={"id": "j", "inputs": [{**_ONE, "data": [_B64]}]})
    assert ok.status_code == 200 and ok.headers["content-type"] == "application/json", ok.text
    body = ok.json()
    assert body["id"] == "j" and body["model_name"] == MODEL and len(body["outputs"]) == 4
    assert {o["name"]: o["shape"] for o in body["outputs"]}["top_k_probability"] == [1, 3]


@pytest.mark.parametrize("method,path,status", [
    ("GET", f"/v2/models/{MODEL}/config", 404), ("GET", f"/v2/models/{MODEL}/infer", 405),
    ("GET", "/v2/repository/index", 404), ("POST", "/v2/health/live", 405)])
def test_v2_unknown_routes_answer_in_the_protocol_shape(app, method, path, status):
    r = httpx.request(method, f"{app[1]}{path}", timeout=30)
    assert r.status_code == status and list(r.json()) == ["error"], r.text
    assert "/v2/models/{name}" in r.json()["error"]


def test_v2_versioned_routes_and_compressed_requests(app):
    """The version the metadata lists works in the /versions/ routes (tritonclient's model_version);
    another version is a 404; gzip and deflate request bodies (request_compression_algorithm) infer."""
    from tritonclient.utils import InferenceServerException

    client, images = _client(app[1]), [image_bytes(430), image_bytes(431)]
    version = client.get_model_metadata(MODEL)["versions"][0]
    assert client.get_model_metadata(MODEL, version)["name"] == MODEL
    assert client.is_model_ready(MODEL, version) and not client.is_model_ready(MODEL, "9")
    plain = client.infer(MODEL, [_images_input(images)]).as_numpy("class_index").tolist()
    assert client.infer(MODEL, [_images_input(images)], model_version=version).as_numpy("class_index").tolist() == plain
    for algorithm in ("gzip", "deflate"):
        result = client.infer(MODEL, [_images_input(images)], request_compression_algorithm=algorithm)
        assert result.as_numpy("class_index").tolist() == plain, algorithm
    with pytest.raises(InferenceServerException) as raised:
        client.infer(MODEL, [_images_input(images)], model_version="9")
    assert raised.value.status() == "404" and "no version '9'" in raised.value.message()
