"""Tests for stages.model.zoo (CPU only, fast)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stages.model.zoo import MIN_INPUT_PX, MODEL_NAMES, build_model, check_input_size, count_parameters

NUM_CLASSES = 7


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize(("name", "batch"), [("small_cnn", 4), ("resnet18", 4), ("resnet50", 2)])
def test_output_shape(name: str, batch: int) -> None:
    model = build_model(name, NUM_CLASSES).eval()
    with torch.no_grad():
        out = model(torch.randn(batch, 3, 64, 64))
    assert out.shape == (batch, NUM_CLASSES)
    assert torch.isfinite(out).all()


def test_model_names() -> None:
    assert MODEL_NAMES == ("small_cnn", "resnet18", "resnet50")


@pytest.mark.parametrize("size", [32, 48, 96])
def test_small_cnn_any_input_size(size: int) -> None:
    model = build_model("small_cnn", 3, width=8, dropout=0.2).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, size, size)).shape == (2, 3)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_min_input_size_is_the_smallest_that_runs(name: str) -> None:
    least = MIN_INPUT_PX[name]
    model = build_model(name, 3, width=8).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 3, least, least)).shape == (1, 3)
        if least > 1:
            with pytest.raises(RuntimeError):
                model(torch.zeros(1, 3, least - 1, least - 1))
            with pytest.raises(ValueError, match=f"etl.image_size>={least}"):
                check_input_size(name, least - 1)
    check_input_size(name, least)


@pytest.mark.parametrize(("name", "expected"), [("resnet18", 11_689_512), ("resnet50", 25_557_032)])
def test_resnet_parameter_count_matches_torchvision(name: str, expected: int) -> None:
    assert count_parameters(build_model(name, 1000)) == expected


def test_resnet_width_and_dropout_do_not_change_parameters() -> None:
    a = build_model("resnet18", 10)
    b = build_model("resnet18", 10, width=8, dropout=0.5)
    assert list(a.state_dict()) == list(b.state_dict())
    assert count_parameters(a) == count_parameters(b)


def test_resnet_state_dict_keys_match_torchvision_names() -> None:
    keys18 = set(build_model("resnet18", 10).state_dict())
    assert {"conv1.weight", "bn1.running_mean", "layer4.1.bn2.running_var", "fc.weight", "fc.bias"} <= keys18
    assert "layer2.0.downsample.1.weight" in keys18
    assert "layer1.0.downsample.0.weight" not in keys18  # no projection in resnet18 stage 1
    keys50 = set(build_model("resnet50", 10).state_dict())
    assert {"layer1.0.downsample.0.weight", "layer1.0.downsample.1.running_var", "layer4.2.bn3.weight"} <= keys50
    assert "layer3.5.conv3.weight" in keys50 and "layer3.6.conv1.weight" not in keys50
    # torchvision's state_dicts (params + BN buffers incl. num_batches_tracked) have 122 / 320 entries.
    assert (len(keys18), len(keys50)) == (122, 320)


def test_unknown_name_raises() -> None:
    with pytest.raises(ValueError) as exc:
        build_model("foo", 10)
    msg = str(exc.value)
    assert "'foo'" in msg
    for name in MODEL_NAMES:
        assert name in msg


def test_count_parameters_small() -> None:
    assert count_parameters(nn.Linear(3, 2)) == 8


def _separable_data(n: int = 64, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Two classes: the bright blob is in the left half or in the right half."""
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 2, (n,), generator=g)
    x = 0.3 * torch.randn(n, 3, size, size, generator=g)
    half = size // 2
    for i in range(n):
        if y[i] == 0:
            x[i, :, :, :half] += 1.0
        else:
            x[i, :, :, half:] += 1.0
    return x, y


def test_small_cnn_learns() -> None:
    x, y = _separable_data()
    model = build_model("small_cnn", 2, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    model.train()
    with torch.no_grad():
        initial = loss_fn(model(x), y).item()
    for _ in range(40):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    model.eval()
    with torch.no_grad():
        logits = model(x)
    final = loss_fn(logits, y).item()
    accuracy = (logits.argmax(1) == y).float().mean().item()
    assert final < 0.5 * initial, (initial, final)
    assert accuracy >= 0.95, accuracy


@pytest.mark.parametrize("name", ["small_cnn", "resnet18"])
def test_channels_last_matches_contiguous(name: str) -> None:
    model = build_model(name, NUM_CLASSES).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        model_cl = model.to(memory_format=torch.channels_last)
        x_cl = x.contiguous(memory_format=torch.channels_last)
        assert x_cl.is_contiguous(memory_format=torch.channels_last)
        out = model_cl(x_cl)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
