"""Ray run the way Ray users run it: public APIs only, a loopback dashboard behind Ray's token,
and no credentials in Ray's own logs."""
from __future__ import annotations

import http.client
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.conftest import REPO, make_tree

# Any private module under ray (ray._private, ray._raylet, ray.serve._private, ...), not a dunder
PRIVATE_RAY = re.compile(r"\bray(\.\w+)*\._(?!_)|core\.generated|_internal|_local_tuner|_experiment_analysis")
LOOPBACK = ("127.0.0.1", "::1")


def _product_files() -> list[Path]:
    return sorted(p for folder in ("stages", "workflow") for p in (REPO / folder).rglob("*.py"))


def test_product_code_uses_only_public_ray_apis():
    for planted in ("import ray._raylet", "from ray.serve._private import x", "ray._private.utils"):
        assert PRIVATE_RAY.search(planted), planted  # the check can fail
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in _product_files()
            for n, line in enumerate(p.read_text().splitlines(), 1) if PRIVATE_RAY.search(line)]
    assert not hits, "private Ray APIs in product code:\n" + "\n".join(hits)


def test_no_product_file_is_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in _product_files() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these files: {long}"


def _token() -> str:
    token = os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").read_text()
    return token.strip()


def _http_status(host: str, port: int, headers: dict | None = None) -> int | str:
    """Status of GET /api/version, or what the port said if it is not an HTTP/1 server."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", "/api/version", headers=headers or {})
        return conn.getresponse().status
    except (http.client.HTTPException, OSError) as e:  # gRPC (HTTP/2 only) answers with a frame
        return type(e).__name__
    finally:
        conn.close()


def _prometheus_only(host: str, port: int) -> bool:
    """A Prometheus exporter: every path answers the same read-only metrics text.

    Ray 2.60's dashboard and autoscaler monitor processes serve their metrics on 0.0.0.0 with no
    token, and no public setting binds them to loopback (see the notes); that exposes counters,
    never an API. Anything else answering without the token fails the test.
    """
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", "/api/jobs/")
        response = conn.getresponse()
        body = response.read(4096).decode(errors="replace")
        return response.status == 200 and (body.startswith("# HELP") or body.startswith("# TYPE"))
    except (http.client.HTTPException, OSError):
        return False
    finally:
        conn.close()


def _ray_listeners() -> list[tuple[str, str, int]]:
    """(process name, ip, port) of every listening socket of this process and its children: the
    local Ray that the session fixture started (GCS, raylet, dashboard, agents, workers)."""
    import psutil

    me = psutil.Process()
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            found += [(proc.name(), c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # a worker that exited meanwhile
            continue
    return found


def test_dashboard_is_loopback_only_and_refuses_requests_without_the_token(ray_session):
    from stages.common import session

    url = urlparse(session.dashboard_url() or "")
    assert url.hostname == "127.0.0.1", f"dashboard not started on loopback: {session.dashboard_url()}"
    assert _http_status(url.hostname, url.port) in (401, 403)
    assert _http_status(url.hostname, url.port, {"Authorization": f"Bearer {_token()}"}) == 200
    listeners = _ray_listeners()
    assert {ip for _, ip, port in listeners if port == url.port} <= set(LOOPBACK), listeners
    # Ray 2.60 binds its gRPC servers (GCS, raylet, workers) to the node IP's wildcard: ray.init
    # resolves 127.0.0.1 to the machine's address, and gRPC there needs the token. No HTTP
    # service may answer on a non-loopback address without the token.
    open_http = []
    for name, ip, port in listeners:
        if ip in LOOPBACK:
            continue
        host = "127.0.0.1" if ip in ("0.0.0.0", "::") else ip
        status = _http_status(host, port)
        if isinstance(status, int) and status not in (401, 403) and not _prometheus_only(host, port):
            open_http.append((name, ip, port, status))
    assert not open_http, f"Ray HTTP listeners on non-loopback addresses without auth: {open_http}"


def test_s3_run_leaves_no_credentials_in_ray_session_logs(s3_bucket, tmp_path):
    """A CLI ETL run from and to S3 with a fresh local Ray: its workers read S3 with the
    inherited credentials, and no file Ray wrote (session logs included) holds the secret."""
    import s3fs

    endpoint, bucket = s3_bucket
    make_tree(tmp_path / "src", per_class=3, bad=False)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.put(str(tmp_path / "src") + "/", f"{bucket}/raw/", recursive=True)
    secret = f"raymill-secret-{uuid.uuid4().hex}"
    ray_tmp = tempfile.mkdtemp(prefix="rm-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_SESSION_TOKEN": f"{secret}-session", "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(REPO)}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "workflow", "etl", "--input", f"s3://{bucket}/raw",
             "--output", f"s3://{bucket}/ds", "--set", f"s3.endpoint_url={endpoint}",
             "--set", "ray.num_cpus=1", "--set", "etl.image_size=16"],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        assert fs.exists(f"{bucket}/ds/manifest.json")
        files = [p for p in Path(ray_tmp).rglob("*") if p.is_file()]
        assert any("/logs/" in str(p) for p in files), "Ray wrote no session logs: nothing was checked"
        leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert not leaked, f"the AWS secret is in Ray's files: {leaked}"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.parametrize("joins_cluster", [False, True])
def test_session_never_puts_credentials_in_the_runtime_env(joins_cluster, monkeypatch):
    """What session.start hands ray.init: no secret for local Ray (workers inherit the env) or for
    a cluster (nodes use instance profiles / their own env); the S3 endpoint only for a cluster."""
    import ray

    from stages.common import ray_start, session
    from stages.common.config import RayConfig

    seen: dict = {}
    for name in ("RAY_API_SERVER_ADDRESS", "RAY_enable_metrics_collection"):  # start() sets them
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(ray_start, "cluster_resources", lambda: {"CPU": 1.0, "GPU": 0.0})
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "t0ken")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    session.start(RayConfig(address="auto" if joins_cluster else None))
    assert "s3cr3t" not in repr(seen) and "t0ken" not in repr(seen)
    env_vars = (seen.get("runtime_env") or {}).get("env_vars", {})
    assert env_vars.get("AWS_ENDPOINT_URL") == ("http://127.0.0.1:9000" if joins_cluster else None)
    assert set(env_vars) <= {"AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                             "RAYMILL_VERBOSE",  # not a secret: --verbose reaching cluster workers
                             "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",  # ray_start.TRAIN_POLL_S, for Tune's trainers
                             "OMP_WAIT_POLICY",  # ray_start.OMP_WAIT_POLICY: CPU workers' idle threads sleep
                             "RAY_SERVE_LOG_TO_STDERR"}  # Serve's actors log to files only (no -v)


def test_local_workers_run_the_checkout_the_driver_runs(tmp_path):
    """A notebook that puts a checkout on its own sys.path (beside the editable install of another
    one) had its Ray workers import the other copy: a reviewer's ETL failed on that copy's
    half-edited file. A copy of stages/ marked as the driver's must be what a worker imports."""
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "stages", checkout / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "stages" / "MARK").write_text("this copy")
    (checkout / "notebooks").mkdir()
    script = f"""
import sys
sys.path.insert(0, {str(checkout)!r})  # what the notebooks' first cell does
import ray, stages
from stages.common import session
from stages.common.config import RayConfig
session.start(RayConfig(num_cpus=1, include_dashboard=False))
where = ray.get(ray.remote(lambda: __import__("stages").__file__).remote())
print("DRIVER", stages.__file__)
print("WORKER", where)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], cwd=checkout / "notebooks", env=env,
                          capture_output=True, text=True, timeout=180)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("DRIVER", "WORKER")))
    assert done.returncode == 0, done.stderr[-2000:]
    assert lines["DRIVER"].startswith(str(checkout)) and lines["WORKER"] == lines["DRIVER"], lines


def test_a_copy_in_the_drivers_folder_is_named_not_hidden(tmp_path, monkeypatch, caplog):
    """Ray puts the driver's folder first on a local worker's path, before PYTHONPATH: a process
    run from another checkout's root cannot hand its workers its own copy, so it says so."""
    import logging

    from stages.common import ray_start

    shutil.copytree(REPO / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "")
    caplog.set_level(logging.WARNING, logger="stages.common.ray_start")
    ray_start._workers_import_this_code()
    assert f"local workers would import {tmp_path}/stages (this folder)" in caplog.text
    assert os.environ["PYTHONPATH"] == ""  # no use: the folder comes first


def test_a_callers_own_ray_after_shutdown_finds_its_own_state_api(tmp_path):
    """Ray's processes take RAY_API_SERVER_ADDRESS (this Ray's dashboard) from the driver's start;
    the driver drops it after. It had stayed set: a notebook's own `ray.init()` after
    `ray.shutdown()` sent its State API calls to raymill's dead dashboard ("Failed to make request"),
    whatever address they named (Ray reads the variable first)."""
    script = """
import os
from stages.common import session
from stages.common.config import RayConfig
session.start(RayConfig(num_cpus=1))
import ray
from ray.util.state import list_actors
print("DRIVER", os.environ.get("RAY_API_SERVER_ADDRESS"))
print("WORKER", ray.get(ray.remote(lambda: os.environ.get("RAY_API_SERVER_ADDRESS")).remote()))
ray.shutdown()
ray.init(address="local", num_cpus=1, include_dashboard=True)
# its own Ray by address (another test's Ray may be up); the variable, when set, overrides it
print("ACTORS", len(list_actors(address=ray.get_runtime_context().gcs_address)))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("DRIVER", "WORKER", "ACTORS")))
    assert lines["DRIVER"] == "None" and lines["WORKER"].startswith("http://127.0.0.1:"), lines
    assert lines["ACTORS"].isdigit(), lines
    # below the kernel's ephemeral range, where Ray's own binds to port 0 (and its fixed exporter
    # ports 44217, 44227) had taken the port first, once in ~40 starts
    assert 20000 <= int(lines["WORKER"].rsplit(":", 1)[1]) < 32768, lines
