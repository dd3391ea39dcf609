"""The seed's example loop, verbatim but for the import (ppo_core), the model (tiny, local) and the reward
(a rule on the texts instead of the sentiment pipeline)."""

from __future__ import annotations

import torch
from datasets import Dataset
from tqdm import tqdm

from ppo_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from tests.tiny import tiny_causal_lm, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

QUERIES = ["w5 w6 w7", "w8", "w9 w10", "w11 w12 w13 w14", "w15 w16", "w17", "w18 w19 w20", "w21 w22",
           "w23 w24 w25", "w26"]


def reward_model(texts):
    """Stands in for the sentiment pipeline: the output format of ``pipeline(...)`` with a rule score."""
    return [[{"label": "NEGATIVE", "score": 0.0}, {"label": "POSITIVE", "score": float(t.count("w7"))}]
            for t in texts]


def test_the_seed_loop_runs():
    config = PPOConfig(model_name="tiny-gpt2", learning_rate=1.41e-5, batch_size=4, mini_batch_size=2)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"))
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token

    def tokenize(sample):
        sample["input_ids"] = tokenizer.encode(sample["query"])
        return sample

    dataset = Dataset.from_dict({"query": QUERIES})
    dataset = dataset.map(tokenize, batched=False)
    dataset.set_format(type="torch")

    def collator(data):
        return dict((key, [d[key] for d in data]) for key in data[0])

    ppo_trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer, dataset=dataset,
                             data_collator=collator)

    generation_kwargs = {
        "min_length": -1,
        "top_k": 0.0,
        "top_p": 1.0,
        "do_sample": True,
        "pad_token_id": tokenizer.eos_token_id,
        "max_new_tokens": 8,
    }

    all_stats = []
    epochs = 1
    for epoch in tqdm(range(epochs), "epoch: "):  # noqa: B007 - the seed's loop, as written
        for batch in tqdm(ppo_trainer.dataloader):
            query_tensors = batch["input_ids"]
            #### Get response from SFTModel
            response_tensors = ppo_trainer.generate(query_tensors, **generation_kwargs)
            batch["response"] = [tokenizer.decode(r.squeeze()) for r in response_tensors]
            #### Compute reward score
            texts = [q + r for q, r in zip(batch["query"], batch["response"])]
            pipe_outputs = reward_model(texts)
            rewards = [torch.tensor(output[1]["score"]) for output in pipe_outputs]
            #### Run PPO step
            stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
            ppo_trainer.log_stats(stats, batch, rewards)
            all_stats.append(stats)

    assert len(all_stats) == len(QUERIES) // config.batch_size  # drop_last: 10 queries -> 2 steps
    assert all(isinstance(s["ppo/loss/total"], float) for s in all_stats)
    assert ppo_trainer.current_step == 2
