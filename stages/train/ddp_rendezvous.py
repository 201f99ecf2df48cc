"""DDP rendezvous that opens no port off loopback when every worker is on one node.

Ray Train's torch backend sets up the process group with `env://`: rank 0 hosts torch's TCPStore,
which binds every interface with no authentication (TCPStore has no bind address, and
`TorchConfig` has no option for one). When all workers of a group share a node, nothing needs a
network socket: this backend rendezvouses through a `file://` store (torch's FileStore, a file in
the node's temp dir, fresh for every start of the worker group so a restart after a SIGKILL never
reads a stale one) and keeps gloo's and NCCL's own pair sockets on the loopback interface
(`GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME`, torch's and NCCL's documented switches; values the
user set are kept). Groups that span nodes get Ray's own backend unchanged: a cluster's nodes must
reach each other, and the README's security-group rule covers them.

It plugs in through Ray Train's public extension point: a `ray.train.backend.BackendConfig` whose
`backend_cls` is a `ray.train.backend.Backend` (both DeveloperAPI), using only the worker group's
`execute` and `len`; `TorchTrainer` takes it as its `torch_config`. It is not a subclass of
`ray.train.torch.TorchConfig`, whose module imports torch at its top: Train's controller unpickles
this config, and torch's import there (~1.3 s on 2 cores) delayed every run's worker group. So it
keeps TorchConfig's three fields and its per-worker context (the worker's CUDA device) itself, and
reports no `framework` to Train's state API (which only reads it to list torch's version there).
"""
from __future__ import annotations

import logging
import os
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta

from typing import Optional

from ray.train.backend import Backend, BackendConfig

__all__ = ["LoopbackTorchConfig"]

log = logging.getLogger(__name__)

STORE_PREFIX = "raymill-ddp-"  # the store files in the node's temp dir (a SIGKILLed group leaves its own)
_LOOPBACK_IFNAME = "lo"  # Linux's loopback interface


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _store_path(token: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{STORE_PREFIX}{token}")


def _init_on_loopback(backend: str, token: str, timeout_s: int) -> None:
    """In each worker: torch's documented env vars, then the process group through a file store."""
    import ray.train
    import torch.distributed as dist

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    os.environ.update({"LOCAL_RANK": str(context.get_local_rank()), "RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
                       "NODE_RANK": str(context.get_node_rank()), "WORLD_SIZE": str(world)})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _LOOPBACK_IFNAME)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", _LOOPBACK_IFNAME)
    if backend == "nccl":  # as Ray's backend: fail on a timed-out collective instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend=backend, init_method=f"file://{_store_path(token)}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def _shutdown(token: str, destroy: bool) -> None:
    import torch.distributed as dist

    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    try:
        os.remove(_store_path(token))
    except FileNotFoundError:
        pass  # another rank removed it, or FileStore did when the last rank closed it


class _LoopbackBackend(Backend):
    """Ray's torch backend for groups across nodes; a file store on loopback for one node."""

    # As Ray's torch backend: the workers on a node see all of its GPUs (each uses its local
    # rank's), so NCCL can use peer-to-peer links between them. False (Backend's default) had
    # given each worker only its own GPU on a multi-GPU node.
    share_cuda_visible_devices = True

    def __init__(self):
        self._token: str | None = None

    def _ray_backend(self, config: LoopbackTorchConfig) -> Backend:
        from ray.train.torch import TorchConfig  # groups across nodes only: it imports torch

        return TorchConfig(backend=config.backend, init_method=config.init_method,
                           timeout_s=config.timeout_s).backend_cls()

    def on_start(self, worker_group, backend_config: LoopbackTorchConfig) -> None:
        nodes = set(worker_group.execute(_node_id))
        if len(nodes) > 1 or not backend_config.backend:
            self._token = None
            log.info("DDP rendezvous: Ray's TCP store (%d nodes)", len(nodes))
            return self._ray_backend(backend_config).on_start(worker_group, backend_config)
        self._token = uuid.uuid4().hex  # fresh per group start: a restarted group never sees a stale file
        worker_group.execute(_init_on_loopback, backend_config.backend, self._token, backend_config.timeout_s)
        log.info("DDP rendezvous: file store on one node, %s sockets on loopback (%d workers)",
                 backend_config.backend, len(worker_group))

    def on_training_start(self, worker_group, backend_config: LoopbackTorchConfig) -> None:
        if self._token is None:  # Ray's backend, Ray's hook; one node: _init_on_loopback set torch's env vars
            self._ray_backend(backend_config).on_training_start(worker_group, backend_config)

    def on_shutdown(self, worker_group, backend_config: LoopbackTorchConfig) -> None:
        if self._token is None:
            return self._ray_backend(backend_config).on_shutdown(worker_group, backend_config)
        worker_group.execute(_shutdown, self._token, len(worker_group) > 1)


class _WorkerDevice:
    """Each worker's train function runs with its CUDA device current (as TorchConfig's does)."""

    def __enter__(self):
        import ray.train.torch
        import torch

        if torch.cuda.is_available():
            device = ray.train.torch.get_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc) -> bool:
        return False


@dataclass
class LoopbackTorchConfig(BackendConfig):
    """`TorchConfig`'s fields, whose process group opens no port off loopback on a single node."""

    backend: Optional[str] = None
    init_method: str = "env"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _LoopbackBackend

    @property
    def train_func_context(self):
        return _WorkerDevice
