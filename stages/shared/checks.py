"""The params' checks beyond their types: ranges and agreement across sections (``check_values``, at load), a group
estimator's sampling (``check_group_sampling``), and the `ppo` keys a file leaves to PPOConfig's defaults
(``defaulted_ppo_keys``). A problem is a ConfigError or ParamsError naming the file and key, as everywhere in the
params. The `ppo` section itself becomes a PPOConfig in ``Params.ppo_config`` (stages/shared/typed_params.py)."""

from __future__ import annotations

from typing import Any

from ppo_core.algo.registry import get_estimator
from ppo_core.fields import check_range
from stages.shared.param_sections import COLUMNS, SYNTHETIC, GenerationParams
from stages.shared.runtime import ParamsError
from stages.shared.typed_params import PIPELINE_LABELS, Params

# Columns of the tokenized prompts, the rollouts and evaluate's samples, and the names a reward function is called with:
# a kept prompts column must not take one (stages/ppo/tables.py's ROLLOUT_COLUMNS; stages/shared/scoring.py)
RESERVED_COLUMNS = ("query", "input_ids", "step", "response", "score", "kl", "query_tokens", "response_tokens",
                    "ends_with_eos", "response_ids", "gold", "policy", "kl_to_sft", "prompts", "completions",
                    "completion_ids", "trainer_state")
# data/eval/metrics.json's own keys
RESERVED_METRICS = ("win_rate", "reward", "kl", "length", "sft", "heldout", "accuracy")
MIN_VOCAB = 256 + 2  # a tokenizer trained from scratch: every byte, plus EOS and PAD (stages/sft.py)


def defaulted_ppo_keys(params: Params) -> dict[str, Any]:
    """The `ppo` keys the file leaves out, each with the PPOConfig default the run takes instead (the keys the
    pipeline fills itself, and the derived ones, aside)."""
    from ppo_core.config import SETTABLE

    filled = {"seed", "max_completion_length", "temperature", *PIPELINE_LABELS}
    config = params.ppo_config
    return {key: getattr(config, key) for key in SETTABLE if key not in params.ppo and key not in filled}


def check_values(p: Params) -> None:
    """Range and cross-section checks, done once at load (a ConfigError names the first that fails)."""
    check_range("seed", p.seed, ">= 0", p.seed >= 0)  # before the ppo section, whose seed defaults to it
    for key, value in positive_values(p).items():
        check_range(key, value, "> 0", value > 0)
    checks = [*range_checks(p), *generation_checks(p.generation), *judge_checks(p), *watch_checks(p),
              *reward_function_checks(p)]
    if p.model.name_or_path is None:
        checks += scratch_model_checks(p)
    for key, value, expected, ok in checks:
        check_range(key, value, expected, ok)


def check_group_sampling(p: Params, config) -> None:
    """A group estimator with greedy decoding: every sample of a prompt the same, every advantage 0."""
    if get_estimator(config.advantage_estimator).needs_groups and not p.generation.do_sample:
        raise ParamsError(f"{p.path}: generation.do_sample is false, but ppo.advantage_estimator "
                          f"{config.advantage_estimator} compares ppo.num_generations={config.num_generations} samples "
                          "of each prompt: greedy decoding makes them identical (every advantage 0); set "
                          "generation.do_sample: true")


# scorer.functions' entries: each key and what it must be
REWARD_FUNCTION_KEYS = {"name": "a 'module:function' (callable), a model (pipeline), or null (reward_model)",
                        "weight": "a number", "source": "reward_model, pipeline or callable", "label": "a label"}


def reward_function_checks(p: Params) -> list[tuple[str, Any, str, bool]]:
    """scorer.functions: set exactly with scorer.source combined, each entry a mapping of `REWARD_FUNCTION_KEYS` (a
    name, a weight), under a name no metric of evaluate's has."""
    spec, out = p.scorer, []
    combined = spec.source == "combined"
    out.append(("scorer.functions", spec.functions, "a mapping of reward names to {name, weight} with scorer.source "
                "combined, and {} otherwise", bool(spec.functions) == combined))
    out.append(("scorer.name", spec.name, "null with scorer.source combined (its functions name theirs)",
                not combined or spec.name is None))
    for name, entry in spec.functions.items():
        key = f"scorer.functions.{name}"
        ok = isinstance(entry, dict) and set(entry) <= set(REWARD_FUNCTION_KEYS)
        out.append((key, entry, f"a mapping with keys among {list(REWARD_FUNCTION_KEYS)}", ok))
        if not ok:
            continue
        source = entry.get("source", "callable")
        out += [(f"{key}.source", source, REWARD_FUNCTION_KEYS["source"], source in ("reward_model", "pipeline",
                                                                                      "callable")),
                (f"{key}.weight", entry.get("weight", 1.0), "a number",
                 isinstance(entry.get("weight", 1.0), (int, float)) and not isinstance(entry.get("weight"), bool)),
                (f"{key}.name", entry.get("name"), "a 'module:function'", source != "callable" or
                 ":" in str(entry.get("name") or "")),
                ("scorer.functions", name, f"names other than {list(RESERVED_METRICS)}", name not in RESERVED_METRICS)]
    return out


def positive_values(p: Params) -> dict[str, Any]:
    """The sizes and rates that must be > 0, by key."""
    return {
        "model.vocab_size": p.model.vocab_size, "model.n_layer": p.model.n_layer, "model.n_head": p.model.n_head,
        "model.n_embd": p.model.n_embd, "model.n_positions": p.model.n_positions,
        "sft.learning_rate": p.sft.learning_rate, "sft.num_train_epochs": p.sft.num_train_epochs,
        "sft.batch_size": p.sft.batch_size, "sft.max_length": p.sft.max_length,
        "reward.learning_rate": p.reward.learning_rate, "reward.num_train_epochs": p.reward.num_train_epochs,
        "reward.batch_size": p.reward.batch_size, "reward.max_length": p.reward.max_length,
        "scorer.batch_size": p.scorer.batch_size,
        "generation.max_new_tokens": p.generation.max_new_tokens, "evaluate.batch_size": p.evaluate.batch_size,
    }


def range_checks(p: Params) -> list[tuple[str, Any, str, bool]]:
    """(key, value, what it must be, whether it is) for the data, training, tokenize, scorer, LoRA and checkpoint
    keys."""
    lora = p.model.lora
    return [
        ("data.n_eval_prompts", p.data.n_eval_prompts, ">= 1", p.data.n_eval_prompts >= 1),
        *((f"data.{name}.n", spec.n, "null or >= 1", spec.n is None or spec.n >= 1)
          for name, spec in (("sft", p.data.sft), ("pairs", p.data.pairs), ("prompts", p.data.prompts))),
        ("sft.weight_decay", p.sft.weight_decay, ">= 0", p.sft.weight_decay >= 0),
        ("sft.eval_fraction", p.sft.eval_fraction, "in (0, 1)", 0 < p.sft.eval_fraction < 1),
        ("reward.eval_fraction", p.reward.eval_fraction, "in (0, 1)", 0 < p.reward.eval_fraction < 1),
        ("sft.warmup_ratio", p.sft.warmup_ratio, "in [0, 1)", 0 <= p.sft.warmup_ratio < 1),
        ("reward.warmup_ratio", p.reward.warmup_ratio, "in [0, 1)", 0 <= p.reward.warmup_ratio < 1),
        ("tokenize.min_query_tokens", p.tokenize.min_query_tokens, ">= 1", p.tokenize.min_query_tokens >= 1),
        ("tokenize.max_query_tokens", p.tokenize.max_query_tokens, "null (what the model's context leaves) or > 0",
         p.tokenize.max_query_tokens is None or p.tokenize.max_query_tokens > 0),
        ("tokenize.min_query_tokens", p.tokenize.min_query_tokens, "<= tokenize.max_query_tokens",
         p.tokenize.max_query_tokens is None or p.tokenize.min_query_tokens <= p.tokenize.max_query_tokens),
        ("scorer.name", p.scorer.name, f"set for scorer.source {p.scorer.source}",
         p.scorer.source in ("reward_model", "combined") or bool(p.scorer.name)),
        ("scorer.name", p.scorer.name, "a 'module:function' with scorer.source callable",
         p.scorer.source != "callable" or not p.scorer.name or p.scorer.name.partition(":")[2] != ""),
        ("scorer.name", p.scorer.name, "null with scorer.source reward_model (the reward stage's model scores; a "
         "function goes with scorer.source: callable, a classifier with pipeline)",
         p.scorer.source != "reward_model" or p.scorer.name is None),
        *((f"data.{name}.keep", spec.keep, "[] (only the prompts keep columns of their source)", not spec.keep)
          for name, spec in (("sft", p.data.sft), ("pairs", p.data.pairs))),
        ("data.prompts.keep", p.data.prompts.keep, f"[] with data.prompts.source {SYNTHETIC} (its prompts have no "
         "other column)", p.data.prompts.source != SYNTHETIC or not p.data.prompts.keep),
        ("data.prompts.keep", p.data.prompts.keep, f"names other than the pipeline's own columns "
         f"{list(RESERVED_COLUMNS)}", not set(p.data.prompts.keep) & set(RESERVED_COLUMNS)),
        ("data.prompts.keep", p.data.prompts.keep, "names other than 'messages' with chat prompts (their chats travel "
         "under that name)", "messages" not in p.data.prompts.columns or "messages" not in p.data.prompts.keep),
        ("data.prompts.keep", p.data.prompts.keep, "names without repeats",
         len(set(p.data.prompts.keep)) == len(p.data.prompts.keep)),
        *((f"data.{name}.columns", spec.columns, f"{{{', '.join(f'{c}: {c}' for c in COLUMNS[name])}}} with "
           f"data.{name}.source {SYNTHETIC} (it makes its own columns)",
           spec.source != SYNTHETIC or spec.columns == {c: c for c in COLUMNS[name]})
          for name, spec in (("sft", p.data.sft), ("pairs", p.data.pairs), ("prompts", p.data.prompts))),
        ("model.lora.r", lora and lora.r, ">= 1", lora is None or lora.r >= 1),
        ("model.lora.alpha", lora and lora.alpha, "> 0", lora is None or lora.alpha > 0),
        ("model.lora.dropout", lora and lora.dropout, "in [0, 1)", lora is None or 0 <= lora.dropout < 1),
        ("checkpoint.ppo_every", p.checkpoint.ppo_every, ">= 0 (0: no checkpoints)", p.checkpoint.ppo_every >= 0),
        ("checkpoint.trainer_every", p.checkpoint.trainer_every, ">= 0 (0: no checkpoints)",
         p.checkpoint.trainer_every >= 0),
        ("numerics.threads", p.numerics.threads, "null or >= 1", p.numerics.threads is None or p.numerics.threads >= 1),
    ]


def judge_checks(p: Params) -> list[tuple[str, Any, str, bool]]:
    """evaluate's prompt count and judges: 'module:function' each, named apart from the metrics' own keys."""
    return [
        ("evaluate.n_prompts", p.evaluate.n_prompts, "null or >= 1",
         p.evaluate.n_prompts is None or p.evaluate.n_prompts >= 1),
        ("evaluate.samples_per_prompt", p.evaluate.samples_per_prompt, ">= 1", p.evaluate.samples_per_prompt >= 1),
        ("evaluate.pass_at_k", p.evaluate.pass_at_k, f"each in [1, evaluate.samples_per_prompt], here [1, "
         f"{p.evaluate.samples_per_prompt}] (pass@k draws k of a prompt's samples)",
         all(1 <= k <= p.evaluate.samples_per_prompt for k in p.evaluate.pass_at_k)),
        *((f"evaluate.judges.{name}", value, "a 'module:function'", ":" in value and value.partition(":")[2] != "")
          for name, value in p.evaluate.judges.items()),
        *((f"evaluate.judges.{name}", name, f"a name other than {list(RESERVED_METRICS)} (metric names of their own)",
           name not in RESERVED_METRICS) for name in p.evaluate.judges),
        # the synthetic data's gold score is its lexicon's: a judge named gold would replace it without a word
        *((f"evaluate.judges.{name}", name, "a name other than 'gold' with the synthetic data (its gold score, the "
           "lexicon's, is 'gold' already; a judge takes that name with data of your own)",
           name != "gold" or not p.data.is_synthetic) for name in p.evaluate.judges),
    ]


def watch_checks(p: Params) -> list[tuple[str, Any, str, bool]]:
    """The watch section: held-out evaluation, the policy kept and by what, the alerts' thresholds."""
    rankable = [*(f"reward_{name}" for name in p.scorer.functions), *p.evaluate.judges]  # beside reward and gold
    gold = f"gold{' (synthetic data only)' if not p.data.is_synthetic else ''}, "
    return [
        ("watch.eval_every", p.watch.eval_every, ">= 0 (0: no held-out evaluation)", p.watch.eval_every >= 0),
        ("watch.eval_prompts", p.watch.eval_prompts, ">= 1", p.watch.eval_prompts >= 1),
        ("watch.keep", p.watch.keep, "last when watch.eval_every is 0 (best is chosen at a held-out evaluation)",
         p.watch.keep == "last" or p.watch.eval_every > 0),
        ("watch.best_by", p.watch.best_by, f"reward, {gold}reward_NAME of a function of scorer.functions or a judge "
         f"of evaluate.judges ({', '.join(rankable) or 'none'}) with watch.keep: best",
         p.watch.keep != "best" or p.watch.best_by in ("reward", *(["gold"] * p.data.is_synthetic), *rankable)),
        ("watch.kl_price", p.watch.kl_price, ">= 0", p.watch.kl_price >= 0),
        *((f"watch.alerts.{name}", value, "> 0", value > 0) for name, value in vars(p.watch.alerts).items()),
        ("watch.alerts.entropy_ratio", p.watch.alerts.entropy_ratio, "< 1 (a share of the first step's entropy)",
         p.watch.alerts.entropy_ratio < 1),
    ]


def scratch_model_checks(p: Params) -> list[tuple[str, Any, str, bool]]:
    """A model trained from scratch (model.name_or_path null): its shape against the byte-level BPE and the lengths."""
    n_positions = p.model.n_positions
    # the response's room beside the longest query (null max_query_tokens: the shortest one kept)
    query = "max_query_tokens" if p.tokenize.max_query_tokens is not None else "min_query_tokens"
    query_tokens = getattr(p.tokenize, query)
    return [
        ("model.vocab_size", p.model.vocab_size, f">= {MIN_VOCAB} (the 256 bytes of the byte-level BPE and its "
         "2 special tokens)", p.model.vocab_size >= MIN_VOCAB),
        ("model.n_embd", p.model.n_embd, "a multiple of model.n_head", p.model.n_embd % p.model.n_head == 0),
        ("sft.max_length", p.sft.max_length, f"<= model.n_positions ({n_positions})",
         p.sft.max_length <= n_positions),
        ("reward.max_length", p.reward.max_length, f"<= model.n_positions ({n_positions})",
         p.reward.max_length <= n_positions),
        ("generation.max_new_tokens", p.generation.max_new_tokens,
         f"<= model.n_positions - tokenize.{query} ({n_positions - query_tokens})",
         query_tokens + p.generation.max_new_tokens <= n_positions),
    ]


def generation_checks(g: GenerationParams) -> list[tuple[str, Any, str, bool]]:
    """The `generation` section's ranges, as transformers' `generate()` would refuse them only after the models
    load (or, for `top_p` above 1, not at all: it would sample as if 1.0)."""
    return [
        ("generation.temperature", g.temperature, "> 0 (sampling divides the logits by it; greedy decoding is "
         "generation.do_sample: false)", g.temperature > 0),
        ("generation.top_k", g.top_k, ">= 0 (0: no top-k filtering)", g.top_k >= 0),
        ("generation.top_p", g.top_p, "in (0, 1] (1.0: no nucleus filtering)", 0 < g.top_p <= 1),
        ("generation.min_length", g.min_length, ">= -1 (-1: no minimum)", g.min_length >= -1),
    ]
