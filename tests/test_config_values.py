"""Config values: every shipped config, bad keys and values named with their fix, config files
that say less than they seem to, a --set key a command does not read, cluster and dashboard
addresses refused before Ray (no Ray session)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from stages.common.config import ConfigError, load_config
from tests.conftest import REPO, make_tree

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.etl.image_size > 0


@pytest.mark.parametrize("override, fragment", [
    ("etl.image_sise=32", "unknown config key 'etl.image_sise'"),
    ("trian.epochs=2", "unknown config key 'trian'"),
    ("train.epochs=two", "config key 'train.epochs'"),
    ("etl.formats=[zip]", "config key 'etl.formats.0'"),
    ("tune.search_space.lr.type=gaussian", "config key 'tune.search_space.lr.type'"),
    ("etl.formats=[]", "config key 'etl.formats'"),  # would publish a dataset of no shards
    ("etl.formats=[parquet,parquet]", "list each shard format once"),  # would list every shard twice
    ("etl.allowed_formats=[jpg,png]", r"JPG \(did you mean JPEG\?\): not a format name Pillow opens"),
    ("run.dir=s3://bucket//runs", "config key 'run.dir'"),  # S3 would keep the key '/runs'
    ("train.storage_path=s3:///ray", "empty path segment or no bucket"),
    ("run.dir=s3:/bucket/runs", "looks like a URI with a slash missing"),  # was a local folder './s3:/bucket/runs'
    ("run.source=S3://bucket/images", "write it in lower case: s3://"),
    ("run.source=s3//bucket/images", "colon missing"),  # was a local folder './s3/bucket/images'
    ("run.dir=FILE:///tmp/runs", "write it in lower case: file://"),
    ("train.init_from=gs://bucket/w.pt", "unsupported scheme 'gs://'"),
    ("etl.formats=parquet", "takes a list"),
    ("etl.allowed_formats=gif", "write etl.allowed_formats=[gif], items separated by commas"),
    ("run.source=", "config key 'run.source': Value error, is empty"),
    ("train.init_from=", "null for random weights"),  # had started Ray, then looked for '/model.json'
    ("train.lr=[1", "override 'train.lr=[1': the value is not valid YAML"),  # these three had been tracebacks
    ("run.name=*x", "quote it as a string"),
    ("tune.max_epochs=null", "tune.max_epochs must be a whole number of epochs"),
    ("ray.address=bad", "config key 'ray.address': Value error, not a cluster address"),  # had failed in ray.init
    ("ray.object_store_memory_mb=-1", "config key 'ray.object_store_memory_mb'"),
    ("serve.app_name=", "config key 'serve.app_name'"),  # these had been refused after Ray's start, or untracked
    ("tracking.experiment=", "config key 'tracking.experiment': Value error, is empty"),
    ("tracking.model_name=a/b", "which MLflow refuses in a model's name"),
])
def test_bad_keys_name_the_path(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace(".", r"\.")):
        load_config(REPO / "configs/smoke.yaml", [override])


def test_allowed_formats_are_pillow_names_in_any_case():
    assert load_config(None, ["etl.allowed_formats=[jpeg,Png,JPEG]"]).etl.allowed_formats == ("JPEG", "PNG")


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.etl.image_size = 3


def test_config_files_that_say_less_than_they_seem_to(tmp_path, caplog):
    """A key twice (YAML keeps the last silently), a tab, a list, an empty file."""
    cases = {"dup.yaml": ("train:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n", "'train.lr' is set twice (line 4)"),
             "dup_section.yaml": ("train:\n  lr: 0.1\netl:\n  image_size: 32\ntrain:\n  epochs: 2\n",
                                  "'train' is set twice (line 5)"),
             "open.yaml": ("train:\n  lr: [0.1\n", "open.yaml', line 3"),
             "tab.yaml": ("train:\n\tlr: 0.1\n", "indent with spaces, not tabs"),
             "list.yaml": ("- train\n", "must hold a mapping of sections")}
    for name, (text, fragment) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            load_config(tmp_path / name)
    (tmp_path / "utf16.yaml").write_bytes("train:\n  lr: 0.1\n".encode("utf-16"))  # had been a traceback
    for path, fragment in ((tmp_path / "utf16.yaml", "is not UTF-8 text"), (tmp_path, "is a folder")):
        with pytest.raises(ConfigError, match=fragment):
            load_config(path)
    (tmp_path / "empty.yaml").write_text("# nothing set yet\n")
    assert load_config(tmp_path / "empty.yaml") == load_config(None)
    assert "config file" in caplog.text and "is empty: every key has its default" in caplog.text


def test_a_set_key_the_command_does_not_read_is_said():
    """`raymill train --set etl.image_size=64` had trained at the data's own size without a word."""
    from workflow.cli_args import build_parser, unread_overrides

    parse = build_parser().parse_args
    said = unread_overrides(parse(["train", "--data", "d", "--output", "o", "--set", "etl.image_size=64",
                                   "--set", "train.epochs=2"]))
    assert said.startswith("raymill train: --set etl.image_size does nothing here: it reads train.*"), said
    assert unread_overrides(parse(["train", "--data", "d", "--output", "o", "--set", "train.epochs=2"])) is None
    assert unread_overrides(parse(["serve", "--model", "m", "--set", "serve.port=8100"])) is None
    assert "infer.batch_size" in unread_overrides(parse(["export", "--model", "m", "--output", "o",
                                                         "--set", "infer.batch_size=8"]))


def test_a_cluster_address_where_nothing_answers_exits_2_at_once(tmp_path):
    """ray.init retries a GCS that is not there for good: `raymill etl --set ray.address=127.0.0.1:1`
    had printed Ray's "Failed to connect to GCS" lines for 10 minutes, and nothing of its own."""
    from tests.conftest import free_port

    make_tree(tmp_path / "src", per_class=2, bad=False)
    done = subprocess.run([sys.executable, "-m", "workflow", "etl", "--input", str(tmp_path / "src"), "--output",
                           str(tmp_path / "out"), "--set", f"ray.address=127.0.0.1:{free_port()}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nothing answers there" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    # `raymill run`: before config.yaml, ETL and MLflow's store (a train had left OUT/mlflow.db)
    done = subprocess.run([sys.executable, "-m", "workflow", "run", "--set", f"run.source={tmp_path / 'src'}",
                           "--set", f"run.dir={tmp_path / 'run'}", "--set", f"ray.address=127.0.0.1:{free_port()}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nothing answers there" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()
    # a dashboard host this machine does not have: it had been a gaierror from Ray's start, exit 1
    done = subprocess.run([sys.executable, "-m", "workflow", "etl", "--input", str(tmp_path / "src"), "--output",
                           str(tmp_path / "out"), "--set", "ray.dashboard_host=no-such-host.invalid"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "ray.dashboard_host='no-such-host.invalid'" in done.stderr, done.stderr[-2000:]
