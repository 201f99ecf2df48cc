"""`raymill run --serve` end to end on the smoke config, then a rerun that reuses every stage."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from workflow import demo_data, pipeline
from workflow.core.config import load_config
from tests.conftest import REPO, free_port


def test_run_with_serve_end_to_end_then_reuse(tmp_path, ray_session, caplog):
    demo_data.generate(tmp_path / "src", images=200, seed=4)
    overrides = [f"run.source={tmp_path / 'src'}", f"run.dir={tmp_path / 'run'}", f"serve.port={free_port()}",
                 "serve.app_name=pipeline-test"]
    cfg = load_config(REPO / "configs/smoke.yaml", overrides)
    from stages import serve

    try:
        report = pipeline.run(cfg, serve=True)
    finally:
        serve.shutdown(cfg.serve)
        # Serve's proxy keeps its port for the whole Ray session; later tests need their own.
        from ray import serve as ray_serve

        ray_serve.shutdown()
    run = tmp_path / "run"
    for name in ("config.yaml", "report.json", "report.md", "etl/manifest.json", "train/model.pt",
                 "infer/predictions.parquet"):
        assert (run / name).exists(), name
    saved = json.loads((run / "report.json").read_text())
    assert saved["stages"][0]["rows"] == 200 and [s["stage"] for s in saved["stages"]] == ["etl", "train", "infer"]
    assert saved["serve"]["requests"] > 0 and saved["serve"]["p50_ms"] > 0
    assert 0 <= saved["test_accuracy"] <= 1 and 0 <= saved["input_stall_fraction"] <= 1
    assert report["test_accuracy"] == saved["test_accuracy"]

    caplog.set_level(logging.INFO)
    pipeline.run(cfg)  # same config and inputs: nothing is recomputed
    reused = [r.getMessage() for r in caplog.records if "reusing" in r.getMessage()]
    assert len(reused) == 3, reused
    changed = load_config(REPO / "configs/smoke.yaml", overrides + ["infer.top_k=2"])
    caplog.clear()
    pipeline.run(changed)  # only the stage whose config changed runs again
    reused = [r.getMessage().split(":")[0] for r in caplog.records if "reusing" in r.getMessage()]
    assert reused == ["etl", "train"]


def test_stage_reuse_checks_the_manifest_itself_and_the_source_listing(tmp_path):
    from tests.conftest import image_bytes, make_tree
    from workflow.core.artifacts import Artifact, base_manifest, write_manifest
    from workflow.core.config import section_dict

    src = tmp_path / "src"
    make_tree(src, per_class=2, bad=False)
    cfg = load_config(REPO / "configs/smoke.yaml", [f"run.source={src}", f"run.dir={tmp_path / 'run'}"])
    builds = []

    def build(out: str) -> Artifact:  # stands in for etl.run: publishes a manifest of this config
        builds.append(out)
        manifest = base_manifest("etl", section_dict(cfg.etl), {"source": str(src)})
        write_manifest(out, manifest)
        return Artifact("etl", out, manifest)

    def reused(inputs=None) -> bool:
        return pipeline.stage("etl", cfg, cfg.etl, inputs or pipeline.etl_inputs(cfg), build)[1]

    by_path = {"source": str(src)}
    assert not reused(by_path) and reused(by_path)
    # A manual `raymill etl --overwrite` at another image_size replaced the published manifest.
    other = section_dict(cfg.etl.model_copy(update={"image_size": 16}))
    write_manifest(str(tmp_path / "run" / "etl"), base_manifest("etl", other, {"source": str(src)}))
    assert not reused(by_path), "reused a manifest made with another config"
    assert not reused() and reused()
    (src / "cat" / "cat_new.jpg").write_bytes(image_bytes(1))  # images added to the same source path
    assert not reused() and reused()
    assert len(builds) == 4
