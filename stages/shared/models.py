"""Loading the pipeline's models: their shape, LoRA adapters, and the reward model with its scores."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

from stages.shared import auto
from stages.shared.artifacts import loading, require_dir
from stages.shared.runtime import StageError, device, reason, tf32_arg, to_host

# Training rows that sft's train loss and reward's train metrics are computed over, after training: the first of the
# shuffled training set, a sample enough to set beside the held-out figures (the whole set cost sft and reward a third
# of their training time again on a 2-core CPU, for a metric that learns nothing)
TRAIN_METRIC_ROWS = 256

# Notices about what the stages do on purpose, a line or two each at every LoRA run: peft saves the embeddings of a
# model whose vocabulary sft grew (a pad token apart from EOS) with each adapter, and reads transformers' deprecated
# `is_gradient_checkpointing`.
warnings.filterwarnings("ignore", message="Setting `save_embedding_layers` to `True`", category=UserWarning)
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def model_context(path: Path) -> int:
    """The most tokens the model at `path` attends to (its position embeddings), from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return 1 << 30  # no fixed context (e.g. relative positions): nothing to drop


def is_encoder_decoder(path: Path) -> bool:
    """Whether the model saved at `path` is an encoder-decoder (T5, BART) rather than a causal LM."""
    from transformers import AutoConfig

    return bool(AutoConfig.from_pretrained(path).is_encoder_decoder)


def load_float32(model_class, path, **kwargs):
    """`model_class.from_pretrained(path, **kwargs)` with float32 weights, whatever dtype the checkpoint was saved in:
    transformers 5 loads the saved dtype, so a bf16 checkpoint would train (sft, reward) bf16 weights with no float32
    master copy, whose updates below bf16's resolution vanish, and evaluate would compare policies at two precisions.
    bf16 compute is mixed precision (autocast) over these float32 weights."""
    import torch

    with loading(path):
        return model_class.from_pretrained(path, dtype=torch.float32, **kwargs)


def load_base(model_class, path, tokenizer):
    """The pretrained model at ``path`` that sft started from, in float32 on the device for sampling (eval mode), its
    embeddings sized to SFT's ``tokenizer``
    (sft adds a pad token where the model's tokenizer has none): evaluate's base model, sampled with SFT's padding."""
    model = load_float32(model_class, path)
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))  # the pad row: masked out of attention wherever it pads
    return model.to(device()).eval()

def check_mixed_precision(params, stage: str) -> None:
    """Refuse `model.mixed_precision: fp16` where no CUDA GPU is visible: autocast to float16 is a GPU's, and on a CPU
    the stages would compute in float32, byte for byte what `null` gives, while the params say fp16. Then say what
    `auto` chose, or warn of an emulated bf16 (stages/shared/auto.py)."""
    if params.model.mixed_precision == "fp16" and device() == "cpu":
        raise StageError(f"{params.path}: model.mixed_precision is fp16, which needs a CUDA GPU and none is visible: "
                         "on a CPU the run would compute in float32 (the same as null); set auto, bf16 or null")
    auto.precision_note(stage, params.model.mixed_precision, params.numerics.kernels, auto.machine())


def mixed_precision(params) -> str | None:
    """`model.mixed_precision` as this machine uses it: bf16, fp16 or None (float32); `auto` resolved."""
    return auto.mixed_precision(params.model.mixed_precision, params.numerics.kernels, auto.machine())[0]


def precision_args(params) -> dict[str, bool | None]:
    """`TrainingArguments`' precision for `model.mixed_precision` (auto resolved): its autocast flags (float32
    weights, bf16 or fp16 compute) and TF32 matmuls on GPUs that have them (`tf32` None elsewhere: torch's setting)."""
    used = mixed_precision(params)
    return {"bf16": used == "bf16", "fp16": used == "fp16", "tf32": tf32_arg()}


def lora_config(spec, task_type: str):
    """The `peft.LoraConfig` of the `model.lora` params (task_type "CAUSAL_LM" or "SEQ_CLS")."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise StageError("model.lora is set but the 'peft' package is missing; pip install -e '.[lora]' "
                         "(or set model.lora: null)") from None
    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=spec.target_modules,
                      task_type=task_type)


def with_lora(model, spec, task_type: str):
    """`model` with a fresh LoRA adapter (base weights frozen), or `model` itself when `spec` is None."""
    if spec is None:
        return model
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(spec, task_type))
    except ValueError as err:  # e.g. target_modules that the model does not have
        raise StageError(f"model.lora: {reason(err, 200)}") from None


def merged(model):
    """A LoRA-adapted model with its adapter merged in (a plain transformers model); others unchanged."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


def load_reward_model(path: Path, policy=None):
    """The reward model of the reward stage (scalar head) in eval mode, and its tokenizer; given a `policy` that carries
    the reward stage's adapter (ppo_core's `from_pretrained(..., reward_adapter=...)`), that policy instead of a
    second copy of the base weights (`reward_scores` scores with its `compute_reward_score`)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(require_dir(path))
    if policy is not None:
        return policy, tokenizer
    model = load_float32(AutoModelForSequenceClassification, path).to(device()).eval()
    return model, tokenizer


def reward_inputs(model, tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids the reward model scores, truncated to the tokenizer's model_max_length. An encoder-decoder
    (T5, BART) classifies from the hidden state at the EOS token, so each text gets one at its end."""
    if not model.config.is_encoder_decoder:
        return tokenizer(texts, truncation=True)["input_ids"]
    ids = tokenizer(texts, truncation=True, max_length=tokenizer.model_max_length - 1, add_special_tokens=False)
    return [x + [tokenizer.eos_token_id] for x in ids["input_ids"]]


def reward_scores(model, tokenizer, texts: Sequence[str], batch_size: int) -> list[float]:
    """Scalar reward of each text (the head's raw output), truncated to the tokenizer's model_max_length. `model` is
    the reward model, or a policy with the reward adapter (`load_reward_model`), pooled as the reward model pools."""
    import torch

    tokenizer.padding_side = "right"
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            ids = reward_inputs(model, tokenizer, list(texts[start:start + batch_size]))
            batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(model.device)
            if getattr(model, "supports_rm_adapter", False):
                per_token = model.compute_reward_score(batch["input_ids"], batch["attention_mask"])  # (B, T, 1)
                logits = at_last_token(per_token, batch["input_ids"], tokenizer.pad_token_id)  # (B, 1)
            else:
                logits = model(**batch).logits  # (B, 1)
            scores += logits[:, 0].float().cpu().tolist()
    return scores


def at_last_token(per_token, input_ids, pad_token_id: int):
    """``(B, T, L) -> (B, L)``: each row's scores at its rightmost non-pad token, where transformers' sequence
    classifiers (GPT-2, Llama, ...) pool theirs."""
    import torch

    positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
    last = (positions * (input_ids != pad_token_id).int()).argmax(-1)  # (B,)
    return per_token[torch.arange(len(input_ids), device=per_token.device), last.to(per_token.device)]


def sample_responses(model, tokenizer, query_ids: list[list[int]], generation: dict, batch_size: int,
           desc: str, share_prompts: bool = False) -> list[list[int]]:
    """Sampled response tokens per query, ``batch_size`` at a time, each cut after its first EOS (kept): ppo_core's
    generation, as in the PPO rollouts, with transformers' own sampling draws; ``share_prompts``: a batch's copies of
    a query prefilled once."""
    import torch
    from tqdm.auto import tqdm

    from ppo_core.models.generation import generate_batched

    out = []
    for start in tqdm(range(0, len(query_ids), batch_size), desc=desc, unit="batch", disable=None):  # a terminal only
        queries = [torch.tensor(q) for q in query_ids[start:start + batch_size]]
        responses = generate_batched(model, tokenizer, queries, model.device, None, len(queries), False, generation,
                                     model.config.is_encoder_decoder, fast_sampling=False, share_prompts=share_prompts)
        out += [r.tolist() for r in to_host(responses)]
    return out


def save_adapter(model, folder: Path) -> None:
    """A PEFT model's adapter (and any modules saved with it) to ``folder``, its config's lists in a fixed order
    (peft writes target_modules in hash order, which would change the bytes from run to run)."""
    from ppo_core.models.adapters import canonical_adapter_configs

    model.save_pretrained(folder)
    canonical_adapter_configs(str(folder))

