"""Multi-adapter RL (legacy TRL's ``reward_adapter``): a PEFT reward model loaded beside the policy's adapter on one
copy of the base weights scores exactly as the saved reward model does, leaves the policy's adapter active, and
nothing of it trains. Written as a migrating user's code: a reward model trained with peft ``task_type="SEQ_CLS"``
and saved with ``save_pretrained``, then the legacy docs' loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft")
import peft
from transformers import AutoModelForSequenceClassification

from ppo_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer
from ppo_core.models.training import disable_dropout
from tests.tiny import PAD, VOCAB, random_queries, tiny_causal_lm, tiny_lora_config, tiny_seq2seq_lm, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

GEN = dict(max_new_tokens=6, do_sample=True, top_k=0, top_p=1.0, pad_token_id=PAD)


def randomized(model, names: str, seed: int) -> None:
    """Random values in the parameters whose name contains `names` (a fresh LoRA is the identity, a fresh head ~0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if names in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(3, 7)`` ids right-padded to mixed lengths, and their attention mask."""
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, length in enumerate((7, 4, 5)):
        ids[row, length:], mask[row, length:] = PAD, 0
    return ids, mask


def policy_params(name: str) -> bool:
    return ".default." in name or name.startswith("v_head.")  # the policy's adapter ("default") and the value head


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A base model, and a reward model trained on it as a LoRA adapter with its score head (random stand-ins for the
    trained values), both saved with save_pretrained."""
    base_dir, rm_dir = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("reward_adapter")
    tiny_causal_lm("gpt2").save_pretrained(str(base_dir))
    rm = AutoModelForSequenceClassification.from_pretrained(str(base_dir), num_labels=1)
    rm.config.pad_token_id = PAD
    rm = peft.get_peft_model(rm, tiny_lora_config(task_type="SEQ_CLS"))  # the score head goes to modules_to_save
    randomized(rm, "lora_B", seed=1)
    randomized(rm, "score", seed=2)
    rm.save_pretrained(str(rm_dir))
    return SimpleNamespace(base_dir=str(base_dir), rm_dir=str(rm_dir))


def policy_with_reward_adapter(saved, **kwargs):
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        saved.base_dir, peft_config=tiny_lora_config(task_type="CAUSAL_LM"), reward_adapter=saved.rm_dir, **kwargs)
    randomized(model, "lora_B.default", seed=3)  # the policy's adapter differs from the reward model's
    return model


def saved_reward_model_logits(saved, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved reward model loaded with peft on the base: its per-position logits (B, T, 1), what its score head
    outputs before pooling, and its pooled logits (B, 1)."""
    rm = AutoModelForSequenceClassification.from_pretrained(saved.base_dir, num_labels=1)
    rm = peft.PeftModel.from_pretrained(rm, saved.rm_dir).eval()
    captured = []
    rm.base_model.model.score.register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad():
        pooled = rm(input_ids=ids, attention_mask=mask).logits
    return captured[0], pooled


def test_scores_equal_the_saved_reward_model_at_every_position(saved):
    model = policy_with_reward_adapter(saved)
    ids, mask = padded_batch()
    scores = model.compute_reward_score(ids, attention_mask=mask)
    per_position, pooled = saved_reward_model_logits(saved, ids, mask)
    assert scores.shape == (3, 7, 1) and scores.dtype == torch.float32  # legacy: score(last hidden states)
    assert torch.equal(scores, per_position)
    last = mask.sum(-1) - 1  # the reward of a right-padded sequence: its last token's row
    assert torch.equal(scores[torch.arange(3), last], pooled)
    assert not scores.requires_grad


def test_the_policy_adapter_is_active_again_and_nothing_else_changes(saved):
    model = policy_with_reward_adapter(saved, reward_adapter_name="rm")
    lm = model.pretrained_model
    assert model.supports_rm_adapter and model.rm_adapter_name == "rm" and model.policy_adapter_name == "default"
    assert set(lm.peft_config) == {"default", "rm"}
    disable_dropout(model)  # as PPOTrainer does: the train-mode outputs are then comparable
    ids, mask = padded_batch(seed=1)
    for mode in (True, False):
        model.train(mode)
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        with torch.no_grad():
            before = model(ids, attention_mask=mask)[0]
        model.compute_reward_score(ids, attention_mask=mask)
        assert lm.active_adapter == "default" and all(m.training == mode for m in model.modules())
        assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
        with torch.no_grad():
            assert torch.equal(model(ids, attention_mask=mask)[0], before)  # the policy's adapter, not the reward's
    trainable = {n for n, flag in flags.items() if flag}
    assert trainable and all(policy_params(n) for n in trainable)  # nothing of the reward model, nor the base


def test_a_saved_policy_adapter_loads_with_the_reward_adapter(saved, tmp_path):
    policy = policy_with_reward_adapter(saved).eval()
    policy.pretrained_model.save_pretrained(str(tmp_path), selected_adapters=["default"])
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path), reward_adapter=saved.rm_dir).eval()
    ids, mask = padded_batch(seed=2)
    assert torch.equal(loaded.compute_reward_score(ids, mask), saved_reward_model_logits(saved, ids, mask)[0])
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask)[0], policy(ids, attention_mask=mask)[0])


def test_ppo_steps_train_only_the_policy_adapter_and_the_value_head(saved):
    """The legacy docs' loop: the reward comes from trainer.model.compute_reward_score on the query + response."""
    model = policy_with_reward_adapter(saved)
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-2, seed=0)
    trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tiny_tokenizer())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for n, p in model.named_parameters() if policy_params(n)}
    for step in range(2):
        queries = random_queries(4, seed=step)
        responses = trainer.generate(queries, return_prompt=False, **GEN)
        texts = [torch.cat([q, r]) for q, r in zip(queries, responses)]
        ids = torch.nn.utils.rnn.pad_sequence(texts, batch_first=True, padding_value=PAD)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(t) for t in texts], batch_first=True)
        scores = trainer.model.compute_reward_score(ids, attention_mask=mask)  # (B, T, 1)
        rewards = scores[torch.arange(len(texts)), mask.sum(-1) - 1, 0]
        trainer.step(queries, responses, list(rewards))
    for name, param in model.named_parameters():
        if policy_params(name):
            assert param.requires_grad and not torch.equal(param, before[name]), f"{name} did not train"
        else:  # the base, the reward adapter and its score head
            assert not param.requires_grad and torch.equal(param, before[name]), f"{name} changed"
    assert model.score.weight.grad is None and model.pretrained_model.active_adapter == "default"
    ids, mask = padded_batch(seed=3)
    assert torch.equal(model.compute_reward_score(ids, mask), saved_reward_model_logits(saved, ids, mask)[0])


def test_under_bf16_autocast_the_cast_reward_model_scores_in_bf16(saved):
    """A bf16 trainer casts the frozen matmul weights (the reward adapter's and its head included) to bf16 once: the
    reward pass then runs under bf16 autocast, and agrees with the float32 scores to bf16's precision."""
    ids, mask = padded_batch(seed=4)
    exact = policy_with_reward_adapter(saved).compute_reward_score(ids, mask)
    model = policy_with_reward_adapter(saved)
    config = PPOConfig(batch_size=4, mini_batch_size=2, accelerator_kwargs={"mixed_precision": "bf16"})
    PPOTrainer(config, model, ref_model=None, tokenizer=tiny_tokenizer())
    assert model.score.weight.dtype == torch.bfloat16
    scores = model.compute_reward_score(ids, mask)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, exact, atol=0.05, rtol=0.02)  # bf16 keeps ~3 significant digits


def test_reward_adapter_errors_are_actionable(saved, tmp_path):
    def load(reward_adapter, base=saved.base_dir, **kwargs):  # a fresh LoraConfig each time (peft writes in it)
        return AutoModelForCausalLMWithValueHead.from_pretrained(
            base, peft_config=tiny_lora_config(task_type="CAUSAL_LM"), reward_adapter=reward_adapter, **kwargs)

    with pytest.raises(ValueError, match="needs a PEFT policy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(saved.base_dir, reward_adapter=saved.rm_dir)
    with pytest.raises(ValueError, match="does not support reward modeling adapter"):
        AutoModelForCausalLMWithValueHead.from_pretrained(saved.base_dir).compute_reward_score(padded_batch()[0])
    with pytest.raises(ValueError, match=r"no adapter_config.json in .*; pass the directory that save_pretrained"):
        load(saved.base_dir)
    with pytest.raises(ValueError, match="must be the directory"):
        load(object())
    policy_adapter = tmp_path / "policy_adapter"  # a causal-LM adapter: no score head
    load(saved.rm_dir).pretrained_model.save_pretrained(str(policy_adapter), selected_adapters=["default"])
    with pytest.raises(ValueError, match=r"no score head .*task_type='SEQ_CLS'"):
        load(policy_adapter)
    with pytest.raises(ValueError, match="already has an adapter named 'default'"):
        load(saved.rm_dir, reward_adapter_name="default")
    wider = tmp_path / "wider_base"
    tiny_causal_lm("gpt2", hidden=64).save_pretrained(str(wider))
    with pytest.raises(ValueError, match="32-wide hidden states, the policy's are 64-wide"):
        load(saved.rm_dir, base=str(wider))
    with pytest.raises(ValueError, match="causal LMs only"):
        AutoModelForSeq2SeqLMWithValueHead.from_pretrained(
            tiny_seq2seq_lm("t5"), peft_config=tiny_lora_config(target_modules=("q", "v")), reward_adapter=saved.rm_dir)
