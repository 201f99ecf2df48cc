"""What a raymill session exposes: every listening TCP socket of its processes, classified, and
the switch that keeps a local Ray on loopback (`keep_local_on_loopback`, used by session.start).

Used by `raymill doctor` and by tests/test_exposure.py, so the command and the test agree:
- `loopback`: reachable from this machine only;
- `ray-grpc-token`: one of Ray's gRPC servers that refused a call made without the token;
- `named`: a documented exception (EXCEPTIONS), with its reason;
- `exposed`: anything else. A local run must have none.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable

import psutil

__all__ = ["keep_local_on_loopback", "check_loopback", "LOCAL_ONLY_ENV", "Listener", "listeners", "process_tree",
           "ray_processes", "classify", "rows", "EXCEPTIONS"]

log = logging.getLogger(__name__)

# Ray's documented switch for single-machine Ray (macOS and Windows default to it): with it off,
# Ray takes 127.0.0.1 as the node's address, and GCS, raylet, workers, the agents and the
# Prometheus exporters all listen on loopback. Read when Ray is imported.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_local_on_loopback() -> None:
    """Before Ray starts locally: nothing it opens listens beyond this machine.

    Without it a local run had 20 of 24 listeners off loopback, two of them (the Prometheus
    exporters) answering without the token. A user who set the variable keeps their value;
    if Ray was imported before raymill could set it, the run says so (`check_loopback`).
    """
    if LOCAL_ONLY_ENV not in os.environ and "ray" not in sys.modules:
        os.environ[LOCAL_ONLY_ENV] = "0"


def check_loopback() -> None:
    import ray

    address = ray.util.get_node_ip_address()
    if not address.startswith("127."):
        # the stages import Ray only when they run (tests/test_exposure.py): the caller imported it
        log.warning("this local Ray listens on %s, not only on loopback: Ray was imported before "
                    "raymill started it (call stages.common.session.start(cfg.ray) before importing "
                    "ray, as the notebooks do, or set %s=0 before importing ray); `raymill doctor` "
                    "lists what is open", address, LOCAL_ONLY_ENV)


def _is_tcp_store(port: int) -> bool:
    """True when a torch TCPStore answers on `port` (the client handshake validates the server;
    no key is read or written)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False)
        return True
    except Exception:  # RuntimeError/DistStoreError: not a TCPStore, or gone
        return False


# Listeners that may face the network: (process name prefix, a check that it is that listener)
# -> the reason. Everything else of a local run is on loopback (keep_local_on_loopback).
EXCEPTIONS: dict[tuple[str, Callable[[int], bool]], str] = {
    ("ray::RayTrainWorker", _is_tcp_store): (
        "torch's DDP rendezvous store (TCPStore, on rank 0, while a training run that spans nodes "
        "runs) binds every interface with no authentication: torch's TCPStore has no bind address "
        "and Ray Train's TorchConfig no listen option. One-node runs use a file store instead "
        "(stages/train/ddp_rendezvous.py); clusters keep it inside the security group (README, Security)"),
}

@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    address: str
    port: int


def listeners(pids: set[int]) -> list[Listener]:
    """The listening TCP sockets of `pids` (processes that vanished meanwhile are skipped)."""
    out = set()
    for conn in psutil.net_connections("tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        try:
            name = psutil.Process(conn.pid).name()
        except psutil.NoSuchProcess:
            continue
        out.add(Listener(conn.pid, name, conn.laddr.ip, conn.laddr.port))
    return sorted(out, key=lambda l: (l.process, l.port))


def process_tree(pid: int) -> set[int]:
    """`pid` and its descendants (a raymill command: its local Ray is its child)."""
    try:
        return {pid} | {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def ray_processes() -> set[int]:
    """This user's Ray processes on this machine, and the drivers that started them."""
    me = psutil.Process().username()
    pids, scripts = set(), _ray_package()
    for p in psutil.process_iter(["pid", "name", "username", "cmdline"]):
        # Named processes, and Python ones running a script of Ray's package: the dashboard head
        # (HTTP and the Jobs API) and the autoscaler monitor are plain "python" processes
        ours = (p.info["name"] or "").startswith(("gcs_server", "raylet", "ray::", "ray-")) or \
            any(arg.startswith(scripts) for arg in p.info["cmdline"] or ())
        if p.info["username"] == me and ours:
            pids.add(p.info["pid"])
            try:
                pids |= {a.pid for a in p.parents()[:1]}  # the driver or raylet that started it
            except psutil.NoSuchProcess:
                pass
    return pids


def _ray_package() -> str:
    """Ray's package folder, found without importing Ray (doctor must not start or join one)."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return os.path.join(locations[0], "") if locations else "\0"  # "\0" starts no argument


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


# One real method of each of Ray's gRPC services (Ray's wire protocol, not a Python API): Ray
# checks the token per registered method, so a made-up method name proves nothing.
_PROBES = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetNodeStats",
           "/ray.rpc.ObjectManagerService/FreeObjects", "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
           "/ray.serve.ASGIService/HandleRequest")  # Serve replicas' inter-deployment server (on [::])


def _refuses_without_token(port: int) -> bool:
    """True when the server at `port` answers UNAUTHENTICATED to a call made without the token
    (an empty request to one of its real methods) and answers no probe at all."""
    import grpc

    refused = False
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for method in _PROBES:
            try:
                channel.unary_unary(method)(b"", timeout=1)
                return False  # it answered without the token
            except grpc.RpcError as e:
                refused |= e.code() == grpc.StatusCode.UNAUTHENTICATED
                if e.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED):
                    return False  # not a gRPC server we know (or not reachable): not proven
    return refused


def classify(listener: Listener) -> tuple[str, str]:
    """(kind, why) for one listener; kinds as in the module docstring."""
    if _loopback(listener.address):
        return "loopback", "reachable from this machine only"
    for (prefix, check), why in EXCEPTIONS.items():
        if listener.process.startswith(prefix) and check(listener.port):
            return "named", why
    if _refuses_without_token(listener.port):  # Ray's drivers and workers are named `python` too
        return "ray-grpc-token", "Ray gRPC: refused a call without the token"
    return "exposed", "not loopback, not token-protected, not a named exception"


def rows(pids: set[int]) -> list[dict[str, str | int]]:
    """One row per listener of `pids`: process, address, port, kind, why."""
    out = []
    for listener in listeners(pids):
        kind, why = classify(listener)
        out.append({"process": listener.process, "pid": listener.pid, "address": listener.address,
                    "port": listener.port, "kind": kind, "why": why})
    return out
