"""stages/shared/accuracy.py: pass@k against every k-subset counted, the table's statistics and paired standard errors
by hand, and the 0/1 check of a null success threshold."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from stages.shared.accuracy import accuracy_table, paired_se, pass_at_k, passed, per_prompt
from stages.shared.runtime import StageError


def brute_force_pass_at_k(passes: list[bool], k: int) -> float:
    """The share of the k-subsets of a prompt's samples that hold a pass, every subset enumerated."""
    subsets = list(itertools.combinations(passes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n):
    """For every n <= 6, every count of passes c and every k: Chen et al.'s 1 - C(n-c, k)/C(n, k) is exactly the
    share of all k-subsets that hold at least one pass (a biased c/n-based estimate, 1 - (1 - c/n)^k, is not)."""
    rows = [[True] * c + [False] * (n - c) for c in range(n + 1)]  # one prompt per c
    for k in range(1, n + 1):
        expected = [brute_force_pass_at_k(row, k) for row in rows]
        assert pass_at_k(np.array(rows), k) == pytest.approx(expected, abs=1e-12)
        # the order of the samples does not matter, only their count of passes
        shuffled = np.array([row[::-1] for row in rows])
        assert pass_at_k(shuffled, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_by_hand():
    # n = 4, c = 1, k = 2: 1 - C(3, 2)/C(4, 2) = 1 - 3/6 = 0.5 (the biased 1 - (3/4)^2 = 0.4375 is not)
    # n = 4, c = 2, k = 2: 1 - C(2, 2)/C(4, 2) = 1 - 1/6; c = 3: n - c = 1 < k, so 1; c = 0: 0
    passes = np.array([[0, 0, 1, 0], [1, 0, 1, 0], [1, 1, 0, 1], [0, 0, 0, 0]], dtype=bool)
    assert pass_at_k(passes, 2).tolist() == pytest.approx([0.5, 5 / 6, 1.0, 0.0], abs=1e-15)
    assert pass_at_k(passes, 1).tolist() == [0.25, 0.5, 0.75, 0.0]  # pass@1 = c / n
    assert pass_at_k(passes, 4).tolist() == [1.0, 1.0, 1.0, 0.0]  # all n: any pass
    with pytest.raises(ValueError, match=r"pass@5 needs 1 <= k <= n samples per prompt \(4\)"):
        pass_at_k(passes, 5)


def test_pass_at_k_stays_exact_where_the_binomials_overflow_floats():
    """C(1100, 550) is ~1e330, past float64: exact integers keep 1 - C(n - c, k)/C(n, k) right."""
    passes = np.zeros((1, 1100), dtype=bool)
    passes[0, :3] = True
    # c = 3: C(n-3, k)/C(n, k) = (n-k)(n-k-1)(n-k-2) / (n(n-1)(n-2)) = 550*549*548 / (1100*1099*1098)
    expected = 1 - (550 * 549 * 548) / (1100 * 1099 * 1098)
    assert pass_at_k(passes, 550)[0] == pytest.approx(expected, rel=1e-12)


def test_per_prompt_statistics_by_hand():
    sampled = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])  # P = 2 prompts, n = 3 samples
    greedy = np.array([1.0, 0.0])
    stats = per_prompt(sampled, greedy, [1, 2], None, "reward", "ppo")
    # mean: 2/3, 0; greedy: 1, 0; pass@1 = c/n: 2/3, 0; pass@2: 1 - C(1, 2)/C(3, 2) = 1 - 0/3 = 1, 0
    expected = {"mean": [2 / 3, 0.0], "greedy": [1.0, 0.0], "pass@1": [2 / 3, 0.0], "pass@2": [1.0, 0.0]}
    assert list(stats) == list(expected)
    for statistic, values in expected.items():
        assert stats[statistic].tolist() == pytest.approx(values, abs=1e-15), statistic
    # a threshold: rewards 0.7, 0.2, 0.9 with threshold 0.5 pass, fail, pass; the mean is of the rewards themselves
    scores = np.array([[0.7, 0.2, 0.9]])
    stats = per_prompt(scores, np.array([0.4]), [2], 0.5, "reward", "ppo")
    assert stats["mean"].tolist() == pytest.approx([0.6], abs=1e-15)  # (0.7 + 0.2 + 0.9) / 3
    assert stats["greedy"].tolist() == [0.0]  # 0.4 < 0.5
    assert stats["pass@2"].tolist() == [1.0]  # c = 2, n - c = 1 < 2
    assert passed(np.array([0.5, 0.49]), 0.5, "reward", "ppo").tolist() == [True, False]  # >=: the threshold passes


def test_paired_se_by_hand():
    # d = ppo - sft = [1, 0, 1, 0]: mean 0.5, sample variance sum((d - 0.5)^2) / 3 = 1/3, SE = sqrt(1/3) / sqrt(4)
    assert paired_se(np.array([1.0, 1.0, 1.0, 0.0]), np.array([0.0, 1.0, 0.0, 0.0])) == pytest.approx(
        math.sqrt(1 / 3) / 2, abs=1e-15)
    # paired, not two independent samples: a constant shift per prompt has no spread at all
    assert paired_se(np.array([0.2, 0.9, 0.5]), np.array([0.1, 0.8, 0.4])) == pytest.approx(0.0, abs=1e-15)
    assert paired_se(np.array([1.0]), np.array([0.0])) is None  # one prompt: no spread to measure


def test_accuracy_table_by_hand():
    """Two rewards (any names: the table takes what it is given), SFT and PPO on the same 2 prompts, n = 2."""
    sampled = {"sft": {"correct": np.array([[0.0, 0.0], [1.0, 0.0]]), "format": np.array([[1.0, 1.0], [1.0, 1.0]])},
               "ppo": {"correct": np.array([[1.0, 0.0], [1.0, 1.0]]), "format": np.array([[1.0, 1.0], [0.0, 1.0]])}}
    greedy = {"sft": {"correct": np.array([0.0, 1.0]), "format": np.array([1.0, 1.0])},
              "ppo": {"correct": np.array([1.0, 1.0]), "format": np.array([1.0, 0.0])}}
    table = accuracy_table(sampled, greedy, [1, 2], None)
    assert list(table) == ["correct", "format"]
    # correct, sft: per prompt mean 0, 0.5; greedy 0, 1; pass@2 0, 1. ppo: mean 0.5, 1; greedy 1, 1; pass@2 1, 1
    assert table["correct"]["sft"] == {"mean": 0.25, "greedy": 0.5, "pass@1": 0.25, "pass@2": 0.5}
    assert table["correct"]["ppo"] == {"mean": 0.75, "greedy": 1.0, "pass@1": 0.75, "pass@2": 1.0}
    # per-prompt differences: mean 0.5, 0.5 (SE 0); greedy 1, 0 (std sqrt(0.5), SE 0.5); pass@2 1, 0 (SE 0.5)
    assert table["correct"]["paired_se"] == pytest.approx({"mean": 0.0, "greedy": 0.5, "pass@1": 0.0, "pass@2": 0.5},
                                                          abs=1e-15)
    assert table["format"]["ppo"] == {"mean": 0.75, "greedy": 0.5, "pass@1": 0.75, "pass@2": 1.0}


def test_the_base_model_is_a_column_where_given_and_the_paired_error_stays_ppo_minus_sft():
    """With a pretrained model.name_or_path, evaluate adds the base model: its statistics first, the paired SE still
    PPO - SFT's."""
    sampled = {"sft": {"correct": np.array([[0.0, 1.0], [1.0, 0.0]])},
               "ppo": {"correct": np.array([[1.0, 1.0], [1.0, 0.0]])},
               "base": {"correct": np.array([[0.0, 0.0], [0.0, 1.0]])}}
    greedy = {"sft": {"correct": np.array([0.0, 1.0])}, "ppo": {"correct": np.array([1.0, 1.0])},
              "base": {"correct": np.array([0.0, 0.0])}}
    table = accuracy_table(sampled, greedy, [2], None)
    assert list(table["correct"]) == ["base", "sft", "ppo", "paired_se"]
    assert table["correct"]["base"] == {"mean": 0.25, "greedy": 0.0, "pass@2": 0.5}
    without = accuracy_table({p: sampled[p] for p in ("sft", "ppo")}, {p: greedy[p] for p in ("sft", "ppo")}, [2],
                             None)
    assert list(without["correct"]) == ["sft", "ppo", "paired_se"]
    assert without["correct"]["paired_se"] == table["correct"]["paired_se"]
    assert without["correct"]["paired_se"]["greedy"] == pytest.approx(0.5, abs=1e-15)
    # evaluate.base: greedy: the base model answered greedily only, so it has greedy accuracy and nothing else
    greedy_only = accuracy_table({p: sampled[p] for p in ("sft", "ppo")}, greedy, [2], None)
    assert list(greedy_only["correct"]) == ["base", "sft", "ppo", "paired_se"]
    assert greedy_only["correct"]["base"] == {"greedy": 0.0}
    assert {p: greedy_only["correct"][p] for p in ("sft", "ppo", "paired_se")} == \
        {p: table["correct"][p] for p in ("sft", "ppo", "paired_se")}


def test_a_reward_not_0_or_1_with_a_null_threshold_is_one_line_naming_it():
    with pytest.raises(StageError) as err:
        passed(np.array([[0.0, 1.0], [1.0, 0.25]]), None, "gold", "sft")
    assert str(err.value) == ("evaluate: the reward 'gold' gave 0.25 for the sft policy's sample 1 of prompt 1, but "
                              "evaluate.success_threshold is null (a reward must be 0 or 1); set it to the reward that "
                              "passes")
    with pytest.raises(StageError, match=r"'reward' gave 2 for the ppo policy's greedy response to prompt 0"):
        passed(np.array([2.0, 1.0]), None, "reward", "ppo")
