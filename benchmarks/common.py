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
from pathlib import Path
from typing import Any, Callable

__all__ = ["REPO", "machine_info", "versions", "MemorySampler", "measure", "combine", "loadavg", "now_iso", "mb",
           "ratio", "fmt", "pct", "start_ray", "wait_for_quiet", "md_table", "targets_table", "NOISY_SPREAD", "with_retry"]

# The checkout's root: benchmarks run raymill's CLI from it, with it on PYTHONPATH.
REPO = Path(__file__).resolve().parents[1]

# Fastest / slowest run of one method above this: a 5-15% verdict is inside the noise, so say so.
NOISY_SPREAD = 1.15

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
    """Sample RSS and CPU time of this process and its descendants in a background thread.

    A local `ray.init()` starts gcs_server and raylet as children of the driver, and raylet
    starts the workers, so the whole Ray cluster is in this process tree; so are the children
    of a multiprocessing.Pool. Processes fall in four groups: the driver (this process), Ray
    workers (`ray::*` task/actor processes), other children (Pool workers) and Ray's daemons
    and agents. Two RSS sums are kept per sample:
      - `driver_workers`: driver + Ray workers + other children: what a method's data path costs;
      - `tree`: that plus Ray's daemons and agents.
    With `ray=False` (a method that does not use Ray, measured while an idle Ray is up) Ray's
    processes are left out of both sums and of the CPU total; their CPU time is reported
    separately (`excluded_cpu_s`) so the background cost stays visible.
    RSS counts shared pages (the object store's shared memory, copy-on-write pages after fork)
    once per process that touched them, so these sums are upper bounds.
    """

    def __init__(self, interval_s: float = 0.1, ray: bool = True):
        import psutil

        self._psutil = psutil
        self.interval_s = interval_s
        self.ray = ray
        self._root = psutil.Process()
        self._category: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self.samples = 0
        self.baseline: dict[str, int] | None = None
        self.peak = {"driver_workers": 0, "tree": 0, "driver": 0, "workers": 0}
        self.max_processes = 0
        self._cpu_first: dict[int, float] = {}  # pid -> CPU seconds when first seen
        self._cpu_last: dict[int, float] = {}
        self._t0 = self._t1 = time.perf_counter()
        self._busy_counts: list[int] = []  # per sample: processes busy >= half the interval

    def _classify(self, proc) -> str:
        """driver | ray_workers | children | system (Ray daemons and agents)."""
        if proc.pid == self._root.pid:
            return "driver"
        cat = self._category.get(proc.pid)
        if cat is None:
            try:
                name = proc.name()
            except self._psutil.Error:
                name = ""
            if name.startswith(_RAY_SYSTEM_NAMES):
                cat = "system"
            elif name.startswith("ray::"):
                cat = "ray_workers"
            else:
                cat = "children"
                try:  # Ray's Python daemons (dashboard, log monitor) run as plain `python ...ray/...`
                    if "site-packages/ray/" in " ".join(proc.cmdline()):
                        cat = "system"
                except self._psutil.Error:
                    pass
            self._category[proc.pid] = cat
        return cat

    def _counted(self, category: str) -> bool:
        return self.ray or category in ("driver", "children")

    def sample(self) -> None:
        try:
            procs = [self._root] + self._root.children(recursive=True)
        except self._psutil.Error:
            return
        sums = {"driver": 0, "ray_workers": 0, "children": 0, "system": 0}
        now, busy, counted = time.perf_counter(), 0, 0
        elapsed = now - self._t1
        for p in procs:
            try:
                rss = p.memory_info().rss
                t = p.cpu_times()
            except self._psutil.Error:
                continue
            cpu = t.user + t.system
            category = self._classify(p)
            # A process first seen after the start began at 0 CPU seconds (as far as we know).
            self._cpu_first.setdefault(p.pid, cpu if self.baseline is None else 0.0)
            if (self.baseline is not None and category != "system" and self._counted(category)
                    and elapsed > 0 and cpu - self._cpu_last.get(p.pid, 0.0) >= 0.5 * elapsed):
                busy += 1
            self._cpu_last[p.pid] = cpu
            sums[category] += rss
            counted += self._counted(category)
        workers = sums["children"] + (sums["ray_workers"] if self.ray else 0)
        row = {"driver": sums["driver"], "workers": workers, "driver_workers": sums["driver"] + workers,
               "tree": sums["driver"] + workers + (sums["system"] if self.ray else 0)}
        first = self.baseline is None
        if first:
            self.baseline = row
        for k in self.peak:
            self.peak[k] = max(self.peak[k], row[k])
        self.samples += 1
        if not first:
            self._busy_counts.append(busy)
        self._t1 = now
        self.max_processes = max(self.max_processes, counted)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "MemorySampler":
        self._t0 = time.perf_counter()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def cpu_seconds(self, counted: bool = True) -> float:
        """CPU seconds used while sampling by the counted (or the excluded) processes.

        A process that exits between samples loses its last <= interval_s of CPU time.
        """
        return sum(self._cpu_last[pid] - first for pid, first in self._cpu_first.items()
                   if self._counted(self._category.get(pid, "driver")
                                    if pid != self._root.pid else "driver") == counted)

    def summary(self) -> dict[str, Any]:
        base = self.baseline or {}
        wall = max(self._t1 - self._t0, 1e-9)
        cpu = self.cpu_seconds()
        return {"peak_rss_mb": mb(self.peak["driver_workers"]),
                "peak_rss_tree_mb": mb(self.peak["tree"]),
                "peak_rss_driver_mb": mb(self.peak["driver"]),
                "peak_rss_workers_mb": mb(self.peak["workers"]),
                "start_rss_mb": mb(base.get("driver_workers", 0)),
                "start_rss_tree_mb": mb(base.get("tree", 0)),
                "rss_samples": self.samples, "rss_interval_s": self.interval_s,
                "max_processes": self.max_processes, "counts_ray_processes": self.ray,
                "cpu_s": round(cpu, 2),
                "excluded_cpu_s": round(self.cpu_seconds(counted=False), 2),
                # share of all the machine's cores these processes kept busy over the measurement
                "cpu_util": round(cpu / (wall * (os.cpu_count() or 1)), 2),
                # processes (driver, workers) each using >= half a core, over the samples
                "busy_procs_max": max(self._busy_counts, default=0),
                "busy_procs_mean": round(sum(self._busy_counts) / max(1, len(self._busy_counts)), 2)}


def measure(fn: Callable[[], Any], *, images: int, repeat: int = 1, ray: bool = True,
            sampler_interval_s: float = 0.1) -> tuple[dict[str, Any], Any]:
    """Run `fn` `repeat` times under one memory sampler; report the fastest run.

    Returns (measurement, value of the last call). Peak memory and CPU use are over all repeats.
    """
    seconds, value = [], None
    load_before = loadavg()
    with MemorySampler(sampler_interval_s, ray=ray) as sampler:
        for _ in range(max(1, repeat)):
            t0 = time.perf_counter()
            value = fn()
            seconds.append(time.perf_counter() - t0)
    best = min(seconds)
    summary = sampler.summary()
    summary["images_per_cpu_s"] = (round(images * len(seconds) / summary["cpu_s"], 1)
                                   if summary["cpu_s"] > 0 else None)
    result = {"images": images, "seconds": round(best, 3), "images_per_s": round(images / best, 1),
              "runs_s": [round(s, 3) for s in seconds], **summary,
              "loadavg_before": load_before, "loadavg_after": loadavg()}
    return result, value


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge single-run measurements of one method (taken in interleaved rounds) into one.

    Time: the fastest run (`seconds`, `images_per_s`) and the median (`median_s`); memory: the
    highest peak; CPU: totals over all runs.
    """
    if len(runs) == 1:
        out = dict(runs[0])
        out["median_s"] = out["seconds"]
        return out
    seconds = [r["seconds"] for r in runs]
    images = runs[0]["images"]
    best = min(seconds)
    cpu = sum(r["cpu_s"] for r in runs)
    out = dict(runs[0])
    out.update({
        "seconds": best, "images_per_s": round(images / best, 1),
        "median_s": round(sorted(seconds)[len(seconds) // 2], 3),
        "runs_s": [s for r in runs for s in r["runs_s"]],
        "cpu_s": round(cpu, 2),
        "excluded_cpu_s": round(sum(r["excluded_cpu_s"] for r in runs), 2),
        "cpu_util": round(sum(r["cpu_util"] for r in runs) / len(runs), 2),
        "images_per_cpu_s": round(images * len(runs) / cpu, 1) if cpu > 0 else None,
        "busy_procs_max": max(r["busy_procs_max"] for r in runs),
        "busy_procs_mean": round(sum(r["busy_procs_mean"] for r in runs) / len(runs), 2),
        "rss_samples": sum(r["rss_samples"] for r in runs),
        "max_processes": max(r["max_processes"] for r in runs),
        "loadavg_before": [r["loadavg_before"] for r in runs],
        "loadavg_after": [r["loadavg_after"] for r in runs],
    })
    for key in ("peak_rss_mb", "peak_rss_tree_mb", "peak_rss_driver_mb", "peak_rss_workers_mb"):
        out[key] = max(r[key] for r in runs)
    return out


def with_retry(fn: Callable[[], dict[str, Any]], what: str, attempts: int = 2) -> dict[str, Any]:
    """Run one measurement; retry once if it crashed (other jobs on a shared machine can kill
    its worker processes). The dict it returns records how many attempts it took."""
    for attempt in range(1, attempts + 1):
        try:
            m = fn()
            m["attempts"] = attempt
            return m
        except Exception as e:
            if attempt == attempts:
                raise
            print(f"{what} failed ({type(e).__name__}: {str(e)[:200]}); retrying once", flush=True)
    raise AssertionError("unreachable")


def ratio(x: float | None, y: float | None, nd: int = 2) -> float | None:
    """x / y rounded, or None when either side is missing or zero (a ratio of nothing is not 0)."""
    return round(x / y, nd) if x and y else None


def fmt(v: Any, nd: int = 1) -> str:
    """A table cell: '-' for missing, thousands separators, `nd` decimals for floats."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


QUIET_LOAD = 1.5  # a run that starts above this 1-minute load average is not kept (the house rule)


def wait_for_quiet(limit_s: float, cores: int) -> dict[str, Any]:
    """Wait (up to `limit_s`) for the 1-minute load average to drop below min(`cores`, QUIET_LOAD);
    say what it was."""
    t0, quiet = time.perf_counter(), min(cores, QUIET_LOAD)
    while limit_s > 0 and (loadavg() or [0])[0] >= quiet and time.perf_counter() - t0 < limit_s:
        time.sleep(5)
    return {"limit_s": limit_s, "waited_s": round(time.perf_counter() - t0, 1), "loadavg": loadavg()}


def md_table(headers: list[str], rows: list[list[Any]], align: str | None = None) -> list[str]:
    """Markdown table lines; `align` is one character per column ('l' or 'r'), default: first left."""
    align = align or "l" + "r" * (len(headers) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return ["| " + " | ".join(headers) + " |", rule] + ["| " + " | ".join(str(c) for c in r) + " |"
                                                          for r in rows]


def targets_table(targets: list[dict[str, Any]], nd: int = 2) -> list[str]:
    """The PASS/FAIL table every benchmark ends with; a noisy verdict says how noisy."""
    rows = []
    for t in targets:
        verdict = "n/a" if t.get("pass") is None else ("PASS" if t["pass"] else "FAIL")
        if t.get("noisy"):
            verdict += f" (noisy: runs of one method differ up to x{fmt(t['spread'], 2)})"
        rows.append([t["target"], fmt(t.get("measured"), nd), verdict])
    return md_table(["target", "measured", "result"], rows, "lrl")


def start_ray(workers: int, cpus_per_worker: float) -> float:
    """Start raymill's Ray (session.start: the product's own settings) and check that `workers`
    trainer workers of `cpus_per_worker` fit; returns the seconds `ray.init` took."""
    from stages.common import session
    from stages.common.config import RayConfig

    t0 = time.perf_counter()
    resources = session.start(RayConfig())
    if workers * cpus_per_worker > resources["CPU"] + 1e-9:
        raise ValueError(f"{workers} workers x {cpus_per_worker} CPU exceed the cluster's "
                         f"{resources['CPU']:g} CPUs; lower --cpus-per-worker")
    return time.perf_counter() - t0
