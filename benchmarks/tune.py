"""P4: what early stopping is for. ASHA, FIFO and PBT side by side in one run, plus Tune's floor.

ASHA and FIFO use the same seed, so BasicVariantGenerator samples the same configurations, at
the same concurrency (session.plan_trials) and epoch budget. PBT samples its own starting points
(its param space adds momentum and weight decay) and explores lr, momentum and weight decay.
Times come from each trial's own result timestamps (result.json), relative to its search's start.

Start-up per trial = Tune's own per-trial floor + the trial's own start-up. The floor is measured
in the same run: a trivial function that reports at once, with a trial's resources, concurrency
and reused actors; its wall time x concurrency / trials is what Tune itself costs a trial slot
(actor start or reuse, scheduling, reporting). The trial's own part is its `startup_s` (its
function's first line -> first batch), cross-checked from Tune's side (`on_trial_start` -> first
batch: Tune calls it once the actor is up, so it adds nothing the floor does not hold).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import tune_rank, tune_replay
from benchmarks.common import REPO, fmt, loadavg, md_table, ratio, targets_table

__all__ = ["add_arguments", "run", "render"]

SCHEDULERS = ("asha", "fifo", "pbt")

# The searched space (train.* keys). `wide` is a first search on unfamiliar data: lr over four
# decades, weight decay over three, momentum from 0.5 to 0.99, so that many samples diverge or
# crawl, as they do when nobody knows the data's scale yet. Early stopping exists for such
# searches. `narrow` is the space of the runs up to 2026-11-25 04:10: around lr 0.05 most samples
# were good, each seed's FIFO met its goal in its first or second wave and ASHA could not beat it
# (1.10x median of 3 seeds, RESULTS.md history); it stays here to rerun that comparison.
SPACES = {
    "wide": {"lr": (0.0001, 1.0), "weight_decay": (0.00001, 0.01), "momentum": (0.5, 0.99, "uniform")},
    "narrow": {"lr": (0.0005, 0.5), "weight_decay": (0.00001, 0.001)},
}


def _space_yaml(name: str) -> str:
    items = [f"{k}: {{type: {v[2] if len(v) > 2 else 'loguniform'}, lower: {v[0]}, upper: {v[1]}}}"
             for k, v in SPACES[name].items()]
    return "{" + ", ".join(items) + "}"


def _space_text(name: str) -> str:
    return ", ".join(f"{k} {v[2] if len(v) > 2 else 'log-uniform'} {v[0]:g}-{v[1]:g}" for k, v in SPACES[name].items())


def add_arguments(p: argparse.ArgumentParser) -> None:
    # 3,000: an epoch (about 1.3 s at 0.74 CPU, scaled from the quick run) outweighs a trial's
    # start-up, so what ASHA saves is epochs; at 600 an epoch cost less than Tune's own per-trial floor
    p.add_argument("--images", type=int, default=3000, help="demo images (default 3000)")
    # 16 px: at 32 px every sampled lr above ~0.01 reached val_acc 1.0 within 2 epochs (the run of
    # 2026-11-25 03:57: FIFO hit its goal at 11 s), so there was nothing left for early stopping to
    # save. At 16 px a good lr climbs for ~9 epochs (0.57 after 1, 0.93 after 4, 0.98 after 9, measured
    # with `raymill train`, lr 0.05): the budget matters, as it does on real data.
    p.add_argument("--image-size", type=int, default=16, help="ETL image side in px (default 16)")
    p.add_argument("--samples", type=int, default=16, help="configurations per search (default 16)")
    p.add_argument("--max-epochs", type=int, default=12, help="epoch budget of a trial (default 12)")
    p.add_argument("--grace", type=int, default=1, help="ASHA grace period, epochs (default 1)")
    p.add_argument("--reduction", type=int, default=3, help="ASHA reduction factor (default 3)")
    # The time to a goal depends on where the good configurations fall in the sample order (FIFO
    # with a good first sample is hard to beat): ASHA and FIFO run on each seed, the target is the median.
    p.add_argument("--seeds", default="0,1,2,3,4", help="search seeds for ASHA vs FIFO (PBT runs on the first)")
    p.add_argument("--space", choices=sorted(SPACES), default="wide", help="searched space (default wide)")
    p.add_argument("--sweep", default="0.5,0.7,0.8,0.9", help="val_acc targets read from the same runs")
    p.add_argument("--quick", action="store_true", help="4 samples x 3 epochs on 200 images: proves it runs")


class _TrialClock:
    """Driver-side start of every trial (Tune's `on_trial_start`), and its first batch as the
    trial reported it: start-up as Tune sees it, placement and process start included."""

    def __init__(self) -> None:
        from ray.tune import Callback

        class Clock(Callback):
            def __init__(self, sink: dict):
                self.sink = sink

            def on_trial_start(self, iteration, trials, trial, **info):  # again after a PBT exploit
                self.sink.setdefault(trial.trial_id, {}).setdefault("start", time.time())

            def on_trial_result(self, iteration, trials, trial, result, **info):
                entry = self.sink.setdefault(trial.trial_id, {})
                if "first_batch_at" in result and "first" not in entry:
                    entry["first"] = result["first_batch_at"]

        self.trials: dict[str, dict] = {}
        self.callback = Clock(self.trials)

    def startups(self) -> list[float]:
        return [t["first"] - t["start"] for t in self.trials.values() if "first" in t and "start" in t]


def _config(scheduler: str, args, seed: int = 0) -> Any:
    from stages.common.config import load_config

    return load_config(REPO / "configs/smoke.yaml", [
        f"tune.scheduler={scheduler}", f"tune.num_samples={args.samples}", f"tune.max_epochs={args.max_epochs}",
        f"tune.grace_period={args.grace}", f"tune.reduction_factor={args.reduction}", f"tune.seed={seed}",
        "train.width=16", "train.batch_size=32", "train.optimizer=sgd",
        # every trial gets the whole budget (no searched length): what FIFO pays, ASHA can save
        f"tune.search_space={_space_yaml(args.space)}"])


def _search(scheduler: str, args, data, work: Path, seed: int = 0) -> dict[str, Any]:
    from stages.tune import stage as tune

    cfg, clock, out = _config(scheduler, args, seed), _TrialClock(), work / f"{scheduler}-{seed}"
    started = time.time()
    artifact = tune.run(cfg.tune, cfg.train, data, str(out), seed=0, ray_cfg=cfg.ray, callbacks=[clock.callback])
    wall = time.time() - started
    m, plan = artifact.manifest["metrics"], artifact.manifest["resource_plan"]
    startups = [v for v in artifact.manifest["startup_s"].values() if v is not None]
    trials = _trials(out)
    return {"scheduler": scheduler, "wall_s": round(wall, 1), "reports": _epoch_reports(trials, started),
            "trials": [{"config": t["config"], "curve": t["curve"]} for t in trials],
            "best_val_acc": m["best_val_acc"], "stopped_early": m["stopped_early"], "failed": m["failed"],
            "concurrent_trials": plan["concurrent_trials"], "cpus_per_worker": plan["cpus_per_worker"],
            "trial_in_function": plan.get("trial_in_function"), **_epoch_time(trials),
            "startup_s": _median(startups), "startup_s_max": max(startups, default=None),
            "tune_startup_s": _median(clock.startups()), "tune_startup_s_max": max(clock.startups(), default=None)}


def _epoch_reports(trials: list[dict[str, Any]], started: float) -> list[list[float]]:
    """[seconds since the search started, val_acc] of every trial's epoch-end report, in time order."""
    return sorted([round(at - started, 2), acc] for t in trials for at, acc in t["reports"])


def _trials(out: Path) -> list[dict[str, Any]]:
    """Every trial's starting config; its epoch-end reports as [time_total_s, val_acc] (seconds since
    its own function started, start-up included) and as [wall-clock time, val_acc]. The wall clock is
    the function's start (first batch minus start-up, both in the first report after each (re)start)
    plus time_since_restore: Tune's `timestamp` holds whole seconds only."""
    trials = []
    for result_file in sorted((out / "ray").rglob("result.json")):
        rows = [r for r in map(json.loads, result_file.read_text().splitlines())
                if r.get("position_step") == 0 and r.get("epoch", 0) >= 1]
        if not rows:
            continue
        reports, t0 = [], rows[0]["timestamp"] - rows[0]["time_since_restore"]  # whole seconds, if no start is known
        for r in rows:
            if r.get("first_batch_at") and r.get("startup_s") is not None:
                t0 = r["first_batch_at"] - r["startup_s"]
            reports.append([t0 + r["time_since_restore"], r.get("val_acc", -1)])
        trials.append({"config": rows[0]["config"], "reports": reports,
                       "curve": [[round(r["time_total_s"], 2), r.get("val_acc", -1)] for r in rows]})
    return trials


def _epoch_time(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Median seconds per epoch after a trial's first, and the trial-epochs the search ran."""
    epochs = [b[0] - a[0] for t in trials for a, b in zip(t["curve"], t["curve"][1:]) if b[0] > a[0]]
    return {"epoch_s": _median(epochs), "trial_epochs": sum(len(t["curve"]) for t in trials)}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _floor(concurrency: int, cpus: float, n: int) -> dict[str, Any]:
    """Tune's own per-trial start-up: a trivial function with a trial's resources, reused actors."""
    from ray import tune

    def trivial(config: dict) -> None:
        tune.report({"first_batch_at": time.time(), "score": config["x"]})

    clock = _TrialClock()
    tuner = tune.Tuner(tune.with_resources(trivial, {"CPU": cpus}), param_space={"x": tune.uniform(0, 1)},
                       tune_config=tune.TuneConfig(num_samples=n, metric="score", mode="max", reuse_actors=True,
                                                   max_concurrent_trials=concurrency),
                       run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(prefix="raymill-tune-floor-"),
                                                 name="trivial", callbacks=[clock.callback], verbose=0))
    started = time.perf_counter()
    tuner.fit()
    wall = time.perf_counter() - started
    # Slot-seconds a trial holds that are Tune's alone (actor start or reuse, scheduling, reports):
    # every raymill trial pays them too, before its own start-up.
    return {"trials": n, "concurrency": concurrency, "wall_s": round(wall, 2),
            "slot_s": round(wall * concurrency / n, 2), "tune_side_s": _median(clock.startups())}


def _time_to(reports: list[list[float]], target: float) -> float | None:
    return next((t for t, acc in reports if acc >= target - 1e-9), None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from stages.etl import stage as etl
    from workflow import demo_data
    from stages.common import session
    from stages.common.config import EtlConfig, RayConfig

    if args.quick:
        args.samples, args.max_epochs, args.images, args.seeds = 4, 3, 200, "0,1"
    session.start(RayConfig())
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="raymill-bench-tune-") as tmp:
        work = Path(tmp)
        demo_data.generate(work / "src", images=args.images, seed=6)
        data = etl.run(EtlConfig(image_size=args.image_size, shard_max_rows=100), str(work / "src"), str(work / "ds"))
        seeds = [int(x) for x in args.seeds.split(",")]
        _warm_up(args, data, work)
        searches = {s: _search(s, args, data, work, seeds[0]) for s in SCHEDULERS}
        by_seed = {seeds[0]: _versus(searches["asha"], searches["fifo"], args)}
        for i, seed in enumerate(seeds[1:], start=1):
            # ASHA first on even seeds, FIFO first on odd: no scheduler always runs on the warmer Ray
            order = ("asha", "fifo") if i % 2 == 0 else ("fifo", "asha")
            pair = {s: _search(s, args, data, work, seed) for s in order}
            by_seed[seed] = _versus(pair["asha"], pair["fifo"], args)
    fifo = searches["fifo"]
    floor = _floor(fifo["concurrent_trials"], fifo["cpus_per_worker"], args.samples)
    goal = round(fifo["best_val_acc"] - 0.01, 4)  # FIFO's best accuracy minus 1 point
    for s in searches.values():
        s["time_to_goal_s"] = _time_to(s["reports"], goal)
        s["time_to_targets_s"] = {str(x): _time_to(s["reports"], x) for x in _targets(args)}
    return {"config": vars(args), "searches": searches, "floor": floor, "goal_val_acc": goal, "by_seed": by_seed,
            "loadavg_before": load_before, "loadavg_after": loadavg()}


def _warm_up(args, data, work: Path) -> None:
    """A search of 2 one-epoch trials, not measured: the first search of a run started Ray's
    worker processes and paid the imports (about 1 s later to every target, seen 2026-11-25)."""
    warm = argparse.Namespace(**{**vars(args), "samples": 2, "max_epochs": 1})
    _search("fifo", warm, data, work / "warm-up", 99)


def _versus(asha: dict[str, Any], fifo: dict[str, Any], args) -> dict[str, Any]:
    """ASHA against FIFO on one seed's configurations: time to FIFO's best minus 1 point."""
    goal = round(fifo["best_val_acc"] - 0.01, 4)
    a, f = _time_to(asha["reports"], goal), _time_to(fifo["reports"], goal)
    # The trials that reach the goal under FIFO, and how far ASHA let the same configurations run
    reach = [(t["config"], _time_to(t["curve"], goal)) for t in fifo["trials"]]
    reach = [(c, s) for c, s in reach if s is not None]
    ran = {json.dumps(t["config"], sort_keys=True): len(t["curve"]) for t in asha["trials"]}
    return {"goal": goal, "asha_s": a, "fifo_s": f, "ratio": ratio(a, f),
            "oracle_own_s": min((s for _, s in reach), default=None), "goal_trials": len(reach),
            "asha_ran_them": [ran.get(json.dumps(c, sort_keys=True)) for c, _ in reach],
            "asha_wall_s": asha["wall_s"], "fifo_curves": [t["curve"] for t in fifo["trials"]],
            "fifo_wall_s": fifo["wall_s"], "asha_best": round(asha["best_val_acc"], 4),
            "fifo_best": round(fifo["best_val_acc"], 4),
            "points_behind": round(100 * (fifo["best_val_acc"] - asha["best_val_acc"]), 2),
            "ranking": tune_rank.early_ranking(
                [[acc for _, acc in t["curve"]] for t in fifo["trials"]], goal, args.max_epochs, args.grace,
                args.reduction, ran=[ran.get(json.dumps(t["config"], sort_keys=True)) for t in fifo["trials"]])}


def _targets(args) -> list[float]:
    return sorted({float(x) for x in args.sweep.split(",") if x.strip()})


def render(result: dict[str, Any]) -> str:
    if "floor" not in result or not result.get("by_seed") or any("goal_trials" not in x for x in result["by_seed"].values()):
        return "An older format of this benchmark's results: rerun `python -m benchmarks tune`."
    c, s, floor = result["config"], result["searches"], result["floor"]
    a, f, p = s["asha"], s["fifo"], s["pbt"]
    space = c.get("space", "narrow")
    lines = [f"{c['samples']} sampled configurations (seeds {c['seeds']}, SGD; the {space} space: "
             f"{_space_text(space)}), every trial {c['max_epochs']} epochs at most, "
             f"ASHA grace {c['grace']} and reduction {c['reduction']}, one worker per "
             f"trial in its Tune function (trial_in_function={f['trial_in_function']}), {f['concurrent_trials']} "
             f"trial(s) at a time x {f['cpus_per_worker']} CPU, {c['images']} demo images at {c.get('image_size', 32)} px. "
             f"Goal = FIFO's best val_acc minus 1 point = {result['goal_val_acc']}.", ""]
    rows = [[n, s[n]["wall_s"], fmt(s[n]["time_to_goal_s"]), s[n]["trial_epochs"], s[n]["best_val_acc"],
             s[n]["stopped_early"], s[n]["failed"], s[n]["startup_s"], s[n]["tune_startup_s"]] for n in SCHEDULERS]
    lines += md_table(["scheduler", "wall s", "time to goal s", "trial-epochs", "best val_acc", "stopped early",
                       "failed", "start-up s (own)", "start-up s (on_trial_start)"], rows)
    lines += ["", "Time to each val_acc target, from the same searches:", ""]
    lines += md_table(["val_acc", "ASHA s", "FIFO s", "PBT s", "ASHA / FIFO"],
                      [[k, fmt(a["time_to_targets_s"][k]), fmt(f["time_to_targets_s"][k]), fmt(p["time_to_targets_s"][k]),
                        fmt(ratio(a["time_to_targets_s"][k], f["time_to_targets_s"][k]), 2)] for k in f["time_to_targets_s"]])
    lines += ["", f"Tune's floor in the same run: {floor['trials']} trivial trials (report once), with a trial's "
              f"resources, {floor['concurrency']} at a time and reused actors, took {floor['wall_s']} s: "
              f"{floor['slot_s']} s of a trial slot each (Tune's own per-trial cost: actor start or reuse, "
              f"scheduling, reports). A raymill trial pays that and then its own start-up, {f['startup_s']} s "
              f"median (max {f['startup_s_max']}) from its function's first line to its first batch "
              f"({f['tune_startup_s']} s from Tune's `on_trial_start`), against {f['epoch_s']} s per later epoch. "
              f"The start-up columns above are that own part."]
    lines += _by_seed(result)
    lines += tune_rank.render(result.get("by_seed", {}), c["reduction"])
    lines += tune_replay.section(result)
    lines += _cluster(result)
    lines += ["", *targets_table(_verdicts(result))]
    lines += ["", f"Load average before/after: {result['loadavg_before']} / {result['loadavg_after']}."]
    return "\n".join(lines)


def _verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    s, floor = result["searches"], result["floor"]
    f, p = s["fifo"], s["pbt"]
    own = max(x["startup_s"] if x["startup_s"] is not None else math.inf for x in s.values())
    startup = round(floor["slot_s"] + own, 2)  # Tune's per-trial floor + the trial's own start-up
    seeds = list(result["by_seed"].values())
    speeds = [x["ratio"] if x["ratio"] is not None else math.inf for x in seeds]
    speed = round(statistics.median(speeds), 2) if speeds else None
    gap = round(statistics.median(x["points_behind"] for x in seeds), 2)
    return [{"target": "one-worker trial start-up (Tune's floor + own, worst search median) <= 3 s",
             "measured": startup, "pass": startup <= 3.0},
            {"target": "trial start-up <= 2x Tune's trivial-function floor (x floor)",
             "measured": ratio(startup, floor["slot_s"]), "pass": startup <= 2 * floor["slot_s"]},
            {"target": f"ASHA time to goal <= 0.5x FIFO's (median of {len(seeds)} seeds)", "measured": speed, "pass": speed is not None and speed <= 0.5},
            {"target": f"ASHA best within 1 point of FIFO's (points behind, median of {len(seeds)} seeds)", "measured": gap, "pass": gap <= 1.0},
            {"target": "PBT reaches the goal within FIFO's wall time (PBT s / FIFO wall s)",
             "measured": ratio(p["time_to_goal_s"], f["wall_s"]),
             "pass": p["time_to_goal_s"] is not None and p["time_to_goal_s"] <= f["wall_s"]}]


def _by_seed(result: dict[str, Any]) -> list[str]:
    slot = result["floor"]["slot_s"]
    rows = [[seed, x["goal"], fmt(x["fifo_s"]), fmt(x["asha_s"]), fmt(x["ratio"], 2), fmt(_bound(x, slot), 2),
             x["goal_trials"], " ".join(fmt(e) for e in x["asha_ran_them"]),
             x["fifo_wall_s"], x["asha_wall_s"], x["fifo_best"], x["asha_best"]]
            for seed, x in result.get("by_seed", {}).items()]
    if not rows:
        return []
    return ["", f"ASHA against FIFO on each seed's {result['config']['samples']} configurations (goal: that FIFO's "
            f"best minus 1 point). 'Any scheduler ≥' is the fastest FIFO trial's own time to the goal (its "
            f"start-up and epochs, from its `time_total_s`, plus Tune's per-trial floor of {slot} s) ÷ FIFO's "
            "time: a scheduler that started that configuration first, with trials running as fast as they did here, "
            "could not do better. 'Goal trials' "
            "counts FIFO's trials that reached the goal; 'ASHA ran them' is how many epochs ASHA let each of "
            f"the same configurations run (of {result['config']['max_epochs']}).", "",
            *md_table(["seed", "goal", "FIFO s to goal", "ASHA s to goal", "ASHA / FIFO", "any scheduler ≥",
                       "goal trials", "ASHA ran them", "FIFO wall s", "ASHA wall s", "FIFO best", "ASHA best"], rows),
            "", _why(result)]


def _bound(x: dict[str, Any], slot: float) -> float | None:
    return ratio(x["oracle_own_s"] + slot, x["fifo_s"]) if x.get("oracle_own_s") is not None else None


def _why(result: dict[str, Any]) -> str:
    """What bounds time to goal, and where ASHA lost against that bound."""
    seeds, slot = list(result["by_seed"].values()), result["floor"]["slot_s"]
    walls = statistics.median(x["asha_wall_s"] / x["fifo_wall_s"] for x in seeds)
    bounds = [b for b in (_bound(x, slot) for x in seeds) if b is not None]
    stopped = sum(1 for x in seeds for e in x["asha_ran_them"] if e is not None and e < result["config"]["max_epochs"])
    reached = sum(x["goal_trials"] for x in seeds)
    lost = (f"ASHA stopped {stopped} of the {reached} trials that reach the goal under FIFO before their last "
            "epoch (at a rung their accuracy so far was below the top third of the trials recorded there), so "
            "it reached the goal later or through another trial." if stopped else
            f"ASHA let all {reached} trials that reach the goal under FIFO run to the end; what it lost is the "
            "slot time of the trials it promoted and later stopped, and of the first trial at each rung, "
            "which Ray's ASHA always promotes.")
    bound = f"{statistics.median(bounds):.2f}x" if bounds else "-"
    return (f"Even a scheduler that wasted nothing would reach {bound} FIFO (median of the seeds' bounds). "
            f"{lost} Its wall time was {walls:.2f}x FIFO's (median) for a best within "
            f"{statistics.median(x['points_behind'] for x in seeds):.2f} points.")


def _cluster(result: dict[str, Any]) -> list[str]:
    """On paper: N trials on M GPUs (one trial per GPU), each paying start-up s once (Tune's floor +
    the trial's own) and E epochs of e seconds (FIFO), from this run's measured s and e. The TorchTrainer figure is the 25 s
    measured by this benchmark on 2026-11-24 with every trial a TorchTrainer (RESULTS.md then)."""
    f, c = result["searches"]["fifo"], result["config"]
    s, e, epochs = round(result["floor"]["slot_s"] + (f["startup_s"] or 0), 2), f["epoch_s"], c["max_epochs"]
    if not s or not e:
        return []
    rows = []
    for n, m in ((16, 1), (64, 8), (256, 8), (1024, 64)):
        waves = math.ceil(n / m)
        rows.append([n, m, fmt(waves * (s + epochs * e) / 60), fmt(waves * s / 60), f"{s / (s + epochs * e):.0%}",
                     fmt(waves * 25.0 / 60), f"{25.0 / (25.0 + epochs * e):.0%}"])
    return ["", f"The cluster picture on paper (N trials, M GPUs, one trial per GPU, FIFO, {epochs} epochs of "
            f"{e} s, start-up {s} s as measured here, against the 25 s a TorchTrainer trial cost on 2026-11-24):", "",
            *md_table(["N trials", "M GPUs", "search min", "of it start-up min", "start-up share",
                       "start-up min as TorchTrainer", "share as TorchTrainer"], rows),
            "", "ASHA stops most trials after the grace epochs, so start-up is a larger share of what it "
            "runs: with grace 1 a stopped trial costs start-up + 1 epoch."]
