"""stages/ppo/watch.py: the held-out evaluation during ppo, the policy it keeps, and the run doctor (issue #36)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import pandas as pd
import pytest
from typer.testing import CliRunner

from stages import ppo
from stages.ppo.watch import diagnose
from stages.shared.artifacts import (
    PPO_CHECKPOINTS,
    PPO_CURVES,
    PPO_EVAL,
    PPO_METRICS,
    PPO_MODEL,
    PPO_ROLLOUTS,
    PPO_STATS,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
)
from stages.shared.cli import app
from stages.shared.params import AlertParams
from tests.conftest import write_params
from tests.stages.test_ppo import copy_for_ppo

STEPS = 4  # ppo steps of 8 rollouts (ppo.steps 32)


def run_ppo(tiny_run, tiny_params, root_dir, monkeypatch=None, crash_at: int | None = None, **watch):
    """The ppo stage on a copy of the tiny run, for STEPS steps, with `watch` fields changed; ``crash_at``: the run
    is interrupted as that step (0-based) starts, then rerun (it resumes from its checkpoint). Returns (the summary
    line, the project's root)."""
    root = copy_for_ppo(tiny_run, root_dir)
    params = dataclasses.replace(tiny_params, watch=dataclasses.replace(tiny_params.watch, **watch),
                                 ppo={**tiny_params.ppo, "steps": 8 * STEPS})
    if crash_at is not None:
        real = ppo.one_step

        def crashing(loop, step, *args):
            if step == crash_at:
                raise KeyboardInterrupt(f"crash at step {step}")
            return real(loop, step, *args)

        with monkeypatch.context() as patch:
            patch.setattr(ppo, "one_step", crashing)
            with pytest.raises(KeyboardInterrupt):
                ppo.run(params, root)
        assert (root / PPO_CHECKPOINTS / "state").exists()
    return ppo.run(params, root), root


def digest(path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for file in files:
        h.update(file.name.encode() + file.read_bytes())
    return h.hexdigest()


TRAINED = (PPO_MODEL / "model.safetensors", PPO_ROLLOUTS, PPO_STATS, PPO_CURVES)


def test_the_heldout_evaluation_leaves_the_training_run_as_it_was_on_cpu(tiny_run, tiny_params, tmp_path):
    """Its sampling draws from a stream of its own: the run trains the same bytes with it on (every step) or off."""
    _, on = run_ppo(tiny_run, tiny_params, tmp_path / "on", eval_every=1)
    _, off = run_ppo(tiny_run, tiny_params, tmp_path / "off", eval_every=0)
    assert {str(p): digest(on / p) for p in TRAINED} == {str(p): digest(off / p) for p in TRAINED}
    evals = pd.read_csv(on / PPO_EVAL)
    assert evals["step"].tolist() == list(range(STEPS))
    assert list(evals.columns) == ["step", "gold", "reward", "kl", "length"] and evals.notna().all().all()
    assert pd.read_csv(off / PPO_EVAL).empty


def test_keep_best_publishes_the_best_heldout_policy_and_a_resumed_run_keeps_it_on_cpu(tiny_run, tiny_params,
                                                                                       tmp_path, monkeypatch):
    summary, root = run_ppo(tiny_run, tiny_params, tmp_path / "best", eval_every=1, keep="best", best_by="gold",
                            kl_price=0.5)
    evals = pd.read_csv(root / PPO_EVAL)
    ranked = evals["gold"] - 0.5 * evals["kl"]
    best = int(evals["step"][ranked.idxmax()])
    metrics = json.loads((root / PPO_METRICS).read_text())
    # evals.csv holds 6 significant digits: each of gold and kl is within 5e-6 of its own size of the value ranked
    rounding = 5e-6 * float(evals["gold"].abs()[ranked.idxmax()] + 0.5 * evals["kl"].abs()[ranked.idxmax()])
    assert metrics["kept"] == {"policy": "best", "step": best, "by": "gold", "kl_price": 0.5,
                               "value": pytest.approx(float(ranked.max()), rel=0, abs=rounding)}
    assert summary.endswith(f"(step {best + 1}'s, the best held-out)")
    # the policy of that step: what a run that ends there publishes (the same bytes up to it, on a CPU)
    cut = copy_for_ppo(tiny_run, tmp_path / "cut")
    params = dataclasses.replace(tiny_params, watch=dataclasses.replace(tiny_params.watch, eval_every=0),
                                 ppo={**tiny_params.ppo, "steps": 8 * (best + 1)})
    ppo.run(params, cut)
    assert digest(root / PPO_MODEL / "model.safetensors") == digest(cut / PPO_MODEL / "model.safetensors")
    # interrupted after a best was saved, the rerun resumes and keeps the same one
    _, resumed = run_ppo(tiny_run, tiny_params, tmp_path / "resumed", monkeypatch, crash_at=STEPS - 1, eval_every=1,
                         keep="best", best_by="gold", kl_price=0.5)
    for path in (PPO_MODEL / "model.safetensors", PPO_EVAL, PPO_METRICS):
        assert digest(resumed / path) == digest(root / path), path


HEALTHY = {"step": 5, "entropy": 20.0, "kl": 3.0, "response_len": 15.0, "approxkl": 0.05, "ratio_mean": 1.0,
           "clipfrac": 0.1, "loss_value": 0.5, "truncated_share": 0.2, "reward_mean": 1.0}
LIMITS = AlertParams(entropy_ratio=0.3, kl_per_token=1.0, approxkl=0.5, ratio_mean=2.0, clipfrac=0.4,
                     value_loss_growth=10.0, length_ratio=0.25, truncated_share=0.9)


def test_more_heldout_prompts_asked_than_there_are_is_said_once(tiny_run, tiny_params, capsys):
    """watch.eval_prompts above the held-out prompts the tokenize stage kept: the evaluation uses them all, and says
    so (without the note a user reads 32 in params.yaml and believes 32 prompts were scored)."""
    kept = len(pd.read_parquet(tiny_run / TOKENIZED_EVAL))
    params = dataclasses.replace(tiny_params, watch=dataclasses.replace(tiny_params.watch, eval_prompts=kept + 5))
    training = pd.read_parquet(tiny_run / TOKENIZED_TRAIN)["query"]
    assert len(ppo.heldout_prompts(params, tiny_run, training)) == kept
    assert capsys.readouterr().err == (f"note: ppo: watch.eval_prompts is {kept + 5}, but {TOKENIZED_EVAL} holds "
                                       f"{kept} held-out prompts: each held-out evaluation uses all {kept}\n")
    params = dataclasses.replace(tiny_params, watch=dataclasses.replace(tiny_params.watch, eval_prompts=kept))
    assert len(ppo.heldout_prompts(params, tiny_run, training)) == kept and capsys.readouterr().err == ""


def test_the_watch_says_when_held_out_prompts_are_training_prompts(tiny_run, tiny_params, capsys):
    """None are (prepare splits by distinct prompt, and data/ppo/metrics.json records 0); should a user's own
    tokenized files mix them, the watch says its figures are not held-out ones."""
    heldout = pd.read_parquet(tiny_run / TOKENIZED_EVAL)["query"]
    ppo.heldout_prompts(tiny_params, tiny_run, list(heldout[:2]))
    assert capsys.readouterr().err.endswith("held-out prompts, 2 of them training prompts: their figures are not "
                                            "held-out ones\n")


@pytest.mark.parametrize("change, check", [
    ({"entropy": 5.0}, "entropy_ratio"), ({"kl": 20.0}, "kl_per_token"), ({"approxkl": 47.0}, "approxkl"),
    ({"ratio_mean": 3.0}, "ratio_mean"), ({"clipfrac": 0.48}, "clipfrac"), ({"loss_value": 36.0}, "value_loss_growth"),
    ({"response_len": 3.0, "kl": 0.1}, "length_ratio"), ({"truncated_share": 1.0}, "truncated_share"),
    ({"reward_mean": math.nan}, "non_finite"),
])
def test_the_doctor_names_each_check_that_a_step_crosses(change, check):
    first = HEALTHY | {"step": 0, "loss_value": 1.0}
    assert diagnose(HEALTHY, first, LIMITS) == []
    found = diagnose(HEALTHY | change, first, LIMITS)
    assert [alert["check"] for alert in found] == [check] and found[0]["step"] == 5


def test_a_100x_learning_rate_alerts_at_once_and_on_alert_stop_ends_the_run_there(tiny_run, tmp_path, monkeypatch):
    root = copy_for_ppo(tiny_run, tmp_path)
    params = write_params(root, {"ppo.learning_rate": 0.03, "ppo.steps": 64, "watch.on_alert": "stop"})
    monkeypatch.chdir(root)
    result = CliRunner().invoke(app, ["ppo", "--params", str(params)])
    assert result.exit_code == 0, result.output
    metrics = json.loads((root / PPO_METRICS).read_text())
    assert metrics["stopped"]["step"] < 5 and metrics["steps"] == metrics["stopped"]["step"] + 1
    assert f"stopped at step {metrics['stopped']['step'] + 1} by an alert (" in result.stdout
    assert result.stderr.startswith(f"warning: ppo: step {metrics['stopped']['step'] + 1}: ")
    assert (root / PPO_MODEL / "model.safetensors").exists() and not (root / PPO_CHECKPOINTS).exists()
