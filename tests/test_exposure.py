"""Every open port accounted for: a real `raymill run` (ETL, 2-worker DDP train, batch inference)
and `raymill serve`, run as a user runs them, with every listening socket of their process trees
classified while they run (stages.common.exposure: the same classification as `raymill doctor`)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO, answers_ok, free_port, image_bytes, interruptible
from stages.common import exposure


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the product decides, as for a user
    return subprocess.Popen(interruptible("workflow", *args), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _sample_while(proc: subprocess.Popen, until, timeout_s: float) -> dict[tuple, dict]:
    """Classified listeners of `proc`'s tree, sampled every 0.3 s until `until()` or it exits."""
    seen: dict[tuple, dict] = {}
    deadline = time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline and not until():
        for row in exposure.rows(exposure.process_tree(proc.pid)):
            seen.setdefault((row["process"], row["address"], row["port"]), row)
        time.sleep(0.3)
    return seen


def _off_loopback(seen: dict) -> list[dict]:
    return [r for r in seen.values() if r["kind"] not in ("loopback", "ray-grpc-token", "named")]


def test_a_planted_listener_is_caught(tmp_path):
    """The classifier can fail: a plain socket on every interface is `exposed`."""
    with socket.socket() as planted:
        planted.bind(("0.0.0.0", 0))
        planted.listen()
        port = planted.getsockname()[1]
        rows = exposure.rows({os.getpid()})
    mine = [r for r in rows if r["port"] == port]
    assert mine and mine[0]["kind"] == "exposed", rows


def test_doctor_finds_rays_python_processes_too(ray_session):
    """The dashboard head (HTTP, the Jobs API) runs as plain `python .../ray/dashboard/dashboard.py`:
    `raymill doctor` without --pid once skipped it, and a dashboard on 0.0.0.0 got a clean report."""
    import psutil

    # this session's own (another test worker's Ray may come and go between the two scans)
    dashboards = {p.pid for p in psutil.Process().children(recursive=True)
                  if any(a.endswith(os.path.join("ray", "dashboard", "dashboard.py")) for a in p.cmdline())}
    assert dashboards and dashboards <= exposure.ray_processes()


def test_importing_the_stages_leaves_ray_unimported_so_a_library_caller_stays_on_loopback():
    """The switch that keeps a local Ray on loopback is read when Ray is imported. A library caller
    writes its imports first (`from stages.train import run`), then session.start: had any stage
    imported Ray, that Ray listened off loopback (the check_loopback warning)."""
    probe = ("import importlib, sys\n"
             "for name in ('etl', 'train', 'tune', 'infer', 'serve'):\n"
             "    package = importlib.import_module('stages.' + name)\n"
             "    [getattr(package, export) for export in package.__all__]\n"
             "import workflow.pipeline\n"
             "print('ray' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != exposure.LOCAL_ONLY_ENV}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "False", done.stdout


def test_a_local_run_exposes_nothing_beyond_loopback(smoke_run):
    """`raymill run` (ETL, a 2-worker DDP train, batch inference), sampled while it ran."""
    seen = smoke_run.listeners
    assert smoke_run.returncode == 0, smoke_run.stderr[-4000:]
    processes = {r["process"] for r in seen.values()}
    assert any(p.startswith("gcs_server") for p in processes), processes
    assert any(p.startswith("ray::RayTrainWorker") for p in processes), processes
    # as the README's table says: everything on loopback, the DDP store included (a file store)
    assert {r["kind"] for r in seen.values()} == {"loopback"}, [r for r in seen.values() if r["kind"] != "loopback"]


def test_readme_port_table_matches_what_the_runs_expose():
    text = (REPO / "README.md").read_text()
    table = text[text.index("| port | what | authenticated | local run | cluster |"):].split("\n\n")[0]
    local = {cells[1]: cells[4] for line in table.splitlines()[2:] if (cells := [c.strip() for c in line.split("|")])}
    off = {what: where for what, where in local.items() if not where.startswith("127.0.0.1")}
    assert set(off) == {"Serve replicas' inter-deployment gRPC",
                        "DDP rendezvous across nodes (torch TCPStore, rank 0, while training)"}, off
    assert "token" in off["Serve replicas' inter-deployment gRPC"]
    assert off["DDP rendezvous across nodes (torch TCPStore, rank 0, while training)"] == "not opened"


class _Clients:
    """Clients that send images in a loop, as a service's callers do, until the endpoint says it is
    stopping (a non-200 answer, which they honour) or cannot be reached; each keeps how it ended."""

    def __init__(self, port: int, n: int = 4):
        self.url, self.ended = f"http://127.0.0.1:{port}/predict", []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        [t.start() for t in self.threads]

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=60) as client:
            while True:
                try:
                    answer = client.post(self.url, content=image_bytes(1), headers={"content-type": "image/jpeg"})
                except httpx.HTTPError as e:
                    self.ended.append(type(e).__name__)
                    return
                if answer.status_code != 200:
                    self.ended.append(f"{answer.status_code} {answer.json().get('error')}")
                    return

    def join(self) -> list[str]:
        [t.join(60) for t in self.threads]
        return self.ended


def test_a_local_serve_endpoint_exposes_nothing_beyond_loopback_and_stops_without_dropping_a_request(smoke_run):
    port = free_port()
    proc = _cli("serve", "--model", str(smoke_run.run_dir / "train"), "--port", str(port), "--config", "configs/smoke.yaml")
    ready = []

    def up() -> bool:
        if not ready:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    ready.append(time.time())
            except OSError:
                return False
        return time.time() - ready[0] > 3  # a few more samples once it answers

    try:
        seen = _sample_while(proc, up, 300)
        # `raymill doctor` says the same of the running endpoint
        doctor = subprocess.run([sys.executable, "-m", "workflow", "doctor", "--pid", str(proc.pid)], cwd=REPO,
                                capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        clients = _Clients(port)
        time.sleep(1.0)  # each client has a request in flight at any moment
    finally:
        proc.send_signal(signal.SIGTERM)  # as systemd and Kubernetes stop it (Ctrl-C takes the same path)
        try:
            output = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:  # fail, but leave no endpoint (and its Ray) behind for later tests
            proc.kill()
            output = proc.communicate()[0]
            pytest.fail(f"raymill serve did not stop within 120 s of Ctrl-C:\n{output[-3000:]}")
    assert ready, output[-4000:]
    assert proc.returncode == 143 and "Traceback" not in output, output[-3000:]
    # Each client's request in flight at the SIGTERM is answered; its next one gets the JSON 503, and
    # it stops (Retry-After). Without the drain, Ray's teardown cut the requests in flight (the
    # clients saw RemoteProtocolError: "Server disconnected without sending a response").
    assert clients.join() == ["503 shutting_down"] * 4, (clients.ended, output[-3000:])
    assert "serve: drained in" in output, output[-3000:]
    with pytest.raises(OSError):  # closed with the process: no proxy left answering 404 without routes
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert any(r["port"] == port and r["kind"] == "loopback" for r in seen.values()), seen
    assert not _off_loopback(seen), _off_loopback(seen)
    assert doctor.returncode == 0 and " 0 exposed" in doctor.stdout, doctor.stdout + doctor.stderr
    # off loopback: only Serve's replica-to-replica gRPC, and it refused a call without the token
    assert {r["kind"] for r in seen.values() if "ServeReplica" not in r["process"]} == {"loopback"}


def test_serve_exits_when_its_ray_dies_and_frees_its_port(smoke_run):
    """A killed raylet had left `raymill serve` asleep for good: its endpoint dead, its port claimed
    (another serve on it refused), until someone found the process. Now: exit 1, a line saying so."""
    import psutil

    port = free_port()
    proc = _cli("serve", "--model", str(smoke_run.run_dir / "train"), "--port", str(port), "--config", "configs/smoke.yaml")
    try:
        # serving: the driver idles (a raylet killed mid-start, Ray's core worker ends the driver itself)
        answers_ok(f"http://127.0.0.1:{port}/healthz", 300, alive=lambda: proc.poll() is None)
        raylets = [p for p in psutil.Process(proc.pid).children(recursive=True) if "raylet" in p.name()]
        assert raylets, "no raylet under raymill serve"
        raylets[0].kill()
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1 and "Ray node" in output and "start `raymill serve` again" in output, output[-3000:]
    with socket.socket() as again:  # the port is free for the next serve (as a server binds it: the
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # health check's TIME_WAIT stays)
        again.bind(("127.0.0.1", port))
