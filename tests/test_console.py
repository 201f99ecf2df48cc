"""The console a person reads: `raymill run` on the smoke config, as a subprocess, like `make run`.

Bounds its line count, checks every epoch line appears once, no Ray object reprs, the summary
table last, and that the default SQLite MLflow store in the run folder holds what `make run`
promises (per-epoch metrics, the model, the infer accuracy).
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from stages.common import console, tracking
from workflow import report

MAX_LINES = 60  # the target for `make run` after pip's own output
# what a person takes for an error: glog's "E <pid> <tid>]" (Ray's C++), a traceback, any warning
ERRORISH = re.compile(r"(^|[\[\s])E \d+ \d+\]|^E |Traceback|warning", re.IGNORECASE)
REPRS = re.compile(r"\b(TrainingReport|Checkpoint|Result|ObjectRef|ActorHandle|Dataset)\(")


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_DATA_DISABLE_PROGRESS_BARS", None)  # the user's default, not the test suite's
    return subprocess.run([sys.executable, "-m", "workflow", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.slow
def test_run_console_is_short_and_tracked(smoke_run):
    done, run_dir = smoke_run, smoke_run.run_dir
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # stdout carries only the summary; stderr the progress lines (the order within each is kept)
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) <= MAX_LINES, "\n".join(lines)
    assert not REPRS.search(output), REPRS.search(output).group(0)
    epochs = [line for line in lines if "train: epoch" in line]
    assert [re.search(r"epoch (\d+)/2", line).group(1) for line in epochs] == ["1", "2"], epochs
    assert "train: epoch" not in done.stdout  # progress on stderr from either host (a trial actor's had been on stdout)
    assert "Reporting training result" not in output and "Execution plan of Dataset" not in output
    stdout = done.stdout.strip().splitlines()
    start = next(i for i, line in enumerate(stdout) if line.startswith("raymill run smoke:"))
    assert stdout[start + 1].startswith("| stage |") and stdout[-1].startswith("mlflow: run ")  # last
    assert "| infer |" in done.stdout and "report.md" in done.stdout
    # the report says where the train stage's seconds went: named parts that add up to them
    saved = json.loads((run_dir / "report.json").read_text())
    split, train_s = saved["train_seconds_split"], next(s["seconds"] for s in saved["stages"] if s["stage"] == "train")
    assert split and sum(split.values()) == pytest.approx(train_s, abs=0.05) and min(split.values()) > -0.05, split
    assert "Where the train stage's" in (run_dir / "report.md").read_text()
    # ... and where the whole run's went: before the first stage, each stage, the rest
    whole = saved["run_seconds_split"]
    assert sum(whole.values()) == pytest.approx(saved["seconds"], abs=0.1) and min(whole.values()) > -0.05, whole
    assert list(whole)[:5] == [next(iter(whole)), report.RAY_START, "etl", "train", "infer"], whole
    assert list(whole)[0].startswith("before the first stage") and whole[report.RAY_START] > 0.5
    assert "\x1b[" not in output  # a pipe gets no colour codes around Ray's worker prefixes
    assert "(raymill_train pid=" in output or "(RayTrainWorker pid=" in output  # ... and the prefixes stay
    looks_bad = [line for line in lines if ERRORISH.search(line)]
    assert not looks_bad, "a clean run printed lines that look like errors:\n" + "\n".join(looks_bad)

    from mlflow import MlflowClient

    found = tracking.find(str(run_dir / "train"))
    assert found["uri"] == f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=found["uri"], registry_uri=found["uri"])
    run = client.get_run(found["run_id"])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")] == [1, 2]
    version = client.get_model_version(found["model_name"], found["model_version"])
    held = client.list_logged_model_artifacts(version.source.split("/")[-1], "artifacts")  # models:/<model id>
    assert "artifacts/model.pt" in {a.path for a in held}  # the pyfunc's artifacts (tests/test_mlflow_model.py)
    assert 0 <= run.data.metrics["infer_accuracy"] <= 1
    assert client.get_model_version(found["model_name"], found["model_version"]).run_id == run.info.run_id
    _printed_ui_command_serves_on_loopback(stdout[-1].split("browse with: ", 1)[1])


@pytest.mark.slow
def test_a_rerun_whose_stages_are_all_reused_starts_no_ray(smoke_run):
    """The smoke run's command again: every stage is reused, so neither Ray nor torch starts (the
    rerun had spent 7.7 s of its 7.7 s starting Ray on the 2-core demo)."""
    run_dir = smoke_run.run_dir
    done = _cli("run", "--config", "configs/smoke.yaml", "--set", f"run.source={run_dir.parent / 'src'}", "--set",
                f"run.dir={run_dir}", "--set", "train.num_workers=2", "-v", timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert [s for s in ("etl", "train", "infer") if f"{s}: reusing {run_dir / s}" in output] == ["etl", "train", "infer"]
    assert not re.search(r"\bray: [\d.]+ CPUs", output), output[-4000:]  # -v would show Ray's start line
    saved = json.loads((run_dir / "report.json").read_text())
    assert report.RAY_START not in saved["run_seconds_split"] and all(s["reused"] for s in saved["stages"])
    assert sum(saved["run_seconds_split"].values()) == pytest.approx(saved["seconds"], abs=0.1)


def _printed_ui_command_serves_on_loopback(command: str) -> None:
    """The `mlflow ui` line the run printed, run as printed (on a free port): 200, loopback only."""
    import shlex
    import time
    import urllib.request

    from tests.conftest import free_port
    from stages.common import exposure

    argv, port = shlex.split(command), free_port()
    assert argv[0] == "mlflow" and argv[argv.index("--host") + 1] == "127.0.0.1", command
    argv[argv.index("--port") + 1] = str(port)
    ui = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), *argv[1:]], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    try:
        deadline, status = time.time() + 120, None
        while time.time() < deadline and ui.poll() is None and status != 200:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).status
            except OSError:
                time.sleep(0.5)
        assert status == 200, ui.stderr.read() if ui.poll() is not None else "no answer in 120 s"
        rows = exposure.rows(exposure.process_tree(ui.pid))
        assert rows and all(r["kind"] == "loopback" for r in rows), rows
    finally:
        ui.terminate()
        ui.wait(30)


def test_config_error_reaches_the_terminal_with_the_fix(tmp_path):
    done = _cli("train", "--data", str(tmp_path), "--output", str(tmp_path / "o"), "--set", "tracking.enabld=true",
                timeout=120)
    assert done.returncode == 2
    assert "unknown config key 'tracking.enabld'" in done.stderr and "enabled" in done.stderr


def test_ray_trains_coordinator_timeout_is_one_line_in_the_controller(ray_session):
    """The trainer's QuietController callback is unpickled where Train's controller runs: a real
    Ray task that receives it (as the controller receives its callbacks) logs the controller's
    warning with its traceback, and one line without it comes out; a process without it is untouched."""
    import ray

    from stages.train.controller_hook import QuietController

    @ray.remote(max_calls=1)  # a fresh process each call: the factory stays in the one it was installed in
    def warn_like_the_controller(callbacks: list) -> list[str]:
        import logging

        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger("ray.train.v2.autoscaling_client")  # Train's module logger, by prefix
        logger.addHandler(handler)
        try:
            raise TimeoutError("GetTimeoutError")
        except TimeoutError:
            logger.warning("Failed to send resource request for %s.", "abc", exc_info=True)
        return [logging.Formatter().format(r) for r in records]

    lines = ray.get(warn_like_the_controller.remote([QuietController()]))
    assert len(lines) == 1 and "\n" not in lines[0] and "goes on" in lines[0]
    untouched = ray.get(warn_like_the_controller.remote([]))
    assert len(untouched) == 1 and "Traceback" in untouched[0]


def test_trains_controller_gets_the_quiet_factory_and_no_torch(ray_session, tmp_path):
    """A real Train controller: the QuietController callback installed its record factory there,
    and what the controller unpickles imported no torch (through `stages.train`'s old eager exports
    and TorchConfig's module it had delayed every worker group by ~1.3 s on 2 cores)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from stages.train.controller_hook import QuietController
    from stages.train.ddp_rendezvous import LoopbackTorchConfig

    seen = tmp_path / "controller.json"

    class Probe(ray.train.UserCallback):  # its hooks run in the controller
        def after_report(self, run_context, metrics, checkpoint):
            import logging
            import sys

            seen.write_text(json.dumps({"torch": "torch" in sys.modules,
                                        "quiet": getattr(logging.getLogRecordFactory(), "raymill_quiet", False)}))

    def report_once(config):
        ray.train.report({"done": 1})

    TorchTrainer(report_once, torch_config=LoopbackTorchConfig(backend="gloo"),
                 scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
                 run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="probe",
                                                callbacks=[QuietController(), Probe()])).fit()
    assert json.loads(seen.read_text()) == {"torch": False, "quiet": True}


def test_an_empty_test_split_reports_no_accuracy_not_zero():
    # a tiny or one-class data set can leave the test split empty: "test_acc 0.000 on 0 images" was untrue
    from stages.model.publish import test_metrics
    from stages.common import console

    scored = test_metrics({"test_acc": 0.0, "test_rows": 0}, "unused", {}, "unused")
    assert scored["acc"] is None and scored["rows"] == 0
    assert test_metrics({"test_acc": 0.5, "test_rows": 4}, "unused", {}, "unused")["acc"] == 0.5
    assert [console.score(x) for x in (None, float("nan"), 0.0, 0.98765)] == ["n/a", "n/a", "0.000", "0.988"]


def test_benign_lines_are_dropped_at_the_descriptor_and_shown_with_a_note_when_verbose(tmp_path):
    """stages.common.benign: a child process writes Ray's benign core-worker line the way C++
    does (straight to fd 2), an ordinary line through Python, and a print() in two writes."""
    script = (
        "import os, sys\n"
        "from stages.common import benign\n"
        "benign.install(sys.argv[1] == 'verbose')\n"
        "os.write(2, b\"[2026-11-26 21:00:00,1 E 1 1] core_worker.cc:2465: Actor with class name: 'X' and ID: "
        "'a' has constructor arguments in the object store and max_restarts > 0. If the arguments\\n\")\n"
        "print('an ordinary line', file=sys.stderr)\n"
        "sys.stderr.write('a progress bar without its newline')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    quiet, loud = (subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True,
                                  timeout=60) for mode in ("quiet", "verbose"))
    assert quiet.returncode == 0 == loud.returncode, quiet.stderr + loud.stderr
    assert quiet.stderr == "an ordinary line\na progress bar without its newline"
    assert "max_restarts > 0" in loud.stderr and "[raymill] note: the line above is benign" in loud.stderr
    assert loud.stderr.endswith("an ordinary line\na progress bar without its newline")


def test_a_workers_sigterm_traceback_at_shutdown_is_dropped_only_when_it_ends_so():
    """The one multi-line benign block (stages.common.benign.SHUTDOWN_START): held whole, dropped only
    when Ray's sigterm_handler raised SystemExit: 1; any other ending shows every line."""
    import io

    from stages.common.benign import BenignFilter

    head = "(raymill_train pid=7) Exception ignored in: <function WeakSet.__init__.<locals>._remove at 0x7f>\n" \
           "(raymill_train pid=7) Traceback (most recent call last):\n"
    benign = head + '(raymill_train pid=7)   File "ray/_private/worker.py", line 1, in sigterm_handler\n' \
                    "(raymill_train pid=7) SystemExit: 1\n"
    other = head + '(raymill_train pid=7)   File "x.py", line 2, in f\n(raymill_train pid=7) ValueError: real\n'
    for text, verbose, shown in [(benign, False, "after\n"), (other, False, other + "after\n")]:
        out = io.StringIO()
        f = BenignFilter(out, verbose)
        f.write("before\n" + text + "after\n")
        f.flush(final=True)
        assert out.getvalue() == "before\n" + shown
    out = io.StringIO()
    f = BenignFilter(out, verbose=True)
    f.write(benign)
    assert "SystemExit: 1" in out.getvalue() and "the traceback above is benign" in out.getvalue()
    out = io.StringIO()
    f = BenignFilter(out)
    f.write(head)  # cut off by the stream's end: shown, unjudged
    f.flush(final=True)
    assert out.getvalue() == head


def test_verbose_keeps_raymills_own_lines_in_a_worker(monkeypatch):
    """--verbose brings Ray's lines back; it had also dropped raymill's epoch lines in a worker."""
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    for name in ("raymill", "stages"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    console.quiet_train_worker()
    assert logging.getLogger("raymill.train").getEffectiveLevel() == logging.INFO


def test_sigterm_stops_a_training_run_as_ctrl_c_does_with_exit_143(smoke_run, tmp_path):
    """Ray's core worker had taken SIGTERM: a "*** SIGTERM received" dump, three `E ... logging.cc`
    lines, then exit 130 as for Ctrl-C (kill, systemd and Kubernetes expect 143)."""
    import signal

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "workflow", "train", "--data", str(smoke_run.run_dir / "etl"),
                             "--output", str(tmp_path / "t"), "--config", str(REPO / "configs/smoke.yaml"),
                             "--set", "train.epochs=1000", "--set", "tracking.enabled=false"],
                            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    for line in proc.stdout:  # the loop runs: Ray is up, its handlers installed
        lines.append(line)
        if "epoch 2/1000" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out, _ = proc.communicate(timeout=120)
    said = "".join(lines) + out
    assert proc.returncode == 143, said[-3000:]
    assert "raymill train: terminated (SIGTERM); rerun the same command to resume" in said, said[-3000:]
    assert not [line for line in said.splitlines() if ERRORISH.search(line) or "SIGTERM received" in line], said
