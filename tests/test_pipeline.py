"""`raymill run --serve` end to end on the smoke config, then a rerun that reuses every stage."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from workflow import demo_data, pipeline
from workflow.config import load_config
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
