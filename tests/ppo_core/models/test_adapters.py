"""LoRA policies: the adapter-disabled model as the reference (no second copy of the base weights), only the
adapter and the value head trained, the adapter saved and reloaded, and a merged model for plain transformers."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft")
import peft
from transformers import AutoModelForCausalLM

from ppo_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer
from ppo_core.models.modeling import VALUE_HEAD_FILE
from ppo_core.step.inputs import build_model_inputs
from ppo_core.step.rollout import policy_outputs, rollout_passes
from tests.ppo_core.models.test_modeling import legacy_logprobs_and_values, mixed_batch
from tests.ppo_core.test_trainer import LEGACY_KEYS, assert_all_finite
from tests.tiny import (
    PAD,
    VOCAB,
    random_queries,
    randomize_lora,
    tiny_causal_lm,
    tiny_lora_config,
    tiny_seq2seq_lm,
    tiny_tokenizer,
)

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

GEN = dict(max_new_tokens=6, do_sample=True, top_k=0, top_p=1.0, pad_token_id=PAD)


def is_adapter_or_head(name: str) -> bool:
    return "lora_" in name or name.startswith("v_head.")


def ppo_config(**overrides) -> PPOConfig:
    options = dict(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-2, seed=0)
    return PPOConfig(**{**options, **overrides})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A LoRA GPT-2 loaded from a local base checkpoint, trained for two PPO steps."""
    base_dir = tmp_path_factory.mktemp("base")
    tiny_causal_lm("gpt2").save_pretrained(str(base_dir))
    torch.manual_seed(1)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(base_dir), peft_config=tiny_lora_config())
    randomize_lora(model)  # a fresh adapter is the identity: make adapter-on and adapter-off differ from step 1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = PPOTrainer(ppo_config(), model, tokenizer=tiny_tokenizer())
    stats = []
    for step in range(2):
        queries = random_queries(4, seed=step)
        responses = trainer.generate(queries, return_prompt=False, **GEN)
        scores = [torch.tensor(float(len(r))) for r in responses]
        stats.append(trainer.step(queries, responses, scores))
    base = AutoModelForCausalLMWithValueHead(AutoModelForCausalLM.from_pretrained(str(base_dir))).eval()
    return SimpleNamespace(base_dir=base_dir, model=model, trainer=trainer, stats=stats, before=before, base=base)


def test_from_pretrained_with_a_lora_config_freezes_the_base(run):
    assert run.model.is_peft_model and isinstance(run.model.pretrained_model, peft.PeftModel)
    assert run.trainer.config.is_peft_model and not run.trainer.config.is_encoder_decoder
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_or_head(n) for n in trainable)
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= trainable
    optimised = {id(p) for group in run.trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for n, p in run.model.named_parameters() if n in trainable}


def test_lora_ppo_steps_have_finite_stats(run):
    for stats in run.stats:
        assert not [k for k in LEGACY_KEYS if k not in stats]
        assert_all_finite(stats)
    assert run.stats[0]["objective/kl"] != 0  # the randomised adapter differs from the base from the start


def test_only_the_adapter_and_the_value_head_change(run):
    for name, param in run.model.named_parameters():
        if is_adapter_or_head(name):
            assert not torch.equal(param, run.before[name]), f"{name} did not train"
        else:
            assert torch.equal(param, run.before[name]), f"base weight {name} changed"


def test_the_reference_is_the_adapter_disabled_policy_without_a_copy(run):
    trainer, model = run.trainer, run.model
    assert trainer.ref_model is None
    # one set of base weights in the trainer: the policy's parameters are the base's, plus adapter and head
    base_numel = sum(p.numel() for p in run.base.pretrained_model.parameters())
    extra = sum(p.numel() for n, p in model.named_parameters() if is_adapter_or_head(n))
    assert sum(p.numel() for p in trainer.model.parameters()) == base_numel + extra
    assert not any(isinstance(m, AutoModelForCausalLMWithValueHead) for m in vars(trainer).values()
                   if m is not trainer.model)

    queries, responses = mixed_batch()
    inputs = build_model_inputs(queries, responses, PAD)
    old, ref = rollout_passes(trainer.model, trainer.reference_policy, inputs, 4,
                              trainer._forward_precision)  # as step()
    with torch.no_grad():
        expected = policy_outputs(run.base, inputs).logprobs  # the untouched base model
    torch.testing.assert_close(ref.logprobs, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(old.logprobs, ref.logprobs, atol=1e-3)  # the adapter is back on after the pass


@pytest.mark.parametrize("adapter", ["on", "off"])
def test_fast_path_matches_the_full_forward_with_an_adapter(run, adapter):
    model = run.model.eval()
    queries, responses = mixed_batch(seed=1)
    inputs = build_model_inputs(queries, responses, PAD)
    ctx = model.pretrained_model.disable_adapter() if adapter == "off" else torch.enable_grad()
    with ctx, torch.no_grad():
        out = policy_outputs(model, inputs, with_entropy=True, chunk_size=3)
        for i, (q, r) in enumerate(zip(queries, responses)):
            logprobs, values = legacy_logprobs_and_values(model, q, r)  # through PeftModel.forward
            torch.testing.assert_close(out.logprobs[i, :len(r)], logprobs, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.values[i, :len(r)], values, atol=1e-5, rtol=0)


def greedy(model, queries):
    return [model.generate(input_ids=q[None], attention_mask=torch.ones_like(q[None]), max_new_tokens=5,
                           do_sample=False, pad_token_id=PAD)[0] for q in queries]


def test_saved_adapter_reloads_and_generates(run, tmp_path):
    run.model.eval().save_pretrained(str(tmp_path))
    files = {p.name for p in tmp_path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", VALUE_HEAD_FILE} <= files
    assert "model.safetensors" not in files  # the adapter only, not the base weights

    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path)).eval()
    assert loaded.is_peft_model
    state, expected = loaded.state_dict(), run.model.state_dict()
    assert state.keys() == expected.keys()
    for key in state:
        torch.testing.assert_close(state[key], expected[key], atol=0, rtol=0, msg=key)
    assert any(p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)  # ready to resume
    queries = random_queries(3, seed=7)
    with torch.no_grad():
        assert [g.tolist() for g in greedy(loaded, queries)] == [g.tolist() for g in greedy(run.model, queries)]

        # plain peft loads it too
        plain = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(run.base_dir)), str(tmp_path))
        input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(plain(input_ids).logits, run.model(input_ids)[0], atol=1e-6, rtol=0)


def test_merged_save_loads_in_plain_transformers(run, tmp_path):
    model = run.model.eval()
    base_before = {n: p.clone() for n, p in model.named_parameters() if not is_adapter_or_head(n)}
    model.save_pretrained(str(tmp_path), merge_adapter=True)
    assert not (tmp_path / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids).logits, model(input_ids)[0], atol=1e-5, rtol=0)
    # the model in memory keeps its adapter and its untouched base weights
    assert model.is_peft_model and any("lora_" in n for n, _ in model.named_parameters())
    for name, param in model.named_parameters():
        if name in base_before:
            assert torch.equal(param, base_before[name]), name
    merged = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert not merged.is_peft_model
    torch.testing.assert_close(merged.v_head.summary.weight, model.v_head.summary.weight, atol=0, rtol=0)


def test_a_peft_model_can_be_wrapped_directly():
    peft_model = peft.get_peft_model(tiny_causal_lm("gpt2"), tiny_lora_config())
    for model in (AutoModelForCausalLMWithValueHead(peft_model),
                  AutoModelForCausalLMWithValueHead.from_pretrained(peft_model)):
        assert model.is_peft_model and model.pretrained_model is peft_model
        assert model.transformers_model is peft_model.get_base_model()


def test_lora_encoder_decoder_policy_trains_only_its_adapter():
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(
        tiny_seq2seq_lm("t5"), peft_config=tiny_lora_config(target_modules=("q", "v")))
    randomize_lora(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = PPOTrainer(ppo_config(), model, tokenizer=tiny_tokenizer())
    assert trainer.ref_model is None and trainer.config.is_encoder_decoder and trainer.config.is_peft_model
    queries = random_queries(4, seed=3)
    responses = trainer.generate(queries, return_prompt=False, **GEN)
    stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert_all_finite(stats)
    assert stats["objective/kl"] != 0
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) != is_adapter_or_head(name), name


def test_peft_errors_are_actionable(run, tmp_path, monkeypatch):
    base = tiny_causal_lm("gpt2")
    with pytest.raises(ValueError, match="peft_config must be a peft.PeftConfig"):
        AutoModelForCausalLMWithValueHead.from_pretrained(base, peft_config=object())
    with pytest.raises(ValueError, match="merge_adapter=True needs a PEFT policy"):
        AutoModelForCausalLMWithValueHead(base).save_pretrained(str(tmp_path), merge_adapter=True)
    with pytest.raises(ValueError, match="prompt-learning"):
        AutoModelForCausalLMWithValueHead.from_pretrained(
            base, peft_config=peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match="LM head"):
        AutoModelForCausalLMWithValueHead.from_pretrained(
            tiny_causal_lm("llama"), peft_config=tiny_lora_config(target_modules=("lm_head",)))
    with pytest.raises(ValueError, match="LM head"):
        AutoModelForCausalLMWithValueHead.from_pretrained(
            tiny_causal_lm("gpt2"), peft_config=tiny_lora_config(modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="already has a PEFT adapter"):
        AutoModelForCausalLMWithValueHead.from_pretrained(run.model.pretrained_model, peft_config=tiny_lora_config())
    run.model.save_pretrained(str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="already holds an adapter"):
        AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "adapter"), peft_config=tiny_lora_config())
    config = tiny_lora_config()
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(ValueError, match=r"pip install peft"):
        AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"), peft_config=config)
    with pytest.raises(ValueError, match=r"pip install peft"):
        AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "adapter"))


def test_a_saved_adapter_is_the_same_bytes_whatever_the_hash_seed(tmp_path):
    """peft writes target_modules, a set, in the process's string-hash order: two runs of the same LoRA pipeline wrote
    two adapter_config.json files. Saved through ppo_core, the set-valued fields are sorted."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import torch; torch.manual_seed(0)\n"
            "from peft import LoraConfig\n"
            "from ppo_core import AutoModelForCausalLMWithValueHead\n"
            "from tests.tiny import tiny_causal_lm\n"
            "config = LoraConfig(r=4, target_modules=['c_attn', 'c_proj', 'c_fc'], task_type='CAUSAL_LM')\n"
            "model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm('gpt2'), peft_config=config)\n"
            "model.save_pretrained(sys.argv[1])\n")
    files = []
    for seed in ("1", "2", "3"):
        out = tmp_path / seed
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, capture_output=True,
                       env={**os.environ, "PYTHONHASHSEED": seed})
        files.append((out / "adapter_config.json").read_text())
    assert files[0] == files[1] == files[2]
    assert '"target_modules": [\n    "c_attn",\n    "c_fc",\n    "c_proj"\n  ]' in files[0]
