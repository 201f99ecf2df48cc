"""The predicting side of batch inference: the Ray Data actor classes, and the rows they return.

Ray Data runs them as actors (stages.infer.stage); a job small enough to run in the driver process
calls the same classes there, so both paths predict row for row alike.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import torch

from stages.feed import meters
from stages.infer import decode as infer_decode
from stages.model import predict, runtime

__all__ = ["SCHEMA", "BUSY", "ENGINE", "BatchPredictor", "Predictor"]

SCHEMA = pa.schema([("key", pa.string()), ("path", pa.string()), ("true_class", pa.string()),
                    ("class_name", pa.string()), ("class_index", pa.int32()),
                    ("top_k_classes", pa.list_(pa.string())), ("top_k_probs", pa.list_(pa.float64())),
                    ("error", pa.string()), ("error_detail", pa.string())])
# What the actors return: SCHEMA plus each row's share of its batch's device busy seconds, summed
# by the driver (over every actor) and dropped before publishing.
BUSY = pa.field("busy_s", pa.float64())
# ...and the engine that made them (stages.model.runtime: an actor may fall back to torch), dropped alike.
ENGINE = pa.field("engine", pa.string())


class BatchPredictor:
    """Ray Data actor (infer.decode=tasks): loads the model once, then predicts decoded images."""

    def __init__(self, *, model_path: str, s3: dict, top_k: int, use_gpu: bool, threads: int, engine: str = "torch",
                 weights_sha256: str | None = None, loaded: tuple[torch.nn.Module, dict] | None = None):
        """`loaded`: the (model, info) the caller read from `model_path` (in-process infer: the driver's
        own, not read and hashed a second time: 0.19-0.32 s for resnet50, 2-core box); actors load their own."""
        torch.set_num_threads(threads)  # the actor's CPU share, not every core of the node
        if use_gpu and not torch.cuda.is_available():  # Ray declared a GPU that torch cannot use
            raise RuntimeError(f"infer.use_gpu: this actor holds a GPU in Ray, but torch {torch.__version__} sees no "
                               f"CUDA device (CUDA build: {torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES="
                               f"{os.environ.get('CUDA_VISIBLE_DEVICES')}); set infer.use_gpu=false, or give the "
                               "GPU nodes a CUDA build of torch and working drivers")
        model, self.info = loaded or predict.load_model(model_path, s3)
        if weights_sha256 and self.info["weights_sha256"] != weights_sha256:  # what the driver checked and records
            raise RuntimeError(f"the model in '{model_path}' was republished during this infer (weights "
                               f"{self.info['weights_sha256'][:12]}, this run read {weights_sha256[:12]}); its "
                               "predictions would be recorded as the other model's: run infer again")
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model = runtime.for_device(model, self.info, engine, self.device, threads, key="infer.engine")
        self.top_k, self.meter = top_k, meters.StepMeter(self.device)

    def __call__(self, batch: pa.Table) -> pa.Table:
        samples = batch.select(["key", "path", "true_class"]).to_pylist()
        errors, details = batch["error"].to_pylist(), batch["error_detail"].to_pylist()
        good = [i for i, e in enumerate(errors) if e is None]
        images = infer_decode.pixels(batch["pixels"], good, self.info["image_size"])
        busy = self.meter.busy_s()
        rows = self._predict_rows(samples, good, images, errors, details)
        return _with_busy(rows, self.meter.busy_s() - busy, runtime.engine_name(self.model))

    def _predict_rows(self, samples: list[dict], good: list[int], images, errors: list, details: list) -> list[dict]:
        """One row per sample: a prediction for each of `good` (whose pixels are `images`, in order),
        the error reason for the rest."""
        preds = dict(zip(good, predict.predict_arrays(self.model, self.info, images, self.top_k, self.device,
                                                      self.meter)))
        return [_row(s, preds.get(i), errors[i], details[i]) for i, s in enumerate(samples)]


class Predictor(BatchPredictor):
    """Ray Data actor (infer.decode=actor): loads the model once, then reads, decodes and predicts
    its work items (stages.infer.decode.Reader), decoding in threads: Pillow releases the GIL."""

    def __init__(self, *, model_path: str, s3: dict, mode: str, top_k: int, batch_size: int, use_gpu: bool,
                 threads: int, source: str | None = None, raw: bool = False, etl_classes: list | None = None,
                 class_depth: int = 0, engine: str = "torch", weights_sha256: str | None = None,
                 loaded: tuple[torch.nn.Module, dict] | None = None):
        super().__init__(model_path=model_path, s3=s3, top_k=top_k, use_gpu=use_gpu, threads=threads, engine=engine,
                         weights_sha256=weights_sha256, loaded=loaded)
        self.batch_size = batch_size
        self.reader = infer_decode.Reader(self.info, s3, mode=mode, source=source, raw=raw, etl_classes=etl_classes,
                                          class_depth=class_depth)
        self.pool = ThreadPoolExecutor(max_workers=threads)

    def __call__(self, batch: pa.Table) -> pa.Table:
        samples = [s for item in batch.to_pylist() for s in self.reader.samples(item)]
        rows: list[dict[str, Any]] = []
        busy = self.meter.busy_s()
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start:start + self.batch_size]  # read lazily: one batch of bytes at a time
            decoded = list(self.pool.map(self.reader.decode, chunk))
            good = [i for i, d in enumerate(decoded) if d[0] is not None]
            rows += self._predict_rows(chunk, good, [decoded[i][0] for i in good], [d[1] for d in decoded],
                                       [d[2] for d in decoded])
        return _with_busy(rows, self.meter.busy_s() - busy, runtime.engine_name(self.model))


def _with_busy(rows: list[dict[str, Any]], busy_s: float, engine: str) -> pa.Table:
    """Prediction rows, each with an equal share of the device busy seconds it took to make them,
    and the engine that made them."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    table = table.append_column(BUSY, pa.array([busy_s / max(1, len(rows))] * len(rows), pa.float64()))
    return table.append_column(ENGINE, pa.array([engine] * len(rows), pa.string()))


def _row(sample: dict, pred: dict | None, error: str | None, detail: str | None) -> dict[str, Any]:
    """One output row; prediction columns stay null for an error row."""
    row = {"key": sample["key"], "path": sample["path"], "true_class": sample["true_class"],
           "error": error, "error_detail": detail}
    if pred is not None:
        row.update(class_name=pred["class_name"], class_index=pred["class_index"],
                   top_k_classes=[t["class_name"] for t in pred["top_k"]],
                   top_k_probs=[t["probability"] for t in pred["top_k"]])
    return row
