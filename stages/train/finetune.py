"""The fine-tuning side of a training rank: init weights, head-only epochs, the backbone's own lr.

- `shipped` (driver) puts the checked init bytes in Ray's object store once; `load_init` (each
  worker, any node) fetches them and checks their sha256, so nothing depends on the driver's disk.
- `train.freeze_epochs`: in the first N epochs the backbone's gradients are dropped (set to None)
  after backward, so SGD and AdamW skip those parameters entirely (no momentum, no weight decay:
  they stay bit-identical), and the backbone's BatchNorm layers run in eval mode (running stats
  unchanged). requires_grad stays on, so DDP's buckets are the same in every epoch.
- `train.backbone_lr_scale`: two parameter groups, head first, then the backbone at `scale` x the
  head's lr. The layout depends on the config only (fingerprinted), so a resumed run, or a PBT trial
  cloned from its donor (whose config it copies), loads an optimiser state of the same layout.
"""
from __future__ import annotations

from typing import Any

import torch

from stages.model import init_weights
from stages.common.config import TrainConfig

__all__ = ["shipped", "load_init", "uses_groups", "frozen", "group_lrs", "optimizer", "apply_hyperparameters",
           "backbone_params", "freeze_norms", "drop_grads"]

_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def shipped(plan: init_weights.InitPlan | None) -> dict[str, Any]:
    """The loop config's `init` entry: the checked record and a reference to the checked bytes."""
    if plan is None:
        return {}
    import ray  # only a run with init weights needs the object store here

    return {"init": {"record": plan.record, "payload": ray.put(plan.payload)}}


def load_init(model: torch.nn.Module, init: dict[str, Any] | None, model_name: str) -> None:
    """Load the run's init weights (the loop config's `init`, if any) into a freshly built model."""
    if not init:
        return
    import ray

    init_weights.apply(model, ray.get(init["payload"]), init["record"], model_name)


def _head(name: str, model_name: str) -> bool:
    name = name[len("module."):] if name.startswith("module.") else name  # DDP's wrapper prefix
    return name.startswith(init_weights.HEAD_PREFIX[model_name])


def uses_groups(cfg: TrainConfig) -> bool:
    """A run with a freeze or a backbone lr scale keeps head and backbone in groups of their own."""
    return cfg.freeze_epochs > 0 or cfg.backbone_lr_scale != 1.0


def frozen(cfg: TrainConfig, epoch: int) -> bool:
    return epoch < cfg.freeze_epochs


def group_lrs(cfg: TrainConfig, groups: int) -> list[float]:
    """Each group's base lr: the head's is train.lr, the backbone's x backbone_lr_scale."""
    return [cfg.lr, cfg.lr * cfg.backbone_lr_scale][:groups] if groups <= 2 else [cfg.lr] * groups


def optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD or AdamW over `model` (DDP-wrapped or not): one group, or head then backbone."""
    params: list = list(model.parameters())
    if uses_groups(cfg):
        named = list(model.named_parameters())
        head = [p for n, p in named if _head(n, cfg.model)]
        backbone = [p for n, p in named if not _head(n, cfg.model)]
        params = [{"params": group, "lr": lr} for group, lr in zip((head, backbone), group_lrs(cfg, 2))]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           nesterov=cfg.momentum > 0)


def apply_hyperparameters(cfg: TrainConfig, optimizer: torch.optim.Optimizer, schedule) -> None:
    """This run's lr (per group), momentum and weight decay over a loaded optimiser and schedule.

    A resumed run loads its own values back (no change). A PBT trial loads its donor's
    checkpoint, whose optimiser state carries the donor's values: the explored ones must win,
    and the schedule keeps its position (the factor at its step) with the new base lr.
    """
    schedule.base_lrs = group_lrs(cfg, len(optimizer.param_groups))
    factor = schedule.lr_lambdas[0](schedule.last_epoch)
    for group, base in zip(optimizer.param_groups, schedule.base_lrs):
        group.update(initial_lr=base, lr=base * factor, weight_decay=cfg.weight_decay)
        if "momentum" in group:  # SGD; AdamW has betas instead
            group["momentum"] = cfg.momentum


def backbone_params(model: torch.nn.Module, model_name: str) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if not _head(n, model_name)]


def freeze_norms(model: torch.nn.Module, model_name: str) -> None:
    """The backbone's BatchNorm layers to eval mode (after model.train(), each frozen epoch)."""
    for name, module in model.named_modules():
        if isinstance(module, _NORMS) and not _head(name + ".", model_name):
            module.eval()


def drop_grads(params: list[torch.nn.Parameter]) -> None:
    """Gradients to None: the optimiser step then skips these parameters (no decay, no momentum)."""
    for p in params:
        p.grad = None
