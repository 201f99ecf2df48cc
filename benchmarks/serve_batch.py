"""Images/s a client reaches through the Open Inference Protocol's batch requests (N images a
request, binary tensors) against `raymill infer` (stages.infer.stage.run) on the same model and JPEGs.

Used by benchmarks/serve.py; `raymill infer` reads the JPEGs from a folder, so its rate includes
reading files, which the served path does not have (the client already holds the bytes).
"""
from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["v2_body", "v2_images_per_s", "infer_images_per_s"]


def v2_body(images: list[bytes]) -> tuple[bytes, dict[str, str]]:
    """An infer request with the binary-tensor extension, asking for class_index only (binary)."""
    from stages.serve import v2 as serve_v2

    packed = serve_v2.pack_bytes(images)
    header = json.dumps({"inputs": [{"name": serve_v2.INPUT, "datatype": "BYTES", "shape": [len(images)],
                                     "parameters": {"binary_data_size": len(packed)}}],
                         "outputs": [{"name": "class_index", "parameters": {"binary_data": True}}]}).encode()
    return header + packed, {serve_v2.HEADER: str(len(header)), "content-type": "application/octet-stream"}


async def _v2_level(url: str, bodies: list[bytes], n: int, k: int, images: int, cap_s: float) -> dict[str, Any]:
    """k keep-alive clients post requests of n images to the infer URL until `images` or `cap_s`."""
    import httpx

    requests = [v2_body([bodies[(i * n + j) % len(bodies)] for j in range(n)]) for i in range(max(1, len(bodies) // n))]
    latencies: list[float] = []
    errors, issued = 0, 0
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=k)) as ac:
        await asyncio.gather(*[ac.post(url, content=requests[0][0], headers=requests[0][1]) for _ in range(k)])
        started = time.perf_counter()

        async def worker() -> None:
            nonlocal errors, issued
            while issued * n < images and time.perf_counter() - started < cap_s:
                content, headers = requests[issued % len(requests)]
                issued += 1
                t0 = time.perf_counter()
                try:
                    ok = (await ac.post(url, content=content, headers=headers)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append((time.perf_counter() - t0) * 1000)
                else:
                    errors += 1

        await asyncio.gather(*[worker() for _ in range(k)])
        wall = time.perf_counter() - started
    return {"images_per_s": round(len(latencies) * n / wall, 1), "requests": len(latencies), "errors": errors,
            "p50_ms": round(statistics.median(latencies), 1) if latencies else None}


def v2_images_per_s(url: str, model: str, bodies: list[bytes], sizes: list[int], k: int, images: int,
                    cap_s: float) -> dict[str, dict[str, Any]]:
    """{N: images/s, requests, errors, request p50} for k clients sending N images a request to
    the app at `url` serving `model`."""
    infer_url = f"{url}/v2/models/{model}/infer"
    return {str(n): asyncio.run(_v2_level(infer_url, bodies, n, k, images, cap_s)) for n in sizes}


def infer_images_per_s(model_dir: str, bodies: list[bytes], images: int, cfg: Any = None) -> dict[str, Any]:
    """`raymill infer` (`cfg`, default InferConfig()) over folders of images/4 and `images` JPEGs,
    after an untimed warm-up: the end-to-end rate of the larger run, and the marginal rate between
    the two (start-up excluded)."""
    from stages.infer import stage as infer
    from stages.common.config import InferConfig

    cfg = cfg or InferConfig()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="raymill-infer-bench-") as tmp:
        # The first run in a process pays Ray Data's one-off set-up: a warm-up run, not timed.
        for count in (16, max(17, images // 4), images):
            folder = Path(tmp) / f"src{count}" / "c0"
            folder.mkdir(parents=True)
            for i in range(count):
                (folder / f"{i:06d}.jpg").write_bytes(bodies[i % len(bodies)])
            started = time.perf_counter()
            out = infer.run(cfg, model_dir, str(folder.parent), str(Path(tmp) / f"out{count}"))
            runs[count] = time.perf_counter() - started
    (small, t_small), (large, t_large) = sorted(runs.items())[1:]
    marginal = (large - small) / (t_large - t_small) if t_large > t_small else None  # None: inside the noise
    return {"images": large, "seconds": round(t_large, 2), "images_per_s": round(large / t_large, 1),
            "marginal_images_per_s": round(marginal, 1) if marginal else None,
            "device_utilisation": out.manifest["metrics"].get("device_utilisation")}
