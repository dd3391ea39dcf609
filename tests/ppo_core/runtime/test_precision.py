"""Mixed precision on the CPU: fp16 loss scaling (torch's CPU GradScaler standing in for the CUDA one), frozen weights
in the compute dtype, the float32 master weights of a bf16 checkpoint, and TF32's logic (with a GPU faked)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from safetensors.torch import load_file

from ppo_core import AutoModelForCausalLMWithValueHead, precision
from ppo_core import trainer as trainer_module
from ppo_core.runtime.utils import tf32_matmuls, tf32_supported
from ppo_core.step.inputs import build_model_inputs
from ppo_core.step.rollout import policy_outputs
from tests.conftest import cpu_only
from tests.ppo_core.test_trainer import make_batch, make_trainer, params_snapshot
from tests.tiny import PAD, random_queries, randomize_lora, tiny_causal_lm, tiny_lora_config

torch.set_num_threads(1)

INITIAL_SCALE = 2.0**16  # torch's GradScaler and DeepSpeed start there


@pytest.fixture
def fp16(monkeypatch):
    """``accelerator_kwargs`` for an fp16 trainer on the CPU. accelerate gives a GPU run a CUDA GradScaler and fp16
    autocast, and a CPU run neither; here the trainer's Accelerator gets torch's CPU GradScaler and autocast to float16,
    so that accelerate's fp16 path (scaled backward, unscaling clip, scaler step and update) runs as on a GPU (where
    the suite runs on one, these tests keep to the CPU)."""
    build = trainer_module.accelerator_for

    def with_cpu_scaler(config):
        accelerator = build(config)
        accelerator.scaler, accelerator.native_amp = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE), True
        return accelerator

    monkeypatch.setattr(trainer_module, "accelerator_for", with_cpu_scaler)
    with cpu_only():
        yield {"mixed_precision": "fp16"}


def overflow_at(trainer, backwards: set[int] | None):
    """Make the gradient of the given backwards (1-based; None: every one) infinite, as a scaled fp16 backward
    that overflows makes it; returns the list of backwards seen."""
    calls = []

    def hook(grad):
        calls.append(1)
        return grad * float("inf") if backwards is None or len(calls) in backwards else grad

    trainer.model.v_head.summary.weight.register_hook(hook)
    return calls


def test_an_fp16_overflow_skips_that_update_and_the_run_goes_on(fp16):
    """The loss scaler overflows on purpose: the update is skipped (counted), the scale halves, the next update is
    applied. (It used to end the run: the unscaled norm is infinite, and the trainer raised FloatingPointError.)"""
    trainer = make_trainer(ppo_epochs=1, accelerator_kwargs=fp16)  # two mini-batches, two updates
    assert trainer.accelerator.scaler is not None
    overflow_at(trainer, {1})
    before = params_snapshot(trainer.model)
    stats = trainer.step(*make_batch(4))
    assert stats["ppo/policy/overflowed_updates"] == 1 and stats["ppo/policy/skipped_minibatches"] == 0
    assert stats["ppo/loss_scale"] == INITIAL_SCALE / 2 == trainer.accelerator.scaler.get_scale()
    after = params_snapshot(trainer.model)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(after[n], before[n]) for n in before)  # the second update was applied
    assert trainer._updates.overflows.in_a_row == 0  # a finite update after it ends the run of overflows


def test_an_fp16_run_resumes_with_its_loss_scale_and_overflow_count(fp16, tmp_path):
    """The scaler's state (its scale and growth tracker) and the overflows in a row are checkpointed: a resumed run
    does not start again from the initial scale and meet the same overflows."""
    trainer = make_trainer(ppo_epochs=1, accelerator_kwargs=fp16)
    overflow_at(trainer, {2})  # the step's last update overflows: one in a row when the checkpoint is written
    trainer.step(*make_batch(4))
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    state = torch.load(tmp_path / "ckpt" / "engine" / "state.pt", weights_only=True)
    assert state["scaler"]["scale"] == INITIAL_SCALE / 2
    resumed = make_trainer(ppo_epochs=1, accelerator_kwargs=fp16)
    assert resumed.accelerator.scaler.get_scale() == INITIAL_SCALE
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.accelerator.scaler.state_dict() == trainer.accelerator.scaler.state_dict()
    assert resumed._updates.overflows.in_a_row == 1


def test_fp16_overflows_in_a_row_stop_the_run_as_diverged(fp16):
    """Real divergence still stops the run: ``max_consecutive_overflows`` overflows in a row raise, naming them."""
    trainer = make_trainer(ppo_epochs=2, max_consecutive_overflows=3, accelerator_kwargs=fp16)  # four updates
    overflow_at(trainer, None)
    with pytest.raises(FloatingPointError, match=r"PPO step 1, mini-batch 3: 3 loss-scale overflows in a row "
                                                 r"\(max_consecutive_overflows; the loss scaler skipped those "
                                                 r"updates\) before the update.*train in bf16"):
        trainer.step(*make_batch(4))
    assert trainer.accelerator.scaler.get_scale() == INITIAL_SCALE / 4  # two halvings, then the third stopped it


def test_an_fp16_step_whose_minibatches_are_all_skipped_steps_nothing(fp16):
    """A window without a backward (every mini-batch over ratio_threshold) has no gradient for the scaler to check:
    no optimizer step, no scale update. (The scaler's step asserted "No inf checks were recorded for this optimizer".)
    """
    trainer = make_trainer(gradient_accumulation_steps=2, batch_size=8, mini_batch_size=2, accelerator_kwargs=fp16)
    trainer.step(*make_batch(8))  # an ordinary step first: the scaler has scaled and stepped
    trainer.config.ratio_threshold = 1e-3  # every mini-batch of the next step is skipped
    before, scaler_state = params_snapshot(trainer.model), trainer.accelerator.scaler.state_dict()
    with pytest.warns(UserWarning, match="ratio_threshold"):
        stats = trainer.step(*make_batch(8, seed=1))
    assert stats["ppo/policy/skipped_minibatches"] == 2 * 4 and stats["ppo/policy/overflowed_updates"] == 0
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert trainer.accelerator.scaler.state_dict() == scaler_state


def test_a_float32_run_reports_no_loss_scale_statistics():
    """The fp16 statistics exist only where a loss is scaled: a float32 run's stats (and the ppo stage's
    stats.parquet) keep their keys."""
    stats = make_trainer(ppo_epochs=1).step(*make_batch(4))
    assert not [k for k in stats if "overflow" in k or "loss_scale" in k]


# ---------------------------------------------------------------------------------------------------
# bf16: float32 master weights, frozen weights in the compute dtype
# ---------------------------------------------------------------------------------------------------
def bf16_checkpoint(path) -> str:
    """A tiny GPT-2 saved in bf16 (as many hub checkpoints are)."""
    tiny_causal_lm("gpt2").to(torch.bfloat16).save_pretrained(path)
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.bfloat16}
    return str(path)


def test_a_bf16_checkpoint_trains_float32_master_weights(tmp_path):
    """transformers 5 loads a checkpoint in its saved dtype: a bf16 one used to train bf16 weights under autocast,
    and Adam's updates below bf16's resolution (here lr 1e-5 on weights of ~0.02, whose bf16 spacing is ~1e-4)
    vanished. from_pretrained loads float32 unless asked otherwise, and the updates land."""
    model = AutoModelForCausalLMWithValueHead.from_pretrained(bf16_checkpoint(tmp_path / "bf16"))
    trainer = make_trainer(model=model, learning_rate=1e-5, ppo_epochs=1, mini_batch_size=4,
                           accelerator_kwargs={"mixed_precision": "bf16"})
    before = params_snapshot(trainer.model.pretrained_model)
    trainer.step(*make_batch(4))
    after = params_snapshot(trainer.model.pretrained_model)
    changed = sum(int((after[n] != before[n]).sum()) for n in before) / sum(p.numel() for p in before.values())
    assert changed > 0.5, changed  # every weight with a gradient moves by ~lr (Adam); bf16 kept almost none
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_half_precision_policy_outside_deepspeed_is_warned_about(tmp_path):
    """Asked for explicitly, bf16 weights are loaded as asked, and the trainer says what that costs."""
    model = AutoModelForCausalLMWithValueHead.from_pretrained(bf16_checkpoint(tmp_path / "bf16"),
                                                              dtype=torch.bfloat16)
    assert model.pretrained_model.dtype == torch.bfloat16
    with pytest.warns(UserWarning, match=r"trains torch.bfloat16 weights, with no float32 master copy"):
        make_trainer(model=model)


def lora_policy():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"), peft_config=tiny_lora_config())
    randomize_lora(model)
    return model


def test_frozen_matmul_weights_are_kept_in_the_compute_dtype_with_the_same_results_on_cpu(tmp_path):
    """LoRA under bf16 autocast: the frozen base's matmul weights are cast to bf16 once (autocast caches its casts only
    for weights that require grad, so it cast the float32 base again at every matmul of every generated token). Each
    matmul gets the bf16 weight autocast would have made: the policy's and the reference's outputs are the same bits.
    The tied embedding / LM head, the layer norms, the adapter and the value head keep float32."""
    model = lora_policy()
    uncast = copy.deepcopy(model).eval()  # no dropout (the trainer disables the policy's)
    trainer = make_trainer(model=model, accelerator_kwargs={"mixed_precision": "bf16"})
    base = trainer.model.pretrained_model.get_base_model().transformer
    assert base.h[0].attn.c_attn.base_layer.weight.dtype == base.h[0].mlp.c_fc.bias.dtype == torch.bfloat16
    assert base.wte.weight.dtype == base.h[0].ln_1.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters() if p.requires_grad)
    queries = random_queries(4, seed=2)
    responses = [torch.randint(3, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 1, 5, 2)]
    inputs = build_model_inputs(queries, responses, PAD)
    with torch.no_grad(), trainer._forward_precision():
        for adapter in ("on", "off"):
            disabled = [m.pretrained_model.disable_adapter() for m in (trainer.model, uncast)] if adapter == "off" \
                else []
            for block in disabled:
                block.__enter__()
            got, want = policy_outputs(trainer.model, inputs), policy_outputs(uncast, inputs)
            for block in disabled:
                block.__exit__(None, None, None)
            assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.values, want.values), adapter
    trainer.model.save_pretrained(tmp_path / "merged", merge_adapter=True)  # merged in float32
    assert {t.dtype for t in load_file(tmp_path / "merged" / "model.safetensors").values()} == {torch.float32}


def test_generation_with_frozen_weights_in_the_compute_dtype_samples_the_same_tokens_on_cpu(monkeypatch):
    model = lora_policy()
    with monkeypatch.context() as patched:  # a trainer that leaves the frozen float32 weights to autocast
        patched.setattr(precision, "cast_frozen_matmul_weights", lambda *args, **kwargs: 0)
        uncast = make_trainer(model=copy.deepcopy(model), accelerator_kwargs={"mixed_precision": "bf16"})
    cast = make_trainer(model=model, accelerator_kwargs={"mixed_precision": "bf16"})
    weights = [t.model.pretrained_model.get_base_model().transformer.h[1].mlp.c_proj.weight for t in (uncast, cast)]
    assert [w.dtype for w in weights] == [torch.float32, torch.bfloat16]
    queries, samples = random_queries(4, seed=3), []
    for trainer in (uncast, cast):
        torch.manual_seed(0)
        samples.append(trainer.generate(queries, return_prompt=False, max_new_tokens=6, do_sample=True, top_k=0,
                                        pad_token_id=PAD))
    assert [r.tolist() for r in samples[0]] == [r.tolist() for r in samples[1]]


# ---------------------------------------------------------------------------------------------------
# TF32 (no GPU here: torch is told it has an Ampere one)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def ampere(monkeypatch):
    """torch reports a CUDA GPU of compute capability 8.0 (TF32), and NVIDIA_TF32_OVERRIDE is unset."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)


def test_tf32_matmuls_within_the_block_on_gpus_that_have_it(ampere, monkeypatch):
    matmul = torch.backends.cuda.matmul
    assert matmul.fp32_precision == "none" and tf32_supported("cuda:0")  # torch's default: IEEE float32
    with tf32_matmuls(True, "cuda:0"):
        assert matmul.fp32_precision == "tf32"
    assert matmul.fp32_precision == "none"
    for enabled, device in ((False, "cuda:0"), (True, "cpu")):  # switched off, or not a GPU: untouched
        with tf32_matmuls(enabled, device):
            assert matmul.fp32_precision == "none"
    matmul.fp32_precision = "ieee"  # the user's own choice is kept
    try:
        with tf32_matmuls(True, "cuda:0"):
            assert matmul.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision = "none"
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # NVIDIA's switch, which cuBLAS and cuDNN obey too
    assert not tf32_supported("cuda:0")
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # Volta: no TF32
    assert not tf32_supported("cuda:0")


@pytest.mark.parametrize("tf32", [True, False])
def test_generate_and_step_run_with_the_config_s_tf32_setting(tf32, monkeypatch):
    calls = []

    @contextlib.contextmanager
    def recorded(enabled, device):
        calls.append((enabled, torch.device(device).type))
        yield

    monkeypatch.setattr(precision, "tf32_matmuls", recorded)
    trainer = make_trainer(tf32=tf32)
    trainer.generate(random_queries(2), max_new_tokens=2, pad_token_id=PAD)
    trainer.step(*make_batch(4))
    assert calls == [(tf32, trainer.current_device.type)] * 2


def test_a_test_named_on_cpu_runs_with_no_gpu_visible_on_cpu():
    """tests/conftest.py: the bit-for-bit tests (named ``*_on_cpu``) see no GPU, in their process and the ones they
    start, wherever the suite runs."""
    import os

    assert not torch.cuda.is_available() and os.environ["CUDA_VISIBLE_DEVICES"] == ""
