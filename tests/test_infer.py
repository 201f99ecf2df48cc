"""Batch inference with Ray Data actors, on ETL shards and on a raw folder with broken files.

The model is trained in-process (a few SGD steps, no Ray Train), so the file runs in seconds
beyond the shared Ray start-up.
"""
from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from stages.feed import streaming
from stages.etl import stage as etl
from stages.etl.integrity import verify
from stages.infer import plan as planning
from stages.infer import stage as infer
from stages.model.predict import load_model, predict_arrays, preprocess
from stages.model.publish import save_model
from stages.model.zoo import build_model
from stages.model.predict import to_batch
from workflow import demo_data
from stages.common import session
from stages.common.artifacts import load_artifact
from stages.common.config import ConfigError, EtlConfig, InferConfig
from tests.conftest import BAD_FILES, REPO, image_bytes, make_tree

INFO = {"architecture": "small_cnn", "width": 8, "dropout": 0.0, "image_size": 32, "resize": "crop",
        "mean": [0.5] * 3, "std": [0.25] * 3, "version": "t"}


def _train_rows(data) -> list:
    return [r for ref in streaming.shard_refs(data.manifest, data.path, "train", "parquet")
            for r in streaming.read_shard(ref.uri, "parquet")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ray_session):
    """(ETL artifact, model folder): demo data -> ETL at 32 px -> small_cnn, 30 full-batch SGD steps."""
    root = tmp_path_factory.mktemp("infer")
    demo_data.generate(root / "src", images=120, seed=3)
    data = etl.run(EtlConfig(image_size=32, shard_max_rows=40), str(root / "src"), str(root / "ds"))
    rows = _train_rows(data)
    x = to_batch([streaming.decode_sample(r[2], 32, False) for r in rows], INFO["mean"], INFO["std"],
                 torch.device("cpu"), False, False)
    y = torch.tensor([r[1] for r in rows])
    torch.manual_seed(0)
    model = build_model("small_cnn", 10, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    save_model(str(root / "model"), model.eval().state_dict(), {**INFO, "classes": data.manifest["classes"]})
    return data, str(root / "model")


def _outputs(artifact) -> tuple[list[dict], dict]:
    out = Path(artifact.path)
    assert (out / "manifest.json").is_file() and artifact.manifest["kind"] == "raymill.infer"
    return pq.read_table(out / "predictions.parquet").to_pylist(), json.loads((out / "metrics.json").read_text())


def _accuracy(rows: list[dict]) -> float:
    labelled = [r for r in rows if r["true_class"] is not None and r["error"] is None]
    return sum(r["true_class"] == r["class_name"] for r in labelled) / len(labelled)


def test_a_damaged_shard_is_refused_before_any_prediction(setup, tmp_path):
    """As train refuses it: bytes flipped inside a test shard had come back as rows blamed on their
    images ("corrupt") and as changed probabilities, exit 0."""
    import shutil

    data, model_path = setup
    copy = tmp_path / "ds"
    shutil.copytree(data.path, copy)
    shard = next(copy.glob("shards/parquet/split=test/*.parquet"))
    damaged = bytearray(shard.read_bytes())
    for i in range(200, len(damaged) - 200, 700):
        damaged[i] ^= 0x10
    shard.write_bytes(bytes(damaged))
    with pytest.raises(infer.InferError, match=f"refusing to predict from .*{shard.name}.*raymill verify"):
        infer.run(InferConfig(), model_path, str(copy), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_folder_of_someone_elses_files_is_refused_as_an_output_by_infer_and_by_etl_overwrite(setup, tmp_path):
    """Published beside a user's images, predictions (or shards) made the folder unreadable as an
    input ("is a raymill.infer output") and mixed with the files."""
    from stages.etl.stage import OutputExistsError

    data, model_path = setup
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.jpg").write_bytes(image_bytes(1))
    with pytest.raises(ConfigError, match="holds files that raymill infer did not write .*a.jpg"):
        infer.run(InferConfig(), model_path, data.path, str(photos))
    (photos / "cat").mkdir()
    (photos / "cat" / "b.jpg").write_bytes(image_bytes(2))
    with pytest.raises(OutputExistsError, match="holds files that raymill etl did not write .*--overwrite replaces only"):
        etl.run(EtlConfig(image_size=32), data.manifest["inputs"]["source"], str(photos), overwrite=True)
    assert sorted(p.name for p in photos.rglob("*")) == ["a.jpg", "b.jpg", "cat"]
    # a model folder without its model.pt: exit 2 at once, as serve says it (FileNotFoundError, exit 1, before)
    from workflow.__main__ import main

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(model_path) / "model.json", bare / "model.json")
    assert main(["infer", "--model", str(bare), "--data", data.path, "--output", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_a_folder_where_no_file_is_an_image_fails_naming_the_fix(setup, tmp_path):
    """An ETL output's shards/ (or a run folder) passed as --data: every row was an error, exit 0."""
    data, model_path = setup
    with pytest.raises(ConfigError, match=r"is inside the raymill.etl output .* as --data"):  # exit 2, before reading
        infer.run(InferConfig(), model_path, f"{data.path}/shards", str(tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()
    import shutil  # a folder holding an ETL output beside images (a run folder): predicted as images, exit 0

    (tmp_path / "mixed" / "cat").mkdir(parents=True)
    shutil.copy(Path(data.path) / "manifest.json", tmp_path / "mixed" / "cat" / "manifest.json")
    with pytest.raises(ConfigError, match=r"holds raymill's own files \('cat' is"):
        infer.run(InferConfig(), model_path, str(tmp_path / "mixed"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()  # exit 2 as ETL's is (a wrong --data), not 1
    with pytest.raises(etl.InputNotFoundError, match="no files under"):
        infer.run(InferConfig(), model_path, str(tmp_path / "empty"), str(tmp_path / "out"))


def test_an_empty_split_is_a_config_error_and_a_smaller_etl_size_is_said(setup, tmp_path, caplog):
    """infer.split naming a split ETL left empty is the user's key to change (exit 2); shards stored
    smaller than the model's input are upscaled, which the log now says."""
    import copy
    import shutil

    from stages.common.artifacts import Artifact

    data, model_path = setup
    m = copy.deepcopy(data.manifest)
    m["shards"] = [s for s in m["shards"] if s["split"] != "val"]
    with pytest.raises(ConfigError, match="no parquet shards for split 'val'.*choose another infer.split"):
        planning._plan_shards(InferConfig(split="val"), Artifact("etl", data.path, m), INFO)
    bigger = tmp_path / "model48"
    shutil.copytree(model_path, bigger)
    info = json.loads((bigger / "model.json").read_text())
    save_model(str(bigger), load_model(model_path)[0].state_dict(), {**info, "image_size": 48})
    with caplog.at_level("WARNING", logger="stages.infer.stage"):
        infer.run(InferConfig(), str(bigger), data.path, str(tmp_path / "out"))
    assert "stores images at 32 px and the model expects 48 px: they are upscaled" in caplog.text


def test_an_actor_refuses_a_model_republished_after_the_driver_read_it(setup):
    """The driver records the model it read; an actor that loaded another (a train --overwrite in
    between) had predicted with it under the first one's name, classes and version."""
    from stages.infer.predictors import BatchPredictor

    _, model_path = setup
    kwargs = {"model_path": model_path, "s3": {}, "top_k": 1, "use_gpu": False, "threads": 1}
    read = json.loads((Path(model_path) / "model.json").read_text())["weights_sha256"]
    assert BatchPredictor(**kwargs, weights_sha256=read).info["weights_sha256"] == read
    with pytest.raises(RuntimeError, match="was republished during this infer"):
        BatchPredictor(**kwargs, weights_sha256="0" * 64)


def test_etl_test_split_matches_in_process_predictions(setup, tmp_path):
    """Shards through the two-stage plan (decode tasks, then the pool); the actor plan reads the tar
    shards below, and raw folders in the tests that follow."""
    data, model_path = setup
    cfg = InferConfig(batch_size=5, decode="tasks", decode_cpus_per_task=0.5)
    art = infer.run(cfg, model_path, data.path, str(tmp_path / "out"))
    assert art.manifest["metrics"]["decode"] == "tasks"
    rows, metrics = _outputs(art)
    assert len(rows) == metrics["rows"] == sum(data.manifest["counts"]["test"].values())
    assert metrics["errors"] == 0 and metrics["accuracy"] == pytest.approx(_accuracy(rows))
    cells = metrics["confusion"]["cells"]  # nonzero cells only: a dense matrix grew with classes squared
    assert sum(n for _, _, n in cells) == metrics["labelled"] == len(rows) and all(n > 0 for _, _, n in cells)
    assert sum(n for t, p, n in cells if t == p) == metrics["correct"]
    assert art.manifest["metrics"]["images_per_s"] > 0 and "confusion" not in art.manifest["metrics"]
    # the same images, predicted directly in this process, give the same answers
    model, info = load_model(model_path)
    refs = streaming.shard_refs(data.manifest, data.path, "test", "parquet")
    samples = [r for ref in refs for r in streaming.read_shard(ref.uri, "parquet")]
    direct = predict_arrays(model, info, [streaming.decode_sample(r[2], 32, False) for r in samples], top_k=3)
    expected = {r[0]: (data.manifest["classes"][r[1]], p) for r, p in zip(samples, direct)}
    for row in rows:
        true, p = expected[row["key"]]
        assert row["true_class"] == true and row["class_name"] == p["class_name"]
        assert row["top_k_classes"] == [t["class_name"] for t in p["top_k"]]
        assert row["top_k_probs"] == pytest.approx([t["probability"] for t in p["top_k"]], abs=1e-5)
    assert metrics["accuracy"] == pytest.approx(sum(expected[k][0] == expected[k][1]["class_name"]
                                                    for k in expected) / len(expected))
    # the tar shards (read by the same actor class, here in-process) agree with parquet
    tar_items = [vars(r) for r in streaming.shard_refs(data.manifest, data.path, "test", "tar")]
    threads = torch.get_num_threads()  # the actor sets its own share; give this process its own back
    try:
        actor = infer.Predictor(model_path=model_path, s3={}, mode="etl", top_k=3, batch_size=4,
                                use_gpu=False, threads=1, etl_classes=data.manifest["classes"])
        tar_rows = actor(pa.Table.from_pylist(tar_items)).to_pylist()
    finally:
        torch.set_num_threads(threads)
    assert {r["key"]: r["class_name"] for r in tar_rows} == {r["key"]: r["class_name"] for r in rows}


def test_raw_folder_with_broken_files_every_file_once(setup, tmp_path):
    data, model_path = setup
    src = tmp_path / "raw"
    written = make_tree(src, per_class=4, classes=("circle", "square", "triangle"))
    (src / "loose.jpg").write_bytes(image_bytes(5))  # flat file: predicted, label unknown
    written["loose.jpg"] = "ok"
    (src / ".DS_Store").write_bytes(b"\0")  # hidden: skipped and counted
    (src / "circle" / "sub").mkdir()  # the class is the first folder, as ETL labels it
    (src / "circle" / "sub" / "deep.jpg").write_bytes(image_bytes(6))
    written["circle/sub/deep.jpg"] = "ok"
    (src / "manifest.json").write_text('{"made_by": "another tool"}')  # not a raymill manifest: a file row
    written["manifest.json"] = "not_an_image"
    cfg = InferConfig(batch_size=4, num_actors=2, cpus_per_actor=0.5)
    art = infer.run(cfg, model_path, str(src), str(tmp_path / "out"))
    rows, metrics = _outputs(art)
    assert sorted(r["path"] for r in rows) == sorted(written)
    model, info = load_model(model_path)
    for r in rows:
        parent = r["path"].split("/")[0] if "/" in r["path"] else None
        assert r["true_class"] == (parent if parent in info["classes"] else None)
        if written[r["path"]] == "ok":
            assert r["error"] is None and len(r["top_k_classes"]) == 3
            direct = predict_arrays(model, info, [preprocess((src / r["path"]).read_bytes(), info)])[0]
            assert r["class_name"] == direct["class_name"]
        else:
            assert r["error"] == written[r["path"]] and r["class_name"] is None, r
    bad = Counter(w for w in written.values() if w != "ok")
    assert metrics["errors"] == sum(bad.values()) and metrics["rows"] == len(written)
    assert metrics["error_reasons"] == dict(sorted(bad.items()))
    assert metrics["labelled"] == 13 and metrics["accuracy"] == pytest.approx(_accuracy(rows))
    assert art.manifest["inputs"]["hidden_skipped"] == 1 and art.manifest["source_kind"] == "images"


def test_a_raw_folder_is_read_with_the_rules_of_the_models_training_data(setup, tmp_path):
    from stages.infer.decode import Reader
    from stages.model.publish import model_info
    from stages.common.config import TrainConfig

    data, model_path = setup
    _, info = load_model(model_path)  # a model.json without `read` (published before it): ETL's defaults
    assert model_info(TrainConfig(), data, {})["read"] == {
        k: data.manifest["config"][k] for k in ("allowed_formats", "max_image_pixels", "max_file_mb", "follow_symlinks",
                                                "layout")}
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, format="GIF")
    (tmp_path / "a.gif").write_bytes(buf.getvalue())
    sample = {"rel": "a.gif", "size": len(buf.getvalue()), "reason": "", "detail": ""}
    as_trained = Reader(info, {}, mode="images", source=str(tmp_path)).decode(sample)
    assert as_trained[1] == "unsupported_format"
    gif_data = {**info, "read": {"allowed_formats": ["JPEG", "GIF"]}}  # the rest stays at the defaults
    pixels, reason, _ = Reader(gif_data, {}, mode="images", source=str(tmp_path)).decode(sample)
    assert reason is None and pixels.shape == (info["image_size"], info["image_size"], 3)


def test_model_folder_without_model_json_is_a_clear_error(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jpg").write_bytes(image_bytes(1))
    with pytest.raises(ConfigError, match="no model.json in .*train or tune output"):  # exit 2, like --data's
        infer.run(InferConfig(), str(tmp_path / "model"), str(tmp_path / "src"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    # a train output killed before it published (model.json and model.pt, its run state, no manifest)
    (tmp_path / "model" / "model.json").write_text("{}")
    (tmp_path / "model" / "ray").mkdir()
    with pytest.raises(ConfigError, match="is a train or tune output that has not been published"):
        infer.run(InferConfig(), str(tmp_path / "model"), str(tmp_path / "src"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_output_holding_another_stages_manifest_is_refused_with_exit_2(setup, tmp_path, capsys):
    from workflow.__main__ import main

    data, model_path = setup
    before = (Path(data.path) / "manifest.json").read_bytes()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_bytes(before)  # another ETL output
    with pytest.raises(ConfigError, match="holds a published raymill.etl output"):
        infer.run(InferConfig(), model_path, data.path, str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="is inside the input"):  # the data set itself
        infer.run(InferConfig(), model_path, data.path, data.path)
    assert main(["infer", "--model", model_path, "--data", data.path, "--output", str(tmp_path / "other")]) == 2
    assert "raymill.etl" in capsys.readouterr().err
    assert (Path(data.path) / "manifest.json").read_bytes() == before and verify(data.path) == []


def test_a_small_job_on_the_command_line_never_starts_ray(setup, tmp_path):
    """`raymill infer` of a few images predicts them in its own process and starts no Ray (158
    images: 3.3 s against 9.3 s when Ray started first). Its predictions equal the stage's."""
    import os
    import subprocess
    import sys

    data, model_path = setup
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(REPO)}
    (tmp_path / "c.yaml").write_text("etl: {allowed_formats: [gif], image_size: 16}\n")  # a read key, and not
    run = subprocess.run([sys.executable, "-m", "workflow", "infer", "--model", model_path, "--data", data.path,
                          "--output", str(tmp_path / "cli"), "--config", str(tmp_path / "c.yaml"),
                          "--set", "etl.max_file_mb=7"], env=env,
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "in this process" in run.stderr and "[raymill] ray:" not in run.stderr, run.stderr
    assert "etl.allowed_formats, etl.max_file_mb do nothing here" in run.stderr, run.stderr  # the model's rules
    rows, metrics = _outputs(load_artifact(str(tmp_path / "cli"), "infer"))
    here, _ = _outputs(infer.run(InferConfig(), model_path, data.path, str(tmp_path / "here")))
    assert [r["class_name"] for r in rows] == [r["class_name"] for r in here] and metrics["decode"] == "in-process"


def test_a_raw_folder_split_by_its_folders_is_labelled_by_the_class_folder_below(setup, tmp_path):
    """`<split>/<class>/` (stages.etl.layout): each image's label is its class folder, not `train`."""
    _, model_path = setup
    for split in ("train", "test"):
        make_tree(tmp_path / "raw" / split, per_class=2, bad=False, classes=("circle", "square"))
    rows, metrics = _outputs(infer.run(InferConfig(), model_path, str(tmp_path / "raw"), str(tmp_path / "out")))
    assert [r["true_class"] for r in rows] == [r["path"].split("/")[1] for r in rows] and metrics["labelled"] == 4
    # infer.split's files only, as from an ETL output: the train images had been scored with the rest
    assert {r["path"].split("/")[0] for r in rows} == {"test"}
    with pytest.raises(ConfigError, match=r"none is infer.split=val; set infer.split to one of \['test', 'train'\]"):
        infer.run(InferConfig(split="val"), model_path, str(tmp_path / "raw"), str(tmp_path / "out2"))


def test_raw_folder_with_fifo_outside_link_and_non_utf8_name(setup, tmp_path):
    import os

    data, model_path = setup
    src = tmp_path / "raw"
    (src / "circle").mkdir(parents=True)
    (src / "circle" / "a.jpg").write_bytes(image_bytes(1))
    (src / os.fsdecode(b"circle/caf\xe9.jpg")).write_bytes(image_bytes(2))
    os.mkfifo(src / "circle" / "pipe.jpg")  # read, it would block the actor forever
    (tmp_path / "secret.jpg").write_bytes(image_bytes(3))
    os.symlink(tmp_path / "secret.jpg", src / "circle" / "link.jpg")
    art = infer.run(InferConfig(batch_size=4, num_actors=1), model_path, str(src), str(tmp_path / "out"))
    rows, _ = _outputs(art)
    assert {r["path"]: r["error"] for r in rows} == {
        "circle/a.jpg": None, "circle/caf\\xe9.jpg": None, "circle/pipe.jpg": "not_a_regular_file",
        "circle/link.jpg": "symlink_outside_source"}


class _Echo:
    def __call__(self, batch):
        return batch


def _echo(batch):
    return batch


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: tests/gpu runs this plan")
def test_use_gpu_where_ray_declares_a_gpu_torch_cannot_use_fails_saying_so(setup, tmp_path):
    """The session's Ray declares a GPU with no device behind it: the GPU pool's actor cannot start.
    The error names the key and the fix (it used to end in Ray Data's empty 'SystemException: '),
    and nothing is published."""
    data, model_path = setup
    with pytest.raises(infer.InferError, match=r"ActorDiedError: RuntimeError: infer.use_gpu: this actor holds a GPU "
                                               r"in Ray, but torch .* sees no CUDA device .* set infer.use_gpu=false"):
        infer.run(InferConfig(use_gpu=True), model_path, data.path, str(tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_gpu_plan_decodes_in_tasks_and_gives_the_gpu_pool_a_batch_size(ray_session):
    """infer.use_gpu on a CPU machine: the arguments each stage of the GPU plan hands map_batches,
    which Ray Data checks when the stage is declared (a missing batch_size with GPUs raised
    ValueError there)."""
    import ray.data

    plan = infer.Plan("images", [{"path": str(i)} for i in range(10)], 3, 10, {}, {})
    stages = infer.map_batches_kwargs(InferConfig(use_gpu=True, num_actors=2, batch_size=64), plan,
                                      {"CPU": 16.0, "GPU": 2.0})
    assert list(stages) == ["decode", "predict"]  # auto: CPU tasks decode beside a GPU pool
    decode, pool = stages["decode"], stages["predict"]
    assert decode["batch_size"] == 4 and decode["num_cpus"] == 1.0 and "num_gpus" not in decode
    # 16 - 2 x 1 CPUs would hold 14 decode tasks, but 3 blocks feed at most 3 (Ray Data warns of the rest)
    assert isinstance(decode["compute"], ray.data.TaskPoolStrategy) and decode["compute"].size == 3
    # a GPU actor's 1 CPU is Ray Data's default: naming it beside num_gpus draws Ray's "experimental" warning
    assert pool["batch_size"] == 64 and pool["num_gpus"] == 1.0 and "num_cpus" not in pool
    assert isinstance(pool["compute"], ray.data.ActorPoolStrategy) and pool["compute"].max_size == 2
    ray.data.from_items(plan.items).map_batches(_echo, **decode).map_batches(_Echo, **pool)  # declared, not run
    with pytest.raises(ValueError, match="batch_size"):  # what the plan prevents
        ray.data.from_items(plan.items).map_batches(_Echo, **{**pool, "batch_size": None})
    actor = infer.map_batches_kwargs(InferConfig(use_gpu=True, decode="actor"), plan, {"CPU": 16.0, "GPU": 2.0})
    assert list(actor) == ["predict"] and actor["predict"]["batch_size"] == 4 and actor["predict"]["num_gpus"] == 1
    cpu = infer.map_batches_kwargs(InferConfig(), plan, {"CPU": 2.0, "GPU": 0.0})  # the CPU default: actors decode
    assert list(cpu) == ["predict"] and cpu["predict"]["num_gpus"] == 0
    # infer.num_actors unset: one actor per GPU, as many as leave a decode task its CPU, else 1 on a CPU
    eight = infer.map_batches_kwargs(InferConfig(use_gpu=True), plan, {"CPU": 16.0, "GPU": 8.0})
    assert eight["predict"]["compute"].max_size == 8 and eight["decode"]["compute"].size == 3  # 3 blocks
    many = infer.Plan("images", [{"path": str(i)} for i in range(40)], 20, 40, {}, {})
    assert infer.map_batches_kwargs(InferConfig(use_gpu=True), many, {"CPU": 16.0, "GPU": 8.0})["decode"]["compute"].size == 8
    one_block = infer.map_batches_kwargs(InferConfig(num_actors=2), infer.Plan("images", plan.items, 1, 10, {}, {}),
                                         {"CPU": 4.0, "GPU": 0.0})
    assert one_block["predict"]["compute"].max_size == 1 and one_block["predict"]["num_cpus"] == 1.0
    # 6 CPUs for 8 GPUs: 5 actors would leave 1 decode task; 6 actors decoding their own do more
    assert session.plan_infer(InferConfig(use_gpu=True), {"CPU": 6.0, "GPU": 8.0})["num_actors"] == 6
    big = InferConfig(use_gpu=True, decode="actor", cpus_per_actor=4)  # 16 CPUs hold 4 such actors, not 8
    assert session.plan_infer(big, {"CPU": 16.0, "GPU": 8.0})["num_actors"] == 4
    assert session.plan_infer(big, {"CPU": 64.0, "GPU": 8.0, "node_cpus_per_gpu": 2.0})["num_actors"] == 4
    # on CPUs: every CPU but one predicts (one actor had used 1 core of 96); 2 cores: 1, as before
    assert session.plan_infer(InferConfig(), {"CPU": 16.0, "GPU": 8.0})["num_actors"] == 15
    assert session.plan_infer(InferConfig(), {"CPU": 2.0, "GPU": 0.0})["num_actors"] == 1
    two = {"CPU": 10.0, "GPU": 0.0, "nodes": ((8.0, 0.0), (2.0, 0.0))}  # 2-CPU actors, node by node
    assert session.plan_infer(InferConfig(cpus_per_actor=2), two)["num_actors"] == 4
    # a GPU node of 1 CPU: no decode task fits beside the actor, which decodes itself (it had been refused);
    # 8 GPUs, 8 CPUs: each of 8 actors decodes its own (7 actors had been fed by 1 decode task)
    assert session.plan_infer(InferConfig(use_gpu=True), {"CPU": 1.0, "GPU": 1.0})["decode"] == "actor"
    poor = session.plan_infer(InferConfig(use_gpu=True), {"CPU": 8.0, "GPU": 8.0, "node_cpus_per_gpu": 1.0})
    assert (poor["decode"], poor["num_actors"]) == ("actor", 8), poor
    h100 = session.plan_infer(InferConfig(use_gpu=True), {"CPU": 16.0, "GPU": 1.0, "node_cpus_per_gpu": 16.0})
    assert (h100["decode"], h100["num_actors"], h100["decode_tasks"]) == ("tasks", 1, 15), h100
    with pytest.raises(ConfigError, match=r"infer.num_actors=1 of infer.cpus_per_actor=2 CPU each do not fit on the "
                                          r"nodes \(1 CPU/0 GPU, 1 CPU/0 GPU, 1 CPU/0 GPU\): they hold 0"):
        session.plan_infer(InferConfig(num_actors=1, cpus_per_actor=2), {"CPU": 3.0, "GPU": 0.0,
                                                                         "nodes": ((1.0, 0.0),) * 3})
    with pytest.raises(ConfigError, match=r"1 actor\(s\) \(infer.num_actors unset\) needs 1 GPUs but the cluster has 0"):
        session.plan_infer(InferConfig(use_gpu=True), {"CPU": 16.0, "GPU": 0.0})
    with pytest.raises(ConfigError, match="infer.num_actors=2 needs 2 GPUs but the cluster has 1"):
        infer.map_batches_kwargs(InferConfig(use_gpu=True, num_actors=2), plan, {"CPU": 16.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match=r"infer.decode=tasks: .* leave 0 of 2 CPUs, less than one decode task"):
        infer.map_batches_kwargs(InferConfig(decode="tasks", num_actors=2), plan, {"CPU": 2.0, "GPU": 0.0})
    with pytest.raises(ConfigError, match=r"infer.num_actors=4 x infer.cpus_per_actor=1.5 need 6 CPUs but the cluster has 2"):
        session.plan_infer(InferConfig(num_actors=4, cpus_per_actor=1.5), {"CPU": 2.0, "GPU": 0.0})


def test_decode_in_tasks_and_in_process_predict_as_the_actors_do_with_the_same_error_rows(setup, tmp_path):
    """infer.decode=tasks on the CPU: Ray Data tasks decode (half a CPU each, so Ray does not fuse
    them into the actor), the pool predicts; a small job left to the defaults runs in this process
    (infer.local_max_rows). Rows, predictions and error rows equal the actor plan's, in torch as in
    the actors' onnxruntime (infer.engine=auto)."""
    _, model_path = setup
    src = tmp_path / "raw"
    written = make_tree(src, per_class=2, classes=("circle", "square", "triangle"))
    got, ray_starts = {}, []
    for decode in ("actor", "tasks", "in-process"):
        cfg = (InferConfig(batch_size=4) if decode == "in-process" else
               InferConfig(batch_size=4, decode=decode, decode_cpus_per_task=0.5))
        art = infer.run(cfg, model_path, str(src), str(tmp_path / decode), start_ray=lambda: ray_starts.append(decode))
        got[decode] = _outputs(art)
        m = art.manifest["metrics"]
        assert m["decode"] == decode and m["device"] == "cpu" and m["device_busy_s"] > 0
        assert m["engine"] == ("torch" if decode == "in-process" else "onnxruntime")  # infer.engine=auto
        assert 0 < m["device_utilisation"] <= 1 and m["predict_wall_s"] > 0
    assert ray_starts == ["actor", "tasks"]  # the small job never asked for Ray
    actor_rows, actor_m = got["actor"]
    for rows, m in (got["tasks"], got["in-process"]):
        assert sorted(r["path"] for r in rows) == sorted(written)
        assert {r["path"]: r["error"] for r in rows if r["error"]} == {
            k: v for k, v in written.items() if v != "ok"} and m["errors"] == len(BAD_FILES)
        assert [{k: v for k, v in r.items() if k != "top_k_probs"} for r in rows] == \
            [{k: v for k, v in r.items() if k != "top_k_probs"} for r in actor_rows]
        for a, t in zip(actor_rows, rows):
            assert t["top_k_probs"] == (pytest.approx(a["top_k_probs"], abs=1e-6) if a["top_k_probs"] else None)
        assert m["error_reasons"] == actor_m["error_reasons"] and m["accuracy"] == actor_m["accuracy"]


def test_an_output_inside_the_input_is_refused_before_anything_is_written(tmp_path):
    # predictions written among the images would be read back as a class of images on the next run
    src = tmp_path / "src"
    make_tree(src, per_class=1, bad=False)
    for out in (src, src / "preds"):
        with pytest.raises(ConfigError, match="is inside the input"):
            infer.run(InferConfig(), str(tmp_path / "any-model"), str(src), str(out))
    assert sorted(p.name for p in src.iterdir()) == ["bird", "cat", "dog"]


def test_a_class_the_model_lacks_is_unlabelled_from_an_etl_output_as_from_a_raw_folder(setup, tmp_path):
    _, model_path = setup  # a model of the demo's classes (circle, square, ...): no "zebra"
    src = tmp_path / "raw"
    make_tree(src, per_class=2, bad=False, classes=("circle", "zebra"))
    data = etl.run(EtlConfig(image_size=32, split={"train": 1.0, "val": 0.0, "test": 0.0}), str(src),
                   str(tmp_path / "ds"))
    cfg = InferConfig(split="train")
    rows = {}
    for kind, source in (("raw", str(src)), ("etl", data.path)):
        rows[kind], metrics = _outputs(infer.run(cfg, model_path, source, str(tmp_path / f"out-{kind}")))
        assert metrics["labelled"] == 2 and metrics["rows"] == 4, (kind, metrics)
        assert {r["true_class"] for r in rows[kind]} == {"circle", None}, kind
    key = {r["key"]: r["true_class"] for r in rows["raw"]}
    assert {r["key"]: r["true_class"] for r in rows["etl"]} == key
