"""stages/shared/runtime.py: the progress line."""

from __future__ import annotations


def test_progress_says_a_value_was_not_measured_instead_of_nan(capsys, monkeypatch):
    """dapo, gspo and cispo skip the reference pass: their KL is NaN, shown as not measured, not as 'nan'."""
    from stages.shared.runtime import Progress

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    progress = Progress("ppo", total=2, every=0.0)
    progress.update(1, reward=0.5, kl=float("nan"))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("ppo: step 1/2, ") and line.endswith("reward 0.5, kl not measured")
