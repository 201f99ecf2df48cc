"""Online serving: a Ray Serve app that classifies one image per /predict request, or N per
Open Inference Protocol request (/v2/models/<serve.model_name>/infer, stages/serve/v2.py).

Two deployments in one app, bound here: `Ingress` (stages/serve/http.py: FastAPI, limits, JSON
errors, retry on a lost model replica) and `Classifier` (stages/serve/replica.py: decode, dynamic
batching, forward pass).

Serve's proxy answers a few cases itself with a plain-text body: 408 past request_timeout_s when
the ingress did not answer first (it gives JSON 408/504 a little earlier: stages.serve.http.within;
a request the router held for most of its time still gets the proxy's), and 503 past the
ingress's own shedding (stages.serve.http.admission + 2 x SHED_ROOM a replica)
or, with serve.model_deployment=false, past max_queued_requests. Note: the proxy honours a
client's `x-request-timeout-seconds` header over request_timeout_s (0 disables it), so put a
reverse proxy that strips it in front when the timeout is a protection, not just a default.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from stages.common import cluster, console, session, storage
from stages.common.artifacts import check_model_folder
from stages.common.config import ConfigError, RayConfig, ServeConfig
from stages.model import runtime
from stages.serve.endpoint import base_url

__all__ = ["start", "update", "drain", "shutdown", "watch_ray", "build_app", "deployment_options", "base_url", "ingress_env",
           "apply_ingress_env"]

log = logging.getLogger(__name__)

# Ray, Serve and the deployments (which import Ray) are imported where they are used, not here: a
# library caller's `from stages.serve import start` before session.start must not import Ray, whose
# switch that keeps a local Ray on loopback is read when Ray is imported (stages.common.exposure).

# Longest wait for other work to free room for a replica before `start` refuses the plan.
ROOM_WAIT_S = 30.0
SHUTDOWN_WAIT_S = 30.0  # how long stopping `raymill serve` waits for the app's replicas to go


def deployment_options(cfg: ServeConfig, plan: session.ServePlan | None = None) -> dict[str, Any]:
    """The model deployment's options: replicas or autoscaling, overload limits, resources.

    `plan` (session.plan_serve) may turn the rollout surge off where it can never be scheduled.
    """
    gpus = cfg.gpus_per_replica if cfg.use_gpu else 0
    options: dict[str, Any] = {
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "max_queued_requests": cfg.max_queued_requests,  # past it callers get 503
        # old replicas serve until replacements are up (0: replaced in place, see session.plan_serve)
        "max_surge_percent": cfg.max_surge_percent if plan is None else plan.max_surge_percent,
        # A killed replica is noticed at the next health check (default every 10 s): check often,
        # so the replacement starts within seconds (the ingress retries calls meanwhile).
        "health_check_period_s": 2.0,
        "logging_config": {"enable_access_log": cfg.access_log},
        "ray_actor_options": {"num_cpus": cfg.cpus_per_replica, "num_gpus": gpus,
                              "memory": cfg.replica_memory_mb * 2**20},
    }
    if cfg.autoscaling:
        if cfg.min_replicas > cfg.max_replicas:
            raise ConfigError(f"serve.min_replicas={cfg.min_replicas} exceeds serve.max_replicas="
                              f"{cfg.max_replicas}; set min_replicas <= max_replicas")
        options["autoscaling_config"] = {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas}
    else:
        options["num_replicas"] = cfg.num_replicas
    return options


def build_app(cfg: ServeConfig, model_path: str, s3: Any | None = None, plan: session.ServePlan | None = None):
    """The bound Serve application (not yet running): ingress -> model deployment, or one
    deployment holding both when serve.model_deployment is false."""
    from ray import serve

    from stages.serve.http import SHED_ROOM, Ingress, admission
    from stages.serve.replica import Classifier

    # Every replica, a restarted one too, loads the weights this deploy read: a replica restarted after
    # a republish had served the new model beside the old one from one endpoint
    fs, root = storage.filesystem(model_path, s3)
    weights = storage.read_json(fs, storage.join(root, "model.json"))["weights_sha256"]
    if not cfg.model_deployment:
        return Ingress.options(**deployment_options(cfg, plan)).bind(None, cfg, model_path, s3, weights)
    model = serve.deployment(Classifier).options(**deployment_options(cfg, plan)).bind(cfg, model_path, s3, weights)
    # The ingress sheds past `admitted` with raymill's JSON 503 (stages.serve.http). Serve's router
    # queue in front of it must hold a burst too: at 2 (max_queued_requests) it had dropped 185 of
    # 200 simultaneous requests in plain text while the ingress replica had room for them all.
    admitted = admission(cfg)
    limits = {"max_ongoing_requests": cfg.max_ongoing_requests, "max_queued_requests": cfg.max_queued_requests}
    if admitted is not None:
        limits = {"max_ongoing_requests": admitted + SHED_ROOM, "max_queued_requests": SHED_ROOM}
    ingress = Ingress.options(num_replicas=cfg.ingress_replicas, **limits,
                              max_surge_percent=cfg.max_surge_percent,
                              logging_config={"enable_access_log": cfg.access_log},
                              ray_actor_options={"num_cpus": cfg.ingress_cpus})
    return ingress.bind(model, cfg)


def ingress_env(cfg: ServeConfig) -> dict[str, str]:
    """Environment Serve reads once at start-up for `serve.ingress`; set it before ray.init.

    "throughput_optimized" is Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED=1 bundle (gRPC proxy->replica,
    direct ingress on 127.0.0.1, user code on the replica's loop). gRPC's default 4 MB message
    cap is raised past max_body_bytes so a body the app accepts always reaches it.
    """
    if cfg.ingress == "proxy":
        return {}
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(cfg.max_body_bytes + 2**20)}


def apply_ingress_env(cfg: ServeConfig) -> None:
    """Export ingress_env(cfg) for a Ray this process is about to start (not for one running)."""
    import ray

    env = ingress_env(cfg)
    if ray.is_initialized() and any(os.environ.get(k) != v for k, v in env.items()):
        log.warning("serve.ingress=%s needs %s before Ray starts; Ray is already running, so the "
                    "running ingress mode stays", cfg.ingress, env)
    os.environ.update(env)


def start(cfg: ServeConfig, model_path: str, *, s3: Any | None = None, route_prefix: str = "/",
          wait_for_room_s: float = ROOM_WAIT_S, checked: bool = False) -> str:
    """Deploy the classifier as Serve app `cfg.app_name` and return its base URL.

    Starts Ray (defaults: local) if the caller hasn't. host, port and request_timeout_s are per
    Ray cluster: Serve keeps the first values it started with. When the app is already running,
    this is a rolling update to `model_path` (see `update`). A plan that the nodes could never
    hold is refused at once; one that other work leaves no room for, after `wait_for_room_s`.
    `checked`: the caller has just run check_model_folder with weights (the CLI does, before Ray
    starts); each replica still checks the bytes it loads (stages.model.predict).
    """
    import ray
    from ray import serve

    from stages.serve import draining as serve_drain

    if not checked:  # a deploy of no model fails after Serve's retries
        check_model_folder(model_path, s3, "model_path", weights=True)
    # serve.engine=onnxruntime that cannot run this model: exit 2 here, not a deploy failed by retries
    runtime.preflight(model_path, s3, cfg.engine, "serve.engine")
    if not ray.is_initialized():
        apply_ingress_env(cfg)
        session.start(RayConfig())
    plan = _plan_with_room(cfg, wait_for_room_s)
    if plan.warning:
        log.warning("serve: %s", plan.warning)
    console.quiet_serve()
    serve.start(http_options={"host": cfg.host, "port": cfg.port, "request_timeout_s": cfg.request_timeout_s})
    serve_drain.create(cfg.app_name)  # before the ingress replicas start: each one follows it
    serve.run(build_app(cfg, model_path, s3, plan), name=cfg.app_name, route_prefix=route_prefix)
    url = base_url(cfg) + route_prefix.rstrip("/")
    log.info("serve: app '%s' at %s (POST /predict, GET /healthz, GET /metadata, GET /docs; Open Inference "
             "Protocol: POST /v2/models/%s/infer)", cfg.app_name, url, cfg.model_name)
    return url


def _plan_with_room(cfg: ServeConfig, wait_s: float) -> session.ServePlan:
    """The serve plan on what is free now beside other apps, trainers and trials, waited for up
    to `wait_s` (an app deleted a moment ago, or a run ending, frees its share within seconds).
    Only on a Ray this process started (its dashboard, no autoscaler): on a joined cluster the
    autoscaler may add the room, so the plan is made on the nodes' totals, as Ray sees them."""
    if session.dashboard_url() is None:
        return session.plan_serve(cfg, cluster.node_resources())
    deadline, never_checked = time.monotonic() + wait_s, True
    while True:
        nodes, held = cluster.free_node_resources(own_app=cfg.app_name)
        try:
            return session.plan_serve(cfg, nodes, held)
        except ConfigError:
            if not held or time.monotonic() >= deadline:  # nothing else holds room: it never fits
                raise
        if never_checked:  # what the nodes could never hold is refused at once, not waited for
            session.plan_serve(cfg, cluster.node_resources())
            never_checked = False
        time.sleep(1.0)


def update(cfg: ServeConfig, model_path: str, *, s3: Any | None = None, route_prefix: str = "/") -> str:
    """Roll a running app to `model_path` with no failed request (Serve's rolling update).

    With serve.max_surge_percent (default 100) Serve starts the replacement replicas first, then
    drains the old ones (each finishes its in-flight requests), so the app never has fewer
    replicas than configured; the surge needs that much spare CPU, GPU and memory for the rollout.
    Where it can never fit (session.plan_serve), replicas are replaced in place, with a warning.
    """
    return start(cfg, model_path, s3=s3, route_prefix=route_prefix)


def drain(cfg: ServeConfig) -> None:
    """Stop the app taking requests, and wait for the ones it took to be answered
    (stages.serve.draining): at most serve.request_timeout_s (+1 s), after which Serve's proxy has
    ended every request itself, and never more than SHUTDOWN_WAIT_S."""
    from stages.serve import draining as serve_drain

    serve_drain.drain(cfg.app_name, min(cfg.request_timeout_s + 1.0, SHUTDOWN_WAIT_S))


def shutdown(cfg: ServeConfig, wait_s: float = SHUTDOWN_WAIT_S) -> None:
    """Drain the app, then delete it; Serve itself (proxy, controller) keeps running for other apps.

    `serve.delete` asks the controller at once, then polls until the replicas are gone. A replica
    that drains slowly (a loaded node) must not keep Ctrl-C or SIGTERM from ending the process, so
    the poll is bounded: past `wait_s` the controller goes on deleting without this process.
    """
    from ray import serve
    from ray.serve.exceptions import RayServeException

    drain(cfg)
    done = threading.Event()

    def delete() -> None:
        try:
            serve.delete(cfg.app_name)
        except RayServeException:  # Serve isn't running: nothing to delete
            pass
        except Exception:  # logged: this runs on the way out, after the caller's own error if any
            log.exception("serve: deleting app %r failed", cfg.app_name)
        finally:
            done.set()

    threading.Thread(target=delete, name="raymill-serve-delete", daemon=True).start()
    if not done.wait(wait_s):
        log.warning("serve: app %r is still stopping after %.0f s; Serve's controller finishes deleting it",
                    cfg.app_name, wait_s)


def watch_ray(on_lost: Callable[[str], None], poll_s: float = 5.0, tries: int = 3) -> threading.Event | None:
    """Call `on_lost(why)` from a daemon thread once this process's local Ray node is gone: dead in
    Ray's node table, or its GCS failing `tries` polls in a row (one slow answer is no death). A
    killed raylet had left `raymill serve` asleep for good (or stuck in its deploy): its endpoint
    dead, its port claimed, so another serve was refused until someone found the process. Returns
    the event that stops the watch (set it before a normal stop: Ray's own teardown must not read
    as a death); None where this process has no node of its own (a Ray Client driver)."""
    import ray

    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception as e:
        log.debug("serve: no node of this process to watch (%s)", e)
        return None
    stop = threading.Event()

    def watch() -> None:
        failed = 0
        while not stop.wait(poll_s):
            try:
                alive = any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())
                failed = 0
            except Exception as e:  # Ray's GCS gone: its client fails (or Ray ends this process first)
                failed += 1
                alive, why = failed < tries, f"Ray stopped answering ({type(e).__name__}: {e})"
            else:
                why = f"this process's Ray node {node[:12]} died (its raylet stopped)"
            if not alive and not stop.is_set():
                return on_lost(why)

    threading.Thread(target=watch, name="raymill-ray-watch", daemon=True).start()
    return stop
