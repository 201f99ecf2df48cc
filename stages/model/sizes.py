"""The smallest image each model takes: checked before any work starts, without importing torch
(`raymill run` checks it before Ray starts and torch loads, stages.model.zoo re-exports it)."""
from __future__ import annotations

from typing import Sequence

from stages.common.config import ConfigError

__all__ = ["MIN_INPUT_PX", "check_input_size", "check_image_size"]

# The smallest square input each model accepts. SmallCNN divides by 16 (a stride-2 conv and three
# 2x2 max-pools); below 15 px its last pool gets a 1x1 map and torch fails mid-trial. The ResNets
# end in stride-2 convs with padding, which never reach 0, and an adaptive pool.
MIN_INPUT_PX: dict[str, int] = {"small_cnn": 15, "resnet18": 1, "resnet50": 1}


def check_input_size(name: str, size: int) -> None:
    """Raise ValueError, naming the fix, when ``name`` cannot take ``size`` x ``size`` images."""
    least = MIN_INPUT_PX.get(name, 1)
    if size < least:
        raise ValueError(f"train.model={name} needs images of at least {least} px, but the data is {size} px; "
                         f"re-run ETL with etl.image_size>={least} or choose train.model=resnet18")


def check_image_size(model_names: Sequence[str], size: int) -> None:
    """Refuse (exit 2) a model that cannot take the data's image size, before any worker starts."""
    for name in dict.fromkeys(model_names):
        try:
            check_input_size(name, size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
