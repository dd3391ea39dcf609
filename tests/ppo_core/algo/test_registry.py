"""ppo_core.algo.registry, the estimator registry, and the glue between a config and the math: each built-in's
settings, a user's own estimator by name, the estimators' policy-loss variants by hand (DAPO's decoupled clip, GSPO's
sequence ratio, CISPO), and the steps where a small slip in the glue would change training without failing anything
else. The advantages themselves (ppo_core.algo.advantages) are ``test_advantages.py``."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from ppo_core import PPOConfig, PPOTrainer
from ppo_core.algo.advantages import sequence_advantages, shaped_group_scores
from ppo_core.algo.ppo_math import policy_loss
from ppo_core.algo.registry import ESTIMATORS, get_estimator, register_estimator
from tests.tiny import tiny_tokenizer, tiny_value_model

torch.set_num_threads(1)
F64 = torch.float64

# name: (uses_critic, needs_groups, kl_in, kl_coef, loss_aggregation, policy_loss, cliprange, epsilon_high, level,
#        dynamic_sampling), each from its reference implementation (ppo_core.algo.registry's docstring cites them)
REFERENCE = {
    "gae": (True, False, "reward", 0.2, "token-mean", "clip", 0.2, None, "token", False),
    "grpo": (False, True, "loss", 0.04, "seq-mean-token-mean", "clip", 0.2, None, "token", False),
    "dr_grpo": (False, True, "loss", 0.0, "seq-mean-token-sum-norm", "clip", 0.2, None, "token", False),
    "rloo": (False, True, "reward", 0.05, "token-mean", "clip", 0.2, None, "token", False),
    "reinforce_plus_plus": (False, False, "reward", 0.01, "token-mean", "clip", 0.2, None, "token", False),
    "reinforce_plus_plus_baseline": (False, True, "loss", 0.001, "token-mean", "clip", 0.2, None, "token", False),
    "dapo": (False, True, "loss", 0.0, "token-mean", "clip", 0.2, 0.28, "token", True),
    "gspo": (False, True, "loss", 0.0, "seq-mean-token-mean", "gspo", 3e-4, 4e-4, "sequence", False),
    "cispo": (False, True, "loss", 0.0, "token-mean", "cispo", 0.2, None, "token", False),  # its cap: the loss's own
}


@pytest.mark.parametrize("name", REFERENCE)
def test_every_built_in_has_its_reference_settings_and_a_config_takes_them(name):
    e = get_estimator(name)
    assert (e.uses_critic, e.needs_groups, e.kl_in, e.kl_coef, e.loss_aggregation, e.policy_loss, e.cliprange,
            e.epsilon_high, e.importance_sampling_level, e.dynamic_sampling) == REFERENCE[name]
    size = 4 if e.needs_groups else 1
    config = PPOConfig(advantage_estimator=name, num_generations=size, batch_size=8, mini_batch_size=4).resolved
    coef = config.init_kl_coef if e.kl_in == "reward" else config.kl_loss_coef
    assert (config.kl_in, coef, config.loss_aggregation, config.cliprange, config.importance_sampling_level,
            config.dynamic_sampling) == (e.kl_in, e.kl_coef, e.loss_aggregation, e.cliprange,
                                         e.importance_sampling_level, e.dynamic_sampling)
    assert config.epsilon_high == (e.epsilon_high if e.epsilon_high is not None else config.cliprange)
    assert (config.init_kl_coef if e.kl_in == "loss" else config.kl_loss_coef) == 0.0  # nothing on the other side
    assert config.policy_loss == e.policy_loss
    assert sorted(ESTIMATORS) >= sorted(REFERENCE)


def test_a_field_set_by_the_user_wins_over_the_estimator_s_default():
    config = PPOConfig(advantage_estimator="gspo", num_generations=2, batch_size=4, mini_batch_size=2,
                       cliprange=0.1, importance_sampling_level="token", loss_type="cispo").resolved
    # CISPO's cap on its weight is its own parameter (5.0), not GSPO's clip eps (4e-4 would cap every weight at 0.0004)
    assert (config.cliprange, config.importance_sampling_level) == (0.1, "token")
    assert config.policy_loss_kwargs == {"cap": 5.0}
    assert config.loss_aggregation == "token-mean" and config.policy_loss == "cispo"  # loss_type: TRL's meaning
    assert PPOConfig(advantage_estimator="rloo", num_generations=2, batch_size=4, mini_batch_size=2,
                     init_kl_coef=0.2).resolved.init_kl_coef == 0.2


def test_trl_names_and_conflicts_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^unknown key 'PPOConfig.epsilon'; TRL's epsilon is legacy PPOConfig's "
                                         r"cliprange$"):
        PPOConfig(epsilon=0.3)
    with pytest.raises(ValueError, match=r"^unknown key 'PPOConfig.beta'; TRL's beta is kl_loss_coef here"):
        PPOConfig(beta=0.04)
    with pytest.raises(ValueError, match=r"^PPOConfig.loss_aggregation must be 'seq-mean-token-sum-norm', as "
                                         r"loss_type 'dr_grpo' implies \(or unset\), got 'token-mean'"):
        PPOConfig(loss_type="dr_grpo", loss_aggregation="token-mean")
    with pytest.raises(ValueError, match=r"^PPOConfig.advantage_estimator 'grop' is not a registered estimator; one "
                                         r"of gae, grpo, dr_grpo"):
        PPOConfig(advantage_estimator="grop")
    with pytest.raises(ValueError, match=r"^PPOConfig.kl_estimator must be one of"):
        PPOConfig(kl_estimator="full")  # the whole-vocabulary KL is reward-side only
    with pytest.raises(ValueError, match=r"^PPOConfig.overlong_buffer_len must be <= max_completion_length"):
        PPOConfig(advantage_estimator="dapo", num_generations=2, batch_size=4, mini_batch_size=2,
                  overlong_buffer_len=4)


@pytest.fixture
def best_of_group():
    """A user's estimator, registered by a decorator as a user would: each sample's score less its group's best."""

    @register_estimator("best_of_group", needs_groups=True)
    def advantages(batch, config, group):
        shaped, scores = shaped_group_scores(batch)
        groups = scores.view(-1, config.num_generations)
        return shaped, sequence_advantages((groups - groups.max(dim=1, keepdim=True).values).reshape(-1), batch.mask)

    yield advantages
    ESTIMATORS.pop("best_of_group")


def test_a_user_estimator_is_selected_by_name_and_trains(best_of_group):
    config = PPOConfig(advantage_estimator="best_of_group", num_generations=2, batch_size=4, mini_batch_size=4,
                       ppo_epochs=1, learning_rate=1e-3)
    trainer = PPOTrainer(config, tiny_value_model("gpt2"), tokenizer=tiny_tokenizer())
    assert trainer.estimator.advantage_function() is best_of_group and config.resolved.kl_in == "reward"
    queries = [torch.tensor([5, 6])] * 2 + [torch.tensor([7])] * 2
    responses = [torch.tensor([9, 10]), torch.tensor([11]), torch.tensor([12]), torch.tensor([13, 14])]
    stats = trainer.step(queries, responses, [torch.tensor(x) for x in (1.0, 3.0, 2.0, 2.0)])
    # the advantages, broadcast to every response token: -2 (2 tokens), 0 ; 0, 0 (2 tokens): mean -4/6 over 6 tokens
    assert stats["ppo/policy/advantages_mean"] == pytest.approx(-4 / 6)
    with pytest.raises(ValueError, match="registered already"):
        register_estimator("grpo")(best_of_group)


def test_a_user_estimator_in_a_params_file_is_named_module_colon_name(tmp_path, monkeypatch):
    """params.yaml selects a user's estimator as 'module:name': the module is imported, its decorator registers it."""
    from stages.shared.params import load_params
    from tests.conftest import write_params

    (tmp_path / "my_estimators.py").write_text(
        "from ppo_core.algo.advantages import sequence_advantages, shaped_group_scores\n"
        "from ppo_core.algo.registry import register_estimator\n\n"
        "@register_estimator('worst_of_group', needs_groups=True)\n"
        "def worst_of_group(batch, config, group):\n"
        "    shaped, scores = shaped_group_scores(batch)\n"
        "    groups = scores.view(-1, config.num_generations)\n"
        "    return shaped, sequence_advantages((groups - groups.min(dim=1, keepdim=True).values).reshape(-1), "
        "batch.mask)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "my_estimators", None)  # not imported yet
    del sys.modules["my_estimators"]
    try:
        path = write_params(tmp_path, {"ppo.advantage_estimator": "my_estimators:worst_of_group",
                                       "ppo.num_generations": 2})
        config = load_params(path).ppo_config  # built once, at load
        assert config.advantage_estimator == "my_estimators:worst_of_group"
        entry = get_estimator(config.advantage_estimator)
        assert entry.name == "worst_of_group" and entry.needs_groups
    finally:
        ESTIMATORS.pop("worst_of_group", None)


def make(estimator, size, batch, mini, **options):
    config = PPOConfig(advantage_estimator=estimator, num_generations=size, batch_size=batch, mini_batch_size=mini,
                       ppo_epochs=1, learning_rate=1e-9, seed=0, **options)
    return PPOTrainer(config, tiny_value_model("gpt2"), tokenizer=tiny_tokenizer())


def crafted(lengths, scores, size):
    """Queries in groups of ``size`` (one prompt each), responses of ``lengths`` tokens (no EOS), ``scores``."""
    queries = [torch.tensor([3 + i // size, 4]) for i in range(len(lengths))]
    responses = [torch.arange(10, 10 + n) for n in lengths]
    return queries, responses, [torch.tensor(float(s)) for s in scores]


def test_dr_grpo_divides_by_the_global_batch_s_longest_response_in_every_mini_batch():
    """Dr. GRPO's constant: sum_{i,t} -A_i / (b * L_max), L_max the whole batch's longest response (8 here, in one
    mini-batch only). A divisor per mini-batch, or the batch's min, gives another loss (mutations that survived)."""
    lengths, scores = [1, 2, 3, 4, 1, 2, 3, 8], [0, 1, 1, 0, 0, 1, 1, 0]
    trainer = make("dr_grpo", 2, 8, 4)
    stats = trainer.step(*crafted(lengths, scores, 2))
    # A = r - mean: -.5 .5 .5 -.5 -.5 .5 .5 -.5; at ratio 1 the loss of a token is -A; sum over tokens: 2, shared by
    # the two mini-batches of 4, each dividing by 4 * 8, and the stat their mean: 2 / (4 * 8) / 2
    assert stats["ppo/loss/policy"] == pytest.approx(2 / 64, rel=1e-5)


def test_grpo_s_kl_goes_to_the_loss_and_never_also_to_the_reward():
    """With init_kl_coef set (a legacy config's 0.2) and GRPO's KL in the loss, the rewards stay unshaped (a mutation
    applying the controller's coefficient there as well survived before)."""
    trainer = make("grpo", 2, 8, 4, init_kl_coef=0.2)
    head = trainer.model.pretrained_model.lm_head.weight.data
    head.add_(0.5 * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))  # KL to the reference != 0
    stats = trainer.step(*crafted([2] * 8, [0, 1, 1, 0, 0, 1, 1, 0], 2))
    assert stats["objective/kl"] != 0 and stats["objective/kl_loss_coef"] == 0.04
    assert stats["objective/kl_coef"] == 0.0 and stats["ppo/mean_non_score_reward"] == 0.0


def test_the_decoupled_clip_by_hand():
    """DAPO's clip-higher: with eps_high 0.28 a ratio of 1.25 on a positive advantage still has its gradient (PPO's
    symmetric 0.2 clips it); a ratio of 0.75 on a negative advantage is clipped at 1 - eps_low either way."""
    old = torch.zeros(1, 2, dtype=F64)
    logprobs = torch.tensor([[math.log(1.25), math.log(0.75)]], dtype=F64, requires_grad=True)
    advantages, mask = torch.tensor([[1.0, -1.0]], dtype=F64), torch.ones(1, 2, dtype=F64)
    for high, grad0 in [(0.28, -1.25 / 2), (None, 0.0)]:
        logprobs.grad = None
        out = policy_loss(logprobs, old, advantages, mask, 0.2, cliprange_high=high)
        out.loss.backward()
        kept = -1.25 if high else -1.2
        assert out.loss.item() == pytest.approx((kept + 0.8) / 2)
        assert logprobs.grad[0].tolist() == pytest.approx([grad0, 0.0])  # d(-A r)/d log p = -A r, over 2 tokens
        assert out.clipfrac.item() == pytest.approx(0.5 if high else 1.0)


def test_gspo_s_sequence_ratio_by_hand():
    """GSPO: one ratio per response, exp of the mean token log-ratio, clipped as a whole; its gradient reaches each
    token as that ratio times A over the response's length."""
    old = torch.zeros(2, 2, dtype=F64)
    logprobs = torch.tensor([[0.1, 0.3], [-0.2, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    advantages = torch.tensor([[1.0, 1.0], [-1.0, 0.0]], dtype=F64)
    out = policy_loss(logprobs, old, advantages, mask, 0.3, level="sequence",
                      reduce=lambda loss: (loss * mask).sum(dim=1).div(mask.sum(dim=1)).mean())
    s0, s1 = math.exp(0.2), math.exp(-0.2)  # both inside [0.7, 1.3]
    assert out.loss.item() == pytest.approx((-s0 + s1) / 2)
    out.loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-s0 / 2 / 2] * 2)  # -A s / len, over 2 sequences
    assert logprobs.grad[1, 0].item() == pytest.approx(s1 / 1 / 2)
    tight = policy_loss(logprobs.detach(), old, advantages, mask, 3e-4, cliprange_high=4e-4, level="sequence")
    assert tight.clipfrac.item() == pytest.approx(1.0)  # both ratios outside [1 - 3e-4, 1 + 4e-4]: clipped


def test_cispo_keeps_the_gradient_of_a_capped_token():
    """CISPO: -sg(min(r, cap)) A log p. A token over the cap keeps a gradient, scaled to the cap (PPO's clip would
    zero it); one under it, its ratio."""
    old = torch.zeros(1, 2, dtype=F64)
    logprobs = torch.tensor([[math.log(2.0), math.log(0.5)]], dtype=F64, requires_grad=True)
    advantages, mask = torch.tensor([[1.0, 1.0]], dtype=F64), torch.ones(1, 2, dtype=F64)
    out = policy_loss(logprobs, old, advantages, mask, 0.2, cliprange_high=1.5, kind="cispo")
    out.loss.backward()
    assert out.loss.item() == pytest.approx((-1.5 * math.log(2.0) - 0.5 * math.log(0.5)) / 2)
    assert logprobs.grad[0].tolist() == pytest.approx([-1.5 / 2, -0.5 / 2])
    assert out.clipfrac.item() == pytest.approx(0.5)


def test_dapo_leaves_groups_of_one_score_out_and_shapes_overlong_responses():
    """DAPO in a step: with L_max 8 and L_cache 4 a 7-token response loses 0.75; groups whose samples all scored the
    same are out of the loss, and the stats say how many; a mini-batch left with no token trains on nothing."""
    trainer = make("dapo", 2, 8, 2, max_completion_length=8)
    assert trainer.config.overlong_buffer_len == 1  # 20% of 8, DAPO's share
    trainer = make("dapo", 2, 8, 2, max_completion_length=8, overlong_buffer_len=4)
    lengths, scores = [1, 1, 7, 1, 2, 2, 3, 3], [1, 1, 1, 0, 2, 2, 0, 1]
    stats = trainer.step(*crafted(lengths, scores, 2))
    assert stats["ppo/overlong_penalty_mean"] == pytest.approx(-0.75 / 8)
    # shaped scores 1 1 | .25 0 | 2 2 | 0 1: groups 0 and 2 have one score: 4 of 8 responses left out
    assert stats["ppo/frac_responses_left_out"] == 0.5 and stats["ppo/frac_reward_zero_std"] == 0.5
    assert np.isfinite(stats["ppo/loss/policy"])


def test_mask_truncated_completions_leaves_responses_without_eos_out():
    trainer = make("grpo", 2, 4, 4, mask_truncated_completions=True)
    queries, responses, scores = crafted([2, 2, 3, 1], [0, 1, 1, 0], 2)
    responses[1] = torch.tensor([10, trainer.tokenizer.eos_token_id])  # the only one that ended
    stats = trainer.step(queries, responses, scores)
    assert stats["ppo/frac_responses_left_out"] == 0.75


def test_checking_a_config_loads_neither_torch_nor_the_math():
    """Every stage checks params.yaml's ppo section by building a PPOConfig, which reads the registry: the registry
    names the built-ins' functions by path, so that check stays light and the math is no code dep of other stages."""
    import subprocess

    code = ("import sys; from ppo_core import PPOConfig; "
            "PPOConfig(advantage_estimator='dapo', num_generations=4, batch_size=8, mini_batch_size=4); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('ppo_core.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("['ppo_core.algo', 'ppo_core.algo.choices', 'ppo_core.algo.registry', 'ppo_core.config', "
                           "'ppo_core.fields', 'ppo_core.resolution']")


def test_a_direct_loss_call_uses_its_own_sizes_never_the_last_step_s():
    """Dr. GRPO's constant travels in the step's Rollout, not on the trainer: a loss() call after a step whose longest
    response was 8 divides by what it is given (or its mini-batch's width), as the step's own mini-batches did."""
    trainer = make("dr_grpo", 2, 8, 4)
    trainer.step(*crafted([1, 2, 3, 4, 1, 2, 3, 8], [0, 1, 1, 0, 0, 1, 1, 0], 2))
    zeros, mask = torch.zeros(2, 3), torch.ones(2, 3)
    args = (zeros, zeros, None, zeros, zeros, mask, torch.ones(2, 3), zeros)  # ratio 1, advantage 1 at 6 tokens
    assert trainer.loss(*args)[0].item() == pytest.approx(-6 / (2 * 3))  # the mini-batch's width, 3
    assert trainer.loss(*args, norm_length=6)[0].item() == pytest.approx(-6 / (2 * 6))


# ---- the policy losses: a registry of their own, beside the estimators ----------------------------------------------
@pytest.fixture
def reinforce_loss():
    """A user's policy loss, registered by a decorator: plain REINFORCE (-A * log p, no ratio, nothing clipped), with a
    parameter of its own."""
    from ppo_core.algo.registry import POLICY_LOSS_REGISTRY, register_policy_loss

    @register_policy_loss("reinforce", params={"scale": 1.0})
    def reinforce(ratio, advantages, logprobs, low, high, scale):
        return -scale * advantages * logprobs, torch.zeros_like(ratio, dtype=torch.bool)

    yield reinforce
    POLICY_LOSS_REGISTRY.pop("reinforce")


def test_a_user_policy_loss_is_chosen_by_name_with_its_own_parameters_and_trains(reinforce_loss):
    config = PPOConfig(advantage_estimator="grpo", num_generations=2, batch_size=4, mini_batch_size=4, ppo_epochs=1,
                       learning_rate=1e-3, policy_loss="reinforce", policy_loss_kwargs={"scale": 2.0})
    assert (config.resolved.policy_loss, config.resolved.policy_loss_kwargs) == ("reinforce", {"scale": 2.0})
    trainer = PPOTrainer(config, tiny_value_model("gpt2"), tokenizer=tiny_tokenizer())
    queries = [torch.tensor([5, 6])] * 2 + [torch.tensor([7])] * 2
    responses = [torch.tensor([9, 10]), torch.tensor([11]), torch.tensor([12]), torch.tensor([13, 14])]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.step(queries, responses, [torch.tensor(x) for x in (1.0, 3.0, 2.0, 0.0)])
    assert stats["ppo/policy/clipfrac"] == 0 and np.isfinite(stats["ppo/loss/policy"])
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    with pytest.raises(ValueError, match="registered already"):
        from ppo_core.algo.registry import register_policy_loss

        register_policy_loss("clip")(reinforce_loss)


def test_the_user_loss_s_gradient_is_its_own(reinforce_loss):
    """The engine hands the loss the ratio, the advantages and the log-probs, and reduces what it returns."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = policy_loss(logprobs, logprobs.detach(), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 0.2,
                       kind="reinforce", scale=3.0)
    loss.loss.backward()
    assert loss.loss.item() == pytest.approx(-3.0 * (-1.0 - 2.0) / 2)
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.5, -1.5]]))  # -scale * A / tokens


def test_a_policy_loss_of_the_user_in_a_params_file_is_module_colon_name(tmp_path, monkeypatch):
    from ppo_core.algo.registry import POLICY_LOSS_REGISTRY
    from stages.shared.params import load_params
    from tests.conftest import write_params

    (tmp_path / "my_losses.py").write_text(
        "import torch\n"
        "from ppo_core.algo.registry import register_policy_loss\n\n"
        "@register_policy_loss('sign_loss')\n"
        "def sign_loss(ratio, advantages, logprobs, low, high):\n"
        "    return -advantages.sign() * ratio, torch.zeros_like(ratio, dtype=torch.bool)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        path = write_params(tmp_path, {"ppo.policy_loss": "my_losses:sign_loss"})
        config = load_params(path).ppo_config
        assert config.policy_loss == "my_losses:sign_loss" and config.resolved.policy_loss == "sign_loss"
    finally:
        POLICY_LOSS_REGISTRY.pop("sign_loss", None)
        sys.modules.pop("my_losses", None)


def test_a_policy_loss_brings_its_own_clip_and_level_where_it_is_not_the_estimator_s():
    gspo_on_grpo = PPOConfig(advantage_estimator="grpo", num_generations=2, batch_size=4, mini_batch_size=4,
                             policy_loss="gspo").resolved
    assert (gspo_on_grpo.cliprange, gspo_on_grpo.epsilon_high, gspo_on_grpo.importance_sampling_level) == \
        (3e-4, 4e-4, "sequence")
    clip_on_gspo = PPOConfig(advantage_estimator="gspo", num_generations=2, batch_size=4, mini_batch_size=4,
                             policy_loss="clip").resolved  # the clip brings none of its own: the estimator's
    assert (clip_on_gspo.cliprange, clip_on_gspo.importance_sampling_level) == (3e-4, "sequence")


@pytest.mark.parametrize("options,message", [
    ({"policy_loss": "nope"}, r"^PPOConfig.policy_loss 'nope' is not a registered policy loss; one of clip, gspo, "
     r"cispo, or one of your own"),
    ({"policy_loss": "cispo", "policy_loss_kwargs": {"cp": 5.0}}, r"policy_loss_kwargs.*parameters of policy loss "
     r"'cispo' \(one of \['cap'\]; not \['cp'\]\)"),
    ({"policy_loss": "clip", "loss_type": "cispo"}, r"policy_loss.*'cispo', as loss_type 'cispo' implies"),
])
def test_a_bad_policy_loss_is_one_clear_line(options, message):
    with pytest.raises(ValueError, match=message) as err:
        PPOConfig(**options)
    assert "\n" not in str(err.value)
