"""A PPO step on each supported decoder family (tiny random-init models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppo_core import PPOConfig, PPOTrainer
from tests.tiny import ARCHS, random_queries, tiny_tokenizer, tiny_value_model

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost


@pytest.mark.parametrize("arch", ARCHS)
def test_ppo_step_runs_with_finite_stats(arch):
    tokenizer = tiny_tokenizer()
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-3, seed=0)
    trainer = PPOTrainer(config, tiny_value_model(arch), tokenizer=tokenizer, num_shared_layers=1)
    queries = random_queries(4, seed=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    for _ in range(2):
        responses = trainer.generate(queries, return_prompt=False, max_new_tokens=5, do_sample=True, top_k=0,
                                     top_p=1.0, pad_token_id=tokenizer.eos_token_id)
        scores = [torch.tensor(float(len(r))) for r in responses]
        stats = trainer.step(queries, responses, scores)
        bad = [k for k, v in stats.items() if not np.all(np.isfinite(np.asarray(v, dtype=np.float64)))]
        assert not bad, f"{arch}: non-finite stats {bad}"
    assert stats["objective/kl"] != 0  # second step: the policy has moved away from the reference
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed
