"""bf16 weights trained through float32 masters (``PPOConfig.weights_dtype``, ``runtime.master_weights``): Adam's small
updates survive, the update is float32's within bf16's rounding, and a resumed run continues from the masters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ppo_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from ppo_core.models import rollout_copy
from ppo_core.runtime.master_weights import MasterAdam, MasterAdamW, MasterWeights, has_masters
from ppo_core.step.update import run_optimizer
from tests.ppo_core.test_trainer_estimators import grouped_queries
from tests.tiny import random_queries, tiny_causal_lm, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost


class MasterSGD(MasterWeights, torch.optim.SGD):
    """Plain SGD over masters: its update is the gradient itself, so two runs' updates compare as gradients."""


def descend(optimizer_cls, steps: int = 200, **kwargs):
    """``steps`` of a constant gradient of 1 on a bf16 weight of ones and a float32 one beside it, at lr 1e-5: each
    update (1e-5) is far below bf16's resolution at 1 (2^-7 above, 2^-8 below)."""
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    head = torch.nn.Parameter(torch.ones(4))
    optimizer = optimizer_cls([weight, head], lr=1e-5, **kwargs)
    for _ in range(steps):
        (weight.float().sum() + head.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weight, head, optimizer


@pytest.mark.parametrize("optimizer_cls", [MasterAdam, MasterAdamW])
def test_small_updates_add_up_in_the_masters_and_the_weights_are_them_rounded(optimizer_cls):
    plain, _, _ = descend(torch.optim.Adam)
    assert torch.equal(plain, torch.ones_like(plain))  # without masters every update is rounded away
    weight, head, optimizer = descend(optimizer_cls, weight_decay=0.0)
    master = optimizer.masters[0]
    assert master.dtype == torch.float32 and master.mean().item() == pytest.approx(1 - 200e-5, abs=2e-5)
    assert torch.equal(weight, master.to(torch.bfloat16)) and (weight < 1).all()
    assert optimizer.masters[1] is head and head.mean().item() == pytest.approx(1 - 200e-5, abs=2e-5)
    assert weight.grad is None and master.grad is None and has_masters(optimizer)


def test_the_state_dict_carries_the_masters_and_a_resume_continues_from_them():
    weight, _, optimizer = descend(MasterAdam, steps=50)
    state = optimizer.state_dict()
    assert len(state["masters"]) == 1 and torch.equal(state["masters"][0], optimizer.masters[0])
    uninterrupted = descend(MasterAdam, steps=100)[2].masters[0]

    fresh_weight = torch.nn.Parameter(weight.detach().clone())  # the checkpointed bf16 weights: masters rounded
    fresh_head = torch.nn.Parameter(optimizer.masters[1].detach().clone())
    resumed = MasterAdam([fresh_weight, fresh_head], lr=1e-5)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.masters[0], optimizer.masters[0])  # not the rounded weights
    for _ in range(50):
        (fresh_weight.float().sum() + fresh_head.sum()).backward()
        resumed.step()
        resumed.zero_grad()
    assert torch.equal(resumed.masters[0], uninterrupted)

    other = MasterAdam([torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(2)], lr=1e-5)
    with pytest.raises(ValueError, match=r"MasterAdam.load_state_dict: the state holds 1 masters, the optimizer has 2 "
                                         r"half-precision weights"):
        other.load_state_dict(state)


def test_a_weight_cast_to_bf16_after_the_optimizer_was_built_gets_its_master_at_the_first_step():
    """The seed's loop builds the optimizer before the trainer, which casts the policy under weights_dtype."""
    layer = torch.nn.Linear(4, 4)
    optimizer = MasterAdam(layer.parameters(), lr=1e-5)
    layer.to(torch.bfloat16)
    before = layer.weight.detach().float().clone()
    for _ in range(100):
        layer(torch.ones(4, dtype=torch.bfloat16)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(m.dtype == torch.float32 and m is not w for w, m in zip(optimizer.weights, optimizer.masters))
    assert optimizer.masters[0].sub(before).abs().max().item() == pytest.approx(100e-5, rel=0.05)
    assert torch.equal(layer.weight, optimizer.masters[0].to(torch.bfloat16))

    resumed_layer = torch.nn.Linear(4, 4)  # built, then cast, then resumed before its first step (a checkpoint)
    resumed = MasterAdam(resumed_layer.parameters(), lr=1e-5)
    resumed_layer.to(torch.bfloat16)
    resumed.load_state_dict(optimizer.state_dict())
    assert torch.equal(resumed.masters[0], optimizer.masters[0])
    assert torch.equal(resumed.state[resumed.masters[0]]["exp_avg"], optimizer.state[optimizer.masters[0]]["exp_avg"])

    stepped = MasterAdam(torch.nn.Linear(2, 2).parameters(), lr=1e-5)
    stepped.weights[0].sum().backward()
    stepped.step()
    stepped.weights[0].data = stepped.weights[0].data.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight 0 was cast to torch.bfloat16 after the optimizer stepped it in "
                                         r"float32; cast the model before its first step"):
        stepped.step()


def grpo_trainer(weights_dtype: str | None, optimizer_cls=None, lr: float = 1.0, **options) -> PPOTrainer:
    """A critic-free trainer (GRPO, G=4: the value head frozen, so its update is the LM's alone) on a tiny Llama."""
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("llama"))
    config = PPOConfig(batch_size=8, mini_batch_size=8, learning_rate=lr, seed=0, advantage_estimator="grpo",
                       num_generations=4, weights_dtype=weights_dtype, **options)
    optimizer = None if optimizer_cls is None else optimizer_cls(model.parameters(), lr=lr)
    return PPOTrainer(config, model, None, tiny_tokenizer(), optimizer=optimizer)


def fixed_step(trainer: PPOTrainer) -> dict:
    g = torch.Generator().manual_seed(0)
    queries = grouped_queries(2, 4, seed=1)
    responses = [torch.randint(3, 64, (n,), generator=g) for n in (3, 9, 5, 7, 4, 6, 8, 2)]
    scores = [torch.tensor(s) for s in torch.randn(8, generator=g).tolist()]
    return trainer.step(queries, responses, scores)


def lm_update(trainer: PPOTrainer, step) -> torch.Tensor:
    """The LM's weight change over ``step(trainer)``, flattened, in float32: the masters' under weights_dtype."""
    def values():
        optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around it
        if has_masters(optimizer):  # the LM's weights are the half ones, in the same order
            return [m.detach().clone() for _, m in optimizer._pairs()]
        return [p.detach().clone() for p in trainer.model.pretrained_model.parameters()]

    before = values()
    step(trainer)
    return torch.cat([(a - b).flatten() for a, b in zip(values(), before)])


def test_a_bf16_weights_step_is_the_float32_step_within_bf16_rounding():
    """One step, plain SGD at lr 1 (the update is the gradient): the same update as float32's, up to the passes'
    bf16 rounding (bf16 keeps 8 bits: 2^-8 = 0.4% relative per operation; the tiny Llama's measured 0.6-0.8%); the
    policy's LM and its frozen reference are bf16, the value head float32, the optimizer keeps the masters."""
    exact = lm_update(grpo_trainer(None, torch.optim.SGD), fixed_step)
    trainer = grpo_trainer("bfloat16", MasterSGD)
    assert {p.dtype for p in trainer.model.pretrained_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.v_head.parameters()} == {torch.float32}
    assert {p.dtype for p in trainer.ref_model.pretrained_model.parameters()} == {torch.bfloat16}
    assert trainer.config.rollout_dtype is None  # the policy samples itself: a copy would hold the same weights
    got = lm_update(trainer, fixed_step)
    assert exact.norm() > 0
    assert (got - exact).norm() / exact.norm() < 0.02
    assert torch.nn.functional.cosine_similarity(got, exact, dim=0) > 0.999


def test_the_default_optimizer_keeps_masters_and_the_policy_samples_its_bf16_weights():
    """Sampled steps with the default optimizer (MasterAdam): generate() samples the bf16 policy itself, the masters
    move, and the bf16 weights are the masters rounded after each step."""
    trainer = grpo_trainer("bfloat16", lr=1e-3)
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, MasterAdam)
    initial = None
    for step in range(3):
        queries = grouped_queries(2, 4, seed=step)
        responses = trainer.generate(queries, batch_size=8, return_prompt=False, do_sample=True, top_k=0,
                                     max_new_tokens=6)
        stats = trainer.step(queries, responses, [(r == 10).float().sum() - 0.5 for r in responses])
        assert torch.isfinite(torch.as_tensor(stats["ppo/loss/total"]))
        pairs = optimizer._pairs()
        initial = initial if initial is not None else [m.clone() for _, m in pairs]
        assert len(pairs) == len(list(trainer.model.pretrained_model.parameters()))
        for w, m in pairs:
            assert w.dtype == torch.bfloat16 and m.dtype == torch.float32 and torch.equal(w, m.to(w.dtype))
    assert any(not torch.equal(a, m) for a, (_, m) in zip(initial, optimizer._pairs()))


def test_a_resumed_bf16_weights_run_equals_the_uninterrupted_one(tmp_path):
    def run(trainer, steps):
        for step in steps:
            queries = random_queries(8, seed=step)
            responses = trainer.generate(queries, batch_size=8, return_prompt=False, do_sample=True, top_k=0,
                                         max_new_tokens=6)
            trainer.step(queries, responses, [(r == 10).float().sum() for r in responses])

    def make():
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"))
        config = PPOConfig(batch_size=8, mini_batch_size=4, learning_rate=1e-3, seed=0, weights_dtype="bfloat16")
        return PPOTrainer(config, model, None, tiny_tokenizer())

    uninterrupted = make()
    run(uninterrupted, range(4))
    first = make()
    run(first, range(2))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = make()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    run(resumed, range(2, 4))
    for a, b in zip(uninterrupted.optimizer.optimizer.masters, resumed.optimizer.optimizer.masters):
        assert torch.equal(a, b)
    for name, param in uninterrupted.model.state_dict().items():
        assert torch.equal(param, resumed.model.state_dict()[name]), name


def test_weights_dtype_is_refused_where_nothing_would_keep_the_masters():
    with pytest.raises(ValueError, match=r"weights_dtype='bfloat16' trains bf16 weights through float32 masters, "
                                         r"which it cannot keep with the optimizer passed \(Adam\), which would write "
                                         r"its updates into the bf16 weights \(pass ppo_core.runtime.master_weights"):
        grpo_trainer("bfloat16", torch.optim.Adam)
    config = PPOConfig(weights_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"cannot keep under DeepSpeed, whose engine keeps float32 masters itself"):
        run_optimizer(None, [torch.nn.Parameter(torch.ones(2))], config, deepspeed=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match=r"cannot keep with mixed_precision fp16, whose loss scaler"):
        run_optimizer(None, [torch.nn.Parameter(torch.ones(2))], config, deepspeed=False, mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"weights_dtype"):
        dataclasses.replace(config, weights_dtype="float16")
    assert isinstance(run_optimizer(None, [torch.nn.Parameter(torch.ones(2))], config, False, "no"), MasterAdam)
    plain = dataclasses.replace(config, weights_dtype=None)
    assert type(run_optimizer(None, [torch.nn.Parameter(torch.ones(2))], plain, False, "no")) is torch.optim.Adam


def test_no_half_weights_warning_with_masters(recwarn):
    grpo_trainer("bfloat16")
    assert not [w for w in recwarn if "no float32 master copy" in str(w.message)]


@pytest.mark.parametrize(("dtype", "weights_dtype", "expected"), [
    ("auto", "bfloat16", (None, None)),  # a GPU with bf16 weights: the policy samples itself, nothing to correct
    ("auto", None, ("bfloat16", "token_truncate")),  # the default fast rollout
    ("bfloat16", "bfloat16", ("bfloat16", "token_truncate")),  # an explicit copy wins
])
def test_auto_makes_no_rollout_copy_of_bf16_weights(dtype, weights_dtype, expected):
    assert rollout_copy.rollout_choice(dtype, "auto", "cuda", True, False, weights_dtype) == expected
