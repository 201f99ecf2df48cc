"""The DDP step loop shared by the `ddp` benchmark's two launchers, and its torchrun entry point.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        benchmarks/ddp_torchrun_worker.py --out result.json --warmup 30 --steps 100

Both launchers (Ray Train's TorchTrainer and torchrun) call `timed_steps()` on the same model
(stages.model.zoo small_cnn), the same in-memory random batches, the same gloo backend and one
intra-op thread per process, so the only difference left is the launcher and how it wraps the
model in DistributedDataParallel. Imports only torch and stages.model.zoo (no Ray).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

__all__ = ["timed_steps", "build", "main"]


def build(width: int, classes: int, seed: int):
    import torch

    from stages.model.zoo import build_model

    torch.manual_seed(seed)  # identical init on every rank (DDP also broadcasts rank 0's)
    return build_model("small_cnn", classes, width)


def timed_steps(model, *, rank: int, world: int, batch_size: int, image_size: int, classes: int,
                warmup: int, steps: int, seed: int, batches: int = 8) -> dict[str, Any]:
    """`warmup` untimed then `steps` timed SGD steps on in-memory random data; timing from rank 0.

    `model` is already wrapped for DDP when world > 1. A barrier before and after the timed
    steps makes the measured interval the same on every rank. `cpu_s` is the CPU time (all
    threads) of every rank's process over the timed steps, summed: less sensitive than wall time
    to other load on the machine, and it shows a launcher's background work in the worker.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    data = [(torch.randn(batch_size, 3, image_size, image_size, generator=g),
             torch.randint(0, classes, (batch_size,), generator=g)) for _ in range(batches)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()

    def step(i: int) -> float:
        x, y = data[i % batches]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    distributed = dist.is_available() and dist.is_initialized()
    for i in range(warmup):
        step(i)
    if distributed:
        dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    step_s = []
    loss = float("nan")
    for i in range(steps):
        s0 = time.perf_counter()
        loss = step(warmup + i)
        step_s.append(time.perf_counter() - s0)
    cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)  # all threads of this process
    if distributed:
        dist.barrier()
    elapsed = time.perf_counter() - t0
    if distributed:
        dist.all_reduce(cpu)  # CPU seconds of every rank's process, summed
    step_s.sort()
    return {"rank": rank, "world": world, "steps": steps, "warmup": warmup, "batch_size": batch_size,
            "seconds": elapsed, "steps_per_s": steps / elapsed,
            "samples_per_s": steps * batch_size * world / elapsed,
            "step_ms_p50": 1000 * step_s[len(step_s) // 2], "step_ms_p90": 1000 * step_s[int(len(step_s) * 0.9)],
            "cpu_s": float(cpu[0]), "cpu_ms_per_step": 1000 * float(cpu[0]) / steps,
            "final_loss": loss, "torch_threads": torch.get_num_threads(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS")}


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo")  # env:// from torchrun
    t_ready = time.time()
    model = build(args.width, args.classes, args.seed)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    result = timed_steps(model, rank=rank, world=world, batch_size=args.batch_size,
                         image_size=args.image_size, classes=args.classes, warmup=args.warmup,
                         steps=args.steps, seed=args.seed)
    if rank == 0:
        result.update(launcher="torchrun", process_start=t_start, process_group_ready=t_ready,
                      finished=time.time())
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
