"""train.ingest=ray_data: epoch-granular resume ledger, object-store cache, two-node placement.

Three TorchTrainer runs (~40 s each on 2 CPUs) plus one two-node cluster in a subprocess.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from stages.feed import ray_data as ingest_ray
from stages.feed import streaming
from stages.train import stage as train
from stages.feed.meters import EpochTimes, StartWaits, verdict
from stages.common.config import ConfigError, load_config
from tests.conftest import REPO, demo_dataset, kill_train_worker_when

BASE = ["train.ingest=ray_data", "train.epochs=2", "train.batch_size=8", "train.shuffle_buffer_rows=32",
        "etl.shard_max_rows=40", "train.num_workers=2"]  # two ranks: Train's split of Ray Data


def _cfg(*extra):
    return load_config(REPO / "configs/smoke.yaml", BASE + list(extra))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, ray_session):
    return demo_dataset(tmp_path_factory.mktemp("ingest"), _cfg().etl, images=200, seed=1)


def _train_keys(dataset) -> list[str]:
    return sorted(r[0] for ref in streaming.shard_refs(dataset.manifest, dataset.path, "train", "parquet")
                  for r in streaming.read_shard(ref.uri, "parquet"))


def _history(artifact) -> list[dict]:
    return [json.loads(x) for x in (Path(artifact.path) / "metrics.jsonl").read_text().splitlines()]


def _kill_a_worker_once_registered(run_dir: Path, name: str, killed: list) -> None:
    """SIGKILL one training worker once Ray Train has *registered* checkpoint `name` (listed in its
    checkpoint manager snapshot), so the restart must resume from it; a kill while the folder is
    still being written would restart from scratch and prove nothing."""
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    kill_train_worker_when(lambda: snapshot.exists() and name in snapshot.read_text(errors="ignore"), killed,
                           timeout_s=300)


def test_killed_worker_repeats_only_the_interrupted_epoch_and_counts_it(dataset, tmp_path):
    cfg = _cfg("train.checkpoint_every_steps=4", "train.ledger=true")
    killed: list = []
    watcher = threading.Thread(target=_kill_a_worker_once_registered,
                               args=(tmp_path / "train/ray/train", "checkpoint-e000-s000004", killed))
    watcher.start()
    artifact = train.run(cfg.train, dataset, str(tmp_path / "train"), seed=0, ray_cfg=cfg.ray)
    watcher.join()
    assert killed, "no worker was killed: the test did not exercise recovery"
    keys = _train_keys(dataset)
    kept = ingest_ray.equal_rows(len(keys), 2)
    ledger = json.loads((Path(artifact.path) / "ledger.json").read_text())
    # epoch 1 completed without a failure: every (kept) sample exactly once
    assert len(ledger["1"]) == kept and len(set(ledger["1"])) == kept and set(ledger["1"]) <= set(keys)
    # epoch 0 was interrupted after its step-4 checkpoint: restarted from its first batch, so the
    # 2 ranks x 4 steps x 8 rows consumed before that checkpoint come twice (or 8 steps, if the
    # step-8 checkpoint was registered before the kill landed), and are counted
    counts = Counter(ledger["0"])
    duplicates = sum(n - 1 for n in counts.values())
    assert len(counts) >= kept and max(counts.values()) == 2 and duplicates in (2 * 4 * 8, 2 * 8 * 8)
    history = _history(artifact)
    assert [h["ledger_duplicates"] for h in history] == [duplicates, 0]
    assert artifact.manifest["ingest"]["resume"].startswith("epoch-granular")
    for h in history:  # the verdict names the path, with Ray Data's own iterator wait
        assert h["ray_data_blocked_s"] is not None and h["ray_data_blocked_s"] >= 0
        assert "Ray Data" in h["verdict"] and h["rows_decoded_in_epoch"] > 0
    assert 0 <= artifact.manifest["metrics"]["test_acc"] <= 1


def test_object_store_cache_serves_epoch_two_without_decoding_tar_shards(dataset, tmp_path):
    cfg = _cfg("train.object_store_cache=true", "train.data_format=tar")
    artifact = train.run(cfg.train, dataset, str(tmp_path / "train"), seed=0, ray_cfg=cfg.ray)
    ingest = artifact.manifest["ingest"]
    assert ingest["cache_fits"] and ingest["cache_bytes"] > 0
    history = _history(artifact)
    assert [h["rows_decoded_in_epoch"] for h in history] == [0, 0], "a cached epoch decoded again"
    assert history[-1]["images_per_s"] > 0


def test_task_sizes_that_cannot_fit_beside_the_trainer_are_refused(caplog):
    cfg = _cfg("train.data_cpus_per_task=1.0")
    with pytest.raises(ConfigError, match="train.data_cpus_per_task=1 exceeds ray.data_reserved_cpus=0.5"):
        ingest_ray.check_plan(cfg.train, cfg.ray.data_reserved_cpus)
    with caplog.at_level(logging.WARNING):
        ingest_ray.check_plan(_cfg("train.checkpoint_every_steps=4").train, 0.5)
    assert "epoch-granular" in caplog.text
    assert ingest_ray._blocked_s("* Total time user thread is blocked by Ray Data iter_batches: 12.5ms") == 0.0125


def test_each_epoch_starts_while_the_one_before_trains_in_fused_tasks(dataset):
    """WarmEpochs: epoch e + 1's execution (the other dataset's split coordinator) delivers its first
    batch while epoch e is still being read; every epoch still has every row once. Small shards:
    whole blocks, Ray fuses the read with the decode; big ones keep 64-row calls."""
    shards = [dict(s, uri=f"{dataset.path}/{s['path']}") for s in dataset.manifest["shards"]
              if s["split"] == "train" and s["format"] == "parquet"]
    assert ingest_ray.decode_rows(shards, 32) is None
    assert ingest_ray.decode_rows([{"rows": 2000}], 224) == ingest_ray.MAP_BATCH_ROWS
    cfg = _cfg("train.epochs=3").train
    datasets, _ = ingest_ray.build_train_datasets(cfg, shards, seed=0, image_size=32, raw=False, s3=None)
    assert sorted(datasets) == sorted(ingest_ray.SPLITS)
    # small epochs run without Ray Data's per-operator reservation (1.7x the decode rate); an epoch
    # that would not fit in a quarter of the object store keeps it (its run-ahead budget)
    assert not any(ds.context.op_resource_reservation_enabled for ds in datasets.values())
    import ray

    store = ray.cluster_resources()["object_store_memory"]
    rows = int(store * ingest_ray.RUN_AHEAD_SHARE / (224 * 224 * 3)) + 1
    assert ingest_ray.reserve_per_operator([{"rows": rows}], 224, 1)
    assert not ingest_ray.reserve_per_operator([{"rows": rows // 3}], 224, 2)
    splits = {name: ds.streaming_split(1, equal=True)[0] for name, ds in datasets.items()}
    asked: list[str] = []
    keys = _train_keys(dataset)
    steps = -(-len(keys) // cfg.batch_size)
    warm = ingest_ray.WarmEpochs(cfg, 0, 0, lambda name: asked.append(name) or splits[name], steps)
    for epoch in range(3):
        batches, seen = iter(warm.epoch(epoch)), []
        for _ in range(warm.at):
            assert warm.next is None, "the next epoch began before half of this one was read"
            seen += next(batches).rows
        if epoch < 2:  # the next epoch's first batch arrives before this epoch is read further
            upcoming = warm.next[1]
            upcoming.thread.join(timeout=60)
            assert warm.next[0] == epoch + 1 and upcoming.first is not None and upcoming.error is None
        for fed in batches:
            seen += fed.rows
        assert sorted(k for k, _, _ in seen) == keys, f"epoch {epoch} lost or repeated rows"
    assert asked == ["train", "train_odd", "train"]
    cold = ingest_ray.WarmEpochs(cfg.model_copy(update={"next_epoch_at": 1.0}), 0, 0, splits.get, steps)
    assert sum(len(fed.rows) for fed in cold.epoch(0)) == len(keys) and cold.next is None  # each epoch cold
    asked.clear()
    head = ingest_ray.WarmEpochs(cfg, 0, 0, lambda name: asked.append(name) or splits[name], steps)
    head.begin(0)  # a fresh worker's first epoch, begun before its model is built
    started = head.next[1]
    batches = head.epoch(0)
    assert batches.started is started and asked == ["train"]  # read, not started twice
    assert sum(len(fed.rows) for fed in batches) == len(keys)
    assert "ReadParquet->MapBatches(decode_augment_batch)" in splits["train"].stats()


def test_verdicts_name_the_other_path_as_the_fix():
    starved, busy = EpochTimes(100, 9.0, 1.0, 10.0), EpochTimes(100, 0.1, 9.9, 10.0)
    assert "train.ingest=ray_data" in verdict(starved, "GPU", "stream")
    waits = lambda start, early=0.0, late=None, warm=True, ahead=False: StartWaits(start, early, late, warm, ahead)
    assert "Ray Data is the weakest link" in verdict(starved, "GPU", "ray_data", ray_waits=waits(1.0))
    started = verdict(starved, "GPU", "ray_data", ray_waits=waits(8.0))
    assert "Ray Data's start is the weakest link, 8.0 s of the 9.0 s" in started and "train more epochs" in started
    # every epoch cold (train.next_epoch_at=1): the start is paid every epoch, and the fix says so
    cold_each = verdict(starved, "GPU", "ray_data", ray_waits=waits(8.0, warm=False))
    assert "train more epochs" not in cold_each and "train.next_epoch_at=0.5" in cold_each
    # begun during the epoch before and still not ready: more epochs or an earlier start fix nothing
    behind = verdict(starved, "GPU", "ray_data", ray_waits=waits(8.0, ahead=True))
    assert "cannot build an epoch ahead" in behind and "train more epochs" not in behind
    # a CPU run: stall 40%, but decode at the step's 1,000 img/s takes 1000/9000 = 11% of the cores:
    # not decode (a review's "CPU-bound ... store decoded" there would have won back <= 11%)
    stalled = EpochTimes(6000, 4.0, 6.0, 10.0)  # device rate 1,000 img/s
    elsewhere = verdict(stalled, "CPU", "stream", {"processes": 2, "images_per_s": 9000.0})
    assert "needs only 11% of the cores" in elsewhere and "store decoded" not in elsewhere
    shared = verdict(stalled, "CPU", "stream", {"processes": 2, "images_per_s": 1500.0})  # 67% of the cores
    assert shared.startswith("CPU-bound: decode (2 processes") and "store decoded" in shared
    # a fresh run's epoch 1 began while its worker started: the wait is in its first half, the second kept up
    cold = verdict(starved, "GPU", "ray_data", ray_waits=waits(0.0, 8.6, 0.05))
    assert "Ray Data's start is the weakest link, 8.6 s of the 9.0 s wait came in the epoch's first half" in cold
    # two ranks' parts, summed: means, as the verdict's other times; no second half, no late stall
    train = _cfg().train
    assert ingest_ray.judged_waits([2.0, 3.0, 0.4, 4.0, 2.0], 2, train) == (1.0, 1.5, 0.1, True, True)
    assert ingest_ray.judged_waits([1.0, 1.0, 0.0, 0.0, 0.0], 1, train).late_stall is None
    assert not ingest_ray.judged_waits([1.0, 1.0, 0.0, 0.0, 0.0], 1, train).ahead
    assert ingest_ray.judged_waits([], 2, train) is None
    assert not ingest_ray.judged_waits([1.0] * 5, 1, _cfg("train.next_epoch_at=1").train).warm
    # an early wait whose second half still stalls, or a wait spread over the epoch, is Ray Data's rate
    for early, late in ((8.6, 0.4), (4.5, 0.9)):
        assert "Ray Data is the weakest link" in verdict(starved, "GPU", "ray_data", ray_waits=waits(0.0, early, late))
    assert verdict(busy, "GPU", "ray_data").startswith("compute-bound: the GPU is the weakest link")


def test_two_nodes_decode_off_the_accelerator_node(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tests/ingest_two_node_run.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"no result (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["ok"], result
    assert result["worker_nodes"] == [result["accelerator_node"]]
    assert result["decode_nodes"] and result["accelerator_node"] not in result["decode_nodes"]
    assert set(result["decode_nodes"]) <= {result["cpu_node"]}


def test_a_runs_figures_cover_all_its_epochs_not_the_last():
    """A review's 4-epoch ray_data run: 272/427/771/1,843 img/s. The last epoch, fed by the one
    before, had stood for the run (1,843 img/s, compute-bound) where it averaged ~509."""
    from stages.feed.meters import over_epochs

    rows = [{"epoch": e, "wall_s": w, "images_per_s": r, "stall_fraction": st, "device_utilisation": 1 - st,
             "verdict": v} for e, w, r, st, v in [(1, 4.0, 272, 0.57, "input-bound: Ray Data's start"),
                                                  (2, 2.5, 427, 0.58, "input-bound: Ray Data's start ahead"),
                                                  (3, 1.4, 771, 0.18, "input-bound: Ray Data is"),
                                                  (4, 0.65, 1843, 0.01, "compute-bound: the CPU")]]
    run = over_epochs(rows)
    images = 272 * 4.0 + 427 * 2.5 + 771 * 1.4 + 1843 * 0.65
    assert run["images_per_s"] == pytest.approx(images / 8.55)
    assert run["stall_fraction"] == pytest.approx((0.57 * 4 + 0.58 * 2.5 + 0.18 * 1.4 + 0.01 * 0.65) / 8.55)
    # the kind of most of the wall (input-bound: 7.9 of 8.55 s), in its median epoch's words (epoch 2)
    assert run["verdict"] == "input-bound: Ray Data's start ahead" and run["verdict_epochs"] == [1, 2, 3]
    assert over_epochs([])["verdict"] is None
