"""Starting Ray: the one place `ray.init` is called (re-exported by stages.common.session, where
every plan lives). A local Ray keeps its servers on loopback with token auth, and the State API
points at this process's own dashboard.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from stages.common.cluster import cluster_resources
from stages.common.config import ConfigError, RayConfig
from stages.common.exposure import check_loopback, keep_local_on_loopback

__all__ = ["start", "start_if_needed", "dashboard_url", "check"]

log = logging.getLogger(__name__)

# Settings (not secrets) a cluster's workers need to reach the same S3 endpoint. Never credentials:
# Ray logs the runtime env (README, "Credentials on a cluster"); local workers inherit the env.
_FORWARDED_ENV = ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                  "RAYMILL_VERBOSE",  # stages.common.console: --verbose reaches workers
                  "TORCH_CPP_LOG_LEVEL",  # console.quiet_torch_cpp
                  "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",  # TRAIN_POLL_S: multi-worker Tune trials start trainers too
                  "OMP_WAIT_POLICY", "RAY_SERVE_LOG_TO_STDERR")
_DASHBOARD: dict[str, str] = {}
# Ray Train 2.60's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
# default), and a worker's `ray.train.report` waits in a queue of one for that poll: every report
# after the first cost up to 2 s (a no-op 2-worker trainer: 10 reports 31.9 s against 12.1 s at
# 0.1 s, 2-core box). The variable is read by Train's controller and propagated from the driver to
# it (Train's ENV_VARS_TO_PROPAGATE); it is not in Ray's docs (upstream note in the README). A
# user's own value wins.
TRAIN_POLL_S = "0.2"
# torch's CPU build runs intra-op work on OpenMP threads that spin between parallel regions by
# default. A CPU train worker steps on every core it holds beside its decode processes
# (session.torch_threads), which run at a lower priority: spinning threads took their cycles (224 px,
# 1 worker x 2 cores: 236 img/s spinning, 249-276 passive; a 2-thread step alone cost 5.78 CPU ms an
# image spinning, 5.29 passive). OpenMP reads the variable when a process loads it, so it is set for
# Ray's workers before they start. A user's own value wins.
OMP_WAIT_POLICY = "PASSIVE"


def _plain_prefixes_off_a_terminal() -> None:
    """Ray wraps each worker line's `(name pid=N)` prefix in ANSI colour codes even on a pipe, so a
    run's log file or CI output read `\x1b[36m(raymill_train pid=7768)\x1b[0m`. Ray's documented
    RAY_COLOR_PREFIX=0 turns them off; the driver reads it as it prints. A user's own value wins."""
    import sys

    if not all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr)):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _workers_import_this_code() -> None:
    """Local workers run this process's `stages`, not another copy: a notebook or script that puts a
    checkout on its own sys.path (beside an installed or editable raymill elsewhere, or none)
    had its workers import the other copy (a reviewer's ETL failed on another checkout's half-edited
    file) or nothing. A fresh interpreter in this folder with this environment is what a local worker
    is: when it would find another `stages`, the checkout goes first on PYTHONPATH, which local
    workers inherit. An installed raymill is left as it is."""
    import subprocess
    import sys

    import stages

    mine = os.path.dirname(os.path.dirname(os.path.abspath(stages.__file__)))
    probe = "import importlib.util as u; s = u.find_spec('stages'); print(s.origin if s else '')"
    try:
        found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # cannot tell: leave the environment alone
        return
    other = os.path.dirname(os.path.dirname(os.path.abspath(found))) if found else None
    if other == mine:
        return
    if other == os.getcwd():  # Ray puts the driver's folder first on a local worker's path, before PYTHONPATH
        log.warning("ray: local workers would import %s/stages (this folder) while this process runs "
                    "%s/stages; run from another folder, or from that checkout", other, mine)
        return
    log.debug("ray: local workers get %s on PYTHONPATH (they would import %s)", mine, found or "no raymill")
    os.environ["PYTHONPATH"] = os.pathsep.join([mine, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def start(cfg: RayConfig) -> dict[str, float]:
    """Start (or join) Ray once per process and return the cluster's resources.

    Embedded local Ray by default; `ray.address` joins a running cluster. Token authentication
    is Ray 2.60's default and is left on. The dashboard (on unless `ray.include_dashboard=false`)
    binds to `ray.dashboard_host`, 127.0.0.1 by default: it also hosts the State API that Ray
    Train uses to free the placement groups of stopped runs. A local run keeps every Ray server
    on loopback (`keep_local_on_loopback`).
    """
    if cfg.address is None:
        keep_local_on_loopback()
    import ray

    from stages.common import console

    first = not ray.is_initialized()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", TRAIN_POLL_S)  # read by Train's driver
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)  # inherited by local workers, forwarded to a cluster's
    # Serve's controller, proxy and replica lines (status INFO, one access line a request) go to
    # its files under logs/serve/ only, not this terminal (Serve's documented switch); -v shows them
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "1" if console.verbose() else "0")
    _plain_prefixes_off_a_terminal()
    if first:
        saved = {name: os.environ.get(name) for name in _FOR_RAY_ONLY}
        kwargs: dict = {"include_dashboard": cfg.include_dashboard, "dashboard_host": cfg.dashboard_host,
                        "logging_level": logging.INFO if console.verbose() else logging.WARNING}
        os.environ.update(console.quiet_torch_cpp())  # local workers inherit this process's env
        # No job runtime_env on a local Ray: with one, the first tasks cannot use the workers
        # Ray starts beside the node and wait for fresh ones (0.85 s on 2 cores)
        check(cfg)  # the address answers; the dashboard's host is this machine's
        if cfg.address:
            env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
            kwargs.update(address=cfg.address, runtime_env={"env_vars": env} if env else None)
        else:
            # The dashboard agent's Prometheus endpoint listens on every interface without the
            # token; a local run has no Prometheus to scrape it. RAY_enable_metrics_collection=1 keeps it.
            os.environ.setdefault("RAY_enable_metrics_collection", "0")
            _workers_import_this_code()
            if cfg.include_dashboard:
                kwargs["dashboard_port"] = _point_state_api_at_own_dashboard(cfg.dashboard_host)
            # "local" always starts a fresh embedded Ray: without it ray.init() joins whatever
            # cluster last wrote /tmp/ray/ray_current_cluster on this machine.
            kwargs.update(address="local", num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus,
                          object_store_memory=(cfg.object_store_memory_mb or 0) * 2**20 or None)
        try:
            context = ray.init(**{k: v for k, v in kwargs.items() if v is not None})
        finally:
            _restore(saved)
        if not cfg.address:
            check_loopback()
        if getattr(context, "dashboard_url", None):
            _DASHBOARD["url"] = f"http://{context.dashboard_url}"
            log.info("ray dashboard: %s (token: `ray get-auth-token`)", _DASHBOARD["url"])
        console.quiet_tune()
        for hook in AFTER_START:
            hook()
    resources = cluster_resources()
    log.log(logging.INFO if first else logging.DEBUG, "ray: %s CPUs, %s GPUs (address=%s)",
            resources["CPU"], resources["GPU"], cfg.address or "local")
    return resources


# Called once this process's Ray is up (ray.init has installed its own signal handlers): the CLI takes
# SIGTERM back there (workflow.signals.take_sigterm), whichever command started Ray; a library caller
# registers none and keeps Ray's.
AFTER_START: list[Callable[[], None]] = []

# Set for Ray's own processes, which take this process's environment when a local Ray starts. The
# driver drops them after: a library caller's own later `ray.init` (after `ray.shutdown`) had
# inherited metrics off, and its State API calls went to this Ray's dead dashboard ("Failed to
# make request"). State API calls in this process name their Ray (cluster._holdings).
_FOR_RAY_ONLY = ("RAY_API_SERVER_ADDRESS", "RAY_enable_metrics_collection")


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def start_if_needed() -> None:
    """For a stage called as a library before any Ray: Ray as raymill starts it (loopback, token),
    joining RAY_ADDRESS when set (a script under `ray job submit`), not Ray's auto-init (every
    interface, all cores, no word). Nothing when Ray is up: the caller's own `ray.init` stands."""
    import ray

    if not ray.is_initialized():
        start(RayConfig(address=os.environ.get("RAY_ADDRESS") or None))


def _point_state_api_at_own_dashboard(host: str) -> int:
    """Pick the dashboard's port and name it in RAY_API_SERVER_ADDRESS (Ray's documented variable
    for the API server) before Ray starts, so every Ray process inherits it. Without it a State
    API client given no address (Train's placement-group cleaner, `ray.util.state`) scans this
    machine's processes and fails with "Found multiple active Ray instances" beside another
    local Ray; the placement groups of stopped trials then stay reserved, and new trials wait.
    A free port, not Ray's usual 8265: two commands started together both found 8265 free, and the
    second one's dashboard then failed to bind it (exit 1 after 62 s)."""
    port = _free_port(host)
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://{host}:{port}"
    return port


def check(cfg: RayConfig) -> None:
    """What can be known of ray.address and ray.dashboard_host before Ray starts, with sockets alone
    (ConfigError, exit 2): the CLI checks it before MLflow's store opens, and `start` again."""
    import socket

    if cfg.address:
        _check_reachable(cfg.address)
        return
    if not cfg.include_dashboard:
        return
    try:
        socket.getaddrinfo(cfg.dashboard_host, None)
    except OSError as e:  # had been a gaierror from Ray's start, exit 1
        raise ConfigError(f"ray.dashboard_host={cfg.dashboard_host!r} is no address of this machine ({e}); set it "
                          f"to 127.0.0.1 (the default), or an interface's address") from None
    with socket.socket() as probe:
        try:
            probe.bind((cfg.dashboard_host, 0))
        except OSError as e:  # 10.9.9.9 on a machine without it: EADDRNOTAVAIL
            raise ConfigError(f"ray.dashboard_host={cfg.dashboard_host!r}: cannot listen there ({e}); set it to "
                              f"127.0.0.1 (the default), or an address of this machine's interfaces") from None


# Where the dashboard's port is drawn from: above Ray's worker ports (10002-19999) and below the
# kernel's ephemeral range (Linux: 32768-60999), which the OS hands to every bind to port 0, Ray's
# own processes' included, and which holds Ray's fixed exporter ports 44217 and 44227. A port the
# OS had picked there was taken by Ray's own start before the dashboard bound it (exit 1 after 60 s,
# once in ~40 starts on a shared box).
_PORTS = range(20000, 32768)


def _free_port(host: str) -> int:
    import random
    import socket

    low = _ephemeral_low()
    for port in random.sample(_PORTS, 64):
        if port >= low:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket() as probe:  # the range is taken (or ephemeral): any free port, as before
        probe.bind((host, 0))  # `check` made sure it can
        return probe.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the range is the OS's own
        return _PORTS.stop


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """ConfigError when nothing answers at ray.address's host:port: ray.init retries a GCS that is not
    there for good, printing "Failed to connect to GCS" lines (a run had hung for 10 minutes). Only a
    connect is tried: Ray's own handshake and token check follow in ray.init."""
    import socket

    if address == "auto":
        return
    where = address.removeprefix("ray://")
    host, _, port = where.rpartition(":") if not where.endswith("]") and ":" in where else (where, "", "10001")
    deadline = time.monotonic() + timeout_s
    while True:  # a head started with this command may still be starting: refused connects are retried
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
            return
        except ConnectionRefusedError as e:
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            error = e
        except OSError as e:
            error = e
        raise ConfigError(f"ray.address={address}: nothing answers there ({type(error).__name__}: {error}); start the "
                          f"cluster (`ray start --head`, `ray up cluster.yaml`) or fix ray.address (the head's "
                          f"GCS, port 6379 unless set; unset: a local Ray)") from None


def dashboard_url() -> str | None:
    """The dashboard this process started (None if Ray was started elsewhere or without one)."""
    return _DASHBOARD.get("url")
