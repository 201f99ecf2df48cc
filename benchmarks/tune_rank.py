"""Does a trial's accuracy at an ASHA rung tell which trials end best? Read from FIFO's full curves.

ASHA can only save time if the trials that will reach the goal are in the top 1/reduction of
their rung when they get there. FIFO runs every configuration to the end, so its curves hold
both sides of that question, measured rather than replayed: the val_acc of each trial at each
rung, and its val_acc at the end.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks.common import md_table

__all__ = ["rungs", "spearman", "early_ranking", "render"]

CONTENDER_POINTS = 5.0  # a contender ends within this many points of the best final val_acc


def rungs(max_t: int, grace: int, rf: int) -> list[int]:
    """ASHA's milestones below max_t, as Ray's AsyncHyperBandScheduler lays them out."""
    count = int(math.log(max_t / grace) / math.log(rf) + 1)
    return [grace * rf ** k for k in range(count) if grace * rf ** k < max_t]


def _ranks(values: list[float]) -> np.ndarray:
    """Ranks with ties averaged (Spearman's convention)."""
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v), dtype=float)
    for value in np.unique(v):
        tied = v == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    if len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return round(float(np.corrcoef(ra, rb)[0, 1]), 2)


def early_ranking(curves: list[list[float]], goal: float, max_t: int, grace: int, rf: int,
                  ran: list[int | None] | None = None) -> dict[str, Any]:
    """Per rung: how many of the trials that reach `goal` stand in the rung's top 1/rf (ASHA's
    rule, against every trial at the rung), and the rank correlation of rung val_acc with final
    val_acc over all trials and over the contenders. `ran`: the epochs ASHA let each of the same
    configurations run; a goal trial it stopped at a rung is checked against that whole rung."""
    ran = ran or [None] * len(curves)
    kept = [i for i, c in enumerate(curves) if len(c) >= max_t]  # a diverged trial ends early
    if not kept:
        return {}
    full, ran = [curves[i] for i in kept], [ran[i] for i in kept]
    finals = [c[-1] for c in full]
    best = max(finals)
    contenders = [i for i, f in enumerate(finals) if 100 * (best - f) <= CONTENDER_POINTS]
    reach = [i for i, c in enumerate(full) if max(c) >= goal - 1e-9]
    out: dict[str, Any] = {"rungs": [], "contenders": len(contenders), "reach": len(reach),
                           "asha_stopped": 0, "asha_stopped_in_top": 0}
    for milestone in rungs(max_t, grace, rf):
        at = [c[milestone - 1] for c in full]
        cutoff = float(np.percentile(at, (1 - 1 / rf) * 100))
        stopped = [i for i in reach if ran[i] == milestone]
        out["asha_stopped"] += len(stopped)
        out["asha_stopped_in_top"] += sum(1 for i in stopped if at[i] >= cutoff)
        out["rungs"].append({
            "epoch": milestone, "reach_in_top": sum(1 for i in reach if at[i] >= cutoff),
            "rho_all": spearman(at, finals),
            "rho_contenders": spearman([at[i] for i in contenders], [finals[i] for i in contenders])})
    return out


def render(by_seed: dict[str, Any], rf: int) -> list[str]:
    """The per-seed table and the sentence that reads it."""
    seeds = {s: x["ranking"] for s, x in by_seed.items() if x.get("ranking")}
    if not seeds:
        return []
    epochs = [r["epoch"] for r in next(iter(seeds.values()))["rungs"]]
    rows = [[s, x["reach"], x["contenders"],
             *[f"{r['reach_in_top']} of {x['reach']}" for r in x["rungs"]],
             *[f"{_f(r['rho_all'])} / {_f(r['rho_contenders'])}" for r in x["rungs"]]] for s, x in seeds.items()]
    head = ["seed", "goal trials", "contenders", *[f"goal trials in top 1/{rf} at epoch {e}" for e in epochs],
            *[f"ρ epoch {e}: all / contenders" for e in epochs]]
    med = {e: _median([r["rho_contenders"] for x in seeds.values() for r in x["rungs"] if r["epoch"] == e])
           for e in epochs}
    kept = {e: (sum(r["reach_in_top"] for x in seeds.values() for r in x["rungs"] if r["epoch"] == e),
                sum(x["reach"] for x in seeds.values())) for e in epochs}
    return ["", f"What ASHA had to go on, read from FIFO's full curves (the same configurations): at each "
            f"rung, how many of the trials that reach the goal stood in the top 1/{rf} of all "
            f"the trials there (ASHA stops the rest once it has seen enough of them), and Spearman's ρ of val_acc at "
            f"the rung against final val_acc, over all trials and over the contenders (final within "
            f"{CONTENDER_POINTS:g} points of the best).", "", *md_table(head, rows), "",
            "Across seeds, " + "; ".join(f"at epoch {e} {kept[e][0]} of {kept[e][1]} goal trials were in the top "
                                         f"1/{rf} and ρ among contenders was {_f(med[e])} (median)" for e in epochs)
            + f". {_stopped(seeds.values(), rf)}"]


def _stopped(seeds, rf: int) -> str:
    seeds = list(seeds)
    if any("asha_stopped" not in x for x in seeds):  # results from before 2026-11-26 02:40
        return ("A low ρ among contenders means early accuracy tells the bad configurations from the good "
                "ones but not the good ones from each other.")
    stopped = sum(x["asha_stopped"] for x in seeds)
    in_top = sum(x["asha_stopped_in_top"] for x in seeds)
    return (f"ASHA stopped {stopped} goal trials at a rung; {in_top} of them stood in the top 1/{rf} of that "
            "whole rung. Ray's ASHA cuts a trial against the trials that reached the rung before it (it "
            "cannot wait for the rest), and early in a search those are few, so its cut-off is not the "
            "whole rung's. A low ρ among contenders means early accuracy tells the bad configurations "
            "from the good ones but not the good ones from each other.")


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(float(np.median(kept)), 2) if kept else None


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
