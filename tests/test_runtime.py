"""The CPU forward pass in onnxruntime (stages/model/runtime.py): the answers torch gives, a graph
exported once and then read from the cache, a damaged cache file replaced, a cache that cannot be
written, and the refusals. The model is the session's smoke run's (tests/conftest.py `smoke_run`)."""
from __future__ import annotations

import copy
import logging
import os

import numpy as np
import pytest
import torch

from stages.common.config import ConfigError, load_config
from stages.model import predict, runtime
from tests.conftest import REPO


@pytest.fixture(scope="module")
def trained(smoke_run):
    assert smoke_run.returncode == 0, smoke_run.stderr[-3000:]
    return predict.load_model(str(smoke_run.run_dir / "train"))


def _images(info: dict, count: int) -> list[np.ndarray]:
    size = info["image_size"]
    rng = np.random.default_rng(7)
    return list(rng.integers(0, 256, (count, size, size, 3), dtype=np.uint8))


def test_onnxruntime_answers_as_torch_and_its_graph_is_exported_once(trained, tmp_path, caplog):
    model, info = trained
    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="stages.model.runtime")
    forward = runtime.for_device(model, info, "auto", torch.device("cpu"), 1, str(cache))
    assert runtime.engine_name(forward) == "onnxruntime" and forward.source.startswith("exported")
    (kept,) = cache.glob("*.onnx")
    assert sorted(p.name for p in cache.iterdir()) == sorted([kept.name, kept.with_suffix(".lock").name])  # no partial
    images = _images(info, 5)
    ours, torchs = (predict.predict_arrays(m, info, images, top_k=3) for m in (forward, model))
    assert [p["class_index"] for p in ours] == [p["class_index"] for p in torchs]
    for a, b in zip(ours, torchs):
        assert np.allclose([t["probability"] for t in a["top_k"]], [t["probability"] for t in b["top_k"]], atol=1e-5)
    assert predict.predict_arrays(forward, info, np.stack(images[:1]))[0]["class_index"] == ours[0]["class_index"]

    os.utime(kept, (1e9, 1e9))  # an old graph: a cached read makes it the newest, as the eviction counts
    again = runtime.for_device(model, info, "auto", torch.device("cpu"), 1, str(cache))
    assert again.source == f"cached {kept}" and kept.stat().st_mtime > 1e9

    # A cached graph that is not these weights' (here: the same model.json, weights changed after)
    # is never used: exported again from the model given, and replaced.
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(0.5)
    before = kept.read_bytes()
    mended = runtime.for_device(other, info, "onnxruntime", torch.device("cpu"), 1, str(cache))
    assert mended.source.startswith("exported") and "is unusable" in caplog.text and "differ from torch" in caplog.text
    assert kept.read_bytes() != before
    assert predict.predict_arrays(mended, info, images)[0]["top_k"][0]["probability"] == pytest.approx(
        predict.predict_arrays(other, info, images)[0]["top_k"][0]["probability"], abs=1e-5)


def test_a_cache_that_cannot_be_written_still_serves_and_says_so(trained, tmp_path, caplog):
    model, info = trained
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    forward = runtime.for_device(model, info, "auto", torch.device("cpu"), 1, str(blocker / "onnx"))
    assert runtime.engine_name(forward) == "onnxruntime"
    assert "could not keep the ONNX graph" in caplog.text


def test_torch_when_asked_or_on_a_gpu_and_the_refusals(trained):
    model, info = trained
    assert runtime.for_device(model, info, "torch", torch.device("cpu"), 1) is model
    with pytest.raises(runtime.EngineError, match="set serve.engine to auto or torch"):
        runtime.for_device(model, info, "onnxruntime", torch.device("cuda"), 1, key="serve.engine")
    with pytest.raises(ConfigError, match="infer.engine 'tensorrt' is not one of auto, torch, onnxruntime"):
        runtime.for_device(model, info, "tensorrt", torch.device("cpu"), 1, key="infer.engine")
    for section in ("serve", "infer"):
        with pytest.raises(ConfigError, match=f"'{section}'.*engine=onnxruntime runs the model on the CPU"):
            load_config(str(REPO / "configs/default.yaml"), [f"{section}.use_gpu=true", f"{section}.engine=onnxruntime"])
    assert load_config(str(REPO / "configs/default.yaml"), ["serve.use_gpu=true"]).serve.engine == "auto"


def test_the_cache_keeps_the_graphs_used_last(tmp_path):
    for age in range(runtime.CACHE_KEEP + 2):
        graph = tmp_path / f"{age:02d}.onnx"
        graph.write_bytes(b"g")
        os.utime(graph, (1e9 - age, 1e9 - age))  # 00 is the newest
    runtime._evict(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.onnx")) == [f"{age:02d}.onnx" for age in range(runtime.CACHE_KEEP)]


def test_a_model_the_export_cannot_build_runs_in_torch_under_auto_and_stops_when_asked_by_name(tmp_path, caplog):
    """The export runs in a child process that rebuilds the model from model.json's architecture: one
    this raymill does not know (a newer version's) fails there, with the child's reason."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 3, 2)).eval()
    info = {"weights_sha256": "0" * 64, "architecture": "from_a_newer_raymill", "width": 0, "classes": ["a", "b"],
            "image_size": 8, "mean": [0.5] * 3, "std": [0.25] * 3, "dropout": 0.0}
    assert runtime.for_device(model, info, "auto", torch.device("cpu"), 1, str(tmp_path)) is model
    assert "onnxruntime cannot run this model (the ONNX export failed: " in caplog.text
    assert "from_a_newer_raymill" in caplog.text and "torch runs it" in caplog.text
    with pytest.raises(runtime.EngineError, match="serve.engine=onnxruntime cannot run this model: .*set serve.engine=torch"):
        runtime.for_device(model, info, "onnxruntime", torch.device("cpu"), 1, str(tmp_path), key="serve.engine")
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob(".*"))


def test_raymill_serve_with_onnxruntime_named_that_cannot_run_the_model_exits_2_before_serve_starts(
        trained, ray_session, tmp_path, capsys):
    """A model whose logits are not finite (its last layer's weights inf): the graph's check fails, so
    it is never used. Asked for by name, the driver says so at once (exit 2, the key and the fix),
    before Serve retries a replica that could never start. (Logits scaled by 1e7 had failed the check
    when it was absolute; it is relative to the logits' scale now: test_export checks that.)"""
    from stages.model.publish import save_model
    from tests.conftest import free_port
    from workflow.__main__ import main

    model, info = trained
    state = {k: torch.full_like(v, float("inf")) if k.startswith("fc.") else v  # zoo: fc last
             for k, v in model.state_dict().items()}
    save_model(str(tmp_path), state, {k: v for k, v in info.items() if k != "weights_sha256"})
    rc = main(["serve", "--model", str(tmp_path), "--port", str(free_port()), "--set", "serve.engine=onnxruntime",
               "--set", "serve.app_name=preflight"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "serve.engine=onnxruntime cannot run this model" in err and "set serve.engine=torch" in err, err[-2000:]
    assert "differ from torch's" in err
