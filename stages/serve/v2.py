"""The Open Inference Protocol (KServe v2, Triton's HTTP/REST) for the Serve app: pure parsing and
encoding, no Ray. The routes live on the ingress (stages/serve/http.py) and call these functions.

  GET  /v2                         server metadata: name, version, extensions (binary_tensor_data)
  GET  /v2/health/live|ready       200 when live / when a model replica answers
  GET  /v2/models/{name}           model metadata: one input, the outputs below
  GET  /v2/models/{name}/ready     200 when the model answers
  POST /v2/models/{name}/infer     one BYTES input `images` of shape [N] (encoded JPEG/PNG/WEBP)
  /v2/models/{name}/versions/{v}[/ready|/infer]   the same, for the version the metadata lists

Answers, one row per image, as tensors: `class_name` BYTES [N], `class_index` INT64 [N],
`top_k_index` INT64 [N, k], `top_k_probability` FP32 [N, k]. Inputs and outputs use JSON tensors
or the binary-tensor extension (a JSON header of `Inference-Header-Content-Length` bytes, then raw
tensors; a BYTES element is a 4-byte little-endian length, then its bytes). In JSON, a BYTES
element holding an image is base64 text (JSON has no raw bytes). Errors are the protocol's body,
`{"error": "..."}`, with a 4xx (404 for another model's name).
"""
from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["V2Error", "InferRequest", "INPUT", "OUTPUTS", "HEADER", "parse_infer", "encode_infer", "is_decimal",
           "model_metadata", "server_metadata", "pack_bytes", "split_bytes"]

INPUT = "images"
# output name -> (datatype, little-endian numpy dtype for binary data; None: BYTES)
OUTPUTS = {"class_name": ("BYTES", None), "class_index": ("INT64", "<i8"),
           "top_k_index": ("INT64", "<i8"), "top_k_probability": ("FP32", "<f4")}
HEADER = "Inference-Header-Content-Length"
_LENGTH = struct.Struct("<I")


MAX_ID_CHARS = 256  # a request id echoed in the response: a correlation key, not a payload


class V2Error(Exception):
    """A request the protocol refuses: `{"error": message}` with `status` (4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    images: list[bytes]
    outputs: dict[str, bool]  # requested output name -> answer it as binary data


def server_metadata(version: str) -> dict[str, Any]:
    return {"name": "raymill", "version": version, "extensions": ["binary_tensor_data"]}


def model_metadata(name: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The model's v2 metadata from the replica's /metadata dict (classes, version, top_k, ...)."""
    k = meta["top_k"]
    shapes = {"class_name": [-1], "class_index": [-1], "top_k_index": [-1, k], "top_k_probability": [-1, k]}
    # the platform that answers, as Triton names it: /metadata's engine (onnxruntime on a CPU by default)
    platform = "onnxruntime_onnx" if meta.get("engine") == "onnxruntime" else "pytorch_libtorch"
    return {"name": name, "versions": [str(meta.get("version") or "")], "platform": platform,
            "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": n, "datatype": OUTPUTS[n][0], "shape": s} for n, s in shapes.items()],
            "parameters": {"classes": meta["classes"], "image_size": meta["image_size"],
                           "allowed_formats": meta["allowed_formats"], "max_images": meta["max_images"]}}


def split_bytes(buffer: bytes) -> list[bytes]:
    """A serialised BYTES tensor -> its elements; V2Error when the lengths do not add up."""
    items, offset = [], 0
    while offset < len(buffer):
        if offset + 4 > len(buffer):
            raise V2Error(400, f"input '{INPUT}': binary data ends inside an element's 4-byte length")
        (size,) = _LENGTH.unpack_from(buffer, offset)
        offset += 4
        if offset + size > len(buffer):
            raise V2Error(400, f"input '{INPUT}': element {len(items)} declares {size} bytes but "
                               f"{len(buffer) - offset} remain")
        items.append(bytes(buffer[offset:offset + size]))
        offset += size
    return items


def pack_bytes(items: list[bytes]) -> bytes:
    """Elements -> a serialised BYTES tensor (4-byte little-endian length before each)."""
    return b"".join(_LENGTH.pack(len(item)) + item for item in items)


def is_decimal(text: str) -> bool:
    """A header's non-negative integer: ASCII digits only ('²'.isdigit() is True, int('²') fails)."""
    text = text.strip()
    return text.isascii() and text.isdigit()


def parse_infer(body: bytes, header_length: str | None, max_images: int) -> InferRequest:
    """An infer request's body (and its Inference-Header-Content-Length) -> the images to classify."""
    header, binary = _split_body(body, header_length)
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise V2Error(400, f"'inputs' must hold exactly one tensor, '{INPUT}' (BYTES, shape [N])")
    tensor = inputs[0]
    if tensor.get("name") != INPUT:
        raise V2Error(400, f"unknown input {tensor.get('name')!r:.80}; the model's one input is '{INPUT}'")
    if tensor.get("datatype") != "BYTES":
        raise V2Error(400, f"input '{INPUT}' has datatype {tensor.get('datatype')!r:.80}; send BYTES (encoded images)")
    shape = tensor.get("shape")
    # a JSON true is a Python int too: [true] is no shape
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 1):
        raise V2Error(400, f"input '{INPUT}' has shape {shape!r:.80}; send shape [N], N >= 1 images")
    if shape[0] > max_images:
        raise V2Error(413, f"{shape[0]} images in one request exceed serve.max_images_per_request="
                           f"{max_images}; split the request")
    images = _tensor_images(tensor, binary)
    if len(images) != shape[0]:
        raise V2Error(400, f"input '{INPUT}' declares shape [{shape[0]}] but holds {len(images)} element(s)")
    request_id = header.get("id")
    # the protocol's id is a string, echoed back: any JSON value of any size had been echoed
    if request_id is not None and not (isinstance(request_id, str) and len(request_id) <= MAX_ID_CHARS):
        raise V2Error(400, f"'id' must be a string of at most {MAX_ID_CHARS} characters")
    return InferRequest(request_id, images, _requested_outputs(header))


def _split_body(body: bytes, header_length: str | None) -> tuple[dict, bytes]:
    """(JSON header, binary part): the binary-tensor extension when the header length is given."""
    if header_length is None:
        size = len(body)
    elif is_decimal(header_length) and int(header_length) <= len(body):
        size = int(header_length)
    else:
        raise V2Error(400, f"{HEADER} '{header_length}' is not a length within the {len(body)}-byte body")
    try:
        header = json.loads(body[:size])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting too deep
        raise V2Error(400, f"the request's JSON does not parse ({type(e).__name__}); "
                           f"binary tensors need the {HEADER} header") from None
    if not isinstance(header, dict):
        raise V2Error(400, "the request's JSON must be an object with 'inputs'")
    return header, body[size:]


def _tensor_images(tensor: dict, binary: bytes) -> list[bytes]:
    """The input's elements: from the binary part (binary_data_size), else base64 JSON strings."""
    parameters = tensor.get("parameters") or {}
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is not None:
        if "data" in tensor:
            raise V2Error(400, f"input '{INPUT}' has both 'data' and binary_data_size; send one")
        if type(size) is not int or size != len(binary):
            raise V2Error(400, f"input '{INPUT}' declares binary_data_size {size!r:.40} but {len(binary)} "
                               f"bytes follow the JSON header")
        return split_bytes(binary)
    if binary:
        raise V2Error(400, f"{len(binary)} bytes follow the JSON header but no input declares binary_data_size")
    data = tensor.get("data")
    if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
        raise V2Error(400, f"input '{INPUT}' needs 'data': a list of base64 strings, one per image "
                           f"(or binary data)")
    try:
        return [base64.b64decode(item, validate=True) for item in data]
    except (binascii.Error, ValueError):
        raise V2Error(400, f"input '{INPUT}': a JSON element is not base64; encode each image "
                           f"as base64, or send binary data") from None


def _requested_outputs(header: dict) -> dict[str, bool]:
    """Which outputs to answer and in which form (all, as JSON, unless the request says)."""
    parameters = header.get("parameters") or {}
    default_binary = _flag(parameters.get("binary_data_output", False) if isinstance(parameters, dict) else False,
                           "parameters.binary_data_output")
    requested = header.get("outputs")
    if requested is None or requested == []:  # Triton reads an empty list as "all outputs" too
        return {name: default_binary for name in OUTPUTS}
    if not isinstance(requested, list) or not all(isinstance(o, dict) for o in requested):
        raise V2Error(400, "'outputs' must be a list of {name, parameters}")
    outputs = {}
    for output in requested:
        name, params = output.get("name"), output.get("parameters") or {}
        if not isinstance(name, str) or name not in OUTPUTS:
            raise V2Error(400, f"unknown output {name!r:.80}; the model answers {', '.join(OUTPUTS)}")
        if name in outputs:
            raise V2Error(400, f"output '{name}' is requested twice; name each output once")
        if not isinstance(params, dict):
            raise V2Error(400, f"output '{name}': 'parameters' must be an object, e.g. {{\"binary_data\": true}}")
        if params.get("classification"):
            raise V2Error(400, f"output '{name}': the classification extension is not supported; "
                               f"read top_k_index and top_k_probability")
        outputs[name] = _flag(params.get("binary_data", default_binary), f"output '{name}': binary_data")
    return outputs


def _flag(value: Any, what: str) -> bool:
    """A JSON boolean; the string "false" would otherwise read as true."""
    if not isinstance(value, bool):
        raise V2Error(400, f"{what} is {value!r:.40}; send true or false")
    return value


def encode_infer(results: list[dict], request: InferRequest, name: str,
                 version: str) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers for one answer per image (stages.model.predict's dicts)."""
    values = {"class_name": [r["class_name"] for r in results],
              "class_index": [r["class_index"] for r in results],
              "top_k_index": [[t["class_index"] for t in r["top_k"]] for r in results],
              "top_k_probability": [[t["probability"] for t in r["top_k"]] for r in results]}
    outputs, chunks = [], []
    for output, binary in request.outputs.items():
        datatype, dtype = OUTPUTS[output]
        data = values[output]
        tensor: dict[str, Any] = {"name": output, "datatype": datatype, "shape": list(np.shape(data))}
        if binary:
            raw = pack_bytes([s.encode() for s in data]) if dtype is None else np.asarray(data, dtype).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = np.ravel(data).tolist()  # the protocol's JSON data is flat, row-major
        outputs.append(tensor)
    response: dict[str, Any] = {"model_name": name, "model_version": version, "outputs": outputs}
    if request.id is not None:
        response["id"] = request.id
    header = json.dumps(response).encode()
    if not chunks:
        return header, {"content-type": "application/json"}
    return header + b"".join(chunks), {"content-type": "application/octet-stream", HEADER: str(len(header))}
