"""How much time can stopping trials save? FIFO's recorded curves, replayed in many trial orders.

A scheduler that stops trials makes no trial faster: it can only start the configurations after it
sooner, in the slots it frees. So how far any early-stopping scheduler can get ahead of FIFO on time to a
goal depends on where the first configuration that reaches the goal sits in the search order, and the
searcher's seed decides that, not the scheduler. One run of each seed shows one order; this replays the
same recorded curves in many orders, with the same number of slots:
- FIFO: every trial runs to its end;
- ASHA: the rule of Ray's `AsyncHyperBandScheduler` (its `_Bracket.on_result` in
  ray/tune/schedulers/async_hyperband.py): at a rung, a trial stops when its value is below the
  (1 - 1/rf) percentile of the values recorded at that rung before it, and the first one there goes on;
- the oracle: a rule that knows the future and stops, at its first report, every configuration that will
  not reach the goal. No stopping rule with a grace of 1 epoch can do better.
It is a replay, not a measurement: each trial reports at the times it reported under FIFO (its
`time_total_s`, start-up included), a trial slot costs Tune's measured per-trial floor on top, and a
trial runs as fast whatever else runs beside it.
"""
from __future__ import annotations

import heapq
import random
import statistics
from typing import Any, Callable

import numpy as np

from benchmarks.common import fmt, md_table
from benchmarks.tune_rank import rungs

__all__ = ["replay", "asha_rule", "oracle_rule", "study", "most_of", "render", "section"]

Curve = list[list[float]]  # [[time_total_s, val_acc] per epoch]
Rule = Callable[[int, int, float], bool]  # (trial, epoch, val_acc) -> stop now


def replay(curves: list[Curve], order: list[int], slots: int, slot_s: float, goal: float,
           rule: Rule | None = None) -> float | None:
    """Seconds until some trial first reports val_acc >= goal, or None if none does. Trials start in
    `order` as slots free; `rule` (None: FIFO) is asked at every report whether to stop that trial."""
    queue, events, reached = list(order), [], None

    def start(at: float) -> None:
        if queue:
            i = queue.pop(0)
            began = at + slot_s
            heapq.heappush(events, (began + curves[i][0][0], i, 0, began))

    for _ in range(slots):
        start(0.0)
    while events:
        at, i, e, began = heapq.heappop(events)
        acc = curves[i][e][1]
        if reached is None and acc >= goal - 1e-9:
            reached = at
        if e + 1 < len(curves[i]) and not (rule and rule(i, e + 1, acc)):
            heapq.heappush(events, (began + curves[i][e + 1][0], i, e + 1, began))
        else:
            start(at)
    return reached


def asha_rule(milestones: list[int], rf: float) -> Rule:
    """Ray's asynchronous successive halving, one bracket: a fresh rule (its own rungs) per replay."""
    recorded: dict[int, list[float]] = {m: [] for m in milestones}

    def stop(trial: int, epoch: int, acc: float) -> bool:
        if epoch not in recorded:
            return False
        seen = recorded[epoch]
        cut = bool(seen) and acc < float(np.nanpercentile(seen, (1 - 1 / rf) * 100))
        seen.append(acc)
        return cut
    return stop


def oracle_rule(curves: list[Curve], goal: float) -> Rule:
    """Stops at its first report every trial that will never reach the goal."""
    never = {i for i, c in enumerate(curves) if max(acc for _, acc in c) < goal - 1e-9}
    return lambda trial, epoch, acc: trial in never


def study(curves: list[Curve], goal: float, slots: int, slot_s: float, milestones: list[int], rf: float,
          orders: int = 1000, seed: int = 0) -> dict[str, Any]:
    """ASHA's and the oracle's time to goal ÷ FIFO's over `orders` random orders of one seed's curves,
    and the recorded order (the search as it ran) replayed, to set beside the measured figures."""
    rng, n = random.Random(seed), len(curves)
    reach = [i for i, c in enumerate(curves) if max(acc for _, acc in c) >= goal - 1e-9]
    if not reach:
        return {}

    def ratios(order: list[int]) -> tuple[float, float, float | None, float | None]:
        fifo = replay(curves, order, slots, slot_s, goal)
        asha = replay(curves, order, slots, slot_s, goal, asha_rule(milestones, rf))
        best = replay(curves, order, slots, slot_s, goal, oracle_rule(curves, goal))
        return (asha / fifo if asha else np.inf), (best or np.inf) / fifo, asha, fifo

    first_wave, asha, oracle = 0, [], []
    for _ in range(orders):
        order = rng.sample(range(n), n)
        first_wave += any(i in reach for i in order[:slots])
        a, o, _, _ = ratios(order)
        asha.append(a)
        oracle.append(o)
    _, _, as_ran_asha, as_ran_fifo = ratios(list(range(n)))
    return {"orders": orders, "goal_trials": len(reach), "trials": n, "first_wave": round(first_wave / orders, 3),
            "asha_median": _median(asha), "asha_half": _share(asha), "asha_never": _share(asha, np.inf),
            "oracle_median": _median(oracle), "oracle_half": _share(oracle),
            "as_ran": {"asha_s": _round(as_ran_asha), "fifo_s": _round(as_ran_fifo)}}


def _median(values: list[float]) -> float:
    return round(float(statistics.median(values)), 2)


def _share(values: list[float], at_least: float | None = None) -> float:
    hits = [v >= at_least if at_least is not None else v <= 0.5 for v in values]
    return round(sum(hits) / len(hits), 3)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def render(studies: dict[str, dict[str, Any]], measured: dict[str, dict[str, Any]], slots: int) -> list[str]:
    """The per-seed replay table and what it says about the ≤ 0.5x target."""
    studies = {s: x for s, x in studies.items() if x}
    if not studies:
        return []
    rows = [[s, f"{x['goal_trials']} of {x['trials']}", f"{x['first_wave']:.0%}", fmt(x["asha_median"], 2),
             f"{x['asha_half']:.0%}", f"{x['asha_never']:.0%}", fmt(x["oracle_median"], 2), f"{x['oracle_half']:.0%}",
             f"{fmt(x['as_ran']['asha_s'])} / {fmt(x['as_ran']['fifo_s'])}",
             f"{fmt(measured.get(s, {}).get('asha_s'))} / {fmt(measured.get(s, {}).get('fifo_s'))}"]
            for s, x in studies.items()]
    orders = next(iter(studies.values()))["orders"]
    return ["", f"Replayed, not measured (benchmarks/tune_replay.py): each seed's recorded FIFO curves in "
            f"{orders} random trial orders, {slots} at a time, under FIFO, under Ray's ASHA rule and under an "
            "oracle that stops, at its first report, every configuration that will never reach the goal. "
            "Stopping trials makes no trial faster; it only starts later ones sooner, so the ratio depends on "
            "where the first configuration that reaches the goal sits in the order. 'First wave' is the share "
            f"of orders with one among the first {slots} started: no stopping rule can start that one sooner. The "
            "last two columns set the replay of the order the search ran in beside the measured run.", "",
            *md_table(["seed", "goal trials", "first wave", "ASHA / FIFO median", "ASHA ≤ 0.5x", "ASHA never",
                       "oracle / FIFO median", "oracle ≤ 0.5x", "as ran, replayed: ASHA / FIFO s",
                       "as ran, measured: ASHA / FIFO s"], rows),
            "", _verdict(studies)]


def _verdict(studies: dict[str, dict[str, Any]]) -> str:
    """How often the target's own statistic (the median of the seeds' ratios) is ≤ 0.5x when each
    seed's order is drawn at random: the chance that most seeds are."""
    oracle = statistics.median(x["oracle_median"] for x in studies.values())
    meets = {k: most_of([x[f"{k}_half"] for x in studies.values()]) for k in ("oracle", "asha")}
    return (f"With each seed's order drawn at random, the median of the {len(studies)} seeds' ratios is ≤ 0.5x "
            f"in {meets['oracle']:.0%} of runs for the oracle and in {meets['asha']:.1%} for Ray's ASHA (the "
            f"chance that most seeds are, from the shares above); the oracle's own median across seeds is "
            f"{oracle:.2f}x. So even a stopping rule that knew the future would meet the ≤ 0.5x time-to-goal "
            f"target in {meets['oracle']:.0%} of the runs of this benchmark: the target measures where the "
            "search put its good configurations as much as the scheduler.")


def most_of(chances: list[float]) -> float:
    """P(more than half of independent events happen), event i with probability chances[i]."""
    dist = [1.0]  # dist[k]: P(k of the events so far happened)
    for p in chances:
        dist = [a * (1 - p) + b * p for a, b in zip(dist + [0.0], [0.0] + dist)]
    return sum(dist[len(chances) // 2 + 1:])


def section(result: dict[str, Any]) -> list[str]:
    """The replay of a `benchmarks tune` result: every seed whose FIFO curves it holds (runs before
    2026-11-26 13:00 kept the first seed's only, under searches.fifo)."""
    c, fifo = result["config"], result["searches"]["fifo"]
    milestones = rungs(c["max_epochs"], c["grace"], c["reduction"])
    first = c["seeds"].split(",")[0].strip()
    studies = {}
    for seed, x in result["by_seed"].items():
        curves = x.get("fifo_curves") or ([t["curve"] for t in fifo["trials"]] if str(seed) == first else None)
        if curves:
            studies[str(seed)] = study(curves, x["goal"], fifo["concurrent_trials"], result["floor"]["slot_s"],
                                       milestones, c["reduction"])
    return render(studies, {str(s): x for s, x in result["by_seed"].items()}, fifo["concurrent_trials"])
