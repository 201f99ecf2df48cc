"""Where should a served image be decoded: in the ingress replica or in the model replica?

Two Serve apps on one Ray, the same two hops as `raymill serve` (ingress 0.25 CPU -> model 0.5 CPU,
torch 1 thread, the benchmark's model: small_cnn width 32 at 64 px), the same JPEGs:
  replica  the ingress forwards the bytes; the model replica decodes (stages.model.predict.preprocess)
           in a thread, then predicts (what stages/serve/app.py does);
  ingress  the ingress decodes in a thread and sends the uint8 array; the model replica predicts.
Reports c=1 p50 and c=8 requests/s, best of --rounds interleaved rounds:

    python -m benchmarks.serve_decode [--size 500x375] [--requests 200] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _apps(model_dir: str):
    from ray import serve
    from starlette.requests import Request

    from stages.model.predict import load_model, predict_arrays, preprocess

    @serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=32)
    class Model:
        def __init__(self):
            import torch

            torch.set_num_threads(1)
            self.model, self.info = load_model(model_dir)

        async def from_bytes(self, data: bytes) -> dict:
            array = await asyncio.to_thread(preprocess, data, self.info)
            return (await asyncio.to_thread(predict_arrays, self.model, self.info, [array]))[0]

        async def from_array(self, array) -> dict:
            return (await asyncio.to_thread(predict_arrays, self.model, self.info, [array]))[0]

    @serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
    class Ingress:
        def __init__(self, model, decode_here: bool):
            self.decode_here, self.info = decode_here, load_model(model_dir)[1]
            self.from_bytes, self.from_array = model.from_bytes, model.from_array

        async def __call__(self, request: Request) -> dict:
            data = await request.body()
            if self.decode_here:
                return await self.from_array.remote(await asyncio.to_thread(preprocess, data, self.info))
            return await self.from_bytes.remote(data)

    return {"replica": Ingress.bind(Model.bind(), False), "ingress": Ingress.bind(Model.bind(), True)}


async def _level(url: str, bodies: list[bytes], k: int, total: int) -> tuple[float, float]:
    import httpx

    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=k)) as ac:
        await asyncio.gather(*[ac.post(url, content=bodies[i]) for i in range(k)])  # warm-up
        started, issued = time.perf_counter(), 0

        async def worker() -> None:
            nonlocal issued
            while issued < total:
                i, issued = issued, issued + 1
                t0 = time.perf_counter()
                r = await ac.post(url, content=bodies[i % len(bodies)])
                r.raise_for_status()
                latencies.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*[worker() for _ in range(k)])
        return statistics.median(latencies), len(latencies) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    import ray
    from ray import serve

    from benchmarks.serve import _free_port, _jpegs, _make_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_decode")
    p.add_argument("--size", default="500x375")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_dir = Path(tempfile.mkdtemp()) / "model"
    _make_model(model_dir)
    bodies = _jpegs(32, args.size)
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name, app in _apps(str(model_dir)).items():
        serve.run(app, name=name, route_prefix=f"/{name}")
    best: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name in ("replica", "ingress"):
            url = f"http://127.0.0.1:{port}/{name}"
            p50, _ = asyncio.run(_level(url, bodies, 1, args.requests // 2))
            _, rps = asyncio.run(_level(url, bodies, 8, args.requests))
            old = best.get(name, [float("inf"), 0.0])
            best[name] = [min(old[0], p50), max(old[1], rps)]
    for name, (p50, rps) in best.items():
        log.info("decode in the %-7s  c=1 p50 %6.2f ms   c=8 %6.1f requests/s   (%s JPEGs)", name, p50, rps, args.size)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
