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


def test_replay_known_answers_for_fifo_asha_and_the_oracle():
    from benchmarks import tune_replay

    # trial 0 never reaches 0.9; trial 1 does at its second epoch; one slot, each slot costs 0.5 s
    curves = [[[1.0, 0.5], [2.0, 0.6]], [[1.0, 0.4], [2.0, 0.95]]]
    fifo = tune_replay.replay(curves, [0, 1], slots=1, slot_s=0.5, goal=0.9)
    assert fifo == 0.5 + 2.0 + 0.5 + 2.0  # trial 1 starts after trial 0's whole run
    oracle = tune_replay.replay(curves, [0, 1], 1, 0.5, 0.9, tune_replay.oracle_rule(curves, 0.9))
    assert oracle == 0.5 + 1.0 + 0.5 + 2.0  # trial 0 stopped at its first report
    # ASHA (rung at epoch 1, rf 2): trial 0 is first at the rung and goes on; trial 1 is below its
    # value there (0.4 < 0.5) and is stopped, so the goal is never reached
    assert tune_replay.replay(curves, [0, 1], 1, 0.5, 0.9, tune_replay.asha_rule([1], 2)) is None
    # the other order: the goal trial runs first, and no rule can gain anything
    assert tune_replay.replay(curves, [1, 0], 1, 0.5, 0.9, tune_replay.asha_rule([1], 2)) == 2.5
    out = tune_replay.study(curves, 0.9, 1, 0.5, [1], 2, orders=200)
    assert out["goal_trials"] == 1 and 0.3 < out["first_wave"] < 0.7  # half the orders start trial 1 first
    assert out["oracle_median"] <= 1.0 and out["asha_never"] > 0.3
    assert tune_replay.most_of([0.5] * 5) == 0.5 and tune_replay.most_of([1, 1, 1, 0, 0]) == 1.0
    assert abs(tune_replay.most_of([0.9, 0.9, 0.0]) - 0.81) < 1e-12  # 2 of 3 needs both of the first two
