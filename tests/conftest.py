"""Shared fixtures: one local Ray per session, a loopback S3 (moto server), image factories."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# Fake credentials for the loopback S3, set before Ray starts so its workers inherit them.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
# The session's own onnxruntime graph cache (stages/model/runtime.py), inherited by Ray's workers and
# the CLI's subprocesses: results never depend on what this machine's ~/.cache already holds.
os.environ.setdefault("RAYMILL_ONNX_CACHE", tempfile.mkdtemp(prefix="raymill-test-onnx-"))


def _import_ray_on_loopback() -> None:
    """The suite's Ray listens on loopback only, as the CLI's does (exposure.keep_local_on_loopback),
    and not on the machine's address. Ray reads the variable once, at import, so it is set for the
    import and removed again: inherited, it made the two-node tests' `ray start` abort ("Multi-node
    Ray clusters are not supported")."""
    from stages.common.exposure import LOCAL_ONLY_ENV

    if LOCAL_ONLY_ENV in os.environ:
        return
    os.environ[LOCAL_ONLY_ENV] = "0"
    try:
        import ray  # noqa: F401
    finally:
        del os.environ[LOCAL_ONLY_ENV]


_import_ray_on_loopback()

REPO = Path(__file__).resolve().parents[1]


def interruptible(target: str, *args: str) -> list[str]:
    """The command line `python -m target args` (`python target args` for a .py file) for a child
    a test stops with SIGINT. A suite started in the background (`nohup make test &`) ignores
    SIGINT, children inherit that across exec, and Python then installs no KeyboardInterrupt
    handler: the child restores it itself. Not Popen's preexec_fn: that forks this process with
    its Ray driver's gRPC threads, and the driver then missed actor updates (serve.start hung)."""
    run = (f"runpy.run_path({target!r}, run_name='__main__')" if target.endswith(".py")
           else f"runpy.run_module({target!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", "import runpy, signal, sys; signal.signal(signal.SIGINT, "
            f"signal.default_int_handler); sys.argv[0] = {target!r}; {run}", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_ok(url: str, timeout_s: float, alive=lambda: True) -> bool:
    """Whether GET `url` answers 200 within `timeout_s`, polling while `alive()` (a server starting)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (start-up costs ~6 s). 2 logical CPUs, started
    the way the CLI starts it (dashboard on 127.0.0.1, token auth). One declared GPU with no
    device behind it: Serve's GPU plans and one-GPU rollouts run here on the CPU (a replica that
    holds a GPU share but sees no CUDA device runs on the CPU); nothing else asks for a GPU."""
    import ray

    from stages.common import session
    from stages.common.config import RayConfig

    yield session.start(RayConfig(num_cpus=2, num_gpus=1))
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint on 127.0.0.1 (moto server mode). Yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket per test; yields (endpoint_url, bucket_name)."""
    import boto3

    # the test's name, cut to fit S3's 63 characters, and a hash of its whole id: parametrized
    # cases once shared a bucket (and one resumed the other's run from it)
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:36].strip("-")
    name = f"raymill-{slug}-{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    yield s3_server, name


def _jpeg(array: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def image_bytes(seed: int, size=(80, 60), fmt: str = "jpeg") -> bytes:
    # Smooth gradients plus mild noise: like photos, they survive JPEG re-encoding at small sizes.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[1], 0:size[0]]
    base = rng.uniform(0, 1, 3) * 200 + np.stack([x / size[0], y / size[1], (x + y) / sum(size)], -1) * 55
    array = np.clip(base + rng.normal(0, 4, base.shape), 0, 255).astype(np.uint8)
    return _jpeg(array) if fmt == "jpeg" else _png(array)


def bomb_png() -> bytes:
    """A tiny file that declares 20000x20000 px: a decompression bomb."""
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")
    return buf.getvalue()


def many_scans_jpeg(repeats: int = 120) -> bytes:
    """A valid progressive JPEG whose last scan repeats: decode time grows with every scan."""
    buf = io.BytesIO()
    y, x = np.mgrid[0:150, 0:200]
    gradient = np.stack([x, y, x + y], -1).astype(np.uint8)
    Image.fromarray(gradient).save(buf, format="JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    last = data[data.rindex(b"\xff\xda"):-2]  # the last scan's header and data, without EOI
    return data[:-2] + last * repeats + b"\xff\xd9"


BAD_FILES = {
    # relative path -> (bytes, expected quarantine reason)
    "cat/zero.jpg": (b"", "empty_file"),
    "cat/truncated.jpg": (None, "truncated"),  # filled in by make_tree
    "dog/random.jpg": (bytes(np.random.default_rng(7).integers(0, 255, 4000, dtype=np.uint8)), "not_an_image"),
    "dog/notes.jpg": (b"this is a text file, not a photo\n" * 20, "not_an_image"),
    "bird/bomb.png": (None, "decompression_bomb"),
    "bird/scan.tiff": (None, "unsupported_format"),
    "dog/scans.jpg": (None, "decompression_bomb"),  # a JPEG of 130 scans
}


def make_tree(root: Path, per_class: int = 8, bad: bool = True, classes=("bird", "cat", "dog")) -> dict:
    """Write a small ImageFolder tree with real JPEG/PNG files (and broken ones when `bad`)."""
    written = {}
    for c_index, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            fmt = "png" if i % 3 == 2 else "jpeg"
            rel = f"{name}/{name}_{i:03d}.{'png' if fmt == 'png' else 'jpg'}"
            data = image_bytes(1000 * c_index + i, size=(60 + 7 * i, 50 + 5 * c_index), fmt=fmt)
            (root / rel).write_bytes(data)
            written[rel] = "ok"
    if bad:
        good_jpeg = image_bytes(99, size=(200, 150))
        tiff = io.BytesIO()
        Image.new("RGB", (30, 30)).save(tiff, format="TIFF")
        fill = {"cat/truncated.jpg": good_jpeg[: len(good_jpeg) // 2], "bird/bomb.png": bomb_png(),
                "bird/scan.tiff": tiff.getvalue(), "dog/scans.jpg": many_scans_jpeg()}
        for rel, (data, reason) in BAD_FILES.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(fill.get(rel, data))
            written[rel] = reason
    return written


class FlakyS3Proxy:
    """A TCP proxy in front of the S3 endpoint that drops every PUT after the first `allow_puts`.

    Models an endpoint failing mid-write; GET/LIST/DELETE still pass so cleanup can be checked.
    """

    def __init__(self, target_port: int, allow_puts: int):
        self.target_port, self.allow_puts, self.puts = target_port, allow_puts, 0
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        try:
            while data := client.recv(65536):
                if data.startswith(b"PUT "):
                    with self.lock:
                        self.puts += 1
                        if self.puts > self.allow_puts:
                            break  # the endpoint "dies" for this request
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()


def demo_dataset(root: Path, etl_cfg, images: int, seed: int):
    """A demo ImageFolder tree of `images` images under `root`, put through the real ETL stage."""
    from stages.etl import stage as etl
    from workflow import demo_data

    demo_data.generate(root / "src", images=images, seed=seed)
    return etl.run(etl_cfg, str(root / "src"), str(root / "ds"))


@contextlib.contextmanager
def lock_held(out: Path, kind: str, timeout_s: float = 60.0):
    """Another process holding `out`'s output lock (stages.common.locks) for `kind` while the block
    runs; yields its Popen (tests look for its pid in the refusal). It is SIGKILLed at the end, so
    it dies holding the lock and the lock file stays behind, as after a crash."""
    import select
    import signal
    import subprocess

    hold = ("import sys, time; from stages.common import locks\n"
            f"with locks.output_lock(sys.argv[1], {kind!r}):\n    print('locked', flush=True); time.sleep(600)")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        ready, _, _ = select.select([holder.stdout], [], [], timeout_s)
        assert ready and holder.stdout.readline().strip() == "locked", f"the holder did not take the lock in {timeout_s} s"
        yield holder
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def kill_train_worker_when(ready, killed: list, actor: str = "ray::RayTrainWorker", timeout_s: float = 240) -> None:
    """SIGKILL one `actor` process (a Train worker; `ray::ImplicitFunc`: the one-worker host's Tune
    trial actor) started after this call, at the first moment `ready()` is true; its pid goes into
    `killed`. Only our descendants, never another session's workers.

    Run in a thread beside the run. On a fast box the rest of a small run took less than one poll
    of the process table, and it finished before the kill (CI, 2026-11-28). So the process is held
    in short slices: SIGSTOP, ask `ready()`, SIGCONT for 10 ms. It progresses in every slice (and a
    DDP group with it), and the kill lands while it is stopped, mid-run."""
    import signal

    import psutil

    started = time.time()
    deadline, pid = started + timeout_s, None
    while time.time() < deadline:
        if pid is None:  # not the processes of an earlier run that are still exiting
            pid = next((p.pid for p in psutil.Process().children(recursive=True)
                        if _started_since(p, actor, started - 1)), None)
            time.sleep(0.05)  # a scan of the process table costs a core's milliseconds
            continue
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:  # it exited: look again (the deadline ends the watch)
            pid = None
            continue
        try:
            if ready():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        finally:  # never leave it stopped: a `ready()` that raised would hang the run
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # after a SIGKILL: harmless
        time.sleep(0.01)


def _started_since(proc, text: str, since: float) -> bool:
    """`proc` runs `text` and was started at or after `since` (a time.time())."""
    import psutil

    try:
        return text in " ".join(proc.cmdline()) and proc.create_time() >= since
    except psutil.Error:  # gone, or not ours to read
        return False


def started_by_this_worker(proc) -> bool:
    """Whether `proc` descends from this pytest process (under pytest-xdist, this worker's): an
    orphan is re-parented to init, so the tree cannot say, but it keeps the environment it
    inherited, and xdist names each worker in PYTEST_XDIST_WORKER. Without xdist: every process."""
    import psutil

    mine = os.environ.get("PYTEST_XDIST_WORKER")
    if mine is None:
        return True
    try:
        return proc.environ().get("PYTEST_XDIST_WORKER") == mine
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def stray_decode_processes(timeout_s: float = 10.0) -> list[str]:
    """Decode-pool processes (stages.feed.decode_pool: a forkserver and its children, which carry its
    command line) that this test worker started, still alive after `timeout_s`, except this test
    process's own forkserver family. Ray's dashboard modules also use a forkserver: theirs name `ray.dashboard`."""
    import time

    import psutil

    def stray() -> list[str]:
        me = psutil.Process()
        own = {p.pid for c in me.children() for p in [c, *c.children(recursive=True)]}
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            line = " ".join(p.info["cmdline"] or [])
            if ("multiprocessing.forkserver" in line and "ray.dashboard" not in line and p.pid not in own
                    and started_by_this_worker(p)):
                out.append(f"{p.pid}: {line[:120]}")
        return out

    deadline = time.time() + timeout_s
    while (left := stray()) and time.time() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """`raymill run` on the smoke config, as `make run` runs it (a subprocess, the user's env),
    with every listening socket of its process tree sampled every 0.3 s while it runs
    (stages.common.exposure). Two DDP workers (the exposure test checks their store). Shared by the
    console test and the exposure test: one run, ~45 s."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from workflow import demo_data
    from stages.common import exposure

    root = tmp_path_factory.mktemp("smoke-run")
    demo_data.generate(root / "src", images=160, seed=2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("RAY_DATA_DISABLE_PROGRESS_BARS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(name, None)  # the user's defaults, not the test suite's: the product decides
    out, err = open(root / "stdout", "w+"), open(root / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "workflow", "run", "--config", "configs/smoke.yaml", "--set",
                             f"run.source={root / 'src'}", "--set", f"run.dir={root / 'run'}",
                             "--set", "train.num_workers=2"], cwd=REPO, env=env,  # DDP: its store's listener too
                            stdout=out, stderr=err, text=True)
    seen: dict[tuple, dict] = {}
    deadline = time.time() + 900
    while proc.poll() is None and time.time() < deadline:
        for row in exposure.rows(exposure.process_tree(proc.pid)):
            seen.setdefault((row["process"], row["address"], row["port"]), row)
        time.sleep(0.3)
    proc.wait(60)
    out.seek(0), err.seek(0)
    return SimpleNamespace(returncode=proc.returncode, stdout=out.read(), stderr=err.read(), run_dir=root / "run",
                           listeners=seen)


def redigest(folder: Path) -> None:
    """Rewrite a checkpoint folder's digests (files-rank*.json) to match its files as they are now:
    what a writer who planted a file would also do, so that the next defence (the unpickler's rule)
    is the one tested."""
    import json

    from stages.common import storage

    for listing in folder.glob("files-rank*.json"):
        names = json.loads(listing.read_text())
        listing.write_text(json.dumps({n: storage.sha256_bytes((folder / n).read_bytes()) for n in names}))

