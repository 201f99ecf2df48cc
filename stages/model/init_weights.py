"""The weights a training run starts from (`train.init_from`): read, checked and applied, never unpickled.

A source is one of:
- a raymill train or tune output folder: its `model.pt`, checked against `model.json`'s sha256;
- a torchvision-format state dict (`.pth` / `.pt`, as torchvision publishes its ResNets);
- a `.safetensors` file with the same keys;
- a training checkpoint that holds such a dict (Lightning's `state_dict`, `model_state_dict`, ...),
  and keys that DDP or torch.compile prefixed: unwrapped, and the log and record say so.
Local or s3://. The torch-free checks (path, checksum, file kind) are stages.model.init_source's,
which the CLI runs before Ray starts. `prepare` runs on the driver before any worker starts and
turns every problem into a ConfigError (exit 2) that names the keys and the fix: the backbone must fit the model
exactly (no missing or extra key, every shape equal). The classifier head is kept only when the
source names this data's classes in this order (a raymill folder does); otherwise it is replaced by
the run's own seeded init (a torchvision ImageNet state dict: 1000 classes, always replaced).
`apply` runs in each worker on the bytes the driver checked, after verifying their sha256.

Normalisation: weights expect the mean/std they were trained with. A raymill model.json says
it; a bare ResNet state dict is taken to be torchvision's ImageNet weights. `train.augment.mean`
and `.std` follow the source unless the user set them (pydantic's `model_fields_set`).
"""
from __future__ import annotations

import io
import logging
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from stages.common import storage
from stages.common.config import AugmentConfig, ConfigError, TrainConfig
from stages.model.init_source import fits, read_source, reuse_inputs, sniff, source_sha256, whole
from stages.model.zoo import build_model

# torch.save's legacy format pickled with protocol 4+ loads fine; torch's loader still warns of it
warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "HEAD_PREFIX", "CHECKPOINT_KEYS", "WRAPPER_PREFIXES", "InitPlan",
           "prepare", "source_sha256", "reuse_inputs", "read_source", "parse", "unwrap", "check_keys", "apply"]

log = logging.getLogger(__name__)

# torchvision's ImageNet weights (IMAGENET1K_V1/V2) were trained on inputs normalised with these
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The classifier head's parameter prefix per architecture (zoo.py: `self.fc` in each)
HEAD_PREFIX = {"small_cnn": "fc.", "resnet18": "fc.", "resnet50": "fc."}
_SHOWN = 5  # keys named in a refusal; the count says how many more
# BatchNorm's step counter, a buffer no weight depends on: torchvision's ImageNet files from before
# torch 0.4.1 lack it (resnet18-5c106cde.pth has 102 of the 122 keys), and torch's BatchNorm loads
# such a dict strictly, counting from 0; so does a run started from one.
COUNTERS = ".num_batches_tracked"


@dataclass(frozen=True)
class InitPlan:
    """A checked init: what the workers load (`payload`: the source's bytes, or the unwrapped weights
    alone, record["shipped"]), what manifests record, and the
    effective train config (its augment mean/std possibly taken from the source)."""
    record: dict[str, Any]  # source, kind, sha256, bytes, head ("kept"/"replaced"), mean, std, normalisation
    train: TrainConfig
    payload: bytes


# Where training checkpoints keep the model's weights, in the order they are looked for: Lightning
# and most scripts ("state_dict"), the PyTorch tutorial's ("model_state_dict"), many repos' ("model",
# "net"). Saved beside them: optimizer state, epoch, counters, none of it wanted. A checkpoint that
# also pickles objects (an argparse.Namespace of its args, numpy scalars) is still refused.
CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model", "net")
# Prefixes a wrapper adds to every key: DDP / DataParallel ("module."), torch.compile ("_orig_mod.")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def parse(payload: bytes, kind: str, uri: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A flat {name: tensor} state dict from `payload`, and what was unwrapped to get it (a
    checkpoint's entry, a wrapper's key prefix); nothing is unpickled."""
    sniff(payload[:32], kind, uri)
    whole(io.BytesIO(payload), len(payload), kind, uri)
    if kind == "safetensors":
        from safetensors.torch import load as load_safetensors  # only this path needs it

        try:
            state = load_safetensors(payload)
        except Exception as e:
            raise ConfigError(f"train.init_from: '{uri}' is not a readable .safetensors file ({e}); "
                              f"check the file, or rename it if it is a torch.save file") from None
    else:
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            lines = [line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()]
            raise ConfigError(
                f"train.init_from: '{uri}' holds objects that are not plain tensors, and loading it would run "
                f"their code; refused ({lines[0] if lines else 'not a weights-only file'}). Save the weights "
                f"alone: torch.save(model.state_dict(), path), or safetensors.torch.save_file") from None
        except Exception as e:
            raise ConfigError(f"train.init_from: '{uri}' is not a readable torch.save file ({type(e).__name__}"
                              f"{': ' + _sentence(str(e)) if str(e) else ''}); check the file") from None
    return unwrap(state, uri)


def _sentence(text: str, limit: int = 200) -> str:
    """The first line of `text`, cut at its last whole sentence within `limit` characters: torch's
    zip errors run on ("... your checkpoint file is" had ended a message)."""
    line = (text.splitlines() or [""])[0]
    if len(line) <= limit:
        return line
    cut = line[:limit].rfind(". ")
    return line[:cut + 1] if cut > 0 else line[:limit] + "..."


def _flat(state: Any) -> bool:
    return isinstance(state, dict) and bool(state) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())


def unwrap(state: Any, uri: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A training checkpoint's model weights (its first CHECKPOINT_KEYS entry that is a flat state
    dict), without a prefix that every key carries from a wrapper (WRAPPER_PREFIXES)."""
    notes: list[str] = []
    if not _flat(state) and isinstance(state, dict):
        entry = next((k for k in CHECKPOINT_KEYS if _flat(state.get(k))), None)
        if entry is not None:
            state, notes = state[entry], [f"the checkpoint's '{entry}' entry"]
    if not _flat(state):
        keys = f" (its top-level keys: {_names([str(k) for k in state])})" if isinstance(state, dict) else ""
        raise ConfigError(f"train.init_from: '{uri}' is not a flat state dict (parameter name -> tensor), nor a "
                          f"checkpoint with one under {', '.join(CHECKPOINT_KEYS)}{keys}. Save its model's weights "
                          f"alone: torch.save(model.state_dict(), path)")
    # Until none is left: torch.compile(DDP(model)) saves "_orig_mod.module.", DDP(compiled) the reverse
    while prefix := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None):
        state = {k[len(prefix):]: v for k, v in state.items()}
        notes.append(f"the '{prefix}' prefix of every key")
    return state, notes


def _names(keys: Sequence[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def check_keys(state: dict[str, torch.Tensor], model_name: str, classes: Sequence[str], width: int,
               uri: str) -> bool:
    """Refuse (ConfigError) a backbone that does not fit `model_name` exactly; True when the
    source's head has this data's shape (whether the class names match is the caller's)."""
    with torch.device("meta"):  # names and shapes only: no memory, no init cost
        expected = {k: tuple(v.shape) for k, v in build_model(model_name, len(classes), width).state_dict().items()}
    head = HEAD_PREFIX[model_name]
    missing = [k for k in expected if not k.startswith(head) and k not in state and not k.endswith(COUNTERS)]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = ([f"missing keys {_names(missing)}"] if missing else []) + \
                ([f"unexpected keys {_names(unexpected)}"] if unexpected else [])
        hint = _prefix_hint(state, expected) or (
            f"are these weights of another architecture? Set train.model to the one they were trained "
            f"as ({', '.join(HEAD_PREFIX)}), or pass weights of train.model={model_name}")
        raise ConfigError(f"train.init_from: '{uri}' does not fit train.model={model_name}: "
                          f"{'; '.join(parts)}; {hint}")
    wrong = [f"{k} {tuple(state[k].shape)} vs {expected[k]}" for k in expected
             if not k.startswith(head) and k in state and tuple(state[k].shape) != expected[k]]
    if wrong:
        fix = ("set train.width to the width the weights were trained with" if model_name == "small_cnn"
               else f"pass weights of train.model={model_name}")
        raise ConfigError(f"train.init_from: '{uri}' has shapes that do not fit train.model={model_name} "
                          f"(file vs model): {_names(wrong)}; {fix}")
    return all(k in state and tuple(state[k].shape) == expected[k] for k in expected if k.startswith(head))


def check_backbone(cfg: TrainConfig, model_names: Sequence[str], width_searched: bool = False) -> None:
    """A weights file's backbone against every model that will train, before the data's classes are
    known (`prepare` checks the head once they are). The CLI runs it beside Ray's start, ahead of
    MLflow's store: a file of another architecture had been refused by the train stage, 13 s later
    on 2 cores, leaving OUT/mlflow.db. `width_searched`: a search's small_cnn widths are its trials'."""
    uri = str(cfg.init_from)
    kind, payload, _ = read_source(uri)
    state, _ = parse(payload, "torch" if kind == "raymill" else kind, uri)
    for name in dict.fromkeys(model_names):
        if not (name == "small_cnn" and width_searched):
            check_keys(state, name, ("a", "b"), cfg.width, uri)  # any classes: the head is not checked
    check_finite(state, HEAD_PREFIX[cfg.model], uri)


def _prefix_hint(state: dict[str, torch.Tensor], expected: dict[str, tuple]) -> str | None:
    """When every key carries one prefix (of any depth) and the rest fits (a Lightning module's
    `self.model`, a wrapper of the user's own), the fix names it: only the wrappers' prefixes are taken
    off unasked."""
    parts = next(iter(state), "").split(".")
    for depth in range(1, len(parts)):
        prefix = ".".join(parts[:depth]) + "."
        if all(k.startswith(prefix) and k[len(prefix):] in expected for k in state):
            return (f"every key carries the prefix '{prefix}' (a wrapper module's attribute?): save "
                    f"model.{prefix[:-1]}.state_dict() instead, or strip the prefix from the keys")
    return None


def check_finite(state: dict[str, torch.Tensor], head: str, uri: str) -> None:
    """Refuse a backbone tensor holding NaN or inf (a diverged run's, a damaged file's): it had passed
    the checks and failed the first epoch as "loss became NaN/inf ... lower train.lr"."""
    bad = [k for k, v in state.items() if not k.startswith(head) and v.is_floating_point()
           and not bool(torch.isfinite(v).all())]
    if bad:
        raise ConfigError(f"train.init_from: '{uri}' holds NaN or inf values in {_names(bad)}: weights of a "
                          f"diverged run or a damaged file; pass other weights")


def _normalisation(augment: AugmentConfig, expected: tuple | None, uri: str) -> tuple[AugmentConfig, str]:
    """augment with mean/std taken from the source where the user did not set them, and where from."""
    if expected is None:
        return augment, "config"
    chosen = {name: tuple(float(x) for x in value) for name, value in zip(("mean", "std"), expected)
              if name not in augment.model_fields_set}
    for name, value in zip(("mean", "std"), expected):
        if name in augment.model_fields_set and tuple(getattr(augment, name)) != tuple(value):
            log.warning("train: train.augment.%s=%s was set explicitly; the init weights '%s' expect %s: kept "
                        "the setting", name, list(getattr(augment, name)), uri, list(value))
    return augment.model_copy(update=chosen), "init" if chosen else "config"


def prepare(cfg: TrainConfig, classes: Sequence[str], s3: Any | None = None,
            model_names: Sequence[str] = ()) -> InitPlan:
    """Read and check `cfg.init_from` against every model that will train (`model_names`, default
    train.model) on `classes`; raises ConfigError before any work."""
    uri = str(cfg.init_from)
    kind, payload, info = read_source(uri, s3)
    state, unwrapped = parse(payload, "torch" if kind == "raymill" else kind, uri)
    heads_fit = []
    for name in dict.fromkeys(model_names or [cfg.model]):
        if info is not None:
            fits(uri, info, (name,))
        heads_fit.append(check_keys(state, name, classes, cfg.width, uri))
    check_finite(state, HEAD_PREFIX[cfg.model], uri)
    same_classes = info is not None and list(info.get("classes", [])) == list(classes)
    head = "kept" if all(heads_fit) and same_classes else "replaced"
    expected = None
    if info is not None and info.get("mean") and info.get("std"):
        expected = (info["mean"], info["std"])
    elif info is None and cfg.model.startswith("resnet"):  # a bare ResNet: torchvision's ImageNet weights
        expected = (IMAGENET_MEAN, IMAGENET_STD)
    augment, origin = _normalisation(cfg.augment, expected, uri)
    record = {"source": uri, "kind": kind, "sha256": storage.sha256_bytes(payload), "bytes": len(payload),
              "head": head, "mean": list(augment.mean), "std": list(augment.std), "normalisation": origin,
              "unwrapped": unwrapped}
    shipped = payload
    if unwrapped:  # the workers get the weights alone: a resnet18 + Adam checkpoint was 128 MiB, its weights 42
        buf = io.BytesIO()
        torch.save(state, buf)
        if buf.tell() < len(payload):  # a prefix stripped from a bare state dict saves nothing
            shipped = buf.getvalue()
            record["shipped"] = {"sha256": storage.sha256_bytes(shipped), "kind": "torch", "bytes": len(shipped)}
    why = "same classes" if head == "kept" else ("the source names no classes" if info is None
                                                 else "other classes" if not same_classes else "another shape")
    log.info("train: init from %s (%s, %.1f MB, sha256 %s): %d tensors checked%s, head %s (%s), mean/std from %s",
             uri, kind, len(payload) / 1e6, record["sha256"][:12], len(state),
             " (took " + " and ".join(unwrapped) + ")" if unwrapped else "", head, why, origin)
    return InitPlan(record, cfg.model_copy(update={"augment": augment}), shipped)


def apply(model: torch.nn.Module, payload: bytes, record: dict[str, Any], model_name: str) -> None:
    """Load the checked init into `model` (freshly built and seeded): the backbone from the source;
    the head from it when `record['head']` is kept, else the model's own fresh head stays."""
    shipped = record.get("shipped") or {"sha256": record["sha256"], "kind": record["kind"]}
    if storage.sha256_bytes(payload) != shipped["sha256"]:  # the driver checked exactly these bytes
        raise RuntimeError(f"init weights from {record['source']} arrived with another sha256; rerun")
    state, _ = parse(payload, "torch" if shipped["kind"] == "raymill" else shipped["kind"], record["source"])
    head = HEAD_PREFIX[model_name]
    keep = record["head"] == "kept"
    own = model.state_dict()
    taken = [k for k in own if (keep or not k.startswith(head)) and (k in state or not k.endswith(COUNTERS))]
    merged = {**own, **{k: state[k] for k in taken}}  # a counter the source lacks stays the model's own 0
    model.load_state_dict(merged, strict=True)
