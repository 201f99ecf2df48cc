"""Draining: stopping an endpoint without dropping a request it took (`raymill serve`'s SIGTERM or Ctrl-C).

Ray's teardown ends Serve's HTTP proxy with the requests it holds: at a SIGTERM, 4 of 4 requests in
flight got "Server disconnected without sending a response" (4 clients, 2-core box). Serve has no
call that drains an app's ingress: serve.shutdown kills the proxies, and serve.delete answers new
requests with a plain-text 404 while the replicas finish. So the app drains itself. Each ingress
replica long-polls this app's `Drain` actor from its start (`Drain.wait`: no cost while serving).
`drain` sets it; from then on every ingress replica answers new image requests with a JSON 503
`shutting_down` (Retry-After, Connection: close) and its readiness routes with 503, and reports its
requests in flight as they finish. The caller waits for none to be left, bounded by
serve.request_timeout_s (Serve's proxy ends any request by then), and then tears Serve down.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import ray

__all__ = ["NAMESPACE", "actor_name", "create", "drain", "follow", "Drain"]

log = logging.getLogger(__name__)

NAMESPACE = "raymill"  # named actors are per namespace; Serve's replicas run in "serve"
HEAR_S = 1.0  # a live replica reports within milliseconds of the drain; one that never does is gone
POLL_S = 0.05


def actor_name(app_name: str) -> str:
    return f"raymill-drain-{app_name}"


@ray.remote(num_cpus=0)
class Drain:
    """The drain flag of one app, and each ingress replica's requests in flight once it is set
    (None: a replica that waits but has not reported since; one that died stays so)."""

    def __init__(self) -> None:
        self._set = asyncio.Event()
        self._in_flight: dict[str, int | None] = {}

    async def wait(self, replica: str) -> None:
        """An ingress replica's long poll: returns when the drain starts."""
        self._in_flight.setdefault(replica, None)
        await self._set.wait()

    async def start(self) -> None:
        self._set.set()

    async def report(self, replica: str, in_flight: int) -> None:
        self._in_flight[replica] = in_flight

    async def state(self) -> dict[str, int | None]:
        return dict(self._in_flight)


# Every handle this process got, kept until its drain: a named actor still ends when its owner's
# handle goes, and a second deploy's get_if_exists handle had replaced (and so ended) the first
_OWNED: dict[str, list[Any]] = {}


def create(app_name: str) -> None:
    """The app's Drain actor, made by the process that deploys the app (or the one already made: a
    rollout from another process, or a second deploy from this one, keeps the first). It lives as
    long as the process that made it."""
    handle = Drain.options(name=actor_name(app_name), namespace=NAMESPACE, get_if_exists=True).remote()
    _OWNED.setdefault(app_name, []).append(handle)


def drain(app_name: str, wait_s: float) -> None:
    """Stop the app's ingress replicas taking requests and wait, at most `wait_s`, for the ones they
    hold to be answered. Never raises: what follows is the teardown, which must happen anyway."""
    try:
        actor = ray.get_actor(actor_name(app_name), namespace=NAMESPACE)
    except ValueError:  # deployed without one (build_app served by a library caller's own serve.run)
        # (or its start failed before: a refused `raymill serve` says nothing more)
        log.debug("serve: app %r has no drain (not deployed by stages.serve.start); stopping without waiting "
                  "for requests in progress", app_name)
        return
    started = time.monotonic()
    try:
        ray.get(actor.start.remote(), timeout=5)
        while True:
            state = ray.get(actor.state.remote(), timeout=5)
            busy, unheard = sum(n or 0 for n in state.values()), sum(n is None for n in state.values())
            waited = time.monotonic() - started
            if busy == 0 and (unheard == 0 or waited >= HEAR_S):
                log.info("serve: drained in %.2f s: every request taken was answered", waited)
                return
            if waited >= wait_s:
                log.warning("serve: %d request(s) still in progress after %.0f s (serve.request_timeout_s); "
                            "stopping anyway", busy, waited)
                return
            time.sleep(POLL_S)
    except Exception as e:  # Ray going down under us: the teardown follows either way
        log.warning("serve: could not drain the endpoint (%s: %s); stopping without waiting for requests in "
                    "progress", type(e).__name__, e)
    finally:  # a set flag must not drain the app's next deploy (a library caller's start after shutdown)
        _OWNED.pop(app_name, None)
        with contextlib.suppress(Exception):
            ray.kill(actor)


async def follow(app_name: str, ingress: Any) -> None:
    """An ingress replica's side, from its start: wait for the app's drain, then set
    `ingress.draining` (it refuses new requests) and report `ingress.in_flight` until none is left."""
    try:
        actor = ray.get_actor(actor_name(app_name), namespace=NAMESPACE)
    except ValueError:  # deployed without one: stopping it cannot wait for requests
        return
    me = uuid.uuid4().hex
    try:
        await actor.wait.remote(me)
        ingress.draining = True
        while True:  # new image requests are refused now: the count only falls
            left = ingress.in_flight  # the value sent is the one judged: read again after the await, a 0
            await actor.report.remote(me, left)  # had ended the loop with 3 reported (an 11 s drain in CI)
            if left == 0:
                return
            await asyncio.sleep(POLL_S)
    except Exception as e:  # the process that deployed the app is gone, and its Drain with it
        log.debug("no drain for this replica: %s: %s", type(e).__name__, e)
