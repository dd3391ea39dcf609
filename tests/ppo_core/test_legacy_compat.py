"""Code written against trl==0.11.4's PPO API, unchanged but for the import (issue 15): the dataloader without a
collator, the warning without a dataset, the value-head models (config dropout, state-dict keys, no LM head, dtypes,
class attributes, quantised loading, adapters), and the trainer's legacy methods, each against the legacy formula by
hand. The seed documentation's loop is ``test_seed_loop.py``."""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset as TorchDataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BitsAndBytesConfig,
    GPT2Model,
    T5Model,
)

from ppo_core import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PPOConfig,
    PPOTrainer,
)
from tests.tiny import (
    EOS,
    PAD,
    VOCAB,
    random_queries,
    randomize_lora,
    tiny_causal_lm,
    tiny_lora_config,
    tiny_seq2seq_lm,
    tiny_tokenizer,
    tiny_value_model,
)

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def trainer_for(dataset=None, cls=PPOTrainer, **config):
    options = dict(batch_size=4, mini_batch_size=2, ppo_epochs=1, seed=0) | config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no dataset: legacy's warning, tested below
        return cls(PPOConfig(**options), tiny_value_model("gpt2"), tokenizer=tiny_tokenizer(), dataset=dataset)


@pytest.fixture(scope="module")
def saved_lm(tmp_path_factory):
    """A tiny GPT-2 (and its tokenizer) as ``save_pretrained`` writes it."""
    path = tmp_path_factory.mktemp("gpt2")
    tiny_causal_lm("gpt2", seed=3).save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    return str(path)


# ---- 1. a dataset without a data_collator -------------------------------------------------------------------------
class PairDataset(TorchDataset):
    """A plain torch dataset whose rows are ``(query_tensor, response_tensor)``."""

    def __init__(self, n: int = 8):
        g = torch.Generator().manual_seed(0)
        self.rows = [(torch.randint(3, VOCAB, (3,), generator=g), torch.randint(3, VOCAB, (5,), generator=g))
                     for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def test_a_dataset_of_tensor_tuples_batches_as_torch_does():
    dataset = PairDataset()
    trainer = trainer_for(dataset)
    batches = 0
    for query_tensor, response_tensor in trainer.dataloader:  # torch's default collation: stacked tensors
        assert query_tensor.shape == (4, 3) and response_tensor.shape == (4, 5)
        rows = {tuple(q.tolist()): r.tolist() for q, r in dataset.rows}
        assert all(rows[tuple(q.tolist())] == r.tolist() for q, r in zip(query_tensor, response_tensor))
        batches += 1
    assert batches == 2
    stats = trainer.step(list(query_tensor), list(response_tensor), [torch.tensor(1.0)] * 4)
    assert "ppo/loss/total" in stats


def test_dict_rows_stay_lists_of_their_values():
    """The ``datasets`` case: variable-length queries stay a list of 1-D tensors in every batch; token-id lists (no
    ``set_format("torch")``) become tensors; strings and labels stay lists."""
    from datasets import Dataset

    queries = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15, 16], [17, 18], [19, 20], [21, 22]]  # 2 share a length
    data = Dataset.from_dict({"input_ids": queries, "query": [" ".join(f"w{i}" for i in q) for q in queries],
                              "label": list(range(8))})
    trainer = trainer_for(data)
    for batch in trainer.dataloader:
        assert isinstance(batch["input_ids"], list) and len(batch["input_ids"]) == 4
        assert all(q.dtype == torch.long and q.ndim == 1 for q in batch["input_ids"])
        assert all(q.tolist() == queries[label] for q, label in zip(batch["input_ids"], batch["label"]))
        assert isinstance(batch["query"][0], str) and isinstance(batch["label"][0], int)
    data.set_format(type="torch")
    batch = next(iter(trainer_for(data).dataloader))
    assert isinstance(batch["input_ids"], list) and all(isinstance(q, torch.Tensor) for q in batch["input_ids"])


def test_tuple_rows_with_num_generations_repeat_each_prompt():
    trainer = trainer_for(PairDataset(), advantage_estimator="grpo", num_generations=2, mini_batch_size=4)
    query_tensor, response_tensor = next(iter(trainer.dataloader))
    assert query_tensor.shape == (4, 3)  # 2 prompts, each twice in a row
    assert torch.equal(query_tensor[0], query_tensor[1]) and torch.equal(query_tensor[2], query_tensor[3])
    assert not torch.equal(query_tensor[0], query_tensor[2])


# ---- 2. no dataset --------------------------------------------------------------------------------------------------
def test_no_dataset_warns_that_batch_size_must_be_set():
    with pytest.warns(UserWarning, match=r"no dataset is provided.*config\.batch_size \(now 4\)"):
        trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), tiny_value_model(), tokenizer=tiny_tokenizer())
    assert trainer.dataloader is None


# ---- 3. value-head models -------------------------------------------------------------------------------------------
def test_summary_dropout_prob_from_the_wrapped_model_config(tmp_path):
    base = tiny_causal_lm("gpt2")
    assert AutoModelForCausalLMWithValueHead(base).v_head.dropout.p == 0.1  # no config entry: legacy's default
    base.config.summary_dropout_prob = 0.3
    assert AutoModelForCausalLMWithValueHead(base).v_head.dropout.p == 0.3
    assert AutoModelForCausalLMWithValueHead(base, summary_dropout_prob=0.5).v_head.dropout.p == 0.5  # a kwarg wins
    assert isinstance(AutoModelForCausalLMWithValueHead(base, summary_dropout_prob=None).v_head.dropout, nn.Identity)
    base.save_pretrained(str(tmp_path))  # the config entry travels with the checkpoint
    assert AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path)).v_head.dropout.p == 0.3
    seq2seq = tiny_seq2seq_lm("t5")
    seq2seq.config.summary_dropout_prob = 0.2
    assert AutoModelForSeq2SeqLMWithValueHead(seq2seq).v_head.dropout.p == 0.2


def test_state_dict_has_the_transformers_model_keys_plus_the_value_head(saved_lm):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(saved_lm)
    state = model.state_dict()
    plain = AutoModelForCausalLM.from_pretrained(saved_lm).state_dict()
    head = [k for k in state if k.startswith("v_head.")]
    assert head == ["v_head.summary.weight", "v_head.summary.bias"]
    assert [k for k in state if k not in head] == list(plain)  # key for key, in order
    assert all(torch.equal(state[k], plain[k]) for k in plain)

    fresh = tiny_value_model("gpt2", seed=9)
    assert not torch.equal(fresh.v_head.summary.weight, model.v_head.summary.weight)
    fresh.load_state_dict(state)  # the legacy keys
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    fresh = tiny_value_model("gpt2", seed=9)
    fresh.load_state_dict(nn.Module.state_dict(model))  # nn.Module's, with pretrained_model.
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    fresh = tiny_value_model("gpt2", seed=9)
    result = fresh.load_state_dict(plain, strict=False)  # a plain transformers state dict: the LM's weights
    assert sorted(result.missing_keys) == ["v_head.summary.bias", "v_head.summary.weight"]
    assert not result.unexpected_keys
    assert torch.equal(fresh.pretrained_model.transformer.wte.weight, plain["transformer.wte.weight"])


def test_state_dict_round_trips_inside_a_wrapper_module():
    """DDP and DeepSpeed call the model's ``state_dict`` with a prefix, and load theirs module by module."""
    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    source = Wrapper(tiny_value_model("gpt2", seed=1))
    state = source.state_dict()
    assert "module.transformer.wte.weight" in state and "module.v_head.summary.weight" in state
    assert not any(k.startswith("module.pretrained_model.") for k in state)
    target = Wrapper(tiny_value_model("gpt2", seed=2))
    target.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), source.parameters()))
    assert isinstance(target.module.state_dict(keep_vars=True)["v_head.summary.weight"], nn.Parameter)


def test_a_peft_policy_state_dict_is_the_peft_model_s_plus_the_value_head():
    """Legacy returned the value head alone; ours keeps the adapter (and the frozen base), which resuming needs."""
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"), peft_config=tiny_lora_config())
    randomize_lora(model)
    state = model.state_dict()
    assert [k for k in state if not k.startswith("v_head.")] == list(model.pretrained_model.state_dict())
    assert any("lora_B" in k for k in state)
    other = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"), peft_config=tiny_lora_config())
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))


def test_a_model_without_an_lm_head_is_refused():
    with pytest.raises(ValueError, match="no language-model head"):
        AutoModelForCausalLMWithValueHead(tiny_causal_lm("gpt2").transformer)
    config = tiny_causal_lm("gpt2").config
    with pytest.raises(ValueError, match="no language-model head"):
        AutoModelForCausalLMWithValueHead.from_pretrained(GPT2Model(config))
    with pytest.raises(ValueError, match="no language-model head"):
        AutoModelForSeq2SeqLMWithValueHead(T5Model(tiny_seq2seq_lm("t5").config))


@pytest.mark.parametrize("kwarg", ["torch_dtype", "dtype"])
def test_from_pretrained_in_bfloat16(saved_lm, kwarg):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation of torch_dtype either: it is passed on as dtype
        model = AutoModelForCausalLMWithValueHead.from_pretrained(saved_lm, **{kwarg: torch.bfloat16})
    assert {p.dtype for p in model.pretrained_model.parameters()} == {torch.bfloat16}
    assert model.v_head.summary.weight.dtype == torch.float32  # legacy's head kept float32 too
    logits, loss, values = model(torch.tensor([[5, 6, 7, 8]]))
    assert logits.dtype == values.dtype == torch.float32 and values.shape == (1, 4)
    assert torch.isfinite(logits).all() and torch.isfinite(values).all() and loss is None
    default = AutoModelForCausalLMWithValueHead.from_pretrained(saved_lm)
    assert {p.dtype for p in default.parameters()} == {torch.float32}


def test_class_attributes_legacy_code_reads():
    assert AutoModelForCausalLMWithValueHead.transformers_parent_class is AutoModelForCausalLM
    assert AutoModelForSeq2SeqLMWithValueHead.transformers_parent_class is AutoModelForSeq2SeqLM
    assert AutoModelForCausalLMWithValueHead.lm_head_namings == ["lm_head", "embed_out"]
    assert AutoModelForSeq2SeqLMWithValueHead.lm_head_namings == ["lm_head", "embed_out", "output_projection"]
    for cls in (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead):
        assert cls.supported_args == ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
        assert cls.supported_modules == ("v_head",)


def test_post_init_and_init_weights():
    model = tiny_value_model("gpt2")
    model._init_weights(v_head_initializer_range=0.2, v_head_init_strategy="normal")
    assert torch.equal(model.v_head.summary.bias, torch.zeros(1))
    weight, bias = torch.full((1, 32), 0.25), torch.tensor([-1.5])
    model.post_init({"v_head.summary.weight": weight, "v_head.summary.bias": bias, "transformer.wte.weight": None})
    assert torch.equal(model.v_head.summary.weight, weight) and torch.equal(model.v_head.summary.bias, bias)


def fake_hub(monkeypatch):
    """``HfApi.create_repo``/``upload_folder`` recording what would be uploaded (nothing leaves the machine)."""
    import huggingface_hub

    uploads = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: repo_id)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, repo_id, folder_path, **kw: uploads.append(
        (repo_id, sorted(os.listdir(folder_path)), kw)))
    return uploads


def test_model_push_to_hub_uploads_the_value_head_too(monkeypatch):
    uploads = fake_hub(monkeypatch)
    tiny_value_model("gpt2").push_to_hub("me/policy", commit_message="ppo")
    (repo, files, kwargs), = uploads
    assert repo == "me/policy" and kwargs == {"commit_message": "ppo"}
    assert {"config.json", "model.safetensors", "value_head.safetensors"} <= set(files)
    tiny_value_model("gpt2").push_to_hub("me/sharded", max_shard_size="20KB")  # a save_pretrained option
    assert "model.safetensors.index.json" in uploads[1][1] and uploads[1][2] == {}


# ---- 6. quantised loading, adapters ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"load_in_8bit": True}, {"load_in_4bit": True},
                                    {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)}])
def test_quantised_loading_is_one_clear_error(saved_lm, kwargs):
    with pytest.raises(ValueError, match=r"quantised.*dtype=torch\.bfloat16.*peft_config=LoraConfig") as err:
        AutoModelForCausalLMWithValueHead.from_pretrained(saved_lm, **kwargs)
    assert next(iter(kwargs)) in str(err.value)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(saved_lm, load_in_8bit=False, load_in_4bit=False)
    assert model.pretrained_model.dtype == torch.float32  # False: plain loading, as legacy


def test_is_trainable_loads_a_saved_adapter_trainable_or_frozen(saved_lm, tmp_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(saved_lm, peft_config=tiny_lora_config())
    randomize_lora(model)
    model.save_pretrained(str(tmp_path))
    for kwargs, trainable in (({}, True), ({"is_trainable": True}, True), ({"is_trainable": False}, False)):
        loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path), **kwargs)
        lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        assert lora and all(p.requires_grad == trainable for p in lora.values()), kwargs
        assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in lora.items())


# ---- 4. the trainer's legacy methods, by hand ---------------------------------------------------------------------
def test_compute_advantages_by_hand():
    trainer = trainer_for(gamma=0.5, lam=0.5)
    values = t([[1.0, 2.0, 3.0], [0.5, 4.0, 9.0]]).requires_grad_()
    rewards = t([[0.0, 0.0, 1.0], [2.0, 7.0, 9.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    vals, advantages, returns = trainer.compute_advantages(values, rewards, mask)
    # legacy: values and rewards masked first (row 1: V = [0.5, 0, 0], r = [2, 0, 0]); V beyond the end is 0;
    # delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, gamma = lam = 0.5
    # row 0: d2 = 1 + 0 - 3 = -2 -> A2 = -2; d1 = 0 + 0.5*3 - 2 = -0.5 -> A1 = -0.5 + 0.25*-2 = -1;
    #        d0 = 0 + 0.5*2 - 1 = 0 -> A0 = 0 + 0.25*-1 = -0.25
    # row 1: A2 = A1 = 0; d0 = 2 + 0.5*0 - 0.5 = 1.5 -> A0 = 1.5
    raw = t([[-0.25, -1.0, -2.0], [1.5, 0.0, 0.0]])
    torch.testing.assert_close(vals, t([[1.0, 2.0, 3.0], [0.5, 0.0, 0.0]]), atol=0, rtol=0)
    torch.testing.assert_close(returns, raw + vals.detach(), atol=1e-6, rtol=0)  # [[0.75, 1, 1], [2, 0, 0]]
    # whitened over the 4 valid tokens [-0.25, -1, -2, 1.5]: mean -0.4375, unbiased variance 6.546875 / 3
    mean, var = -0.4375, 6.546875 / 3
    expected = (raw - mean) / (var + 1e-8) ** 0.5 * mask  # zero at padding (legacy whitened it too: a fixed bug)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    assert not advantages.requires_grad and not returns.requires_grad


def test_compute_advantages_whitens_the_rewards_first_when_asked():
    trainer = trainer_for(gamma=1.0, lam=1.0, whiten_rewards=True)
    values, mask = torch.zeros(1, 2), torch.ones(1, 2)
    _, _, returns = trainer.compute_advantages(values, t([[1.0, 3.0]]), mask)
    # rewards whitened keeping their mean (legacy shift_mean=False): mean 2, unbiased var 2 ->
    # [2 - 1/sqrt 2, 2 + 1/sqrt 2]; with V = 0, gamma = lam = 1 the returns are the reward-to-go
    s = 2 ** -0.5
    torch.testing.assert_close(returns, t([[4.0, 2 + s]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode, expected", [("kl", [[0.5, -1.0]]), ("abs", [[0.5, 1.0]]), ("mse", [[0.125, 0.5]])])
def test_kl_penalty_by_hand(mode, expected):
    # logp - ref = [0.5, -1.0]; abs: |.|; mse: 0.5 * (.)^2
    trainer = trainer_for(kl_penalty=mode)
    torch.testing.assert_close(trainer._kl_penalty(t([[-1.0, -2.0]]), t([[-1.5, -1.0]])), t(expected))


def test_full_kl_penalty_by_hand():
    trainer = trainer_for(kl_penalty="full")
    logp, logq = torch.log(t([[[0.5, 0.5]]])), torch.log(t([[[0.25, 0.75]]]))  # (B=1, R=1, V=2)
    # KL(p || q) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln(4/3)
    expected = t([[0.5 * torch.log(t(4 / 3)).item()]])
    torch.testing.assert_close(trainer._kl_penalty(logp, logq), expected, atol=1e-7, rtol=0)
    legacy = torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)  # legacy's expression
    torch.testing.assert_close(trainer._kl_penalty(logp, logq), legacy, atol=1e-7, rtol=0)


def test_compute_rewards_by_hand():
    trainer = trainer_for(kl_penalty="kl", init_kl_coef=0.2)
    logprobs, ref, mask = t([[-1.0, -2.0, -3.0]]), t([[-1.5, -1.0, -3.0]]), t([[1, 1, 0]])
    rewards, non_score, kls = trainer.compute_rewards(t([2.0]), logprobs, ref, mask)
    # kl = [0.5, -1.0, (padding) 0]; non-score = -0.2 kl = [-0.1, 0.2, 0]; the score 2 on the last valid token
    torch.testing.assert_close(kls, t([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(non_score, t([[-0.1, 0.2, 0.0]]))
    torch.testing.assert_close(rewards, t([[-0.1, 2.2, 0.0]]))

    full = trainer_for(kl_penalty="full", init_kl_coef=0.2)
    logp = torch.log(t([[[0.5, 0.5], [1.0, 0.0]]])).clamp(min=-1e9)  # (1, 2, 2); position 1: p = q
    logq = torch.log(t([[[0.25, 0.75], [1.0, 0.0]]])).clamp(min=-1e9)
    rewards, _, kls = full.compute_rewards(t([1.0]), logp, logq, t([[1, 1]]))
    kl0 = 0.5 * torch.log(t(4 / 3)).item()
    torch.testing.assert_close(kls, t([[kl0, 0.0]]), atol=1e-7, rtol=0)
    torch.testing.assert_close(rewards, t([[-0.2 * kl0, 1.0]]), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match=r"\(B, R, V\)"):
        full.compute_rewards(t([1.0]), logprobs, ref, mask)


def test_generate_batched_is_what_generate_runs():
    trainer = trainer_for()
    queries = random_queries(3, seed=4)
    kwargs = dict(do_sample=False, max_new_tokens=4, pad_token_id=PAD)
    direct = trainer._generate_batched(trainer.model, queries, batch_size=2, return_prompt=False,
                                       pad_to_multiple_of=8, **kwargs)
    assert [r.tolist() for r in direct] == [r.tolist() for r in trainer.generate(queries, batch_size=2,
                                                                                   return_prompt=False, **kwargs)]
    with pytest.raises(ValueError, match="remove_padding"):
        trainer._generate_batched(trainer.model, queries, remove_padding=False, **kwargs)


def test_small_legacy_helpers():
    trainer = trainer_for()
    def target(a, b=1):
        return a, b
    assert trainer._filter_kwargs({"a": 1, "b": 2, "c": 3}, target) == {"a": 1, "b": 2}
    trainer._set_signature_columns_if_needed()
    assert {"input_ids", "attention_mask", "query", "response", "label"} <= set(trainer._signature_columns)
    assert trainer.is_encoder_decoder is False and trainer.is_peft_model is False
    with trainer.optional_peft_ctx():
        pass
    with pytest.warns(UserWarning, match="training_data_collator is not used"):
        PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), tiny_value_model(), tokenizer=tiny_tokenizer(),
                   dataset=PairDataset(), training_data_collator=lambda rows: rows)


def test_prepare_deepspeed_without_deepspeed_places_the_model_for_inference():
    trainer = trainer_for()
    reward = AutoModelForCausalLM.from_config(tiny_causal_lm("gpt2").config).train()
    placed = trainer._prepare_deepspeed(reward)
    assert placed is reward and not placed.training and placed.device == trainer.current_device


def test_trainer_save_pretrained_writes_model_value_head_tokenizer_and_card(tmp_path):
    trainer = trainer_for()
    target = tmp_path / "out"
    trainer.save_pretrained(str(target))
    files = set(os.listdir(target))
    assert {"config.json", "model.safetensors", "value_head.safetensors", "tokenizer.json", "README.md"} <= files
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(target))
    expected = trainer.model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())


def test_trainer_push_to_hub_and_push_if_best(monkeypatch):
    uploads = fake_hub(monkeypatch)
    trainer = trainer_for(push_to_hub_if_best_kwargs={"repo_id": "me/best"})
    trainer.push_to_hub("me/ppo")
    assert uploads[0][0] == "me/ppo" and {"value_head.safetensors", "README.md", "tokenizer.json"} <= set(uploads[0][1])
    queries = random_queries(4, seed=1)
    trainer.step(queries, [torch.tensor([5, 6])] * 4, [torch.tensor(1.0)] * 4)  # the best mean score so far
    assert [repo for repo, *_ in uploads] == ["me/ppo", "me/best"]


def test_every_legacy_method_is_there():
    """Every method of trl 0.11.4's PPOTrainer (and of its BaseTrainer and PyTorchModelHubMixin that users call) but
    those docs/library.md lists as dropped (``_show_tokens``; ``from_pretrained``, which builds no trainer)."""
    legacy = ["__init__", "_filter_kwargs", "prepare_dataloader", "_set_signature_columns_if_needed",
              "_remove_unused_columns", "generate", "_generate_batched", "_step_safety_checker", "step", "_early_stop",
              "gather_stats", "prepare_model_inputs", "batched_forward_pass", "train_minibatch", "compute_rewards",
              "_kl_penalty", "compute_advantages", "loss", "record_step_stats", "log_stats", "create_model_card",
              "_save_pretrained", "_prepare_deepspeed", "save_pretrained", "push_to_hub"]
    assert [name for name in legacy if not callable(getattr(PPOTrainer, name, None))] == []
    for cls in (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead):
        names = ["from_pretrained", "save_pretrained", "push_to_hub", "state_dict", "post_init", "forward",
                 "generate", "_init_weights", "_has_lm_head", "gradient_checkpointing_enable",
                 "gradient_checkpointing_disable", "enable_input_require_grads"]
        assert [name for name in names if not callable(getattr(cls, name, None))] == [], cls
    model = tiny_value_model("gpt2")
    assert model._has_lm_head()
    model.gradient_checkpointing_enable()
    assert model.pretrained_model.is_activation_checkpointing
    model.gradient_checkpointing_disable()
    assert not model.pretrained_model.is_activation_checkpointing


def test_prefixed_state_dict_metadata_survives_a_round_trip():
    model = tiny_value_model("gpt2")
    state = model.state_dict()
    assert isinstance(state, OrderedDict) and "transformer.h.0" in state._metadata  # as the plain model's own
    assert not any(name.startswith("pretrained_model") for name in state._metadata)


def test_generate_cuts_at_the_tokenizer_eos_whatever_eos_token_id_generation_was_given():
    """stack-llama and the T5 example pass an ``eos_token_id`` that never comes (100_000, -1) so that sampling runs
    the full length; legacy then cut each response after the first EOS of the tokenizer, as ppo_core does."""
    trainer = trainer_for()
    torch.manual_seed(0)
    queries = random_queries(16, seed=5)
    for stop in (100_000, -1):
        responses = trainer.generate(queries, return_prompt=False, batch_size=8, max_new_tokens=12, do_sample=True,
                                     top_k=0, pad_token_id=PAD, eos_token_id=stop)
        assert all(EOS not in r[:-1].tolist() for r in responses)  # nothing after the first EOS
        cut = [r for r in responses if len(r) < 12]
        assert cut and all(r[-1].item() == EOS for r in cut)  # a shorter response ends at its EOS


def test_the_rest_of_legacy_trl_core_imports_and_computes():
    from ppo_core.core import (
        PPODecorators,
        add_suffix,
        average_torch_dicts,
        build_bert_batch_from_txt,
        pad_to_size,
        randn_tensor,
        respond_to_batch,
        set_seed,
        top_k_top_p_filtering,
    )

    assert add_suffix({"a": 1}, "_x") == {"a_x": 1}
    torch.testing.assert_close(average_torch_dicts([{"a": t([1.0, 2.0])}, {"a": t([3.0, 6.0])}])["a"], t([2.0, 4.0]))
    assert pad_to_size(torch.tensor([[5, 6]]), 4, padding=0).tolist() == [[5, 6, 0, 0]]
    logits = t([[0.0, 3.0, 1.0, 2.0]])
    assert torch.isinf(top_k_top_p_filtering(logits, top_k=2)).tolist() == [[True, False, True, False]]
    # softmax of (0, 3, 1, 2): 0.03, 0.64, 0.09, 0.24: the nucleus of 0.8 holds 3 and 2, that of 1.0 everything
    assert torch.isinf(top_k_top_p_filtering(logits, top_p=0.8)).tolist() == [[True, False, True, False]]
    assert not torch.isinf(top_k_top_p_filtering(logits)).any()

    model = tiny_causal_lm("gpt2", seed=1).eval()
    set_seed(3)
    queries = torch.tensor([[5, 6, 7], [8, 9, 10]])
    first = respond_to_batch(model, queries, txt_len=5, top_k=4)
    set_seed(3)
    assert first.shape == (2, 5) and torch.equal(first, respond_to_batch(model, queries, txt_len=5, top_k=4))
    with torch.no_grad():  # each sampled token is among the 4 likeliest after what precedes it
        logits = model(torch.cat([queries, first], dim=1)).logits[:, 2:-1]
    assert all(tok in top for tok, top in zip(first.flatten().tolist(), logits.topk(4).indices.flatten(0, 1).tolist()))

    ids, masks = build_bert_batch_from_txt(["w3 w4 w5", "w6"], tiny_tokenizer(), "cpu")
    assert ids.tolist() == [[3, 4, 5], [6, 0, 0]] and masks.tolist() == [[1, 1, 1], [1, 0, 0]]
    g = torch.Generator().manual_seed(0)
    noise = randn_tensor((2, 3), generator=g)
    assert torch.equal(noise, torch.randn((2, 3), generator=torch.Generator().manual_seed(0)))

    calls = []

    @PPODecorators.empty_device_cache()
    def step():
        calls.append(1)
        return "stats"

    assert step() == "stats" and calls == [1]


def test_value_head_model_attributes_legacy_code_reads():
    import ppo_core

    model = tiny_value_model("gpt2")
    assert model.is_loaded_in_8bit is False and model.is_loaded_in_4bit is False
    assert model.supports_rm_adapter is False and model.rm_adapter_name is None
    assert model.policy_adapter_name == "default"
    inputs = model.prepare_inputs_for_generation(torch.tensor([[3, 4]]))
    assert inputs["input_ids"].tolist() == [[3, 4]]
    assert ppo_core.SUPPORTED_ARCHITECTURES == (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead)


def test_numpy_scalars_are_numbers_as_in_legacy():
    import numpy as np

    config = PPOConfig(learning_rate=np.float32(1e-5), ppo_epochs=np.int64(2), batch_size=np.int32(8),
                       mini_batch_size=2)
    assert config.learning_rate == pytest.approx(1e-5) and type(config.learning_rate) is float
    assert config.ppo_epochs == 2 and type(config.ppo_epochs) is int and config.batch_size == 8
    with pytest.raises(ValueError, match=r"PPOConfig.ppo_epochs must be an integer"):
        PPOConfig(ppo_epochs=np.float64(2.5))


class TokenLevelRewards(PPOTrainer):
    """Issue #1395's recipe: a reward on every response token, by overriding compute_rewards."""

    calls: list = []

    def compute_rewards(self, scores, logprobs, ref_logprobs, masks):
        rewards, non_score, kls = super().compute_rewards(scores, logprobs, ref_logprobs, masks)
        type(self).calls.append((scores.shape, logprobs.shape, masks.shape))
        return rewards + 0.5 * masks, non_score, kls


class SuperOnly(PPOTrainer):
    def compute_rewards(self, *args):
        return super().compute_rewards(*args)

    def compute_advantages(self, *args):
        return super().compute_advantages(*args)


def step_with(cls, **config):
    trainer = trainer_for(cls=cls, **config)
    queries, responses = random_queries(4, seed=1), random_queries(4, seed=2)
    return trainer, trainer.step(queries, responses, [t(1.0), t(-1.0), t(0.5), t(0.0)])


def test_step_calls_a_subclass_s_compute_rewards_and_compute_advantages_as_legacy_did():
    _, base = step_with(PPOTrainer)
    _, same = step_with(SuperOnly)  # the hooks as they are: the step is the same, bit for bit
    assert same.keys() == base.keys()
    for key in base:
        if not key.startswith("time/"):
            assert same[key] == pytest.approx(base[key], abs=0, rel=0, nan_ok=True), key
    TokenLevelRewards.calls.clear()
    _, token_level = step_with(TokenLevelRewards)
    longest = max(map(len, random_queries(4, seed=2)))
    assert TokenLevelRewards.calls == [(torch.Size([4]), torch.Size([4, longest]), torch.Size([4, longest]))]
    assert token_level["ppo/returns/mean"] > base["ppo/returns/mean"] + 0.4  # +0.5 on every token, discounted


class LegacyLoss(PPOTrainer):
    """TRL 0.11's exact signature, as a subclass written for it has: none of the keywords ppo_core adds."""

    calls: list = []

    def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns):
        type(self).calls.append((logits, tuple(mask.shape)))
        loss_p, loss_v, stats = super().loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages,
                                             returns)
        return loss_p, 0.0 * loss_v, stats  # the value loss off: the value head does not train


class LegacyTrainMinibatch(PPOTrainer):
    calls: list = []

    def train_minibatch(self, old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns):
        type(self).calls.append(tuple(mask.shape))
        return super().train_minibatch(old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns)


def test_step_calls_a_loss_or_train_minibatch_override_with_legacy_s_signature():
    """A subclass written for TRL 0.11 overrides ``loss`` or ``train_minibatch`` with its eight positional arguments:
    ``step`` calls it once per mini-batch in legacy's order (``logits`` None: the pass never materialises them)."""
    base, base_stats = step_with(PPOTrainer)
    LegacyTrainMinibatch.calls.clear()
    via_override, stats = step_with(LegacyTrainMinibatch)
    assert [shape[0] for shape in LegacyTrainMinibatch.calls] == [2, 2]  # 4 samples, mini-batches of 2, one epoch
    for (name, p), q in zip(via_override.model.named_parameters(), base.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)  # the same update, bit for bit
    # the same stats, but the entropy: a legacy signature takes no per-token entropy, and logits are None
    assert set(base_stats) - set(stats) == {"ppo/policy/entropy"}
    assert stats["ppo/loss/total"] == base_stats["ppo/loss/total"]
    LegacyLoss.calls.clear()
    trainer, _ = step_with(LegacyLoss)
    assert [logits for logits, _ in LegacyLoss.calls] == [None, None]
    start = dict(tiny_value_model("gpt2").named_parameters())  # trainer_for's model, before the step
    moved = {n: not torch.equal(p, start[n]) for n, p in trainer.model.named_parameters()}
    base_moved = {n: not torch.equal(p, start[n]) for n, p in base.model.named_parameters()}
    assert base_moved["v_head.summary.weight"] and not moved["v_head.summary.weight"]  # the override's loss trained
    assert moved["pretrained_model.transformer.h.1.mlp.c_proj.weight"]  # the policy loss did


def test_the_step_s_mini_batches_go_to_the_engine_not_through_the_legacy_methods(monkeypatch):
    """Without an override, ``step`` hands each ``Rollout`` mini-batch to ``step.update.ppo_loss``: the legacy
    ``train_minibatch``, ``loss`` and ``batched_forward_pass`` are never called (a direct call still works)."""
    from unittest import mock

    from ppo_core.legacy import LegacyMethods

    called = {name: mock.Mock(side_effect=AssertionError(name)) for name in
              ("train_minibatch", "loss", "batched_forward_pass", "compute_rewards", "compute_advantages")}
    for name, fake in called.items():
        monkeypatch.setattr(LegacyMethods, name, fake)
    _, stats = step_with(PPOTrainer)
    assert stats["ppo/loss/total"] is not None and not any(fake.called for fake in called.values())


def test_step_hooks_that_step_cannot_call_are_said():
    with pytest.raises(ValueError, match=r"TokenLevelRewards overrides compute_rewards, which step\(\) calls as legacy "
                                         r"did only with advantage_estimator='gae'"):
        step_with(TokenLevelRewards, advantage_estimator="grpo", num_generations=2)

    class OwnForward(PPOTrainer):
        def batched_forward_pass(self, *args, **kwargs):
            return super().batched_forward_pass(*args, **kwargs)

    with pytest.warns(UserWarning, match="OwnForward overrides batched_forward_pass, which ppo_core's step"):
        OwnForward(PPOConfig(batch_size=4, mini_batch_size=2), tiny_value_model(), tokenizer=tiny_tokenizer(),
                   dataset=PairDataset())

    class OwnStats(PPOTrainer):  # legacy step() called these; ppo_core's computes its stats itself
        def record_step_stats(self, kl_coef, **data):
            return super().record_step_stats(kl_coef, **data)

    with pytest.warns(UserWarning, match="OwnStats overrides record_step_stats, which ppo_core's step"):
        OwnStats(PPOConfig(batch_size=4, mini_batch_size=2), tiny_value_model(), tokenizer=tiny_tokenizer(),
                 dataset=PairDataset())


def test_a_patched_zero_grad_keeps_the_gradients_as_in_trl_s_own_tests():
    """TRL's legacy tests patch ``optimizer.zero_grad`` with ``set_to_none=False`` to see, after ``step``, which weights
    trained: the trainer calls it bare, as legacy did, so the patch decides (by default the gradients are freed)."""
    from functools import partial

    trainer = trainer_for(batch_size=2, mini_batch_size=1)
    queries, responses = random_queries(2, seed=1), random_queries(2, seed=2)
    trainer.step(queries, responses, [t(1.0), t(0.0)])
    assert all(p.grad is None for p in trainer.model.parameters())  # the default: freed
    trainer.optimizer.zero_grad = partial(trainer.optimizer.zero_grad, set_to_none=False)
    trainer.step(queries, responses, [t(1.0), t(0.0)])
    trained = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad), trained
    assert all(p.grad is None for p in trainer.ref_model.parameters())


def test_batched_forward_pass_is_differentiable_as_legacy_s():
    """Legacy's step used ``batched_forward_pass`` for the training forward too: a custom loop can backpropagate."""
    trainer = trainer_for()
    queries, responses = random_queries(4, seed=1), random_queries(4, seed=2)
    logprobs, logits, values, masks = trainer.batched_forward_pass(trainer.model, queries, responses,
                                                                   return_logits=True)
    assert logprobs.requires_grad and values.requires_grad and logits.requires_grad
    ((logprobs + values) * masks).sum().backward()
    assert trainer.model.v_head.summary.weight.grad is not None
    with torch.no_grad():  # a rollout pass: nothing to backpropagate
        assert not trainer.batched_forward_pass(trainer.model, queries, responses)[0].requires_grad
