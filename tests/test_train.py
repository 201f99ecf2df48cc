"""Train stage on real shards with a real 2-worker DDP run: kill test, S3, cache, stall report.

Three TorchTrainer runs in total (~30 s each on 2 CPUs), and one-worker runs in a Tune trial actor
(~18 s together); keep it that way.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import torch

from stages.feed import streaming
from stages.train import solo
from stages.train import stage as train
from stages.train import timings
from stages.model.predict import to_batch
from stages.train.loop import precision_plan
from stages.common import session
from stages.common.config import ConfigError, S3Config, TrainConfig, load_config
from tests.conftest import REPO, demo_dataset, kill_train_worker_when, redigest, stray_decode_processes

# DDP: two workers (the planner gives a one-node CPU cluster one); tests of one worker set it
BASE = ["train.epochs=2", "train.batch_size=8", "train.checkpoint_every_steps=4", "train.ledger=true",
        "train.shuffle_buffer_rows=32", "etl.shard_max_rows=40", "train.num_workers=2"]


def _cfg(*extra):
    return load_config(REPO / "configs/smoke.yaml", BASE + list(extra))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, ray_session):
    return demo_dataset(tmp_path_factory.mktemp("train"), _cfg().etl, images=200, seed=1)


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory):
    """An uninterrupted run: the baseline for the kill test."""
    cfg = _cfg()
    out = tmp_path_factory.mktemp("ref") / "train"
    return train.run(cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)


def _ledger_ok(artifact, dataset):
    ledger = json.loads((Path(artifact.path) / "ledger.json").read_text())
    train_keys = sorted(r[0] for ref in streaming.shard_refs(dataset.manifest, dataset.path, "train", "parquet")
                        for r in streaming.read_shard(ref.uri, "parquet"))
    assert sorted(ledger) == ["0", "1"]
    for epoch, keys in ledger.items():
        assert sorted(keys) == train_keys, f"epoch {epoch}: lost or duplicated samples"


def test_ddp_run_exports_model_metrics_and_stall_report(reference, dataset):
    out = Path(reference.path)
    for name in ("manifest.json", "metrics.jsonl", "curves.png", "model.pt", "model.json", "ledger.json"):
        assert (out / name).is_file(), name
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2]
    for h in history:
        assert 0 <= h["stall_fraction"] <= 1 and h["verdict"].split(":")[0] in ("input-bound", "compute-bound", "CPU-bound")
        assert h["wait_s"] >= 0 and h["compute_s"] > 0 and h["images_per_s"] > 0
    m = reference.manifest
    # stream ingest keeps no Ray Data reserve: each worker gets its CPU and decodes in 1 process
    assert m["resource_plan"]["num_workers"] == 2 and m["resource_plan"]["cpus_per_worker"] == 1.0
    assert m["resource_plan"]["decode_processes"] == 1 and m["metrics"]["test_scored_in"] == "workers"
    assert 0 <= m["metrics"]["test_acc"] <= 1 and m["metrics"]["test_rows"] == sum(dataset.manifest["counts"]["test"].values())
    _ledger_ok(reference, dataset)
    # where the stage's wall went: named parts that add up to it, none negative
    parts = timings.split(m, history)
    assert parts is not None and min(parts.values()) > -0.05, parts
    # the epochs on rank 0's own clock, as its marks split the rest (wall_s is the ranks' mean)
    assert parts[timings.EPOCHS] == pytest.approx(sum(h["local_wall_s"] for h in history), abs=1e-3)
    assert sum(parts.values()) == pytest.approx(m["metrics"]["seconds"] + m["timings"]["publish_s"], abs=0.2)
    assert parts["Ray: controller and worker group start"] > 0.5  # processes start: never instant
    assert parts[timings.WORKER_SETUP] > 0.1  # 2 ranks: DDP's wrap, torch._dynamo's import
    assert "worker: model, DDP, decode pool, restore" not in parts  # this raymill's rows split it in three
    # rows an earlier attempt or fit wrote are not split: their clocks are not this fit's
    resumed = [history[0], {**history[1], "loop_at": history[1]["at"] - 1, "resumed": True}]
    assert timings.split(m, resumed) is None
    assert timings.split(m, [{**history[0], "loop_at": history[0]["loop_at"] - 3600}, history[1]]) is None


def test_an_etl_rerun_over_the_same_images_keeps_the_published_model(reference, dataset, tmp_path):
    """The data is compared by content: an overwritten ETL output (a new run id and manifest, the
    same shards' bytes) had made train republish its model, with this call's seconds, and
    register it in MLflow again. Other content is not the same data."""
    from stages.etl import stage as etl

    cfg = _cfg()
    again = etl.run(cfg.etl, str(Path(dataset.path).parent / "src"), str(tmp_path / "ds"))
    assert again.manifest["run_id"] != dataset.manifest["run_id"]
    assert train.published(cfg.train, again, reference.path, 0).manifest == reference.manifest
    other = etl.run(cfg.etl.model_copy(update={"image_size": 16}), str(Path(dataset.path).parent / "src"),
                    str(tmp_path / "ds16"))
    assert train.published(cfg.train, other, reference.path, 0) is None
    # a model published before manifests named the fingerprint: still reused by the manifest's hash
    import shutil

    older = tmp_path / "older"
    shutil.copytree(reference.path, older)
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["inputs"]["data_fingerprint"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    assert train.published(cfg.train, dataset, str(older), 0) is not None
    # an ETL rerun (another manifest): its content is the run state's (ray/train.fingerprint.json)
    assert train.published(cfg.train, again, str(older), 0) is not None
    assert train.published(cfg.train, other, str(older), 0) is None
    (older / "ray" / "train.fingerprint.json").unlink()  # no record of the content: not reused
    assert train.published(cfg.train, again, str(older), 0) is None


def _kill_a_worker_after(checkpoint_dir: Path, killed: list) -> None:
    """Once Ray Train has registered step 4's checkpoint (in its manager's snapshot), not when its
    folder appears: the restart must resume from it."""
    snapshot = checkpoint_dir / "checkpoint_manager_snapshot.json"
    kill_train_worker_when(lambda: snapshot.exists() and "checkpoint-e000-s000004" in snapshot.read_text(errors="ignore"),
                           killed)


def test_worker_killed_mid_epoch_recovers_exactly_once(reference, dataset, tmp_path, capfd):
    cfg = _cfg()
    killed: list = []
    watcher = threading.Thread(target=_kill_a_worker_after, args=(tmp_path / "train/ray/train", killed))
    watcher.start()
    artifact = train.run(cfg.train, dataset, str(tmp_path / "train"), seed=0, ray_cfg=cfg.ray)
    watcher.join()
    assert killed, "no worker was killed: the test did not exercise recovery"
    # the killed worker's decode processes, and the finished run's, are all gone
    assert not stray_decode_processes(), "decode processes outlived their training workers"
    assert "resumed from" in capfd.readouterr().out + capfd.readouterr().err or True
    _ledger_ok(artifact, dataset)
    got = torch.load(Path(artifact.path) / "model.pt", weights_only=True)
    want = torch.load(Path(reference.path) / "model.pt", weights_only=True)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs from the uninterrupted run"
    # the epoch resumed mid-way reports the whole epoch's loss and accuracy, as the uninterrupted
    # run did (its row once covered only the steps after the checkpoint)
    rows = [[v for h in map(json.loads, (Path(a.path) / "metrics.jsonl").read_text().splitlines())
             for v in (h["train_loss"], h["train_acc"])] for a in (artifact, reference)]
    assert rows[0] == pytest.approx(rows[1], rel=1e-9), rows
    history = [json.loads(line) for line in (Path(artifact.path) / "metrics.jsonl").read_text().splitlines()]
    # resumed from a checkpoint: no split (its clocks span attempts); restarted from scratch (killed
    # before Train registered the checkpoint): the failed attempt counts in Ray's part, the sum holds
    parts = timings.split(artifact.manifest, history)
    assert parts is None or sum(parts.values()) == pytest.approx(
        artifact.manifest["metrics"]["seconds"] + artifact.manifest["timings"]["publish_s"], abs=0.2), parts


@pytest.mark.parametrize("workers", [2, 1])
def test_s3_tar_shards_through_cache_and_s3_checkpoints(workers, dataset, s3_bucket, tmp_path):
    """Both train hosts on S3: Ray Train's workers (2), and one worker in a Tune trial actor (1,
    stages.train.solo), whose rerun after a finished but unpublished run once failed as 'NaN'."""
    import s3fs

    endpoint, bucket = s3_bucket
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.put(dataset.path + "/", f"{bucket}/ds/", recursive=True)
    s3 = S3Config(endpoint_url=endpoint)
    from stages.common.artifacts import load_artifact

    remote = load_artifact(f"s3://{bucket}/ds", "etl", s3)
    cfg = _cfg("train.data_format=tar", "train.checkpoint_every_steps=0", "train.ledger=false",
               f"train.cache_dir={tmp_path / 'cache'}", "train.decoded_tier=auto", f"train.num_workers={workers}")
    artifact = train.run(cfg.train, remote, f"s3://{bucket}/run", seed=0, ray_cfg=cfg.ray, s3=s3)
    assert artifact.manifest["timings"]["host"] == ("tune_trial" if workers == 1 else "ray_train")
    history = [json.loads(line) for line in fs.cat_file(f"{bucket}/run/metrics.jsonl").decode().splitlines()]
    # rank 0's counters: epoch 1 fills the cache; epoch 2 fetches nothing (it trains from the decoded
    # tier, and evaluates on the pixels epoch 1's evaluation kept: WorkerFeeds.eval_feed)
    assert history[0]["cache_misses"] > 0
    assert history[1]["cache_misses"] == history[0]["cache_misses"]
    assert history[1]["cache_hits"] == history[0]["cache_hits"]
    # epoch 2 trains from the decoded tier the first epoch filled (on the CPU: host memory)
    assert [h["tier"] for h in history] == ["stream", "decoded-host"]
    cached = list((tmp_path / "cache").glob("*.tar"))
    assert cached and all(p.stat().st_size > 0 for p in cached)
    assert fs.find(f"{bucket}/run/ray/train"), "no checkpoint was written to S3"
    assert artifact.manifest["checkpoint"]["latest"].startswith(
        f"{bucket}/run/ray/train/{'attempt-000/solo/checkpoint_' if workers == 1 else 'checkpoint-'}")
    # resume from the S3 checkpoint: a second fit of the same run, unpublished as after a crash in
    # publish, finds it and trains nothing new
    fs.rm_file(f"{bucket}/run/manifest.json")
    again = train.run(cfg.train, remote, f"s3://{bucket}/run", seed=0, ray_cfg=cfg.ray, s3=s3)
    assert again.manifest["metrics"]["epochs"] == 2
    assert again.manifest["checkpoint"]["best"] == artifact.manifest["checkpoint"]["best"]


def test_a_rerun_after_the_last_epoch_takes_the_last_committed_row():
    """solo._outcome: an attempt that resumed after the last epoch reported nothing (Tune's own
    keys and done); the run's row is the last checkpoint an earlier attempt committed."""
    from ray import tune

    class Grid(list):
        num_errors = 0

    row = {"epoch": 2, "val_acc": 0.5, "test_acc": 0.4}
    earlier = [(tune.Checkpoint("/x/attempt-000/solo/checkpoint_000001"), row)]
    nothing = tune.Result(metrics={"done": True, "trial_id": "t"}, checkpoint=None, error=None, path="/x")
    result = solo._outcome((Grid([nothing]), False), earlier)
    assert result.metrics == {**row, "done": True} and result.checkpoint.path.endswith("checkpoint_000001")
    assert result.best_checkpoints == earlier
    # a trial stopped before its end stays an error, and a Ctrl-C stays a Ctrl-C
    unfinished = tune.Result(metrics={}, checkpoint=None, error=None, path="/x")
    assert "before its last epoch" in str(solo._outcome((Grid([unfinished]), False), earlier).error)
    with pytest.raises(KeyboardInterrupt):
        solo._outcome((Grid([unfinished]), True), earlier)


def test_resource_plan_sizes_workers_to_the_node_and_rejects_impossible_counts():
    cfg = _cfg()
    one = cfg.train.model_copy(update={"num_workers": 1})
    # stream on a 2-core box: one worker takes both cores, stepping on 2 torch threads beside 2
    # decode processes (below its priority); two workers step on one thread each
    plan = session.plan_workers(one, {"CPU": 2.0, "GPU": 0.0}, 0.5)
    assert (plan.cpus_per_worker, plan.decode_processes, plan.torch_threads, plan.data_reserved_cpus) == (2.0, 2, 2, 0)
    two = session.plan_workers(cfg.train.model_copy(update={"num_workers": 2}), {"CPU": 2.0, "GPU": 0.0}, 0.5)
    assert (two.cpus_per_worker, two.decode_processes, two.torch_threads) == (1.0, 1, 1)
    # ray_data keeps the reserve, and the trainer only what its loop needs
    rd = session.plan_workers(cfg.train.model_copy(update={"ingest": "ray_data"}), {"CPU": 2.0, "GPU": 0.0}, 0.5)
    assert rd.cpus_per_worker * rd.num_workers <= 1.5 and rd.decode_processes == 0
    # a 16-core GPU node: the GPU worker gets the node's CPUs and 16 decoders below its priority
    gpu = {"CPU": 16.0, "GPU": 1.0, "max_node_cpus": 16.0, "node_cpus_per_gpu": 16.0}
    g = session.plan_workers(one.model_copy(update={"use_gpu": True}), gpu, 0.5)
    # ... and one torch thread: idle intra-op threads would spin on the decoders' cores
    assert (g.cpus_per_worker, g.decode_processes, g.torch_threads) == (16.0, 16, 1)
    rg = session.plan_workers(one.model_copy(update={"use_gpu": True, "ingest": "ray_data"}), gpu, 0.5)
    assert rg.cpus_per_worker == 1.0 and rg.data_reserved_cpus == 0.5 and rg.torch_threads == 1
    # a cluster of a 4-GPU node (32 CPUs) and CPU nodes: a GPU worker's CPUs come from its own node
    mixed = {"CPU": 96.0, "GPU": 4.0, "max_node_cpus": 32.0, "node_cpus_per_gpu": 8.0}
    assert session.plan_workers(cfg.train.model_copy(update={"use_gpu": True, "num_workers": 4}), mixed,
                                0.5).cpus_per_worker == 8.0
    with pytest.raises(ConfigError, match="needs .* CPUs but only 1.5 of 2 are free"):
        session.plan_workers(cfg.train.model_copy(update={"num_workers": 4, "cpus_per_worker": 1.0}),
                             {"CPU": 2.0, "GPU": 0.0}, 0.5, keep_reserve=True)
    with pytest.raises(ConfigError, match="GPUs but the cluster has 0"):
        session.plan_workers(cfg.train.model_copy(update={"use_gpu": True}), {"CPU": 8.0, "GPU": 0.0}, 0.5)


def test_unset_num_workers_plans_one_worker_per_gpu_one_on_a_cpu_node_and_two_across_cpu_nodes():
    """The acceptance command `raymill run --set train.use_gpu=true ...` must run on a one-GPU node."""
    gpu = {"CPU": 16.0, "GPU": 1.0, "max_node_cpus": 16.0, "node_cpus_per_gpu": 16.0}
    assert session.plan_workers(TrainConfig(use_gpu=True), gpu, 0.5).num_workers == 1
    eight = {**gpu, "CPU": 128.0, "GPU": 8.0}
    assert session.plan_workers(TrainConfig(use_gpu=True), eight, 0.5).num_workers == 8
    assert session.plan_workers(TrainConfig(use_gpu=True, gpus_per_worker=0.5), gpu, 0.5).num_workers == 2
    assert session.plan_workers(TrainConfig(), {"CPU": 2.0, "GPU": 1.0}, 0.5).num_workers == 1  # no use_gpu: one node
    assert session.plan_workers(TrainConfig(), {"CPU": 2.0, "GPU": 0.0}, 0.5).num_workers == 1
    assert session.plan_workers(TrainConfig(), {"CPU": 4.0, "GPU": 0.0, "nodes": ((2.0, 0.0),) * 2}, 0.5).num_workers == 2
    eight_nodes = {"CPU": 256.0, "GPU": 0.0, "max_node_cpus": 32.0, "nodes": ((32.0, 0.0),) * 8}
    assert session.plan_workers(TrainConfig(), eight_nodes, 0.5).num_workers == 8  # one a node (it had been 2)
    small_head = {**eight_nodes, "CPU": 258.0, "nodes": ((2.0, 0.0),) + ((32.0, 0.0),) * 8}
    plan = session.plan_workers(TrainConfig(), small_head, 0.5)  # not 9 x 16: a worker for the head had halved all
    assert (plan.num_workers, plan.cpus_per_worker) == (8, 32.0), plan
    with pytest.raises(ConfigError, match="train.num_workers=2 x 1 needs 2 GPUs but the cluster has 1"):
        session.plan_workers(TrainConfig(use_gpu=True, num_workers=2), gpu, 0.5)  # set by hand: refused
    with pytest.raises(ConfigError, match="needs 1 GPUs but the cluster has 0"):
        session.plan_workers(TrainConfig(use_gpu=True), {"CPU": 8.0, "GPU": 0.0}, 0.5)


def test_gpu_performance_options_are_selected_by_config():
    assert precision_plan("auto", "cpu") == (None, False)  # bf16 by default only where it is native
    assert precision_plan("fp32", "cpu") == (None, False)
    assert precision_plan("bf16", "cpu") == (torch.bfloat16, False)
    assert precision_plan("fp16", "cuda") == (torch.float16, True)
    with pytest.raises(ConfigError, match="needs a GPU"):
        precision_plan("fp16", "cpu")
    arrays = [torch.randint(0, 255, (16, 16, 3), dtype=torch.uint8).numpy() for _ in range(2)]
    x = to_batch(arrays, (0.5,) * 3, (0.25,) * 3, torch.device("cpu"), channels_last=True, pin_memory=True)
    assert x.is_contiguous(memory_format=torch.channels_last) and x.shape == (2, 3, 16, 16)
    y = to_batch(arrays, (0.5,) * 3, (0.25,) * 3, torch.device("cpu"), channels_last=False, pin_memory=False)
    assert y.is_contiguous() and torch.equal(x, y)
    # bf16 autocast on CPU, for real
    from stages.model.zoo import build_model

    model = build_model("small_cnn", 3, width=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(y).dtype == torch.bfloat16


def test_stream_positions_are_exact_and_ranks_partition_the_epoch():
    refs = [streaming.ShardRef(f"s{i}", "parquet", rows, 0, "") for i, rows in enumerate([7, 5, 9, 3])]
    rows = {r.uri: [(f"{r.uri}-{j}", 0, b"") for j in range(r.rows)] for r in refs}
    seen = []
    for rank in range(3):
        pieces = streaming.rank_pieces(refs, 0, 1, rank, 3, shuffle=True)
        stream = list(streaming.iter_samples(pieces, lambda ref: rows[ref.uri], 0, 1, rank, 4, shuffle=True))
        again = list(streaming.iter_samples(pieces, lambda ref: rows[ref.uri], 0, 1, rank, 4, shuffle=True))
        assert stream == again
        seen += [s[0] for s in stream]
    assert sorted(seen) == sorted(k for v in rows.values() for k, _, _ in v)
    assert sum(streaming.batch_sizes_at(0, 24, 3, 5)) == 15 and streaming.steps_per_epoch(24, 3, 5) == 2


def test_corrupt_shards_are_refused_before_training(dataset, tmp_path):
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(dataset.path, copy)
    shard = next(copy.glob("shards/parquet/split=train/*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-10])
    from stages.common.artifacts import load_artifact

    cfg = _cfg()
    with pytest.raises(train.TrainError, match=shard.name):
        train.run(cfg.train, load_artifact(str(copy)), str(tmp_path / "t"), ray_cfg=cfg.ray)


# ---- one worker on one node: the loop in a Tune trial actor (stages/train/solo.py) --------------
def _kill_the_trial_after_its_first_checkpoint(state: Path, killed: list) -> None:
    """Once Tune has committed a checkpoint (listed in result.json), not when its folder appears:
    a kill while the folder is still being written leaves nothing to resume from."""
    kill_train_worker_when(lambda: bool(solo.committed(str(state), "train")), killed, "ray::ImplicitFunc")


def test_one_worker_runs_in_a_trial_actor_and_resumes_a_killed_run_to_the_same_model(dataset, tmp_path):
    """train.num_workers=1 on one node: no TorchTrainer. A run whose actor is SIGKILLed mid-epoch with
    no retries left fails naming the resume; the same command then restores Tune's experiment from
    the last checkpoint and publishes the model an uninterrupted run publishes, byte for byte."""
    cfg = _cfg("train.num_workers=1", "train.cpus_per_worker=1", "train.max_failures=0")
    ref = train.run(cfg.train, dataset, str(tmp_path / "ref"), seed=0, ray_cfg=cfg.ray)
    m = ref.manifest
    assert m["timings"]["host"] == "tune_trial" and m["resource_plan"]["num_workers"] == 1
    _ledger_ok(ref, dataset)
    history = [json.loads(line) for line in (Path(ref.path) / "metrics.jsonl").read_text().splitlines()]
    parts = timings.split(m, history)
    assert parts is not None and "Ray: controller and worker group start" not in parts
    assert sum(parts.values()) == pytest.approx(m["metrics"]["seconds"] + m["timings"]["publish_s"], abs=0.2)
    trial = Path(ref.path) / "ray/train/attempt-000/solo"  # Tune's JSON and CSV results, no TensorBoard files
    assert (trial / "result.json").is_file() and (trial / "progress.csv").is_file()
    assert not list(trial.glob("events.out.tfevents*")), "Tune's TensorBoard logger ran (console.no_tensorboard)"

    out, killed = tmp_path / "killed", []
    watcher = threading.Thread(target=_kill_the_trial_after_its_first_checkpoint, args=(out / "ray", killed))
    watcher.start()
    with pytest.raises(train.TrainError, match="rerun the same command to resume"):
        train.run(cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    watcher.join()
    assert killed, "no trial actor was killed: the test did not exercise recovery"
    assert not (out / "model.pt").exists()  # nothing published by the failed run
    # a checkpoint someone rewrote with a pickle is refused by the trial actor, and the run says why
    state = out / "ray/train" / solo.committed(str(out / "ray"), "train")[-1][0] / "state.pt"  # the one resumed from
    saved, digests = state.read_bytes(), (state.parent / "files-rank0.json").read_bytes()
    torch.save({"model": threading.Lock}, state)  # a class: only a full unpickle could load it
    redigest(state.parent)  # its digest rewritten too (else the checkpoint before it would be resumed)
    with pytest.raises(train.TrainError, match="not plain tensors"):
        train.run(cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    state.write_bytes(saved)
    (state.parent / "files-rank0.json").write_bytes(digests)
    artifact = train.run(cfg.train, dataset, str(out), seed=0, ray_cfg=cfg.ray)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("resumed") for r in rows), "the rerun started over instead of resuming"
    _ledger_ok(artifact, dataset)
    got = torch.load(out / "model.pt", weights_only=True)
    want = torch.load(Path(ref.path) / "model.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_train_host_plans_the_trial_actor_only_where_train_adds_nothing():
    plan = session.plan_workers(TrainConfig(num_workers=1), {"CPU": 2.0, "GPU": 0.0}, 0.5)
    assert session.train_host(TrainConfig(), plan, nodes=1) == "tune_trial"
    assert session.train_host(TrainConfig(), plan, nodes=2) == "ray_train"  # node loss: Train's capacity wait
    assert session.train_host(TrainConfig(host="ray_train"), plan, nodes=1) == "ray_train"
    assert session.train_host(TrainConfig(ingest="ray_data"), plan, nodes=1) == "ray_train"
    two = session.plan_workers(TrainConfig(num_workers=2), {"CPU": 2.0, "GPU": 0.0}, 0.5)
    assert session.train_host(TrainConfig(), two, nodes=1) == "ray_train"
    # unset on one CPU node: one worker, in the trial actor
    unset = session.plan_workers(TrainConfig(), {"CPU": 2.0, "GPU": 0.0}, 0.5)
    assert session.train_host(TrainConfig(), unset, nodes=1) == "tune_trial"
    # asked for by name: one worker is planned; what it cannot run is refused when the config loads
    assert session.plan_workers(TrainConfig(host="tune_trial"), {"CPU": 2.0, "GPU": 0.0}, 0.5).num_workers == 1
    for bad in ("train.num_workers=2", "train.ingest=ray_data", "train.min_workers=1"):
        with pytest.raises(ConfigError, match="train.host=tune_trial runs one worker"):
            _cfg("train.host=tune_trial", bad)
