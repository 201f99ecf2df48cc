"""Config loading and the CLI's exit codes (in-process where Ray is needed, subprocess where not)."""
from __future__ import annotations

import hashlib
import json
import os
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workflow.__main__ import main
from stages.common.config import ConfigError, load_config
from tests.conftest import BAD_FILES, REPO, lock_held, make_tree

def killed_runs(tmp_path: Path) -> Path:
    """A folder of `raymill run` folders, one killed before its ETL published (stage.json, no manifest)."""
    runs = tmp_path / "runs"
    (runs / "a" / "etl").mkdir(parents=True)
    (runs / "a" / "etl" / "stage.json").write_text('{"key": "k"}')
    (runs / "a" / "config.yaml").write_text("run: {}")
    return runs


def run_like(tmp_path: Path, ds: Path) -> Path:
    """A folder laid out as `raymill run` leaves one: a stage's output per sub-folder."""
    import shutil

    run = tmp_path / "run-like"
    (run / "etl").mkdir(parents=True)
    shutil.copy(ds / "manifest.json", run / "etl" / "manifest.json")
    (run / "train").mkdir()
    (run / "report.md").write_text("# a run")
    return run


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflow", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_config_error_exits_2_with_key_path():
    proc = _cli("run", "--config", "configs/smoke.yaml", "--set", "etl.image_sise=3")
    assert proc.returncode == 2
    assert "etl.image_sise" in proc.stderr and "valid keys" in proc.stderr


def test_a_search_that_cannot_work_is_refused_before_ray(tmp_path, capsys):
    """Its check needs the config only: `raymill run` had started Ray and run ETL first (13 s)."""
    smoke, search = str(REPO / "configs/smoke.yaml"), ["--set", "tune.grace_period=5", "--set", "tune.max_epochs=2"]
    assert main(["run", "--config", smoke, "--set", "run.source=data/none", "--set", f"run.dir={tmp_path / 'run'}",
                 "--set", "tune.enabled=true", *search]) == 2
    assert "tune.grace_period=5 exceeds tune.max_epochs=2" in capsys.readouterr().err
    assert main(["tune", "--data", str(tmp_path / "no-data"), "--output", str(tmp_path / "t"), *search]) == 2
    assert "tune.grace_period=5 exceeds tune.max_epochs=2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "t").exists()


def test_help_and_usage_errors():
    for cmd in ("demo-data", "etl", "verify", "run"):
        assert _cli(cmd, "--help").returncode == 0
    assert _cli("etl").returncode == 2  # argparse: missing --input/--output
    assert _cli("nonsense").returncode == 2
    proc = _cli("train", "--data", "s3://bucket/data", "--output", "s3://bucket//out")
    assert proc.returncode == 2 and "argument --output" in proc.stderr and "single slashes" in proc.stderr
    for args in (["etl", "--input", "data/demo", "--output", "s3:/bucket/x"], ["demo-data", "gs:/bucket/x"]):
        proc = _cli(*args)
        assert proc.returncode == 2 and "a slash missing" in proc.stderr, proc.stderr
    proc = _cli("demo-data", "s3://bucket/x")
    assert proc.returncode == 2 and "demo-data writes a local folder" in proc.stderr, proc.stderr
    assert not (REPO / "s3:").exists() and not (REPO / "gs:").exists()


def _serve_before_ray(model: Path, *extra: str) -> tuple[list[str], str]:
    code = ("import sys; from workflow.__main__ import main; "
            f"rc = main(['serve', '--model', {str(model)!r}, *{list(extra)!r}]); print(rc, 'ray' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    return proc.stdout.split(), proc.stderr


def test_serve_refuses_a_missing_or_damaged_model_before_ray_starts(tmp_path):
    # each had started Ray and Serve, failed the deploy after 42-43 s on 2 cores saying only "Failed to
    # update the deployments", and exited 1
    assert _serve_before_ray(tmp_path) == (["2", "False"], f"raymill serve: error: no model.json in '{tmp_path}'; "
                                           "pass a train or tune output folder as --model\n")
    (tmp_path / "model.json").write_text(json.dumps({"weights_sha256": hashlib.sha256(b"weights").hexdigest()}))
    out, err = _serve_before_ray(tmp_path)
    assert out == ["2", "False"] and "holds model.json but no model.pt" in err
    (tmp_path / "model.pt").write_bytes(b"weightz")  # one byte changed
    out, err = _serve_before_ray(tmp_path)
    assert out == ["1", "False"] and "model.pt in" in err and "does not match model.json's checksum" in err
    # a port another program listens on (Serve's proxy had failed to bind it after Ray's start: exit 1)
    import socket

    (tmp_path / "model.pt").write_bytes(b"weights")
    with socket.socket() as theirs:
        theirs.bind(("127.0.0.1", 0))
        theirs.listen()
        port = theirs.getsockname()[1]
        out, err = _serve_before_ray(tmp_path, "--port", str(port))
    assert out == ["2", "False"] and f"serve.port={port} on 127.0.0.1 is not free" in err, err
    # a port another raymill serve has claimed but not bound yet (its Ray still starting): both had
    # bound it with SO_REUSEPORT, and clients were split between two models
    from stages.common.config import ServeConfig
    from stages.serve import endpoint

    claim = endpoint.claim_port(ServeConfig(port=port))
    try:
        out, err = _serve_before_ray(tmp_path, "--port", str(port))
    finally:
        os.close(claim)
    assert out == ["2", "False"] and f"serve.port={port} is taken by another raymill serve or run --serve " \
        f"(pid {os.getpid()})" in err, err
    (tmp_path / "model.json").write_text('{"architecture": ')  # cut short: had been a bare JSONDecodeError, exit 1
    out, err = _serve_before_ray(tmp_path)
    assert out == ["2", "False"] and f"model.json in '{tmp_path}' is not a raymill model.json" in err, err


def test_demo_data_and_verify_exit_codes_without_ray(tmp_path):
    proc = _cli("demo-data", str(tmp_path / "d"), "--images", "20")
    assert proc.returncode == 0, proc.stderr
    refused = _cli("verify", str(tmp_path / "d"))  # an image folder: a usage error
    assert refused.returncode == 2 and "is no ETL output (no manifest.json, no shards/)" in refused.stderr, refused.stderr
    (tmp_path / "d" / "shards").mkdir()  # a killed ETL's output: a problem found
    assert _cli("verify", str(tmp_path / "d")).returncode == 1


def test_etl_cli_exit_codes(tmp_path, ray_session, capsys):
    src = tmp_path / "src"
    make_tree(src, per_class=3)
    out = tmp_path / "out"
    assert main(["etl", "--input", str(src), "--output", str(out), "--format", "tar",
                 "--set", "etl.image_size=16"]) == 0
    assert f"quarantined={len(BAD_FILES)}" in capsys.readouterr().out
    assert all(p.suffix != ".parquet" for p in out.rglob("*"))
    assert main(["etl", "--input", str(src), "--output", str(out)]) == 2  # exists
    assert main(["etl", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o2")]) == 2
    for empty in (["--input", "", "--output", str(tmp_path / "o3")], ["--input", str(src), "--output", " "]):
        with pytest.raises(SystemExit) as usage:  # once the current folder: read, or written into
            main(["etl", *empty])
        assert usage.value.code == 2 and "is empty; name a folder" in capsys.readouterr().err
    shard = next(out.glob("shards/tar/split=*/*.tar"))
    for command in (["etl", "--input", str(src)], ["infer", "--model", str(out), "--data", str(out)]):
        with pytest.raises(SystemExit) as usage:  # was NotADirectoryError, exit 1, once Ray was up
            main([*command, "--output", str(shard / "preds")])
        assert usage.value.code == 2 and f"'{shard}' is a file; name a folder" in capsys.readouterr().err
    assert main(["verify", str(out)]) == 0
    killed = shard.parent / "train-00099-00-20990101T000000-abcdef.tar"  # a killed run's, by its name
    killed.write_bytes(b"half a shard")
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0  # the dataset is whole; the note says what a folder read would count
    assert "verify: note: 1 file(s) of killed runs that no manifest names" in capsys.readouterr().out
    killed.unlink()
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["verify", str(out)]) == 1
    assert shard.name in capsys.readouterr().out


def test_a_model_that_cannot_take_the_image_size_exits_2_before_any_work(tmp_path, ray_session, capsys):
    src, ds, smoke = tmp_path / "src", tmp_path / "ds", str(REPO / "configs/smoke.yaml")
    make_tree(src, per_class=3, bad=False)
    assert main(["etl", "--input", str(src), "--output", str(ds), "--set", "etl.image_size=8"]) == 0
    capsys.readouterr()
    assert main(["train", "--data", str(ds), "--output", str(tmp_path / "m"), "--config", smoke]) == 2
    assert "train.model=small_cnn needs images of at least 15 px" in capsys.readouterr().err
    assert not list((tmp_path / "m").rglob("*.pt"))
    # the pipeline refuses before ETL: nothing under run.dir is written
    assert main(["run", "--config", smoke, "--set", f"run.source={src}", "--set", f"run.dir={tmp_path / 'run'}",
                 "--set", "etl.image_size=8"]) == 2
    assert "etl.image_size>=15" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_gpu_asked_of_a_local_ray_with_none_exits_2_before_mlflows_store(tmp_path, ray_session, capsys):
    """It had been refused by the plan after Ray's start, leaving OUT/mlflow.db behind."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    src, ds, smoke = tmp_path / "src", tmp_path / "ds", str(REPO / "configs/smoke.yaml")
    make_tree(src, per_class=3, bad=False)
    assert main(["etl", "--input", str(src), "--output", str(ds), "--set", "etl.image_size=16"]) == 0
    capsys.readouterr()
    for command in ("train", "tune"):
        assert main([command, "--data", str(ds), "--output", str(tmp_path / command), "--config", smoke,
                     "--set", "train.use_gpu=true"]) == 2
        assert "train.use_gpu=true, but this machine has no GPU torch can use" in capsys.readouterr().err
        assert not (tmp_path / command / "mlflow.db").exists()
    # someone's folder (their own model.pt, their notes): refused, untouched (train had overwritten model.pt)
    for command, files in (("train", {"model.pt": "my weights"}), ("tune", {"notes.txt": "mine", "model.pt": "w"})):
        theirs = tmp_path / f"theirs-{command}"
        theirs.mkdir()
        for name, text in files.items():
            (theirs / name).write_text(text)
        assert main([command, "--data", str(ds), "--output", str(theirs), "--config", smoke]) == 2
        assert f"holds files that raymill {command} did not write" in capsys.readouterr().err
        assert {p.name: p.read_text() for p in theirs.iterdir()} == files  # nothing written there, nothing replaced
    from stages.train.checks import check_output_files

    ours = tmp_path / "ours"  # a train output's own names pass (ledger.json, SQLite's journal had been refused)
    ours.mkdir()
    for name in ("ledger.json", "mlflow.db", "mlflow.db-journal", "metrics.jsonl", "model.json", "model.pt"):
        (ours / name).write_text("x")
    check_output_files(str(ours), "train")
    # a damaged shard: refused before Ray and MLflow's store (it had been 9 s later, leaving a FAILED run)
    damaged = tmp_path / "damaged"
    shutil.copytree(ds, damaged)
    shard = next((damaged / "shards").rglob("train-*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert main(["train", "--data", str(damaged), "--output", str(tmp_path / "dt"), "--config", smoke]) == 1
    assert f"refusing to train on '{damaged}'" in capsys.readouterr().err
    assert not (tmp_path / "dt" / "mlflow.db").exists()


def test_a_missing_output_bucket_says_where_to_look(tmp_path, s3_bucket, ray_session, capsys):
    endpoint, _ = s3_bucket
    make_tree(tmp_path / "src", per_class=2, bad=False)
    code = main(["etl", "--input", str(tmp_path / "src"), "--output", "s3://no-such-bucket-here/ds",
                 "--set", f"s3.endpoint_url={endpoint}", "--set", "etl.image_size=16"])
    err = capsys.readouterr().err  # a config error (exit 2) naming the output, before Ray or ETL
    assert code == 2 and "output 's3://no-such-bucket-here/ds' cannot be written" in err, err
    assert "bucket does not exist" in err and "create the bucket, or fix the s3:// path" in err
    code = main(["run", "--set", f"run.source={tmp_path / 'src'}", "--set", "run.dir=s3://no-such-bucket-here/r",
                 "--set", f"s3.endpoint_url={endpoint}"])
    assert code == 2 and "run.dir 's3://no-such-bucket-here/r' cannot be written" in capsys.readouterr().err


def test_a_split_the_run_needs_that_is_empty_exits_2_naming_it(tmp_path, ray_session, capsys):
    # no val rows: val_acc 0.000 of 0 images had ranked the checkpoints (the first epoch's published)
    src, ds, smoke = tmp_path / "src", tmp_path / "ds", str(REPO / "configs/smoke.yaml")
    make_tree(src, per_class=3, bad=False)
    shares = ["--set", "etl.split.train=0.9", "--set", "etl.split.val=0", "--set", "etl.split.test=0.1"]
    assert main(["etl", "--input", str(src), "--output", str(ds), *shares]) == 0
    assert "the val split is empty, and `raymill train` refuses such data" in capsys.readouterr().err  # said first
    assert main(["train", "--data", str(ds), "--output", str(tmp_path / "m"), "--config", smoke,
                 "--set", "train.batch_size=500"]) == 2
    err = capsys.readouterr().err
    assert "no val rows" in err and "or raise etl.split.val (the val split is hashed from the files)" in err, err
    assert re.search(r"train.batch_size=500 is more than the \d+ train rows: each epoch is one step", err), err
    assert not (tmp_path / "m" / "model.pt").exists()
    # the pipeline refuses before ETL; after ETL, a split its tree left empty is refused before training
    assert main(["run", "--config", smoke, "--set", f"run.source={src}", "--set", f"run.dir={tmp_path / 'run'}",
                 *shares]) == 2
    assert "etl.split.val=0" in capsys.readouterr().err and not (tmp_path / "run").exists()
    from workflow import preflight

    with pytest.raises(ConfigError, match=r"no images in the test split.*etl\.split\.test"):
        preflight.needed_splits(load_config(smoke), {"train": {"a": 3}, "val": {"a": 1}, "test": {}})


def test_one_class_in_a_wrapper_folder_is_named_by_etl_and_refused_by_train(tmp_path, ray_session, capsys):
    """An archive unpacked into <input>/dataset/<class>/: ETL reads one class, says which folder to
    read instead, and training refuses it (exit 2) instead of publishing a model of one answer."""
    src, ds, smoke = tmp_path / "src", tmp_path / "ds", str(REPO / "configs/smoke.yaml")
    make_tree(src / "dataset", per_class=3, bad=False)
    assert main(["etl", "--input", str(src), "--output", str(ds), "--set", "etl.image_size=16"]) == 0
    assert f"point the input (--input, or run.source) at '{src}/dataset'" in capsys.readouterr().err
    assert main(["train", "--data", str(ds), "--output", str(tmp_path / "m"), "--config", smoke]) == 2
    assert "train rows of one class only (dataset)" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # refused before Ray and MLflow's store (it had left an mlflow.db)


def test_etl_warns_of_a_class_with_images_but_no_train_rows(caplog):
    from stages.etl import stage as etl

    manifest = {"classes": ["a", "b"], "counts": {"train": {"a": 3}, "val": {"b": 1}, "test": {}},
                "totals": {"files_in": 4, "rows_out": 4, "quarantined": 0},
                "metrics": {"images_per_s": 1.0, "mb_written": 0.0, "seconds": 1.0}}
    with caplog.at_level(logging.WARNING, logger="stages.etl.stage"):
        etl._log_summary(manifest)
    assert "1 class(es) have images but none in the train split (b)" in caplog.text
    etl._log_summary({**manifest, "classes": ["a"], "counts": {"train": {"a": 3}, "val": {}, "test": {}}})
    assert "one class (a): a classifier needs at least two" in caplog.text
    many = [f"c{i:04d}" for i in range(2000)]  # one warning had named 400 of 2,000 classes in 3,737 characters
    caplog.clear()
    etl._log_summary({**manifest, "classes": ["a", *many], "counts": {"train": {"a": 3}, "val": dict.fromkeys(many, 1),
                                                                      "test": {}}})
    assert "2000 class(es) have images but none in the train split (c0000, " in caplog.text
    assert "c0009 and 1990 more)" in caplog.text and max(map(len, caplog.text.splitlines())) < 600


def test_a_locked_output_is_refused_before_ray_starts(tmp_path, ray_session, capsys):
    """`raymill train` into an output another run holds: exit 2 naming the holder, and no Ray of
    its own started first (the lock is the command's first step, not the stage's)."""
    import os

    src, ds, out = tmp_path / "src", tmp_path / "ds", tmp_path / "m"
    make_tree(src, per_class=3, bad=False)
    assert main(["etl", "--input", str(src), "--output", str(ds), "--set", "etl.image_size=16"]) == 0
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(REPO)}
    with lock_held(out, "train") as holder:
        run = subprocess.run([sys.executable, "-m", "workflow", "train", "--data", str(ds), "--output", str(out)],
                             env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"pid {holder.pid}" in run.stderr
    assert "ray dashboard" not in run.stderr and "[raymill] ray:" not in run.stderr, run.stderr
    # a second `raymill run` into one run.dir (another source) had re-run ETL under the first one's
    # training: its shards gone. Refused at once, naming run.dir and the holder, nothing written
    with lock_held(tmp_path / "run", "pipeline") as holder:
        run = subprocess.run([sys.executable, "-m", "workflow", "run", "--set", f"run.source={src}",
                              "--set", f"run.dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True,
                             timeout=300, cwd=REPO)
    assert run.returncode == 2 and f"run.dir '{tmp_path / 'run'}' is locked" in run.stderr, run.stderr
    assert f"pid {holder.pid}" in run.stderr and not (tmp_path / "run" / "config.yaml").exists()


def test_an_unusable_init_source_or_a_published_etl_output_exits_2_before_ray_starts(tmp_path, ray_session):
    """train.init_from that is missing, or not a weights file, is refused by the CLI's preflight:
    exit 2 naming the key, no Ray of its own started and nothing written. It had been refused ~20 s
    later (2-core box), once Ray and the trainer were up."""
    import os

    src, ds = tmp_path / "src", tmp_path / "ds"
    make_tree(src, per_class=3, bad=False)
    assert main(["etl", "--input", str(src), "--output", str(ds), "--set", "etl.image_size=16"]) == 0
    (tmp_path / "photo.pth").write_bytes(b"\xff\xd8\xff\xe0" + bytes(64))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(REPO)}
    for command, init, fragment in [
            (["train", "--data", str(ds), "--output", str(tmp_path / "m")], tmp_path / "none.pth", "does not exist"),
            (["run", "--set", f"run.source={src}", "--set", f"run.dir={tmp_path / 'run'}"], tmp_path / "photo.pth",
             "is not a readable torch.save file")]:
        run = subprocess.run([sys.executable, "-m", "workflow", *command, "--set", f"train.init_from={init}"],
                             env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert run.returncode == 2 and "train.init_from:" in run.stderr and fragment in run.stderr, run.stderr
        assert str(init) in run.stderr, run.stderr
        assert "[raymill] ray:" not in run.stderr, run.stderr
    assert not (tmp_path / "m").exists() and not (tmp_path / "run").exists()
    # so is `raymill etl` into a published output without --overwrite (it was refused once Ray was up)
    run = subprocess.run([sys.executable, "-m", "workflow", "etl", "--input", str(src), "--output", str(ds)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 2 and "already holds a published dataset" in run.stderr, run.stderr
    assert "[raymill] ray:" not in run.stderr, run.stderr
    # and into a folder of someone's files, and from inside an ETL output (both had waited for Ray)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    (tmp_path / "killed" / "shards").mkdir(parents=True)
    (tmp_path / "killed" / "shards" / "train-00000-x.parquet").write_bytes(b"half a shard")
    for args, fragment in [(["--input", str(src), "--output", str(tmp_path / "notes")], "did not write (e.g. 'a.txt')"),
                           (["--input", str(src), "--output", str(tmp_path / "killed")], "is not empty; pass --overwrite"),
                           (["--input", str(ds / "shards"), "--output", str(tmp_path / "e2" / "deep")],
                            f"is inside the raymill.etl output '{ds}'"),
                           # into another stage's output, and from a run folder (both had run, exit 0 / 1)
                           (["--input", str(src), "--output", str(ds / "sub")],
                            f"output '{ds / 'sub'}' is inside the raymill.etl output '{ds}'"),
                           (["--input", str(run_like(tmp_path, ds)), "--output", str(tmp_path / "e3")],
                            "holds raymill's own files ('etl' is a raymill.etl output)"),
                           (["--input", str(killed_runs(tmp_path)), "--output", str(tmp_path / "e3")],
                            "('a' is a `raymill run` folder)")]:
        run = subprocess.run([sys.executable, "-m", "workflow", "etl", *args], env=env, capture_output=True,
                             text=True, timeout=300, cwd=REPO)
        assert run.returncode == 2 and fragment in run.stderr and "[raymill] ray:" not in run.stderr, run.stderr
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine" and (tmp_path / "killed" / "shards").exists()
    assert not (tmp_path / "e2").exists() and not (tmp_path / "e3").exists()  # nor folders the lock made
    assert not (ds / "sub").exists()
    run = subprocess.run([sys.executable, "-m", "workflow", "run", "--set", f"run.source={ds}", "--set",
                          f"run.dir={tmp_path / 'r2'}"], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 2 and "is a raymill.etl output" in run.stderr, run.stderr
    assert "[raymill] ray:" not in run.stderr and not (tmp_path / "r2").exists(), run.stderr
    # a run.dir inside an ETL output: refused before config.yaml, MLflow's store or Ray (named run.dir)
    run = subprocess.run([sys.executable, "-m", "workflow", "run", "--set", f"run.source={src}", "--set",
                          f"run.dir={ds / 'run'}"], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 2 and f"is inside the raymill.etl output '{ds}'; choose a run.dir" in run.stderr, run.stderr
    assert "[raymill] ray:" not in run.stderr and not (ds / "run").exists(), run.stderr


def test_a_second_ctrl_c_exits_at_once_with_one_line_not_tracebacks(tmp_path):
    """The first SIGINT stops the command cleanly; a second one during that stop exits 130 at once.
    Two in a row had printed a traceback for each frame they hit (`raymill serve`: three)."""
    import signal
    import time

    from tests.conftest import interruptible

    proc = subprocess.Popen(interruptible("workflow", "demo-data", str(tmp_path / "d"), "--images", "100000"),
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline and not any((tmp_path / "d").glob("*/*")):  # writing images: interrupt it
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    assert out.startswith("raymill demo-data: interrupted") or out.startswith("raymill: interrupted again"), out


def test_an_input_that_is_not_there_is_not_offered_to_etl(tmp_path):
    """A missing --data (a typo, a bucket that is not there) had been told to run ETL on it."""
    from stages.common.artifacts import InputNotPublishedError, load_input

    with pytest.raises(InputNotPublishedError, match="'.*gone' does not exist; pass a raymill etl output folder$"):
        load_input(str(tmp_path / "gone"), "etl")
    (tmp_path / "photos").mkdir()
    with pytest.raises(InputNotPublishedError, match="run `raymill etl --input .*photos --output <dataset>` first"):
        load_input(str(tmp_path / "photos"), "etl")
