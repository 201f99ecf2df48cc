"""What the Ray cluster's nodes have, and what other work holds on them now: the facts that
`stages.common.session` plans from.

Ray's public per-node view (`ray.nodes()`) gives totals only, and Serve waits forever for a
replica that no node has room for. So what is held comes from the State API (the dashboard, on
127.0.0.1 behind the token): alive actors outside placement groups, and the bundles of created
placement groups, which hold their resources whether or not an actor runs in them (Train's and
Tune's workers). Tasks come and go in seconds, so they are not counted.
"""
from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

__all__ = ["node_resources", "free_node_resources", "units_that_fit", "cluster_resources", "local_cpus"]

log = logging.getLogger(__name__)
_COUNTED = ("CPU", "GPU", "memory")  # what the plans need; custom resources are left as totals


def local_cpus() -> int:
    """This process's cores when no Ray counts them: its CPU affinity, within the cgroup's CPU quota
    (a container's --cpus; a 2-CPU container on a 64-core host has 2), as Ray counts a node's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.floor(quota))) if quota else cores


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs the cgroup may use (v2 `cpu.max`, or v1's CFS quota and period); None: no quota."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            text = Path(root, quota_file).read_text().split()
            quota, period = text[0], text[1] if period_file is None else Path(root, period_file).read_text().strip()
            if quota not in ("max", "-1") and float(period) > 0:
                return float(quota) / float(period)
        except (OSError, ValueError, IndexError):
            continue
    return None


def node_resources() -> list[dict[str, float]]:
    """Each alive node's total resources (CPU, GPU, memory in bytes, custom ones)."""
    return list(_nodes_by_id().values())


def _nodes_by_id() -> dict[str, dict[str, float]]:
    import ray

    return {n["NodeID"]: {k: float(v) for k, v in n.get("Resources", {}).items()}
            for n in ray.nodes() if n.get("Alive")}


def units_that_fit(need: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many replicas or workers needing `need` fit on `nodes`, node by node (none spans nodes)."""
    return sum(min(int(node.get(r, 0.0) / amount + 1e-9) for r, amount in need.items() if amount > 0)
               for node in nodes)


def free_node_resources(own_app: str | None = None) -> tuple[list[dict[str, float]], str]:
    """Each alive node's resources less what alive actors and placement groups hold there now,
    not counting Serve app `own_app`'s replicas (a rollout replaces them), and a short account of
    the largest holders for messages ("" when nothing is held). Where the State API cannot be
    reached (the dashboard off), the totals, with "".
    """
    from ray.util.state.exception import RayStateApiException, ServerUnavailable

    nodes = _nodes_by_id()
    held: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    try:
        holdings = list(_holdings(own_app))
    except (RayStateApiException, ConnectionError, ValueError) as e:  # no dashboard found, or it failed
        log.log(logging.DEBUG if isinstance(e, ServerUnavailable) else logging.WARNING,
                "cluster: the State API could not list what other work holds (%s); planning on totals", e)
        return list(nodes.values()), ""
    for node_id, holder, resources in holdings:
        node = nodes.get(node_id)
        for key, amount in resources.items():
            if node is not None and key in _COUNTED and key in node:
                node[key] = max(0.0, node[key] - amount)
                held[holder][key] += amount
    return list(nodes.values()), _account(held)


def _holdings(own_app: str | None) -> Iterator[tuple[str, str, dict[str, float]]]:
    """(node id, holder, resources) of every alive actor outside a placement group and every
    created placement group's bundle."""
    import ray
    from ray.util.state import list_actors, list_placement_groups

    # This process's Ray, by its GCS address: without one the State API looks for "the" Ray on the
    # machine, and with a second Ray running (another user's, another serve) it refused to choose
    address = ray.get_runtime_context().gcs_address
    own = f"ServeReplica:{own_app}:" if own_app else None
    for actor in list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=10_000,
                             raise_on_missing_output=False):
        if actor.placement_group_id or (own and (actor.class_name or "").startswith(own)):
            continue  # a placement group's actor uses its bundle, counted below
        yield actor.node_id, actor.class_name or "actor", actor.required_resources or {}
    for group in list_placement_groups(address=address, filters=[("state", "=", "CREATED")], detail=True,
                                       limit=10_000, raise_on_missing_output=False):
        for bundle in group.bundles or []:
            yield bundle.get("node_id"), f"placement group {group.name or group.placement_group_id[:8]}", \
                bundle.get("unit_resources") or {}


def _account(held: dict[str, dict[str, float]], most: int = 4) -> str:
    """'ServeReplica:a:Classifier 1 GPU 0.5 CPU; ...', the largest holders first (GPUs, then CPUs)."""
    def size(item):
        return item[1].get("GPU", 0.0), item[1].get("CPU", 0.0)

    parts = []
    for holder, res in sorted(((h, r) for h, r in held.items() if any(r.values())), key=size, reverse=True)[:most]:
        amounts = [f"{res[k]:g} {k}" for k in ("GPU", "CPU") if res.get(k)]
        amounts += [f"{res['memory'] / 2**20:.0f} MB"] if res.get("memory") else []
        parts.append(f"{holder} {' '.join(amounts)}")
    return "; ".join(parts)


def cluster_resources() -> dict[str, Any]:
    """Totals, plus the node shapes a worker must fit in: the largest node's CPUs, the fewest CPUs
    per GPU on any GPU node (a GPU worker's CPUs come from its own node), and under "nodes" each
    node's (CPUs, GPUs): a plan's workers are placed node by node."""
    import ray

    res = ray.cluster_resources()
    nodes = node_resources()
    gpu_nodes = [n for n in nodes if n.get("GPU", 0) > 0]
    out = {"CPU": float(res.get("CPU", 0)), "GPU": float(res.get("GPU", 0)),
           "max_node_cpus": max((float(n.get("CPU", 0)) for n in nodes), default=float(res.get("CPU", 0))),
           "nodes": tuple((float(n.get("CPU", 0)), float(n.get("GPU", 0))) for n in nodes)}
    if gpu_nodes:
        out["node_cpus_per_gpu"] = min(float(n.get("CPU", 0)) / float(n["GPU"]) for n in gpu_nodes)
    return out
