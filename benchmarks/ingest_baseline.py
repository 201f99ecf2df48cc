"""The ingest benchmark's baseline: a PyTorch DataLoader over the raw JPEG folder, in a fresh Python
process (benchmarks/ingest.py says what it measures)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO
from benchmarks.ingest_ours import _totals


class JpegFolder:
    """A plain map-style dataset (DataLoader needs only __len__ and __getitem__).

    Same pixels pipeline as ours: decode_rgb (centre crop, JPEG draft) and stages.feed.streaming.augment
    with the same parameters and a per-(seed, epoch, index) RNG.
    """

    def __init__(self, root: str, size: int, seed: int, augment: dict[str, Any]):
        root_path = Path(root)
        self.classes = sorted(d.name for d in root_path.iterdir() if d.is_dir())
        self.items = [(str(f), i) for i, c in enumerate(self.classes)
                      for f in sorted((root_path / c).iterdir()) if f.is_file()]
        self.size, self.seed, self.augment, self.epoch = size, seed, augment, 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        import numpy as np
        import torch

        from stages.feed.streaming import augment
        from stages.etl.images import decode_rgb

        path, label = self.items[index]
        with open(path, "rb") as f:
            pixels = decode_rgb(f.read(), self.size)
        a = self.augment
        rng = np.random.default_rng([self.seed, self.epoch, index])
        pixels = augment(pixels, rng, a["scale_min"], a["random_resized_crop"], a["flip"])
        return torch.from_numpy(pixels), label


def _cpu_with_children() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def dataloader_child(spec_json: str) -> None:
    """Entry point of the DataLoader process; prints one JSON line with its timings."""
    t_start = time.time()
    spec = json.loads(spec_json)
    import numpy  # noqa: F401  what a training script imports up front; forked workers inherit it
    import torch
    from torch.utils.data import DataLoader

    import stages.feed.streaming  # noqa: F401
    import stages.etl.images  # noqa: F401

    t_imported = time.time()
    a = spec["augment"]
    mean = torch.tensor(a["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(a["std"]).view(1, 3, 1, 1)
    t_loop = time.time()
    dataset = JpegFolder(spec["src"], spec["image_size"], spec["seed"], a)
    loader = DataLoader(dataset, batch_size=spec["batch_size"], shuffle=True, num_workers=spec["num_workers"],
                        generator=torch.Generator().manual_seed(spec["seed"]))
    epochs = []
    for epoch in range(spec["epochs"]):
        dataset.epoch = epoch  # workers are forked per epoch (not persistent) and see this value
        t0, cpu0 = time.time(), _cpu_with_children()
        n, t_first, batches = 0, None, 0
        for x, y in loader:
            # the same work as stages.train.loop.to_batch after its np.stack
            x = x.permute(0, 3, 1, 2).float().div_(255)
            x = ((x - mean) / std).contiguous()
            assert x.shape[0] == y.shape[0]
            n += x.shape[0]
            batches += 1
            if t_first is None:
                t_first = time.time()
        t_end = time.time()
        # exhausting the iterator joined its workers, so their CPU time is in RUSAGE_CHILDREN now
        epochs.append({"start": t0, "first": t_first, "end": t_end, "images": n, "batches": batches,
                       "cpu_s": _cpu_with_children() - cpu0})
    print("RESULT " + json.dumps({"process_start": t_start, "imported": t_imported, "loop_start": t_loop,
                                  "epochs": epochs, "torch_threads": torch.get_num_threads()}), flush=True)


def run_dataloader(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import MemorySampler, loadavg
    from stages.common.config import AugmentConfig

    spec = {"src": str(src), "image_size": args.image_size, "seed": args.seed, "batch_size": args.batch_size,
            "num_workers": args.dl_workers, "epochs": args.epochs,
            "augment": AugmentConfig().model_dump(mode="json")}
    cmd = [sys.executable, "-c", "import sys; from benchmarks.ingest_baseline import dataloader_child; "
           "dataloader_child(sys.argv[1])", json.dumps(spec)]
    load = loadavg()
    with MemorySampler(0.1, ray=False) as sampler:
        t_launch = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO), timeout=600)
        t_done = time.time()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"DataLoader process failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    epochs = [{"images": e["images"], "seconds": round(e["end"] - e["start"], 3),
               "images_per_s": round(e["images"] / max(e["end"] - e["start"], 1e-9), 1),
               "first_batch_s": round(e["first"] - e["start"], 3), "cpu_s": round(e["cpu_s"], 3)}
              for e in r["epochs"]]
    return {"method": "dataloader", "epochs": epochs, **_totals(epochs),
            "first_batch_loop_s": round(r["epochs"][0]["first"] - r["loop_start"], 3),
            "first_batch_job_s": round(r["epochs"][0]["first"] - t_launch, 3),
            "startup_s": round(r["loop_start"] - t_launch, 3),
            "imports_s": round(r["imported"] - r["process_start"], 3),
            "job_wall_s": round(t_done - t_launch, 2), "loadavg_before": load, "memory": sampler.summary(),
            "torch_threads_main": r["torch_threads"], "num_workers": args.dl_workers}


# ------------------------------------------------------------------------------------------
# part 3: input stall of the demo training (configs/default.yaml)
# ------------------------------------------------------------------------------------------
