"""Failure-mode plans that need no cluster: the bounded capacity wait after a node loss, and
Serve replicas planned beside a trainer (`raymill run --serve`). The real node-loss runs are
in test_cluster.py."""
from __future__ import annotations

import os

import pytest

from stages.train import capacity
from stages.common import session
from stages.common.config import ConfigError, load_config
from tests.conftest import REPO, make_tree

TWO_CPUS = {"CPU": 2.0, "GPU": 0.0}


def _cfg(*extra):
    return load_config(REPO / "configs/smoke.yaml", list(extra))


@pytest.fixture
def no_start_timeout_env(monkeypatch):
    monkeypatch.delenv(capacity.START_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(capacity, "_set_by_us", None)


def test_capacity_timeout_bounds_rays_retries_of_a_group_that_cannot_be_placed(no_start_timeout_env):
    kwargs = capacity.failure_config_kwargs(max_failures=2, capacity_timeout_s=600)
    # 60 s per attempt (Ray's default), 10 attempts in all: limit 9 (Ray raises past the limit)
    assert kwargs == {"max_failures": 2, "controller_failure_limit": 9}
    assert os.environ[capacity.START_TIMEOUT_ENV] == "60"
    # a small budget still holds two attempts, with shorter waits each
    assert capacity.failure_config_kwargs(0, 30)["controller_failure_limit"] == 1
    assert os.environ[capacity.START_TIMEOUT_ENV] == "15"


def test_a_users_own_start_timeout_wins(no_start_timeout_env, monkeypatch):
    monkeypatch.setenv(capacity.START_TIMEOUT_ENV, "20")
    assert capacity.failure_config_kwargs(1, 100)["controller_failure_limit"] == 4
    assert os.environ[capacity.START_TIMEOUT_ENV] == "20"


def test_capacity_timeout_is_recognised_through_rays_controller_error():
    import ray.train

    class WorkerGroupStartupTimeoutError(RuntimeError):  # stands in for Ray's internal class
        pass

    assert capacity.is_capacity_timeout(ray.train.ControllerError(WorkerGroupStartupTimeoutError("15 s")))
    assert not capacity.is_capacity_timeout(ray.train.ControllerError(ValueError("other")))
    assert not capacity.is_capacity_timeout(RuntimeError("worker died"))


def test_capacity_error_names_the_missing_resources_and_how_to_go_on():
    plan = session.plan_workers(_cfg("train.num_workers=2").train, TWO_CPUS, 0.5, keep_reserve=True)  # 2 x 0.75 CPU
    nodes = [{"Alive": True, "Resources": {"CPU": 1.0}}, {"Alive": False, "Resources": {"CPU": 1.0}}]
    assert capacity.workers_that_fit({"CPU": 0.75}, nodes) == 1
    message = str(capacity.capacity_error(plan, 40, "runs/x/train", nodes))
    assert "train.capacity_timeout_s=40s" in message and "1 alive node(s) (CPU 1)" in message
    assert "missing: 1 x {CPU: 0.75}" in message and "ray start --address" in message
    assert "train.min_workers=1" in message and "rerun the same command" in message and "runs/x/train" in message
    # train.worker_resources count: a node without the custom resource holds no worker
    custom = str(capacity.capacity_error(plan, 40, "runs/x/train", nodes, worker_resources={"fast_disk": 1.0}))
    assert "fit only 0" in custom and "fast_disk: 1" in custom, custom


def test_run_with_serve_that_cannot_fit_stops_before_etl_with_exit_2(ray_session, tmp_path, capsys):
    from workflow.__main__ import main

    # Before Ray starts (it had been after, leaving run.dir/config.yaml and an empty mlflow.db): a
    # local Ray's CPUs are known then, at most this machine's (here, ray.num_cpus)
    make_tree(tmp_path / "src", per_class=2, bad=False)
    rc = main(["run", "--serve", "--config", str(REPO / "configs/smoke.yaml"), "--set", f"run.dir={tmp_path / 'run'}",
               "--set", f"run.source={tmp_path / 'src'}", "--set", "ray.num_cpus=2", "--set", "serve.num_replicas=4"])
    err = capsys.readouterr().err
    assert rc == 2 and "serve.num_replicas=4 replica(s) of serve.cpus_per_replica=0.5 CPU" in err, err
    assert "can never be scheduled: the nodes (1.75 CPU/0 GPU/" in err and "hold 3" in err, err  # beside the ingress
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"hold 0; lower serve.replica_memory_mb or serve.num_replicas"):  # memory short
        session.plan_serve(_cfg("serve.replica_memory_mb=4096").serve, [{"CPU": 8.0, "memory": 2 * 2**30}])


ONE_GPU_NODE = [{"CPU": 16.0, "GPU": 1.0, "memory": 64 * 2**30}]


def test_serve_plan_fits_gpu_replicas_or_replaces_in_place_with_a_warning():
    whole = _cfg("serve.use_gpu=true").serve  # 1 GPU a replica, max_surge_percent 100
    plan = session.plan_serve(whole, ONE_GPU_NODE)
    assert (plan.replicas, plan.gpus_per_replica, plan.fit, plan.max_surge_percent) == (1, 1.0, 1, 0)
    assert "serve.gpus_per_replica=0.5" in plan.warning and "requests wait" in plan.warning
    half = session.plan_serve(_cfg("serve.use_gpu=true", "serve.gpus_per_replica=0.5").serve, ONE_GPU_NODE)
    assert (half.fit, half.max_surge_percent, half.warning) == (2, 100, None)  # old + new share the GPU
    cpu = session.plan_serve(_cfg().serve, [{"CPU": 2.0, "memory": 8 * 2**30}])
    assert cpu.gpus_per_replica == 0 and cpu.max_surge_percent == 100  # (2 - 0.25 ingress) / 0.5 = 3 fit
    # the plan reaches the deployment: fractional GPUs, surge off only where it can never fit
    from stages.serve import app as serve_stage

    options = serve_stage.deployment_options(whole, plan)
    assert options["ray_actor_options"]["num_gpus"] == 1.0 and options["max_surge_percent"] == 0
    assert serve_stage.deployment_options(half_cfg := _cfg("serve.use_gpu=true", "serve.gpus_per_replica=0.25").serve,
                                          session.plan_serve(half_cfg, ONE_GPU_NODE))["ray_actor_options"]["num_gpus"] == 0.25


def test_serve_plan_that_can_never_be_scheduled_is_a_config_error_with_the_fix():
    with pytest.raises(ConfigError, match=r"serve.num_replicas=2 .* hold 1; lower serve.gpus_per_replica"):
        session.plan_serve(_cfg("serve.use_gpu=true", "serve.num_replicas=2").serve, ONE_GPU_NODE)
    with pytest.raises(ConfigError, match=r"0 GPU/.* hold 0; the cluster has no GPU: set serve.use_gpu=false"):  # use_gpu on a CPU-only cluster
        session.plan_serve(_cfg("serve.use_gpu=true").serve, [{"CPU": 8.0, "memory": 8 * 2**30}])
    with pytest.raises(ConfigError, match=r"serve.min_replicas=3"):  # autoscaling: its floor must fit
        session.plan_serve(_cfg("serve.autoscaling=true", "serve.min_replicas=3", "serve.max_replicas=4",
                                "serve.cpus_per_replica=1").serve, [{"CPU": 2.0, "memory": 8 * 2**30}])
    with pytest.raises(ConfigError, match=r"serve.gpus_per_replica': Input should be less than or equal to 1"):
        _cfg("serve.gpus_per_replica=1.5")
    with pytest.raises(ConfigError, match=r"serve.gpus_per_replica"):
        _cfg("serve.gpus_per_replica=0")


def test_raymill_serve_refuses_a_plan_ray_could_never_place_with_exit_2(ray_session, tmp_path, capsys):
    """The session's Ray declares 1 GPU: two whole-GPU replicas are refused before Serve starts."""
    import hashlib
    import json

    from tests.conftest import free_port
    from workflow.__main__ import main

    # a folder that passes the model check (model.json + a model.pt of its checksum): the plan is refused
    # next, before any replica would load it
    (tmp_path / "model.pt").write_bytes(b"weights")
    (tmp_path / "model.json").write_text(json.dumps({"weights_sha256": hashlib.sha256(b"weights").hexdigest()}))
    rc = main(["serve", "--model", str(tmp_path), "--port", str(free_port()), "--set", "serve.use_gpu=true",
               "--set", "serve.num_replicas=2"])
    assert rc == 2
    assert "can never be scheduled" in capsys.readouterr().err


def test_free_node_resources_count_what_placement_groups_and_actors_hold(ray_session):
    """What `raymill serve` plans on beside other work: a placement group's bundle is held whether or
    not an actor runs in it; an actor outside one holds its own resources; both are named."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from stages.common import cluster

    @ray.remote(num_cpus=0.25, num_gpus=0.5)
    class Holder:
        def ping(self) -> int:
            return 1

    before, _ = cluster.free_node_resources()
    group = placement_group([{"CPU": 1.0}], name="test-hold")
    ray.get(group.ready(), timeout=60)
    holder = Holder.remote()
    ray.get(holder.ping.remote(), timeout=60)
    try:
        (node,), held = cluster.free_node_resources()
        assert node["CPU"] == pytest.approx(before[0]["CPU"] - 1.25)
        assert node["GPU"] == pytest.approx(before[0]["GPU"] - 0.5)
        assert "placement group test-hold 1 CPU" in held and "Holder 0.5 GPU 0.25 CPU" in held, held
        with pytest.raises(ConfigError, match="cannot be scheduled: .*Holder 0.5 GPU"):
            session.plan_serve(_cfg("serve.use_gpu=true").serve, [node], held)
    finally:
        ray.kill(holder)
        remove_placement_group(group)


def test_a_containers_cpu_quota_caps_the_cores_counted_without_ray(tmp_path):
    """cgroup v2 `cpu.max` and v1's CFS files, as a container runtime writes them (`--cpus=2.5`)."""
    from stages.common.cluster import _cgroup_cpu_quota

    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cpu.max").write_text("250000 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path / "v2")) == 2.5
    (tmp_path / "v2" / "cpu.max").write_text("max 100000\n")
    assert _cgroup_cpu_quota(str(tmp_path / "v2")) is None
    (tmp_path / "v1" / "cpu").mkdir(parents=True)
    (tmp_path / "v1" / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "v1" / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert _cgroup_cpu_quota(str(tmp_path / "v1")) == 1.5
    (tmp_path / "v1" / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert _cgroup_cpu_quota(str(tmp_path / "v1")) is None and _cgroup_cpu_quota(str(tmp_path / "none")) is None
    assert 1 <= session.local_cpus() <= (os.cpu_count() or 1)


def _nodes(*shapes) -> dict:
    """Cluster resources as cluster.cluster_resources gives them, for nodes of (CPUs, GPUs)."""
    return {"CPU": sum(c for c, _ in shapes), "GPU": sum(g for _, g in shapes),
            "max_node_cpus": max(c for c, _ in shapes), "nodes": shapes}


def test_workers_are_sized_to_the_nodes_that_hold_them_not_to_the_clusters_sum():
    # 16 + 4 CPUs: an even share of the sum (2 x 10) fit one worker, and the second waited out
    # train.capacity_timeout_s (a review, on a real 6 + 2 CPU cluster: CapacityError after the wait)
    plan = session.plan_workers(_cfg("train.num_workers=2").train, _nodes((16.0, 0.0), (4.0, 0.0)), 0.5)
    assert (plan.num_workers, plan.cpus_per_worker) == (2, 8.0)
    # unset, one worker a node of at least half the largest's CPUs: the 16-CPU one
    assert session.plan_workers(_cfg().train, _nodes((16.0, 0.0), (4.0, 0.0)), 0.5).cpus_per_worker == 16.0
    four = session.plan_workers(_cfg("train.num_workers=4").train, _nodes((2.0, 0.0), (16.0, 0.0), (4.0, 0.0)), 0.5)
    assert four.cpus_per_worker == 4.0  # 4 on the 16-CPU node (or 3 there and 1 on the 4-CPU one)
    # ray_data on three 1-CPU nodes: 3 x 0.83 left each node 0.17 CPU, under a 0.25-CPU Ray Data task: a hang
    rd = session.plan_workers(_cfg("train.ingest=ray_data", "train.num_workers=3").train,
                              _nodes((1.0, 0.0), (1.0, 0.0), (1.0, 0.0)), 0.5)
    assert rd.cpus_per_worker == 0.75 and rd.data_cpus_per_task == 0.25
    # one GPU and one CPU a node: each node keeps its Ray Data task's quarter
    gpu = session.plan_workers(_cfg("train.ingest=ray_data", "train.use_gpu=true").train,
                               {**_nodes(*[(1.0, 1.0)] * 4), "node_cpus_per_gpu": 1.0}, 0.5)
    assert (gpu.num_workers, gpu.cpus_per_worker) == (4, 0.75)
    # a single node plans as before
    assert session.plan_workers(_cfg("train.num_workers=2").train, TWO_CPUS, 0.5).cpus_per_worker == 1.0
    # a 0-CPU head has no room, not negative room (it had cut the share: 8 x 0.6 where 8 x 0.75 fit)
    head = session.plan_workers(_cfg("train.ingest=ray_data", "train.num_workers=8", "train.data_cpus_per_task=1").train,
                                _nodes((0.0, 0.0), (4.0, 0.0), (4.0, 0.0)), 2.0)
    assert head.cpus_per_worker == 0.75
    # eight 1.5-CPU nodes keep 0.5 each beside 1-CPU workers: 0.25-CPU Ray Data tasks (the totals'
    # 4 CPUs left had given 1-CPU tasks that no node could start)
    small = session.plan_workers(_cfg("train.ingest=ray_data", "train.num_workers=8").train, _nodes(*[(1.5, 0.0)] * 8), 0.5)
    assert (small.cpus_per_worker, small.data_cpus_per_task) == (1.0, 0.25)


def test_a_worker_no_node_can_hold_is_refused_naming_the_nodes():
    with pytest.raises(ConfigError, match=r"1 training worker\(s\) of 17 CPU each .* do not fit on the nodes "
                                          r"\(1 x 16 CPU/0 GPU, 1 x 4 CPU/0 GPU, 1 x 2 CPU/0 GPU; .*they hold 0"):
        session.plan_workers(_cfg("train.num_workers=1", "train.cpus_per_worker=17").train,
                             _nodes((2.0, 0.0), (16.0, 0.0), (4.0, 0.0)), 0.5)
    with pytest.raises(ConfigError, match=r"train.gpus_per_worker=2 GPU do not fit on the nodes \(2 x 16 CPU/1 GPU; "
                                          r".*hold 0; lower train.gpus_per_worker \(at most 1\)"):
        session.plan_workers(_cfg("train.use_gpu=true", "train.num_workers=1", "train.gpus_per_worker=2").train,
                             {**_nodes((16.0, 1.0), (16.0, 1.0)), "node_cpus_per_gpu": 16.0}, 0.5)
    with pytest.raises(ConfigError, match=r"no CPU for training workers yet: add a node with CPUs"):
        session.plan_workers(_cfg().train, _nodes((0.0, 0.0)), 0.5)  # a head started with --num-cpus=0
    with pytest.raises(ConfigError, match=r"leave each worker under 0.01 of the 2 free CPUs"):
        session.plan_workers(_cfg("train.num_workers=300").train, TWO_CPUS, 0.5)
