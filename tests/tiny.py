"""Tiny local models and tokenizers for the tests: built in-process, nothing is downloaded."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    T5Config,
)

VOCAB = 64
SPECIALS = ["<pad>", "<eos>", "<unk>"]
PAD, EOS = 0, 1


def tiny_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the words ``w3 .. w{V-1}`` plus ``<pad>``, ``<eos>``, ``<unk>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def tiny_causal_lm(arch: str = "gpt2", vocab_size: int = VOCAB, seed: int = 0, hidden: int = 32, layers: int = 2,
                   **config_overrides):
    """A random-init causal LM of the given family, small enough for CPU tests.

    ``config_overrides`` go to the model's config (e.g. ``attention_dropout=0.5``).
    """
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS, **config_overrides)
    if arch == "gpt2":
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=128, **common)
    elif arch == "llama":
        config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **common)
    elif arch == "gpt_neox":
        config = GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                               num_attention_heads=4, max_position_embeddings=128, **common)
    else:
        raise ValueError(arch)
    return AutoModelForCausalLM.from_config(config)


def random_queries(n: int, seed: int = 0, min_len: int = 2, max_len: int = 6, vocab_size: int = VOCAB):
    """``n`` 1-D LongTensors of random non-special tokens with mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(len(SPECIALS), vocab_size, (int(k),), generator=g) for k in lengths]


ARCHS = ("gpt2", "llama", "gpt_neox")


def tiny_value_model(arch: str = "gpt2", seed: int = 0, **head_kwargs):
    """``tiny_causal_lm`` wrapped in ppo_core's ``AutoModelForCausalLMWithValueHead`` (value head seeded too)."""
    from ppo_core import AutoModelForCausalLMWithValueHead

    base = tiny_causal_lm(arch, seed=seed)
    torch.manual_seed(seed + 1)
    return AutoModelForCausalLMWithValueHead(base, **head_kwargs)


SEQ2SEQ_ARCHS = ("t5", "t5_unscaled", "bart")


def tiny_seq2seq_lm(arch: str = "t5", vocab_size: int = VOCAB, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A random-init encoder-decoder LM: ``t5`` (tied head, decoder output scaled by ``d_model ** -0.5``),
    ``t5_unscaled`` (T5 v1.1 style, no rescaling) or ``bart`` (with a random ``final_logits_bias``)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, pad_token_id=PAD, eos_token_id=EOS)
    if arch in ("t5", "t5_unscaled"):
        extra = {"tie_word_embeddings": False} if arch == "t5_unscaled" else {}
        config = T5Config(d_model=hidden, d_kv=8, d_ff=2 * hidden, num_layers=layers, num_heads=4,
                          relative_attention_num_buckets=8, decoder_start_token_id=PAD, **common, **extra)
    elif arch == "bart":
        config = BartConfig(d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=2 * hidden, decoder_ffn_dim=2 * hidden,
                            max_position_embeddings=64, bos_token_id=EOS, decoder_start_token_id=EOS,
                            forced_eos_token_id=None, **common)
    else:
        raise ValueError(arch)
    model = AutoModelForSeq2SeqLM.from_config(config)
    if arch == "bart":
        with torch.no_grad():
            model.final_logits_bias.normal_()
    return model


def tiny_lora_config(r: int = 4, target_modules=("c_attn",), **overrides):
    """A small ``peft.LoraConfig`` (no dropout) on the given modules (GPT-2's fused attention by default)."""
    from peft import LoraConfig

    overrides.setdefault("fan_in_fan_out", "c_attn" in target_modules)  # GPT-2 stores its linears transposed (Conv1D)
    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(target_modules), **overrides)


def randomize_lora(model, seed: int = 0, std: float = 0.3) -> None:
    """Give every LoRA ``B`` matrix random values: a fresh adapter is the identity (``B = 0``), which would
    make adapter-on and adapter-off indistinguishable."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * std)
