"""Where a published model's forward pass runs: torch, or onnxruntime on a CPU.

On a CPU, onnxruntime ran the zoo's models 1.1-5x faster than torch's eager mode at every batch size
on the 2-core box (small_cnn 5x, resnet18 2.4x at one image, resnet50 1.7-2.4x; RESULTS.md
"engines"), with logits within 2.4e-7 to 2.3e-5 of torch's. So a CPU serve replica or batch-inference
actor runs the model's ONNX graph unless `engine=torch` is asked for; a GPU keeps torch.

The graph is `raymill export`'s (`Pixels`: uint8 NHWC pixels in, logits out, the eval normalisation
inside). Exporting takes seconds (in a child process: 5.5 s small_cnn, 7.2 s resnet18, 9.8 s
resnet50 on 2 cores), so each node exports a model once into a local cache keyed by the weights and
the versions, and every load checks the graph against torch on a few images: a graph that disagrees
past CHECK_TOLERANCE is never used.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from stages.common.config import ONNX_OPSET, ConfigError

__all__ = ["ENGINES", "CACHE_DIR", "CACHE_ENV", "cache_folder", "resolve", "CHECK_TOLERANCE", "logits_scale", "Pixels", "OnnxForward", "EngineError", "for_device", "preflight", "check_engine",
           "engine_name", "save_onnx", "quiet_exporter"]

log = logging.getLogger(__name__)

ENGINES = ("auto", "torch", "onnxruntime")
CACHE_DIR = "~/.cache/raymill/onnx"  # beside train.cache_dir's shards
CACHE_ENV = "RAYMILL_ONNX_CACHE"  # another folder for it (a read-only home; the tests' own)
CHECK_TOLERANCE = 1e-3  # max |logits diff| / logits_scale against torch, as export.tolerance's default
CHECK_IMAGES = 3  # a batch size the export did not trace at (it traces at 2)
EXAMPLE_BATCH = 2  # torch.export specialises a dimension traced at size 0 or 1: trace the batch at 2
CACHE_FORMAT = 1  # bump when the graph's inputs or outputs change
CACHE_KEEP = 16  # graphs a node keeps, the ones used last
EXPORT_TIMEOUT_S = 600  # resnet50 took 9.8 s on 2 cores (RESULTS.md engines)


class EngineError(ConfigError):
    """engine=onnxruntime was asked for and cannot run this model (a ConfigError: exit 2 where it reaches
    the command line; in a serve replica or a Ray Data actor it stops the deploy or the job)."""


class Pixels(torch.nn.Module):
    """uint8 RGB [N, H, W, 3] -> the model's logits (and softmax probabilities, when asked).

    The same arithmetic as predict.to_batch: (x / 255 - mean) / std as one multiply-add."""

    def __init__(self, model: torch.nn.Module, mean: list[float], std: list[float], probabilities: bool):
        super().__init__()
        self.model, self.probabilities = model, probabilities
        std_t, mean_t = torch.tensor(std, dtype=torch.float32), torch.tensor(mean, dtype=torch.float32)
        self.register_buffer("scale", (1.0 / (255.0 * std_t)).view(1, 3, 1, 1))
        self.register_buffer("bias", (-mean_t / std_t).view(1, 3, 1, 1))

    def forward(self, pixels: torch.Tensor):
        x = torch.addcmul(self.bias, pixels.permute(0, 3, 1, 2).float(), self.scale)
        logits = self.model(x.contiguous())
        if self.probabilities:
            return logits, torch.softmax(logits, dim=1)
        return logits


class OnnxForward:
    """The forward pass in onnxruntime: uint8 NHWC pixels (numpy) -> float32 logits (numpy)."""

    engine = "onnxruntime"

    def __init__(self, session: Any, source: str):
        self.session, self.source = session, source
        self.input = session.get_inputs()[0].name

    def __call__(self, pixels: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input: np.ascontiguousarray(pixels, dtype=np.uint8)})[0]


def engine_name(model: Any) -> str:
    return getattr(model, "engine", "torch")


def cache_folder() -> str:
    return os.path.expanduser(os.environ.get(CACHE_ENV) or CACHE_DIR)


def resolve(engine: str, device_type: str) -> str:
    """The engine `engine` means on a device of `device_type` ("cpu", "cuda"): auto is onnxruntime on
    a CPU and torch elsewhere; the others mean themselves (for_device refuses onnxruntime on a GPU)."""
    return ("onnxruntime" if device_type == "cpu" else "torch") if engine == "auto" else engine


def for_device(model: torch.nn.Module, info: dict, engine: str, device: torch.device, threads: int,
               cache_dir: str | None = None, key: str = "engine") -> torch.nn.Module | OnnxForward:
    """What runs `model`'s forward pass: `model` on `device` for torch, or an OnnxForward.

    auto: onnxruntime on a CPU, torch on a GPU; where onnxruntime cannot run the model (not installed,
    an architecture the export lacks, a check past the tolerance) a warning names why and torch runs
    it. onnxruntime, asked for: those cases raise EngineError instead, naming `key` (serve.engine...).
    torch: always torch. `cache_dir`: where graphs are kept; None: cache_folder().
    """
    if engine not in ENGINES:
        raise ConfigError(f"{key} '{engine}' is not one of {', '.join(ENGINES)}")
    if resolve(engine, device.type) == "torch":
        return model.to(device)
    if device.type != "cpu":
        raise EngineError(f"{key}=onnxruntime runs the model on the CPU, but this process was given a GPU; "
                          f"set {key} to auto or torch")
    try:
        return _onnx_forward(model, info, threads, cache_dir or cache_folder())
    except Exception as e:
        if engine == "onnxruntime":
            raise EngineError(f"{key}=onnxruntime cannot run this model: {e}; set {key}=torch") from e
        log.warning("onnxruntime cannot run this model (%s); torch runs it (%s=torch says so)", e, key)
        return model.to(device)


def preflight(model_path: str, s3: Any | None, engine: str, key: str) -> None:
    """Where onnxruntime is asked for by name, check here, before any replica or actor starts, that it
    runs this model: a model it cannot run is then exit 2 at once, with `key` and the fix named, not
    a deploy that fails after Serve has retried the replica's constructor (and its export) several
    times. Where the driver shares the workers' node and cache folder, it also leaves the graph there
    for them. auto and torch check nothing: auto falls back to torch in each worker, with a warning."""
    if engine != "onnxruntime":
        return
    from stages.model.predict import load_model  # predict imports the feed; the export child needs neither

    check_engine(*load_model(model_path, s3), engine, key)


def check_engine(model: torch.nn.Module, info: dict, engine: str, key: str) -> None:
    """preflight for a model already loaded: EngineError where `engine` is onnxruntime and cannot run it."""
    if engine == "onnxruntime":
        for_device(model, info, engine, torch.device("cpu"), 1, key=key)


def _onnx_forward(model: torch.nn.Module, info: dict, threads: int, cache_dir: str) -> OnnxForward:
    import onnxruntime  # optional at import time: engine=torch never needs it

    path = Path(os.path.expanduser(cache_dir)) / f"{_cache_key(info, onnxruntime.__version__)}.onnx"
    with _export_lock(path):  # one export per graph on a node; the others wait, then read its file
        if path.is_file():
            try:
                forward = _checked(model, info, onnxruntime, str(path), threads, f"cached {path}")
                with contextlib.suppress(OSError):
                    os.utime(path)  # the eviction keeps the graphs used last
                return forward
            except Exception as e:  # a damaged or foreign file: export again, and replace it
                log.warning("the cached ONNX graph %s is unusable (%s); exporting it again", path, e)
        graph, source = _export(model, info, path)
        # still under the lock: the kept file is read whole before any other process may replace it
        return _checked(model, info, onnxruntime, graph, threads, source)


@contextlib.contextmanager
def _export_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on <graph>.lock, released on close (the kernel releases it if this process
    dies). Where the folder cannot be written there is nothing to share: no lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _checked(model: torch.nn.Module, info: dict, onnxruntime: Any, graph: bytes | str, threads: int,
             source: str) -> OnnxForward:
    forward = OnnxForward(_session(onnxruntime, graph, threads), source)
    diff = _check(model, info, forward)
    if not diff <= CHECK_TOLERANCE:
        raise ValueError(f"its ONNX graph's logits differ from torch's by {diff:.2e} of their scale (tolerance "
                         f"{CHECK_TOLERANCE})")
    log.info("onnxruntime %s runs the forward pass on %d thread(s) (graph %s; logits max |diff| against "
             "torch %.1e of their scale)", onnxruntime.__version__, threads, source, diff)
    return forward


def _cache_key(info: dict, ort_version: str) -> str:
    fields = {"format": CACHE_FORMAT, "weights": info["weights_sha256"], "architecture": info["architecture"],
              "width": info.get("width"), "classes": len(info["classes"]), "image_size": info["image_size"],
              "mean": info["mean"], "std": info["std"], "torch": torch.__version__, "onnxruntime": ort_version}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _export(model: torch.nn.Module, info: dict, path: Path) -> tuple[bytes | str, str]:
    """Export the graph in a child process, and keep it at `path` for the next load where the disk
    allows (atomically: a concurrent replica reads a whole file or none). Returns the graph's path
    when kept, else its bytes, and where it came from.

    A child, because the exporter (torch.export, onnxscript) stays resident in the process that ran
    it: a replica that exported small_cnn held 471 MB against 318 MB for one that read the cache,
    memory that serve.replica_memory_mb's decode budget counts on. The child rebuilds the model from
    `info` and the weights (as predict.load_model does), so only zoo architectures export."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="raymill-onnx-") as scratch:
        torch.save(model.state_dict(), Path(scratch) / "weights.pt")
        (Path(scratch) / "info.json").write_text(json.dumps(info))
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds `stages`
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        child = subprocess.run([sys.executable, "-m", "stages.model.runtime", scratch], env=env, cwd=scratch,
                               capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S)
        if child.returncode != 0:
            lines = (child.stderr or child.stdout).strip().splitlines() or [f"exit code {child.returncode}"]
            raise RuntimeError(f"the ONNX export failed: {lines[-1]}")
        graph = (Path(scratch) / "model.onnx").read_bytes()
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(graph)
        os.replace(partial, path)
        _evict(path.parent)
        graph = str(path)  # the session loads the file: from the bytes, it would keep a copy of them
    except OSError as e:  # a read-only home still serves; the next start exports again
        log.warning("could not keep the ONNX graph in %s (%s); each start will export it again: set %s to a "
                    "writable folder", path.parent, e, CACHE_ENV)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)  # a full disk's half-written file
    return graph, f"exported in {time.perf_counter() - started:.1f} s"


def _evict(folder: Path) -> None:
    """Keep the CACHE_KEEP graphs used last: each is as large as its model's weights (resnet50: 98 MB)."""
    graphs = sorted(folder.glob("*.onnx"), key=_mtime, reverse=True)
    for old in graphs[CACHE_KEEP:]:
        with contextlib.suppress(OSError):
            old.unlink()
            old.with_suffix(".lock").unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # another replica evicted it meanwhile
        return 0.0


def _session(onnxruntime: Any, graph: bytes | str, threads: int) -> Any:
    """A session of `graph`: its file's path where it has one, for a session built from bytes keeps a
    copy of them (resnet50 at 224 px: 335 MB more for the process from bytes, 254 MB from its path)."""
    options = onnxruntime.SessionOptions()
    # The process's CPU share, as torch's threads are: onnxruntime's default is every core of the node.
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: its warnings name graph rewrites, not problems
    # Its arena keeps the largest run's buffers for good: resnet50 at 224 px grew 495 -> 694 MB over
    # two batches of 16 and stayed there (517 MB without), memory a replica's decode budget counts on.
    # Without it: the same speed within 3% (resnet50, resnet18 and small_cnn, batch 1 and 16).
    options.enable_cpu_mem_arena = False
    return onnxruntime.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def logits_scale(logits: np.ndarray) -> float:
    """What a logits difference is measured against: the largest |logit|, at least 1. float32 keeps ~7
    digits, so logits of 3e4 (a model trained briefly at a high lr) differ by 4e-3 between two correct
    runtimes; below 1 the difference stays absolute."""
    return max(1.0, float(np.max(np.abs(logits)))) if np.isfinite(logits).all() else 1.0


@torch.no_grad()
def _check(model: torch.nn.Module, info: dict, forward: OnnxForward) -> float:
    """Max |logits diff| / logits_scale between the graph and torch on CHECK_IMAGES seeded random images."""
    size = info["image_size"]
    pixels = np.random.default_rng(0).integers(0, 256, (CHECK_IMAGES, size, size, 3), dtype=np.uint8)
    wrapper = Pixels(model.cpu(), info["mean"], info["std"], probabilities=False).eval()
    expected = wrapper(torch.from_numpy(pixels)).numpy()
    got = forward(pixels)
    if got.shape != expected.shape or not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - expected).max()) / logits_scale(expected)


def save_onnx(wrapper: torch.nn.Module, image_size: int, input_name: str, output_names: list[str],
              path: Path, opset: int = ONNX_OPSET) -> dict[str, int]:
    """Export `wrapper` (uint8 [N, size, size, 3] in) to one ONNX file with a dynamic batch, at
    `opset`, stamped with the oldest IR version that opset allows (IR 8 for opset 18; the onnx package
    stamps its own newest, which older runtimes refuse whatever the opset: onnxruntime 1.16.3 refused
    IR 10, tried). Returns both."""
    import onnx  # only an export needs it

    example = torch.zeros((EXAMPLE_BATCH, image_size, image_size, 3), dtype=torch.uint8)
    with quiet_exporter():
        batch = torch.export.Dim("batch", min=1)
        program = torch.onnx.export(wrapper, (example,), input_names=[input_name], output_names=output_names,
                                    dynamic_shapes={"pixels": {0: batch}}, verbose=False, opset_version=opset)
        used = [onnx.helper.make_opsetid(domain, version) for domain, version in program.model.opset_imports.items()]
        program.model.ir_version = onnx.helper.find_min_ir_version_for(used, ignore_unknown=True)
        program.save(str(path), external_data=False)  # one file: Triton loads model.onnx alone
    return {"opset": program.model.opset_imports[""], "ir_version": program.model.ir_version}


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """torch's exporter warns of things that do not apply here: torchvision ops it skips (raymill has
    no torchvision) and torch.jit's deprecation (Triton's libtorch backend loads TorchScript only)."""
    registry = logging.getLogger("torch.onnx")  # its exporter's loggers are children of this one
    level = registry.level
    registry.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
            warnings.filterwarnings("ignore", category=FutureWarning)
            yield
    finally:
        registry.setLevel(level)


def _export_child(scratch: Path) -> None:
    """`python -m stages.model.runtime <scratch>`: weights.pt + info.json -> model.onnx, in <scratch>."""
    from stages.model.zoo import from_info

    info = json.loads((scratch / "info.json").read_text())
    model = from_info(info, torch.load(scratch / "weights.pt", map_location="cpu", weights_only=True))
    wrapper = Pixels(model, info["mean"], info["std"], probabilities=False).eval()
    save_onnx(wrapper, info["image_size"], "pixels", ["logits"], scratch / "model.onnx")


if __name__ == "__main__":
    _export_child(Path(sys.argv[1]))
