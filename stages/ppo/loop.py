"""The ppo stage's loop: what every step uses, built once (``Loop``), one step of the seed's loop (generate, score,
``step()``) and the order the prompts come in."""

from __future__ import annotations

import dataclasses
import random
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ppo_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOTrainer
from ppo_core.config import PPOConfig
from stages.ppo.tables import gather_columns, rollout_table
from stages.shared.artifacts import PPO_CHECKPOINTS, SFT_MODEL, loading
from stages.shared.models import lora_config
from stages.shared.params import Params, ScorerParams
from stages.shared.runtime import StageError, to_host, warning
from stages.shared.scoring import (
    Combined,
    Row,
    build_scorer,
    component_stats,
    reward_adapter,
    scored,
    scorer_texts,
    trainer_state,
)
from stages.shared.synthetic import gold_score


@dataclasses.dataclass(frozen=True)
class Loop:
    """What every step of the loop uses, built once from the params: the trainer (policy, reference, optimiser), the
    scorer and its params section, the tokenizer, generate()'s keyword arguments, the tokenized prompts, whether the
    gold score is known (synthetic data) and the run's seed."""

    trainer: PPOTrainer
    score: Callable[[list[str]], list[float]]
    scorer: ScorerParams
    tokenizer: Any
    generation: dict[str, Any]
    prompts: Any  # the DataFrame of data/tokenized/train.parquet: query, input_ids
    gold: bool
    seed: int
    columns: dict[str, list] = dataclasses.field(default_factory=dict)  # each prompt's chat and kept columns


def build_loop(params: Params, config: PPOConfig, prompts, tokenizer, seq2seq: bool, root: Path,
               columns: dict[str, list] | None = None) -> Loop:
    """The policy (SFT plus a value head; with LoRA, fresh adapters), the scorer and the trainer. The reference is a
    frozen copy of SFT, or with LoRA the same weights with the adapters disabled."""
    lora = params.model.lora
    policy_class = AutoModelForSeq2SeqLMWithValueHead if seq2seq else AutoModelForCausalLMWithValueHead
    adapter = {"peft_config": lora_config(lora, "SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM")} if lora else {}
    shared = reward_adapter(params, root, seq2seq)  # LoRA: the reward model is an adapter on the policy's base too
    if shared is not None:
        adapter["reward_adapter"] = str(shared)
    with loading(root / SFT_MODEL):
        model = policy_class.from_pretrained(root / SFT_MODEL, **adapter)
    # before the trainer: under ZeRO-3, models built after it come out sharded
    score = build_scorer(params, root, model if shared is not None else None)
    with warnings.catch_warnings():  # no dataset, on purpose: the stage batches the prompts itself (query_batches)
        warnings.filterwarnings("ignore", message="PPOTrainer: no dataset", category=UserWarning)
        trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)
    generation = {**dataclasses.asdict(params.generation), "pad_token_id": tokenizer.pad_token_id,
                  "eos_token_id": tokenizer.eos_token_id}
    return Loop(trainer, score, params.scorer, tokenizer, generation, prompts, params.data.is_synthetic, params.seed,
                columns or {})


def one_step(loop: Loop, step: int, idx: list[int], root: Path) -> tuple[dict, dict[str, list]]:
    """One step of the seed's loop on this process's prompts ``idx``: generate, score, optimise. Returns the step's
    stats (with the wall-clock seconds of generating and scoring as ``time/*``) and every process's rollouts."""
    trainer, tokenizer = loop.trainer, loop.tokenizer
    query_tensors = [torch.tensor(loop.prompts["input_ids"][i]) for i in idx]
    queries = [loop.prompts["query"][i] for i in idx]
    # 1. rollout
    started = time.perf_counter()
    response_tensors = trainer.generate(query_tensors, batch_size=len(idx), return_prompt=False, **loop.generation)
    response_ids = to_host(response_tensors)  # in one copy (one per response: a sync each)
    responses = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    generated = time.perf_counter()
    # 2. score (a reward function that sees the row gets each sample's prompt columns: a prompt's G samples, its own)
    texts = [q + r for q, r in zip(queries, responses)]
    columns = {name: [values[i] for i in idx] for name, values in loop.columns.items()}
    scores = scored(loop.score, scorer_texts(loop.scorer, queries, responses), loop.scorer, f"PPO step {step + 1}",
                    row=Row(queries, responses, columns, [r.tolist() for r in response_ids],
                            trainer_state(step, trainer.config.total_ppo_epochs)))
    seconds = {"time/generate": generated - started, "time/score": time.perf_counter() - generated}
    components = loop.score.last if isinstance(loop.score, Combined) else {}  # scorer.source combined: each function's
    # 3. optimise
    try:
        stats = trainer.step(query_tensors, response_tensors, [torch.tensor(s, dtype=torch.float) for s in scores])
    except FloatingPointError as err:  # raised before the update: the last checkpoint is intact
        raise StageError(f"{str(err).rstrip('.')}; {likely_cause(scores)}; the checkpoint in "
                         f"{root / PPO_CHECKPOINTS} (if any) is intact: a rerun resumes from it once that is "
                         "changed") from None
    # 4. every process's rollouts, in process order (as step() gathers its per-sample stats, the KL among them)
    gold = [gold_score(t) for t in texts] if loop.gold else None
    gathered = gather_columns({
        "step": [step] * len(idx), "query": queries, "response": responses, "score": scores,
        "query_tokens": [len(q) for q in query_tensors], "response_tokens": [len(r) for r in response_ids],
        "ends_with_eos": [bool(len(r)) and int(r[-1]) == tokenizer.eos_token_id for r in response_ids],
        "response_ids": [r.tolist() for r in response_ids],
    } | ({"gold": gold} if gold else {}) | {f"reward_{name}": values for name, values in components.items()}
        | columns, trainer.accelerator)  # each function's rewards and the kept columns after the others
    parts = {name: gathered[f"reward_{name}"] for name in components}  # every process's, as step()'s own stats are
    return stats | component_stats(parts) | seconds, rollout_table(gathered, stats["objective/kl_dist"])


# A score scale past which a non-finite loss is put down to the scores: far outside what a reward should be, on the
# way to where squared errors overflow float32 (scores of ~1e19)
HUGE_SCORE = 1e4


def likely_cause(scores: list[float]) -> str:
    """Why a step's loss or gradients were not finite, from its scores' range: their scale, or else the update's."""
    low, high = min(scores), max(scores)
    span = f"this step's scores range from {low:.3g} to {high:.3g}"
    if max(abs(low), abs(high)) > HUGE_SCORE:
        return (f"{span}, a scale that overflows float32 in the loss: scale the scorer's output down (scores of a "
                "few units train best)")
    return f"{span}; lower ppo.learning_rate or set ppo.max_grad_norm"


# A score magnitude past which a scorer's scale is worth a word: rewards of a few units train best (the KL penalty,
# init_kl_coef * KL, and the value head's targets are of that size); a thousand is far outside it.
LARGE_SCORE = 1e3


def warn_if_large_scores(scores: list[float], step: int, main: bool, config: PPOConfig) -> bool:
    """Warn (once: returns True when it did) when a step's scores reach past +-`LARGE_SCORE` and nothing brings them
    back to scale (ppo.use_score_scaling off, ppo.score_clip unset or above it): the KL penalty then weighs nothing
    beside them and the value loss grows with their square."""
    largest = max(map(abs, scores))
    rescaled = config.use_score_scaling or (config.score_clip is not None and config.score_clip <= LARGE_SCORE)
    if largest <= LARGE_SCORE or rescaled:
        return False
    if main:
        warning(f"ppo: step {step + 1}: scores reach {largest:.3g} in magnitude (over {LARGE_SCORE:g}), a scale at "
                "which the KL penalty weighs nothing and the value loss grows with its square; set "
                "ppo.use_score_scaling: true or ppo.score_clip, or scale the scorer's output down (scores of a few "
                "units train best)")
    return True


FLAT = "ppo/frac_reward_zero_std"


def warn_if_flat_groups(stats: dict, step: int, main: bool, dynamic_sampling: bool = False) -> bool:
    """Warn (once: returns True when it did) when most prompts' samples all got the same score: a group estimator
    learns nothing from those (every advantage 0); the share is the step's ``ppo/frac_reward_zero_std``. With
    ``dynamic_sampling`` (DAPO's) they are out of the loss, and the warning says so."""
    if stats.get(FLAT, 0.0) <= 0.5:
        return False
    if main:
        what = "their advantages are 0 and they teach nothing"
        if dynamic_sampling:
            what = "ppo.dynamic_sampling left them out of the loss, which trained on the others " \
                   "(ppo/frac_responses_left_out)"
        warning(f"ppo: step {step + 1}: in {stats[FLAT]:.0%} of the prompts every sample got the same score, so "
                f"{what} ({FLAT} in data/ppo/stats.parquet); a scorer with finer grades, a higher "
                "generation.temperature or a larger ppo.num_generations gives them a signal")
    return True


def query_batches(n: int, batch_size: int, seed: int, group_size: int = 1) -> Iterator[list[int]]:
    """Endless batches of row indices: a seeded shuffle per epoch, the last incomplete batch dropped. With
    ``group_size`` G, a batch holds ``batch_size / G`` prompts, each G times in a row (the same rollout budget, G
    samples of every prompt)."""
    rng = random.Random(f"{seed}-ppo")
    prompts = batch_size // group_size
    while True:
        order = list(range(n))
        rng.shuffle(order)
        for start in range(0, n - prompts + 1, prompts):
            yield [i for i in order[start:start + prompts] for _ in range(group_size)]
