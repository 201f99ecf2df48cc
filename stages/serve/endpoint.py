"""Finding a running `raymill serve` endpoint and the Ray behind it; imports no Ray at module level.

`raymill serve --model NEW` on a port that already answers rolls that endpoint to NEW. It must
join the Ray that serves the port, before anything imports Ray (Ray reads RAY_AUTH_MODE once).
"""
from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

from stages.common.config import ConfigError, ServeConfig

log = logging.getLogger(__name__)

__all__ = ["base_url", "endpoint_running", "check_port_free", "claim_port", "warn_if_exposed", "record_endpoint",
           "endpoint_ray_address"]


def base_url(cfg: ServeConfig) -> str:
    """The URL a local client uses; a wildcard bind address is reached through loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(cfg.host, cfg.host)
    return f"http://{host}:{cfg.port}"


def endpoint_running(cfg: ServeConfig) -> bool:
    """Whether a raymill app answers /healthz at cfg's host:port."""
    import httpx

    try:
        body = httpx.get(f"{base_url(cfg)}/healthz", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(body, dict) and body.get("status") == "ok" and "ingress_pid" in body


def check_port_free(cfg: ServeConfig) -> None:
    """ConfigError (exit 2) when something other than a raymill endpoint listens on cfg's port:
    Serve's proxy had failed to bind it after Ray's start, a traceback and exit 1 (16 s). Bound
    as the proxy binds (SO_REUSEADDR: a closed endpoint's TIME_WAIT does not count)."""
    import socket

    host = "" if cfg.host in ("0.0.0.0", "::") else cfg.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, cfg.port))
        except OSError as e:
            if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:  # the address, not the port
                raise ConfigError(f"serve.host={cfg.host} is not an address of this machine ({e.strerror}); use "
                                  f"127.0.0.1 (the default), 0.0.0.0 for every interface, or one of its own "
                                  f"addresses") from None
            raise ConfigError(f"serve.port={cfg.port} on {cfg.host or '*'} is not free ({e.strerror}): another program "
                              f"listens there (or, for `raymill run --serve`, a running endpoint); choose another "
                              f"port (serve.port, or `raymill serve --port`)") from None


def claim_port(cfg: ServeConfig) -> int:
    """Hold this machine's claim on cfg.port for the life of the process (an flock, which the kernel
    drops when the process ends, however it ends); returns its descriptor. Serve's proxy binds ~15-20
    s after the port was found free, with SO_REUSEPORT: two `raymill serve` started in that window had
    both bound it, and the kernel split clients between their two models. The second is refused."""
    import fcntl

    path = _endpoint_file(cfg).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(f"serve.port={cfg.port} is taken by another raymill serve or run --serve (pid {holder}), "
                          f"still starting or serving; once it answers, `raymill serve --model NEW --port "
                          f"{cfg.port}` rolls it to NEW; or choose another port (serve.port, or --port)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def warn_if_exposed(cfg: ServeConfig) -> None:
    """Say it, as `raymill doctor` would, when a new endpoint listens beyond loopback."""
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serve: serve.host=%s: the endpoint answers %s on port %d without authentication; put it "
                    "behind your ingress (README: Security: every open port)", cfg.host,
                    "on every interface" if cfg.host in ("0.0.0.0", "::", "") else f"at {cfg.host}", cfg.port)


def _endpoint_file(cfg: ServeConfig) -> Path:
    return Path(os.path.expanduser("~/.cache/raymill/serve")) / f"{cfg.port}.json"


def record_endpoint(cfg: ServeConfig) -> Path:
    """Note which Ray serves cfg.port, so a later `raymill serve --model NEW` joins that Ray.

    Ray's own "auto" address means "the cluster started last on this machine", which on a
    shared machine can be somebody else's; this file (mode 600) names the right one.
    """
    import ray

    path = _endpoint_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"ray_address": ray.get_runtime_context().gcs_address, "pid": os.getpid(),
                                "host": cfg.host}))
    path.chmod(0o600)
    return path


def endpoint_ray_address(cfg: ServeConfig) -> tuple[str, str]:
    """The Ray address of the running `raymill serve` on cfg.port (see record_endpoint), and the
    host it listens on. Warns when cfg asks for another serve.host: Serve keeps the one it started with."""
    path = _endpoint_file(cfg)
    try:
        record = json.loads(path.read_text())
        address = record["ray_address"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"an endpoint answers on port {cfg.port} but {path} does not name its Ray; "
                          f"pass --set ray.address=<that Ray's address> to update it") from None
    if (host := record.get("host", cfg.host)) != cfg.host:  # the rollout had said "done", kept the old address
        log.warning("serve: serve.host=%s is not applied by a rolling update: the endpoint keeps listening on %s; "
                    "stop it and start it again to change its address", cfg.host, host)
    return address, host
