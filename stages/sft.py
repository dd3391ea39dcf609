"""sft: supervised fine-tuning of the policy on the SFT texts (causal LM loss) with `transformers.Trainer`.

Default model (`model.name_or_path: null`): a byte-level BPE tokenizer trained on the SFT texts (`tokenizers`)
and a small GPT-2 config trained from scratch. Otherwise any causal LM id or local path, or an encoder-decoder
(T5, BART): each text is then split at a seeded word boundary, the start going to the encoder and the rest
(the continuation PPO will ask for) to the decoder. EOS ends every text (or target) so the policy learns to
stop; the pad token is distinct from EOS, so EOS keeps its loss.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from ppo_core import set_seed
from stages.shared import chat
from stages.shared.artifacts import (
    RAW_SFT,
    SFT_CHECKPOINTS,
    SFT_CURVE,
    SFT_METRICS,
    SFT_MODEL,
    publishing,
    save_pretrained,
    write_csv,
    write_json,
    writing,
)
from stages.shared.models import (
    TRAIN_METRIC_ROWS,
    check_mixed_precision,
    load_float32,
    merged,
    precision_args,
    with_lora,
)
from stages.shared.origins import check_model_source
from stages.shared.params import MIN_TEXTS_FROM_SCRATCH, ModelParams, Params
from stages.shared.resume import discard, trainer_callback, trainer_resume_point
from stages.shared.runtime import StageError, device, note, quiet_trainer, reason, trainer_progress, warning

EOS, PAD = "<|endoftext|>", "<pad>"


def run(params: Params, root: Path = Path(".")) -> str:
    check_mixed_precision(params, "sft")
    set_seed(params.seed)
    table = chat.read_sft(root / RAW_SFT)  # {text}, or {prompt, completion}: the loss on the completion only
    tokenizer, model = build(params.model, chat.tokenizer_texts(table))
    if params.chat.template:  # before training: tokenize would refuse its prompts after it
        chat.check_template(tokenizer, params.model.name_or_path or "model.name_or_path null", "chat.template is true")
    model = with_lora(model, params.model.lora, "SEQ_2_SEQ_LM" if model.config.is_encoder_decoder else "CAUSAL_LM")
    if model.config.is_encoder_decoder:
        examples, collator = seq2seq_examples(table, tokenizer, params), DataCollatorForSeq2Seq(tokenizer, model)
    else:
        examples, collator = chat.sft_examples(table, tokenizer, params.sft.max_length, params.chat,
                                               params.model.name_or_path or "model.name_or_path null")
    n_eval = max(1, round(len(examples) * params.sft.eval_fraction))
    steps = math.ceil((len(examples) - n_eval) / params.sft.batch_size) * params.sft.num_train_epochs
    if too_few := too_little_data(len(examples) - n_eval, steps, params.model.name_or_path is None):
        warning(f"sft: {too_few}")
    checkpoints = root / SFT_CHECKPOINTS
    resume_from = trainer_resume_point("sft", params, root, checkpoints,
                                       (root / SFT_MODEL.parent, root / SFT_METRICS.parent))
    trainer = quiet_trainer(Trainer(
        model=model, args=training_args(params, checkpoints), data_collator=collator, train_dataset=examples[n_eval:],
        eval_dataset=examples[:n_eval], processing_class=tokenizer,
        callbacks=[trainer_callback(), trainer_progress("sft")]))
    with writing(checkpoints):  # transformers' checkpoints: a full disk names them
        trainer.train(resume_from_checkpoint=resume_from)
    # Losses of the final model (not the running mean of training, which a resumed run only partly sees), each the
    # model's own mean over the tokens it predicts: transformers' Trainer divides a GPT-2 head's summed loss by every
    # label, each text's first too (it counts shifted labels only for the loss_types it recognises)
    trainer.model_accepts_loss_kwargs = False
    train_sample = examples[n_eval:n_eval + TRAIN_METRIC_ROWS]
    train_loss = trainer.evaluate(train_sample, metric_key_prefix="train")["train_loss"]
    eval_loss = trainer.evaluate()["eval_loss"]
    metrics = {"train_loss": train_loss, "eval_loss": eval_loss, "n_train": len(examples) - n_eval, "n_eval": n_eval,
               "n_train_loss": len(train_sample),
               "n_params": sum(p.numel() for p in model.parameters()),
               "n_trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if trainer.is_world_process_zero():  # under `accelerate launch`, one process writes; all outputs or none
        history = trainer.state.log_history  # the running training loss, every 2% of the steps (resumed runs too)
        with publishing():
            save_pretrained(root / SFT_MODEL, merged(model), tokenizer)
            write_json(metrics, root / SFT_METRICS)
            write_csv([{"step": row["step"], "loss": float(row["loss"])} for row in history if "loss" in row],
                      root / SFT_CURVE, columns=["step", "loss"])
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():  # published: the run is finished, and a rerun trains from the start
        discard(checkpoints)
    return f"{metrics['n_train']} texts, train loss {train_loss:.3f}, eval loss {eval_loss:.3f} -> {SFT_MODEL}"


MIN_STEPS = 10  # optimiser steps below which a model barely moves


def too_little_data(n_train: int, steps: float, from_scratch: bool) -> str | None:
    """Why ``n_train`` texts in ``steps`` optimiser steps are too few to learn from (a model trained from scratch needs
    hundreds of texts; any model a few steps), or None."""
    if from_scratch and n_train < MIN_TEXTS_FROM_SCRATCH:
        return (f"{n_train} training texts (data.sft.n) for a model trained from scratch: under "
                f"{MIN_TEXTS_FROM_SCRATCH} it learns no language, and every later result (rewards, win rate) compares "
                "noise; give more texts, or start from a pretrained model (model.name_or_path)")
    if steps < MIN_STEPS:
        return (f"{n_train} training texts make {steps:g} optimiser steps (of sft.batch_size, over "
                f"sft.num_train_epochs): under "
                f"{MIN_STEPS} the model barely moves from where it started; give more texts or epochs")
    return None


def seq2seq_examples(table: dict[str, list], tokenizer, params: Params) -> list[dict[str, list[int]]]:
    """Each text of ``table`` split at a seeded space: encoder input the start, labels the rest (leading space kept,
    so start + rest is the text) plus EOS, both truncated to sft.max_length tokens."""
    if "text" not in table:
        raise StageError("an encoder-decoder model trains on plain text rows (data.sft.columns: {text: ...}) only")
    texts, rng, n = table["text"], random.Random(f"{params.seed}-sft-split"), params.sft.max_length
    examples = []
    for text in texts:
        spaces = [i for i, c in enumerate(text) if c == " " and i > 0]
        cut = rng.choice(spaces) if spaces else len(text)
        source, target = tokenizer([text[:cut], text[cut:]], add_special_tokens=False)["input_ids"]
        examples.append({"input_ids": source[:n], "labels": target[:n - 1] + [tokenizer.eos_token_id]})
    return examples


def training_args(params: Params, output_dir: Path) -> TrainingArguments:
    sft, every = params.sft, params.checkpoint.trainer_every
    return TrainingArguments(
        output_dir=str(output_dir), save_strategy="steps" if every else "no", save_steps=every or 500,
        save_total_limit=2, learning_rate=sft.learning_rate, num_train_epochs=sft.num_train_epochs,
        per_device_train_batch_size=sft.batch_size, per_device_eval_batch_size=sft.batch_size,
        warmup_steps=sft.warmup_ratio, lr_scheduler_type="cosine", weight_decay=sft.weight_decay,
        seed=params.seed, data_seed=params.seed, use_cpu=device() == "cpu", dataloader_num_workers=0,
        logging_strategy="steps", logging_steps=0.02, report_to="none", disable_tqdm=True,  # the loss curve: 50 points
        # torch's fused AdamW (transformers' default from torch 2.8, named so that it stays): its sqrt is the CPU's
        # exact instruction, where the for-loop AdamW's torch.sqrt is MKL's, whose last bit differs between vendors
        optim="adamw_torch_fused",
        **precision_args(params),
    )


def build(spec: ModelParams, texts: list[str]):
    """The tokenizer and the untrained (or pretrained) causal or encoder-decoder LM."""
    if spec.name_or_path is not None:
        check_model_source(spec.name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec.name_or_path)
            model_class = (AutoModelForSeq2SeqLM if AutoConfig.from_pretrained(spec.name_or_path).is_encoder_decoder
                           else AutoModelForCausalLM)
            model = load_float32(model_class, spec.name_or_path)
        except (OSError, ValueError) as err:  # e.g. a tokenizer or weights file transformers cannot read
            raise StageError(f"model.name_or_path '{spec.name_or_path}' could not be loaded ({reason(err)}); give a "
                             "local save_pretrained directory, a hub id (with HF_HUB_OFFLINE=0), or null to train the "
                             "default model from scratch") from None
        if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
            # Padding with EOS would mask EOS out of the loss and the policy would never learn to stop.
            why = "has no pad token" if tokenizer.pad_token is None else "pads with its EOS token"
            tokenizer.add_special_tokens({"pad_token": PAD})
            model.resize_token_embeddings(len(tokenizer))
            note(f"sft: the tokenizer of {spec.name_or_path} {why}; added '{PAD}' (id {tokenizer.pad_token_id}) and "
                 "resized the embeddings")
        model.config.pad_token_id = tokenizer.pad_token_id
        return tokenizer, model
    tokenizer = train_tokenizer(texts, spec.vocab_size, spec.n_positions)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=spec.n_positions, n_embd=spec.n_embd, n_layer=spec.n_layer,
        n_head=spec.n_head, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer, GPT2LMHeadModel(config)


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int):
    """A GPT-2-style byte-level BPE tokenizer (exact round trip on any text), trained on `texts`."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=max_length)
