"""reward: a reward model (the SFT model plus a scalar head) trained on the pairs with the Bradley-Terry loss.

The model is `AutoModelForSequenceClassification` with one label, scoring `prompt + response` at its last
token. Loss: -log sigmoid(r_chosen - r_rejected), averaged over the pairs of a batch. Reports the pairwise
accuracy (r_chosen > r_rejected) on held-out pairs. With `model.lora`, a LoRA on the SFT model (the head trained in
full) saved merged, and also alone with its head in `adapter/`: the ppo stage scores with it on its policy's base.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

from ppo_core import set_seed
from stages.shared.artifacts import (
    RAW_PAIRS,
    REWARD_ADAPTER,
    REWARD_CHECKPOINTS,
    REWARD_METRICS,
    REWARD_MODEL,
    SFT_MODEL,
    atomic_path,
    publishing,
    read_table,
    require_dir,
    write_json,
    writing,
)
from stages.shared.models import (
    TRAIN_METRIC_ROWS,
    check_mixed_precision,
    load_float32,
    merged,
    precision_args,
    reward_inputs,
    reward_scores,
    save_adapter,
    with_lora,
)
from stages.shared.params import Params
from stages.shared.resume import discard, trainer_callback, trainer_resume_point
from stages.shared.runtime import device, quiet_trainer, trainer_progress


def run(params: Params, root: Path = Path(".")) -> str:
    if not needs_reward_model(params.scorer):
        return not_trained(root)
    check_mixed_precision(params, "reward")
    set_seed(params.seed)
    pairs = read_table(root / RAW_PAIRS, ["prompt", "chosen", "rejected"])
    chosen = (pairs["prompt"] + pairs["chosen"]).tolist()
    rejected = (pairs["prompt"] + pairs["rejected"]).tolist()
    order = list(range(len(pairs)))
    random.Random(f"{params.seed}-reward").shuffle(order)
    n_eval = max(1, round(len(order) * params.reward.eval_fraction))
    eval_idx, train_idx = order[:n_eval], order[n_eval:]

    tokenizer = AutoTokenizer.from_pretrained(require_dir(root / SFT_MODEL), model_max_length=params.reward.max_length)
    model = load_float32(AutoModelForSequenceClassification, root / SFT_MODEL, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model = with_lora(model, params.model.lora, "SEQ_CLS")  # the scalar head is trained in full (modules_to_save)
    chosen_ids = reward_inputs(model, tokenizer, [chosen[i] for i in train_idx])
    rejected_ids = reward_inputs(model, tokenizer, [rejected[i] for i in train_idx])
    train = [{"chosen": c, "rejected": r} for c, r in zip(chosen_ids, rejected_ids)]
    checkpoints = root / REWARD_CHECKPOINTS
    resume_from = trainer_resume_point("reward", params, root, checkpoints,
                                       (root / REWARD_MODEL.parent, root / REWARD_METRICS.parent))
    trainer = quiet_trainer(PairwiseTrainer(
        model=model, args=training_args(params, checkpoints), train_dataset=train,
        data_collator=PairCollator(tokenizer), processing_class=tokenizer,
        callbacks=[trainer_callback(), trainer_progress("reward")]))
    with writing(checkpoints):  # transformers' checkpoints: a full disk names them
        trainer.train(resume_from_checkpoint=resume_from)
    model.eval()
    bs = params.reward.batch_size * 2
    # Scores of the final model (not the running mean of training, which a resumed run only partly sees)
    scored = train_idx[:TRAIN_METRIC_ROWS]
    train_chosen = reward_scores(model, tokenizer, [chosen[i] for i in scored], bs)
    train_rejected = reward_scores(model, tokenizer, [rejected[i] for i in scored], bs)
    r_chosen = reward_scores(model, tokenizer, [chosen[i] for i in eval_idx], bs)
    r_rejected = reward_scores(model, tokenizer, [rejected[i] for i in eval_idx], bs)
    wins = [c > r for c, r in zip(r_chosen, r_rejected)]
    # a DVC metric: the held-out numbers a sweep compares at the top level, the rest grouped
    metrics = {"accuracy": sum(wins) / len(wins), "loss": bradley_terry_loss(r_chosen, r_rejected),
               "margin": sum(c - r for c, r in zip(r_chosen, r_rejected)) / n_eval,
               "train": {"accuracy": sum(c > r for c, r in zip(train_chosen, train_rejected)) / len(scored),
                         "loss": bradley_terry_loss(train_chosen, train_rejected)},
               "pairs": {"train": len(train), "eval": n_eval, "train_scored": len(scored)}}
    if trainer.is_world_process_zero():  # under `accelerate launch`, one process writes; all outputs or none
        with publishing():
            save_reward_model(root / REWARD_MODEL, model, tokenizer)
            write_json(metrics, root / REWARD_METRICS)
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():  # published: the run is finished, and a rerun trains from the start
        discard(checkpoints)
    return (f"{len(train)} pairs, held-out pairwise accuracy {metrics['accuracy']:.3f} ({n_eval} pairs) "
            f"-> {REWARD_MODEL}")


def needs_reward_model(scorer) -> bool:
    """Whether the trained reward model scores anything: it is the scorer, or one of `scorer.functions` (judges are
    functions of the user's own)."""
    return scorer.source == "reward_model" or any(entry.get("source") == "reward_model"
                                                  for entry in scorer.functions.values())


NOT_TRAINED = {"trained": False, "why": "nothing scores with the reward model (scorer.source, scorer.functions)"}


def not_trained(root: Path) -> str:
    """Where nothing needs a reward model: outputs that say so, the same bytes whatever the pairs and the SFT model,
    so nothing downstream reruns for them; in seconds."""
    with publishing():
        with atomic_path(root / REWARD_MODEL) as tmp:
            tmp.mkdir(parents=True)
            write_json(NOT_TRAINED, tmp / "not_trained.json")
        write_json(NOT_TRAINED, root / REWARD_METRICS)
    return f"not trained: {NOT_TRAINED['why']} -> {REWARD_MODEL}"


def save_reward_model(path: Path, model, tokenizer) -> None:
    """The reward model as a plain transformers model (LoRA merged in: what evaluate loads), and with LoRA the adapter
    and its score head alone in `adapter/` (what ppo scores with, on its policy's base weights), atomically."""
    with atomic_path(path) as tmp:
        if hasattr(model, "merge_and_unload"):  # before merging, which folds the adapter into the base weights
            save_adapter(model, tmp / REWARD_ADAPTER.name)
        merged(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def bradley_terry_loss(r_chosen: list[float], r_rejected: list[float]) -> float:
    """Mean of -log sigmoid(r_chosen - r_rejected) over pairs."""
    import torch

    return float(-F.logsigmoid(torch.tensor(r_chosen) - torch.tensor(r_rejected)).mean())


def training_args(params: Params, output_dir: Path) -> TrainingArguments:
    rm, every = params.reward, params.checkpoint.trainer_every
    return TrainingArguments(
        output_dir=str(output_dir), save_strategy="steps" if every else "no", save_steps=every or 500,
        save_total_limit=2, learning_rate=rm.learning_rate, num_train_epochs=rm.num_train_epochs,
        per_device_train_batch_size=rm.batch_size, warmup_steps=rm.warmup_ratio, lr_scheduler_type="cosine",
        seed=params.seed, data_seed=params.seed, use_cpu=device() == "cpu", dataloader_num_workers=0,
        remove_unused_columns=False, logging_strategy="no", report_to="none", disable_tqdm=True,
        # torch's fused AdamW (transformers' default from torch 2.8, named so that it stays): its sqrt is the CPU's
        # exact instruction, where the for-loop AdamW's torch.sqrt is MKL's, whose last bit differs between vendors
        optim="adamw_torch_fused",
        **precision_args(params),
    )


class PairCollator:
    """Stack a batch of pairs into one padded batch: the B chosen sequences, then the B rejected ones."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict:
        ids = [f["chosen"] for f in features] + [f["rejected"] for f in features]
        self.tokenizer.padding_side = "right"
        return dict(self.tokenizer.pad({"input_ids": ids}, return_tensors="pt"))  # (2B, T)


class PairwiseTrainer(Trainer):
    """transformers.Trainer with the Bradley-Terry loss on stacked (chosen, rejected) batches."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rewards = model(**inputs).logits.squeeze(-1)  # (2B,)
        r_chosen, r_rejected = rewards.chunk(2)  # (B,), (B,)
        loss = -F.logsigmoid(r_chosen - r_rejected).mean()
        return (loss, {"rewards": rewards}) if return_outputs else loss
