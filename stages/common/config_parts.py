"""The building blocks of the config tree (stages/common/config.py): the frozen section base,
value types with their validators, and the search-space distributions."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

__all__ = ["Section", "RunsModel", "ImageFormats", "Distribution", "default_search_space", "flat_space",
           "tune_defaults", "SET_BY_TUNE", "SHARED_IN_SEARCH"]

# train.* keys a search space may not hold (stages.tune.checks says why, naming the fix): those tune
# sets for every trial, and those every trial must share (the search's plan, host and checks are
# made once: a sampled ingest=ray_data had failed every such trial; a sampled init_from or use_gpu
# had been recorded in best.json while the trial trained from scratch, on the CPU).
SET_BY_TUNE = {"num_workers": "tune.workers_per_trial", "min_workers": "tune.workers_per_trial"}
SHARED_IN_SEARCH = ("ingest", "host", "use_gpu", "gpus_per_worker", "cpus_per_worker", "init_from", "cache_dir",
                    "storage_path", "max_failures")


class Section(BaseModel):
    # frozen: a stage can't mutate config behind the manifest's back; forbid: typos fail loudly;
    # no inf/nan: `train.lr=inf` had trained to a NaN loss after Ray's start, and
    # `serve.request_timeout_s=inf` served with no bound on a request at all.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RunsModel(Section):
    """A section that runs a published model's forward pass (infer, serve): torch on a GPU; on a CPU
    onnxruntime or torch (stages/model/runtime.py; auto: onnxruntime on a CPU, torch on a GPU)."""
    use_gpu: bool = False
    engine: Literal["auto", "torch", "onnxruntime"] = "auto"

    @model_validator(mode="after")
    def _engine_on_its_device(self) -> "RunsModel":
        if self.use_gpu and self.engine == "onnxruntime":
            raise ValueError("engine=onnxruntime runs the model on the CPU, but use_gpu is true; set engine "
                             "to auto (torch on the GPU) or torch")
        return self


def _pillow_names(v: tuple[str, ...]) -> tuple[str, ...]:
    from PIL import Image  # Pillow's own list of the formats it can open, once its plugins load

    Image.init()
    names = tuple(dict.fromkeys(str(f).upper() for f in v))  # jpeg == JPEG, as images.open_image reads them
    unknown = [n for n in names if n not in Image.OPEN]
    if not names:
        raise ValueError("an empty list: name at least one format Pillow opens, e.g. [JPEG, PNG, WEBP, BMP]")
    if unknown:  # a file extension is the usual slip: jpg, tif
        meant = {"JPG": "JPEG", "TIF": "TIFF"}
        named = ", ".join(f"{n} (did you mean {meant[n]}?)" if n in meant else n for n in unknown)
        raise ValueError(f"{named}: not a format name Pillow opens; name Pillow's formats, e.g. "
                         "[JPEG, PNG, WEBP, BMP]")
    if shelled := [n for n in names if n in _RUNS_PROGRAMS]:
        raise ValueError(f"{shelled}: Pillow renders these with Ghostscript, an outside program, on untrusted "
                         "bytes; convert them to PNG first and leave them out")
    return names


_RUNS_PROGRAMS = ("EPS", "PS")  # PostScript is a program: Pillow hands it to Ghostscript to render


# Pillow format names (etl.allowed_formats, serve.allowed_formats): upper-cased, each one Pillow opens
ImageFormats = Annotated[tuple[str, ...], AfterValidator(_pillow_names)]


class Distribution(Section):
    type: Literal["loguniform", "uniform", "choice", "randint"]
    lower: float | None = None
    upper: float | None = None
    values: tuple[Any, ...] | None = None

    @model_validator(mode="after")
    def _check_args(self) -> "Distribution":
        if self.type == "choice":
            if not self.values:
                raise ValueError("type 'choice' needs a non-empty 'values' list")
        elif self.lower is None or self.upper is None or self.lower >= self.upper:
            raise ValueError(f"type '{self.type}' needs 'lower' < 'upper'")
        elif self.type == "loguniform" and self.lower <= 0:
            raise ValueError("type 'loguniform' needs 'lower' > 0")
        return self


def tune_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A tune section's raw values with what is unset filled in: the mode the metric ranks by
    (val_loss: min), the search space flat (`flat_space`), the default space where none is given."""
    data = {**({"mode": "min"} if data.get("metric") == "val_loss" else {}), **data,
            "search_space": flat_space(data.get("search_space"))}
    if not data["search_space"]:
        space = default_search_space(_max_epochs(data.get("max_epochs", 6)))
        if data.get("scheduler") == "pbt":  # PBT clones trials at equal epochs: one length for all
            space.pop("epochs")
        data["search_space"] = space
    return data


def _max_epochs(value: Any) -> int:
    """tune.max_epochs read before pydantic checks it (the default space needs it): `null`, `[1]` or
    `bad` had raised TypeError or named only the section."""
    whole = isinstance(value, float) and value.is_integer() and value > 0  # 6.0, as pydantic takes it
    if not whole and (isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit()):
        raise ValueError(f"tune.max_epochs must be a whole number of epochs (got {value!r}); set e.g. "
                         f"tune.max_epochs=6")
    return int(value)


def flat_space(space: Any, prefix: str = "") -> Any:
    """A search space with nested keys written flat: `--set tune.search_space.augment.flip={...}`
    nests `flip` under `augment`, which had been read as a distribution named `augment` ("type:
    Field required"). A dict of dicts without `type` is a group of keys; anything else is left to
    validation (`{lr: {lower: 0.1}}` still says that lr's `type` is missing)."""
    if not isinstance(space, dict):
        return space
    flat: dict[str, Any] = {}
    for key, value in space.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()) \
                and "type" not in value:
            flat.update(flat_space(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def default_search_space(max_epochs: int) -> dict[str, Distribution]:
    """lr, weight decay, the augmentation switches and the training length (half to all of
    `max_epochs`: the LR schedule decays to its end, so length is a real choice, not a cut-off)."""
    lengths = tuple(sorted({max(1, max_epochs // 2), max_epochs}))
    return {
        "lr": Distribution(type="loguniform", lower=0.005, upper=0.2),
        "weight_decay": Distribution(type="loguniform", lower=1e-5, upper=1e-3),
        "augment.flip": Distribution(type="choice", values=(False, True)),
        "augment.random_resized_crop": Distribution(type="choice", values=(True, False)),
        "epochs": Distribution(type="choice", values=lengths),
    }
