"""Helpers for the serving benchmark (benchmarks/serve.py).

1. The baseline server, (c): the same model and the same preprocessing as the Serve app
   (stages.export.preprocess + stages.export.predict_arrays) behind a plain FastAPI app in one
   uvicorn process. Run as a subprocess:

       python -m benchmarks.serve_apps --model DIR --port PORT [--threads 1]

   It binds 127.0.0.1 only. POST /predict takes a raw image body and answers the same JSON keys
   as the Serve app; GET /healthz answers once the model is loaded and warmed up. The handler is
   `async` and calls the model inline, as the simplest single-process app would: one request at
   a time on the event loop, no batching.

2. `HandleClassifier`: stages.serve.Classifier plus one method, `classify(image bytes)`, so the
   same replica code (decode in a thread, batch queue, forward pass) can be called through a
   DeploymentHandle from the driver, without the HTTP proxy. It is built on first access (PEP 562
   module __getattr__) so that the uvicorn process above never imports Ray; Serve pickles the
   class by reference (`benchmarks.serve_apps.HandleClassifier`) and the replica resolves it
   the same way.
"""
# No `from __future__ import annotations` here: FastAPI resolves the handler's `Request`
# annotation at runtime, and a string annotation of a locally imported name would make it a
# query parameter (every request then fails with 422).
import argparse
import os
import time
from typing import Any, Optional

__all__ = ["create_app", "main"]


def create_app(model_dir: str, threads: int = 1):
    """The FastAPI app for (c); `threads` > 0 sets torch's intra-op threads (0: torch's default)."""
    import numpy as np
    import torch
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from stages.export import load_model, predict_arrays, preprocess

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


def _make_handle_classifier() -> type:
    from stages.serve import Classifier

    class HandleClassifier(Classifier):
        """The Serve replica, plus an entry point for DeploymentHandle calls (no HTTP)."""

        async def classify(self, data: bytes) -> dict[str, Any]:
            return await self._infer(await self._preprocess(data))

        def torch_threads(self) -> int:
            import torch

            return torch.get_num_threads()

    HandleClassifier.__module__ = __name__
    HandleClassifier.__qualname__ = "HandleClassifier"
    return HandleClassifier


def __getattr__(name: str) -> Any:
    if name == "HandleClassifier":
        cls = _make_handle_classifier()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
