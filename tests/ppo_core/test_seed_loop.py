"""The seed documentation's PPO code (/work/shared/seed/ppo_trainer_doc.txt, TRL 0.11's PPOTrainer page) and TRL 0.11's
``examples/scripts/ppo.py`` loop, as written but for the import (ppo_core), local tiny models and data in place of the
hub's, and fewer steps. Each line that differs says why in a comment."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tqdm import tqdm
from transformers import GPT2Config, GPT2ForSequenceClassification

from ppo_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer  # was: from trl import ...
from ppo_core.core import LengthSampler  # was: from trl.core import LengthSampler
from tests.tiny import EOS, PAD, VOCAB, tiny_causal_lm, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

WORDS = [f"w{i}" for i in range(3, VOCAB)]  # the tiny tokenizer's vocabulary


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Local stand-ins for the hub ids of the doc: a tiny GPT-2 with its tokenizer, and a tiny sentiment classifier
    (two labels, NEGATIVE and POSITIVE, as lvwerra/distilbert-imdb)."""
    root = tmp_path_factory.mktemp("hub")
    tiny_causal_lm("gpt2").save_pretrained(str(root / "gpt2"))
    tiny_tokenizer().save_pretrained(str(root / "gpt2"))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=128, pad_token_id=PAD,
                        eos_token_id=EOS, bos_token_id=EOS, num_labels=2, id2label={0: "NEGATIVE", 1: "POSITIVE"},
                        label2id={"NEGATIVE": 0, "POSITIVE": 1})
    GPT2ForSequenceClassification(config).save_pretrained(str(root / "distilbert-imdb"))
    tiny_tokenizer().save_pretrained(str(root / "distilbert-imdb"))
    return root


def cherry_picked_prompts():
    """Stands in for ``load_dataset("HuggingFaceH4/cherry_picked_prompts", split="train")`` (its columns)."""
    prompts = ["w5 w6 w7", "w8", "w9 w10", "w11 w12 w13 w14", "w15 w16", "w17", "w18 w19 w20", "w21 w22"]
    return Dataset.from_dict({"prompt": prompts, "meta": [{"source": "seed"}] * 8, "completion": ["w30"] * 8})


def test_the_seed_documentation_loop_runs(hub):
    from transformers import AutoTokenizer, pipeline

    dataset = cherry_picked_prompts()
    dataset = dataset.rename_column("prompt", "query")
    dataset = dataset.remove_columns(["meta", "completion"])

    config = PPOConfig(
        model_name=str(hub / "gpt2"),  # was: "gpt2"
        learning_rate=1.41e-5,
        batch_size=4, mini_batch_size=2,  # not in the doc (defaults 128): 8 prompts here
    )
    model = AutoModelForCausalLMWithValueHead.from_pretrained(config.model_name)
    tokenizer = AutoTokenizer.from_pretrained(config.model_name)

    tokenizer.pad_token = tokenizer.eos_token

    # was: model="lvwerra/distilbert-imdb". top_k=None: the loop reads output[1], so the pipeline must return every
    # label's score (by default it returns only the best one's, and output[1] fails, in TRL 0.11's days too)
    reward_model = pipeline("text-classification", model=str(hub / "distilbert-imdb"), top_k=None)

    def tokenize(sample):
        sample["input_ids"] = tokenizer.encode(sample["query"])
        return sample

    dataset = dataset.map(tokenize, batched=False)

    ppo_trainer = PPOTrainer(
        model=model,
        config=config,
        dataset=dataset,
        tokenizer=tokenizer,
    )

    generation_kwargs = {
        "min_length": -1,
        "top_k": 0.0,
        "top_p": 1.0,
        "do_sample": True,
        "pad_token_id": tokenizer.eos_token_id,
    }

    all_stats = []
    epochs = 1  # the doc: 10
    for epoch in tqdm(range(epochs), "epoch: "):  # noqa: B007 - the doc's loop, as written
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

    assert len(all_stats) == 2 and ppo_trainer.current_step == 2  # 8 prompts, batch_size 4 (drop_last)
    assert all(isinstance(s["ppo/loss/total"], float) for s in all_stats)
    logs = ppo_trainer.log_stats(stats, batch, rewards)
    assert logs["env/reward_mean"] == pytest.approx(float(torch.stack(rewards).mean()), abs=1e-6)


def test_the_example_script_loop_runs(hub):
    """TRL 0.11's examples/scripts/ppo.py: LengthSampler queries, a ``sentiment-analysis`` pipeline's raw logit as the
    reward, reference responses scored alongside, and ``columns_to_log``."""
    from transformers import AutoTokenizer, pipeline

    # model_name and reward_model: local paths (were "gpt2" and "sentiment-analysis:lvwerra/distilbert-imdb");
    # the batch sizes: the tiny data
    ppo_config = PPOConfig(model_name=str(hub / "gpt2"), query_dataset="imdb",
                           reward_model=f"sentiment-analysis:{hub / 'distilbert-imdb'}", learning_rate=1.41e-5,
                           batch_size=4, mini_batch_size=2)
    sent_kwargs = {"top_k": None, "function_to_apply": "none", "batch_size": 16}  # return_all_scores: gone in 5.x

    def build_dataset(config, dataset_name="stanfordnlp/imdb", input_min_text_length=2, input_max_text_length=8):
        tokenizer = AutoTokenizer.from_pretrained(config.model_name)
        tokenizer.pad_token = tokenizer.eos_token
        g = torch.Generator().manual_seed(0)  # was: load_dataset(dataset_name, split="train")
        reviews = [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (12,), generator=g)) for _ in range(8)]
        ds = Dataset.from_dict({"text": reviews, "label": [0, 1] * 4})
        ds = ds.rename_columns({"text": "review"})
        ds = ds.filter(lambda x: len(x["review"]) > 20, batched=False)  # was: > 200 (characters of a real review)

        input_size = LengthSampler(input_min_text_length, input_max_text_length)

        def tokenize(sample):
            sample["input_ids"] = tokenizer.encode(sample["review"])[: input_size()]
            sample["query"] = tokenizer.decode(sample["input_ids"])
            return sample

        ds = ds.map(tokenize, batched=False)
        ds.set_format(type="torch")
        return ds

    dataset = build_dataset(ppo_config, ppo_config.query_dataset)

    def collator(data):
        return {key: [d[key] for d in data] for key in data[0]}

    torch.manual_seed(ppo_config.seed)  # was: set_seed(ppo_config.seed)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(ppo_config.model_name)
    ref_model = AutoModelForCausalLMWithValueHead.from_pretrained(ppo_config.model_name)
    tokenizer = AutoTokenizer.from_pretrained(ppo_config.model_name)
    tokenizer.pad_token_id = tokenizer.eos_token_id

    ppo_trainer = PPOTrainer(ppo_config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)

    device = ppo_trainer.accelerator.device
    if ppo_trainer.accelerator.num_processes == 1:
        device = 0 if torch.cuda.is_available() else "cpu"
    task, model_name = ppo_config.reward_model.split(":")
    sentiment_pipe = pipeline(task, model=model_name, device=device)

    generation_kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True,
                         "pad_token_id": tokenizer.eos_token_id, "max_new_tokens": 32}

    steps = 0
    for _epoch, batch in tqdm(enumerate(ppo_trainer.dataloader)):
        query_tensors = batch["input_ids"]

        # Get response from gpt2
        response_tensors, ref_response_tensors = ppo_trainer.generate(
            query_tensors, return_prompt=False, generate_ref_response=True, **generation_kwargs
        )
        batch["response"] = tokenizer.batch_decode(response_tensors)
        batch["ref_response"] = tokenizer.batch_decode(ref_response_tensors)

        # Compute sentiment score
        texts = [q + r for q, r in zip(batch["query"], batch["response"])]
        pipe_outputs = sentiment_pipe(texts, **sent_kwargs)
        rewards = [torch.tensor(output[1]["score"]) for output in pipe_outputs]
        ref_texts = [q + r for q, r in zip(batch["query"], batch["ref_response"])]
        ref_pipe_outputs = sentiment_pipe(ref_texts, **sent_kwargs)
        ref_rewards = [torch.tensor(output[1]["score"]) for output in ref_pipe_outputs]
        batch["ref_rewards"] = ref_rewards

        # Run PPO step
        stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
        ppo_trainer.log_stats(stats, batch, rewards,
                              columns_to_log=["query", "response", "ref_response", "ref_rewards"])
        steps += 1

    assert steps == 2 and ppo_trainer.current_step == 2
    assert all(2 <= len(q) <= 7 for q in query_tensors)  # LengthSampler(2, 8): 2..7 tokens
