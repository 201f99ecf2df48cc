"""Does starting from a pretrained raymill model help on few-shot data? (`train.init_from`)

One run, on data the benchmark makes (workflow.demo_data, 10 shapes):
1. pretrain: a model on shapes 0-4 (circle, ring, square, diamond, triangle), many images;
2. few-shot: shapes 5-9 (cross, star, hstripes, vstripes, checker), about `--shots` train images a
   class, trained with the same epochs and seed three ways: from scratch, from the pretrained model
   (`train.init_from`, head replaced: other class names) with `freeze_epochs=0`, and with
   `freeze_epochs=--freeze` (head only first, then the backbone at `backbone_lr_scale`).
Each few-shot run is `stages.train.run`, the function `raymill train` calls, in one Ray session;
test accuracy is on the few-shot set's own held-out test split (several times the train split).
The target: the fine-tuned run is clearly better than scratch; the margin and its spread over
the seeds are reported, not timed.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, fmt, loadavg, md_table, targets_table

__all__ = ["add_arguments", "run", "render"]

PRETRAIN_CLASSES = ("circle", "ring", "square", "diamond", "triangle")
FEWSHOT_CLASSES = ("cross", "star", "hstripes", "vstripes", "checker")
VARIANTS = ("scratch", "init", "init+freeze")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pretrain-per-class", type=int, default=300, help="pretraining images a class (default 300)")
    p.add_argument("--shots", type=int, default=10, help="few-shot train images a class, about (default 10)")
    p.add_argument("--pretrain-epochs", type=int, default=6, help="pretraining epochs (default 6)")
    p.add_argument("--epochs", type=int, default=8, help="few-shot epochs, every variant (default 8)")
    p.add_argument("--freeze", type=int, default=2, help="freeze_epochs of the third variant (default 2)")
    p.add_argument("--image-size", type=int, default=32, help="ETL image side, px (default 32)")
    p.add_argument("--width", type=int, default=16, help="small_cnn width (default 16)")
    p.add_argument("--seeds", default="0,1,2", help="few-shot seeds (default 0,1,2)")


def _trees(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """Two ImageFolder trees of one generated set: the pretraining shapes and the few-shot ones.
    The few-shot set has 5x `shots` images a class, so its test split is large enough to rank."""
    from workflow import demo_data

    per_class = max(args.pretrain_per_class, 5 * args.shots)
    demo_data.generate(root / "all", images=10 * per_class, seed=7, classes=10)
    pre, few = root / "pretrain", root / "fewshot"
    for name in PRETRAIN_CLASSES:
        shutil.move(str(root / "all" / name), pre / name)
    for name in FEWSHOT_CLASSES:
        files = sorted((root / "all" / name).iterdir())[: 5 * args.shots]
        (few / name).mkdir(parents=True)
        for f in files:
            shutil.move(str(f), few / name / f.name)
    return pre, few


def _config(args: argparse.Namespace, overrides: list[str]):
    from stages.common.config import load_config

    base = [f"etl.image_size={args.image_size}", "train.model=small_cnn", f"train.width={args.width}",
            "train.batch_size=16", "tracking.enabled=false"]
    return load_config(REPO / "configs" / "smoke.yaml", base + overrides)


def _train(cfg, data, out: Path, seed: int) -> dict[str, Any]:
    from stages import train

    t0 = time.perf_counter()
    artifact = train.run(cfg.train, data, str(out), seed=seed, ray_cfg=cfg.ray)
    m = artifact.manifest["metrics"]
    return {"test_acc": m["test_acc"], "test_rows": m["test_rows"], "best_val_acc": m["best_val_acc"],
            "seconds": round(time.perf_counter() - t0, 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from stages import etl
    from stages.common import session

    seeds = [int(s) for s in args.seeds.split(",")]
    started, load = time.time(), loadavg()
    with tempfile.TemporaryDirectory(prefix="raymill-finetune-") as tmp:
        root = Path(tmp)
        pre_src, few_src = _trees(root, args)
        cfg = _config(args, [f"train.epochs={args.pretrain_epochs}"])
        session.start(cfg.ray)
        pre_data = etl.run(cfg.etl, str(pre_src), str(root / "pre-ds"))
        # few-shot split: ~shots train images a class, the rest mostly test
        share = 1 / 5
        few_cfg = _config(args, [f"etl.split.train={share}", "etl.split.val=0.2", f"etl.split.test={0.8 - share}"])
        few_data = etl.run(few_cfg.etl, str(few_src), str(root / "few-ds"))
        pretrained = _train(cfg, pre_data, root / "pretrained", seed=0)
        runs = []
        for seed in seeds:
            for variant in VARIANTS:
                extra = [f"train.epochs={args.epochs}"]
                if variant != "scratch":
                    extra.append(f"train.init_from={root / 'pretrained'}")
                if variant == "init+freeze":
                    extra += [f"train.freeze_epochs={args.freeze}", "train.backbone_lr_scale=0.5"]
                result = _train(_config(args, extra), few_data, root / f"{variant}-{seed}", seed)
                runs.append({"seed": seed, "variant": variant, **result})
        train_rows = sum(s["rows"] for s in few_data.manifest["shards"]
                         if s["split"] == "train" and s["format"] == "parquet")
    return {"args": vars(args), "loadavg_at_start": load, "started": started, "pretrained": pretrained,
            "fewshot_train_rows": train_rows, "runs": runs}


def _by_variant(runs: list[dict]) -> dict[str, list[float]]:
    return {v: [r["test_acc"] for r in runs if r["variant"] == v] for v in VARIANTS}


def render(result: dict[str, Any]) -> str:
    a, runs = result["args"], result["runs"]
    accs = _by_variant(runs)
    margins = [i - s for i, s in zip(accs["init"], accs["scratch"])]
    margins_f = [i - s for i, s in zip(accs["init+freeze"], accs["scratch"])]
    lines = [f"Pretrained on {len(PRETRAIN_CLASSES)} shapes ({a['pretrain_per_class']} images a class, "
             f"{a['pretrain_epochs']} epochs: test_acc {fmt(result['pretrained']['test_acc'], 3)}); few-shot "
             f"on {len(FEWSHOT_CLASSES)} other shapes with {result['fewshot_train_rows']} train images in all, "
             f"{a['epochs']} epochs, small_cnn width {a['width']}, {a['image_size']} px. Load average at start: "
             f"{result['loadavg_at_start']} (the accuracies do not depend on it; the seconds do).", ""]
    rows = [[r["seed"], r["variant"], fmt(r["test_acc"], 3), r["test_rows"], fmt(r["seconds"], 1)] for r in runs]
    lines += md_table(["seed", "start", "test_acc", "test images", "train stage s"], rows, "llrrr") + [""]
    for name, m in (("init_from, freeze 0", margins), (f"init_from, freeze {a['freeze']}", margins_f)):
        lines.append(f"- {name} minus scratch: median {fmt(statistics.median(m), 3)}, "
                     f"min {fmt(min(m), 3)}, max {fmt(max(m), 3)} over {len(m)} seeds")
    lines.append("")
    # The target is on plain init_from (freeze 0), fixed before the run: not the better of the two.
    targets = [{"target": "init_from minus scratch, test_acc, smallest over the seeds (> 0.05)",
                "measured": min(margins), "pass": min(margins) > 0.05}]
    return "\n".join(lines + targets_table(targets, 3))
