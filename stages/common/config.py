"""One typed, frozen config tree for every stage, loaded from YAML plus `a.b=value` overrides.

Each stage receives only its own section. Unknown or mistyped keys raise `ConfigError`
with the full key path and the fix; the CLI turns that into exit code 2.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, ValidationError, field_validator, model_validator

from stages.common.config_parts import (SET_BY_TUNE, SHARED_IN_SEARCH, Distribution, ImageFormats, Section,
                                        tune_defaults)
from stages.common.config_out import ONNX_OPSET, ExportConfig, InferConfig, ServeConfig, TrackingConfig
from stages.common.overrides import ConfigError, merge, parse_overrides, read_config_file
from stages.common.storage import check_init_from, check_location, check_named, check_output_place

__all__ = [
    "ConfigError", "Config", "RayConfig", "S3Config", "RunSection", "EtlConfig", "TrainConfig",
    "TuneConfig", "Distribution", "InferConfig", "ServeConfig", "TrackingConfig", "ExportConfig", "ONNX_OPSET",
    "load_config", "parse_overrides",
]


class RayConfig(Section):
    # None: embedded local Ray; "auto", "host:port" or "ray://host:port" joins a cluster
    address: str | None = None
    num_cpus: int | None = Field(None, ge=1)  # local Ray only; None = all cores; Ray takes whole CPUs only
    num_gpus: int | None = Field(None, ge=0)  # local Ray only
    object_store_memory_mb: int | None = Field(None, ge=75)  # local Ray only; None = Ray's default; its least
    # On: Ray Train frees the placement groups of stopped runs through the State API, which the
    # dashboard process serves. Safe by default: loopback only, and Ray 2.60's token auth is on
    # (anyone reaching an open dashboard can run code: CVE-2023-48022).
    include_dashboard: bool = True
    dashboard_host: str = "127.0.0.1"  # other interfaces only when asked explicitly
    # CPUs kept free for Ray Data read/decode tasks while trainers or trials hold the rest;
    # without it 2 workers x 1 CPU on 2 CPUs deadlocks (see README, "Resource plan").
    data_reserved_cpus: float = Field(0.5, gt=0)


    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        """A form ray.init takes: `bad` had failed after the run began (ValueError, exit 1). Empty or
        `local` (`--set ray.address=`): a local Ray, as unset."""
        if value is not None and value.strip() in ("", "local"):
            return None
        if value is not None and not re.fullmatch(
                r"auto|ray://[^\s/]+|(\[[0-9A-Fa-f:.%\w]+\]|[^\s:/\[\]]+):[0-9]{1,5}", value):
            raise ValueError("not a cluster address: write auto, host:port (the GCS, e.g. 10.0.0.5:6379) or "
                             "ray://host:port (Ray Client), or leave it unset for a local Ray")
        return value


class S3Config(Section):
    # Credentials stay in the environment (AWS_ACCESS_KEY_ID, ...), never in config files.
    endpoint_url: str | None = None  # e.g. http://127.0.0.1:5000 for MinIO/moto; env AWS_ENDPOINT_URL also works
    region: str | None = None
    anon: bool = False
    max_attempts: int | None = Field(None, ge=1)  # per S3 request; unset: botocore's (AWS_MAX_ATTEMPTS)


class RunSection(Section):
    name: str | None = None  # unset: the run folder's name (run.dir's; a stage command's --output's)
    dir: Annotated[str, AfterValidator(check_output_place)] = "runs/demo"  # run folder: local path or s3:// URI
    source: Annotated[str, AfterValidator(check_named)] = "data/demo"  # ImageFolder tree: path or s3:// prefix
    seed: int = 0
    force: bool = False  # recompute stages even when their inputs and config are unchanged

    def named(self, folder: str) -> str:
        """`name`, or where unset the last name of `folder` (the run's, or a stage command's output)."""
        return self.name or folder.rstrip("/").rsplit("/", 1)[-1]


class SplitFractions(Section):
    train: float = Field(0.8, ge=0, le=1)
    val: float = Field(0.1, ge=0, le=1)
    test: float = Field(0.1, ge=0, le=1)

    @model_validator(mode="after")
    def _sum_to_one(self) -> "SplitFractions":
        total = self.train + self.val + self.test
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"train+val+test must sum to 1, got {total:g}; adjust etl.split.*")
        return self


class EtlConfig(Section):
    image_size: int = Field(64, ge=8, le=4096)  # output side length, px (square)
    resize: Literal["crop", "stretch"] = "crop"  # crop: shorter side to size then centre crop
    formats: tuple[Literal["parquet", "tar"], ...] = ("parquet", "tar")
    # encoded: small shards, decode cost at train time; raw: uint8 HWC, ~10x bytes, no decode.
    parquet_encoding: Literal["encoded", "raw"] = "encoded"
    codec: Literal["jpeg", "png"] = "jpeg"  # codec of stored encoded images (tar always encoded)
    jpeg_quality: int = Field(90, ge=1, le=100)
    shard_max_rows: int = Field(1000, ge=1)
    shard_max_mb: float = Field(64.0, gt=0)
    # Smaller shards when the input would otherwise make fewer tasks than this: parallelism for
    # small jobs. Raise it to ~4x the cluster's CPUs on big clusters.
    min_shards: int = Field(8, ge=1)
    split: SplitFractions = SplitFractions()
    # auto: a tree whose top folders are train/ (val/, test/) holding class folders keeps its own
    # splits (stages.etl.layout); classes: every top folder is a class; splits: refuse any other tree
    layout: Literal["auto", "classes", "splits"] = "auto"
    max_bad_fraction: float = Field(0.5, ge=0, le=1)  # more bad files than this fails the job
    max_image_pixels: int = Field(89_478_485, ge=1)  # above: quarantined as decompression bomb
    max_file_mb: float = Field(64.0, gt=0)  # larger source files are quarantined unread
    allowed_formats: ImageFormats = ("JPEG", "PNG", "WEBP", "BMP")
    # Symlinks in the source: inside_source follows only links that resolve inside the source tree;
    # never quarantines every link; always follows any (reads whatever they point at).
    follow_symlinks: Literal["inside_source", "never", "always"] = "inside_source"
    cpus_per_task: float = Field(1.0, gt=0)
    # Fewer source files than this: the shard tasks run as plain Ray tasks, not through Ray Data,
    # whose start (its own actors, its executor) was 2 s of the 2-core demo's 3 s ETL. 0: always Ray Data.
    ray_data_min_files: int = Field(20_000, ge=0)

    @field_validator("formats")
    @classmethod
    def _one_of_each(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or len(set(v)) != len(v):  # none publishes no shards; a repeat lists each shard twice
            raise ValueError("list each shard format once, at least one: [parquet], [tar] or [parquet, tar]")
        return v


class AugmentConfig(Section):
    random_resized_crop: bool = True
    scale_min: float = Field(0.6, gt=0, le=1)  # min area fraction kept by the random crop
    # Off by default: a mirror image is another class for digits, text, arrows, left/right
    # signs. On held-out orientation-sensitive data flip=true cost 5 points (0.933 vs 0.982).
    # Turn it on for mirror-symmetric classes (animals, objects); the default search tries both.
    flip: bool = False
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.25, 0.25, 0.25)


ModelName = Literal["small_cnn", "resnet18", "resnet50"]  # stages.model.zoo builds each


class TrainConfig(Section):
    model: ModelName = "small_cnn"  # a typo had started Ray and failed 4 trial actors, exit 1
    width: int = Field(32, ge=4)  # base channel width (small_cnn only)
    # The weights a run starts from (README "Fine-tuning"): a raymill train/tune output folder
    # (model.pt + model.json), a torchvision-format ResNet state dict (.pth/.pt) or a .safetensors
    # file; local or s3://. Never unpickled. None: random weights.
    init_from: Annotated[str, AfterValidator(check_init_from)] | None = None
    freeze_epochs: int = Field(0, ge=0)  # the first N epochs train the head only (backbone and its BN frozen)
    backbone_lr_scale: float = Field(1.0, gt=0)  # after the freeze: backbone lr = this x the head's
    dropout: float = Field(0.0, ge=0, lt=1)
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(64, ge=1)  # per worker
    lr: float = Field(0.05, gt=0)
    weight_decay: float = Field(5e-4, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    warmup_epochs: float = Field(0.5, ge=0)
    num_workers: int | None = Field(None, ge=1)  # None: planned (session.planned_workers)
    min_workers: int | None = Field(None, ge=1)  # set for elastic training: (min_workers, num_workers)
    # Who runs the loop (session.train_host): auto = one Tune trial actor for one worker on a one-node
    # cluster with stream ingest (stages/train/solo.py: 7 s less start-up on 2 cores), else Ray Train's
    # TorchTrainer; ray_train: always the TorchTrainer; tune_trial: the actor (one worker, stream only).
    host: Literal["auto", "ray_train", "tune_trial"] = "auto"
    use_gpu: bool = False
    cpus_per_worker: float | None = Field(None, gt=0)  # None: planned by stages.common.session
    gpus_per_worker: float = Field(1.0, gt=0)
    # auto: bf16 on a GPU that supports it, else fp32. channels_last None: on (faster on GPUs and,
    # measured, on CPUs too).
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    channels_last: bool | None = None
    pin_memory: bool = True  # GPU only: pinned host buffers + non_blocking copies
    data_format: Literal["parquet", "tar"] = "parquet"
    shuffle_buffer_rows: int = Field(512, ge=1)
    prefetch_batches: int = Field(4, ge=0)
    # Decode + augment processes per worker (stages.feed.decode_pool), outside the loop's GIL. None: the
    # plan's (stages.common.session: one per CPU of the worker); 0: decode in train.decode_threads
    # threads of the training process instead (the old path).
    decode_processes: int | None = Field(None, ge=0)
    decode_threads: int = Field(2, ge=1)
    # Decoded tier (stages.feed.decoded_tier): from epoch 2 on, each rank trains on the decoded,
    # pre-augmentation pixels of its epoch-1 rows, kept in memory and augmented as tensor ops.
    # auto: on the GPU if they fit in decoded_tier_gpu_share of its memory, else in host memory if
    # they fit in decoded_tier_host_gb, else off (said in the log). gpu/host: only there.
    decoded_tier: Literal["off", "auto", "gpu", "host"] = "off"
    decoded_tier_gpu_share: float = Field(0.3, gt=0, le=0.9)
    decoded_tier_host_gb: float = Field(8.0, gt=0)
    augment: AugmentConfig = AugmentConfig()
    checkpoint_every_steps: int = Field(0, ge=0)  # 0: only at epoch ends
    num_to_keep: int = Field(2, ge=1)
    max_failures: int = Field(3, ge=0)
    # After a node loss Ray Train waits for room for the whole group (or min_workers); past this
    # many seconds of waiting, training stops with an error naming what is missing (exit 1).
    capacity_timeout_s: float = Field(600.0, gt=0)
    storage_path: Annotated[str, AfterValidator(check_location)] | None = None  # Ray Train storage (local or s3://); None: <run dir>/ray
    cache_dir: str = "~/.cache/raymill/shards"  # local copies of remote shards
    cache_max_gb: float = Field(20.0, gt=0)
    ledger: bool = False  # record every consumed sample key (tests, audits)
    max_steps: int | None = Field(None, ge=1)  # stop early (benchmarks, smoke runs)
    # stream: each worker reads its own shards (exact mid-epoch resume). ray_data: Ray Data decodes
    # on any CPU of the cluster, epoch-granular resume (README, "Which ingest when").
    ingest: Literal["stream", "ray_data"] = "stream"
    data_cpus_per_task: float | None = Field(None, gt=0)  # ray_data: CPUs a decode task; unset: planned
    object_store_cache: bool = False  # ray_data: decode once, keep decoded train set in the object store
    # ray_data: the share of an epoch's batches after which the next epoch's execution starts
    # (stages/feed/ray_data.WarmEpochs); 1: not before this epoch ends, a cold start each epoch
    next_epoch_at: float = Field(0.5, ge=0, le=1)
    # Extra custom resources per worker, e.g. {accelerator: 1}: pins workers to the nodes that have them.
    worker_resources: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_worker_host(self) -> "TrainConfig":
        if self.host == "tune_trial" and ((self.num_workers or 1) > 1 or self.min_workers or self.ingest != "stream"):
            raise ValueError("train.host=tune_trial runs one worker with train.ingest=stream; unset train.num_workers "
                             "and train.min_workers, set train.ingest=stream, or set train.host=auto")
        return self


class TuneConfig(Section):
    enabled: bool = False
    num_samples: int = Field(8, ge=1)
    metric: str = "val_acc"
    mode: Literal["max", "min"] = "max"
    scheduler: Literal["asha", "fifo", "pbt"] = "asha"
    max_epochs: int = Field(6, ge=1)  # budget per trial; also the upper end of a searched train.epochs
    grace_period: int = Field(1, ge=1)
    reduction_factor: int = Field(3, ge=2)
    perturbation_interval: int = Field(1, ge=1)  # pbt: epochs between exploit/explore steps
    seed: int = 0
    workers_per_trial: int = Field(1, ge=1)
    max_concurrent_trials: int | None = Field(None, ge=1)  # None: as many as fit (session.plan_trials)
    max_failures: int = Field(1, ge=0)  # retries per trial
    handoff: Literal["reuse"] = "reuse"  # publish the best trial's best checkpoint
    # Default: optimiser, augmentation and training length, the knobs that mattered on real data
    # (see default_search_space). train.epochs is searched within tune.max_epochs.
    search_space: dict[str, Distribution] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_removed(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("handoff") == "retrain":
            raise ValueError("tune.handoff=retrain was removed; the search publishes the best trial's "
                             "checkpoint. To retrain with its params, copy best.json's train_config "
                             "into --set train.* and run `raymill train`")
        return tune_defaults(data)

    @field_validator("search_space")
    @classmethod
    def _known_params(cls, space: dict[str, Distribution]) -> dict[str, Distribution]:
        known = set(TrainConfig.model_fields)
        for key in space:
            if key.split(".")[0] not in known:
                searchable = sorted(known - set(SET_BY_TUNE) - set(SHARED_IN_SEARCH))
                raise ValueError(f"search_space key '{key}' is not a train.* field; searchable: {searchable}")
        return space

    def models(self, train_model: str) -> list[str]:
        """Every train.model a trial of the search may build (`train_model` unless searched)."""
        d = self.search_space.get("model")
        return list(d.values) if d is not None and d.type == "choice" else [train_model]


class Config(Section):
    ray: RayConfig = RayConfig()
    s3: S3Config = S3Config()
    run: RunSection = RunSection()
    etl: EtlConfig = EtlConfig()
    train: TrainConfig = TrainConfig()
    tune: TuneConfig = TuneConfig()
    infer: InferConfig = InferConfig()
    serve: ServeConfig = ServeConfig()
    tracking: TrackingConfig = TrackingConfig()
    export: ExportConfig = ExportConfig()


def _explain(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        path = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            parent = _section_at(item["loc"][:-1])
            valid = ", ".join(sorted(parent.model_fields)) if parent else "see README"
            lines.append(f"unknown config key '{path}'; valid keys here: {valid}")
        elif item["type"] in ("tuple_type", "list_type") and isinstance(item.get("input"), (str, int, float)):
            # `--set etl.formats=parquet`: YAML reads a scalar; the fix is the list's brackets
            lines.append(f"config key '{path}' takes a list (got {item['input']!r}); write "
                         f"{path}=[{item['input']}], items separated by commas")
        else:
            lines.append(f"config key '{path}': {item['msg']} (got {item.get('input')!r})")
    return "; ".join(lines)


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML config (or defaults when `path` is None) and apply `a.b=value` overrides."""
    data = read_config_file(Path(path)) if path is not None else {}
    data = merge(data, parse_overrides(overrides))
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def section_dict(section: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a config section, for manifests."""
    return section.model_dump(mode="json")
