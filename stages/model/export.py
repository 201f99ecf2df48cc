"""Export a published model for serving elsewhere: ONNX (or TorchScript) in a Triton/KServe model repository.

The exported graph takes what a client has, uint8 RGB pixels [N, H, W, 3] at the model's image size,
and does raymill's eval normalisation inside (`Pixels`), so no client re-implements mean/std or the
NHWC -> NCHW change. Before anything is published the export is run (onnxruntime, or torch.jit for
TorchScript) on images of the model's own data and compared with the model in torch through
`predict.to_batch`, the transform infer and serve use; past export.tolerance it is refused.

Files are built and checked in a staging folder beside the output, then moved in under the output's
lock, and the manifest is written last: a Triton server watching the output never sees half a model.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from stages.common import storage
from stages.common.artifacts import (MANIFEST, Artifact, base_manifest, load_artifact, manifest_kind, unpublish,
                                     write_manifest)
from stages.common.config import ConfigError, ExportConfig, section_dict
from stages.common.locks import LOCK_NAME, output_lock
from stages.etl import pixels, sources
from stages.etl.images import BadImage
from stages.feed import streaming
from stages.model import predict, triton
from stages.model.runtime import EXAMPLE_BATCH, Pixels, logits_scale, quiet_exporter, save_onnx

__all__ = ["run", "Pixels", "ExportError", "ExportRefusedError", "check_images", "compare"]

log = logging.getLogger(__name__)
# Beside config.pbtxt: stages/etl/pixels.py, which needs only Pillow and numpy, so a client feeds
# the graph the pixels raymill computes (a README-style decode disagreed on JPEG draft, alpha, 16 bit).
PREPROCESS = "preprocess.py"
READ_KEYS, READ_OPTIONAL = ("allowed_formats", "max_image_pixels"), ("max_file_mb",)  # preprocess.pixels's
PIPELINE_MARKER = "stage.json"  # `raymill run` keeps its stage marker in the stage folder


class ExportError(ConfigError):
    """The model or output named cannot be exported (exit 2, before any work)."""


class ExportRefusedError(ConfigError):
    """The export does not reproduce the model within export.tolerance; nothing was published."""


def run(cfg: ExportConfig, model_path: str, out: str, *, name: str, s3: Any | None = None,
        stage_folder: bool = False, data: str | None = None) -> Artifact:
    """Export the model in `model_path` into the model repository `out` as `<out>/<name>/`.

    Refused before any work (ExportError, exit 2): a path that is missing or holds no model, an output
    that holds anything but an earlier export. Refused after the check (ExportRefusedError): an export
    whose outputs differ from torch's by more than cfg.tolerance. Either way nothing is published.
    `stage_folder`: `out` is `raymill run`'s export folder, whose files the pipeline vouches for (it
    holds the lock, and clears or refuses the folder itself). `data`: what the check decodes
    (check_images), for a model whose own ETL output is not reachable here.
    """
    try:
        triton.check_name(name)
    except ValueError as e:  # a usage error (exit 2), not a failure
        raise ExportError(str(e)) from None
    _check_model_path(model_path, s3)
    if not stage_folder:
        _check_output(out, s3, name)
    with output_lock(out, "export", s3):
        if not stage_folder:
            _check_output(out, s3, name)  # again, holding the lock: another run may have written meanwhile
        return _run_locked(cfg, model_path, out, name, s3, data)


def _run_locked(cfg: ExportConfig, model_path: str, out: str, name: str, s3: Any | None,
                data: str | None) -> Artifact:
    started = time.perf_counter()
    model, info = predict.load_model(model_path, s3)
    if broken := [c for c in info["classes"] if len(str(c).splitlines()) != 1]:  # an ETL before the check
        raise ExportError(f"class {ascii(broken[0])} of '{model_path}' is not one line: labels.txt (one class a "
                          "line) would misname every class after it; rename its folder, re-run ETL and train")
    images, split = check_images(info, cfg.check_images, s3, data)
    lay = triton.layout(cfg.format, cfg.probabilities)
    # no parameter asks for a gradient: a TorchScript model's answers had required one (a user's
    # .numpy() of them failed without torch.no_grad())
    wrapper = Pixels(model, info["mean"], info["std"], cfg.probabilities).eval().requires_grad_(False)
    with _staging(out) as stage_dir:
        folder = stage_dir / name
        model_file = folder / triton.VERSION / lay.model_file
        model_file.parent.mkdir(parents=True)
        versions = _save(cfg.format, wrapper, info["image_size"], lay, model_file, cfg.opset)
        (folder / "config.pbtxt").write_text(triton.config_pbtxt(
            name, lay, info["image_size"], len(info["classes"]), cfg.max_batch_size))
        (folder / triton.LABELS).write_text("".join(f"{c}\n" for c in info["classes"]))
        shutil.copyfile(pixels.__file__, folder / PREPROCESS)  # the client's decode: raymill's own
        check = compare(model, info, images, _runner(cfg.format, model_file), cfg.tolerance)
        check.update(split=split, data=data or info["data"], runtime=_runtime_name(cfg.format))
        _refuse_if_off(check, cfg)
        files = {str(p.relative_to(stage_dir)): p for p in sorted(folder.rglob("*")) if p.is_file()}
        manifest = _manifest(cfg, model_path, info, name, lay, check, files)
        if versions:  # what a runtime must support: onnxruntime >= 1.14 loads opset 18, IR 8
            manifest["onnx"] = versions
        manifest["metrics"] = {"seconds": round(time.perf_counter() - started, 2)}
        _install(stage_dir, name, files, out, s3)
    write_manifest(out, manifest, s3)
    log.info("export: %s %s, logits max |diff| %.2e, class agreement %.3f on %d %s images, %.1f s -> %s",
             cfg.format, name, check["logits_max_abs_diff"], check["class_agreement"], check["images"], split,
             manifest["metrics"]["seconds"], out)
    return Artifact("export", str(out).rstrip("/"), manifest)


def _check_model_path(model_path: str, s3: Any | None) -> None:
    fs, root = storage.filesystem(model_path, s3)
    if not fs.exists(root):
        raise ExportError(f"--model '{model_path}' does not exist; pass a train or tune output folder")
    if not fs.exists(storage.join(root, "model.json")) or not fs.exists(storage.join(root, "model.pt")):
        raise ExportError(f"'{model_path}' holds no model (model.pt + model.json); pass a train or tune output "
                          f"folder as --model")


def _check_output(out: str, s3: Any | None, name: str) -> None:
    """An output must be new, empty or an earlier export (its manifest says raymill.export) holding
    only the files that export wrote: replacing anything else would delete files raymill did not
    write (a second version or a note added to the repository had gone without a word). A new one
    must be creatable."""
    fs, root = storage.filesystem(out, s3)
    if not fs.exists(root):
        if not storage.is_remote(out):  # a read-only path, or one through a file, had exited 1 at the lock
            _check_creatable(out, root)
        return
    if not fs.isdir(root):
        raise ExportError(f"--output '{out}' is a file; name a new or empty folder, or an earlier export")
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in storage.children(fs, root)} - {LOCK_NAME}
    kind = manifest_kind(fs, root)
    if not names:
        return
    if kind == "raymill.export":
        _earlier_export(out, fs, root, name)
        return
    if kind:
        raise ExportError(f"--output '{out}' holds a published {kind} output; exporting there would delete it. "
                          f"Name a new or empty folder, or an earlier export to replace")
    raise ExportError(f"--output '{out}' holds files that are not a raymill export (e.g. '{sorted(names)[0]}'); "
                      f"name a new or empty folder, or an earlier export to replace")


def _earlier_export(out: str, fs, root: str, name: str) -> None:
    """Refuse files an earlier export did not write (its manifest lists each); say when the model
    it holds is another name's, which the new one replaces (one model a repository folder)."""
    earlier = storage.read_json(fs, storage.join(root, MANIFEST))
    ours = set(earlier.get("files") or {}) | {MANIFEST, LOCK_NAME, PIPELINE_MARKER}
    present = set(storage.files_under(fs, root))
    # Python's bytecode of the export's preprocess.py, written by a client that imported it (the
    # README's onnxruntime example) unless PYTHONDONTWRITEBYTECODE: replaced with the export's folder
    ours |= {p for p in present if "__pycache__/" in p and p.endswith(".pyc")}
    if foreign := sorted(present - ours):
        raise ExportError(f"--output '{out}' is an earlier export, but holds {len(foreign)} file(s) it did not "
                          f"write (e.g. '{foreign[0]}'), which replacing it would delete; move them, or name a "
                          f"new or empty folder")
    if earlier.get("name") not in (None, name):
        log.warning("export: '%s' holds model '%s', which this export of '%s' replaces; name another --output to "
                    "keep both", out, earlier["name"], name)


def _check_creatable(out: str, root: str) -> None:
    """A new local folder can be made at `root`: tried one level at a time, and exactly the folders
    made here removed again (a refused export leaves nothing; another run's folder is never touched)."""
    missing, path = [], os.path.abspath(root)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    made: list[str] = []
    try:  # only the filesystem knows: read-only, /proc, a name too long, a file on the path
        for folder in reversed(missing):
            os.mkdir(folder)
            made.append(folder)
    except FileExistsError:
        pass  # another run made it meanwhile: the check under the lock decides
    except OSError as e:
        raise ExportError(f"--output '{out}' cannot be created ({e.strerror or type(e).__name__}); name a folder "
                          f"you can write to") from None
    finally:
        for folder in reversed(made):
            os.rmdir(folder)


def check_images(info: dict, count: int, s3: Any | None = None, data: str | None = None) -> tuple[np.ndarray, str]:
    """Up to `count` images as uint8 [N, H, W, 3], decoded as `raymill infer` decodes them, and
    where they came from. `data` (export's --data): an ETL output, or a folder of image files
    (any tree; files that do not decode are skipped); default: the model's own ETL output
    (model.json's `data`), from its test split when it has rows, else val, else train."""
    source = data or info["data"]
    fs, root = storage.filesystem(source, s3)
    if data and fs.isdir(root) and manifest_kind(fs, root) is None:
        return _folder_images(info, count, fs, root, data), "folder"
    try:
        etl_output = load_artifact(source, "etl", s3)
    except (FileNotFoundError, ValueError) as e:
        where = f"--data '{data}'" if data else f"the model's own data, model.json's data '{info['data']}',"
        raise ExportError(f"the export is checked on {where} which cannot be read ({e}); pass --data with an ETL "
                          f"output or a folder of images this model can classify") from e
    manifest = etl_output.manifest
    fmt = "parquet" if "parquet" in manifest["config"]["formats"] else "tar"
    raw = storage.stored_raw(manifest, fmt)
    if raw and manifest["config"]["image_size"] != info["image_size"]:
        raise ExportError(f"'{etl_output.path}' stores raw {manifest['config']['image_size']} px pixels but the "
                          f"model expects {info['image_size']} px; pass --data with another ETL output, or a folder "
                          f"of images")
    for split in ("test", "val", "train"):
        refs = streaming.shard_refs(manifest, etl_output.path, split, fmt)
        if sum(r.rows for r in refs):
            break
    else:
        raise ExportError(f"the ETL output '{etl_output.path}' holds no images to check the export on")
    cache = streaming.ShardCache(streaming.CACHE_DIR, streaming.CACHE_MAX_BYTES, s3)
    images: list[np.ndarray] = []
    for ref in refs:
        rows = streaming.read_shard(cache.local_path(ref), ref.format)
        images += [streaming.decode_sample(r[2], info["image_size"], raw) for r in rows[:count - len(images)]]
        if len(images) >= count:
            break
    return np.stack(images), split


def _folder_images(info: dict, count: int, fs, root: str, data: str) -> np.ndarray:
    """The first `count` files of a folder tree that decode under the model's read rules (model.json
    `read`: formats, size caps, links), with its resize rule: the pixels `raymill infer` computes."""
    rules = sources.read_rules(info)
    entries, _ = sources.list_tree(fs, root, rules["follow_symlinks"])
    images: list[np.ndarray] = []
    for entry in (e for e in entries if e.problem is None):
        try:  # the cap as ETL and infer count it (MB, not MiB)
            raw = sources.read_capped(fs, root, entry.rel, int(rules["max_file_mb"] * 1e6), rules["follow_symlinks"])
            images.append(predict.preprocess(raw, info, tuple(rules["allowed_formats"]), rules["max_image_pixels"]))
        except (BadImage, OSError):  # not an image, or gone / unreadable since it was listed: skipped
            continue
        if len(images) >= count:
            break
    if not images:
        raise ExportError(f"--data '{data}' holds no image that decodes ({len(entries)} files listed); pass an ETL "
                          f"output or a folder of images")
    return np.stack(images)


def _save(fmt: str, wrapper: Pixels, image_size: int, lay: triton.Layout, path: Path, opset: int) -> dict | None:
    """Write the model file; for ONNX, return its opset and IR version (the runtimes it loads in)."""
    if fmt == "onnx":
        import onnx  # only an ONNX export needs it

        if opset > (newest := onnx.defs.onnx_opset_version()):
            raise ExportError(f"export.opset={opset} is newer than this onnx package knows ({newest}); lower it")
        return save_onnx(wrapper, image_size, lay.input_name, list(lay.output_names), path, opset)
    with quiet_exporter():
        # Triton's libtorch backend loads TorchScript only. Tracing records the forward pass
        # (the probabilities switch included); the zoo's models have no data-dependent control flow.
        example = torch.zeros((EXAMPLE_BATCH, image_size, image_size, 3), dtype=torch.uint8)
        torch.jit.save(torch.jit.script(_CheckedInput(torch.jit.trace(wrapper, example), image_size)), str(path))
    return None


class _CheckedInput(torch.nn.Module):
    """The traced graph behind a check of its input, scripted. A traced graph runs on any shape and
    dtype (the zoo's models pool adaptively), so pixels of the wrong size or float pixels got
    answers, silently; the ONNX graph's fixed dims refuse them in onnxruntime."""

    def __init__(self, traced: torch.nn.Module, size: int):
        super().__init__()
        self.traced, self.size = traced, size

    def forward(self, pixels: torch.Tensor):
        if pixels.dtype != torch.uint8:  # TorchScript shows a dtype as its number: named by kind instead
            kind = "floating-point" if pixels.is_floating_point() else "integer but not uint8"
            raise ValueError("expected uint8 pixels (0-255, NHWC RGB), got " + kind + " ones; convert them "
                             "with .to(torch.uint8)")
        if pixels.dim() != 4 or pixels.size(1) != self.size or pixels.size(2) != self.size or pixels.size(3) != 3:
            raise ValueError(f"expected pixels [N, {self.size}, {self.size}, 3] (NHWC RGB), got {list(pixels.shape)}")
        return self.traced(pixels)


def _runner(fmt: str, path: Path):
    """A function uint8 [N, H, W, 3] -> list of float arrays, running the saved file, not the wrapper."""
    if fmt == "onnx":
        import onnxruntime  # only the ONNX check needs it

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda pixels: session.run(None, {name: pixels})
    with quiet_exporter():
        loaded = torch.jit.load(str(path), map_location="cpu").eval()

    def run_torchscript(pixels: np.ndarray) -> list[np.ndarray]:
        with torch.no_grad():
            result = loaded(torch.from_numpy(pixels))
        return [t.numpy() for t in (result if isinstance(result, tuple) else (result,))]

    return run_torchscript


def _runtime_name(fmt: str) -> str:
    if fmt == "onnx":
        import onnxruntime

        return f"onnxruntime {onnxruntime.__version__}"
    return f"torch.jit {torch.__version__}"


@torch.no_grad()
def compare(model: torch.nn.Module, info: dict, images: np.ndarray, runner, tolerance: float) -> dict[str, Any]:
    """The export against torch on the same uint8 images, at batch 1 and N: max |logits diff|, also over
    the logits' scale (runtime.logits_scale: float32 rounds logits of 3e4 by 4e-3), max |probabilities
    diff| (when exported), and the share of images whose classes agree (a tie within 2 x tolerance x
    scale counts as agreeing: the export cannot be blamed for it)."""
    expected = model(predict.to_batch(images, info["mean"], info["std"], torch.device("cpu"), False, False)).numpy()
    single = runner(images[:1])
    outputs = runner(images)
    logits = outputs[0]
    diff = float(np.max(np.abs(np.concatenate([single[0] - expected[:1], logits - expected]))))
    scale = logits_scale(expected)
    got, want = logits.argmax(1), expected.argmax(1)
    rows = np.arange(len(images))
    tie = np.abs(expected[rows, want] - expected[rows, got]) <= 2 * tolerance * scale
    check = {"images": int(len(images)), "batch_sizes": [1, int(len(images))], "tolerance": tolerance,
             "logits_max_abs_diff": diff, "logits_scale": scale, "logits_max_rel_diff": diff / scale,
             "class_agreement": float(np.mean((got == want) | tie))}
    if len(outputs) > 1:
        probabilities = torch.softmax(torch.from_numpy(expected), dim=1).numpy()
        check["probabilities_max_abs_diff"] = float(np.max(np.abs(outputs[1] - probabilities)))
    return check


def _refuse_if_off(check: dict[str, Any], cfg: ExportConfig) -> None:
    diffs = [check["logits_max_rel_diff"], check.get("probabilities_max_abs_diff", 0.0)]
    # a NaN compares false, so an export that produces NaN is refused too
    if all(d <= cfg.tolerance for d in diffs) and check["class_agreement"] == 1.0:
        return
    raise ExportRefusedError(
        f"the {cfg.format} export differs from the model in torch on {check['images']} {check['split']} images: "
        f"logits max |diff| {check['logits_max_abs_diff']:.3g} ({check['logits_max_rel_diff']:.3g} of their scale "
        f"{check['logits_scale']:.3g}), probabilities max |diff| "
        f"{check.get('probabilities_max_abs_diff', 0.0):.3g} (export.tolerance={cfg.tolerance:g}), class agreement "
        f"{check['class_agreement']:.3f}; nothing was published. Raise export.tolerance if that difference is "
        f"acceptable, or try --format {'torchscript' if cfg.format == 'onnx' else 'onnx'}")


def _manifest(cfg: ExportConfig, model_path: str, info: dict, name: str, lay: triton.Layout,
              check: dict[str, Any], files: dict[str, Path]) -> dict[str, Any]:
    size, classes = info["image_size"], info["classes"]
    manifest = base_manifest("export", section_dict(cfg), {
        "model": model_path, "weights_sha256": info["weights_sha256"], "model_version": info.get("version"),
        "data": info["data"]})
    manifest.update({
        "format": cfg.format, "name": name, "platform": lay.platform, "max_batch_size": cfg.max_batch_size,
        "input": {"name": lay.input_name, "dtype": "uint8", "shape": [-1, size, size, 3], "layout": "NHWC RGB",
                  "resize": info.get("resize", "crop"), "image_size": size,
                  # preprocess.pixels(..., read): the files raymill refuses, refused by a client too
                  **({"read": {k: read[k] for k in READ_KEYS + READ_OPTIONAL if k in read}}
                     if all(k in (read := info.get("read") or {}) for k in READ_KEYS) else {})},
        "outputs": [{"name": n, "dtype": "float32", "shape": [-1, len(classes)]} for n in lay.output_names],
        "preprocessing_in_graph": {"scale": "1/255", "mean": info["mean"], "std": info["std"]},
        "classes": classes, "check": check,
        "files": {rel: {"bytes": p.stat().st_size, "sha256": storage.sha256_file(
            storage.filesystem(str(p))[0], str(p))[0]} for rel, p in files.items()}})
    return manifest


@contextlib.contextmanager
def _staging(out: str) -> Iterator[Path]:
    """A fresh local folder for the files: beside a local output (same filesystem, so the move into
    place is a rename), in the temp folder for an s3:// one. Removed afterwards, whatever happens."""
    if storage.is_remote(out):
        folder = Path(tempfile.mkdtemp(prefix="raymill-export-"))
    else:
        local = Path(storage.local_path(out))
        folder = local.parent / f".{local.name}.export-{uuid.uuid4().hex[:8]}"
        folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _install(stage_dir: Path, name: str, files: dict[str, Path], out: str, s3: Any | None) -> None:
    """Replace the output's contents with the staged model folder. The old manifest goes first, so an
    export killed here leaves an unpublished folder, never a manifest over files it did not check."""
    unpublish(out, s3)
    fs, root = storage.filesystem(out, s3)
    for path in storage.children(fs, root):
        if path.rstrip("/").rsplit("/", 1)[-1] not in (LOCK_NAME, PIPELINE_MARKER):
            fs.rm(path, recursive=True)  # an earlier export's folders, whatever it was named
    if storage.is_remote(out):  # S3 has no folder rename: the files one by one, the manifest after them
        for rel, path in files.items():
            storage.write_bytes_atomic(fs, storage.join(root, rel), path.read_bytes())
    else:
        os.replace(stage_dir / name, Path(root) / name)
