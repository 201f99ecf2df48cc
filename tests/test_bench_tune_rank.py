"""The benchmark's reading of early ranking (benchmarks/tune_rank.py), on curves whose answer is known."""
from benchmarks import tune_rank


def test_rungs_are_ashas_milestones_below_the_budget():
    assert tune_rank.rungs(12, 1, 3) == [1, 3, 9]
    assert tune_rank.rungs(27, 1, 3) == [1, 3, 9]  # 27 is the budget itself: no decision there
    assert tune_rank.rungs(6, 2, 2) == [2, 4]


def test_spearman_known_answers():
    assert tune_rank.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert tune_rank.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert tune_rank.spearman([1, 1, 1, 1], [1, 2, 3, 4]) is None  # no order to compare
    assert tune_rank.spearman([1, 2], [1, 2]) is None


def test_early_ranking_counts_goal_trials_in_the_top_third():
    # six trials, four epochs: trial 5 ends best but is last at epoch 1 (a late bloomer);
    # trials 3 and 4 lead at epoch 1 and end third and second.
    curves = [[0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2], [0.3, 0.3, 0.3, 0.3],
              [0.6, 0.8, 0.85, 0.95], [0.5, 0.7, 0.9, 0.96], [0.05, 0.5, 0.95, 0.99]]
    out = tune_rank.early_ranking(curves, goal=0.95, max_t=4, grace=1, rf=3)
    assert out["reach"] == 3 and out["contenders"] == 3  # 0.95, 0.96, 0.99: within 5 points of 0.99
    first, second = out["rungs"]
    assert first["epoch"] == 1 and first["reach_in_top"] == 2  # the late bloomer is below the cut
    assert second["epoch"] == 3 and second["reach_in_top"] == 2  # now trial 3 has fallen below it
    assert first["rho_contenders"] == -1.0 and second["rho_contenders"] == 1.0
    # trials that did not run the whole budget (stopped ones) are left out
    assert tune_rank.early_ranking([[0.5]], goal=0.5, max_t=4, grace=1, rf=3) == {}


def test_a_goal_trial_asha_stopped_is_checked_against_the_whole_rung():
    curves = [[0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2], [0.3, 0.3, 0.3, 0.3],
              [0.6, 0.8, 0.85, 0.95], [0.5, 0.7, 0.9, 0.96], [0.05, 0.5, 0.95, 0.99]]
    # ASHA stopped trial 3 after epoch 1 (top third of the whole rung there) and trial 5 after
    # epoch 1 (below it); trial 4 ran to the end; a short curve (diverged) is left out.
    out = tune_rank.early_ranking(curves + [[0.9]], goal=0.95, max_t=4, grace=1, rf=3,
                                  ran=[1, 1, 1, 1, 4, 1, 1])
    assert out["reach"] == 3 and out["asha_stopped"] == 2 and out["asha_stopped_in_top"] == 1
