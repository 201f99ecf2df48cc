"""Stage reuse: what makes `raymill run` recompute a stage or reuse it.

The end-to-end `raymill run --serve` with reruns is in tests/test_tracking.py (one pipeline run,
tracked on a real MLflow server, serves both)."""
from __future__ import annotations

from workflow import pipeline, preflight
from stages.common.config import load_config
from tests.conftest import REPO


def test_stage_reuse_checks_the_manifest_itself_and_the_source_listing(tmp_path):
    from tests.conftest import image_bytes, make_tree
    from stages.common.artifacts import Artifact, base_manifest, write_manifest
    from stages.common.config import section_dict

    src = tmp_path / "src"
    make_tree(src, per_class=2, bad=False)
    cfg = load_config(REPO / "configs/smoke.yaml", [f"run.source={src}", f"run.dir={tmp_path / 'run'}"])
    builds = []

    unread = []  # read_error rows the next build quarantines

    def build(out: str) -> Artifact:  # stands in for etl.run: publishes a manifest of this config
        builds.append(out)
        manifest = {**base_manifest("etl", section_dict(cfg.etl), {"source": str(src)}), "files": ["data.bin"],
                    "quarantine": {"reasons": {"read_error": unread.pop()} if unread else {}}}
        (tmp_path / "run" / "etl" / "data.bin").write_bytes(b"rows")
        write_manifest(out, manifest)
        return Artifact("etl", out, manifest)

    def reused(inputs=None) -> bool:
        return pipeline.stage("etl", cfg, cfg.etl, inputs or preflight.etl_inputs(cfg), build,
                              stale=pipeline.unread_files)[1]

    by_path = {"source": str(src)}
    assert not reused(by_path) and reused(by_path)
    # A manual `raymill etl --overwrite` at another image_size replaced the published manifest.
    other = section_dict(cfg.etl.model_copy(update={"image_size": 16}))
    write_manifest(str(tmp_path / "run" / "etl"), base_manifest("etl", other, {"source": str(src)}))
    assert not reused(by_path), "reused a manifest made with another config"
    assert not reused() and reused()
    (src / "cat" / "cat_new.jpg").write_bytes(image_bytes(1))  # images added to the same source path
    assert not reused() and reused()
    (tmp_path / "run" / "etl" / "data.bin").unlink()  # a file the manifest lists is gone
    assert not reused() and reused()
    # files it could not read (a permission since fixed leaves names, sizes and mtimes as they were)
    unread.append(2)
    assert not reused(by_path) and not reused(by_path) and reused(by_path)
    assert len(builds) == 7


def test_a_run_never_deletes_or_writes_beside_files_it_did_not_make(tmp_path):
    # a run.dir/etl made by hand had its files deleted; run.dir == run.source got config.yaml and
    # etl/stage.json written into the image tree before ETL refused it
    import pytest

    from tests.conftest import make_tree
    from stages.common.config import ConfigError

    src, run = tmp_path / "src", tmp_path / "run"
    make_tree(src, per_class=2, bad=False)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    with pytest.raises(ConfigError, match="choose a run.dir outside the input"):
        pipeline.run(load_config(REPO / "configs/smoke.yaml", [f"run.source={src}", f"run.dir={src}"]))
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
    (run / "etl").mkdir(parents=True)
    (run / "etl" / "precious.txt").write_text("x")
    cfg = load_config(REPO / "configs/smoke.yaml", [f"run.source={src}", f"run.dir={run}"])
    with pytest.raises(ConfigError, match="no raymill run wrote"):
        pipeline.run(cfg)
    (run / "config.yaml").write_text("my: important\n")  # a project's own: it had been replaced, the run gone on
    with pytest.raises(ConfigError, match="holds a config.yaml that no raymill run wrote"):
        pipeline.run(cfg)
    assert (run / "config.yaml").read_text() == "my: important\n"
    (run / "config.yaml").write_text("{}")  # a run.dir of an earlier run: its stage folders are checked one by one
    with pytest.raises(ConfigError, match="did not write"):
        pipeline.stage("etl", cfg, cfg.etl, preflight.etl_inputs(cfg), lambda out: None)
    assert (run / "etl" / "precious.txt").read_text() == "x"
    with pytest.raises(ConfigError, match="run.source"):  # a missing source: refused before config.yaml is rewritten
        pipeline.run(load_config(REPO / "configs/smoke.yaml", [f"run.source={tmp_path / 'none'}", f"run.dir={run}"]))
    assert (run / "config.yaml").read_text() == "{}"


def test_an_object_stores_folder_marker_is_no_file_and_clearing_keeps_the_lock(s3_bucket):
    """Ray Tune's storage writes zero-byte `prefix/` folder markers to S3 (the console's "Create
    folder" too). s3fs lists one as an entry of the folder itself: clearing a recomputed stage had
    removed it recursively, the whole prefix with the lock this run held, then failed on the next
    entry (FileNotFoundError, exit 1); and a marker alone had counted as someone's file."""
    import boto3

    from stages.common import storage
    from stages.common.config import S3Config
    from stages.common.locks import LOCK_NAME, foreign_files

    endpoint, bucket = s3_bucket
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for key in ("r1/train/", f"r1/train/{LOCK_NAME}", "r1/train/stage.json", "r1/train/curves.png",
                "r1/train/ray/", "r1/train/ray/x.json", "empty/"):
        client.put_object(Bucket=bucket, Key=key, Body=b"" if key.endswith("/") else b"x")
    fs, root = storage.filesystem(f"s3://{bucket}/r1/train", S3Config(endpoint_url=endpoint))
    pipeline._clear(fs, root, ours=True)
    left = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="r1/")["Contents"]}
    assert f"r1/train/{LOCK_NAME}" in left and not left & {"r1/train/stage.json", "r1/train/curves.png",
                                                           "r1/train/ray/x.json"}
    assert foreign_files(f"s3://{bucket}/empty", lambda rel: False, S3Config(endpoint_url=endpoint)) == []
