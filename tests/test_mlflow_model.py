"""The registered MLflow model loads with `mlflow.pyfunc.load_model("models:/<name>/<version>")` in a
fresh process and answers as `stages.model.predict` does, with a per-row error for a bad image.

The fresh process runs outside the checkout with no PYTHONPATH, so it imports `stages` from the code
shipped with the model (code_paths), which the test checks. One test logs a small untrained model
(no Ray); the other loads the model the smoke run (`raymill run`, tests/conftest.py) registered.
"""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import image_bytes
from stages.common import tracking, tracking_guard, tracking_model
from stages.common.config import load_config

# Runs in the fresh process: argv = model URI, then files of image bytes; prints one JSON line.
LOADER = """
import importlib.abc, json, os, sys
from pathlib import Path
class Absent(importlib.abc.MetaPathFinder):  # what the model's logged requirements would not install
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in os.environ["RAYMILL_TEST_ABSENT"].split(","):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
sys.meta_path.insert(0, Absent())
import mlflow
import pandas as pd
model = mlflow.pyfunc.load_model(sys.argv[1])
import stages  # imported by the model's code: from its code_paths copy (cwd elsewhere, no PYTHONPATH)
images = [Path(p).read_bytes() for p in sys.argv[2:]]
rows = lambda out: out.to_dict("records")  # as the frame holds them: None is null, NaN stays NaN
frame = model.predict(pd.DataFrame({"image": images}, index=[10 * (i + 1) for i in range(len(images))]))
listed = model.predict(images[:2])
try:  # MLflow hands an unnamed signature only the first column: 'image' second must be refused
    second = str(model.predict(pd.DataFrame({"other": images[:2], "image": images[:2]})))
except Exception as e:
    second = f"{type(e).__name__}: {e}"
from mlflow.pyfunc.scoring_server import predictions_to_json  # what `mlflow models serve` answers
rest = __import__("io").StringIO()
predictions_to_json(frame, rest)
print(json.dumps({"frame": rows(frame), "index": frame.index.tolist(), "list": rows(listed), "second": second,
                  "stages": stages.__file__, "rest": rest.getvalue()}, default=str))
"""


def _absent() -> list[str]:
    """Installed top-level modules that a fresh environment made from the model's requirements (and
    MLflow) would lack: no distribution in their dependency closure provides them (psutil had been
    imported by the model's code through stages.etl's package: a fresh env failed to load it)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo, closure = ["mlflow", *tracking_model.REQUIREMENTS], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in closure:
            continue
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        closure.add(name)
        todo += [r.name for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate({"extra": ""})]
    owners = md.packages_distributions()
    return sorted(m for m, dists in owners.items() if m.isidentifier() and m != "stages"
                  and not any(canonicalize_name(d) in closure for d in dists))


def _predict_fresh(uri: str, model_uri: str, images: list[bytes], folder: Path) -> dict:
    """`model_uri` loaded and run on `images` in a new Python process pointed at the store `uri`,
    where only what the model's requirements install can be imported."""
    paths = []
    for index, data in enumerate(images):
        paths.append(folder / f"image-{index}.bin")
        paths[-1].write_bytes(data)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PYTHONPATH"))}
    done = subprocess.run([sys.executable, "-c", LOADER, model_uri, *map(str, paths)], cwd=folder, text=True,
                          capture_output=True, timeout=300,
                          env={**env, "MLFLOW_TRACKING_URI": uri, "RAYMILL_TEST_ABSENT": ",".join(_absent())})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _expected(model_dir: str, images: list[bytes]) -> list[dict]:
    from stages.etl.sources import read_rules
    from stages.model.predict import load_model, predict_arrays, preprocess

    model, info = load_model(model_dir)
    rules = read_rules(info)  # the model's own ETL read settings, as infer reads files
    return predict_arrays(model, info, [preprocess(data, info, tuple(rules["allowed_formats"]),
                                                   rules["max_image_pixels"]) for data in images], top_k=1)


def _check_rows(rows: list[dict], expected: list[dict], bad: dict[int, str]) -> None:
    """Good rows answer as stages.model.predict; rows in `bad` carry that error and no class."""
    good = [row for index, row in enumerate(rows) if index not in bad]
    assert [r["class_index"] for r in good] == [e["class_index"] for e in expected]
    assert [r["class_name"] for r in good] == [e["class_name"] for e in expected]
    assert [r["probability"] for r in good] == pytest.approx([e["top_k"][0]["probability"] for e in expected],
                                                              abs=1e-5)
    assert all(r["error"] is None for r in good)
    for index, reason in bad.items():
        assert rows[index]["class_index"] == -1 and rows[index]["error"].startswith(reason), rows[index]
        assert rows[index]["class_name"] is None  # None, not the NaN pandas makes of it beside a string


def test_a_logged_model_loads_in_a_fresh_process_and_answers_per_image(tmp_path):
    import mlflow
    from mlflow import MlflowClient

    from stages.model.mlflow_model import OUTPUT_COLUMNS
    from stages.model.publish import save_model
    from stages.model.zoo import build_model

    info = {"architecture": "small_cnn", "width": 8, "dropout": 0.0, "classes": ["bird", "cat", "dog"],
            "image_size": 32, "resize": "crop", "mean": [0.5] * 3, "std": [0.25] * 3, "version": "unit",
            "read": {"allowed_formats": ["JPEG", "PNG", "GIF"], "max_image_pixels": 5000}}  # its ETL's rules
    model_dir = tmp_path / "model"
    save_model(str(model_dir), build_model("small_cnn", 3, width=8).state_dict(), info)
    files = {name: (model_dir / name).read_bytes() for name in tracking_model.ARTIFACT_NAMES}
    cfg = load_config(None, [])
    handle = tracking.start(cfg.tracking, str(tmp_path / "store"), "unit", {"raymill.stage": "train"})
    was_set = mlflow.is_tracking_uri_set()
    assert tracking.register_model(handle, "unit-model", files) == "1"
    assert tracking.register_model(handle, "unit-model", files) == "2"  # the registered model is reused
    # the fluent state log_model needs is put back: no active run, no exported MLFLOW_TRACKING_URI
    assert mlflow.active_run() is None and mlflow.is_tracking_uri_set() == was_set
    assert not tracking_guard.has_failed(handle["uri"])

    client = MlflowClient(tracking_uri=handle["uri"], registry_uri=handle["uri"])
    version = client.get_model_version("unit-model", "2")
    assert version.run_id == handle["run_id"] and version.source.startswith("models:/m-")
    model_id = version.source.split("/")[-1]
    held = {a.path for a in client.list_logged_model_artifacts(model_id, "artifacts")}
    assert held == {"artifacts/model.pt", "artifacts/model.json"}  # lineage: the published files
    logged = tmp_path / "store" / "mlartifacts" / "models" / model_id / "artifacts"  # the SQLite store's layout
    assert client.get_logged_model(model_id).artifact_location == logged.as_uri()
    signature = mlflow.models.Model.load(str(logged)).signature
    assert [c.name for c in signature.outputs.inputs] == list(OUTPUT_COLUMNS)

    gif, webp = (_encoded(image_bytes(4), fmt) for fmt in ("GIF", "WEBP"))
    images = [image_bytes(1), b"this is not an image", image_bytes(2, fmt="png"), image_bytes(3, size=(20, 90)),
              gif, webp, image_bytes(5, size=(100, 100)), base64.b64encode(image_bytes(1))]  # REST's base64 text
    answer = _predict_fresh(handle["uri"], "models:/unit-model/2", images, tmp_path)
    assert answer["stages"] == str(logged / "code" / "stages" / "__init__.py")  # the model's own copy of the code
    # read as the model's ETL read (GIF allowed, WEBP not, 5000 px at most): it had used serve's defaults
    good = [images[0], images[2], images[3], gif, images[0]]
    _check_rows(answer["frame"], _expected(str(model_dir), good),
                bad={1: "not_an_image", 5: "unsupported_format", 6: "decompression_bomb"})
    _check_rows(answer["list"], _expected(str(model_dir), good[:1]), bad={1: "not_an_image"})
    assert len(answer["frame"]) == 8 and set(answer["frame"][0]) == set(OUTPUT_COLUMNS)
    assert answer["index"] == [10 * (i + 1) for i in range(8)]  # the input's row labels stay on the answers
    rest = json.loads(answer["rest"], parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))["predictions"]
    assert [r["probability"] for r in rest][1] is None and rest[0]["probability"] > 0  # NaN had broken strict parsers
    assert "column named 'image'" in answer["second"] and "['other']" in answer["second"], answer["second"]


def _encoded(jpeg: bytes, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(buf, format=fmt)
    return buf.getvalue()


def _test_split_images(run_dir: Path, count: int) -> list[bytes]:
    """The original encoded files (JPEG/PNG) of the first `count` rows of the run's test split."""
    from stages.feed import streaming

    etl = run_dir / "etl"
    manifest = json.loads((etl / "manifest.json").read_text())
    refs = streaming.shard_refs(manifest, str(etl), "test", "parquet")
    rows = [row for ref in refs for row in streaming.read_shard(ref.uri, ref.format, with_path=True)][:count]
    assert len(rows) == count, f"the smoke run's test split holds {len(rows)} rows"
    source = Path(manifest["inputs"]["source"])  # rows name their file relative to the source
    return [(source / path).read_bytes() for _, path, _, _ in rows]


@pytest.mark.slow
def test_the_smoke_runs_registered_model_predicts_in_a_fresh_process(smoke_run, tmp_path):
    assert smoke_run.returncode == 0, smoke_run.stderr[-4000:]
    found = tracking.find(str(smoke_run.run_dir / "train"))
    assert found and found["model_version"], "the smoke run registered no model: see tracking warnings"
    images = _test_split_images(smoke_run.run_dir, 5)
    with_bad = [*images[:2], b"\x89PNG\r\n\x1a\n truncated", *images[2:]]
    answer = _predict_fresh(found["uri"], f"models:/{found['model_name']}/{found['model_version']}", with_bad,
                            tmp_path)
    assert "/artifacts/code/stages/" in answer["stages"]
    expected = _expected(str(smoke_run.run_dir / "train"), images)
    _check_rows(answer["frame"], expected, bad={2: ""})
    assert answer["frame"][2]["error"]  # a truncated PNG: its own row's reason, the batch goes on
    assert pd.DataFrame(answer["frame"])["class_index"].ge(0).sum() == len(images)
