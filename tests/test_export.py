"""`raymill export`: ONNX through onnxruntime from uint8 pixels, agreement with `raymill infer`, a Triton
config that parses as Triton's own protobuf, TorchScript in a process without raymill, and the refusals.

Every export here is of the model the session's smoke run trained (tests/conftest.py `smoke_run`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pyarrow.parquet as pq
import pytest
from PIL import Image
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from stages.common.artifacts import load_artifact
from stages.common.config import load_config
from stages.feed import streaming
from stages.model import export, predict
from tests.conftest import REPO
from workflow import pipeline
from workflow.__main__ import main

SMOKE = str(REPO / "configs/smoke.yaml")


@pytest.fixture(scope="module")
def trained(smoke_run):
    assert smoke_run.returncode == 0, smoke_run.stderr[-3000:]
    model, info = predict.load_model(str(smoke_run.run_dir / "train"))
    return smoke_run.run_dir, model, info


@pytest.fixture(scope="module")
def onnx_repo(trained, tmp_path_factory):
    """One ONNX export with both outputs, through the CLI; (repository folder, its manifest)."""
    out = tmp_path_factory.mktemp("export") / "repo"
    assert main(["export", "--model", str(trained[0] / "train"), "--output", str(out), "--config", SMOKE,
                 "--set", "export.probabilities=true", "--set", "export.name=flowers"]) == 0
    return out, json.loads((out / "manifest.json").read_text())


def _torch_logits(model, info, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(predict.to_batch(pixels, info["mean"], info["std"], torch.device("cpu"), False, False)).numpy()


def _test_images(run_dir: Path, info: dict) -> dict[str, np.ndarray]:
    """Every test-split image of the run's ETL output by key, decoded as `raymill infer` decodes shards."""
    data = load_artifact(str(run_dir / "etl"), "etl")
    refs = streaming.shard_refs(data.manifest, data.path, "test", "parquet")
    raw = data.manifest["config"]["parquet_encoding"] == "raw"
    return {key: streaming.decode_sample(image, info["image_size"], raw)
            for ref in refs for key, _, image in streaming.read_shard(ref.uri, "parquet")}


def test_onnx_predicts_from_uint8_pixels_at_batch_1_and_17(trained, onnx_repo):
    run_dir, model, info = trained
    out, manifest = onnx_repo
    session = onnxruntime.InferenceSession(str(out / "flowers/1/model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["pixels"]
    assert [o.name for o in session.get_outputs()] == ["logits", "probabilities"]
    images = np.stack(list(_test_images(run_dir, info).values()))
    pixels = np.resize(images, (17, *images.shape[1:]))  # 17 real images (repeated where the split is smaller)
    for batch in (pixels[:1], pixels):
        logits, probabilities = session.run(None, {"pixels": batch})
        expected = _torch_logits(model, info, batch)
        assert logits.shape == probabilities.shape == (len(batch), len(info["classes"]))
        assert np.abs(logits - expected).max() < 1e-4
        assert (logits.argmax(1) == expected.argmax(1)).all()
        np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-5)
    check = manifest["check"]
    assert check["class_agreement"] == 1.0 and check["logits_max_abs_diff"] <= 1e-3 and check["split"] == "test"
    assert manifest["inputs"]["weights_sha256"] == info["weights_sha256"]
    assert manifest["input"] == {"name": "pixels", "dtype": "uint8", "shape": [-1, 32, 32, 3], "layout": "NHWC RGB",
                                 "resize": info["resize"], "image_size": 32, "read": {
                                     "allowed_formats": info["read"]["allowed_formats"],
                                     "max_image_pixels": info["read"]["max_image_pixels"],
                                     "max_file_mb": info["read"]["max_file_mb"]}}
    # the oldest graph torch builds, stamped with its oldest IR: onnxruntime 1.16 refused IR 10 / opset 20
    stamped = onnx.load(str(out / "flowers/1/model.onnx"))
    assert manifest["onnx"] == {"opset": 18, "ir_version": 8} == {
        "opset": next(o.version for o in stamped.opset_import if o.domain == ""), "ir_version": stamped.ir_version}


def test_onnx_agrees_with_raymill_infer_on_every_test_image(trained, onnx_repo):
    run_dir, _, info = trained
    session = onnxruntime.InferenceSession(str(onnx_repo[0] / "flowers/1/model.onnx"),
                                           providers=["CPUExecutionProvider"])
    predictions = pq.read_table(run_dir / "infer/predictions.parquet").to_pylist()
    images = _test_images(run_dir, info)
    assert predictions and {p["key"] for p in predictions} == set(images)
    keys = [p["key"] for p in predictions]
    logits = session.run(["logits"], {"pixels": np.stack([images[k] for k in keys])})[0]
    assert logits.argmax(1).tolist() == [p["class_index"] for p in predictions]


def test_the_exported_preprocess_gives_a_client_raymills_own_pixels(trained, onnx_repo, tmp_path):
    """preprocess.py beside the model, run where raymill is not importable, turns a large JPEG
    (draft-decoded), a PNG with transparency and a 16-bit PNG into the very pixels raymill computes:
    a decode by the README's old recipe differed on all three."""
    from PIL import Image

    from stages.etl.images import decode_rgb

    out, manifest = onnx_repo
    rng = np.random.default_rng(0)
    photo, rgba, deep = (tmp_path / n for n in ("photo.jpg", "rgba.png", "deep.png"))
    Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(photo, quality=90)
    half_clear = rng.integers(0, 256, (40, 50, 4), dtype=np.uint8)
    half_clear[:, :25, 3] = 0
    Image.fromarray(half_clear, "RGBA").save(rgba)
    Image.fromarray(rng.integers(0, 65536, (40, 50), dtype=np.uint16)).save(deep)  # mode I;16
    size, resize = manifest["input"]["image_size"], manifest["input"]["resize"]
    assert (out / "flowers/preprocess.py").is_file() and "flowers/preprocess.py" in manifest["files"]
    Image.new("P", (2000, 2000)).save(tmp_path / "anim.gif")  # raymill reads no GIF: nor does the client, with read
    script = ("import json, sys, numpy\n"
              "sys.path.insert(0, sys.argv[1])\n"
              "from preprocess import BadImage, pixels\n"
              "read = json.load(open(sys.argv[6]))['input']['read']\n"
              "batch = numpy.stack([pixels(open(p, 'rb').read(), int(sys.argv[2]), sys.argv[3], read) for p in sys.argv[7:]])\n"
              "try:\n    pixels(open(sys.argv[5], 'rb').read(), int(sys.argv[2]), sys.argv[3], read)\n"
              "except BadImage as e:\n    print('refused', e.reason)\n"
              "assert not {'stages', 'workflow'} & set(sys.modules), 'raymill was imported'\n"
              "numpy.save(sys.argv[4], batch)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script, str(out / "flowers"), str(size), resize,
                           str(tmp_path / "client.npy"), str(tmp_path / "anim.gif"), str(out / "manifest.json"),
                           str(photo), str(rgba), str(deep)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "refused unsupported_format\n", proc.stdout + proc.stderr[-2000:]
    client = np.load(tmp_path / "client.npy")
    from stages.etl.pixels import BadImage, pixels  # the size limit too, as infer refuses a file (it had read it)

    with pytest.raises(BadImage, match="too_large"):
        pixels(photo.read_bytes(), size, resize, {**manifest["input"]["read"], "max_file_mb": 1e-3})
    ours = np.stack([decode_rgb(p.read_bytes(), size, resize=resize) for p in (photo, rgba, deep)])
    assert client.dtype == np.uint8 and np.array_equal(client, ours)
    # the old recipe (no draft, alpha dropped, 16 bit clipped) differs on each: the test tells them apart
    for i, path in enumerate((photo, rgba, deep)):
        img = Image.open(path).convert("RGB")
        w, h = img.size
        box = ((w - min(w, h)) / 2, (h - min(w, h)) / 2, (w + min(w, h)) / 2, (h + min(w, h)) / 2)
        naive = img.resize((size, size), Image.Resampling.BILINEAR, box=box if resize == "crop" else None)
        assert not np.array_equal(np.asarray(naive), ours[i]), path.name


def test_triton_config_parses_as_model_config_and_matches_the_onnx_graph(trained, onnx_repo):
    info = trained[2]
    out, manifest = onnx_repo
    config = text_format.Parse((out / "flowers/config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert (config.name, config.platform, config.max_batch_size) == ("flowers", "onnxruntime_onnx", 64)
    assert config.HasField("dynamic_batching")
    graph = onnx.load(str(out / "flowers/1/model.onnx")).graph
    types = {onnx.TensorProto.UINT8: model_config_pb2.TYPE_UINT8, onnx.TensorProto.FLOAT: model_config_pb2.TYPE_FP32}
    for declared, tensor in zip([*config.input, *config.output], [*graph.input, *graph.output], strict=True):
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.type.tensor_type.shape.dim]
        assert declared.name == tensor.name
        assert declared.data_type == types[tensor.type.tensor_type.elem_type]
        assert dims[0] == -1 and list(declared.dims) == dims[1:]  # Triton's dims leave out the batch
    assert [o.label_filename for o in config.output] == ["labels.txt", "labels.txt"]
    assert (out / "flowers/labels.txt").read_text().splitlines() == info["classes"]
    assert sorted(manifest["files"]) == ["flowers/1/model.onnx", "flowers/config.pbtxt", "flowers/labels.txt",
                                         "flowers/preprocess.py"]
    assert [o["name"] for o in manifest["outputs"]] == ["logits", "probabilities"]


def test_torchscript_loads_and_predicts_in_a_process_without_raymill(trained, tmp_path, capsys):
    run_dir, model, info = trained
    out = tmp_path / "ts"
    assert main(["export", "--model", str(run_dir / "train"), "--output", str(out), "--format", "torchscript",
                 "--config", SMOKE]) == 0
    assert "torchscript model 'raymill'" in capsys.readouterr().out
    config = text_format.Parse((out / "raymill/config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.platform == "pytorch_libtorch" and [i.name for i in config.input] == ["pixels__0"]
    pixels = np.stack(list(_test_images(run_dir, info).values()))
    np.save(tmp_path / "pixels.npy", pixels)
    script = ("import sys, numpy, torch\n"
              "m = torch.jit.load(sys.argv[1])\n"
              "logits = m(torch.from_numpy(numpy.load(sys.argv[2])))\n"
              "assert not {'stages', 'workflow'} & set(sys.modules), 'raymill was imported'\n"
              "numpy.save(sys.argv[3], logits.numpy())\n"  # no grad to detach: an inference graph
              "for bad in (torch.zeros((2, 64, 64, 3), dtype=torch.uint8), torch.zeros((2, 32, 32, 3))):\n"
              "    try:\n"
              "        m(bad)\n"
              "    except Exception as e:\n"
              "        assert 'expected' in str(e) and 'dtype code' not in str(e), e\n"
              "    else:\n"
              "        raise SystemExit(f'the TorchScript model answered {bad.dtype} {list(bad.shape)}')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", script, str(out / "raymill/1/model.pt"), str(tmp_path / "pixels.npy"),
                           str(tmp_path / "logits.npy")], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logits = np.load(tmp_path / "logits.npy")
    expected = _torch_logits(model, info, pixels)
    assert np.abs(logits - expected).max() < 1e-4 and (logits.argmax(1) == expected.argmax(1)).all()


def test_bad_inputs_and_a_refused_export_exit_2_and_publish_nothing(trained, onnx_repo, tmp_path, capsys):
    run_dir = trained[0]
    model = str(run_dir / "train")
    cases = [(["--model", str(tmp_path / "missing"), "--output", str(tmp_path / "a")], "does not exist"),
             (["--model", str(run_dir / "etl"), "--output", str(tmp_path / "b")], "holds no model"),
             (["--model", model, "--output", str(run_dir / "etl")], "raymill.etl"),
             (["--model", model, "--output", str(tmp_path / "c"), "--set", "export.tolerance=1e-30"],
              "nothing was published")]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    cases.append((["--model", model, "--output", str(foreign)], "not a raymill export"))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(SystemExit) as usage:  # refused by the argument itself, as every stage's --output
        main(["export", "--model", model, "--output", str(tmp_path / "a-file" / "repo"), "--config", SMOKE])
    assert usage.value.code == 2 and f"'{tmp_path / 'a-file'}' is a file; name a folder" in capsys.readouterr().err
    cases.append((["--model", model, "--output", str(tmp_path / "new" / ("a" * 300))], "File name too long"))
    cases.append((["--model", model, "--output", str(tmp_path / "d"), "--data", str(tmp_path / "none")],
                  f"--data '{tmp_path / 'none'}' which cannot be read"))
    cases.append((["--model", model, "--output", str(tmp_path / "e"), "--set", "export.name=a/b"],
                  "not a folder name Triton accepts"))
    added = tmp_path / "added"  # an earlier export with a second version someone put beside it
    shutil.copytree(onnx_repo[0], added)
    (added / "flowers/2").mkdir()
    (added / "flowers/2/model.onnx").write_bytes(b"theirs")
    cases.append((["--model", model, "--output", str(added)], "holds 1 file(s) it did not write (e.g. 'flowers/2/"))
    for args, fragment in cases:
        assert main(["export", *args, "--config", SMOKE]) == 2, args
        assert fragment in capsys.readouterr().err, args
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and (added / "flowers/2/model.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "added", "foreign"]  # no output, no staging
    (tmp_path / "raced").mkdir()  # made by another run after the output was found missing: left to it
    export._check_creatable(str(tmp_path / "raced"), str(tmp_path / "raced"))
    assert (tmp_path / "raced").is_dir()
    # an earlier export is replaced, whatever its model's name was
    repo = tmp_path / "earlier"
    shutil.copytree(onnx_repo[0], repo)
    # ...after a client imported its preprocess.py as the README shows, which wrote __pycache__ there
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'flowers'); import preprocess"], cwd=repo,
                   env=env, check=True, timeout=120)
    assert list(repo.glob("flowers/__pycache__/*.pyc"))
    assert main(["export", "--model", model, "--output", str(repo), "--config", SMOKE]) == 0
    assert sorted(p.name for p in repo.iterdir()) == ["manifest.json", "raymill"]


def test_a_model_whose_data_is_elsewhere_is_checked_on_data_given_with_data(trained, tmp_path, capsys):
    """A model taken to another machine (its model.json's `data` not there) exports when --data
    names an ETL output, or a folder of images (any tree; a file that is no image is skipped)."""
    run_dir = trained[0]
    moved = tmp_path / "moved"
    shutil.copytree(run_dir / "train", moved)
    info = json.loads((moved / "model.json").read_text())
    (moved / "model.json").write_text(json.dumps({**info, "data": str(tmp_path / "gone")}))
    assert main(["export", "--model", str(moved), "--output", str(tmp_path / "a"), "--config", SMOKE]) == 2
    assert "pass --data with an ETL output or a folder of images" in capsys.readouterr().err
    assert main(["export", "--model", str(moved), "--output", str(tmp_path / "b"), "--config", SMOKE,
                 "--data", str(run_dir / "etl")]) == 0
    assert "nothing here" not in capsys.readouterr().err  # the config the model was trained with
    check = json.loads((tmp_path / "b" / "manifest.json").read_text())["check"]
    assert check["data"] == str(run_dir / "etl") and check["split"] == "test" and check["class_agreement"] == 1.0
    photos = tmp_path / "photos" / "some" / "where"
    photos.mkdir(parents=True)
    for i, image in enumerate(list(_test_images(run_dir, info).values())[:5]):
        Image.fromarray(image).save(photos / f"{i}.png")
    (photos / "notes.txt").write_text("not an image")
    assert main(["export", "--model", str(moved), "--output", str(tmp_path / "c"), "--config", SMOKE,
                 "--data", str(tmp_path / "photos"), "--set", "etl.max_file_mb=7"]) == 0
    assert "export --data reads image files with the rules of the model's own ETL" in (err := capsys.readouterr().err)
    assert "etl.max_file_mb does nothing here" in err, err
    check = json.loads((tmp_path / "c" / "manifest.json").read_text())["check"]
    assert (check["data"], check["split"], check["images"]) == (str(tmp_path / "photos"), "folder", 5)
    assert main(["export", "--model", str(moved), "--output", str(tmp_path / "d"), "--config", SMOKE,
                 "--data", str(photos / "notes.txt")]) == 2
    capsys.readouterr()


def test_the_pipeline_export_stage_publishes_and_reuses(trained, tmp_path):
    run_dir, _, info = trained
    cfg = load_config(SMOKE, [f"run.dir={tmp_path / 'run'}", "export.enabled=true", "export.format=torchscript"])
    model = load_artifact(str(run_dir / "train"), "train")
    artifact, reused = pipeline.export_stage(cfg, model)
    assert not reused and artifact.path == str(tmp_path / "run/export")
    assert artifact.manifest["inputs"]["weights_sha256"] == info["weights_sha256"]
    assert (tmp_path / "run/export/raymill/1/model.pt").is_file()
    again, reused = pipeline.export_stage(cfg, model)
    assert reused and again.manifest == artifact.manifest
    from workflow import report  # the run's summary table has the export's row (it had none)

    [row] = report._export_row(again, {"export": 0.7})
    assert row["stage"] == "export" and row["rows"] == again.manifest["check"]["images"] > 0, row
    assert row["note"].startswith("torchscript, logits within") and "classes agree 100.0%" in row["note"], row


def test_logits_far_from_1_are_checked_against_their_scale(trained, tmp_path, capsys):
    """A model whose logits reach ~1e4 (trained briefly at a high lr): float32 rounds them by ~1e-3,
    so two correct runtimes differ by that; an absolute 1e-3 had refused raymill's own model."""
    from stages.model import publish, runtime

    run_dir, model, info = trained
    state = {k: (v * 3e4 if k.startswith("fc.") else v) for k, v in model.state_dict().items()}
    publish.save_model(str(tmp_path / "loud"), state, info)
    loud, _ = predict.load_model(str(tmp_path / "loud"))
    assert main(["export", "--model", str(tmp_path / "loud"), "--output", str(tmp_path / "repo"),
                 "--config", SMOKE]) == 0, capsys.readouterr().err
    check = json.loads((tmp_path / "repo" / "manifest.json").read_text())["check"]
    assert check["logits_scale"] > 1e3 and check["logits_max_rel_diff"] <= 1e-3
    # the engines' own check (serve and infer with engine=onnxruntime) measures the same way: it had raised
    forward = runtime.for_device(loud.eval(), info, "onnxruntime", torch.device("cpu"), 1, str(tmp_path / "cache"))
    assert isinstance(forward, runtime.OnnxForward)
