"""Runs that cannot lie (issue 14, items 1, 6, 7): fingerprinted resume, plain-data checkpoints,
and a shard cache that checks content, not size.

One short TorchTrainer run (the module fixture) and one refused resume; the rest reuses its state.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from stages.model import checkpoint_io
from stages.model import publish
from stages.train import stage as train
from stages.feed import streaming
from stages.common import fingerprint, storage
from workflow.__main__ import main
from stages.common.config import ConfigError, S3Config, load_config, section_dict
from tests.conftest import REPO, demo_dataset, redigest

SMOKE = REPO / "configs/smoke.yaml"
# Ray Train's host and its checkpoint folders (ray/train/checkpoint-*): two workers
BASE = ["train.epochs=2", "train.batch_size=8", "train.max_steps=2", "train.shuffle_buffer_rows=16",
        "train.max_failures=0", "etl.shard_max_rows=40", "train.num_workers=2"]


def _cfg(*extra: str):
    return load_config(SMOKE, BASE + list(extra))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, ray_session):
    return demo_dataset(tmp_path_factory.mktemp("integrity"), _cfg().etl, images=100, seed=2)


@pytest.fixture(scope="module")
def first_run(dataset, tmp_path_factory):
    cfg = _cfg()
    out = tmp_path_factory.mktemp("run") / "train"
    return train.run(cfg.train, dataset, str(out), seed=cfg.run.seed, ray_cfg=cfg.ray)


def _checkpoints(run) -> list[Path]:
    found = sorted((Path(run.path) / "ray/train").glob("checkpoint-*"))
    assert found, "the run left no checkpoints"
    return found


def _published(run) -> tuple[bytes, bytes]:
    out = Path(run.path)
    return (out / "model.pt").read_bytes(), (out / "manifest.json").read_bytes()


@pytest.mark.parametrize("change", ["train.lr=0.2", "train.batch_size=4", "train.epochs=3",
                                    "train.model=resnet18", "run.seed=7"])
def test_rerun_with_another_config_is_refused_with_exit_2(first_run, dataset, capsys, change):
    before = _published(first_run)
    sets = [a for s in BASE + [change] for a in ("--set", s)]
    rc = main(["train", "--data", dataset.path, "--output", first_run.path, "--config", str(SMOKE), *sets])
    err = capsys.readouterr().err
    assert rc == 2, err
    key = change.split("=")[0].removeprefix("run.")
    assert key in err and "--overwrite" in err and "--output" in err, err
    assert _published(first_run) == before, "a refused run must not touch the published model"


def test_rerun_of_a_finished_train_hands_back_its_model_and_tracks_nothing_new(first_run, dataset):
    # It had restored the trainer, re-published the same model and registered it in MLflow again
    before = _published(first_run)
    sets = [a for s in BASE for a in ("--set", s)]
    assert main(["train", "--data", dataset.path, "--output", first_run.path, "--config", str(SMOKE), *sets]) == 0
    assert _published(first_run) == before
    # as a user runs it: nothing to train, so no Ray starts (`raymill train` starts it beside torch's
    # import only for an output that holds no model yet)
    done = subprocess.run([sys.executable, "-m", "workflow", "train", "--data", dataset.path, "--output",
                           first_run.path, "--config", str(SMOKE), *sets], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "already holds this run's model" in done.stdout + done.stderr, done.stderr
    assert "[raymill] ray:" not in done.stdout + done.stderr, "a reused model started Ray"
    # tracking is on by default: no MLflow run finished, no model version registered (tracking.json)
    assert not (Path(first_run.path) / "tracking.json").exists()


def test_resumable_keys_resume_and_other_data_is_refused(first_run, dataset):
    cfg = _cfg()
    state = str(Path(first_run.path) / "ray")
    made = fingerprint.for_train(section_dict(cfg.train), cfg.run.seed, dataset.manifest)
    ops = cfg.train.model_copy(update={"max_failures": 5, "num_to_keep": 4, "decode_threads": 1,
                                       "cache_dir": "/elsewhere", "num_workers": 1})
    same = fingerprint.for_train(section_dict(ops), cfg.run.seed, dataset.manifest)
    assert same.digest == made.digest
    assert fingerprint.guard(state, "train", same) is True  # resumes: only operational keys changed
    # Same config, other data content (one shard's bytes differ): refused, and the message says so.
    manifest = json.loads(json.dumps(dataset.manifest))
    manifest["shards"][0]["sha256"] = "0" * 64
    other = fingerprint.for_train(section_dict(cfg.train), cfg.run.seed, manifest)
    with pytest.raises(ConfigError, match=r"data: '.*' -> '.*'.*--overwrite"):
        fingerprint.guard(state, "train", other)


def test_overwrite_discards_state_and_unfingerprinted_state_is_refused(first_run, tmp_path):
    copy = tmp_path / "ray"
    shutil.copytree(Path(first_run.path) / "ray", copy)
    stored = json.loads((copy / "train.fingerprint.json").read_text())
    changed = fingerprint.compute({**stored["parts"], "seed": 99})
    with pytest.raises(ConfigError, match="seed: 0 -> 99"):
        fingerprint.guard(str(copy), "train", changed)
    assert fingerprint.guard(str(copy), "train", changed, overwrite=True) is False
    assert not (copy / "train").exists()
    assert json.loads((copy / "train.fingerprint.json").read_text())["digest"] == changed.digest
    # State from before fingerprints (or whose file was deleted): nobody can say what made it.
    (copy / "train").mkdir()
    (copy / "train/checkpoint-e001-s000000").mkdir()
    (copy / "train.fingerprint.json").unlink()
    with pytest.raises(ConfigError, match="records no fingerprint"):
        fingerprint.guard(str(copy), "train", changed)


def test_a_killed_runs_state_made_by_another_config_is_refused_before_ray(first_run, dataset, tmp_path):
    """`raymill train` into an unpublished output whose run state another config made: exit 2 before
    Ray's start and MLflow's store (the stage's guard had said it after both, 12 s in)."""
    out = tmp_path / "train"
    shutil.copytree(first_run.path, out)
    (out / "manifest.json").unlink()  # killed before its publish: the state alone
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "workflow", "train", "--data", dataset.path, "--output", str(out),
                          "--config", str(SMOKE), *[a for kv in BASE for a in ("--set", kv)], "--set", "train.lr=0.2"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 2 and "holds run state made with another config" in run.stderr, run.stderr
    assert "lr" in run.stderr and "[raymill] ray:" not in run.stderr and "tracking:" not in run.stderr, run.stderr


def test_a_run_whose_data_was_replaced_is_not_told_to_resume(dataset):
    """A train that failed because an ETL --overwrite replaced its data had said "rerun the same
    command to resume", which its fingerprint guard then refused."""
    from stages.common.artifacts import Artifact

    assert train._data_replaced(dataset, None) is None
    started_on = Artifact("etl", dataset.path, {**dataset.manifest, "run_id": "20990101T000000-abcdef"})
    assert "was replaced during the run" in train._data_replaced(started_on, None)


def test_checkpoints_carry_the_fingerprint_and_a_foreign_one_is_refused(first_run):
    stored = json.loads((Path(first_run.path) / "ray/train.fingerprint.json").read_text())
    foreign = fingerprint.compute({**stored["parts"], "train": {**stored["parts"]["train"], "lr": 0.2}})
    for folder in _checkpoints(first_run):
        meta = checkpoint_io.read_meta(folder, str(folder), stored)
        assert meta["fingerprint"]["digest"] == stored["digest"]
        with pytest.raises(checkpoint_io.CheckpointRefused, match=r"train.lr: 0.05 -> 0.2"):
            checkpoint_io.read_meta(folder, str(folder), foreign.as_dict())
        # every file loads as plain data (model, SGD state, LR schedule, RNG states)
        state = checkpoint_io.load_plain(folder / "state.pt")
        assert set(state) == {"model", "optimizer", "schedule", "scaler"}
        for rng in folder.glob("rng-rank*.pt"):
            assert set(checkpoint_io.load_plain(rng)) >= {"torch", "numpy", "python"}


class _Payload:
    """Pickled, this runs code when loaded: what a writer to a shared bucket could plant."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickle_payload_is_refused_on_resume_and_export(first_run, dataset, tmp_path):
    import ray.train

    marker = tmp_path / "payload-ran"
    folders = _checkpoints(first_run)
    saved = {p: p.read_bytes() for f in folders for p in [f / "state.pt", *f.glob("rng-rank*.pt"),
                                                          *f.glob("files-rank*.json")]}
    manifest = Path(first_run.path) / "manifest.json"
    saved[manifest] = manifest.read_bytes()
    manifest.unlink()  # unpublished, as after a crash: the rerun resumes from the checkpoints
    try:
        for path in [p for p in saved if p.suffix == ".pt"]:
            torch.save({"model": _Payload(marker), "optimizer": {}, "schedule": {}, "scaler": None,
                        "torch": _Payload(marker)}, path)
        with pytest.raises(checkpoint_io.CheckpointRefused, match="is damaged: .* does not match the sha256"):
            publish.read_checkpoint(ray.train.Checkpoint.from_directory(str(folders[-1])))
        for folder in folders:  # a writer who also rewrote the digests: refused by the unpickler's rule
            redigest(folder)
        with pytest.raises(checkpoint_io.CheckpointRefused, match="not plain tensors"):
            publish.read_checkpoint(ray.train.Checkpoint.from_directory(str(folders[-1])))
        cfg = _cfg()
        with pytest.raises(train.TrainError) as refused:
            train.run(cfg.train, dataset, first_run.path, seed=cfg.run.seed, ray_cfg=cfg.ray)
        assert "not plain tensors" in str(refused.value) and "--overwrite" in str(refused.value), \
            str(refused.value)
    finally:
        for path, payload in saved.items():
            path.write_bytes(payload)
    assert not marker.exists(), "a checkpoint file ran code on load"
    assert all(checkpoint_io.damage(folder) is None for folder in folders)  # the digests match again


def test_cache_refetches_a_same_size_file_with_wrong_content(s3_bucket, tmp_path):
    import s3fs

    endpoint, bucket = s3_bucket
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    good = os.urandom(4096)
    fs.pipe_file(f"{bucket}/shard.tar", good)
    ref = streaming.ShardRef(f"s3://{bucket}/shard.tar", "tar", 1, len(good), storage.sha256_bytes(good))
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    planted = cache_dir / f"{ref.sha256}.tar"
    planted.write_bytes(bytes(len(good)))  # right name, right size, wrong content
    cache = streaming.ShardCache(str(cache_dir), 1e9, S3Config(endpoint_url=endpoint))
    assert Path(cache.local_path(ref)).read_bytes() == good
    assert (cache.hits, cache.misses) == (0, 1)
    assert Path(cache.local_path(ref)).read_bytes() == good and cache.hits == 1  # verified once: a hit
    # A wrong object in the bucket itself is refused, not cached.
    fs.pipe_file(f"{bucket}/shard.tar", bytes(len(good)))
    planted.unlink()
    with pytest.raises(ValueError, match="fails its checksum") as refused:
        streaming.ShardCache(str(cache_dir), 1e9, S3Config(endpoint_url=endpoint)).local_path(ref)
    assert not planted.exists()
    # the train stage says this, not "rerun the same command to resume" (a rerun reads the same bytes)
    assert checkpoint_io.refusal_in(refused.value) == str(refused.value)
    remote = RuntimeError(f"ray::RayTrainWorker\n{checkpoint_io.SHARD_REFUSED}: {refused.value}")
    assert checkpoint_io.refusal_in(type("E", (Exception,), {"worker_failures": {0: remote}})()) == str(refused.value)


def test_fingerprint_guard_on_s3(s3_bucket):
    import s3fs

    endpoint, bucket = s3_bucket
    s3 = S3Config(endpoint_url=endpoint)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    made, other = fingerprint.compute({"train": {"lr": 0.05}}), fingerprint.compute({"train": {"lr": 0.2}})
    state = f"s3://{bucket}/run/ray"
    assert fingerprint.guard(state, "train", made, s3) is False  # fresh: records the fingerprint
    fs.pipe_file(f"{bucket}/run/ray/train/checkpoint-e001-s000000/meta.json", b"{}")
    assert fingerprint.guard(state, "train", made, s3) is True
    with pytest.raises(ConfigError, match=r"train.lr: 0.05 -> 0.2"):
        fingerprint.guard(state, "train", other, s3)
    assert fingerprint.guard(state, "train", other, s3, overwrite=True) is False
    assert not fs.exists(f"{bucket}/run/ray/train/checkpoint-e001-s000000/meta.json")
    assert json.loads(fs.cat_file(f"{bucket}/run/ray/train.fingerprint.json"))["digest"] == other.digest


@pytest.mark.parametrize("lr, workers", [("1e12", "1"), ("1e5", "2")])
def test_a_diverging_run_fails_naming_the_fix_and_publishes_nothing(dataset, tmp_path, lr, workers):
    # 1e12: the loss is NaN in epoch 1 (once an AttributeError); 1e5: the loss stays finite but the
    # weights do not (val_loss NaN), and that epoch's checkpoint was published as the model, exit 0.
    # The check is the loop's; one case runs in a Tune trial actor (1 worker), one on Ray Train.
    cfg = _cfg(f"train.lr={lr}", "train.epochs=3", "train.max_steps=4", f"train.num_workers={workers}")
    with pytest.raises(train.TrainError, match="loss became NaN/inf .* Lower train.lr"):
        train.run(cfg.train, dataset, str(tmp_path / "out"), seed=cfg.run.seed, ray_cfg=cfg.ray)
    assert not (tmp_path / "out" / "manifest.json").exists() and not (tmp_path / "out" / "model.pt").exists()


@pytest.mark.parametrize("workers", ["2", "1"])  # 1: one Tune trial actor hosts it (stages/train/solo.py)
def test_ctrl_c_during_training_says_interrupted_and_exits_130(dataset, tmp_path, workers):
    # Train V2's own SIGINT handler aborts the run and the driver's ray.get raises SystemExit(1):
    # the CLI had exited 1 printing nothing. Tune's handler ends its run and advised Tuner.restore().
    import signal
    import subprocess
    import time

    from tests.conftest import interruptible

    proc = subprocess.Popen(interruptible("workflow", "train", "--data", dataset.path, "--output",
                                          str(tmp_path / "out"), "--config", str(SMOKE), "--set", "train.epochs=500",
                                          "--set", f"train.num_workers={workers}"),
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    lines, deadline = [], time.time() + 180
    while time.time() < deadline and not any("epoch 1/500" in line for line in lines):
        lines.append(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, "".join(lines)[-2000:] + out[-2000:]
    assert "raymill train: interrupted; rerun the same command" in out and "Tuner.restore" not in out
    after = out[out.index("raymill train: interrupted"):]
    assert "train: epoch" not in after, after[:2000]  # Ray's last worker lines came before it


def test_an_output_that_is_a_file_or_another_tools_is_refused_before_anything_starts(dataset, tmp_path, capsys):
    sets = [a for s in BASE for a in ("--set", s)]
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "manifest.json").write_text('{"kind": "someone.else"}')
    for out in (tmp_path / "a-file", tmp_path / "theirs"):
        rc = main(["train", "--data", dataset.path, "--output", str(out), "--config", str(SMOKE), *sets])
        assert rc == 2, capsys.readouterr().err
    # nothing written into the other tool's folder: not even MLflow's store, which opens beside Ray's start
    assert sorted(p.name for p in (tmp_path / "theirs").iterdir()) == ["manifest.json"]
    assert (tmp_path / "a-file").read_text() == "x"


def test_a_best_checkpoint_without_a_test_score_is_scored_while_its_output_is_unpublished(smoke_run, tmp_path):
    """A search ranked by val_loss whose best epoch was no best val_acc had no test score in its
    checkpoint; the driver's fallback loaded the model through the published-output check, which
    refused the folder (run state, no manifest yet): exit 2, and every rerun the same."""
    from stages.common.artifacts import load_artifact

    assert smoke_run.returncode == 0, smoke_run.stderr[-3000:]
    cfg = load_config(REPO / "configs/smoke.yaml")
    data = load_artifact(str(smoke_run.run_dir / "etl"), "etl")
    out = tmp_path / "out"
    out.mkdir()
    (out / "ray").mkdir()  # the search's run state beside the model being published
    for name in ("model.pt", "model.json"):
        shutil.copy(smoke_run.run_dir / "train" / name, out / name)
    loop = {"shards": train.check_data(cfg.train, data, None), "s3": None,
            "raw": storage.stored_raw(data.manifest, cfg.train.data_format)}
    scored = publish.test_metrics({"val_loss": 1.0}, str(out), loop, str(tmp_path / "cache"))
    assert scored["where"] == "driver" and scored["rows"] == sum(r["rows"] for r in loop["shards"]["test"])
    assert scored["acc"] == pytest.approx(json.loads((smoke_run.run_dir / "train" / "manifest.json").read_text())
                                          ["metrics"]["test_acc"]), scored


def test_mid_epoch_checkpoints_rank_last_and_are_never_handed_on_as_an_epoch():
    """A mid-epoch checkpoint carries the previous epoch's validation metrics beside later weights:
    tied with that epoch's checkpoint, retention could evict the epoch's own (a val_loss search lost
    its best epoch), and a val_acc tie could publish its weights as the epoch's model."""
    import types

    from stages.train import checkpointing

    val = {"val_acc": 0.5, "val_loss": 1.2}
    assert checkpointing.scores(val, 0) == {"score_val_acc": 0.5, "score_val_loss": 1.2}
    mid = checkpointing.scores(val, 7)
    assert mid["score_val_acc"] < 0 and mid["score_val_loss"] > 1e29
    end, later = object(), object()
    result = types.SimpleNamespace(best_checkpoints=[(later, {"val_acc": 0.5, "position_step": 7, "epoch": 2}),
                                                     (end, {"val_acc": 0.5, "position_step": 0, "epoch": 1})],
                                   checkpoint=later, metrics={})
    assert publish._best(result)[0] is end
