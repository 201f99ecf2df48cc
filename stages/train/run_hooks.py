"""Where the training loop reports to and restores from: a Ray Train rank, or a one-worker Tune trial.

`stages.train.loop` is the one training loop. What differs between its two hosts is injected here:
- `TrainHooks`: one rank of a Ray Train V2 run (the train stage, and Tune trials of several
  workers, which keep the Train V2 driver pattern): `ray.train.report`/`get_checkpoint`, DDP.
- `TuneHooks`: a one-worker Tune trial that runs the loop directly in its Tune function actor:
  no TorchTrainer, no controller, no second placement group, `ray.tune.report`/`get_checkpoint`.
  With `reuse_actors`, one actor runs many trials (the process, imports and torch start once)
  and keeps the model of each shape. Its decode pool is not kept: a pool left idle for the next
  trial lived until Tune ended the actor, and that end left the pool's named semaphores in
  /dev/shm (10 per 4-trial search here, with an atexit close too); a new pool per trial costs
  about 0.07 s on a reused actor (decode_pool's fork server has the imports done). The decoded
  tier is not carried between trials either: a trial fills it during its first epoch at no extra
  decode cost, and reading a kept one in epoch 1 would make a trial's sample order depend on which
  actor ran it.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

__all__ = ["TrainHooks", "TuneHooks"]

log = logging.getLogger(__name__)

# Per process, so per Tune actor: kept across the trials that `reuse_actors` runs in it.
_MODELS: dict[tuple, tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]] = {}


class TrainHooks:
    """One rank of a Ray Train V2 run."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()

    def build(self, key: tuple, builder: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        return builder()  # a Train worker process lives for one run: nothing to reuse

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model)  # DDP when world > 1, and the device

    def report(self, metrics: dict[str, Any], folder: str | None, name: str | None = None) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(folder) if folder else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name if folder else None)

    def get_checkpoint(self):
        import ray.train

        return ray.train.get_checkpoint()


class TuneHooks:
    """A one-worker Tune trial running the loop inside its own function actor."""

    rank, world = 0, 1

    def __init__(self, resume=None) -> None:
        """`resume`: the checkpoint to start from when Tune has none for this trial (the last one
        an earlier attempt of a one-worker train committed, stages.train.solo)."""
        import ray

        self.resume = resume

        # Tune sets CUDA_VISIBLE_DEVICES to the trial's GPUs, so the trial's GPU is cuda:0.
        gpus = ray.get_gpu_ids() if torch.cuda.is_available() else []
        self.device = torch.device("cuda", 0) if gpus else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def build(self, key: tuple, builder: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """The model of shape `key` (architecture, classes, width, dropout, seed, layout): built by
        the first trial of this actor, then handed to each later trial reset to the same initial
        weights (a copy, not a fresh seeded init: resnet50's init draws 25M random values)."""
        if key in _MODELS:
            model, initial, rng = _MODELS[key]
            model.load_state_dict(initial)
            # where a fresh seeded build leaves torch's RNG (dropout draws from it): a trial must
            # not train differently because its actor had run another trial before
            torch.set_rng_state(rng)
            return model
        model = builder()
        _MODELS.clear()  # one shape at a time: a search rarely changes shape between trials
        _MODELS[key] = (model, {k: v.detach().clone() for k, v in model.state_dict().items()},
                        torch.get_rng_state())
        return model

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)  # one worker: no DDP wrapper

    def report(self, metrics: dict[str, Any], folder: str | None, name: str | None = None) -> None:
        import ray.tune

        # Tune names the folder itself (checkpoint_000007); meta.json inside says epoch and step.
        checkpoint = ray.tune.Checkpoint.from_directory(folder) if folder else None
        ray.tune.report(metrics, checkpoint=checkpoint)

    def get_checkpoint(self):
        import ray.tune

        # the trial's own latest checkpoint, or under PBT the donor's that the trial was cloned from
        return ray.tune.get_checkpoint() or self.resume
