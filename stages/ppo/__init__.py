"""ppo: the seed's loop on ppo_core (generate, score, `step()`), ceil(ppo.steps / ppo.batch_size) times.

The stage reads the tokenized prompts and the SFT model, checks what can be checked before the models load, and runs
the loop (``loop``: the trainer, the scorer of `scorer.source` and one step) while ``watch`` evaluates held-out
prompts and raises alerts. Each step's rollouts and stats go to the run's work in progress (``tables``), every
`checkpoint.ppo_every` steps the whole state is checkpointed, and a finished run publishes its artifacts and deletes
its state (``checkpoints``); a rerun of an interrupted run with the same params, inputs and code resumes from its
checkpoint and ends with the same artifacts."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from transformers import AutoTokenizer

from ppo_core import set_seed
from ppo_core.config import PPOConfig, RunSizes
from stages.ppo.checkpoints import publish, record, resume_run, save_run_checkpoint
from stages.ppo.loop import build_loop, one_step, query_batches, warn_if_flat_groups, warn_if_large_scores
from stages.ppo.tables import StepTables
from stages.ppo.watch import watch_step
from stages.shared.artifacts import (
    PPO_MODEL,
    SFT_MODEL,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
    check_tokenized_with,
    read_prompts,
    require_dir,
)
from stages.shared.checks import defaulted_ppo_keys
from stages.shared.heldout import heldout_words, training_prompts_among, travelling_columns
from stages.shared.models import check_mixed_precision, is_encoder_decoder, model_context
from stages.shared.params import Params
from stages.shared.runtime import Progress, StageError, note, process_state, warning
from stages.shared.scoring import judge_functions


def run(params: Params, root: Path = Path(".")) -> str:
    """Check what can be checked before the models load, build the loop, resume it if a checkpoint of the same run
    is there, run its steps (recording each, checkpointing some) and publish; returns the summary line."""
    check_mixed_precision(params, "ppo")
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
    loop = build_loop(params, config, prompts, tokenizer, seq2seq, root,
                      travelling_columns(root / TOKENIZED_TRAIN, params.data.prompts.keep))
    trainer = loop.trainer
    rank, main = trainer.accelerator.process_index, trainer.accelerator.is_main_process
    batches = query_batches(len(prompts), sizes.global_batch_size, params.seed, sizes.num_generations)
    heldout = heldout_prompts(params, root, prompts["query"], main)  # watch.eval_every: evaluated during the run
    judges = judge_functions(params) if heldout is not None else {}
    start, tables = resume_run(trainer, params, root)
    if heldout is not None:  # what the watch's figures are over, in data/ppo/metrics.json
        tables.heldout = {"prompts": len(heldout), "in_train": training_prompts_among(heldout["query"],
                                                                                       prompts["query"])}
    for _ in range(start):  # the data position: the batches the checkpointed steps consumed
        next(batches)
    total = config.total_ppo_epochs
    progress = Progress("ppo", total, start=start, main=main)  # step i/N, ETA, the last step's reward and KL
    warned_flat = warned_scale = False
    for step in range(start, total):
        idx = next(batches)[rank * sizes.batch_size:(rank + 1) * sizes.batch_size]  # this process's share
        stats, rollouts = one_step(loop, step, idx, root)
        tables.append(step, stats, rollouts["score"], rollouts.get("gold"))  # time/*: timings.csv
        progress.update(step + 1, reward=tables.curves[-1]["reward_mean"], kl=tables.curves[-1]["kl"])
        warned_flat = warned_flat or warn_if_flat_groups(stats, step, main, config.resolved.dynamic_sampling)
        warned_scale = warned_scale or warn_if_large_scores(rollouts["score"], step, main, config)
        stop = watch_step(loop, step, total, stats, rollouts, tables, heldout, judges, params.watch, root, main)
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


def heldout_prompts(params: Params, root: Path, training, main: bool = True):
    """The first `watch.eval_prompts` held-out prompts, tokenized by the SFT model's tokenizer, or None without
    held-out evaluation (watch.eval_every 0); a `warning:` where some are among the ``training`` queries (none are:
    prepare splits by distinct prompt)."""
    if params.watch.eval_every == 0:
        return None
    check_tokenized_with(root / TOKENIZED_EVAL, root / SFT_MODEL)
    prompts = read_prompts(root / TOKENIZED_EVAL)
    if params.watch.eval_prompts > len(prompts):
        note(f"ppo: watch.eval_prompts is {params.watch.eval_prompts}, but {TOKENIZED_EVAL} holds {len(prompts)} "
             f"held-out prompts: each held-out evaluation uses all {len(prompts)}")
    prompts = prompts.head(params.watch.eval_prompts)
    for name, values in travelling_columns(root / TOKENIZED_EVAL, params.data.prompts.keep).items():
        prompts[name] = pd.Series(values[:len(prompts)], dtype=object, index=prompts.index)  # for the rewards
    in_train = training_prompts_among(prompts["query"], training)
    if main and in_train:  # none by construction (data/ppo/metrics.json's `heldout` says so): said only otherwise
        warning(f"ppo: watching {heldout_words(len(prompts), in_train)}: their figures are not held-out ones")
    return prompts


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


def summary(tables: StepTables, start: int) -> str:
    """The stage's line: steps, where it resumed, the reward of the first and the last training batch and the last
    one's KL, said to be those (not the held-out figures evaluate reports, which they would otherwise be read as)."""
    first, last = tables.curves[0], tables.curves[-1]
    resumed = f", resumed at step {start}" if start else ""
    kl = "kl not measured (coefficient 0: no reference pass)" if math.isnan(last["kl"]) else f"kl {last['kl']:.2f}"
    n = len(tables.curves)
    stopped = ""
    if tables.stopped:  # watch.on_alert: stop
        stopped = f", stopped at step {tables.stopped['step'] + 1} by an alert ({tables.stopped['reason']})"
    kept = f" (step {tables.best['step'] + 1}'s, the best held-out)" if tables.best else ""
    return f"{n} step{'s' * (n > 1)}{resumed}{stopped}, reward {first['reward_mean']:.2f} -> " \
           f"{last['reward_mean']:.2f}, {kl} (training batches: step {first['step'] + 1}'s -> step " \
           f"{last['step'] + 1}'s; held-out: evaluate) -> {PPO_MODEL}{kept}"
