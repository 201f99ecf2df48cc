"""Where `train.init_from`'s weights come from: read, hashed and sniffed without torch.

`check` runs in the CLI's preflight, before Ray starts and torch is imported: a wrong path, an
unreadable object, a raymill folder whose model.pt was changed, or a file that is not the kind its
name says had been refused only after Ray and the trainer had started (17-19 s on 2 cores). Parsing
the tensors and fitting them to the model stay in stages.model.init_weights, which needs torch.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, BinaryIO, Iterator, Sequence

from stages.common import storage
from stages.common.config import ConfigError

__all__ = ["kind_of", "read", "read_source", "source_sha256", "reuse_inputs", "check", "sniff", "whole", "fits", "TORCH_SUFFIXES"]

_HASHED: dict[tuple, str] = {}  # (uri, size, modification stamp) -> sha256: source_sha256's memo
_SNIFF_BYTES = 32
# torch.save's legacy (pickle) format opens with this number, pickled: a LONG1 of 10 bytes
_TORCH_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on its JSON header


# torch.save files by the names they go by: .pt/.pth, Lightning's .ckpt, the PyTorch tutorial's
# .tar for checkpoints, Hugging Face's pytorch_model.bin
TORCH_SUFFIXES = (".pth", ".pt", ".ckpt", ".tar", ".bin")


def kind_of(uri: str, s3: Any | None = None, look: bool = False) -> str:
    """'safetensors', 'torch' (TORCH_SUFFIXES) or 'raymill' (any other path: an output folder).
    `look`: a folder that holds model.json is a raymill output whatever its name (run.ckpt/)."""
    name = str(uri).rstrip("/").lower()
    kind = "safetensors" if name.endswith(".safetensors") else "torch" if name.endswith(TORCH_SUFFIXES) else "raymill"
    if look and kind != "raymill":
        with contextlib.suppress(Exception):  # unreadable: the read that follows names the problem
            fs, path = storage.filesystem(uri, s3)
            if fs.isdir(path) and fs.exists(storage.join(path, "model.json")):
                return "raymill"
    return kind


@contextlib.contextmanager
def _reading(uri: str, what: str) -> Iterator[None]:
    """Every way a read of `uri` fails, as a ConfigError naming the fix."""
    try:
        yield
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"train.init_from: {what} '{uri}' does not exist; pass a raymill train/tune output "
                          f"folder, a .pth/.pt/.ckpt state dict or checkpoint, or a .safetensors file") from None
    except NotADirectoryError:
        if kind_of(uri) != "raymill":
            raise ConfigError(f"train.init_from: a part of the path '{uri}' is a file, not a folder; check the "
                              f"path") from None
        # a weights file read as a raymill folder (uri is its model.json): its name has no weights suffix
        raise ConfigError(f"train.init_from: '{uri}' lies under a file, not a folder; a weights file must end in "
                          f"{', '.join(TORCH_SUFFIXES)} or .safetensors (rename it), and a raymill output folder "
                          f"holds model.json + model.pt") from None
    except IsADirectoryError:
        raise ConfigError(f"train.init_from: '{uri}' is a folder, expected a file; name the weights file "
                          f"itself, or pass a raymill output folder (with model.json)") from None
    except Exception as e:  # s3 without credentials, no permission, endpoint down
        first = (str(e).splitlines() or [""])[0][:200]
        raise ConfigError(f"train.init_from: cannot read '{uri}' ({type(e).__name__}: {first}); check the path "
                          f"and, for s3://, the credentials (AWS_ACCESS_KEY_ID, ...) and s3.endpoint_url") from None


def read(uri: str, s3: Any | None, what: str, head: int | None = None) -> bytes:
    """The bytes of `uri` (its first `head` bytes when given)."""
    with _reading(uri, what):
        fs, path = storage.filesystem(uri, s3)
        if head is None:
            return fs.cat_file(path)
        if fs.isdir(path):
            raise IsADirectoryError(path)
        with fs.open(path, "rb") as f:
            return f.read(head)


def _model_json(uri: str, s3: Any | None) -> dict:
    try:
        info = json.loads(read(storage.join(uri, "model.json"), s3, "the folder's model.json"))
    except ConfigError as e:
        if other := _deployed_form(uri, s3):
            raise ConfigError(f"train.init_from: '{uri}' {other}") from None
        raise ConfigError(f"{e} (a path not ending in {', '.join(TORCH_SUFFIXES)} or .safetensors is read as a "
                          f"raymill train or tune output folder, which holds model.json + model.pt)") from None
    except ValueError:
        raise ConfigError(f"train.init_from: '{uri}/model.json' is not JSON; re-publish that model") from None
    if not isinstance(info, dict) or not isinstance(info.get("weights_sha256"), str):
        raise ConfigError(f"train.init_from: '{uri}/model.json' names no weights_sha256; re-publish that model")
    return info


def _deployed_form(uri: str, s3: Any | None) -> str | None:
    """What a path that is no raymill output folder is, when it is a model raymill handed out in
    another form (an export, its ONNX file, an MLflow model): said with the path to start from."""
    start = "training starts from weights: pass the train or tune output folder it came from"
    if str(uri).rstrip("/").lower().endswith(".onnx"):
        return f"is an ONNX graph (raymill export), not weights; {start}"
    with contextlib.suppress(Exception):  # unreadable: the caller's own message stands
        fs, path = storage.filesystem(uri, s3)
        if fs.exists(storage.join(path, "manifest.json")):
            manifest = storage.read_json(fs, storage.join(path, "manifest.json"))
            if manifest.get("kind") == "raymill.export":
                return f"is a raymill export, not weights; {start} ('{manifest['inputs']['model']}')"
        if fs.exists(storage.join(path, "MLmodel")):
            inner = next((storage.join(uri, *p) for p in (("artifacts",), ("artifacts", "artifacts"))
                          if fs.exists(storage.join(path, *p, "model.json"))), None)
            return (f"is an MLflow model; pass the raymill model inside it, '{inner}'" if inner else
                    f"is an MLflow model without a raymill model inside; {start}")
    return None


def _mismatch(uri: str) -> ConfigError:
    return ConfigError(f"train.init_from: '{uri}/model.pt' does not match its model.json's weights_sha256 "
                       f"(changed or half-copied); copy the folder again or re-run that training")


def read_source(uri: str, s3: Any | None = None) -> tuple[str, bytes, dict | None]:
    """(kind, weights bytes, model.json of a raymill folder or None)."""
    kind = kind_of(uri, s3, look=True)
    if kind != "raymill":
        return kind, read(uri, s3, "file"), None
    info = _model_json(uri, s3)
    payload = read(storage.join(uri, "model.pt"), s3, "the folder's model.pt")
    if storage.sha256_bytes(payload) != info["weights_sha256"]:
        raise _mismatch(uri)
    return kind, payload, info


def _file_sha256(uri: str, s3: Any | None, what: str = "file") -> str:
    """A file's sha256, streamed; hashed once a process while its size and modification stamp stay
    the same (`raymill run` asks up to three times: preflight, its reuse key, train's own)."""
    with _reading(uri, what):
        fs, path = storage.filesystem(uri, s3)
        info = fs.info(path)
        stamp = info.get("mtime") or info.get("LastModified") or info.get("ETag")
        if stamp is None:  # nothing tells a changed file apart: hash it every time
            return storage.sha256_file(fs, path)[0]
        key = (uri, info.get("size"), str(stamp))
        if key not in _HASHED:
            _HASHED[key] = storage.sha256_file(fs, path)[0]
        return _HASHED[key]


def source_sha256(uri: str, s3: Any | None = None) -> str:
    """The sha256 of the weights `uri` names, without parsing them (a raymill folder: model.json's)."""
    if kind_of(uri, s3, look=True) == "raymill":
        return _model_json(uri, s3)["weights_sha256"]
    return _file_sha256(uri, s3)


def reuse_inputs(init_from: str | None, s3: Any | None = None) -> dict[str, str]:
    """What a published output records of its init weights, to be reused only for the same content
    (torch-free: `raymill run` decides each stage's reuse before torch and Ray load)."""
    return {"init_sha256": source_sha256(init_from, s3)} if init_from else {}


def sniff(head: bytes, kind: str, uri: str) -> None:
    """Refuse bytes that cannot be `kind` by their first bytes: torch.save writes a zip archive
    (or, before torch 1.6, a pickle); a .safetensors file starts with its header's length and '{'.
    An unpickler reading a text or image file had said it "holds objects that are not plain tensors"."""
    if kind == "safetensors":
        if len(head) < 9 or head[8:9] != b"{":
            raise ConfigError(f"train.init_from: '{uri}' is not a readable .safetensors file (no JSON header "
                              f"after its first 8 bytes); check the file, or rename it if it is a torch.save file")
    elif not (head.startswith(b"PK\x03\x04") or head.startswith(b"\x80")):
        seen = "it is empty" if not head else f"it starts with {head[:8]!r}"
        raise ConfigError(f"train.init_from: '{uri}' is not a readable torch.save file (neither the zip archive "
                          f"torch.save writes nor a pickle: {seen}); check the file, or name a .safetensors file "
                          f"by that suffix")
    elif head.startswith(b"\x80") and not _legacy_torch(head):
        raise ConfigError(f"train.init_from: '{uri}' is a pickle that torch.save did not write (pickle.dump?), and "
                          f"loading it would run its code; refused. Save the weights alone: "
                          f"torch.save(model.state_dict(), path), or safetensors.torch.save_file")


def _legacy_torch(head: bytes) -> bool:
    """Whether a pickle opens as torch.save's legacy format does: its magic number first (after the
    protocol, and protocol 4+'s frame)."""
    at = 11 if head[2:3] == b"\x95" else 2
    return head[at:at + len(_TORCH_MAGIC)] == _TORCH_MAGIC


def whole(f: BinaryIO, size: int, kind: str, uri: str) -> None:
    """Refuse a weights file `f` of `size` bytes cut short (a half-copied download): a torch.save
    zip archive must end in its directory, and a .safetensors file must be as long as its header
    says. Reads the ends, not the tensors."""
    import zipfile

    cut = f"train.init_from: '{uri}' is incomplete ({{}}): a truncated or half-copied file; copy it again"
    if kind == "torch":
        if f.read(4) != b"PK\x03\x04":
            return  # the legacy pickle format: only torch's loader can tell
        f.seek(0)
        try:
            names = zipfile.ZipFile(f).namelist()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise ConfigError(cut.format(f"its zip archive has no readable directory: {e}")) from None
        if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
            raise ConfigError(f"train.init_from: '{uri}' is a TorchScript program (torch.jit.save, or raymill export "
                              f"--format torchscript), not weights; save the weights (model.state_dict()), or pass "
                              f"the train or tune output folder it came from")
        if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
            raise ConfigError(f"train.init_from: '{uri}' is a zip archive that torch.save did not write (no "
                              f"data.pkl in it); name a torch.save or .safetensors weights file")
        return
    length = int.from_bytes(f.read(8), "little")
    try:
        header = json.loads(f.read(length)) if length <= _MAX_HEADER else None
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ConfigError(f"train.init_from: '{uri}' is not a readable .safetensors file (its header is not "
                          f"the JSON of tensors it should be); check the file") from None
    if size < 8 + length + end:
        raise ConfigError(cut.format(f"{size} bytes, where its header describes {8 + length + end}"))


def check(uri: str, s3: Any | None = None, models: tuple[str, ...] = (), width: int | None = None) -> None:
    """The checks that need no torch, for the CLI to run before Ray starts: the source exists and
    is readable; a raymill folder is a model of `models` (and a small_cnn of `width`) and, locally,
    its model.pt matches its model.json; a file's first bytes fit its kind and it is whole. A
    ConfigError (exit 2) naming the fix; the tensors are checked later (init_weights.prepare)."""
    kind = kind_of(uri, s3, look=True)
    if kind == "raymill":
        info = _model_json(uri, s3)
        fits(uri, info, models, width)
        weights = storage.join(uri, "model.pt")
        if storage.is_remote(uri):  # its checksum waits for the one download the run makes (prepare)
            read(weights, s3, "the folder's model.pt", head=_SNIFF_BYTES)
        elif _file_sha256(weights, s3, "the folder's model.pt") != info["weights_sha256"]:
            raise _mismatch(uri)
        return
    sniff(read(uri, s3, "file", head=_SNIFF_BYTES), kind, uri)
    with _reading(uri, "file"):
        fs, path = storage.filesystem(uri, s3)
        with fs.open(path, "rb") as f:
            whole(f, fs.info(path)["size"], kind, uri)


def fits(uri: str, info: dict, models: Sequence[str], width: int | None = None) -> None:
    """A raymill model (its model.json `info`) cannot start any of `models` of another architecture,
    nor a small_cnn of another `width`: said before Ray by the CLI's check (it had been said by the
    shapes, 11 s later on 2 cores), and by init_weights.prepare."""
    arch = info.get("architecture")
    if other := next((name for name in models if name != arch), None):
        raise ConfigError(f"train.init_from: '{uri}' is a {arch} model; set train.model={arch}, or start "
                          f"{other} from other weights")
    if width is not None and arch == "small_cnn" and info.get("width", width) != width:
        raise ConfigError(f"train.init_from: '{uri}' is a small_cnn of width {info['width']}; set "
                          f"train.width={info['width']}, or start width {width} from other weights")
