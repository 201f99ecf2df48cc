"""The one trainer builder shared by `raymill train` and every Tune trial, and its run names."""
from __future__ import annotations

import inspect

from stages.train import stage as train
from stages.tune import stage as tune
from stages.common import storage
from stages.common.config import TrainConfig


def test_shared_storage_path_gives_every_output_its_own_train_run():
    shared = TrainConfig(storage_path="s3://bucket/ray")
    a, b = train.run_name(shared, "s3://bucket/runs/a"), train.run_name(shared, "s3://bucket/runs/b")
    assert a != b and a.startswith("train-") and b.startswith("train-")
    assert train.run_name(shared, "s3://bucket/runs/a/") == a  # same output, same run: it resumes
    assert train.run_name(TrainConfig(), "runs/a") == "train"  # under <out>/ray the folder is the output's


def test_train_and_tune_build_their_trainer_through_one_function():
    assert "build_trainer(" in inspect.getsource(train._run_locked)
    assert "train.build_trainer(" in inspect.getsource(tune._run_trial)
    assert "TorchTrainer(" not in inspect.getsource(tune)


def test_one_training_loop_serves_train_workers_and_one_worker_trials():
    """No second copy of the loop: a one-worker trial calls the same `train_loop` as a Train
    worker, with Tune's hooks; the loop itself calls no Ray Train or Tune API directly."""
    from stages.train import loop as train_loop

    assert "train_loop(loop, TuneHooks())" in inspect.getsource(tune._run_trial)
    assert "train_loop(config)" in inspect.getsource(train._entry)
    loop = inspect.getsource(train_loop)
    assert "ray.train." not in loop and "ray.tune." not in loop


def test_stored_raw_is_answered_in_one_place():
    manifest = {"config": {"parquet_encoding": "raw"}}
    assert storage.stored_raw(manifest, "parquet") and not storage.stored_raw(manifest, "tar")
    assert not storage.stored_raw({"config": {"parquet_encoding": "encoded"}}, "parquet")


def test_ray_data_tasks_get_one_cpu_where_the_node_has_room_and_fit_a_small_one():
    """train.data_cpus_per_task unset: 1 CPU a task (Ray's default) beside one GPU worker on a
    16-core node, what is left (0.25 at most) beside two CPU workers on 2 cores; a set value wins."""
    from stages.common import session

    gpu_node = {"CPU": 16.0, "GPU": 1.0, "max_node_cpus": 16.0, "node_cpus_per_gpu": 16.0}
    ray_data = TrainConfig(ingest="ray_data", use_gpu=True, num_workers=1)
    assert session.plan_workers(ray_data, gpu_node, 0.5).data_cpus_per_task == 1.0
    laptop = {"CPU": 2.0, "GPU": 0.0, "max_node_cpus": 2.0}
    two = TrainConfig(ingest="ray_data", num_workers=2)
    assert session.plan_workers(two, laptop, 0.5).data_cpus_per_task == 0.25
    assert session.plan_workers(two, laptop, 0.2).data_cpus_per_task == 0.2
    # unset on one CPU node: one worker holds 1 CPU for its loop, and Ray Data gets 0.25 of the rest
    assert session.plan_workers(TrainConfig(ingest="ray_data"), laptop, 0.5).data_cpus_per_task == 0.25
    set_by_user = TrainConfig(ingest="ray_data", use_gpu=True, num_workers=1, data_cpus_per_task=0.5)
    assert session.plan_workers(set_by_user, gpu_node, 0.5).data_cpus_per_task == 0.5
    assert session.plan_workers(TrainConfig(), laptop, 0.5).data_cpus_per_task == 0.0  # stream: no Ray Data


def test_the_ddp_backend_shares_a_nodes_gpus_as_rays_torch_backend_does():
    """Each worker sees all of its node's GPUs and uses its local rank's, so NCCL can link them
    peer to peer (Backend's default, False, gave each worker only its own GPU)."""
    from ray.train.torch import TorchConfig

    from stages.train.ddp_rendezvous import LoopbackTorchConfig

    ours, rays = LoopbackTorchConfig(backend="nccl"), TorchConfig(backend="nccl")
    assert ours.backend_cls.share_cuda_visible_devices is rays.backend_cls.share_cuda_visible_devices is True
    assert (ours.backend, ours.init_method, ours.timeout_s) == (rays.backend, rays.init_method, rays.timeout_s)
