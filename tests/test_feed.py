"""The input path without Ray: decode processes, their determinism and clean-up, the decoded
tier, and the verdict in settings whose answer is known (slowed decode vs a slow step)."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from stages.feed import decoded_tier
from stages.feed import meters
from stages.feed import streaming
from stages.feed.decode_pool import DecodePool, DecodeSpec
from stages.feed.feeds import FedBatch, KeptFeed, ListFeed, PoolFeed, ThreadFeed
from tests.conftest import REPO, interruptible

SPEC = DecodeSpec(size=32, raw=False, seed=3, epoch=1, augment=True, scale_min=0.3, crop=True, flip=True)


def _jpeg(rng, shape=(48, 64), fmt="JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray((rng.random((*shape, 3)) * 255).astype(np.uint8)).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards():
    """Three in-memory 'shards' of (key, label, jpeg) rows, read through the real epoch reader."""
    rng = np.random.default_rng(0)
    rows = [(f"{i:032x}", i % 3, _jpeg(rng)) for i in range(90)]
    refs = [streaming.ShardRef(f"mem://{k}", "parquet", 30, 0, str(k)) for k in range(3)]
    return refs, {ref.uri: rows[k * 30:(k + 1) * 30] for k, ref in enumerate(refs)}


def _epoch(shards, rank=0, world=1):
    refs, data = shards
    return streaming.epoch_batches(refs, lambda ref: data[ref.uri], 3, 1, rank, world, 8, 16)


def _collect(feed):
    return [([r[0] for r in fed.rows], np.array(fed.images)) for fed in feed]


def test_same_batches_for_one_and_many_processes_and_threads(shards):
    with DecodePool(1, 8, 32, 2) as one, DecodePool(3, 8, 32, 4) as many:
        a, b = _collect(PoolFeed(one, _epoch(shards), SPEC)), _collect(PoolFeed(many, _epoch(shards), SPEC))
    c = _collect(ThreadFeed(_epoch(shards), SPEC, 2, 2))
    assert len(a) == len(b) == len(c) == 12
    for (ka, xa), (kb, xb), (kc, xc) in zip(a, b, c):
        assert ka == kb == kc and np.array_equal(xa, xb) and np.array_equal(xa, xc)
    keys = [k for ks, _ in a for k in ks]
    assert sorted(keys) == sorted(r[0] for rows in shards[1].values() for r in rows), "not exactly once"


def test_samples_beyond_the_shared_inbox_travel_pickled_and_decode_the_same():
    """A slot's inbox holds its batch's bytes up to the decoded size (8 x 32 x 32 x 3 here); the
    96 px noise PNGs (~28 KB each) cannot fit, the JPEGs between them do."""
    rng = np.random.default_rng(1)
    rows = [(f"{i:032x}", i % 2, _jpeg(rng, (96, 96), "PNG") if i % 2 else _jpeg(rng)) for i in range(8)]
    assert sum(len(r[2]) for r in rows) > 8 * 32 * 32 * 3
    with DecodePool(2, 8, 32, 2) as pool:
        got = _collect(PoolFeed(pool, iter([rows]), SPEC))
    want = _collect(ThreadFeed(iter([rows]), SPEC, 1, 1))
    assert got[0][0] == want[0][0] and np.array_equal(got[0][1], want[0][1])


def test_a_bad_sample_raises_in_the_loop_and_the_pool_ends_clean(shards):
    refs, data = shards
    broken = {**data, refs[1].uri: [(k, y, b"not a jpeg") for k, y, _ in data[refs[1].uri]]}
    me = psutil.Process()
    with DecodePool(2, 8, 32, 2) as pool:
        assert len(_decoders(me)) == 2, "the test must see the pool's processes to see them go"
        feed = PoolFeed(pool, streaming.epoch_batches(refs, lambda r: broken[r.uri], 3, 1, 0, 1, 8, 4), SPEC)
        with pytest.raises(Exception, match="not_an_image|cannot identify|decode"):
            _collect(feed)
        assert len(_collect(PoolFeed(pool, _epoch(shards), SPEC))) == 12, "the pool survives a bad epoch"
    _no_decoders_left(me)


def _decoders(root: psutil.Process) -> list[psutil.Process]:
    """Decode processes of `root`: the children of its own forkserver (a direct child of it; Ray's
    dashboard has one too, further down). The forkserver stays, one per process, and exits with it."""
    out = []
    for server in root.children():
        try:
            if "multiprocessing.forkserver" in " ".join(server.cmdline()):
                out += server.children()
        except psutil.NoSuchProcess:
            pass
    return out


def _no_decoders_left(root: psutil.Process, timeout_s: float = 5.0) -> None:
    deadline = time.time() + timeout_s
    while _decoders(root) and time.time() < deadline:
        time.sleep(0.1)
    assert not _decoders(root), "decode processes outlived their pool"


def _named_semaphores() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.")} if os.path.isdir("/dev/shm") else set()


def test_the_pool_names_no_semaphores_and_a_killed_decoder_breaks_it_loudly(shards):
    # ProcessPoolExecutor's queues named five POSIX semaphores per pool: a SIGKILLed Ray worker left
    # them in /dev/shm, and a Tune actor ending mid-close made its resource tracker print tracebacks
    from concurrent.futures.process import BrokenProcessPool

    before, me = _named_semaphores(), psutil.Process()
    with DecodePool(2, 8, 32, 2) as pool:
        assert not _named_semaphores() - before, "the pool named a semaphore in /dev/shm"
        assert len(_collect(PoolFeed(pool, _epoch(shards), SPEC))) == 12
        _decoders(me)[0].kill()
        slot = pool.acquire(threading.Event())
        with pytest.raises(BrokenProcessPool, match="ended"):
            deadline = time.time() + 10
            while time.time() < deadline:  # the pool learns of the death from the child's sentinel
                for future in pool.submit(slot, next(_epoch(shards)), SPEC):
                    future.result(timeout=10)
    _no_decoders_left(me)


def test_pipe_pool_answers_raises_the_childs_error_and_skips_cancelled_work():
    import multiprocessing
    import operator
    from concurrent.futures.process import BrokenProcessPool

    from stages.feed.pipe_pool import PipePool

    pool = PipePool(1, multiprocessing.get_context("forkserver"), int, ())  # int(): a no-op initializer
    try:
        slow = pool.submit(time.sleep, 0.3)
        dropped = pool.submit(operator.truediv, 1, 0)
        assert dropped.cancel()  # still queued behind the sleep: it never runs
        div, ok = pool.submit(operator.truediv, 1, 0), pool.submit(operator.add, 2, 3)
        assert slow.result(5) is None and ok.result(5) == 5 and dropped.cancelled()
        with pytest.raises(ZeroDivisionError) as raised:
            div.result(5)
        assert "ZeroDivisionError" in str(raised.value.__cause__)  # the child's own traceback
        with pytest.raises(Exception, match="pickle"):  # a task that does not pickle fails alone
            pool.submit(operator.add, lambda: 0, 1).result(5)
        assert pool.submit(operator.add, 1, 2).result(5) == 3
        at_hand, queued = pool.submit(time.sleep, 0.3), pool.submit(operator.add, 1, 1)
    finally:
        pool.close()
    assert at_hand.result(0) is None and queued.cancelled()  # close lets the task at hand finish
    with pytest.raises(BrokenProcessPool, match="closed"):
        pool.submit(operator.add, 1, 1)
    with pytest.raises(BrokenProcessPool, match="(?s)did not start.*ZeroDivisionError"):  # with the child's traceback
        PipePool(1, multiprocessing.get_context("forkserver"), operator.truediv, (1, 0))


_CHILD = textwrap.dedent("""
    import sys, time
    from stages.feed.decode_pool import DecodePool
    if __name__ == "__main__":
        pool = DecodePool(2, 4, 16, 2)
        print("ready", flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("how", ["sigkill", "ctrl_c"])
def test_no_orphans_when_the_owner_is_killed_or_interrupted(tmp_path, how):
    script = tmp_path / "owner.py"
    script.write_text(_CHILD)
    owner = subprocess.Popen(interruptible(str(script)), cwd=REPO, stdout=subprocess.PIPE,
                             start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert owner.stdout.readline().strip() == b"ready"
    decoders = [p for p in psutil.Process(owner.pid).children(recursive=True)
                if p.ppid() != owner.pid]
    assert len(decoders) >= 1
    if how == "sigkill":
        owner.kill()
    else:  # Ctrl-C reaches the whole foreground process group
        os.killpg(owner.pid, signal.SIGINT)
    owner.wait(10)
    gone, alive = psutil.wait_procs(decoders, timeout=5)
    assert not alive, f"orphans after {how}: {[p.pid for p in alive]}"


def test_decoded_tier_is_exactly_once_deterministic_and_augments_on_device():
    tier = decoded_tier.DecodedTier(20, 16, "host", torch.device("cpu"))
    pixels = np.random.default_rng(1).integers(0, 255, (20, 16, 16, 3), dtype=np.uint8)
    tier.put(0, [(f"k{i}", i % 2) for i in range(12)], pixels[:12])
    assert not tier.ready
    tier.put(12, [(f"k{i}", i % 2) for i in range(12, 20)], pixels[12:])
    assert tier.ready
    augment = {"scale_min": 0.3, "random_resized_crop": True, "flip": True}

    def epoch(e, start=0):
        return [([r[0] for r in f.rows], f.images.clone()) for f in tier.feed(5, e, 0, 8, start, 3, augment)]

    one, again, other = epoch(2), epoch(2), epoch(3)
    assert sorted(k for ks, _ in one for k in ks) == sorted(f"k{i}" for i in range(20)), "not exactly once"
    assert all(ka == kb and torch.equal(xa, xb) for (ka, xa), (kb, xb) in zip(one, again))
    assert [k for ks, _ in one for k in ks] != [k for ks, _ in other for k in ks], "epochs reshuffle"
    assert epoch(2, start=1)[0][0] == one[1][0] and torch.equal(epoch(2, start=1)[0][1], one[1][1])
    assert one[0][1].dtype == torch.uint8 and one[0][1].shape == (8, 16, 16, 3)
    # identity parameters give the stored pixels back: the affine grid is exact
    ident = decoded_tier.augment_batch(torch.from_numpy(pixels), torch.Generator().manual_seed(0), 1.0, False, False)
    assert torch.equal(ident, torch.from_numpy(pixels))


def _run(feed, step_s: float) -> meters.EpochTimes:
    """An emulated device: each step sleeps `step_s` (no GIL held), timed like train_loop."""
    meter, images, started = meters.StepMeter(torch.device("cpu")), 0, time.perf_counter()
    for fed in feed:
        meter.start()
        time.sleep(step_s)
        meter.stop()
        images += len(fed.rows)
    return meters.EpochTimes(images, feed.wait_s, meter.busy_s(), time.perf_counter() - started)


def test_verdict_names_slowed_decode_and_a_slow_step_with_true_numbers(shards):
    rng = np.random.default_rng(2)
    # Slowed on purpose: 700x700 PNGs (no JPEG draft shortcut) decoded to 32 px, in 1 process.
    slow = [(f"{i:032x}", 0, _jpeg(rng, (700, 700), "PNG")) for i in range(32)]
    with DecodePool(1, 8, 32, 3) as pool:
        feed = PoolFeed(pool, iter([slow[i:i + 8] for i in range(0, 32, 8)]), SPEC)
        t = _run(feed, step_s=0.002)
        capacity = feed.capacity()
        said = meters.verdict(t, "CPU", "stream", capacity)
        truth = 1 - (t.images / t.wall_s) / (8 / 0.002)  # 1 - fed / the step's own rate
        assert said.startswith(f"input-bound: decode 1 process ≈ {capacity['images_per_s']:,.0f} img/s < CPU"), said
        assert abs(t.stall - truth) < 0.05 and capacity["images_per_s"] < t.device_images_per_s
        assert "(train.cpus_per_worker)" in said  # CPUs are free beside the workers (unknown: as if free)
        # the workers hold every CPU (a default stream plan): the setting cannot give more, a bigger node can
        held = meters.verdict(t, "CPU", "stream", capacity, free_cpus=0.0)
        assert "more cores per worker (a bigger node" in held and "train.cpus_per_worker" not in held, held
        feed = PoolFeed(pool, _epoch(shards), SPEC)
        t = _run(feed, step_s=0.05)
        said = meters.verdict(t, "CPU", "stream", feed.capacity())
        truth = 1 - (t.images / t.wall_s) / (t.images / (0.05 * 12))
        assert said.startswith("compute-bound: the CPU is the weakest link"), said
        assert abs(t.stall - truth) < 0.05


def test_a_restarted_worker_refills_its_tier_and_sees_the_same_epoch(shards):
    """The worker's input side (stages.feed.worker_feeds) without Ray: epoch 1 fills the tier as it
    trains; a restarted worker (a fresh object) refills it with one decode pass, and its epoch 2
    is the same batches, pixel for pixel."""
    from stages.feed.worker_feeds import WorkerFeeds
    from stages.common.config import TrainConfig

    refs, data = shards
    cfg = TrainConfig(batch_size=8, decoded_tier="host", shuffle_buffer_rows=16, prefetch_batches=2,
                      augment={"random_resized_crop": True, "flip": True, "scale_min": 0.3})
    config = {"seed": 3, "image_size": 32, "raw": False, "decode_processes": 2}

    def worker() -> WorkerFeeds:
        return WorkerFeeds(cfg, config, 0, 1, torch.device("cpu"), {"train": refs}, 90, 12, lambda r: data[r.uri])

    first = worker()
    try:
        for step, fed in enumerate(first.train_feed(0, 0)):
            first.keep(0, step, fed)
        assert first.tier.ready
        trained = [([r[0] for r in f.rows], f.images.clone()) for f in first.train_feed(1, 0)]
    finally:
        first.close()
    again = worker()
    try:
        assert not again.tier.ready
        resumed = [([r[0] for r in f.rows], f.images.clone()) for f in again.train_feed(1, 0)]
    finally:
        again.close()
    assert again.tier.ready and len(trained) == len(resumed) == 12
    assert all(ka == kb and torch.equal(xa, xb) for (ka, xa), (kb, xb) in zip(trained, resumed))


def test_stall_counts_only_input_wait_that_left_the_device_idle():
    """A GPU step is queued, not run, by the host: the loop can wait for its next batch while the
    device still works. An H100 busy 96% of the wall was called "input-bound, stall 63%"."""
    overlapped = meters.EpochTimes(images=1000, wait_s=0.63, busy_s=0.96, wall_s=1.0)
    assert abs(overlapped.stall - 0.04) < 1e-9
    assert meters.verdict(overlapped, "GPU", "stream", None, "decoded-gpu").startswith("compute-bound")
    starved = meters.EpochTimes(images=1000, wait_s=0.5, busy_s=0.4, wall_s=1.0)
    assert abs(starved.stall - 0.5) < 1e-9 and "input-bound" in meters.verdict(starved, "GPU", "stream")
    idle = meters.EpochTimes(images=0, wait_s=0.3, busy_s=0.0, wall_s=1.0)  # a rank that got no rows
    assert "train.num_workers" in meters.verdict(idle, "CPU", "stream", {"processes": 1, "images_per_s": 9.0})
    # one worker's clocks, said for all: 2 workers of 500 img/s each are ≈ 1,000 img/s
    assert "≈ 1,000 img/s" in meters.verdict(meters.EpochTimes(500, 0.0, 1.0, 1.0), "CPU", "stream", None, None, 2)
    cpu = meters.EpochTimes(images=100, wait_s=0.3, busy_s=0.7, wall_s=1.0)  # host step: never overlaps
    assert abs(cpu.stall - 0.3) < 1e-9


def test_an_eval_pass_is_kept_only_whole_and_within_its_budget():
    """KeptFeed copies each batch (a pool reuses its slot's memory) and hands them on only after a
    whole pass; a pass over budget, or cut short, keeps nothing and the next pass decodes again."""
    slot = np.zeros((2, 4, 4, 3), np.uint8)

    def batches(n):  # one reused buffer, as a decode pool's slot
        for i in range(n):
            slot[:] = i
            yield FedBatch([(f"k{i}", i)], slot)

    class Source:
        def __init__(self, n):
            self.n, self.closed = n, False

        def __iter__(self):
            return batches(self.n)

        def close(self):
            self.closed = True

    kept = []
    source = Source(3)
    feed = KeptFeed(source, budget=3 * slot.nbytes, on_kept=kept.append)
    assert [int(f.images[0, 0, 0, 0]) for f in feed] == [0, 1, 2]
    feed.close()
    assert source.closed and len(kept) == 1
    assert [int(f.images[0, 0, 0, 0]) for f in ListFeed(kept[0])] == [0, 1, 2]  # copies, not the slot
    over = []
    list(KeptFeed(Source(3), budget=2 * slot.nbytes, on_kept=over.append))
    cut = []
    next(iter(KeptFeed(Source(3), budget=3 * slot.nbytes, on_kept=cut.append)))
    assert over == [] and cut == []
