"""On a CUDA device: train through `raymill train`, batch inference on the GPU, the decoded tier
on the GPU, and a utilisation meter that reads what it should in a setting we control."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from stages.feed import decoded_tier
from stages.infer import stage as infer
from stages.feed import meters
from stages.train import stage as train
from tests.conftest import REPO, demo_dataset
from stages.common import session
from stages.common.config import load_config

# train.num_workers unset: planned, one worker per GPU (the acceptance run's default on any GPU node)
SETTINGS = ["train.model=resnet18", "train.use_gpu=true", "train.num_workers=null", "train.epochs=2",
            "train.batch_size=64", "etl.image_size=64", "infer.use_gpu=true", "infer.batch_size=64"]


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    from stages.common import session
    from stages.common.config import RayConfig

    yield session.start(RayConfig())  # every CPU and GPU of the device
    ray.shutdown()


@pytest.fixture(scope="module")
def trained(gpu_ray, tmp_path_factory):
    cfg = load_config(REPO / "configs/smoke.yaml", SETTINGS + ["train.decoded_tier=auto"])
    root = tmp_path_factory.mktemp("gpu")
    data = demo_dataset(root, cfg.etl, images=600, seed=0)
    return cfg, data, train.run(cfg.train, data, str(root / "train"), seed=0, ray_cfg=cfg.ray)


def test_raymill_train_runs_on_the_gpu_with_a_true_utilisation(trained):
    _, _, artifact = trained
    m = artifact.manifest
    assert m["resource_plan"]["use_gpu"] and m["resource_plan"]["decode_processes"] >= 1
    assert m["resource_plan"]["num_workers"] == torch.cuda.device_count()
    assert m["metrics"]["test_scored_in"] == "workers"
    # one GPU: one worker, in a Tune trial actor (stages/train/solo.py), its GPU seen as cuda:0
    assert m["timings"]["host"] == ("tune_trial" if torch.cuda.device_count() == 1 else "ray_train")
    rows = [json.loads(line) for line in (Path(artifact.path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["tier"] for r in rows] == ["stream", "decoded-gpu"]
    for r in rows:
        assert 0 < r["device_utilisation"] <= 1 and "GPU" in r["verdict"]
        assert r["compute_s"] <= r["wall_s"] + 1e-6


def test_raymill_infer_with_use_gpu(trained, tmp_path):
    """infer.decode=auto with use_gpu: Ray Data tasks decode, the GPU pool predicts, and the
    manifest says how busy the device was (CUDA events, summed over the actors). A job this small
    runs in the driver by default (infer.local_max_rows): on the GPU too, with the same rows."""
    cfg, data, artifact = trained
    here = infer.run(cfg.infer, artifact.path, data.path, str(tmp_path / "here")).manifest["metrics"]
    assert here["decode"] == "in-process" and here["device"] == "cuda" and here["device_busy_s"] > 0
    ray_path = cfg.infer.model_copy(update={"local_max_rows": 0})
    out = infer.run(ray_path, artifact.path, data.path, str(tmp_path / "infer"))
    m = out.manifest["metrics"]
    assert (m["rows"], m["errors"], m["accuracy"]) == (here["rows"], here["errors"], here["accuracy"])
    assert m["rows"] > 0 and m["errors"] == 0 and m["decode"] == "tasks" and m["device"] == "cuda"
    assert 0 < m["device_utilisation"] <= 1 and m["device_images_per_s"] > 0
    # infer.num_actors unset: the planned pool, one actor per GPU as far as the CPUs hold them
    assert 1 <= m["actors"] <= torch.cuda.device_count()
    assert m["actors"] == session.plan_infer(ray_path, session.cluster_resources())["num_actors"]
    assert 0 < m["device_busy_s"] <= m["predict_wall_s"] * m["actors"] + 1e-6


def test_decoded_tier_on_the_gpu_matches_itself_and_stays_there():
    device = torch.device("cuda")
    tier = decoded_tier.DecodedTier(64, 32, "gpu", device)
    pixels = torch.randint(0, 255, (64, 32, 32, 3), dtype=torch.uint8).numpy()
    tier.put(0, [(f"k{i}", 0) for i in range(64)], pixels)
    augment = {"scale_min": 0.3, "random_resized_crop": True, "flip": True}
    a = [f.images for f in tier.feed(1, 1, 0, 16, 0, 4, augment)]
    b = [f.images for f in tier.feed(1, 1, 0, 16, 0, 4, augment)]
    assert all(x.device.type == "cuda" and torch.equal(x, y) for x, y in zip(a, b))


def test_step_meter_reads_the_device_share_we_set():
    """Kernels that keep the GPU busy ~20 ms, then a host sleep of ~20 ms: utilisation ≈ 50%."""
    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    meter = meters.StepMeter(device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        (x @ x).sum()  # warm-up
    torch.cuda.synchronize()
    meter.start()
    for _ in range(20):
        x = torch.tanh(x @ x)
    meter.stop()
    busy = meter.busy_s()
    meter = meters.StepMeter(device)
    started = time.perf_counter()
    for _ in range(5):
        meter.start()
        for _ in range(20):
            x = torch.tanh(x @ x)
        meter.stop()
        torch.cuda.synchronize()
        time.sleep(busy)
    times = meters.EpochTimes(5, 0.0, meter.busy_s(), time.perf_counter() - started)
    assert 0.35 < times.utilisation < 0.65, (times, t0)


def test_raymill_infer_cli_with_use_gpu(trained, tmp_path, capfd):
    """`raymill infer --set infer.use_gpu=true`: the command a user runs (it failed on a GPU with
    "You must provide batch_size to map_batches when requesting GPUs"); a small job runs in the
    driver on the GPU, and with infer.local_max_rows=0 through Ray Data's GPU map."""
    from workflow.__main__ import main

    _, data, artifact = trained
    for local, decode in ((1000, "in-process"), (0, "tasks")):
        out = tmp_path / f"infer-cli-{decode}"
        rc = main(["infer", "--model", artifact.path, "--data", data.path, "--output", str(out), "--config",
                   str(REPO / "configs/smoke.yaml"), "--set", "infer.use_gpu=true", "--set", "tracking.enabled=false",
                   "--set", f"infer.local_max_rows={local}"])
        assert rc == 0
        metrics = json.loads((out / "manifest.json").read_text())["metrics"]
        assert metrics["rows"] > 0 and metrics["errors"] == 0
        assert metrics["decode"] == decode and metrics["device"] == "cuda" and 0 < metrics["device_utilisation"] <= 1
    # a clean run prints nothing that looks like an error: Ray Data's GPU map had warned that num_cpus
    # beside num_gpus is experimental, and that a map of concurrency 15 had 1 input (issue #39)
    from tests.test_console import ERRORISH

    printed = capfd.readouterr()
    looks_bad = [line for line in (printed.out + printed.err).splitlines() if ERRORISH.search(line)]
    assert not looks_bad, "\n".join(looks_bad)


def test_serve_on_the_gpu_answers_v2_batches_and_rolls_on_one_gpu(gpu_ray, tmp_path):
    """Replicas of half a GPU: the model runs on CUDA, a v2 request of 8 images gets 8 answers, and a
    rolling update under c=8 load finishes on one GPU with 0 failed requests."""
    import asyncio
    import base64

    import httpx
    from ray import serve

    from stages.serve import app as serve_stage
    from tests.conftest import free_port, image_bytes
    from tests.test_serve import _save_model
    from tests.test_serve_rollout import _load
    from stages.common.config import ServeConfig

    cfg = ServeConfig(port=free_port(), use_gpu=True, gpus_per_replica=0.5, request_timeout_s=60.0)
    url = serve_stage.start(cfg, _save_model(tmp_path / "v1", "gpu-1"))
    images = [image_bytes(500 + i) for i in range(8)]

    async def rollout():
        stop = asyncio.Event()
        load = asyncio.create_task(_load(url, images, 8, stop, min_requests=16))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(serve_stage.update, cfg, _save_model(tmp_path / "v2", "gpu-2"))
        stop.set()
        return await load

    try:
        assert httpx.get(f"{url}/metadata", timeout=60).json()["device"] == "cuda"
        tensor = {"name": "images", "datatype": "BYTES", "shape": [8],
                  "data": [base64.b64encode(i).decode() for i in images]}
        r = httpx.post(f"{url}/v2/models/raymill/infer", json={"inputs": [tensor]}, timeout=60)
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [8], r.text
        codes = asyncio.run(rollout())
        assert set(codes) == {200}, codes
        assert httpx.get(f"{url}/metadata", timeout=60).json()["version"] == "gpu-2"
    finally:
        serve.shutdown()
