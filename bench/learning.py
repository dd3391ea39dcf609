"""Does bf16 mixed precision learn as well as fp32? The tiny rule-reward task, same seeds, side by side.

The task of tests/ppo_core/test_learning.py: a random-init 2-layer GPT-2 (vocab 64, built here as tests/tiny.py builds
it: bench/ imports nothing from tests/) is rewarded with the number of times one token ("w7") appears in its
8-token response; batch 16, mini-batch 4, 4 PPO epochs, lr 1e-3. Prints the mean score per block of 5 steps for
each precision and seed, as a markdown table (a random policy scores about 0.13).

    .venv/bin/python bench/learning.py                     # fp32 and bf16, seeds 0 1 2, 30 steps
    .venv/bin/python bench/learning.py --seeds 0 --steps 60
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ppo_core from a plain checkout

from ppo_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

TARGET = 7  # the rewarded token
VOCAB, SPECIALS = 64, ["<pad>", "<eos>", "<unk>"]  # the model and tokenizer of tests/tiny.py, built here too


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over ``w3 .. w63`` plus ``<pad>`` (0), ``<eos>`` (1), ``<unk>`` (2)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_value_model(seed: int) -> AutoModelForCausalLMWithValueHead:
    """A random-init 2-layer GPT-2 (hidden 32) with a value head, both seeded."""
    torch.manual_seed(seed)
    lm = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB,
                                    pad_token_id=0, eos_token_id=1, bos_token_id=1))
    torch.manual_seed(seed + 1)
    return AutoModelForCausalLMWithValueHead(lm)


def random_queries(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` queries of 2 to 6 random non-special tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (n,), generator=g)
    return [torch.randint(len(SPECIALS), VOCAB, (int(k),), generator=g) for k in lengths]


def run(precision: str, seed: int, steps: int) -> list[float]:
    """Mean score of each step's batch."""
    tokenizer = tiny_tokenizer()
    config = PPOConfig(batch_size=16, mini_batch_size=4, learning_rate=1e-3, ppo_epochs=4, seed=seed,
                       accelerator_kwargs={"mixed_precision": precision})
    trainer = PPOTrainer(config, tiny_value_model(seed), tokenizer=tokenizer)
    kwargs = dict(max_new_tokens=8, do_sample=True, top_k=0, top_p=1.0, pad_token_id=tokenizer.eos_token_id)
    means = []
    for step in range(steps):
        queries = random_queries(16, seed=1000 * seed + step)
        responses = trainer.generate(queries, return_prompt=False, batch_size=16, **kwargs)
        scores = [(r == TARGET).sum().float() for r in responses]
        trainer.step(queries, responses, scores)
        means.append(torch.stack(scores).mean().item())
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--block", type=int, default=5, help="steps averaged per column")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a tiny model: extra threads only add spin-up cost

    blocks = range(0, args.steps, args.block)
    print("| precision | seed | " + " | ".join(f"steps {b + 1}-{b + args.block}" for b in blocks) + " |")
    print("|---|---|" + "---:|" * len(blocks))
    for precision in ("no", "bf16"):
        for seed in args.seeds:
            means = run(precision, seed, args.steps)
            cells = [f"{statistics.mean(means[b:b + args.block]):.2f}" for b in blocks]
            name = "fp32" if precision == "no" else "bf16 mixed"
            print(f"| {name} | {seed} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
