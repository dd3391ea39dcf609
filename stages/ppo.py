"""ppo: the seed's loop on ppo_core (generate, score, `step()`), ceil(ppo.steps / ppo.batch_size) times.

The reward source is `scorer.source` (see stages/scoring.py). The run works in data/checkpoints/ppo (not a DVC
output, see stages/resume.py): each step writes its rollouts there (rollouts/step-NNNNN.parquet) and rewrites the
stats table (one row of all `step()` stats per step, but the wall-clock `time/*` ones, which go to timings.csv so
that every other artifact is byte-identical across runs) and the curves for `dvc plots`, so a run in progress (or
one that failed) can be inspected; every `checkpoint.ppo_every` steps the whole training state goes to the
directory state/ beside them (ppo_core's checkpoint; under DeepSpeed with every process's shards). Only a finished run
publishes its artifacts (data/ppo/*, data/models/ppo; the timings to data/logs/ppo, outside DVC's hashes) and then
deletes its resumable state: a failed run leaves no artifact, a finished one no state. A rerun of an interrupted
run with the same params, inputs and code resumes from the checkpoint and ends with the same artifacts.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ppo_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOTrainer
from stages.common import (PPO_CHECKPOINTS, PPO_CURVES, PPO_METRICS, PPO_MODEL, PPO_ROLLOUTS, PPO_STATS, PPO_TIMINGS,
                           REWARD_MODEL, SFT_MODEL, TOKENIZED_TRAIN, atomic_path, fresh_dir, is_encoder_decoder,
                           lora_config, model_context, note, process_state, read_table, remove_stale_temporaries,
                           require_dir, seed_everything, StageError, write_csv, write_json, write_parquet)
from stages.params import Params, ppo_config
from stages.resume import discard, fingerprint, open_checkpoint_dir
from stages.scoring import build_scorer, checked_scores, scorer_origin
from stages.synthetic import gold_score

# The run in progress, inside the checkpoint directory: published to data/ppo only when the run has finished.
WORK_ROLLOUTS = PPO_CHECKPOINTS / "rollouts"
WORK_TABLES = {PPO_STATS: PPO_CHECKPOINTS / PPO_STATS.name, PPO_TIMINGS: PPO_CHECKPOINTS / PPO_TIMINGS.name,
               PPO_CURVES: PPO_CHECKPOINTS / PPO_CURVES.name}

# curves.csv column -> step() stats key (plus reward_mean and gold_mean, computed from the raw scores)
CURVES = {"kl": "objective/kl", "kl_coef": "objective/kl_coef", "entropy": "objective/entropy",
          "loss_value": "ppo/loss/value", "loss_policy": "ppo/loss/policy", "clipfrac": "ppo/policy/clipfrac",
          "approxkl": "ppo/policy/approxkl", "response_len": "tokens/responses_len_mean"}


# The params, inputs and code this stage tracks in dvc.yaml (a test keeps the lists equal): a checkpoint is
# reused only for the same ones.
TRACKED = ("seed", "data.sft.source", "data.pairs.source", "data.prompts.source", "model.lora", "scorer", "generation",
           "ppo", "checkpoint.ppo_every", "checkpoint.on_mismatch")
INPUTS = (TOKENIZED_TRAIN, SFT_MODEL, REWARD_MODEL)
CODE = ("stages/ppo.py", "stages/resume.py", "stages/scoring.py", "stages/synthetic.py", "stages/common.py",
        "stages/params.py", "ppo_core", "rewards")


def run(params: Params, root: Path = Path(".")) -> str:
    seed_everything(params.seed)
    config = ppo_config(params)
    prompts = read_table(root / TOKENIZED_TRAIN, ["query", "input_ids"])
    world = process_state().num_processes  # under `accelerate launch`: ppo.batch_size is per process, as in the seed
    if len(prompts) < config.batch_size * world:
        raise StageError(f"{TOKENIZED_TRAIN}: {len(prompts)} prompts, fewer than ppo.batch_size={config.batch_size} "
                         f"x {world} processes; lower ppo.batch_size in {params.path} or give more prompts")
    tokenizer = AutoTokenizer.from_pretrained(require_dir(root / SFT_MODEL))
    seq2seq, lora = is_encoder_decoder(root / SFT_MODEL), params.model.lora
    longest, context = max(map(len, prompts["input_ids"])), model_context(root / SFT_MODEL)
    new_tokens = params.generation.max_new_tokens
    # a decoder-only model holds query and response in one context; an encoder-decoder each in its own
    if (max(longest, new_tokens) if seq2seq else longest + new_tokens) > context:
        raise StageError(f"{TOKENIZED_TRAIN}: a {longest}-token query and generation.max_new_tokens={new_tokens} "
                         f"do not fit the {context}-token context of {SFT_MODEL}; lower one of them "
                         f"(tokenize.max_query_tokens) in {params.path}")
    policy_class = AutoModelForSeq2SeqLMWithValueHead if seq2seq else AutoModelForCausalLMWithValueHead
    adapter = {"peft_config": lora_config(lora, "SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM")} if lora else {}
    model = policy_class.from_pretrained(root / SFT_MODEL, **adapter)
    score = build_scorer(params, root)  # before the trainer: under ZeRO-3, models built after it come out sharded
    # reference: a frozen copy of SFT, or with LoRA the same weights with the adapter disabled
    trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)
    generation = {**dataclasses.asdict(params.generation), "pad_token_id": tokenizer.pad_token_id,
                  "eos_token_id": tokenizer.eos_token_id}
    rank, main = trainer.accelerator.process_index, trainer.accelerator.is_main_process
    batches = query_batches(len(prompts), config.global_batch_size, params.seed)  # global batches
    start, tables = resume(trainer, params, root)
    for _ in range(start):  # the data position: the batches the checkpointed steps consumed
        next(batches)
    total = config.total_ppo_epochs
    progress = tqdm(range(start, total), desc="ppo", unit="step", initial=start, total=total, disable=not main or None)
    for step in progress:
        idx = next(batches)[rank * config.batch_size:(rank + 1) * config.batch_size]  # this process's share
        query_tensors = [torch.tensor(prompts["input_ids"][i]) for i in idx]
        queries = [prompts["query"][i] for i in idx]
        # 1. rollout
        response_tensors = trainer.generate(query_tensors, batch_size=len(idx), return_prompt=False, **generation)
        responses = tokenizer.batch_decode(response_tensors, skip_special_tokens=True)
        # 2. score
        texts = [q + r for q, r in zip(queries, responses)]
        scores = checked_scores(score(texts), len(texts), params, step)
        # 3. optimise
        try:
            stats = trainer.step(query_tensors, response_tensors, [torch.tensor(s, dtype=torch.float) for s in scores])
        except FloatingPointError as err:  # raised before the update: the last checkpoint is intact
            raise StageError(f"{err}; the checkpoint in {root / PPO_CHECKPOINTS} (if any) is intact and a rerun "
                             "resumes from it") from None
        # 4. record: every process's rollouts, in process order (as step() gathers its per-sample stats)
        gold = [gold_score(t) for t in texts] if params.data.is_synthetic else None
        rollouts = gather_columns({
            "step": [step] * len(idx), "query": queries, "response": responses, "score": scores,
            "kl": [0.0] * len(idx),  # filled below from the gathered stats
            "query_tokens": [len(q) for q in query_tensors], "response_tokens": [len(r) for r in response_tensors],
            "ends_with_eos": [bool(len(r)) and int(r[-1]) == tokenizer.eos_token_id for r in response_tensors],
            "response_ids": [r.tolist() for r in response_tensors],
        } | ({"gold": gold} if gold else {}), trainer.accelerator)
        rollouts["kl"] = np.asarray(stats["objective/kl_dist"], dtype=float).tolist()
        tables.append(step, stats, rollouts["score"], rollouts.get("gold"))
        if main:  # only the main process writes
            write_parquet(rollouts, root / WORK_ROLLOUTS / rollout_file(step))
            tables.write({final: root / work for final, work in WORK_TABLES.items()})
        # 5. checkpoint: after the step's artifacts, so a resumed run never redoes a step it has written
        every = params.checkpoint.ppo_every
        if every and ((step + 1) % every == 0 or step + 1 == total):
            trainer.save_checkpoint(str(root / PPO_CHECKPOINTS / STATE),
                                    extra={"step": step + 1, "tables": tables.state()})
    first, last = tables.curves[0], tables.curves[-1]
    if main:  # the run has finished: publish its artifacts
        with atomic_path(root / PPO_ROLLOUTS) as tmp:
            shutil.copytree(root / WORK_ROLLOUTS, tmp)
        tables.write({final: root / final for final in WORK_TABLES})
    with trainer.whole_policy() as policy:  # every process: under ZeRO-3 each holds a shard of the weights
        if main:
            save_policy(root / PPO_MODEL, policy, tokenizer)
    if main:
        write_json({"steps": len(tables.curves)} | {f"final_{k}": v for k, v in last.items() if k != "step"},
                   root / PPO_METRICS)
    trainer.accelerator.wait_for_everyone()
    if main:  # published: the run is finished, and a rerun trains from the start
        discard(root / PPO_CHECKPOINTS)
    resumed = f", resumed at step {start}" if start else ""
    return (f"{len(tables.curves)} steps{resumed}, reward {first['reward_mean']:.2f} -> {last['reward_mean']:.2f}, "
            f"kl {last['kl']:.2f} -> {PPO_MODEL}")


STATE = "state"  # the trainer's checkpoint directory (ppo_core's format, with or without DeepSpeed)


def save_policy(path: Path, policy, tokenizer) -> None:
    """The policy as a plain transformers model (LoRA merged in), its value head, and with LoRA the adapter
    alone in `adapter/` (loadable with peft on the SFT model), atomically."""
    with atomic_path(path) as tmp:
        policy.save_pretrained(tmp, merge_adapter=policy.is_peft_model)
        if policy.is_peft_model:
            policy.save_pretrained(tmp / "adapter")
        tokenizer.save_pretrained(tmp)


def rollout_file(step: int) -> str:
    return f"step-{step:05d}.parquet"


def resume(trainer: PPOTrainer, params: Params, root: Path) -> tuple[int, StepTables]:
    """Restore the last checkpoint of a run with the same params, inputs and code, if there is one: the trainer's
    whole state (every process), the per-step tables and the rollout files of the steps it covers (later ones
    are removed). Returns (the first step to run, the tables); (0, empty tables) for a fresh run."""
    accelerator = trainer.accelerator
    directory, rollouts = root / PPO_CHECKPOINTS, root / WORK_ROLLOUTS
    state = directory / STATE
    expected = fingerprint(params, TRACKED, INPUTS if params.scorer.source == "reward_model" else INPUTS[:2], root,
                           CODE)
    for kind, entries in scorer_origin(params).items():  # the user's reward code, or its package's version
        expected[kind] |= entries
    if accelerator.is_main_process:  # the main process owns the files; the others wait for its decision
        remove_stale_temporaries(directory, rollouts, root / PPO_ROLLOUTS.parent, root / PPO_MODEL.parent,
                                 root / PPO_TIMINGS.parent)
        if not open_checkpoint_dir(directory, expected, params, "ppo") or not state.exists():
            fresh_dir(rollouts)
            for work in WORK_TABLES.values():
                (root / work).unlink(missing_ok=True)
    accelerator.wait_for_everyone()
    if not state.exists():
        return 0, StepTables()
    try:
        extra = trainer.load_checkpoint(str(state))
    except ValueError as err:  # unreadable, or written by another number of processes or ZeRO stage
        raise StageError(str(err)) from None
    start = extra["step"]
    if accelerator.is_main_process:
        missing = [rollout_file(s) for s in range(start) if not (rollouts / rollout_file(s)).exists()]
        if missing:
            raise StageError(f"{rollouts}: {missing[0]} of the steps checkpointed in {directory} is missing; "
                             f"delete {directory} to start fresh")
        for path in rollouts.glob("step-*.parquet"):
            if path.name >= rollout_file(start):
                path.unlink()  # written after the checkpoint: the resumed run writes it again
        note(f"ppo: resuming from {state} at step {start}")
    return start, StepTables.from_state(extra["tables"])


def gather_columns(columns: dict[str, list], accelerator) -> dict[str, list]:
    """Each process's equal-length columns, concatenated in process order; the columns themselves on one."""
    if accelerator.num_processes == 1:
        return columns
    parts = gather_object([columns])  # one dict per process
    return {key: [value for part in parts for value in part[key]] for key in columns}


class StepTables:
    """The per-step tables: stats.parquet (every step() stat but the wall-clock `time/*` ones), timings.csv (those),
    curves.csv. Rewritten (atomically) in the checkpoint directory after each step, and published at the end."""

    def __init__(self):
        self.stats: list[dict] = []
        self.timings: list[dict] = []
        self.curves: list[dict] = []

    def append(self, step: int, stats: dict, scores: list[float], gold: list[float] | None) -> None:
        keys = sorted(stats)
        self.stats.append({"step": step} | {k: to_python(stats[k]) for k in keys if not k.startswith("time/")})
        self.timings.append({"step": step} | {k: float(stats[k]) for k in keys if k.startswith("time/")})
        self.curves.append({"step": step, "reward_mean": float(np.mean(scores))}
                           | ({"gold_mean": float(np.mean(gold))} if gold else {})
                           | {name: float(stats[key]) for name, key in CURVES.items()})

    def write(self, paths: dict[Path, Path]) -> None:
        """Write each table to `paths[its final path]` (the final path itself, or the working copy)."""
        write_parquet({key: [row[key] for row in self.stats] for key in self.stats[0]}, paths[PPO_STATS])
        write_csv(self.timings, paths[PPO_TIMINGS])
        write_csv(self.curves, paths[PPO_CURVES])

    def state(self) -> dict[str, list[dict]]:
        """The rows so far, for a checkpoint (plain Python values)."""
        return {"stats": self.stats, "timings": self.timings, "curves": self.curves}

    @classmethod
    def from_state(cls, state: dict[str, list[dict]]) -> StepTables:
        tables = cls()
        tables.stats, tables.timings, tables.curves = state["stats"], state["timings"], state["curves"]
        return tables


def query_batches(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of row indices: a seeded shuffle per epoch, the last incomplete batch dropped."""
    rng = random.Random(f"{seed}-ppo")
    while True:
        order = list(range(n))
        rng.shuffle(order)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start:start + batch_size]


def to_python(value):
    """A step() stat as a Parquet-friendly value: a float, or a list of floats for histograms."""
    array = np.asarray(value, dtype=float)
    return float(array) if array.ndim == 0 else array.ravel().tolist()
