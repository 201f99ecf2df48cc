"""The weights a training run starts from (`train.init_from`): read, checked and applied, never unpickled.

A source is one of:
- a raymill train or tune output folder: its `model.pt`, checked against `model.json`'s sha256;
- a torchvision-format state dict (`.pth` / `.pt`, as torchvision publishes its ResNets);
- a `.safetensors` file with the same keys.
Local or s3://. `prepare` runs on the driver before any worker starts and turns every problem
into a ConfigError (exit 2) that names the keys and the fix: the backbone must fit the model
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
import json
import logging
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from stages.common import storage
from stages.common.config import AugmentConfig, ConfigError, TrainConfig
from stages.model.zoo import build_model

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "HEAD_PREFIX", "InitPlan", "prepare", "source_sha256", "read_source",
           "parse", "check_keys", "apply"]

log = logging.getLogger(__name__)

# torchvision's ImageNet weights (IMAGENET1K_V1/V2) were trained on inputs normalised with these
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The classifier head's parameter prefix per architecture (zoo.py: `self.fc` in each)
HEAD_PREFIX = {"small_cnn": "fc.", "resnet18": "fc.", "resnet50": "fc."}
_SHOWN = 5  # keys named in a refusal; the count says how many more


@dataclass(frozen=True)
class InitPlan:
    """A checked init: what the workers load (`payload`), what manifests record, and the
    effective train config (its augment mean/std possibly taken from the source)."""
    record: dict[str, Any]  # source, kind, sha256, bytes, head ("kept"/"replaced"), mean, std, normalisation
    train: TrainConfig
    payload: bytes


def _kind(uri: str) -> str:
    name = str(uri).rstrip("/").lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    return "torch" if name.endswith((".pth", ".pt")) else "raymill"


def _read(uri: str, s3: Any | None, what: str) -> bytes:
    """The bytes of `uri`; every way of failing becomes a ConfigError naming the fix."""
    try:
        fs, path = storage.filesystem(uri, s3)
        return fs.cat_file(path)
    except FileNotFoundError:
        raise ConfigError(f"train.init_from: {what} '{uri}' does not exist; pass a raymill train/tune output "
                          f"folder, a .pth/.pt state dict or a .safetensors file") from None
    except IsADirectoryError:
        raise ConfigError(f"train.init_from: '{uri}' is a folder, expected a file; name the weights file "
                          f"itself, or pass a raymill output folder (with model.json)") from None
    except Exception as e:  # s3 without credentials, no permission, endpoint down
        first = (str(e).splitlines() or [""])[0][:200]
        raise ConfigError(f"train.init_from: cannot read '{uri}' ({type(e).__name__}: {first}); check the path "
                          f"and, for s3://, the credentials (AWS_ACCESS_KEY_ID, ...) and s3.endpoint_url") from None


def read_source(uri: str, s3: Any | None = None) -> tuple[str, bytes, dict | None]:
    """(kind, weights bytes, model.json of a raymill folder or None)."""
    kind = _kind(uri)
    if kind != "raymill":
        return kind, _read(uri, s3, "file"), None
    try:
        info = json.loads(_read(storage.join(uri, "model.json"), s3, "model.json of"))
    except ConfigError as e:
        raise ConfigError(f"{e} (a path not ending in .pth, .pt or .safetensors is read as a raymill train or "
                          f"tune output folder, which holds model.json + model.pt)") from None
    except ValueError:
        raise ConfigError(f"train.init_from: '{uri}/model.json' is not JSON; re-publish that model") from None
    payload = _read(storage.join(uri, "model.pt"), s3, "model.pt of")
    if storage.sha256_bytes(payload) != info.get("weights_sha256"):
        raise ConfigError(f"train.init_from: '{uri}/model.pt' does not match its model.json's weights_sha256 "
                          f"(changed or half-copied); copy the folder again or re-run that training")
    return kind, payload, info


def source_sha256(uri: str, s3: Any | None = None) -> str:
    """The sha256 of the weights `uri` names, without parsing them (a raymill folder: model.json's)."""
    if _kind(uri) == "raymill":
        try:
            return json.loads(_read(storage.join(uri, "model.json"), s3, "model.json of"))["weights_sha256"]
        except ConfigError:
            raise
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"train.init_from: '{uri}/model.json' names no weights_sha256; "
                              f"re-publish that model") from None
    try:
        fs, path = storage.filesystem(uri, s3)
        info = fs.info(path)
        # `raymill run` asks for it up to twice (its reuse key, then train's own): a 100 MB file is
        # hashed once a process while its size and modification stamp stay the same
        stamp = info.get("mtime") or info.get("LastModified") or info.get("ETag")
        if stamp is None:  # nothing tells a changed file apart: hash it every time
            return storage.sha256_file(fs, path)[0]
        key = (uri, info.get("size"), str(stamp))
        if key not in _HASHED:
            _HASHED[key] = storage.sha256_file(fs, path)[0]
        return _HASHED[key]
    except Exception:
        _read(uri, s3, "file")  # raises the ConfigError that names the fix
        raise


_HASHED: dict[tuple, str] = {}  # (uri, size, modification stamp) -> sha256: source_sha256's memo


def parse(payload: bytes, kind: str, uri: str) -> dict[str, torch.Tensor]:
    """A flat {name: tensor} state dict from `payload`; nothing is unpickled."""
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
                              f"{': ' + str(e).splitlines()[0][:200] if str(e) else ''}); check the file") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ConfigError(f"train.init_from: '{uri}' is not a flat state dict (parameter name -> tensor); a "
                          f"training checkpoint? Save its model's weights alone: torch.save(model.state_dict(), path)")
    return state


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
    missing = [k for k in expected if not k.startswith(head) and k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = ([f"missing keys {_names(missing)}"] if missing else []) + \
                ([f"unexpected keys {_names(unexpected)}"] if unexpected else [])
        hint = ("the keys carry DDP's 'module.' prefix: save model.module.state_dict() instead"
                if unexpected and all(k.startswith("module.") for k in state) else
                f"are these weights of another architecture? Set train.model to the one they were trained "
                f"as ({', '.join(HEAD_PREFIX)}), or pass weights of train.model={model_name}")
        raise ConfigError(f"train.init_from: '{uri}' does not fit train.model={model_name}: "
                          f"{'; '.join(parts)}; {hint}")
    wrong = [f"{k} {tuple(state[k].shape)} vs {expected[k]}" for k in expected
             if not k.startswith(head) and tuple(state[k].shape) != expected[k]]
    if wrong:
        fix = ("set train.width to the width the weights were trained with" if model_name == "small_cnn"
               else f"pass weights of train.model={model_name}")
        raise ConfigError(f"train.init_from: '{uri}' has shapes that do not fit train.model={model_name} "
                          f"(file vs model): {_names(wrong)}; {fix}")
    return all(k in state and tuple(state[k].shape) == expected[k] for k in expected if k.startswith(head))


def _normalisation(augment: AugmentConfig, expected: tuple | None, uri: str) -> tuple[AugmentConfig, str]:
    """augment with mean/std taken from the source where the user did not set them, and where from."""
    if expected is None:
        return augment, "config"
    chosen = {name: tuple(float(x) for x in value) for name, value in zip(("mean", "std"), expected)
              if name not in augment.model_fields_set}
    for name, value in zip(("mean", "std"), expected):
        if name in augment.model_fields_set and tuple(getattr(augment, name)) != tuple(value):
            log.warning(f"train: train.augment.{name}={list(getattr(augment, name))} was set explicitly; the "
                        f"init weights '{uri}' expect {list(value)}: kept the setting")
    return augment.model_copy(update=chosen), "init" if chosen else "config"


def prepare(cfg: TrainConfig, classes: Sequence[str], s3: Any | None = None,
            model_names: Sequence[str] = ()) -> InitPlan:
    """Read and check `cfg.init_from` against every model that will train (`model_names`, default
    train.model) on `classes`; raises ConfigError before any work."""
    uri = str(cfg.init_from)
    kind, payload, info = read_source(uri, s3)
    state = parse(payload, "torch" if kind == "raymill" else kind, uri)
    heads_fit = []
    for name in dict.fromkeys(model_names or [cfg.model]):
        if info is not None and info.get("architecture") != name:
            raise ConfigError(f"train.init_from: '{uri}' is a {info.get('architecture')} model; set "
                              f"train.model={info.get('architecture')}, or start {name} from other weights")
        heads_fit.append(check_keys(state, name, classes, cfg.width, uri))
    same_classes = info is not None and list(info.get("classes", [])) == list(classes)
    head = "kept" if all(heads_fit) and same_classes else "replaced"
    expected = None
    if info is not None and info.get("mean") and info.get("std"):
        expected = (info["mean"], info["std"])
    elif info is None and cfg.model.startswith("resnet"):  # a bare ResNet: torchvision's ImageNet weights
        expected = (IMAGENET_MEAN, IMAGENET_STD)
    augment, origin = _normalisation(cfg.augment, expected, uri)
    record = {"source": uri, "kind": kind, "sha256": storage.sha256_bytes(payload), "bytes": len(payload),
              "head": head, "mean": list(augment.mean), "std": list(augment.std), "normalisation": origin}
    why = "same classes" if head == "kept" else ("the source names no classes" if info is None
                                                 else "other classes" if not same_classes else "another shape")
    log.info(f"train: init from {uri} ({kind}, {len(payload) / 1e6:.1f} MB, sha256 {record['sha256'][:12]}): "
             f"{len(state)} tensors checked, head {head} ({why}), mean/std from {origin}")
    return InitPlan(record, cfg.model_copy(update={"augment": augment}), payload)


def apply(model: torch.nn.Module, payload: bytes, record: dict[str, Any], model_name: str) -> None:
    """Load the checked init into `model` (freshly built and seeded): the backbone from the source;
    the head from it when `record['head']` is kept, else the model's own fresh head stays."""
    if storage.sha256_bytes(payload) != record["sha256"]:  # the driver checked exactly these bytes
        raise RuntimeError(f"init weights from {record['source']} arrived with another sha256; rerun")
    state = parse(payload, "torch" if record["kind"] == "raymill" else record["kind"], record["source"])
    head = HEAD_PREFIX[model_name]
    keep = record["head"] == "kept"
    own = model.state_dict()
    merged = {k: (state[k] if keep or not k.startswith(head) else v) for k, v in own.items()}
    model.load_state_dict(merged, strict=True)
