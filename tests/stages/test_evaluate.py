"""stages/evaluate.py on tiny params (the shared run, see conftest.tiny_run): metrics that are those of its samples (and
by hand), the judges (evaluate.judges) and a judge that fails, and the response log-probability sums its KL comes
from."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pandas as pd
import pytest
from transformers import AutoModelForCausalLM

from stages.shared.artifacts import EVAL_METRICS, EVAL_SAMPLES, SFT_MODEL
from stages.shared.runtime import StageError


def test_evaluate_metrics_are_those_of_its_samples(tiny_run, tiny_params):
    """metrics.json summarises samples.parquet: each policy's means, and the win rate over the same prompts."""
    metrics = json.loads((tiny_run / EVAL_METRICS).read_text())
    samples = pd.read_parquet(tiny_run / EVAL_SAMPLES)
    n = tiny_params.evaluate.n_prompts
    assert samples.groupby("policy").size().to_dict() == {"ppo": n, "sft": n}
    by = {name: samples[samples["policy"] == name].reset_index(drop=True) for name in ("sft", "ppo")}
    assert (by["sft"]["query"] == by["ppo"]["query"]).all()
    ppo, sft = by["ppo"], by["sft"]
    assert list(metrics) == ["win_rate", "gold", "reward", "kl", "length", "sft", "heldout"]  # top: the PPO policy's
    assert metrics["heldout"] == {"prompts": n, "in_train": 0}  # held out: none of them a training prompt
    means = {"gold": "gold", "reward": "score", "kl": "kl_to_sft", "length": "response_tokens"}
    assert {k: metrics[k] for k in means} == pytest.approx({k: ppo[c].mean() for k, c in means.items()}, abs=1e-12)
    assert metrics["sft"] == pytest.approx({k: sft[c].mean() for k, c in means.items() if k != "kl"}, abs=1e-12)
    assert (sft["kl_to_sft"] == 0).all()  # KL(sft || sft): left out of the metrics
    wins = (by["ppo"]["score"] > by["sft"]["score"]).sum() + 0.5 * (by["ppo"]["score"] == by["sft"]["score"]).sum()
    assert metrics["win_rate"] == wins / n


def test_evaluate_metrics_by_hand():
    from stages.evaluate import policy_metrics, win_rate
    from stages.shared.artifacts import evaluation_metrics, policy_means

    rows = {"score": [1.0, -2.0, 0.5, 3.0], "kl_to_sft": [0.0, 0.25, 0.5, 0.25], "response_tokens": [3, 5, 4, 8],
            "gold": [1, -1, 0, 2]}
    # score (1 - 2 + 0.5 + 3) / 4 = 0.625; kl 1.0 / 4 = 0.25; length 20 / 4 = 5; gold 2 / 4 = 0.5
    ppo = policy_metrics(rows, ["gold"])
    assert ppo == {"gold": 0.5, "reward": 0.625, "kl": 0.25, "length": 5.0}
    assert "gold" not in policy_metrics(rows)  # only the judges named
    sft = {"gold": 0.0, "reward": -1.0, "kl": 0.0, "length": 4.0}
    metrics = evaluation_metrics(ppo, sft, 0.75, {"prompts": 4, "in_train": 0})
    assert metrics == {"win_rate": 0.75, **ppo, "sft": {"gold": 0.0, "reward": -1.0, "length": 4.0},
                       "heldout": {"prompts": 4, "in_train": 0}}
    assert policy_means(metrics, "ppo") == ppo and policy_means(metrics, "sft") == sft
    # ppo vs sft per prompt: 2 > 1 win, 1 = 1 tie, 1 < 2 loss, 0 = 0 tie: (1 + 0.5 + 0 + 0.5) / 4
    assert win_rate([2.0, 1.0, 1.0, 0.0], [1.0, 1.0, 2.0, 0.0]) == 0.5
    # a tie counts half, not as a win (>= would give 1.0) nor as nothing (dropping ties would give 0.5)
    assert win_rate([2.0, 2.0], [1.0, 2.0]) == 0.75


JUDGES = """
def vowels(texts):
    return [float(sum(c in "aeiou" for c in t)) for t in texts]


def words(texts):
    return [float(len(t.split())) for t in texts]
"""


def test_evaluate_reports_each_judge_as_a_metric_and_a_samples_column(tiny_run, tiny_params, tmp_path, monkeypatch):
    """evaluate.judges, scorers the policy never trained on: each is a column of data/eval/samples.parquet (its score of
    each sample's query + response) and a metric of each policy (their mean), beside the scorer's; one named `gold`
    takes the place of the gold score (as the example's VADER does with its own data; beside the synthetic data's
    lexicon the params check refuses the name, tests/stages/test_bad_input.py: these params are built in code)."""
    from stages import evaluate
    from stages.shared.synthetic import gold_score
    from tests.conftest import params_per_stage

    (tmp_path / "my_judges.py").write_text(JUDGES)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "eval", "report", "logs"))
    judges = {"gold": "my_judges:vowels", "words": "my_judges:words"}
    params = dataclasses.replace(tiny_params, evaluate=dataclasses.replace(tiny_params.evaluate, judges=judges))
    summary = evaluate.run(params_per_stage(params)["evaluate"], root)  # evaluate tracks the evaluate section

    metrics = json.loads((root / EVAL_METRICS).read_text())
    samples = pd.read_parquet(root / EVAL_SAMPLES)
    assert list(samples.columns) == ["policy", "query", "response", "score", "kl_to_sft", "response_tokens", "gold",
                                     "words"]
    assert list(metrics) == ["win_rate", "gold", "words", "reward", "kl", "length", "sft", "heldout"]
    assert list(metrics["sft"]) == ["gold", "words", "reward", "length"]
    for policy, means in (("ppo", metrics), ("sft", metrics["sft"])):
        texts = (samples["query"] + samples["response"])[samples["policy"] == policy]
        vowels = texts.map(lambda t: sum(c in "aeiou" for c in t)).astype(float)
        words = texts.str.split().str.len().astype(float)
        assert samples.loc[texts.index, "gold"].tolist() == vowels.tolist()
        assert samples.loc[texts.index, "words"].tolist() == words.tolist()
        assert means["gold"] == pytest.approx(vowels.mean(), abs=1e-12)
        assert means["words"] == pytest.approx(words.mean(), abs=1e-12)
        assert means["gold"] != pytest.approx(np.mean([gold_score(t) for t in texts]))  # not the lexicon's
    assert f", words {metrics['sft']['words']:.2f} -> {metrics['words']:.2f}," in summary
    # the report: a row per judge (the gold score named by its function), and the judges beside each sample's score
    from stages import report

    report.run(params_per_stage(params)["report"], root)
    page = (root / "data" / "report" / "index.html").read_text()
    assert "<td>gold score (my_judges:vowels)</td>" in page and "<td>judge words (my_judges:words)</td>" in page
    assert "<th>SFT response</th><th>RM score</th><th>gold</th><th>words</th><th>PPO response</th>" in page


def test_a_judge_that_fails_is_one_line_naming_it(tiny_params, tmp_path, monkeypatch):
    """A judge that cannot be imported, or whose scores are not finite numbers, stops evaluate with one line naming
    the judge, as the scorer's problems do."""
    from stages.evaluate import judge_functions, scores_of

    (tmp_path / "odd_judges.py").write_text(JUDGES + "\n\ndef broken(texts):\n    return [float('nan')] * len(texts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with_judges = lambda judges: dataclasses.replace(  # noqa: E731
        tiny_params, evaluate=dataclasses.replace(tiny_params.evaluate, judges=judges))
    with pytest.raises(StageError, match=r"evaluate.judges.mine 'no_such_module:score' is not an importable "
                                         r"'module:function'"):
        judge_functions(with_judges({"mine": "no_such_module:score"}))
    with pytest.raises(StageError, match=r"odd_judges has no function 'nothing'"):
        judge_functions(with_judges({"mine": "odd_judges:nothing"}))
    params = with_judges({"mine": "odd_judges:broken"})
    fn = judge_functions(params)["mine"]
    with pytest.raises(StageError) as err:
        scores_of(fn, ["a b", "c"], params, "ppo", who="judge mine")
    assert str(err.value) == ("the ppo policy's samples 1-2: judge mine returned nan for text 0; scores must be finite "
                              "numbers")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_sums_match_one_sample_at_a_time(tiny_run, temperature):
    """The padded batch in evaluate.logprob_sums gives each sample's sum_t log p(response_t | ...) as if alone, at
    the sampling temperature (the logits divided by it, as the samples were drawn)."""
    import torch

    from stages.evaluate import logprob_sums

    model = AutoModelForCausalLM.from_pretrained(tiny_run / SFT_MODEL).eval()
    queries, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 0]]
    expected = []
    for q, r in zip(queries, responses):
        ids = torch.tensor([q + r])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float() / temperature
            logprobs = torch.log_softmax(logits, dim=-1)  # (T-1, V)
        expected.append(sum(float(logprobs[len(q) - 1 + t, tok]) for t, tok in enumerate(r)))
    assert logprob_sums(model, queries, responses, 2, temperature) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_logprob_sums_score_the_response_tokens_without_full_logits(arch):
    """evaluate's KL comes from ppo_core's scoring pass, as the PPO step's: the LM head at the response positions only,
    chunk by chunk (evaluate materialised float32 (B, T-1, V) logits and their log-softmax). Its sums equal those
    of the full logits, and the LM head module's own forward (the full logits) never runs."""
    import torch

    from stages.evaluate import logprob_sums
    from tests.tiny import tiny_causal_lm, tiny_seq2seq_lm

    model = (tiny_causal_lm() if arch == "gpt2" else tiny_seq2seq_lm(arch)).eval()
    queries, responses = [[5, 6, 7], [8, 9], [10]], [[10, 11], [12, 13, 14, 1], [15]]
    expected = []
    with torch.no_grad():
        for q, r in zip(queries, responses):
            if arch == "gpt2":
                logits = model(input_ids=torch.tensor([q + r])).logits[0, len(q) - 1:-1]  # (R, V)
            else:
                decoder_ids = torch.tensor([[model.config.decoder_start_token_id] + r[:-1]])
                logits = model(input_ids=torch.tensor([q]), decoder_input_ids=decoder_ids).logits[0]
            expected.append(float(torch.log_softmax(logits.float(), -1)[torch.arange(len(r)), r].sum()))
    full_logits = []
    model.get_output_embeddings().register_forward_hook(lambda *args: full_logits.append(1))
    assert logprob_sums(model, queries, responses, batch_size=2) == pytest.approx(expected, abs=1e-5)
    assert not full_logits


ZERO_ONE = """
def even_length(texts):
    return [float(len(t) % 2 == 0) for t in texts]


def thirds(texts):
    return [float(len(t) % 3 == 0) for t in texts]


def chars(texts):
    return [float(len(t)) for t in texts]
"""


def test_evaluate_reports_accuracy_and_pass_at_k_beside_what_it_reported(tiny_run, tiny_params, tmp_path, monkeypatch):
    """evaluate.samples_per_prompt > 1 and evaluate.pass_at_k: metrics.json's last group, ``accuracy``, holds per reward
    (the callable scorer's 0/1 `reward`, the gold score, a 0/1 judge) SFT's and PPO's mean, greedy accuracy and pass@k,
    and the paired standard errors; the extra samples are drawn after the rest, so samples.parquet and every other
    metric are those of the same params with the table off, byte for byte. The report shows the table."""
    from stages import evaluate, report
    from tests.conftest import params_per_stage

    (tmp_path / "zero_one.py").write_text(ZERO_ONE)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "eval", "report", "logs"))
    scorer = dataclasses.replace(tiny_params.scorer, source="callable", name="zero_one:even_length", input="response")
    off = dataclasses.replace(tiny_params, scorer=scorer, evaluate=dataclasses.replace(
        tiny_params.evaluate, judges={"thirds": "zero_one:thirds"}))
    evaluate.run(params_per_stage(off)["evaluate"], root)
    before = {path: (root / path).read_bytes() for path in (EVAL_SAMPLES, EVAL_METRICS)}
    on = dataclasses.replace(off, evaluate=dataclasses.replace(off.evaluate, samples_per_prompt=4, pass_at_k=[1, 2, 4],
                                                                success_threshold=0.5))
    evaluate.run(params_per_stage(on)["evaluate"], root)

    assert (root / EVAL_SAMPLES).read_bytes() == before[EVAL_SAMPLES]  # the first sample per prompt, as with it off
    metrics = json.loads((root / EVAL_METRICS).read_text())
    accuracy = metrics.pop("accuracy")
    assert json.dumps(metrics, indent=2) + "\n" == before[EVAL_METRICS].decode()  # all else as with it off
    assert list(accuracy) == ["reward", "gold", "thirds"]
    statistics = ["mean", "greedy", "pass@1", "pass@2", "pass@4"]
    n = tiny_params.evaluate.n_prompts
    for name, entry in accuracy.items():
        assert list(entry) == ["sft", "ppo", "paired_se"]
        for policy in ("sft", "ppo"):
            stats = entry[policy]
            assert list(stats) == statistics
            assert stats["pass@1"] <= stats["pass@2"] <= stats["pass@4"]  # more tries, more passes
            assert stats["greedy"] * n == pytest.approx(round(stats["greedy"] * n), abs=1e-9)  # a share of n prompts
            if name != "gold":  # a 0/1 reward: its mean is its pass rate, pass@1
                assert stats["pass@1"] == pytest.approx(stats["mean"], abs=1e-12)
        assert all(se is None or se >= 0 for se in entry["paired_se"].values())
    # the scorer's first sample per prompt is among the 4 its mean is over: with 4 samples, each prompt's share moves
    # in quarters, so the mean over prompts is a multiple of 1 / (4 n)
    assert accuracy["reward"]["ppo"]["mean"] * 4 * n == pytest.approx(round(accuracy["reward"]["ppo"]["mean"] * 4 * n))

    report.run(params_per_stage(on)["report"], root)
    page = (root / "data" / "report" / "index.html").read_text()
    assert "<h3>Accuracy and pass@k</h3>" in page
    assert "<td>callable zero_one:even_length score</td><td>pass@4 of 4 samples (unbiased estimator; a pass: reward " \
           "&gt;= 0.5)</td>" in page
    assert "<td>judge thirds</td><td>greedy accuracy" in page and "data/ppo/eval.csv" in page


@pytest.mark.parametrize("base", ["sampled", "greedy", "none"])
def test_the_base_model_is_sampled_greedy_only_or_left_out_as_evaluate_base_says(base, tiny_run, tiny_params, tmp_path,
                                                                                 monkeypatch):
    """evaluate.base with a pretrained model.name_or_path (here the tiny SFT model itself, so the base model's greedy
    answers are SFT's): sampled, the base model has every statistic; greedy, its greedy accuracy only (no sample
    drawn), a blank in the report's other rows; none, no base column and no base draw."""
    from stages import evaluate, report
    from tests.conftest import params_per_stage

    (tmp_path / "zero_one.py").write_text(ZERO_ONE)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "eval", "report", "logs"))
    scorer = dataclasses.replace(tiny_params.scorer, source="callable", name="zero_one:even_length", input="response")
    base_model = dataclasses.replace(tiny_params.model, name_or_path=str(tiny_run / SFT_MODEL))
    params = dataclasses.replace(
        tiny_params, scorer=scorer, model=base_model,
        evaluate=dataclasses.replace(tiny_params.evaluate, samples_per_prompt=2, pass_at_k=[2], base=base))
    drawn, sample = [], evaluate.sample_responses  # each draw's progress label: which policy, sampled or greedy
    monkeypatch.setattr(evaluate, "sample_responses",
                        lambda *args, desc, **kw: drawn.append(desc) or sample(*args, desc=desc, **kw))
    evaluate.run(params_per_stage(params)["evaluate"], root)

    accuracy = json.loads((root / EVAL_METRICS).read_text())["accuracy"]
    base_draws = [desc for desc in drawn if desc.startswith("evaluate base")]
    if base == "none":
        assert all(list(entry) == ["sft", "ppo", "paired_se"] for entry in accuracy.values()) and not base_draws
    else:
        assert all(list(entry) == ["base", "sft", "ppo", "paired_se"] for entry in accuracy.values())
        # the base model is the SFT model: greedy decoding gives SFT's answers, so the same greedy accuracy
        assert all(entry["base"]["greedy"] == entry["sft"]["greedy"] for entry in accuracy.values())
        expected = ["greedy"] if base == "greedy" else ["mean", "greedy", "pass@2"]
        assert all(list(entry["base"]) == expected for entry in accuracy.values())
        assert base_draws == (["evaluate base, greedy"] if base == "greedy"
                              else ["evaluate base, sampled", "evaluate base, greedy"])
    report.run(params_per_stage(params)["report"], root)
    page = (root / "data" / "report" / "index.html").read_text()
    assert ("<th>base model</th>" in page) == (base != "none")
    mean_row = page.split("<td>mean reward of 2 sampled responses per prompt</td>")[1].split("</tr>")[0]
    assert mean_row.startswith("<td></td>") == (base == "greedy")  # no samples: a blank, not a zero


def test_a_null_success_threshold_refuses_a_reward_that_is_not_0_or_1(tiny_run, tiny_params, tmp_path, monkeypatch):
    """evaluate.success_threshold: null says the rewards are 0/1: a judge's count of characters is not, and evaluate
    stops with one line naming it, before it writes anything."""
    from stages import evaluate
    from tests.conftest import params_per_stage

    (tmp_path / "zero_one.py").write_text(ZERO_ONE)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "eval", "report", "logs"))
    scorer = dataclasses.replace(tiny_params.scorer, source="callable", name="zero_one:even_length")
    params = dataclasses.replace(tiny_params, scorer=scorer, evaluate=dataclasses.replace(
        tiny_params.evaluate, judges={"chars": "zero_one:chars"}, samples_per_prompt=2, pass_at_k=[2],
        success_threshold=None))
    with pytest.raises(StageError, match=r"^evaluate: the reward 'chars' gave \d+ for the sft policy's sample 0 of "
                                         r"prompt 0, but evaluate.success_threshold is null"):
        evaluate.run(params_per_stage(params)["evaluate"], root)
    assert not (root / EVAL_METRICS).exists() and not (root / EVAL_SAMPLES).exists()
