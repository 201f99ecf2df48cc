"""The config sections of what comes after training: batch inference, serving, tracking, export.

Kept apart from `config.py` (the tree's root, the data and training sections) to keep each file
short; `stages.common.config` re-exports every name here, and stages import them from there.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from stages.common.config_parts import ImageFormats, RunsModel, Section


class InferConfig(RunsModel):  # use_gpu, engine
    split: Literal["train", "val", "test"] = "test"
    batch_size: int = Field(128, ge=1)
    num_actors: int | None = Field(None, ge=1)  # unset: one per GPU with use_gpu, else a CPU but one (plan_infer)
    cpus_per_actor: float = Field(1.0, gt=0)
    top_k: int = Field(3, ge=1)
    # Where images are decoded: `tasks` (Ray Data CPU tasks, then an actor pool that only predicts),
    # `actor` (each actor decodes its own items), `auto` (tasks with use_gpu, actor on a CPU).
    decode: Literal["auto", "tasks", "actor"] = "auto"
    decode_cpus_per_task: float = Field(1.0, gt=0)
    # A job of at most this many images runs in the driver process (no Ray Data, no actors: their
    # start-up outweighs so few images) unless infer.decode or infer.num_actors is set. 0: never.
    local_max_rows: int = Field(1000, ge=0)


class ServeConfig(RunsModel):  # use_gpu, engine
    host: str = "127.0.0.1"  # other interfaces only when asked explicitly
    port: int = Field(8000, ge=1, le=65535)
    num_replicas: int = Field(1, ge=1)
    autoscaling: bool = False
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(2, ge=1)
    cpus_per_replica: float = Field(0.5, gt=0)
    # The forward pass's threads in a model replica (torch's or onnxruntime's); unset: Ray's (the
    # replica's CPUs, at least 1). 2 did not make a lone request faster on 2 cores (RESULTS.md serve_user)
    torch_threads: int | None = Field(None, ge=1)
    # GPUs each model replica holds with use_gpu. A fraction lets replicas share one device, and
    # lets a rollout's new replica start beside the old one on a one-GPU node (session.plan_serve).
    gpus_per_replica: float = Field(1.0, gt=0, le=1)
    batching: bool = True
    max_batch_size: int = Field(16, ge=1)
    # 0: batch whatever is queued, never hold a lone request (5 ms cost 23-28% of p50, RESULTS.md P5)
    batch_wait_timeout_s: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(32, ge=1)
    max_queued_requests: int = Field(64, ge=-1)
    request_timeout_s: float = Field(10.0, gt=0)
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1)
    max_image_pixels: int = Field(40_000_000, ge=1)
    # ETL's default list: a model trained on BMP files answers for BMP uploads too
    allowed_formats: ImageFormats = ("JPEG", "PNG", "WEBP", "BMP")
    top_k: int = Field(3, ge=1)
    app_name: str = Field("raymill", min_length=1)  # Serve refuses an empty one, after Ray's start
    # The Open Inference Protocol's model name: /v2/models/<model_name>/infer (stages/serve/v2.py).
    model_name: str = Field("raymill", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    # Images one /v2 infer request may carry; they go through one forward pass together.
    max_images_per_request: int = Field(64, ge=1)
    # Their pixels together (headers, before any decode; at least max_image_pixels): decode time is pixels.
    max_request_pixels: int = Field(100_000_000, ge=1)
    # Memory Ray reserves per model replica; concurrent decodes are capped to fit in it
    # (stages.serve.replica.decode_slots: 2 at the defaults for a replica holding up to 768 MB
    # before any decode, each up to max_image_pixels x 16 B).
    replica_memory_mb: int = Field(2048, ge=256)
    decode_slots: int = Field(0, ge=0)  # 0: derived from replica_memory_mb and max_image_pixels
    # proxy: Serve's HTTP proxy. throughput_optimized: RAY_SERVE_THROUGHPUT_OPTIMIZED=1 at Ray start.
    ingress: Literal["proxy", "throughput_optimized"] = "proxy"
    # true: the model runs in its own deployment and the ingress retries a call whose replica
    # died (a replica kill loses no request). false: the model runs inside the ingress replica:
    # one Serve hop less (~6 ms at c=1 on 2 cores), but a killed replica fails its in-flight requests.
    model_deployment: bool = True
    ingress_replicas: int = Field(1, ge=1)
    ingress_cpus: float = Field(0.25, gt=0)
    # Extra replicas during a model update (percent of num_replicas): 100 = new ones start
    # before old ones stop, so an update loses no request; 0 = no spare resources needed.
    max_surge_percent: int = Field(100, ge=0, le=100)
    # Serve's per-request access log line in each replica's log file (Serve's LoggingConfig).
    access_log: bool = True


class TrackingConfig(Section):
    """MLflow experiment tracking (stages/common/tracking.py). Failures warn once and never stop a stage."""
    enabled: bool = True
    # None: SQLite inside the run folder (`raymill run`) or --output (`raymill train/tune`). A path on
    # the head is invisible to workers on other nodes: clusters set a server, e.g. http://head:5000.
    uri: str | None = None
    experiment: str = "raymill"
    model_name: str = "raymill"  # registered model name; each trained model becomes a new version
    timeout_s: float = Field(5.0, gt=0)  # per HTTP request to a tracking server, no retries

    @field_validator("experiment", "model_name")
    @classmethod
    def _mlflow_name(cls, value: str, info: ValidationInfo) -> str:
        """Names MLflow refuses (empty; '/' or ':' in a registered model's, an experiment's may be a
        path): the stage had run untracked, its warning blaming tracking.uri."""
        if not value.strip():
            raise ValueError("is empty; name it (MLflow refuses an empty name)")
        if info.field_name == "model_name" and (bad := {"/", ":"} & set(value)):
            raise ValueError(f"holds {' and '.join(sorted(bad))}, which MLflow refuses in a model's name; drop it")
        return value


ONNX_OPSET = 18  # export.opset's default and least (stages.model.runtime exports at it too)


class ExportConfig(Section):
    """`raymill export` and the export step of `raymill run` (stages/model/export.py)."""
    enabled: bool = False  # `raymill run`: export the published model after infer
    format: Literal["onnx", "torchscript"] = "onnx"
    probabilities: bool = False  # onnx: a second output with the softmax of the logits
    # max |logits(onnxruntime) - logits(torch)| / max(1, max |logits(torch)|) allowed on the check images
    # (float32 keeps ~7 digits: logits of 3e4 differ by 4e-3 between runtimes); past it nothing is published
    tolerance: float = Field(1e-3, gt=0)
    check_images: int = Field(32, ge=1)  # images of the model's own data the export is checked on
    max_batch_size: int = Field(64, ge=0)  # Triton's config.pbtxt (0: Triton does not batch)
    name: str | None = None  # the model's name in the Triton repository; None: tracking.model_name
    # onnx: the opset of model.onnx. 18 loads in onnxruntime >= 1.14 (Triton 23.03+); torch's exporter
    # builds nothing older (its converter fails on this graph's reductions and leaves 18)
    opset: int = Field(ONNX_OPSET, ge=ONNX_OPSET)
