"""train.init_from and the fine-tuning schedule (train.freeze_epochs, train.backbone_lr_scale).

Real files and real models, small: torchvision-format state dicts written by the in-repo ResNets
(whose keys are checked against torchvision's own list below), a .safetensors file, raymill
output folders written by stages.model.publish. The loop-level tests run the one training loop
(stages.train.loop) in this process through a host of their own (stages.train.run_hooks' interface),
without a Ray Train run; one CLI test starts from the smoke run's model.
"""
from __future__ import annotations

import io
import json
import logging
import pickle
import shutil
import types
from pathlib import Path

import pytest
import torch

from stages.common.config import ConfigError, TrainConfig, load_config
from stages.model import checkpoint_io, init_source, init_weights, publish
from stages.model.zoo import build_model
from stages.train import finetune
from stages.train import stage as train
from stages.train.loop import train_loop
from tests.conftest import REPO, demo_dataset

CLASSES = ["bird", "cat", "dog"]


def _torchvision_resnet18_keys() -> list[str]:
    """torchvision.models.resnet18().state_dict() keys, in order (torchvision 0.2x)."""
    bn = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    keys = ["conv1.weight", *[f"bn1.{b}" for b in bn]]
    for layer in (1, 2, 3, 4):
        for block in (0, 1):
            p = f"layer{layer}.{block}."
            keys += [p + "conv1.weight", *[p + f"bn1.{b}" for b in bn], p + "conv2.weight", *[p + f"bn2.{b}" for b in bn]]
            if layer > 1 and block == 0:
                keys += [p + "downsample.0.weight", *[p + f"downsample.1.{b}" for b in bn]]
    return keys + ["fc.weight", "fc.bias"]


def test_in_repo_resnets_carry_torchvisions_keys_and_shapes():
    with torch.device("meta"):
        r18, r50 = build_model("resnet18", 1000).state_dict(), build_model("resnet50", 1000).state_dict()
    assert list(r18) == _torchvision_resnet18_keys() and len(r18) == 122  # torchvision's count
    assert len(r50) == 320  # torchvision's resnet50 state dict
    shapes = {k: tuple(v.shape) for k, v in {**r18, **{f"50:{k}": v for k, v in r50.items()}}.items()}
    assert shapes["conv1.weight"] == (64, 3, 7, 7) and shapes["fc.weight"] == (1000, 512)
    assert shapes["layer2.0.downsample.0.weight"] == (128, 64, 1, 1) and shapes["layer4.1.conv2.weight"] == (512, 512, 3, 3)
    assert shapes["50:layer1.0.conv3.weight"] == (256, 64, 1, 1) and shapes["50:fc.weight"] == (1000, 2048)
    assert shapes["50:layer1.0.downsample.0.weight"] == (256, 64, 1, 1)


def _imagenet_file(tmp_path: Path, arch: str, suffix: str = ".pth") -> tuple[Path, dict]:
    torch.manual_seed(1)
    state = build_model(arch, 1000).state_dict()  # a torchvision-format ImageNet state dict
    if suffix.startswith("-old"):  # torchvision's files from before torch 0.4.1: no BatchNorm step counters
        state = {k: v for k, v in state.items() if not k.endswith(".num_batches_tracked")}
    path = tmp_path / f"{arch}-imagenet{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path, state


def _backbone_equal(model: torch.nn.Module, state: dict) -> bool:
    return all(torch.equal(v, state.get(k, torch.tensor(0))) for k, v in model.state_dict().items()
               if not k.startswith("fc."))


@pytest.mark.parametrize("arch,suffix", [("resnet18", ".pth"), ("resnet50", ".pt"), ("resnet18", ".safetensors"),
                                         ("resnet18", "-old.pth")])
def test_torchvision_format_weights_load_strictly_with_a_new_head(tmp_path, arch, suffix):
    path, state = _imagenet_file(tmp_path, arch, suffix)
    plan = init_weights.prepare(TrainConfig(model=arch, init_from=str(path)), CLASSES)
    r = plan.record
    assert r["head"] == "replaced" and r["kind"] == ("safetensors" if suffix == ".safetensors" else "torch")
    assert r["sha256"] == init_weights.source_sha256(str(path)) and r["bytes"] == path.stat().st_size
    # a bare ResNet state dict: torchvision's ImageNet normalisation, the config's left unset
    assert tuple(plan.train.augment.mean) == init_weights.IMAGENET_MEAN and r["normalisation"] == "init"
    torch.manual_seed(0)
    model = build_model(arch, len(CLASSES))
    fresh_head = model.fc.weight.detach().clone()
    init_weights.apply(model, plan.payload, r, arch)
    assert _backbone_equal(model, state) and torch.equal(model.fc.weight, fresh_head)  # the run's seeded head


def _raymill_folder(tmp_path: Path, name: str, classes: list[str], width: int = 8, arch: str = "small_cnn",
                    mean=(0.1, 0.2, 0.3)) -> tuple[Path, dict]:
    torch.manual_seed(2)
    state = build_model(arch, len(classes), width).state_dict()
    info = {"architecture": arch, "width": width, "dropout": 0.0, "classes": classes, "image_size": 32,
            "resize": "crop", "mean": list(mean), "std": [0.3, 0.3, 0.3]}
    publish.save_model(str(tmp_path / name), state, info)
    return tmp_path / name, state


def test_a_raymill_folder_keeps_its_head_for_the_same_classes_and_replaces_it_otherwise(tmp_path):
    folder, state = _raymill_folder(tmp_path, "run", CLASSES)
    cfg = TrainConfig(model="small_cnn", width=8, init_from=str(folder))
    same = init_weights.prepare(cfg, CLASSES)
    assert same.record["head"] == "kept" and list(same.train.augment.mean) == [0.1, 0.2, 0.3]
    model = build_model("small_cnn", 3, 8)
    init_weights.apply(model, same.payload, same.record, "small_cnn")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # the head too
    assert init_weights.prepare(cfg, ["x", "y", "z"]).record["head"] == "replaced"  # same count, other names
    assert init_weights.prepare(cfg, ["bird", "cat"]).record["head"] == "replaced"  # another count
    # mean set by the user wins; std, unset, follows model.json
    user = load_config(None, ["train.model=small_cnn", "train.width=8", f"train.init_from={folder}",
                              "train.augment.mean=[0.4,0.4,0.4]"]).train
    chosen = init_weights.prepare(user, CLASSES).train.augment
    assert list(chosen.mean) == [0.4, 0.4, 0.4] and list(chosen.std) == [0.3, 0.3, 0.3]
    with pytest.raises(ConfigError, match="is a small_cnn model; set train.model=small_cnn"):
        init_weights.prepare(TrainConfig(model="resnet18", init_from=str(folder)), CLASSES)
    init_source.check(str(folder), models=("small_cnn",), width=8)
    # before Ray, by its model.json: another architecture or width (the shapes said it after Ray's start)
    with pytest.raises(ConfigError, match="is a small_cnn model; set train.model=small_cnn"):
        init_source.check(str(folder), models=("resnet18",), width=8)
    with pytest.raises(ConfigError, match="or start resnet18 from other weights"):  # a search over both: each must fit
        init_source.check(str(folder), models=("small_cnn", "resnet18"), width=8)
    with pytest.raises(ConfigError, match="is a small_cnn of width 8; set train.width=8"):
        init_source.check(str(folder), models=("small_cnn",), width=16)
    named = folder.rename(tmp_path / "run.ckpt")  # an output folder whose name says "torch file"
    init_source.check(str(named))
    assert init_weights.prepare(cfg.model_copy(update={"init_from": str(named)}), CLASSES).record["kind"] == "raymill"
    folder = named.rename(folder)
    (folder / "model.pt").write_bytes((folder / "model.pt").read_bytes() + b"x")
    for check in (lambda: init_weights.prepare(cfg, CLASSES), lambda: init_source.check(str(folder))):
        with pytest.raises(ConfigError, match="does not match its model.json's weights_sha256"):
            check()
    (folder / "model.pt").unlink()
    with pytest.raises(ConfigError, match=r"the folder's model.pt '.*' does not exist"):
        init_source.check(str(folder))


def test_a_wrong_key_a_wrong_shape_and_another_architecture_are_refused_naming_the_key(tmp_path):
    torch.manual_seed(0)
    state = build_model("small_cnn", 3, 8).state_dict()
    renamed = {("features.0.kernel" if k == "features.0.weight" else k): v for k, v in state.items()}
    torch.save(renamed, tmp_path / "renamed.pt")
    cfg = TrainConfig(model="small_cnn", width=8)
    with pytest.raises(ConfigError, match=r"missing keys features\.0\.weight; unexpected keys features\.0\.kernel"):
        init_weights.prepare(cfg.model_copy(update={"init_from": str(tmp_path / "renamed.pt")}), CLASSES)
    torch.save(state, tmp_path / "w8.pt")
    with pytest.raises(ConfigError, match=r"features\.0\.weight \(8, 3, 3, 3\) vs \(16, 3, 3, 3\).*train\.width"):
        init_weights.prepare(TrainConfig(model="small_cnn", width=16, init_from=str(tmp_path / "w8.pt")), CLASSES)
    with pytest.raises(ConfigError, match=r"does not fit train.model=resnet18: missing keys conv1.weight"):
        init_weights.prepare(TrainConfig(model="resnet18", init_from=str(tmp_path / "w8.pt")), CLASSES)
    torch.save({f"model.{k}": v for k, v in state.items()}, tmp_path / "lightning.pt")  # self.model's keys
    with pytest.raises(ConfigError, match=r"every key carries the prefix 'model\.'.*model\.model\.state_dict\(\)"):
        init_weights.prepare(cfg.model_copy(update={"init_from": str(tmp_path / "lightning.pt")}), CLASSES)
    torch.save({f"model.encoder.{k}": v for k, v in state.items()}, tmp_path / "deep.pt")  # two levels
    with pytest.raises(ConfigError, match=r"prefix 'model\.encoder\.'.*model\.model\.encoder\.state_dict\(\)"):
        init_weights.prepare(cfg.model_copy(update={"init_from": str(tmp_path / "deep.pt")}), CLASSES)
    diverged = {k: v.clone() for k, v in state.items()}
    diverged["features.0.weight"][0, 0, 0, 0] = float("nan")  # had passed, then failed epoch 1 as "lower train.lr"
    torch.save(diverged, tmp_path / "nan.pt")
    for check in (lambda c: init_weights.prepare(c, CLASSES), lambda c: init_weights.check_backbone(c, ["small_cnn"])):
        with pytest.raises(ConfigError, match=r"holds NaN or inf values in features\.0\.weight"):
            check(cfg.model_copy(update={"init_from": str(tmp_path / "nan.pt")}))


def test_checkpoints_and_wrapped_keys_are_unwrapped_to_the_same_weights(tmp_path):
    """A training checkpoint (weights beside optimizer state and an epoch), DDP's and torch.compile's
    key prefixes: each starts from exactly the weights inside, and the record says what was taken."""
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, 3, 32, 32)).sum().backward()
    opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    files = {"lightning.ckpt": {"state_dict": state, "epoch": 3, "optimizer_states": [opt.state_dict()]},
             "tutorial.tar": {"model_state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3,
                              "optimizer_state_dict": opt.state_dict(), "loss": 0.5},
             "compiled-ddp.pt": {f"_orig_mod.module.{k}": v for k, v in state.items()}}
    expected = {"lightning.ckpt": ["the checkpoint's 'state_dict' entry"],
                "tutorial.tar": ["the checkpoint's 'model_state_dict' entry", "the 'module.' prefix of every key"],
                "compiled-ddp.pt": ["the '_orig_mod.' prefix of every key", "the 'module.' prefix of every key"]}
    for name, content in files.items():
        torch.save(content, tmp_path / name)
        init_source.check(str(tmp_path / name))
        plan = init_weights.prepare(TrainConfig(model="small_cnn", width=8, init_from=str(tmp_path / name)), CLASSES)
        assert plan.record["unwrapped"] == expected[name], name
        assert publish.init_lineage({"init": {"record": plan.record}})["lineage"]["init"]["unwrapped"] == expected[name]
        # the workers get the weights alone, not the optimizer state beside them
        assert plan.record["bytes"] == (tmp_path / name).stat().st_size >= len(plan.payload), name
        assert "shipped" in plan.record or "optimizer" not in str(content.keys()), name
        fresh = build_model("small_cnn", 3, 8)
        init_weights.apply(fresh, plan.payload, plan.record, "small_cnn")
        assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items() if not k.startswith("fc.")), name
    (tmp_path / "weights.data").write_bytes((tmp_path / "lightning.ckpt").read_bytes())
    with pytest.raises(ConfigError, match=r"lies under a file.*\.ckpt"):
        init_source.check(str(tmp_path / "weights.data"))
    with pytest.raises(ConfigError, match=r"a part of the path .* is a file, not a folder; check the path"):
        init_source.check(str(tmp_path / "weights.data" / "w.pt"))
    torch.save({"optimizer": opt.state_dict(), "epoch": 3}, tmp_path / "optimizer-only.pt")
    with pytest.raises(ConfigError, match=r"nor a checkpoint with one under state_dict.*keys: optimizer, epoch"):
        init_weights.prepare(TrainConfig(model="small_cnn", width=8, init_from=str(tmp_path / "optimizer-only.pt")),
                             CLASSES)


class Payload:
    """Anything that is not a tensor: unpickling it would import and run code."""


def test_files_that_need_unpickling_or_are_unreadable_or_missing_are_refused(tmp_path):
    buf = io.BytesIO()
    torch.save({"conv1.weight": torch.zeros(1), "extra": Payload()}, buf)
    (tmp_path / "custom.pth").write_bytes(buf.getvalue())
    (tmp_path / "plain.pth").write_bytes(pickle.dumps({"conv1.weight": Payload()}))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "empty.pt").write_bytes(b"")
    cfg = TrainConfig(model="small_cnn", width=8)
    (tmp_path / "photo.pth").write_bytes(b"\xff\xd8\xff\xe0" + b"\0" * 64)  # a JPEG named .pth
    whole = io.BytesIO()
    torch.save(build_model("small_cnn", 3, 8).state_dict(), whole)
    (tmp_path / "cut.pth").write_bytes(whole.getvalue()[:len(whole.getvalue()) // 2])  # a half-copied download
    from safetensors.torch import save as save_safetensors

    tensors = save_safetensors(build_model("small_cnn", 3, 8).state_dict())
    (tmp_path / "cut.safetensors").write_bytes(tensors[:-100])
    for name, fragment in [("custom.pth", "not plain tensors"), ("plain.pth", "a pickle that torch.save did not write"),
                           ("cut.pth", r"is incomplete \(its zip archive has no readable directory"),
                           ("cut.safetensors", r"is incomplete \(\d+ bytes, where its header describes \d+\)"),
                           ("junk.safetensors", "not a readable .safetensors"), ("empty.pt", "not a readable torch.save"),
                           ("photo.pth", r"neither the zip archive torch.save writes nor a pickle: it starts with"),
                           ("missing.pth", "does not exist"), ("no-folder", "does not exist")]:
        with pytest.raises(ConfigError, match=fragment):
            init_weights.prepare(cfg.model_copy(update={"init_from": str(tmp_path / name)}), CLASSES)
        if fragment != "not plain tensors":  # the torch-free preflight refuses the same, before Ray starts
            with pytest.raises(ConfigError, match=fragment):
                init_source.check(str(tmp_path / name))
    init_source.check(str(tmp_path / "custom.pth"))  # only torch's loader can tell; preflight lets it by


def test_a_model_in_a_deployed_form_is_refused_naming_the_folder_to_start_from(tmp_path):
    """An export (its folder, its ONNX file, a TorchScript program) or an MLflow model is not weights:
    each is named for what it is, with the path to start from (they had been "does not exist",
    "lies under a file" and torch's weights_only error)."""
    torch.jit.save(torch.jit.script(build_model("small_cnn", 3, 8)), str(tmp_path / "model.pt"))
    export = tmp_path / "exported"
    (export / "raymill/1").mkdir(parents=True)
    (export / "raymill/1/model.onnx").write_bytes(b"\x08\x08")
    (export / "manifest.json").write_text(json.dumps({"kind": "raymill.export", "inputs": {"model": "/runs/a/train"}}))
    mlflow_model = tmp_path / "mlflow-model"
    (mlflow_model / "artifacts").mkdir(parents=True)
    (mlflow_model / "MLmodel").write_text("flavors: {}")
    (mlflow_model / "artifacts/model.json").write_text("{}")
    for uri, fragment in [(tmp_path / "model.pt", "is a TorchScript program"),
                          (export / "raymill/1/model.onnx", "is an ONNX graph"),
                          (export, "is a raymill export, not weights; .* \\('/runs/a/train'\\)"),
                          (mlflow_model, f"is an MLflow model; pass the raymill model inside it, '{mlflow_model}/artifacts'")]:
        with pytest.raises(ConfigError, match=fragment):
            init_source.check(str(uri))


def test_a_fine_tuning_run_has_two_groups_and_a_loaded_optimiser_keeps_the_backbone_scale():
    cfg = TrainConfig(model="small_cnn", width=8, backbone_lr_scale=0.1, lr=0.2)
    model = build_model("small_cnn", 3, 8)
    opt = finetune.optimizer(cfg, model)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.02])
    assert [len(g["params"]) for g in opt.param_groups] == [2, len(list(model.parameters())) - 2]  # fc first
    assert len(finetune.optimizer(TrainConfig(), model).param_groups) == 1  # not fine-tuning: as before
    from stages.train.loop import make_schedule
    schedule = make_schedule(opt, 0, 10)
    for _ in range(3):
        opt.step()
        schedule.step()
    explored = cfg.model_copy(update={"lr": 0.5})  # what PBT's explore does to a cloned trial
    finetune.apply_hyperparameters(explored, opt, schedule)
    factor = schedule.lr_lambdas[0](3)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5 * factor, 0.05 * factor])


# ---- the loop, hosted here ------------------------------------------------------------------------
class LocalHooks:
    """stages.train.run_hooks' interface in this process: rank 0 of 1 on the CPU; each report's
    checkpoint folder is copied to `store/<name>`; `resume_from` plays Ray's latest checkpoint."""

    rank, world, device = 0, 1, torch.device("cpu")

    def __init__(self, store: Path, resume_from: Path | None = None):
        self.store, self.resume_from, self.reports = store, resume_from, []

    def build(self, key, builder):
        return builder()

    def prepare_model(self, model):
        return model

    def report(self, metrics, folder, name=None):
        self.reports.append(metrics)
        if folder:
            shutil.copytree(folder, self.store / (name or f"checkpoint-{len(self.reports)}"))

    def get_checkpoint(self):
        import ray.train

        return ray.train.Checkpoint.from_directory(str(self.resume_from)) if self.resume_from else None


@pytest.fixture(scope="module")
def loop_setup(tmp_path_factory, ray_session):
    root = tmp_path_factory.mktemp("finetune")
    cfg = load_config(REPO / "configs/smoke.yaml", ["etl.shard_max_rows=40"])
    data = demo_dataset(root, cfg.etl, images=90, seed=3)
    source, state = _raymill_folder(root, "source", data.manifest["classes"], mean=(0.45, 0.45, 0.45))
    tcfg = cfg.train.model_copy(update={
        "init_from": str(source), "freeze_epochs": 1, "backbone_lr_scale": 0.5, "epochs": 2, "batch_size": 8,
        "max_steps": 4, "checkpoint_every_steps": 2, "decode_processes": 0, "shuffle_buffer_rows": 16})
    plan = train.check_init(tcfg, data, None)
    shards = train.check_data(tcfg, data, None)
    from stages.common.session import WorkerPlan

    workers = WorkerPlan(num_workers=1, min_workers=None, cpus_per_worker=1.0, gpus_per_worker=0.0, use_gpu=False,
                         data_reserved_cpus=0.0, total_cpus=1.0, decode_processes=0, torch_threads=1)
    loop = {**train.loop_config(plan.train, data, shards, 0, None, workers), **finetune.shipped(plan),
            "fingerprint": None, "tracking": None}
    return types.SimpleNamespace(root=root, loop=loop, state=state, plan=plan)


def _run(setup, store: Path, resume_from: Path | None = None) -> LocalHooks:
    store.mkdir()
    hooks = LocalHooks(store, resume_from)
    levels = {name: logging.getLogger(name).level for name in ("", "ray.train", "ray.tune")}
    threads = torch.get_num_threads()
    try:
        train_loop(setup.loop, hooks)
    finally:  # the loop sets up a Ray worker's process (root logger, torch threads): this one is pytest's
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        torch.set_num_threads(threads)
    return hooks


def _model(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "state.pt", weights_only=True)["model"]


def test_frozen_epochs_keep_the_backbone_bit_identical_and_a_resume_mid_freeze_is_byte_identical(loop_setup):
    full = _run(loop_setup, loop_setup.root / "full")
    names = sorted(p.name for p in (loop_setup.root / "full").iterdir())
    assert [n.split("-")[1:3] for n in names] == [["e000", "s000002"], ["e001", "s000000"], ["e001", "s000002"],
                                                  ["e002", "s000000"]], names
    frozen, done = _model(loop_setup.root / "full" / names[1]), _model(loop_setup.root / "full" / names[-1])
    source = loop_setup.state  # the raymill folder's weights, same classes: head kept, then trained
    backbone = [k for k in source if not k.startswith("fc.")]
    # after the frozen epoch: every backbone tensor, BatchNorm running stats included, bit-identical
    assert all(torch.equal(frozen[k], source[k]) for k in backbone)
    assert not torch.equal(frozen["fc.weight"], source["fc.weight"])  # the head trained
    assert not all(torch.equal(done[k], source[k]) for k in backbone)  # epoch 2 trains the backbone
    optimizer = torch.load(loop_setup.root / "full" / names[-1] / "state.pt", weights_only=True)["optimizer"]
    lrs = [g["initial_lr"] for g in optimizer["param_groups"]]
    assert lrs == pytest.approx([0.05, 0.025])  # smoke's lr; the backbone at 0.5 x
    # killed mid-freeze (after step 2 of epoch 1): resumed, the run ends byte-identical
    resumed = _run(loop_setup, loop_setup.root / "resumed", loop_setup.root / "full" / names[0])
    last = sorted((loop_setup.root / "resumed").iterdir())[-1]
    again = _model(last)
    assert all(torch.equal(again[k], done[k]) for k in done), "the resumed run trained differently"
    assert resumed.reports[-1]["val_loss"] == full.reports[-1]["val_loss"]


def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_resumes_byte_identically(loop_setup, caplog):
    """One flipped bit in the newest checkpoint's state.pt had been resumed silently into another
    model (exit 0); a cut-short one had failed every retry. Its digest names it, and the checkpoint
    before it resumes the run to the very same model."""
    full = loop_setup.root / "damage-full"
    _run(loop_setup, full)
    names = sorted(p.name for p in full.iterdir())
    done = _model(full / names[-1])
    state = full / names[2] / "state.pt"  # e001-s000002: the newest when killed there
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING)
    _run(loop_setup, loop_setup.root / "damage-resumed", full / names[2])
    again = _model(sorted((loop_setup.root / "damage-resumed").iterdir())[-1])
    assert all(torch.equal(again[k], done[k]) for k in done), "resumed from the damaged checkpoint"
    assert f"{full / names[2]} (damaged: state.pt does not match the sha256" in caplog.text, caplog.text
    assert f"resumed from {full / names[1]} (epoch 1, step 0) instead" in caplog.text, caplog.text
    for name in names[:2]:  # none whole before it either: refused, naming each, never loaded
        (full / name / "state.pt").write_bytes(state.read_bytes()[:1000])
    with pytest.raises(checkpoint_io.CheckpointRefused, match=r"no whole checkpoint to resume from: .*--overwrite"):
        _run(loop_setup, loop_setup.root / "damage-none", full / names[2])


def _cli_main(*args: str) -> int:
    from workflow.__main__ import main

    return main(list(args))


@pytest.mark.slow
def test_raymill_train_continues_from_a_run_and_exits_2_for_a_bad_init_file(smoke_run, ray_session, tmp_path, capsys):
    assert smoke_run.returncode == 0, smoke_run.stderr[-3000:]
    data, source = smoke_run.run_dir / "etl", smoke_run.run_dir / "train"
    common = ["--data", str(data), "--config", str(REPO / "configs/smoke.yaml"), "--set", "tracking.enabled=false"]
    torch.save({"conv1.weight": torch.zeros(1), "extra": Payload()}, tmp_path / "bad.pth")  # only torch can tell
    code = _cli_main("train", *common, "--output", str(tmp_path / "bad"), "--set", f"train.init_from={tmp_path / 'bad.pth'}")
    err = capsys.readouterr().err
    assert code == 2 and "train.init_from:" in err and "not plain tensors" in err, err
    assert not (tmp_path / "bad" / "ray").exists() and not (tmp_path / "bad" / "model.pt").exists()
    # another architecture's file, MLflow on: refused beside Ray's start, before MLflow's store (the
    # train stage had refused it 13 s later, leaving OUT/mlflow.db)
    torch.save(build_model("resnet18", 4).state_dict(), tmp_path / "r18.pth")
    code = _cli_main("train", *common[:-2], "--output", str(tmp_path / "other"), "--set", "tracking.enabled=true",
                     "--set", f"train.init_from={tmp_path / 'r18.pth'}")
    err = capsys.readouterr().err
    assert code == 2 and "does not fit train.model=small_cnn: missing keys features.0.weight" in err, err
    assert not (tmp_path / "other" / "mlflow.db").exists() and not (tmp_path / "other" / "ray").exists()
    out = tmp_path / "ft"
    assert _cli_main("train", *common, "--output", str(out), "--set", f"train.init_from={source}",
                     "--set", "train.freeze_epochs=1", "--set", "train.backbone_lr_scale=0.5",
                     "--set", "tracking.enabled=true") == 0
    theirs, mine = (json.loads((p / "model.json").read_text()) for p in (source, out))
    from mlflow import MlflowClient  # the mean/std training used are logged (train.augment's are as given)

    store = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    params = store.search_runs([e.experiment_id for e in store.search_experiments()])[0].data.params
    assert (params["init.mean"], params["init.std"]) == (str(theirs["mean"]), str(theirs["std"])), params
    init = mine["lineage"]["init"]
    assert init["sha256"] == theirs["weights_sha256"] and init["head"] == "kept" and init["kind"] == "raymill"
    assert (mine["mean"], mine["std"]) == (theirs["mean"], theirs["std"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"]["init_sha256"] == theirs["weights_sha256"] and manifest["init"]["head"] == "kept"
    fp = json.loads((out / "ray" / "train.fingerprint.json").read_text())
    assert fp["parts"]["init"]["sha256"] == theirs["weights_sha256"]


def test_weights_on_s3_load_and_a_missing_object_is_refused(s3_bucket, tmp_path):
    import s3fs

    from stages.common.config import S3Config

    endpoint, bucket = s3_bucket
    path, state = _imagenet_file(tmp_path, "resnet18")
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).put(
        str(path), f"{bucket}/models/r18.pth")
    s3 = S3Config(endpoint_url=endpoint)
    plan = init_weights.prepare(TrainConfig(model="resnet18", init_from=f"s3://{bucket}/models/r18.pth"), CLASSES, s3)
    assert plan.record["sha256"] == init_weights.source_sha256(str(path)) and plan.record["head"] == "replaced"
    with pytest.raises(ConfigError, match="does not exist"):
        init_weights.prepare(TrainConfig(model="resnet18", init_from=f"s3://{bucket}/models/none.pth"), CLASSES, s3)
    init_source.check(f"s3://{bucket}/models/r18.pth", s3)  # the torch-free preflight reads its first bytes
    for missing in ("models/none.pth", "models/run"):  # a file, a raymill folder
        with pytest.raises(ConfigError, match="does not exist"):
            init_source.check(f"s3://{bucket}/{missing}", s3)


def test_a_weights_file_is_hashed_once_until_it_changes(tmp_path):
    import hashlib
    import os

    weights = tmp_path / "w.pth"
    weights.write_bytes(b"a" * 64)
    first = init_weights.source_sha256(str(weights))
    assert first == hashlib.sha256(b"a" * 64).hexdigest()
    assert init_weights.source_sha256(str(weights)) == first and any(k[0] == str(weights) for k in init_source._HASHED)
    stat = weights.stat()
    weights.write_bytes(b"b" * 64)  # same size: the modification stamp tells them apart
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert init_weights.source_sha256(str(weights)) == hashlib.sha256(b"b" * 64).hexdigest()


def test_a_freeze_as_long_as_the_run_is_warned_of(caplog):
    from stages.train.stage import check_init

    assert check_init(TrainConfig(freeze_epochs=1, epochs=2), None, None) is None
    assert "freeze_epochs" not in caplog.text
    check_init(TrainConfig(freeze_epochs=5, epochs=1), None, None)
    assert "train.freeze_epochs=5 >= train.epochs=1: the backbone stays frozen for the whole run" in caplog.text
