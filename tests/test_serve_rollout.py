"""Serving under change: a model replica SIGKILLed under load, a rolling model update under load,
and how `raymill serve --model NEW` finds the endpoint's own Ray. Real Serve, real HTTP, no
client retries; each test deploys its own app on one Serve proxy started here.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import httpx
import pytest
import ray

from stages.serve import app as serve_stage
from stages.serve import draining
from tests.conftest import free_port, image_bytes
from tests.test_serve import JPEG, _save_model
from stages.common.config import ConfigError, ServeConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _save_model(tmp_path_factory.mktemp("model"), "test-1")


@pytest.fixture(scope="module")
def proxy(ray_session):
    """(base config with the proxy's port). Serve is shut down afterwards."""
    from ray import serve

    # engine=torch: these tests are about Serve's rollouts and replica loss, and each new model's
    # first onnxruntime export (a child process, ~5 s) added 26 s to them; test_serve and
    # test_runtime cover the onnxruntime replica.
    cfg = ServeConfig(port=free_port(), replica_memory_mb=768, request_timeout_s=60.0, engine="torch")
    serve.start(http_options={"host": cfg.host, "port": cfg.port, "request_timeout_s": cfg.request_timeout_s})
    yield cfg
    serve.shutdown()


async def _load(url: str, images: list[bytes], concurrency: int, stop: asyncio.Event,
                min_requests: int = 0) -> Counter:
    """Keep `concurrency` clients posting images (no retries) until `stop` and `min_requests`."""
    codes: Counter = Counter()

    async def worker(ac: httpx.AsyncClient, k: int) -> None:
        i = k
        while not stop.is_set() or sum(codes.values()) < min_requests:
            try:
                r = await ac.post("/predict", content=images[i % len(images)], headers=JPEG)
                codes[r.status_code] += 1
            except httpx.TransportError as e:
                codes[type(e).__name__] += 1
            i += concurrency

    async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
        await asyncio.gather(*[worker(ac, k) for k in range(concurrency)])
    return codes


def _pids(url: str, n: int = 20) -> set[int]:
    """Model replica pids seen on /healthz over `n` calls (the proxy spreads them)."""
    return {httpx.get(f"{url}/healthz", timeout=30).json()["pid"] for _ in range(n)}


def test_replica_kill_under_load_loses_nothing(proxy, model_dir):
    """SIGKILL one of 2 model replicas under c=8 load: 0 non-2xx with no client retry (the ingress
    retries the lost call on the other replica), and a new replica serves within 30 s."""
    cfg = proxy.model_copy(update={"app_name": "test-kill", "num_replicas": 2})
    url = serve_stage.start(cfg, model_dir, route_prefix="/kill")
    images = [image_bytes(200 + i) for i in range(16)]

    async def scenario() -> tuple[Counter, float, set[int], int]:
        old = _pids(url)
        stop = asyncio.Event()
        load = asyncio.create_task(_load(url, images, 8, stop))
        await asyncio.sleep(1.0)
        victim = min(old)
        os.kill(victim, signal.SIGKILL)
        killed_at, new = time.time(), set()
        while time.time() < killed_at + 30 and not new:
            await asyncio.sleep(0.5)
            new = await asyncio.to_thread(_pids, url, 4) - old
        seconds = time.time() - killed_at
        await asyncio.sleep(1.0)
        stop.set()
        return await load, seconds, new, victim

    try:
        codes, seconds, new, victim = asyncio.run(scenario())
    finally:
        serve_stage.shutdown(cfg)
    assert set(codes) == {200} and codes[200] > 20, codes
    assert new, f"no new replica serving within 30 s of killing {victim}"
    print(f"replica kill: {codes[200]} requests, 0 failed, new replica {new} serving within {seconds:.1f} s")


# The session's Ray declares one GPU (tests/conftest.py): a replica holding a GPU share runs on
# the CPU here, and Serve schedules it exactly as on a one-GPU node.
def test_rolling_updates_on_one_gpu_lose_nothing(proxy, model_dir, tmp_path, caplog):
    """Two model updates under c=8 load on a one-GPU Ray, each with 0 failed requests, the new
    version serving and the old replica process gone: half-GPU replicas surge (old and new share
    the GPU); a whole-GPU replica cannot surge, so it is replaced in place and the plan's warning
    names the gap. (One app for both: one deploy less than a test each.)"""
    half = proxy.model_copy(update={"app_name": "test-rollout", "use_gpu": True, "gpus_per_replica": 0.5})
    whole = half.model_copy(update={"gpus_per_replica": 1.0})
    url = serve_stage.start(half, model_dir, route_prefix="/rollout")
    images = [image_bytes(300 + i) for i in range(16)]

    async def scenario(cfg: ServeConfig, new_model: str) -> Counter:
        stop = asyncio.Event()
        load = asyncio.create_task(_load(url, images, 8, stop, min_requests=16))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(serve_stage.update, cfg, new_model, route_prefix="/rollout")
        await asyncio.sleep(0.5)
        stop.set()
        return await load

    try:
        assert httpx.get(f"{url}/metadata", timeout=30).json()["device"] == "cpu"
        for cfg, version in ((half, "test-2"), (whole, "test-3")):
            old = _pids(url, 3)
            caplog.clear()
            codes = asyncio.run(scenario(cfg, _save_model(tmp_path / version, version)))
            assert set(codes) == {200}, (version, codes)
            assert ("Updates replace replicas in place" in caplog.text) == (cfg is whole)
            assert httpx.get(f"{url}/metadata", timeout=30).json()["version"] == version
            assert not _pids(url, 3) & old
            deadline = time.time() + 30
            while any(_alive(pid) for pid in old) and time.time() < deadline:
                time.sleep(0.5)
            assert not any(_alive(pid) for pid in old), f"old replica {old} still running"
            # the app's Drain lives on through this process's update (its second handle had ended it)
            drain = ray.get_actor(draining.actor_name(half.app_name), namespace=draining.NAMESPACE)
            assert isinstance(ray.get(drain.state.remote(), timeout=30), dict)
        # Another app finds the GPU held by this one: refused with the holder named, not left pending.
        from ray import serve

        other = half.model_copy(update={"app_name": "test-no-room"})
        with pytest.raises(ConfigError, match=r"cannot be scheduled: .*ServeReplica:test-rollout:\w+ 1 GPU.*"
                                              r"stop that work"):
            serve_stage.start(other, model_dir, route_prefix="/no-room", wait_for_room_s=2)
        assert "test-no-room" not in serve.status().applications
        # Two updates from this process later, the app still drains (a second deploy's handle had
        # ended its Drain actor): readiness says 503 to load balancers, liveness stays 200
        serve_stage.drain(half)
        health = httpx.get(f"{url}/healthz", timeout=30)
        assert health.status_code == 503 and health.json()["error"] == "shutting_down", health.text
        assert httpx.get(f"{url}/v2/health/ready", timeout=30).status_code == 503
        assert httpx.get(f"{url}/v2/health/live", timeout=30).status_code == 200
    finally:
        serve_stage.shutdown(half)

def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_endpoint_record_names_the_ray_behind_a_port(proxy, model_dir, tmp_path, monkeypatch, caplog):
    """`raymill serve --model NEW` finds the running endpoint and the Ray serving it (not "auto")."""
    import ray

    from stages.serve import endpoint as serve_endpoint
    from stages.common.config import ConfigError

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = proxy.model_copy(update={"app_name": "test-endpoint"})
    serve_stage.start(cfg, model_dir)
    assert serve_endpoint.endpoint_running(cfg)
    assert not serve_endpoint.endpoint_running(ServeConfig(port=free_port()))
    with pytest.raises(ConfigError, match="ray.address"):
        serve_endpoint.endpoint_ray_address(cfg)
    path = serve_endpoint.record_endpoint(cfg)
    assert path.stat().st_mode & 0o077 == 0
    assert serve_endpoint.endpoint_ray_address(cfg) == (ray.get_runtime_context().gcs_address, cfg.host)
    # a rollout cannot move the endpoint to another address: said, and the recorded host is kept
    assert serve_endpoint.endpoint_ray_address(cfg.model_copy(update={"host": "0.0.0.0"}))[1] == cfg.host
    assert "serve.host=0.0.0.0 is not applied by a rolling update" in caplog.text
    serve_stage.shutdown(cfg)
