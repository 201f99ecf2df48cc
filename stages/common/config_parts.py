"""The building blocks of the config tree (stages/common/config.py): the frozen section base,
value types with their validators, and the search-space distributions."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

__all__ = ["Section", "RunsModel", "ImageFormats", "Distribution", "default_search_space"]


class Section(BaseModel):
    # frozen: a stage can't mutate config behind the manifest's back; forbid: typos fail loudly.
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    if not names or unknown:
        raise ValueError(f"{unknown or 'an empty list'}: name at least one format Pillow opens, e.g. "
                         "[JPEG, PNG, WEBP, BMP]")
    return names


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
