"""Where CPUs/GPUs are planned so no stage can deadlock, and Ray is started (stages.common.ray_start).

The trap this module exists for: TorchTrainer with 2 workers x 1 CPU on a 2-CPU Ray holds every
CPU, and Ray Data's read tasks then wait forever. Every plan here keeps `data_reserved_cpus` free.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass

from stages.common.cluster import cluster_resources, local_cpus, units_that_fit
from stages.common.config import ConfigError, InferConfig, ServeConfig, TrainConfig, TuneConfig
from stages.common.exposure import LOCAL_ONLY_ENV, keep_local_on_loopback  # noqa: F401 (re-exported)
from stages.common.ray_start import check as check_ray, dashboard_url, start, start_if_needed  # noqa: F401 (API)

__all__ = ["start", "start_if_needed", "check_ray", "keep_local_on_loopback", "LOCAL_ONLY_ENV", "dashboard_url",
           "cluster_resources", "local_cpus", "WorkerPlan", "plan_workers", "train_host", "plan_trials", "TrialPlan",
           "TRIAL_DRIVER_CPUS", "ServePlan", "plan_serve", "plan_infer", "planned_actors"]

log = logging.getLogger(__name__)
DATA_TASK_CPUS = 0.25  # a Ray Data task's CPUs on a small node (train.data_cpus_per_task unset)


@dataclass(frozen=True)
class WorkerPlan:
    """Resources for one TorchTrainer run: what each worker holds, and what stays free."""
    num_workers: int
    min_workers: int | None
    cpus_per_worker: float
    gpus_per_worker: float
    use_gpu: bool
    data_reserved_cpus: float
    total_cpus: float
    decode_processes: int = 0  # per worker (stages.feed.decode_pool); 0: threads, or Ray Data decodes
    torch_threads: int = 1  # intra-op threads of a worker (session.torch_threads)
    data_cpus_per_task: float = 0.0  # each Ray Data read/decode task (train.ingest=ray_data)

    def as_dict(self) -> dict:
        return asdict(self)

    def resources(self, worker_resources: dict[str, float]) -> dict[str, float]:
        """What one worker holds in Ray (`worker_resources`: train.worker_resources), whichever
        host runs it: a Train worker, a Tune trial actor, or the one-worker train host."""
        return {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.use_gpu else {}),
                **worker_resources}


def plan_workers(train: TrainConfig, resources: dict[str, float], data_reserved_cpus: float,
                 slots: int = 1, keep_reserve: bool | None = None, say: bool = True) -> WorkerPlan:
    """Fit `slots` concurrent trainers of `train.num_workers` workers into `resources`.

    The Ray Data reserve is kept when Ray Data runs beside the trainers (`train.ingest=ray_data`,
    or `keep_reserve`); a `stream` run has no Ray Data task to leave room for. Then:
    - `stream`: each worker gets its share of the CPUs, within one node (on a GPU node, its
      share of that node's CPUs per GPU), and decodes in that many processes, below the loop's
      priority: a decode-heavy run uses every core;
    - `ray_data`: a worker keeps 1 CPU for its loop at most, and Ray Data gets the rest.
    """
    reserve = data_reserved_cpus if (train.ingest == "ray_data" if keep_reserve is None else keep_reserve) else 0.0
    total_cpus, total_gpus = resources["CPU"], resources["GPU"]
    n = planned_workers(train, resources)
    workers = n * slots
    free = total_cpus - reserve
    if total_cpus <= 0:  # a head started with --num-cpus=0, before a worker node joins
        raise ConfigError("the cluster has no CPU for training workers yet: add a node with CPUs (or wait "
                          "for the autoscaler to start one), then rerun")
    if free <= 0:
        raise ConfigError(f"the cluster has {total_cpus:g} CPUs, all needed by ray.data_reserved_cpus="
                          f"{reserve:g}; lower ray.data_reserved_cpus or add CPUs")
    cpus = train.cpus_per_worker or math.floor(_cpu_share(train, resources, free / workers) * 100) / 100
    if cpus <= 0:  # an even share under 0.01 CPU
        raise ConfigError(f"train.num_workers={n} x {slots} trainer(s) leave each worker under 0.01 of the {free:g} "
                          f"free CPUs; lower train.num_workers, or add nodes")
    if cpus * workers > free + 1e-9:
        raise ConfigError(
            f"train.num_workers={n} x {slots} trainer(s) x {cpus:g} CPU needs "
            f"{cpus * workers:g} CPUs but only {free:g} of {total_cpus:g} are free after "
            f"ray.data_reserved_cpus={reserve:g}; lower train.num_workers or "
            f"train.cpus_per_worker, or add nodes")
    if train.use_gpu and train.gpus_per_worker * workers > total_gpus + 1e-9:
        raise ConfigError(
            f"train.use_gpu with train.num_workers={n} x {slots} needs "
            f"{train.gpus_per_worker * workers:g} GPUs but the cluster has {total_gpus:g}; lower "
            f"train.num_workers, set train.gpus_per_worker below 1, or set train.use_gpu=false")
    # the totals hold them: now node by node
    cpus = _fit_nodes(train, cpus, workers, resources, min(train.data_cpus_per_task or DATA_TASK_CPUS, reserve))
    if train.min_workers is not None and train.min_workers > n:
        raise ConfigError(f"train.min_workers={train.min_workers} exceeds train.num_workers="
                          f"{n}; set min_workers <= num_workers")
    data_cpus = _data_task_cpus(train, cpus, workers, resources) if reserve else 0.0
    plan = WorkerPlan(n, train.min_workers, cpus,
                      train.gpus_per_worker if train.use_gpu else 0.0, train.use_gpu, reserve,
                      total_cpus, _decode_processes(train, cpus), torch_threads(train, cpus), data_cpus)
    decode = (f"{plan.decode_processes} decode process(es)" if plan.decode_processes else
              f"Ray Data decodes ({data_cpus:g} CPU a task)" if train.ingest == "ray_data"
              else f"{train.decode_threads} decode threads")
    if say:  # not for a check before the stage trains (plan_trials): said once
        log.info("resource plan: %d worker(s) x %.2f CPU x %.2f GPU, %s per worker, %.2f CPU kept for Ray Data",
                 plan.num_workers, plan.cpus_per_worker, plan.gpus_per_worker, decode, reserve)
        if total_gpus and not train.use_gpu:  # the default: a GPU cluster had trained on CPUs without a word
            log.info("resource plan: the cluster's %g GPU(s) stay unused (train.use_gpu=false)", total_gpus)
    return plan


def _nodes(resources: dict) -> list[tuple[float, float]]:
    """Each node's (CPUs, GPUs); one node of the totals where the shapes are not known."""
    return list(resources.get("nodes", ((resources["CPU"], resources["GPU"]),)))


def _data_task_cpus(train: TrainConfig, cpus: float, workers: int, resources: dict) -> float:
    """A Ray Data task's CPUs: 1 (Ray's default; on an H100 node 1-CPU tasks decoded 3.4x what 0.5-CPU
    ones did, RESULTS gpu) with 2+ CPUs left and a node keeping 1 once the workers are placed (fullest
    first, as PACK places them), else what fits: totals alone gave eight 1.5-CPU nodes 1-CPU tasks."""
    if train.data_cpus_per_task:
        return train.data_cpus_per_task
    left = math.floor((resources["CPU"] - cpus * workers) * 100 + 1e-6) / 100
    gpus, most, placing = (train.gpus_per_worker if train.use_gpu else 0.0), 0.0, workers
    for c, g in sorted(_nodes(resources), reverse=True):
        room = [{"CPU": max(c - DATA_TASK_CPUS, 0), "GPU": g}]  # as _fit_nodes placed them: each keeps a task
        here = min(placing, units_that_fit({"CPU": cpus, "GPU": gpus}, room))
        placing, most = placing - here, max(most, c - here * cpus)
    return 1.0 if left >= 2 and most >= 1 else min(DATA_TASK_CPUS, left)


def _fit_nodes(train: TrainConfig, cpus: float, workers: int, resources: dict, keep: float) -> float:
    """`cpus` a worker, or where the nodes cannot hold `workers` of them (each within one node, each
    node keeping `keep` CPUs for a Ray Data task), the largest share they can. Summing the cluster had
    given 2 x 10 CPUs on nodes of 16 and 4 (a capacity wait, then a false error) and 3 x 0.83 on three
    1-CPU nodes (no room for a Ray Data task: a hang). A cpus_ or gpus_per_worker no node holds is refused."""
    gpus, raw = (train.gpus_per_worker if train.use_gpu else 0.0), _nodes(resources)
    nodes = [(max(c - keep, 0.0), g) for c, g in raw]  # a 0-CPU head keeps nothing: no negative room

    def held(share: float) -> int:
        return units_that_fit({"CPU": share, "GPU": gpus}, [{"CPU": c, "GPU": g} for c, g in nodes])

    if held(cpus) >= workers:
        return cpus
    shapes = ", ".join(f"{k} x {c:g} CPU/{g:g} GPU" for (c, g), k in sorted(Counter(raw).items(), reverse=True))
    if gpus and (on_gpus := units_that_fit({"GPU": gpus}, [{"GPU": g} for _, g in raw])) < workers:
        raise ConfigError(f"{workers} training worker(s) of train.gpus_per_worker={gpus:g} GPU do not fit on the nodes "
                          f"({shapes}; a worker's GPUs are on one node): they hold {on_gpus}; lower "
                          f"train.gpus_per_worker (at most {max(g for _, g in raw):g}) or train.num_workers, or add "
                          f"GPU nodes")
    if not train.cpus_per_worker:  # the largest share, in hundredths, at which every worker is placed
        shares = {math.floor(c / k * 100) / 100 for c, _ in nodes for k in range(1, workers + 1)}
        if fit := max((s for s in shares if 0 < s <= cpus and held(s) >= workers), default=0.0):
            return fit
    per_worker = f"{cpus:g} CPU" + (f" and {gpus:g} GPU" if gpus else "")
    raise ConfigError(f"{workers} training worker(s) of {per_worker} each (train.num_workers, train.cpus_per_worker"
                      f"{', train.gpus_per_worker' if gpus else ''}) do not fit on the nodes ({shapes}; a worker "
                      f"runs within one node, beside {keep:g} CPU for Ray Data): they hold {held(cpus)}; lower "
                      f"train.num_workers{' or train.cpus_per_worker' if train.cpus_per_worker else ''}, or add "
                      f"nodes")


def train_host(train: TrainConfig, plan: WorkerPlan, nodes: int) -> str:
    """Who hosts a fresh train run's loop (train.host): "tune_trial" (one Tune function actor,
    stages.train.solo) or "ray_train" (a TorchTrainer). auto takes the actor only where Train's
    extra parts buy nothing: one worker, not elastic, stream ingest (ray_data's split is Train's),
    one node (a lost GPU node stays Train's capacity wait and error, not a trial pending forever)."""
    solo = plan.num_workers == 1 and plan.min_workers is None and train.ingest == "stream"
    if train.host == "auto":
        return "tune_trial" if solo and nodes == 1 else "ray_train"
    return train.host


def planned_workers(train: TrainConfig, resources: dict[str, float]) -> int:
    """`train.num_workers`, or where unset one worker per GPU (train.use_gpu: a one-GPU node trains on
    it). On CPUs: one a node with at least half the largest node's CPUs (2 had left 6 of 8 nodes idle;
    a 9th worker for a small head would halve every share). Never two on one node: a second DDP process
    buys nothing that intra-op threads do not (README "On a CPU-only node" has the numbers)."""
    if train.num_workers or train.host == "tune_trial":  # that host runs one (config.TrainConfig checks)
        return train.num_workers or 1
    if train.use_gpu:
        return max(1, int(resources["GPU"] / train.gpus_per_worker + 1e-9))
    cpus = [c for c, _ in _nodes(resources)]
    return max(1, sum(1 for c in cpus if c > 0 and c >= max(cpus) / 2))


def _cpu_share(train: TrainConfig, resources: dict[str, float], even: float) -> float:
    """CPUs per worker when the config does not say: an even share, within what one node holds."""
    if train.ingest == "ray_data":
        return min(1.0, even)  # the loop's own CPU; decoding runs in Ray Data's tasks
    if train.use_gpu and "node_cpus_per_gpu" in resources:
        return min(even, resources["node_cpus_per_gpu"] * train.gpus_per_worker)
    return min(even, resources.get("max_node_cpus", resources["CPU"]))


def torch_threads(train: TrainConfig, cpus: float) -> int:
    """Intra-op threads of a worker. A CPU worker steps on every core it holds: its decode processes
    run below its priority and take what the step leaves, and its idle threads sleep instead of
    spinning (ray_start.OMP_WAIT_POLICY; with spinning, a 2-thread step cost 2.67 CPU ms an image
    against 1.84 on one, and starved the decoders: 224 px, 1 worker, 236 img/s with 2 threads, 249-276
    passive). A GPU worker beside decoders steps on one: its host work is launches and a uint8 copy
    (emulated GPU, 2 decode processes: 1,333-1,359 img/s fed with 2 torch threads, 1,653-1,681 with 1)."""
    cores = max(1, int(cpus + 0.5))
    return 1 if train.use_gpu and _decode_processes(train, cpus) else cores


def _decode_processes(train: TrainConfig, cpus: float) -> int:
    if train.decode_processes is not None:
        return train.decode_processes
    if train.ingest == "ray_data":
        return 0
    # One per CPU of the worker. They run at a lower priority (stages.feed.decode_pool.NICE), so the
    # loop that launches kernels (or computes, on a CPU) is never queued behind them: it gets a
    # core when it needs one, and the decoders take every cycle it leaves.
    return max(1, int(cpus + 0.5))


@dataclass(frozen=True)
class TrialPlan:
    """How many trials run at once, and what each holds. `in_function`: a trial of one `stream`
    worker runs the loop inside its Tune function actor, which holds the worker's CPUs (and GPU):
    no TorchTrainer, controller or second placement group, so it starts in seconds. A trial of
    several workers (or `ray_data`, which needs Train's dataset shards) is a 0.01-CPU driver that
    runs a TorchTrainer, whose workers hold the resources."""
    concurrent_trials: int
    workers: WorkerPlan
    in_function: bool = False

    def trial_resources(self, worker_resources: dict[str, float]) -> dict[str, float]:
        """What Tune reserves for one trial (`worker_resources`: train.worker_resources)."""
        if not self.in_function:
            return {"CPU": TRIAL_DRIVER_CPUS}
        return self.workers.resources(worker_resources)


# A trial's driver only launches and watches its trainer. Tune refuses a trial with no
# resources at all (an empty head bundle), so it asks for a token 0.01 CPU.
TRIAL_DRIVER_CPUS = 0.01
# Below 1 CPU per worker a trial trains a little slower, but two trials side by side finish a
# search sooner than one at a time (the 2-CPU case: 2 x 0.74 CPU beside the 0.5 Ray Data reserve).
MIN_TRIAL_CPUS_PER_WORKER = 0.7


def plan_trials(tune: TuneConfig, train: TrainConfig, resources: dict[str, float],
                data_reserved_cpus: float, say: bool = True) -> TrialPlan:
    """How many Tune trials (each a TorchTrainer) run at once, filling the cluster beside Ray Data.

    Each trial worker gets up to 1 CPU; when that would leave room for only one trial, workers
    get less (down to MIN_TRIAL_CPUS_PER_WORKER) so that a second trial fits.
    """
    per_trial = train.model_copy(update={"num_workers": tune.workers_per_trial, "min_workers": None})
    workers = tune.workers_per_trial

    def free(n: int) -> float:  # CPUs for trial workers when n trials (and their drivers) run
        return resources["CPU"] - data_reserved_cpus - n * TRIAL_DRIVER_CPUS

    def most(cpus_per_worker: float) -> int:  # most trials whose workers each get this many CPUs
        n = int(free(1) // (cpus_per_worker * workers) + 1e-9)
        return next((k for k in range(n, 0, -1) if k * cpus_per_worker * workers <= free(k) + 1e-9), 0)

    if per_trial.cpus_per_worker:
        fit = most(per_trial.cpus_per_worker)
    else:
        fit = most(1.0) if most(1.0) >= 2 else most(MIN_TRIAL_CPUS_PER_WORKER)
    if train.use_gpu:
        if (gpu_fit := int(resources["GPU"] // (train.gpus_per_worker * workers))) < 1:  # not the CPUs' fault
            raise ConfigError(f"train.use_gpu=true: one trial needs tune.workers_per_trial={workers} x "
                              f"train.gpus_per_worker={train.gpus_per_worker:g} GPU, and the cluster has "
                              f"{resources['GPU']:g}; set train.use_gpu=false, or run on a node with GPUs")
        if not per_trial.cpus_per_worker and fit < gpu_fit:  # a GPU for each trial before a CPU more a worker
            fit = max(fit, most(MIN_TRIAL_CPUS_PER_WORKER))  # (8 GPUs, 8 CPUs: 7 trials at 1 CPU had left one idle)
        fit = min(fit, gpu_fit)
    concurrent = min(tune.max_concurrent_trials or fit, fit, tune.num_samples)
    if concurrent < 1:
        cpus = per_trial.cpus_per_worker or MIN_TRIAL_CPUS_PER_WORKER
        fixes = (["lower tune.workers_per_trial"] if workers > 1 else []) + (
            ["lower train.cpus_per_worker"] if per_trial.cpus_per_worker else []) + [
            "give Ray more CPUs (ray.num_cpus, or a bigger node)", "lower ray.data_reserved_cpus",
            "or, in `raymill run`, set tune.enabled=false to train without a search"]
        raise ConfigError(
            f"one trial needs tune.workers_per_trial={workers} x {cpus:g} CPU (and {TRIAL_DRIVER_CPUS:g} for its "
            f"driver) but only {max(0.0, free(1)):g} CPUs are free of {resources['CPU']:g} after "
            f"ray.data_reserved_cpus={data_reserved_cpus:g}: {', '.join(fixes)}")
    plan = plan_workers(per_trial, {**resources, "CPU": resources["CPU"] - concurrent * TRIAL_DRIVER_CPUS},
                        data_reserved_cpus, slots=concurrent, keep_reserve=True, say=say)
    in_function = workers == 1 and train.ingest == "stream"
    if say:  # not for the check before Ray (stages.tune.checks.check_room): the search says it
        log.info("trial plan: %d trial(s) at a time, %s", concurrent,
                 "each in its Tune function actor" if in_function else "each a TorchTrainer")
    return TrialPlan(concurrent, plan, in_function)


@dataclass(frozen=True)
class ServePlan:
    """What each model replica asks Ray for, and how a rollout replaces replicas."""
    replicas: int  # started now (serve.min_replicas with autoscaling)
    cpus_per_replica: float
    gpus_per_replica: float
    fit: int  # model replicas the nodes hold beside the ingress (and what other work holds)
    max_surge_percent: int  # serve.max_surge_percent, or 0 when the surge can never be scheduled
    warning: str | None = None


def plan_serve(serve: ServeConfig, nodes: list[dict[str, float]], held: str = "", say: bool = True) -> ServePlan:
    """Fit the model replicas onto the cluster's nodes, or refuse with the keys to change.

    Serve waits forever for a replica Ray cannot place, so a plan that cannot be scheduled is a
    config error. `nodes` are totals, or what is free beside other work (`held` names it:
    stages.common.cluster.free_node_resources). A rolling update first starts
    ceil(max_surge_percent x replicas / 100) new replicas beside the old ones; when they can never
    fit (one GPU, a whole-GPU replica), the update replaces replicas in place (max_surge_percent 0)
    and warns of the gap.
    """
    replicas = serve.min_replicas if serve.autoscaling else serve.num_replicas
    gpus = serve.gpus_per_replica if serve.use_gpu else 0.0
    need = {"CPU": serve.cpus_per_replica, "GPU": gpus, "memory": serve.replica_memory_mb * 2**20}
    nodes = sorted((dict(n) for n in nodes), key=lambda n: -n.get("CPU", 0.0))
    if serve.model_deployment and nodes:  # the ingress replicas' CPUs, taken where most are
        nodes[0]["CPU"] = nodes[0].get("CPU", 0.0) - serve.ingress_replicas * serve.ingress_cpus
    fit = units_that_fit(need, nodes)
    key = "serve.min_replicas" if serve.autoscaling else "serve.num_replicas"
    have = ", ".join(f"{n.get('CPU', 0):g} CPU/{n.get('GPU', 0):g} GPU/{n.get('memory', 0) / 2**20:.0f} MB"
                     for n in nodes) + (f" free beside what other work holds: {held}" if held else "")
    if fit < replicas:
        fix = "lower serve.gpus_per_replica (a fraction shares a GPU) or " if gpus else ""
        if gpus and not any(n.get("GPU", 0) > 0 for n in nodes):
            fix = "the cluster has no GPU: set serve.use_gpu=false, add GPU nodes, or "
        tail = f"lower {key} or serve.cpus_per_replica, or add nodes"
        if units_that_fit({**need, "memory": 0.0}, nodes) >= replicas:  # memory alone is short
            fix, tail = "", f"lower serve.replica_memory_mb or {key}, or add nodes with more memory"
        raise ConfigError(
            f"{key}={replicas} replica(s) of serve.cpus_per_replica={serve.cpus_per_replica:g} CPU, "
            f"{gpus:g} GPU (serve.use_gpu, serve.gpus_per_replica) and serve.replica_memory_mb="
            f"{serve.replica_memory_mb} can{'not' if held else ' never'} be scheduled: the nodes ({have}) "
            f"hold {fit}; {'stop that work (serve.delete another app), ' if held else ''}"
            f"{fix}{tail}")
    surge = (serve.max_surge_percent * replicas + 99) // 100
    surge_pct, warning = serve.max_surge_percent, None
    if surge and fit < replicas + surge:
        surge_pct = 0
        fix = (f"set serve.gpus_per_replica={gpus / 2:g} (or less) so that old and new share the GPUs, or add "
               f"GPUs" if gpus else "lower serve.cpus_per_replica or serve.replica_memory_mb, or add nodes")
        warning = (f"a rollout's {surge} new replica(s) ({gpus:g} GPU, {serve.cpus_per_replica:g} CPU each) "
                   f"cannot start beside the {replicas} old one(s): the nodes ({have}) hold {fit}. Updates "
                   f"replace replicas in place: while one restarts, {replicas - 1} of {replicas} serve "
                   f"(with 1, requests wait out the new replica's start-up). To keep serving at full "
                   f"capacity, {fix}")
    plan = ServePlan(replicas, serve.cpus_per_replica, gpus, fit, surge_pct, warning)
    if say:  # not for `raymill run --serve`'s check before ETL: said when the endpoint starts
        log.info("serve plan: %d replica(s) x %.2f CPU x %.2f GPU, room for %d, max_surge_percent=%d",
                 replicas, plan.cpus_per_replica, gpus, fit, surge_pct)
    return plan


def plan_infer(infer: InferConfig, resources: dict[str, float]) -> dict:
    """Batch inference's plan: `decode` (tasks|actor), the actors (`num_actors`) and each one's
    num_cpus/num_gpus, and with decode=tasks each decode task's CPUs and how many run at once.
    Decode tasks get only the CPUs the actor pool leaves, and a pool that leaves none is refused:
    it would starve Ray Data."""
    gpus, total, per_task = (1.0 if infer.use_gpu else 0.0), resources["CPU"], infer.decode_cpus_per_task
    decode = infer.decode if infer.decode != "auto" else "tasks" if infer.use_gpu else "actor"
    actors = planned_actors(infer, resources, decode)
    if infer.decode == "auto" and decode == "tasks" and total - actors * infer.cpus_per_actor < actors * per_task:
        decode, actors = "actor", planned_actors(infer, resources, "actor")  # 8 GPUs, 8 CPUs: not 7 + 1 task
    named = f"infer.num_actors={actors}" if infer.num_actors else f"{actors} actor(s) (infer.num_actors unset)"
    if actors * gpus > resources["GPU"] + 1e-9:
        raise ConfigError(f"infer.use_gpu with {named} needs {actors:g} GPUs but the cluster has "
                          f"{resources['GPU']:g}; lower infer.num_actors or set infer.use_gpu=false")
    left = total - actors * infer.cpus_per_actor
    if left < -1e-9:  # Ray Data ran fewer actors than planned, and metrics.json counted them all
        raise ConfigError(f"{named} x infer.cpus_per_actor={infer.cpus_per_actor:g} need "
                          f"{actors * infer.cpus_per_actor:g} CPUs but the cluster has {total:g}; lower them")
    nodes = resources.get("nodes", ((total, resources["GPU"]),))  # and node by node: Ray Data waits
    fit = units_that_fit({"CPU": infer.cpus_per_actor, "GPU": gpus}, [{"CPU": c, "GPU": g} for c, g in nodes])
    if fit < actors:  # for the whole pool, for good
        raise ConfigError(f"{named} of infer.cpus_per_actor={infer.cpus_per_actor:g} CPU{' and 1 GPU' if gpus else ''}"
                          f" each do not fit on the nodes ({', '.join(f'{c:g} CPU/{g:g} GPU' for c, g in nodes)}): "
                          f"they hold {fit}; lower infer.num_actors or infer.cpus_per_actor, or add nodes")
    if decode == "tasks" and left < per_task - 1e-9:
        raise ConfigError(f"infer.decode=tasks: {named} x infer.cpus_per_actor="
                          f"{infer.cpus_per_actor:g} leave {max(left, 0):g} of {total:g} CPUs, less than one decode "
                          f"task (infer.decode_cpus_per_task={per_task:g}); lower them, or set infer.decode=actor")
    tasks = int(left / per_task + 1e-9) if decode == "tasks" else 0
    return {"decode": decode, "num_actors": actors, "num_cpus": infer.cpus_per_actor, "num_gpus": gpus,
            "decode_cpus": per_task if tasks else 0.0, "decode_tasks": tasks}


def planned_actors(infer: InferConfig, resources: dict[str, float], decode: str) -> int:
    """`infer.num_actors`, or where unset: with use_gpu one actor per GPU the cluster has (as
    training plans its workers: an 8-GPU node predicts on all 8), as many as the CPUs hold (those
    of a GPU node, and with decode=tasks one decode task's left beside them); on CPUs, as many as
    the nodes hold beside one CPU left for Ray Data's own tasks (one actor had used 1 core of a
    96-core node; on 2 cores it is still 1). Made on the cluster's totals, as training's plan is:
    beside other work, set infer.num_actors. The stage starts no more than its blocks."""
    if infer.num_actors:
        return infer.num_actors
    if not infer.use_gpu:
        nodes = [{"CPU": c} for c, _ in resources.get("nodes", ((resources["CPU"], 0.0),))]
        nodes[0]["CPU"] -= 1.0  # a CPU beside the pool, on one node (any one: the sum is what counts)
        return max(1, units_that_fit({"CPU": infer.cpus_per_actor}, nodes))
    cpus = resources["CPU"] - (infer.decode_cpus_per_task if decode == "tasks" else 0.0)
    # a GPU node's CPUs may hold fewer actors than it has GPUs
    per_gpu = min(1.0, resources.get("node_cpus_per_gpu", math.inf) / infer.cpus_per_actor)
    return max(1, min(int(resources["GPU"] * per_gpu + 1e-9), int(cpus / infer.cpus_per_actor + 1e-9)))
