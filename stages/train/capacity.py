"""A bounded wait for cluster capacity after a node loss (`train.capacity_timeout_s`).

Ray Train V2 retries a worker group that cannot be placed forever: each start waits
RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S for its placement group, and a timed-out start is a
controller error retried up to `FailureConfig.controller_failure_limit` times (-1, forever, by
default). Here that limit is derived from the capacity timeout, so a run that lost a node and
gets no replacement stops with an error that names the missing resources, instead of hanging.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any

from stages.common.cluster import units_that_fit
from stages.common.session import WorkerPlan

__all__ = ["CapacityError", "failure_config_kwargs", "is_capacity_timeout", "capacity_error",
           "workers_that_fit"]

log = logging.getLogger(__name__)

START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # documented in Ray Train's timeout error
_RAY_DEFAULT_START_TIMEOUT_S = 60.0
_set_by_us: str | None = None  # the value this module wrote, so a user's own setting wins


class CapacityError(RuntimeError):
    """The cluster stayed too small for the training group for train.capacity_timeout_s."""


def start_timeout_s(capacity_timeout_s: float) -> float:
    """Seconds one worker-group start waits for its placement group.

    Shorter than Ray's 60 s default when the capacity budget is small, so the budget holds at
    least two attempts (a replacement node that joins mid-attempt is used by the next one).
    Ray Train copies this variable from the driver's environment to its controller.
    """
    global _set_by_us
    current = os.environ.get(START_TIMEOUT_ENV)
    if current is not None and current != _set_by_us:
        return float(current)
    value = f"{min(_RAY_DEFAULT_START_TIMEOUT_S, max(5.0, capacity_timeout_s / 2)):g}"
    os.environ[START_TIMEOUT_ENV] = _set_by_us = value
    return float(value)


def failure_config_kwargs(max_failures: int, capacity_timeout_s: float) -> dict[str, Any]:
    """Keyword arguments for ray.train.FailureConfig: worker retries plus a bounded capacity wait."""
    per_start_s = start_timeout_s(capacity_timeout_s)
    # Ray raises once the count of timed-out starts exceeds the limit: limit + 1 attempts in all.
    limit = max(0, math.ceil(capacity_timeout_s / per_start_s) - 1)
    return {"max_failures": max_failures, "controller_failure_limit": limit}


def is_capacity_timeout(error: BaseException) -> bool:
    """True when Train gave up because its worker group could not be placed in time."""
    stack: list[BaseException | None] = [error]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        # The class lives in Ray's internal module; match it by its (stable) name.
        if type(item).__name__ == "WorkerGroupStartupTimeoutError":
            return True
        # ray.train.ControllerError keeps the controller's exception in `controller_failure`.
        stack += [getattr(item, "controller_failure", None), item.__cause__, item.__context__]
    return False


def workers_that_fit(per_worker: dict[str, float], nodes: list[dict]) -> int:
    """How many workers of `per_worker` resources the alive `nodes` (ray.nodes() rows) can hold."""
    return units_that_fit(per_worker, [n.get("Resources", {}) for n in nodes if n.get("Alive")])


def capacity_error(plan: WorkerPlan, capacity_timeout_s: float, out: str,
                   nodes: list[dict] | None = None, worker_resources: dict[str, float] | None = None) -> CapacityError:
    """The error to stop with: what the group needs, what the cluster has, and how to go on.
    `worker_resources` (train.worker_resources) count too: a node without them holds no worker."""
    import ray

    nodes = ray.nodes() if nodes is None else nodes
    per_worker = plan.resources(worker_resources or {})
    need = plan.min_workers or plan.num_workers
    fit = workers_that_fit(per_worker, nodes)
    alive = [n for n in nodes if n.get("Alive")]
    have = {name: sum(n.get("Resources", {}).get(name, 0.0) for n in alive) for name in per_worker}
    shape = ", ".join(f"{k}: {v:g}" for k, v in per_worker.items())
    return CapacityError(
        f"training waited train.capacity_timeout_s={capacity_timeout_s:g}s for room for {need} worker(s) "
        f"of {{{shape}}}, but the {len(alive)} alive node(s) ({', '.join(f'{k} {v:g}' for k, v in have.items())}) "
        f"fit only {fit}; missing: {max(need - fit, 1)} x {{{shape}}}. Add a node "
        f"(`ray start --address=<head-ip>:6379`) or lower the group (train.min_workers={max(fit, 1)} for "
        f"elastic training), then rerun the same command with the same output ({out}): it resumes from "
        f"the last checkpoint")
