"""End to end on CPU: PPO raises a rule reward (how often one token appears) within a few dozen steps."""

from __future__ import annotations

import numpy as np
import torch

from ppo_core import PPOConfig, PPOTrainer
from tests.tiny import random_queries, tiny_tokenizer, tiny_value_model

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

TARGET = 7  # the rewarded token ("w7")


def test_rule_reward_rises():
    tokenizer = tiny_tokenizer()
    config = PPOConfig(batch_size=16, mini_batch_size=4, learning_rate=1e-3, ppo_epochs=4, seed=0)
    trainer = PPOTrainer(config, tiny_value_model("gpt2", seed=0), tokenizer=tokenizer)
    generation_kwargs = dict(max_new_tokens=8, do_sample=True, top_k=0, top_p=1.0,
                             pad_token_id=tokenizer.eos_token_id)
    mean_scores = []
    for step in range(30):
        queries = random_queries(16, seed=step)
        responses = trainer.generate(queries, return_prompt=False, batch_size=16, **generation_kwargs)
        scores = [(r == TARGET).sum().float() for r in responses]
        stats = trainer.step(queries, responses, scores)
        assert np.isfinite(stats["ppo/loss/total"])
        mean_scores.append(torch.stack(scores).mean().item())
    first, last = np.mean(mean_scores[:5]), np.mean(mean_scores[-5:])
    assert last > 2 * first and last > first + 0.5, f"mean score {first:.2f} -> {last:.2f}: {mean_scores}"
