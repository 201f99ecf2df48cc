"""Where a training epoch's time goes, measured so that nothing can hide, and the verdict on it.

Three clocks per epoch:
- `wait_s`: host time the loop spent blocked on its next batch (the feed's own counter);
- `busy_s`: the device's busy time. On CUDA, events recorded around each step on the stream and
  read once per epoch, so a host thread that waits for the GIL between kernel launches no
  longer counts as "compute" (it did: 81 -> 262 ms a step beside 12 decode threads on an H100);
  on the CPU, the step's wall time, because the CPU is the device;
- `wall_s`: the epoch's wall time, checkpoint I/O excluded.
utilisation = busy / wall; stall = min(wait, wall - busy) / wall: the share of the wall that the
device sat idle while the loop waited for input. On a CPU the two never overlap (the step is host
work), so this is wait / wall. On a GPU the host can wait for its next batch while the kernels of
the last step still run: that wait costs the device nothing, and counting it called an H100 busy
96% of the wall "input-bound, stall 63%" (the decoded tier's copies synchronised with the stream).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["StepMeter", "EpochTimes", "verdict", "over_epochs", "INPUT_BOUND_STALL", "LOW_UTILISATION"]

# Above this share of the wall spent waiting for input, input is the weakest link.
INPUT_BOUND_STALL = 0.15
# A GPU busy for less than this share of the wall, with no input wait to blame, is held back by
# the host's own step work (launches, syncs, Python).
LOW_UTILISATION = 0.8


@dataclass(frozen=True)
class EpochTimes:
    images: int
    wait_s: float
    busy_s: float
    wall_s: float

    @property
    def stall(self) -> float:
        idle = max(0.0, self.wall_s - self.busy_s)
        return min(1.0, min(self.wait_s, idle) / max(self.wall_s, 1e-9))

    @property
    def utilisation(self) -> float:
        return min(1.0, self.busy_s / max(self.wall_s, 1e-9))

    @property
    def device_images_per_s(self) -> float:
        """What the device (or the CPU step) sustains when it never waits."""
        return self.images / max(self.busy_s, 1e-9)


class StepMeter:
    """Device busy time of each step: CUDA events on a GPU, the step's wall time on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple] = []
        self._host_s = 0.0
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            self._pairs.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._pairs[-1][0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._pairs[-1][1].record()
        else:
            self._host_s += time.perf_counter() - self._t0

    def busy_s(self) -> float:
        """Busy seconds so far (one device sync on CUDA: call per epoch or checkpoint, not per step)."""
        if not self.cuda:
            return self._host_s
        if self._pairs:
            self._pairs[-1][1].synchronize()
        # Fold finished pairs into a sum, so a long epoch holds a bounded number of events.
        self._host_s += sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3
        self._pairs.clear()
        return self._host_s


def _procs(n: int) -> str:
    return f"{n} process{'' if n == 1 else 'es'}"


def _more_cpus(device: str, free_cpus: float | None) -> str:
    """The input-bound fix of more CPUs: `free_cpus` is what no worker holds (None: unknown)."""
    per = "GPU" if device == "GPU" else "worker"
    if free_cpus is not None and free_cpus < 1:  # the workers hold every CPU: the setting cannot give more
        return f"more cores per {per} (a bigger node: the workers hold every CPU)"
    return f"more CPUs per {per} (train.cpus_per_worker)"


def _rate(x: float) -> str:
    return f"{x:,.0f} img/s"


class StartWaits(NamedTuple):
    """Ray Data's wait in an epoch, in parts (means over ranks): before the first batch, in the first
    half of the batches (that one included), the second half's stall; `warm`: the next epoch starts
    while this one trains (train.next_epoch_at < 1)."""

    start_s: float
    early_s: float
    late_stall: float | None
    warm: bool = True
    ahead: bool = False  # this epoch's execution began while the one before trained (most ranks)


def _ray_data_start(t: EpochTimes, w: StartWaits | None, device: str, rate: str) -> str | None:
    """The phrase for a wait that was Ray Data's execution starting: most of it before the first
    batch, or in the epoch's first half while the second half kept up (a rate limit spreads it over
    the epoch). A fresh run's epoch 1 begins during the worker's start, so its start shows in the
    first half. None for any other wait."""
    if w is None:
        return None
    if w.start_s > 0.5 * t.wait_s:
        where = f"{w.start_s:.1f} s of the {t.wait_s:.1f} s wait came before the epoch's first batch"
    elif w.late_stall is not None and w.early_s >= 0.75 * t.wait_s and w.late_stall <= INPUT_BOUND_STALL:
        where = (f"{w.early_s:.1f} s of the {t.wait_s:.1f} s wait came in the epoch's first half, while its "
                 "execution started (the second half kept up)")
    else:
        return None
    if w.ahead:  # started during the epoch before, and still not ready: starting earlier is no fix
        fix = ("this epoch's execution began while the one before trained and still was not ready: Ray Data "
               "cannot build an epoch ahead on these CPUs; train.ingest=stream (no cluster-wide start), or "
               "add CPU nodes")
    elif w.warm:
        fix = ("later epochs start while the one before trains: train more epochs a run, or "
               "train.ingest=stream (no cluster-wide start)")
    else:
        fix = ("every epoch starts cold (train.next_epoch_at=1): train.next_epoch_at=0.5 starts the next one "
               "while this one trains, or train.ingest=stream (no cluster-wide start)")
    return f"input-bound: Ray Data's start is the weakest link, {where}, beside a {device} that does ≈ {rate}; {fix}"


def verdict(t: EpochTimes, device: str, ingest: str, decode: dict | None = None, tier: str | None = None,
            workers: int = 1, ray_waits: StartWaits | None = None, free_cpus: float | None = None) -> str:
    """One phrase naming the weakest link with its numbers, and a fix that works.

    `decode` is the feed's capacity report ({"processes": n, "images_per_s": r}) when the feed
    knows it: r is n / (decode CPU seconds per image), what its processes can deliver. `tier` is
    the feed's tier (`decoded-gpu`/`decoded-host` when the decoded tier fed the epoch). `t` and
    `decode` are one worker's (the mean over `workers`): rates are said for all of them, beside
    the epoch's images/s, which counts every worker (one worker's rate had read as a bound 4.7x
    below the throughput printed next to it). `ray_waits`: Ray Data's wait in parts; `free_cpus`: `_more_cpus`.
    """
    if t.images == 0:  # more workers than training rows: the mean worker's batches were empty
        return "too few images this epoch to judge: fewer training rows than train.num_workers"
    if workers > 1:
        t = EpochTimes(t.images * workers, t.wait_s, t.busy_s, t.wall_s)
        decode = decode and {"processes": decode["processes"] * workers,
                             "images_per_s": decode["images_per_s"] * workers}
    rate = _rate(t.device_images_per_s)
    have = f" (decode {_procs(decode['processes'])} ≈ {_rate(decode['images_per_s'])})" if decode else ""
    if t.stall > INPUT_BOUND_STALL:
        if ingest == "ray_data":
            return _ray_data_start(t, ray_waits, device, rate) or (
                f"input-bound: Ray Data is the weakest link, stall {t.stall:.0%} beside a {device} that does "
                f"≈ {rate}; add CPU nodes (decode runs on any node's CPUs), train.object_store_cache=true, "
                "or store decoded (etl.parquet_encoding=raw)")
        more = _more_cpus(device, free_cpus)
        if tier and tier.startswith("decoded"):
            return (f"input-bound: the decoded tier's augmentation ({tier}) < {device} ≈ {rate}, stall "
                    f"{t.stall:.0%}; keep the tier on the GPU (train.decoded_tier=gpu, "
                    "train.decoded_tier_gpu_share) or give the worker more CPUs")
        if decode and device == "CPU" and decode["images_per_s"] >= t.device_images_per_s:
            share = t.device_images_per_s / decode["images_per_s"]  # of the cores, to decode at the step's rate
            if share < t.stall / 2:  # decode cannot explain the wait: storing decoded would win back <= share
                return (f"input-bound: stall {t.stall:.0%}, but decode ({_procs(decode['processes'])} ≈ "
                        f"{_rate(decode['images_per_s'])}) needs only {share:.0%} of the cores at the step's "
                        f"≈ {rate}: the wait is elsewhere (the first batches, shard reads, another rank, or other "
                        "load on this machine); raise train.prefetch_batches, or train longer epochs")
            both = 1 / (1 / decode["images_per_s"] + 1 / t.device_images_per_s)
            return (f"CPU-bound: decode ({_procs(decode['processes'])} ≈ {_rate(decode['images_per_s'])}) and "
                    f"the step (≈ {rate}) share the same cores, together ≈ {_rate(both)}; add cores, "
                    "train.decoded_tier=auto when the data fits, or store decoded (etl.parquet_encoding=raw)")
        if decode and decode["images_per_s"] >= t.device_images_per_s:
            return (f"input-bound: stall {t.stall:.0%} although decode {_procs(decode['processes'])} ≈ "
                    f"{_rate(decode['images_per_s'])} ≥ {device} ≈ {rate}: the wait is shard reads or "
                    "the first batches, not decode; raise train.prefetch_batches, or train longer epochs")
        limit = (f"decode {_procs(decode['processes'])} ≈ {_rate(decode['images_per_s'])}" if decode
                 else "decode in threads")
        return (f"input-bound: {limit} < {device} ≈ {rate}; {more}, train.decoded_tier=auto when "
                "the data fits, or train.ingest=ray_data with CPU nodes")
    if device == "GPU" and t.utilisation < LOW_UTILISATION:
        return (f"host-bound: the GPU is busy {t.utilisation:.0%} of the wall and input waits only "
                f"{t.stall:.0%}; the step's host work is the limit (kernel launches, syncs, or threads "
                f"beside the loop holding the GIL): raise train.batch_size, decode in processes "
                f"(train.decode_processes), or use a larger model per step{have}")
    if device == "CPU" and ingest == "stream" and decode is None and not (tier and tier.startswith("decoded")):
        # decode threads run on the step's own cores, so their share is in the step's time: "input
        # keeps up" had hidden a decode that cost ~30% of the throughput (a review: 1,548 img/s on raw)
        return (f"compute-bound: the CPU ≈ {rate}, its step sharing the cores with the decode threads (their "
                "share is in the step's time); train.decode_processes decodes apart, in processes")
    return f"compute-bound: the {device} is the weakest link ≈ {rate}, input keeps up{have}"


def over_epochs(history: list[dict]) -> dict:
    """A run's feed figures from its epochs' rows: images/s, stall and utilisation over all of them
    (weighted by each epoch's wall), and the verdict of the kind that took most of the wall. The last epoch's
    had stood for the run: with train.ingest=ray_data its decode was done during the epoch before
    (WarmEpochs), and it read 1,843 img/s and "compute-bound" for a run that averaged 509 img/s."""
    rows = [h for h in history if h.get("wall_s")]
    if not rows:
        return {"images_per_s": None, "stall_fraction": None, "device_utilisation": None, "verdict": None,
                "verdict_epochs": []}
    walls = [h["wall_s"] for h in rows]
    images = sum(h.get("images_per_s", 0.0) * h.get("local_wall_s", h["wall_s"]) for h in rows)
    mean = lambda key: sum((h.get(key) or 0.0) * w for h, w in zip(rows, walls)) / sum(walls)
    kind = lambda h: str(h.get("verdict") or "").split(":")[0]  # "input-bound", "compute-bound", ...
    walls_of: dict[str, float] = {}
    for h, w in zip(rows, walls):
        walls_of[kind(h)] = walls_of.get(kind(h), 0.0) + w
    most = max(walls_of, key=walls_of.__getitem__)
    of_kind = [(h, w) for h, w in zip(rows, walls) if kind(h) == most]
    return {"images_per_s": images / sum(h.get("local_wall_s", h["wall_s"]) for h in rows),
            "stall_fraction": mean("stall_fraction"), "device_utilisation": mean("device_utilisation"),
            # its words from the kind's median epoch by wall: neither its slowest nor its fastest
            "verdict": sorted(of_kind, key=lambda p: p[1])[len(of_kind) // 2][0].get("verdict"),
            "verdict_epochs": [h["epoch"] for h, _ in of_kind if "epoch" in h]}
