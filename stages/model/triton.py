"""The model repository an export is written as: Triton's layout, which KServe's Triton runtime reads too.

    <out>/<name>/config.pbtxt        platform, max_batch_size, input and outputs, dynamic_batching
    <out>/<name>/labels.txt          the class names, one a line (the logits output's label_filename)
    <out>/<name>/1/model.onnx        onnxruntime_onnx  (or 1/model.pt: pytorch_libtorch)
    <out>/manifest.json              raymill's: what made it, and how it was checked

Pure functions: names, shapes and the text of config.pbtxt; no torch, no files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Layout", "layout", "check_name", "config_pbtxt", "LABELS", "VERSION"]

LABELS = "labels.txt"
VERSION = "1"  # Triton serves the highest numbered version folder; an export writes one
# Triton names a model by its folder; keep it a plain file name on every filesystem and in URLs.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Layout:
    """Where an export's files go and what its tensors are called, for one format."""
    platform: str
    model_file: str  # relative to the model folder's version folder
    input_name: str
    output_names: tuple[str, ...]  # logits, then probabilities when exported


def layout(fmt: str, probabilities: bool) -> Layout:
    """ONNX keeps the graph's own names. Triton's libtorch backend binds tensors by position, named
    `<name>__<index>` (outputs must be; inputs may), so TorchScript's names carry the index."""
    if fmt == "onnx":
        outputs = ("logits", "probabilities") if probabilities else ("logits",)
        return Layout("onnxruntime_onnx", "model.onnx", "pixels", outputs)
    if fmt == "torchscript":
        outputs = ("logits__0", "probabilities__1") if probabilities else ("logits__0",)
        return Layout("pytorch_libtorch", "model.pt", "pixels__0", outputs)
    raise ValueError(f"export.format={fmt!r}: choose onnx or torchscript")


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValueError(f"model name {name!r} is not a folder name Triton accepts (letters, digits, '_', '.', "
                         f"'-', at most 64, starting with a letter or digit); set export.name")
    return name


def config_pbtxt(name: str, lay: Layout, image_size: int, num_classes: int, max_batch_size: int) -> str:
    """Triton's ModelConfig in protobuf text format. max_batch_size 0 means Triton does not batch:
    the batch dimension is then part of dims (-1, any size), and dynamic batching is off."""
    batch = [] if max_batch_size > 0 else [-1]
    lines = [f'name: "{check_name(name)}"', f'platform: "{lay.platform}"', f"max_batch_size: {max_batch_size}",
             "input [", "  {", f'    name: "{lay.input_name}"', "    data_type: TYPE_UINT8",
             f"    dims: {_dims(batch + [image_size, image_size, 3])}", "  }", "]",
             "output ["]
    for i, output in enumerate(lay.output_names):
        lines += ["  {", f'    name: "{output}"', "    data_type: TYPE_FP32",
                  f"    dims: {_dims(batch + [num_classes])}", f'    label_filename: "{LABELS}"',
                  "  }" + ("," if i < len(lay.output_names) - 1 else "")]
    lines.append("]")
    if max_batch_size > 0:
        lines.append("dynamic_batching { }")
    return "\n".join(lines) + "\n"


def _dims(values: list[int]) -> str:
    return "[ " + ", ".join(str(v) for v in values) + " ]"
