"""The params file's sections, one frozen dataclass each (`params.yaml` mirrors them key for key), and the names
the sections' checks share (`SYNTHETIC`, `COLUMNS`). Each field is documented once, here; the whole file is `Params`
(stages/shared/typed_params.py), loaded and checked by `load_params` (stages/shared/params.py), which these names
import from too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

SYNTHETIC = "synthetic"
MIN_TEXTS_FROM_SCRATCH = 500  # SFT texts below which a model trained from scratch learns no language (sft and the
# report say so)
# Each dataset's columns (what data.<name>.columns maps to the source's; synthetic data makes them itself).
COLUMNS = {"sft": ("text",), "pairs": ("prompt", "chosen", "rejected"), "prompts": ("query",)}


@dataclass(frozen=True)
class DatasetSpec:
    source: str
    """"synthetic" (embedded generator), a local .parquet/.jsonl/.json/.csv file, or a Hugging Face dataset id."""
    split: str
    """Split of a Hugging Face dataset; ignored for local files and synthetic data."""
    columns: dict[str, str]
    """Our column -> the source's column, e.g. {query: prompt} renames `prompt` to `query` (as the seed does); sft may
    map {prompt, completion} or {messages} instead of {text}, prompts {messages} instead of {query} (chats:
    stages/shared/chat.py)."""
    n: int | None
    """Rows generated (synthetic) or kept after a seeded shuffle (real data; null keeps all)."""
    keep: list[str] = dataclasses.field(default_factory=list)
    """(prompts) The source's other columns that travel with each prompt, as they are (an answer, an id, nested JSON):
    in every table after prepare's, and for the rewards by name (`scorer`). []: the query alone."""


@dataclass(frozen=True)
class DataParams:
    sft: DatasetSpec
    """SFT rows: text (the loss on all of it), or prompt and completion, or messages (the loss on the completion, the
    last turn)."""
    pairs: DatasetSpec
    """Preference pairs: prompt, chosen, rejected (the RM scores prompt + chosen against prompt + rejected)."""
    prompts: DatasetSpec
    """PPO prompts, one column: query (or messages, chats); split into train and held-out eval."""
    n_eval_prompts: int
    """Distinct prompts held out from PPO (evaluate, the watch), each once, every copy of a prompt on one side; at most
    25% of the distinct prompts (a note says so where this asks for more)."""

    @property
    def is_synthetic(self) -> bool:
        """True when all three datasets come from the embedded generator (then the gold score is known)."""
        return all(spec.source == SYNTHETIC for spec in (self.sft, self.pairs, self.prompts))


@dataclass(frozen=True)
class LoraParams:
    """LoRA adapters (peft) instead of full fine-tuning, in the sft, reward and ppo stages alike. Each stage
    trains a fresh adapter on its starting model and saves the merged model, so every artifact stays a plain
    transformers model; ppo also saves its adapter (data/models/ppo/adapter) and takes its reference policy
    from the same weights with the adapter disabled (one copy of the base model in memory)."""

    r: int
    """Adapter rank."""
    alpha: float
    """Scaling numerator: the update is (alpha / r) * B @ A."""
    dropout: float
    """Dropout on the adapter's input (0 keeps PPO's log-probs deterministic, as ppo.disable_dropout does)."""
    target_modules: list[str] | None
    """Module names to adapt, e.g. [c_attn] (GPT-2) or [q_proj, v_proj] (Llama); null: peft's default for the
    architecture."""


@dataclass(frozen=True)
class ModelParams:
    name_or_path: str | None
    """A causal LM id or local path; null trains a GPT-2 config and a byte-level BPE tokenizer from scratch."""
    vocab_size: int
    """From scratch only: BPE vocabulary size, special tokens included."""
    n_layer: int
    """From scratch only: transformer blocks."""
    n_head: int
    """From scratch only: attention heads."""
    n_embd: int
    """From scratch only: hidden size."""
    n_positions: int
    """From scratch only: context length; query plus response must fit."""
    lora: LoraParams | None
    """null: full fine-tuning; otherwise LoRA adapters (needs the `lora` extra: pip install -e '.[lora]')."""
    mixed_precision: Literal["auto", "bf16", "fp16"] | None
    """sft, reward and ppo compute in this dtype under autocast, over float32 weights (null: float32); auto: bf16 where
    the hardware has it natively, float32 elsewhere (stages/shared/auto.py). ppo takes it as accelerate's."""


@dataclass(frozen=True)
class ChatParams:
    """Prompts in the tokenizer's own chat template (`apply_chat_template(..., add_generation_prompt=True)`), in sft
    and tokenize alike. Chats (a `messages` column) always go through it."""

    template: bool
    """Each query and each SFT prompt (prompt/completion rows) a user turn of the template; `text` rows never."""
    system_prompt: str | None
    """A system turn put first in every templated chat that has none (null: none)."""


@dataclass(frozen=True)
class SFTParams:
    learning_rate: float
    """AdamW peak learning rate (cosine decay after warmup)."""
    num_train_epochs: float
    """Passes over the SFT texts."""
    batch_size: int
    """Texts per optimiser step."""
    max_length: int
    """Tokens kept per text, EOS included."""
    warmup_ratio: float
    """Fraction of the steps spent on linear warmup."""
    weight_decay: float
    """AdamW weight decay."""
    eval_fraction: float
    """Fraction of the texts held out to report eval loss."""


@dataclass(frozen=True)
class RewardParams:
    learning_rate: float
    """AdamW peak learning rate (cosine decay after warmup)."""
    num_train_epochs: float
    """Passes over the training pairs."""
    batch_size: int
    """Pairs per optimiser step."""
    max_length: int
    """Tokens kept per prompt + response; saved as the RM tokenizer's model_max_length."""
    warmup_ratio: float
    """Fraction of the steps spent on linear warmup."""
    eval_fraction: float
    """Fraction of the pairs held out to report pairwise accuracy."""


@dataclass(frozen=True)
class TokenizeParams:
    max_query_tokens: int | None
    """The most tokens a query may have (query plus response must fit the model's context); null: what the SFT
    model's context leaves beside generation.max_new_tokens (`query_token_limit`), which fits any prompts file."""
    truncation: Literal["refuse", "keep_start", "keep_end", "drop"]
    """A query over max_query_tokens: "refuse" (stop, saying how many), "keep_start" / "keep_end" (its first / last
    tokens, maybe cutting a word: the stage says how many), "drop" (left out, counted)."""
    min_query_tokens: int
    """Queries shorter than this (after truncation) are dropped."""


@dataclass(frozen=True)
class ScorerParams:
    source: Literal["reward_model", "pipeline", "callable", "combined"]
    """Reward source of the ppo stage, and what evaluate reports: "reward_model" (data/models/reward), "pipeline",
    "callable" or "combined" (`functions`' weighted sum)."""
    name: str | None
    """pipeline: a text-classification model id or path; callable: "module:function" (list[str] -> list[float])."""
    label: str
    """pipeline only: the label whose raw score (function_to_apply="none") is the reward, as in the seed."""
    batch_size: int
    """Texts per scoring forward pass."""
    input: Literal["query_response", "response"] = "query_response"
    """What the scorer is given: "query_response" (the prompt and the response as one text, as the seed scores and
    the reward model is trained) or "response" (the response alone). Judges and the gold score see both."""
    functions: dict = dataclasses.field(default_factory=dict)
    """source combined: several rewards, weighted and summed, each a metric of its own: name -> {name, weight, and
    source (callable by default; reward_model, pipeline with label)} (stages/shared/scoring.py's `Combined`)."""

    @property
    def title(self) -> str:
        """The scorer in labels: "reward model", "pipeline NAME (LABEL)", "callable module:function", "combined A+B"."""
        return {"reward_model": "reward model", "pipeline": f"pipeline {self.name} ({self.label})",
                "callable": f"callable {self.name}", "combined": "combined " + "+".join(self.functions)}[self.source]


@dataclass(frozen=True)
class GenerationParams:
    """Keyword arguments of `generate()`, for PPO rollouts and evaluation alike."""

    max_new_tokens: int
    """Response length cap."""
    min_length: int
    """-1 as in the seed: no minimum, EOS may come at any time."""
    do_sample: bool
    """Sample (true) or decode greedily."""
    top_k: int
    """0 disables top-k filtering (the seed's setting; filtering biases the KL estimate)."""
    top_p: float
    """1.0 disables nucleus filtering."""
    temperature: float
    """Softmax temperature."""
    cache_implementation: Literal["auto", "dynamic", "static"]
    """transformers' KV cache: dynamic (grows token by token) or static (preallocated; with a model in its own bf16
    weights, e.g. a rollout copy, transformers compiles the decoding step on a GPU); auto: static on a GPU only."""


@dataclass(frozen=True)
class EvaluateParams:
    n_prompts: int | None
    """Held-out prompts evaluated (null: all of them)."""
    batch_size: int
    """Prompts per generation and scoring batch."""
    judges: dict[str, str]
    """Scorers the policy never trained on, reported beside `scorer`'s: name -> "module:function" (list[str] ->
    list[float]), each a metric and a samples column of that name. `gold` is the gold score: with the synthetic data
    its lexicon's (no judge may take the name there), with data of your own a judge's of that name."""
    samples_per_prompt: int
    """Sampled responses per prompt and policy for the accuracy table (pass@k's n; 1: none beyond the one above)."""
    pass_at_k: list[int]
    """The k of pass@k, each <= samples_per_prompt ([]: none). With one, or n > 1, metrics.json's `accuracy` group:
    per reward, each policy's mean, greedy accuracy and pass@k (Chen et al. 2021), and PPO - SFT's paired SEs."""
    success_threshold: float | None
    """A reward >= this is a pass (accuracy, pass@k); null: a reward must be 0 or 1 (else one line, evaluate stops)."""
    base: Literal["sampled", "greedy", "none"] = "sampled"
    """The pretrained model in the accuracy table, where `model.name_or_path` names one: its sampled and greedy
    responses (sampled, as SFT's and PPO's), its greedy ones only (greedy: a fifth of the cost with 4 samples), or
    none."""


@dataclass(frozen=True)
class AlertParams:
    """The run doctor's limits, checked on every ppo step (stages/ppo/watch.py); each crossed is an alert. The defaults
    leave the default run quiet and fire on its 100x learning rate at the first steps (docs/pipeline.md, "Watching a
    run")."""

    entropy_ratio: float
    """The responses' entropy (sum over tokens) below this share of the first step's: the policy collapses onto a few
    samples (entropy collapse, Cui et al. 2025)."""
    kl_per_token: float
    """The KL to the reference per response token (nats) above this: the policy left the reference's neighbourhood
    (the default run peaks at 0.44)."""
    approxkl: float
    """PPO's approximate KL between the rollout and the updated policy above this (Spinning Up's target_kl is
    0.01-0.05; the default run, 4 epochs a step, peaks at 0.28)."""
    ratio_mean: float
    """The mean probability ratio of the updates above this (TRL's ratio_threshold skips at 10)."""
    clipfrac: float
    """The share of clipped tokens above this (PPO clips a minority by design; the default run peaks at 0.23)."""
    value_loss_growth: float
    """The value loss above this multiple of the first step's: the critic diverges."""
    length_ratio: float
    """The mean response length below this share of the first step's: responses collapse."""
    truncated_share: float
    """The share of responses cut at generation.max_new_tokens (no EOS) above this."""


@dataclass(frozen=True)
class WatchParams:
    """The ppo stage watching its run (stages/ppo/watch.py): a held-out evaluation every few steps, the policy it keeps,
    and the run doctor."""

    eval_every: int
    """A held-out evaluation every N ppo steps and after the last one (0: none): the scorer's mean, the gold score and
    the judges where there are, KL to SFT, response length, in data/ppo/eval.csv. Its sampling has a random stream of
    its own: the run trains the same bytes with it on or off."""
    eval_prompts: int
    """The first N held-out prompts (data/tokenized/eval.parquet), the same at every evaluation."""
    keep: Literal["last", "best"]
    """data/models/ppo: the last step's policy, or the best by `best_by` at a held-out evaluation."""
    best_by: str
    """The held-out metric that ranks policies for keep: best: reward (the scorer's), gold, or a judge's name."""
    kl_price: float
    """keep: best ranks by best_by - kl_price x the KL to SFT (0: best_by alone)."""
    on_alert: Literal["warn", "stop"]
    """An alert of the doctor: warn (one line, the run goes on) or stop (the run ends at that step and publishes what
    it has, exit 0 with the reason)."""
    alerts: AlertParams


@dataclass(frozen=True)
class CheckpointParams:
    """Resumable state of the training stages (sft, reward, ppo), kept in data/checkpoints/<stage>.

    A rerun after a crash or a kill resumes from the last complete checkpoint and ends with the same
    artifacts as an uninterrupted run. sft, reward and ppo track in dvc.yaml the keys of it they read (a stage reads
    only params it tracks), and report the whole section (its page lists the params): a change reruns them, and
    their outputs stay the same.
    """

    ppo_every: int
    """ppo: save the whole PPO state every N `step()` calls (and after the last one); 0: no checkpoints."""
    trainer_every: int
    """sft, reward: save a transformers.Trainer checkpoint every N optimiser steps; 0: no checkpoints."""
    on_mismatch: Literal["restart", "stop"]
    """A checkpoint written with other params or inputs: "restart" (say so, discard it) or "stop" (exit 2)."""


@dataclass(frozen=True)
class NumericsParams:
    """The float kernels of the CPU stages (stages/shared/numerics.py), set before torch loads: what decides whether
    another machine computes the same bytes. Tracked by the stages that compute in floating point."""

    kernels: Literal["portable", "native"]
    """portable: MKL's COMPATIBLE branch and ATen's and oneDNN's AVX2 kernels, the same bytes on any x86-64 CPU with
    AVX2 (the committed dvc.lock's); native: the kernels the CPU picks (AVX-512, MKL's vendor branch), faster, with
    bytes only the same kind of CPU reproduces."""
    threads: int | None
    """CPU threads per stage process (parallel sums split by it, so it decides bytes too); null: torch's default, the
    number of cores."""
