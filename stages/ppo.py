"""ppo: the seed's loop on ppo_core (generate, score, `step()`), ceil(ppo.steps / ppo.batch_size) times.

The reward is `scorer.source`'s (stages/scoring.py). Each step's rollouts and stats go to the run's work in
progress, every `checkpoint.ppo_every` steps the whole state is checkpointed, and a finished run publishes its
artifacts and deletes its state (stages/ppo_run.py); a rerun of an interrupted run with the same params, inputs and
code resumes from its checkpoint and ends with the same artifacts."""

from __future__ import annotations

import dataclasses
import math
import random
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ppo_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOTrainer
from ppo_core.config import PPOConfig, RunSizes
from ppo_core.runtime.utils import moved, set_seed
from stages.artifacts import (
    PPO_CHECKPOINTS,
    PPO_MODEL,
    SFT_MODEL,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
    check_tokenized_with,
    loading,
    read_prompts,
    require_dir,
)
from stages.models import check_mixed_precision, is_encoder_decoder, lora_config, model_context
from stages.params import Params, defaulted_ppo_keys
from stages.ppo_run import publish, record, resume_run, save_run_checkpoint
from stages.ppo_tables import StepTables, gather_columns, rollout_table
from stages.runtime import Progress, StageError, note, process_state, warning
from stages.scoring import build_scorer, judge_functions, reward_adapter, scored, scorer_texts
from stages.synthetic import gold_score
from stages.watch import watch_step


def run(params: Params, root: Path = Path(".")) -> str:
    """Check what can be checked before the models load, build the loop, resume it if a checkpoint of the same run
    is there, run its steps (recording each, checkpointing some) and publish; returns the summary line."""
    check_mixed_precision(params)
    set_seed(params.seed)
    config = params.ppo_config
    prompts = read_prompts(root / TOKENIZED_TRAIN)
    state = process_state()
    sizes = RunSizes.of(config, state.num_processes)  # under `accelerate launch`: ppo.batch_size is per process
    check_prompts_fill_a_step(len(prompts), sizes, params.path)
    if state.is_main_process:
        note_steps_rounded_up(config)
        note_defaulted_keys(params)
    tokenizer = AutoTokenizer.from_pretrained(require_dir(root / SFT_MODEL))
    check_tokenized_with(root / TOKENIZED_TRAIN, root / SFT_MODEL)
    seq2seq = is_encoder_decoder(root / SFT_MODEL)
    check_prompts_fit_the_context(prompts, params, seq2seq, root)
    loop = build_loop(params, config, prompts, tokenizer, seq2seq, root)
    trainer = loop.trainer
    rank, main = trainer.accelerator.process_index, trainer.accelerator.is_main_process
    batches = query_batches(len(prompts), sizes.global_batch_size, params.seed, sizes.num_generations)
    heldout = heldout_prompts(params, root)  # watch.eval_every: the held-out prompts evaluated during the run
    judges = judge_functions(params) if heldout is not None else {}
    start, tables = resume_run(trainer, params, root)
    for _ in range(start):  # the data position: the batches the checkpointed steps consumed
        next(batches)
    total = config.total_ppo_epochs
    progress = Progress("ppo", total, start=start, main=main)  # step i/N, ETA, the last step's reward and KL
    warned_flat = False
    for step in range(start, total):
        idx = next(batches)[rank * sizes.batch_size:(rank + 1) * sizes.batch_size]  # this process's share
        stats, rollouts = one_step(loop, step, idx, params, root)
        tables.append(step, stats, rollouts["score"], rollouts.get("gold"))  # time/*: timings.csv
        progress.update(step + 1, reward=tables.curves[-1]["reward_mean"], kl=tables.curves[-1]["kl"])
        warned_flat = warned_flat or warn_if_flat_groups(stats, step, main, config.resolved.dynamic_sampling)
        stop = watch_step(loop, step, total, stats, rollouts, tables, heldout, judges, params, root, main)
        if main:  # only the main process writes
            record(root, step, rollouts, tables)
        every = params.checkpoint.ppo_every
        if every and ((step + 1) % every == 0 or step + 1 == total):
            save_run_checkpoint(trainer, root, step + 1, tables)
            progress.saved = step + 1  # what a rerun of an interrupted run resumes from
        if stop:  # watch.on_alert: stop
            break
    progress.close()
    publish(trainer, root, tables, tokenizer, params.watch)  # the run has finished, or an alert stopped it
    return summary(tables, start)


def heldout_prompts(params: Params, root: Path):
    """The first `watch.eval_prompts` held-out prompts, tokenized by the SFT model's tokenizer, or None without
    held-out evaluation (watch.eval_every 0)."""
    if params.watch.eval_every == 0:
        return None
    check_tokenized_with(root / TOKENIZED_EVAL, root / SFT_MODEL)
    return read_prompts(root / TOKENIZED_EVAL).head(params.watch.eval_prompts)


def note_defaulted_keys(params: Params) -> None:
    """Say once which `ppo` keys the params file leaves out, and the PPOConfig defaults they take (legacy TRL's,
    which may differ from the shipped params.yaml's: without batch_size a run takes 128 rollouts a step)."""
    defaulted = defaulted_ppo_keys(params)
    if defaulted:
        values = ", ".join(f"{key}={value!r}" for key, value in defaulted.items())
        note(f"{params.path}: {len(defaulted)} ppo key{'s' if len(defaulted) > 1 else ''} not set, so PPOConfig's "
             f"default{'s' if len(defaulted) > 1 else ''}: {values}")


def check_prompts_fill_a_step(n_prompts: int, sizes: RunSizes, params_path: Path) -> None:
    """Stop before any model loads when the tokenized prompts are fewer than one step's distinct prompts: every step
    takes a full batch (`query_batches` drops an incomplete one), so not a single step could run."""
    if n_prompts < sizes.prompts_per_step:
        raise StageError(f"{TOKENIZED_TRAIN}: {n_prompts} prompts, fewer than the {sizes.prompts_per_step} of one "
                         f"step (ppo.batch_size={sizes.batch_size} x {sizes.num_processes} processes / "
                         f"ppo.num_generations={sizes.num_generations}); lower ppo.batch_size in {params_path} or give "
                         "more prompts")


def note_steps_rounded_up(config: PPOConfig) -> None:
    """Say so when ppo.steps (rollouts, as in the seed) is no multiple of ppo.batch_size: the run takes whole steps,
    so it rolls out more than ppo.steps."""
    if config.steps % config.batch_size:
        total = config.total_ppo_epochs
        note(f"ppo: ppo.steps ({config.steps}) is not a multiple of ppo.batch_size ({config.batch_size}): running "
             f"{total} step{'s' * (total > 1)} of {config.batch_size} rollouts ({total * config.batch_size} in all)")


def check_prompts_fit_the_context(prompts, params: Params, seq2seq: bool, root: Path) -> None:
    """Stop before the models load when the longest query and a full-length response do not fit the SFT model's
    context: a decoder-only model holds query and response in one context; an encoder-decoder each in its own."""
    longest, context = max(map(len, prompts["input_ids"])), model_context(root / SFT_MODEL)
    new_tokens = params.generation.max_new_tokens
    if (max(longest, new_tokens) if seq2seq else longest + new_tokens) > context:
        raise StageError(f"{TOKENIZED_TRAIN}: a {longest}-token query and generation.max_new_tokens={new_tokens} "
                         f"do not fit the {context}-token context of {SFT_MODEL}; lower one of them "
                         f"(tokenize.max_query_tokens) in {params.path}")


@dataclasses.dataclass(frozen=True)
class Loop:
    """What every step of the loop uses, built once: the trainer (policy, reference, optimiser), the scorer, the
    tokenizer, generate()'s keyword arguments and the tokenized prompts."""

    trainer: PPOTrainer
    score: Callable[[list[str]], list[float]]
    tokenizer: Any
    generation: dict[str, Any]
    prompts: Any  # the DataFrame of data/tokenized/train.parquet: query, input_ids


def build_loop(params: Params, config: PPOConfig, prompts, tokenizer, seq2seq: bool, root: Path) -> Loop:
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
    return Loop(trainer, score, tokenizer, generation, prompts)


def one_step(loop: Loop, step: int, idx: list[int], params: Params, root: Path) -> tuple[dict, dict[str, list]]:
    """One step of the seed's loop on this process's prompts ``idx``: generate, score, optimise. Returns the step's
    stats (with the wall-clock seconds of generating and scoring as ``time/*``) and every process's rollouts."""
    trainer, tokenizer = loop.trainer, loop.tokenizer
    query_tensors = [torch.tensor(loop.prompts["input_ids"][i]) for i in idx]
    queries = [loop.prompts["query"][i] for i in idx]
    # 1. rollout
    started = time.perf_counter()
    response_tensors = trainer.generate(query_tensors, batch_size=len(idx), return_prompt=False, **loop.generation)
    response_ids = moved(response_tensors, "cpu")  # to the host in one copy (one per response: a sync each)
    responses = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    generated = time.perf_counter()
    # 2. score
    texts = [q + r for q, r in zip(queries, responses)]
    scores = scored(loop.score, scorer_texts(params, queries, responses), params, f"PPO step {step + 1}")
    seconds = {"time/generate": generated - started, "time/score": time.perf_counter() - generated}
    # 3. optimise
    try:
        stats = trainer.step(query_tensors, response_tensors, [torch.tensor(s, dtype=torch.float) for s in scores])
    except FloatingPointError as err:  # raised before the update: the last checkpoint is intact
        raise StageError(f"{str(err).rstrip('.')}; {likely_cause(scores)}; the checkpoint in "
                         f"{root / PPO_CHECKPOINTS} (if any) is intact: a rerun resumes from it once that is "
                         "changed") from None
    # 4. every process's rollouts, in process order (as step() gathers its per-sample stats, the KL among them)
    gold = [gold_score(t) for t in texts] if params.data.is_synthetic else None
    gathered = gather_columns({
        "step": [step] * len(idx), "query": queries, "response": responses, "score": scores,
        "query_tokens": [len(q) for q in query_tensors], "response_tokens": [len(r) for r in response_ids],
        "ends_with_eos": [bool(len(r)) and int(r[-1]) == tokenizer.eos_token_id for r in response_ids],
        "response_ids": [r.tolist() for r in response_ids],
    } | ({"gold": gold} if gold else {}), trainer.accelerator)
    return stats | seconds, rollout_table(gathered, stats["objective/kl_dist"])


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


def summary(tables: StepTables, start: int) -> str:
    """The stage's line: steps, where it resumed, the reward's first and last step, the last KL."""
    first, last = tables.curves[0], tables.curves[-1]
    resumed = f", resumed at step {start}" if start else ""
    kl = "kl not measured (coefficient 0: no reference pass)" if math.isnan(last["kl"]) else f"kl {last['kl']:.2f}"
    n = len(tables.curves)
    stopped = ""
    if tables.stopped:  # watch.on_alert: stop
        stopped = f", stopped at step {tables.stopped['step'] + 1} by an alert ({tables.stopped['reason']})"
    kept = f" (step {tables.best['step'] + 1}'s, the best held-out)" if tables.best else ""
    return f"{n} step{'s' * (n > 1)}{resumed}{stopped}, reward {first['reward_mean']:.2f} -> " \
           f"{last['reward_mean']:.2f}, {kl} -> {PPO_MODEL}{kept}"


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


