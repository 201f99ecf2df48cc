"""Helpers every benchmark shares: machine facts, a process-tree memory sampler, timing.

Imports only the standard library and psutil (which ships with Ray), so `python -m benchmarks
render` stays fast.
"""
from __future__ import annotations

import datetime as dt
import os
import platform
import threading
import time
from importlib import metadata
from typing import Any, Callable

__all__ = ["machine_info", "versions", "MemorySampler", "measure", "loadavg", "now_iso", "mb"]

# Ray processes that are not task/actor workers (daemons and agents), by process name.
_RAY_SYSTEM_NAMES = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def mb(n_bytes: float) -> float:
    return round(n_bytes / 2**20, 1)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _total_ram_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    ram = _total_ram_bytes()
    return {"cores": os.cpu_count(), "cpu_model": _cpu_model(),
            "ram_gib": round(ram / 2**30, 1) if ram else None,
            "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "loadavg_at_start": loadavg()}


def versions(*packages: str) -> dict[str, str]:
    out = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


class MemorySampler:
    """Sample the RSS of this process and all its descendants in a background thread.

    A local `ray.init()` starts gcs_server and raylet as children of the driver, and raylet
    starts the workers, so the whole Ray cluster is in this process tree; so are the children
    of a multiprocessing.Pool. Two sums are kept per sample:
      - `driver_workers`: this process plus task/actor workers (`ray::*` except the agents,
        and any non-Ray child such as a Pool worker): what a method's data path costs;
      - `tree`: everything, including Ray's daemons and agents.
    RSS counts shared pages (the object store's shared memory, copy-on-write pages after fork)
    once per process that touched them, so these sums are upper bounds.
    """

    def __init__(self, interval_s: float = 0.1):
        import psutil

        self._psutil = psutil
        self.interval_s = interval_s
        self._root = psutil.Process()
        self._category: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self.samples = 0
        self.baseline: dict[str, int] | None = None
        self.peak = {"driver_workers": 0, "tree": 0, "driver": 0, "workers": 0}
        self.max_processes = 0

    def _classify(self, proc) -> str:
        if proc.pid == self._root.pid:
            return "driver"
        cat = self._category.get(proc.pid)
        if cat is None:
            try:
                name = proc.name()
            except self._psutil.Error:
                name = ""
            cat = "system" if name.startswith(_RAY_SYSTEM_NAMES) else "workers"
            if cat == "workers" and not name.startswith("ray::"):
                try:  # Ray's Python daemons (dashboard, log monitor) run as plain `python ...ray/...`
                    if "site-packages/ray/" in " ".join(proc.cmdline()):
                        cat = "system"
                except self._psutil.Error:
                    pass
            self._category[proc.pid] = cat
        return cat

    def sample(self) -> None:
        try:
            procs = [self._root] + self._root.children(recursive=True)
        except self._psutil.Error:
            return
        sums = {"driver": 0, "workers": 0, "system": 0}
        for p in procs:
            try:
                rss = p.memory_info().rss
            except self._psutil.Error:
                continue
            sums[self._classify(p)] += rss
        row = {"driver": sums["driver"], "workers": sums["workers"],
               "driver_workers": sums["driver"] + sums["workers"],
               "tree": sums["driver"] + sums["workers"] + sums["system"]}
        if self.baseline is None:
            self.baseline = row
        for k in self.peak:
            self.peak[k] = max(self.peak[k], row[k])
        self.samples += 1
        self.max_processes = max(self.max_processes, len(procs))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "MemorySampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def summary(self) -> dict[str, Any]:
        base = self.baseline or {}
        return {"peak_rss_mb": mb(self.peak["driver_workers"]),
                "peak_rss_tree_mb": mb(self.peak["tree"]),
                "peak_rss_driver_mb": mb(self.peak["driver"]),
                "peak_rss_workers_mb": mb(self.peak["workers"]),
                "start_rss_mb": mb(base.get("driver_workers", 0)),
                "start_rss_tree_mb": mb(base.get("tree", 0)),
                "rss_samples": self.samples, "rss_interval_s": self.interval_s,
                "max_processes": self.max_processes}


def measure(fn: Callable[[], Any], *, images: int, repeat: int = 1,
            sampler_interval_s: float = 0.1) -> tuple[dict[str, Any], Any]:
    """Run `fn` `repeat` times under one memory sampler; report the fastest run.

    Returns (measurement, value of the last call). Peak memory is over all repeats.
    """
    seconds, value = [], None
    load_before = loadavg()
    with MemorySampler(sampler_interval_s) as sampler:
        for _ in range(max(1, repeat)):
            t0 = time.perf_counter()
            value = fn()
            seconds.append(time.perf_counter() - t0)
    best = min(seconds)
    result = {"images": images, "seconds": round(best, 3), "images_per_s": round(images / best, 1),
              "runs_s": [round(s, 3) for s in seconds], **sampler.summary(),
              "loadavg_before": load_before, "loadavg_after": loadavg()}
    return result, value
