"""The baselines of the serving benchmark (benchmarks/serve.py): a bare FastAPI + uvicorn app, and
Ray Serve's own floor (`floor_app`: a no-op Serve app with raymill's hops, limits and CPUs).

The same model and preprocessing as the Serve app (stages.model.predict.preprocess + predict_arrays),
in one uvicorn process bound to 127.0.0.1, run as a subprocess:

    python -m benchmarks.serve_apps --model DIR --port PORT [--threads 1]

POST /predict takes a raw image body and answers the same JSON keys as the Serve app; GET
/healthz answers once the model is loaded and warmed up. The handler is `async` and calls the
model inline, as the simplest single-process app would: no batching, no thread hop.
"""
# No `from __future__ import annotations` here: FastAPI resolves the handler's `Request`
# annotation at runtime, and a string annotation of a locally imported name would make it a
# query parameter (every request then fails with 422).
import argparse
import os
import time
from typing import Optional

__all__ = ["create_app", "main", "floor_app"]


def floor_app(cfg, hops: int = 2):
    """Ray Serve's floor for `raymill serve` with ServeConfig `cfg`: the same two hops (a FastAPI
    ingress deployment -> a model deployment), the same queue limits and CPU requests, and the
    body read and passed on, but the model deployment returns a constant: no decode, no model.
    `hops=1` is the floor of serve.model_deployment=false: the ingress answers the constant itself."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from ray import serve

    app = FastAPI()
    limits = {"max_ongoing_requests": cfg.max_ongoing_requests, "max_queued_requests": cfg.max_queued_requests}

    @serve.deployment(ray_actor_options={"num_cpus": cfg.cpus_per_replica}, **limits)
    class Constant:
        async def classify(self, data: bytes) -> dict:
            return _constant(data)

    @serve.deployment(ray_actor_options={"num_cpus": cfg.ingress_cpus}, **limits)
    @serve.ingress(app)
    class FloorIngress:
        def __init__(self, model=None):
            self.classify = model.classify if model is not None else None

        @app.post("/predict")
        async def predict(self, request: Request) -> JSONResponse:
            body = await request.body()
            return JSONResponse(_constant(body) if self.classify is None else await self.classify.remote(body))

        @app.get("/healthz")
        async def healthz(self) -> dict:
            return {"status": "ok"}

    if hops == 2:
        return FloorIngress.bind(Constant.bind())
    # one hop: the ingress is the model replica, with its CPUs (stages.serve.app.build_app)
    return FloorIngress.options(ray_actor_options={"num_cpus": cfg.cpus_per_replica}).bind()


def _constant(data: bytes) -> dict:
    return {"class_name": "c0", "class_index": 0, "bytes": len(data)}


def create_app(model_dir: str, threads: int = 1):
    """The FastAPI app for (c); `threads` > 0 sets torch's intra-op threads (0: torch's default)."""
    import numpy as np
    import torch
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from stages.model.predict import load_model, predict_arrays, preprocess

    if threads > 0:
        torch.set_num_threads(threads)
    model, info = load_model(model_dir)
    size = info["image_size"]
    predict_arrays(model, info, [np.zeros((size, size, 3), np.uint8)])  # warm-up, as the replica does
    app = FastAPI()

    @app.post("/predict")
    async def predict(request: Request):
        started = time.perf_counter()
        data = await request.body()
        result = predict_arrays(model, info, [preprocess(data, info)], 3)[0]
        return JSONResponse({**result, "model_version": info.get("version"),
                             "latency_ms": round((time.perf_counter() - started) * 1000, 2)})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "pid": os.getpid(), "torch_threads": torch.get_num_threads()}

    return app


def main(argv: Optional[list] = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_apps")
    p.add_argument("--model", required=True, help="exported model folder (model.pt + model.json)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=1, help="torch threads; 0 = torch's default")
    args = p.parse_args(argv)
    uvicorn.run(create_app(args.model, args.threads), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
