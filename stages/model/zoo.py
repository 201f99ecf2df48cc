"""Model zoo for the training stage: a small fast CNN and torchvision-compatible ResNets.

Pure PyTorch (no torchvision dependency). The ResNet modules use exactly the
module/parameter names of ``torchvision.models.resnet`` so torchvision
state_dicts load into them with ``strict=True``.
"""

from __future__ import annotations

import typing
from typing import Callable

import torch
from torch import Tensor, nn

from stages.common.config import ModelName
from stages.model.sizes import MIN_INPUT_PX, check_input_size

__all__ = [
    "MODEL_NAMES",
    "SmallCNN",
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "build_model",
    "MIN_INPUT_PX",
    "check_input_size",
    "count_parameters",
    "resnet18",
    "resnet50",
]

MODEL_NAMES: tuple[str, ...] = typing.get_args(ModelName)  # train.model's values: the config lists them


# --------------------------------------------------------------------------- small CNN


def _conv_bn_relu(in_ch: int, out_ch: int, stride: int = 1) -> list[nn.Module]:
    """conv3x3 (no bias) -> BatchNorm -> ReLU."""
    return [
        nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    ]


class SmallCNN(nn.Module):
    """Small, fast CNN for 32-128 px RGB input.

    Four conv3x3-BN-ReLU blocks with widths (w, 2w, 4w, 4w). The first block
    uses stride 2 so the (expensive) full-resolution feature map is never
    materialised; blocks are separated by 2x2 max-pools and followed by global
    average pooling, so any input size >= 15 px works (MIN_INPUT_PX). At 64x64 input the
    blocks run at 32, 16, 8 and 4 px.
    """

    def __init__(self, num_classes: int, width: int = 32, dropout: float = 0.0, in_channels: int = 3) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            *_conv_bn_relu(in_channels, w, stride=2),
            nn.MaxPool2d(2),
            *_conv_bn_relu(w, 2 * w),
            nn.MaxPool2d(2),
            *_conv_bn_relu(2 * w, 4 * w),
            nn.MaxPool2d(2),
            *_conv_bn_relu(4 * w, 4 * w),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc = nn.Linear(4 * w, num_classes)
        _kaiming_init(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


# --------------------------------------------------------------------------- ResNet


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs), as in torchvision."""

    expansion: int = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck block (stride on the 3x3 conv), as in torchvision."""

    expansion: int = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Standard ImageNet ResNet (7x7/2 stem + maxpool, four stages, GAP, fc).

    Module names match ``torchvision.models.ResNet``; the optional dropout
    module has no parameters, so state_dict keys are unchanged.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 1000,
        dropout: float = 0.0,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc = nn.Linear(512 * block.expansion, num_classes)

        _kaiming_init(self)
        if zero_init_residual:
            # Each residual branch starts as identity (https://arxiv.org/abs/1706.02677).
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)
                elif isinstance(m, BasicBlock):
                    nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(
        self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample: nn.Module | None = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers.extend(block(self.inplanes, planes) for _ in range(1, blocks))
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


def _kaiming_init(model: nn.Module) -> None:
    """torchvision's init: Kaiming-normal (fan_out, relu) convs, BN weight=1/bias=0.

    Linear layers keep PyTorch's default init, as torchvision's ResNet does.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def resnet18(num_classes: int = 1000, dropout: float = 0.0, zero_init_residual: bool = False) -> ResNet:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2])."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, dropout, zero_init_residual)


def resnet50(num_classes: int = 1000, dropout: float = 0.0, zero_init_residual: bool = False) -> ResNet:
    """ResNet-50 (Bottleneck, [3, 4, 6, 3])."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, dropout, zero_init_residual)


# --------------------------------------------------------------------------- factory


def build_model(name: str, num_classes: int, width: int = 32, dropout: float = 0.0) -> nn.Module:
    """Build model ``name`` (one of :data:`MODEL_NAMES`) with ``num_classes`` outputs.

    ``width`` sets the base channel count of ``small_cnn`` only: the ResNets are
    the standard architectures with fixed stage widths (64..512), which is what
    keeps them state_dict-compatible with torchvision, so ``width`` is ignored
    for them. ``dropout`` (if > 0) is applied right before the final linear layer.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    builders: dict[str, Callable[[], nn.Module]] = {
        "small_cnn": lambda: SmallCNN(num_classes, width=width, dropout=dropout),
        "resnet18": lambda: resnet18(num_classes, dropout=dropout),
        "resnet50": lambda: resnet50(num_classes, dropout=dropout),
    }
    if name not in builders:
        raise ValueError(
            f"train.model={name!r} is not a known model; choose one of {', '.join(MODEL_NAMES)}"
        )
    if name == "small_cnn" and width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    return builders[name]()


def from_info(info: dict, state_dict: dict) -> nn.Module:
    """The published model that model.json's `info` describes, with `state_dict` loaded, in eval mode."""
    model = build_model(info["architecture"], len(info["classes"]), info["width"], info.get("dropout", 0.0))
    model.load_state_dict(state_dict)
    return model.eval()


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters in ``model`` (all, or only those with requires_grad)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
