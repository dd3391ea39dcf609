"""PPOConfig: the legacy fields and defaults, and validation that names the offending field."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import yaml

from ppo_core import PPOConfig

# Transcribed from the seed doc's ``class trl.PPOConfig`` signature (exp_name left out: it is the script name).
SEED_SIGNATURE_DEFAULTS = {
    "seed": 0, "log_with": None, "task_name": None, "model_name": "gpt2", "query_dataset": "imdb",
    "reward_model": "sentiment-analysis:lvwerra/distilbert-imdb", "remove_unused_columns": True,
    "tracker_kwargs": {}, "accelerator_kwargs": {}, "project_kwargs": {}, "tracker_project_name": "trl",
    "push_to_hub_if_best_kwargs": {}, "steps": 20000, "learning_rate": 1.41e-05, "adap_kl_ctrl": True,
    "init_kl_coef": 0.2, "kl_penalty": "kl", "target": 6, "horizon": 10000, "gamma": 1, "lam": 0.95,
    "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1, "batch_size": 128, "forward_batch_size": None,
    "mini_batch_size": 128, "gradient_accumulation_steps": 1, "world_size": None, "ppo_epochs": 4,
    "max_grad_norm": None, "optimize_cuda_cache": None, "optimize_device_cache": False, "early_stopping": False,
    "target_kl": 1, "compare_steps": 1, "ratio_threshold": 10.0, "use_score_scaling": False,
    "use_score_norm": False, "score_clip": None, "whiten_rewards": False, "gradient_checkpointing": False,
    "is_encoder_decoder": None, "is_peft_model": None, "backward_batch_size": None,
    "global_backward_batch_size": None, "global_batch_size": None,
}
DERIVED = {"backward_batch_size": 128}  # set by __post_init__ from mini_batch_size * gradient_accumulation_steps


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


BY_ESTIMATOR = {"init_kl_coef", "cliprange"}  # the estimator's (ppo_core.algo.registry): RLOO's KL 0.05, GSPO's clip


def test_every_seed_field_exists_with_the_seed_default():
    fields = {f.name: f for f in dataclasses.fields(PPOConfig)}
    missing = sorted(set(SEED_SIGNATURE_DEFAULTS) - set(fields))
    assert not missing, f"fields of trl.PPOConfig missing from ppo_core.PPOConfig: {missing}"
    for name, default in SEED_SIGNATURE_DEFAULTS.items():
        if name in BY_ESTIMATOR:  # None in the signature: the estimator's value, PPO's (the seed's) by default
            assert field_default(fields[name]) is None, name
            continue
        assert field_default(fields[name]) == default, name
        assert type(field_default(fields[name])) in (type(default), float), name
    assert "exp_name" in fields
    config = PPOConfig()  # the estimator is PPO's (gae): every seed default holds once the config is resolved
    for name, default in SEED_SIGNATURE_DEFAULTS.items():
        if name in BY_ESTIMATOR:  # left as given (None), the seed's value in what the config trains with
            assert getattr(config, name) is None and getattr(config.resolved, name) == default, name
            continue
        assert getattr(config, name) == DERIVED.get(name, default), name
    assert config.total_ppo_epochs == 157  # ceil(20000 / 128)


def test_mutable_defaults_are_not_shared_between_instances():
    a, b = PPOConfig(), PPOConfig()
    a.tracker_kwargs["wandb"] = {}
    assert b.tracker_kwargs == {}


@pytest.mark.parametrize("key,suggestion", [("learning_rat", "learning_rate"), ("batchsize", "batch_size"),
                                            ("mini_batch", "mini_batch_size")])
def test_unknown_key_is_named_with_a_close_match(key, suggestion):
    with pytest.raises(ValueError,
                       match=rf"^unknown key 'PPOConfig\.{key}'; did you mean 'PPOConfig\.{suggestion}'\?$"):
        PPOConfig(**{key: 1})
    with pytest.raises(ValueError, match=rf"unknown key 'PPOConfig\.{key}'"):
        PPOConfig.from_dict({"batch_size": 8, "mini_batch_size": 8, key: 1})


def test_unknown_key_without_a_close_match_is_still_named():
    with pytest.raises(ValueError, match=r"^unknown key 'PPOConfig\.zzzz'; the keys here are \['exp_name', 'seed', "):
        PPOConfig(zzzz=1)


@pytest.mark.parametrize("name,value", [
    ("batch_size", "sixteen"),  # string for int
    ("ppo_epochs", "four"),
    ("batch_size", 16.5),  # non-integral float for int
    ("batch_size", "1e-5"),  # numeric, but not an integer
    ("cliprange", [0.2]),  # list for float
    ("learning_rate", "abc"),
    ("learning_rate", "nan"),
    ("batch_size", True),  # bool for int
    ("gamma", False),  # bool for float
    ("early_stopping", "yes"),  # string for bool
    ("early_stopping", 1),  # int for bool
    ("kl_penalty", "kl2"),  # not one of the literals
    ("model_name", 3),  # int for str
    ("tracker_kwargs", ["wandb"]),  # list for dict
    ("score_clip", "big"),  # wrong type in an Optional field
])
def test_wrong_types_name_the_field(name, value):
    with pytest.raises(ValueError, match=rf"PPOConfig\.{name}\b"):
        PPOConfig(**{name: value})


@pytest.mark.parametrize("text,value", [("2e-05", 2e-5), ("1e-5", 1e-5), ("0.001", 1e-3), ("3", 3.0)])
def test_numeric_strings_are_accepted_as_floats(text, value):
    config = PPOConfig(learning_rate=text)
    assert isinstance(config.learning_rate, float)
    assert config.learning_rate == value


def test_integral_values_are_coerced_to_the_annotated_type():
    config = PPOConfig(batch_size=16.0, mini_batch_size=4, gamma=1, target_kl="2")
    assert config.batch_size == 16 and isinstance(config.batch_size, int)
    assert config.gamma == 1.0 and isinstance(config.gamma, float)
    assert config.target_kl == 2.0 and isinstance(config.target_kl, float)


@pytest.mark.parametrize("name,value", [
    ("batch_size", 0), ("batch_size", -8), ("mini_batch_size", 0), ("gradient_accumulation_steps", 0),
    ("ppo_epochs", 0), ("learning_rate", 0.0), ("learning_rate", -1e-5), ("learning_rate", "-1e-5"),
    ("cliprange", 0), ("steps", -1), ("target_kl", 0), ("vf_coef", -0.1), ("init_kl_coef", -0.2),
    ("gamma", 1.5), ("lam", -0.1),
])
def test_non_positive_sizes_and_rates_are_rejected(name, value):
    with pytest.raises(ValueError, match=rf"PPOConfig\.{name}\b"):
        PPOConfig(**{name: value})


def test_batch_size_must_divide_by_the_backward_batch():
    with pytest.raises(ValueError, match=r"^PPOConfig\.batch_size must be a multiple of mini_batch_size \* "
                                         r"gradient_accumulation_steps \(4 \* 1 = 4\), got 10; change batch_size"):
        PPOConfig(batch_size=10, mini_batch_size=4)
    with pytest.raises(ValueError, match=r"\(4 \* 3 = 12\), got 8; change batch_size or mini_batch_size$"):
        PPOConfig(batch_size=8, mini_batch_size=4, gradient_accumulation_steps=3)
    config = PPOConfig(batch_size=8, mini_batch_size=2, gradient_accumulation_steps=2)
    assert config.backward_batch_size == 4


def test_from_dict_accepts_what_pyyaml_reads():
    values = yaml.safe_load("learning_rate: 1e-5\nbatch_size: 8\nmini_batch_size: 4\nkl_penalty: abs\n"
                            "score_clip: null\nearly_stopping: true\n")
    assert isinstance(values["learning_rate"], str)  # PyYAML (YAML 1.1) reads 1e-5 without a dot as a string
    config = PPOConfig.from_dict(values)
    assert config.learning_rate == 1e-5 and isinstance(config.learning_rate, float)
    assert (config.batch_size, config.mini_batch_size, config.kl_penalty) == (8, 4, "abs")
    assert config.score_clip is None and config.early_stopping is True


def test_from_dict_rejects_a_non_mapping():
    with pytest.raises(ValueError, match="mapping"):
        PPOConfig.from_dict([("batch_size", 8)])


def test_to_dict_round_trips():
    config = PPOConfig(batch_size=16, mini_batch_size=4, learning_rate="3e-6", kl_penalty="full", exp_name="x")
    again = PPOConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()


def test_forward_batch_size_is_deprecated_and_overrides_mini_batch_size():
    with pytest.warns(FutureWarning, match="forward_batch_size"):
        config = PPOConfig(batch_size=64, mini_batch_size=32, forward_batch_size=16)
    assert config.mini_batch_size == 16
    assert config.backward_batch_size == 16


def test_optimize_cuda_cache_is_a_deprecated_alias():
    with pytest.warns(FutureWarning, match="optimize_cuda_cache"):
        config = PPOConfig(optimize_cuda_cache=True)
    assert config.optimize_device_cache is True


def test_defaults_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PPOConfig()


def test_kl_penalty_choices_are_the_math_layer_s():
    """config.py does not import the math layer (validating params must not execute it); the two lists agree."""
    import typing

    from ppo_core.algo.ppo_math import KL_PENALTIES

    assert typing.get_args(typing.get_type_hints(PPOConfig)["kl_penalty"]) == KL_PENALTIES


@pytest.mark.parametrize("kwargs,message", [
    ({"learning_rate": "fast"}, "PPOConfig.learning_rate must be a number, got 'fast' (str)"),
    ({"ppo_epochs": 2.5}, "PPOConfig.ppo_epochs must be an integer, got 2.5 (float)"),
    ({"kl_penalty": "kll"},
     "PPOConfig.kl_penalty must be one of ['kl', 'k1', 'abs', 'mse', 'k2', 'k3', 'full'], got 'kll' (str)"),
    ({"gamma": 1.5}, "PPOConfig.gamma must be in [0, 1], got 1.5"),
    ({"vf_coef": -1}, "PPOConfig.vf_coef must be >= 0, got -1.0"),
    ({"early_stopping": "yes"}, "PPOConfig.early_stopping must be true or false, got 'yes' (str)"),
    ({"steps": "{steps}"}, "PPOConfig.steps must be an integer, got '{steps}' (str)"),  # braces are no template
])
def test_one_wording_for_every_problem(kwargs, message):
    with pytest.raises(ValueError) as info:
        PPOConfig(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("kwargs,message", [
    ({"accelerator_kwargs": {"mixed_precison": "bf16"}},
     "unknown key 'PPOConfig.accelerator_kwargs.mixed_precison'; did you mean "
     "'PPOConfig.accelerator_kwargs.mixed_precision'?"),
    ({"accelerator_kwargs": {"gradient_accumulation_steps": 2}},
     "PPOConfig.accelerator_kwargs.gradient_accumulation_steps: the trainer passes it from "
     "PPOConfig.gradient_accumulation_steps; set that instead"),
    ({"accelerator_kwargs": {"project_config": None}},
     "PPOConfig.accelerator_kwargs.project_config: the trainer passes it from PPOConfig.project_kwargs; set that "
     "instead"),
    ({"project_kwargs": {"total_limt": 2}},
     "unknown key 'PPOConfig.project_kwargs.total_limt'; did you mean 'PPOConfig.project_kwargs.total_limit'?"),
])
def test_accelerate_kwargs_are_checked_against_accelerate_s_arguments(kwargs, message):
    """A misspelt Accelerator or ProjectConfiguration argument, or one the trainer passes itself (legacy: a TypeError
    when the trainer builds its Accelerator, after the models loaded), fails at the config with the key named."""
    with pytest.raises(ValueError) as info:
        PPOConfig(**kwargs)
    assert str(info.value) == message


def test_accelerate_s_own_arguments_are_accepted():
    config = PPOConfig(accelerator_kwargs={"mixed_precision": "bf16", "cpu": True, "kwargs_handlers": []},
                       project_kwargs={"logging_dir": "logs", "total_limit": 2})
    assert config.accelerator_kwargs["mixed_precision"] == "bf16" and config.project_kwargs["total_limit"] == 2


# ---- RunSizes and the trainer's copy of the config -------------------------------------------------------------------
def test_run_sizes_of_a_config_over_processes_by_hand():
    from ppo_core.config import RunSizes

    config = PPOConfig(batch_size=8, mini_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                       advantage_estimator="grpo")
    sizes = RunSizes.of(config, num_processes=3)
    assert (sizes.global_batch_size, sizes.backward_batch_size, sizes.global_backward_batch_size) == (24, 8, 24)
    assert sizes.prompts_per_step == 6  # 24 samples, 4 of each prompt
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.batch_size = 16


def test_the_trainer_s_config_is_a_copy_with_the_run_s_fields_and_the_caller_s_is_untouched():
    from ppo_core.config import RunSizes, run_config

    config = PPOConfig(batch_size=4, mini_batch_size=2)
    before = config.to_dict()
    run = run_config(config, RunSizes.of(config, 2), is_encoder_decoder=False, is_peft_model=True)
    assert config.to_dict() == before and config.world_size is None and config.global_batch_size is None
    assert (run.world_size, run.global_batch_size, run.global_backward_batch_size) == (2, 8, 4)
    assert run.is_peft_model and not run.is_encoder_decoder and run.batch_size == 4


def test_building_a_trainer_leaves_the_caller_s_config_as_it_was():
    import warnings as _warnings

    from ppo_core import PPOTrainer
    from tests.tiny import tiny_tokenizer, tiny_value_model

    config = PPOConfig(batch_size=4, mini_batch_size=2)
    before = config.to_dict()
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore", UserWarning)  # no dataset
        trainer = PPOTrainer(config, tiny_value_model(), tokenizer=tiny_tokenizer())
    assert config.to_dict() == before
    assert trainer.config is not config and trainer.config.global_batch_size == trainer.sizes.global_batch_size == 4
    assert trainer.config.is_peft_model is False


# ---- the resolved config: the estimator's defaults applied once, the user's fields left as given -------------------
# estimator: (kl_in, init_kl_coef, kl_loss_coef, loss_aggregation, policy_loss, cliprange, epsilon_high,
#             importance_sampling_level, dynamic_sampling, overlong_buffer_len with max_completion_length 20)
RESOLVED = {
    "gae": ("reward", 0.2, 0.0, "token-mean", "clip", 0.2, 0.2, "token", False, 0),
    "grpo": ("loss", 0.0, 0.04, "seq-mean-token-mean", "clip", 0.2, 0.2, "token", False, 0),
    "dr_grpo": ("loss", 0.0, 0.0, "seq-mean-token-sum-norm", "clip", 0.2, 0.2, "token", False, 0),
    "rloo": ("reward", 0.05, 0.0, "token-mean", "clip", 0.2, 0.2, "token", False, 0),
    "reinforce_plus_plus": ("reward", 0.01, 0.0, "token-mean", "clip", 0.2, 0.2, "token", False, 0),
    "reinforce_plus_plus_baseline": ("loss", 0.0, 0.001, "token-mean", "clip", 0.2, 0.2, "token", False, 0),
    "dapo": ("loss", 0.0, 0.0, "token-mean", "clip", 0.2, 0.28, "token", True, 4),
    "gspo": ("loss", 0.0, 0.0, "seq-mean-token-mean", "gspo", 3e-4, 4e-4, "sequence", False, 0),
    "cispo": ("loss", 0.0, 0.0, "token-mean", "cispo", 0.2, 0.2, "token", False, 0),
}
RESOLVED_KEYS = ("kl_in", "init_kl_coef", "kl_loss_coef", "loss_aggregation", "policy_loss", "cliprange",
                 "epsilon_high", "importance_sampling_level", "dynamic_sampling", "overlong_buffer_len")


def sized(estimator: str) -> dict:
    group = 1 if estimator in ("gae", "reinforce_plus_plus") else 4
    return {"advantage_estimator": estimator, "num_generations": group, "batch_size": 8, "mini_batch_size": 4,
            "max_completion_length": 20}


@pytest.mark.parametrize("estimator", sorted(RESOLVED))
def test_each_estimator_resolves_to_its_pinned_settings_and_leaves_the_fields_as_given(estimator):
    config = PPOConfig(**sized(estimator))
    resolved = config.resolved
    assert tuple(getattr(resolved, key) for key in RESOLVED_KEYS) == RESOLVED[estimator]
    assert (resolved.advantage_estimator, resolved.uses_critic) == (estimator, estimator == "gae")
    assert (resolved.kl_penalty, resolved.kl_estimator, resolved.max_completion_length) == ("kl", "k3", 20)
    assert resolved.policy_loss_kwargs == ({"cap": 5.0} if estimator == "cispo" else {})  # CISPO's own cap
    from ppo_core.config import RESOLVED_FIELDS

    defaults = {f.name: field_default(f) for f in dataclasses.fields(PPOConfig)}
    assert all(getattr(config, name) == defaults[name] for name in RESOLVED_FIELDS)  # nothing written back
    assert set(RESOLVED_FIELDS) <= set(resolved.to_dict())


@pytest.mark.parametrize("estimator", sorted(RESOLVED))
def test_replace_gives_the_run_that_the_same_fields_at_construction_give(estimator):
    """dataclasses.replace copies every field: resolved values written into them would pass for the user's choices
    (the run after `replace(PPOConfig(), advantage_estimator="grpo")` was GAE's: KL in the reward at 0.2)."""
    assert dataclasses.replace(PPOConfig(), **sized(estimator)).resolved == PPOConfig(**sized(estimator)).resolved
    grpo = dataclasses.replace(PPOConfig(**sized(estimator)), **sized("grpo"))
    assert grpo.resolved == PPOConfig(**sized("grpo")).resolved


def test_a_field_given_is_kept_through_replace_and_the_trainer_copy_holds_the_resolved_values():
    from ppo_core import PPOTrainer
    from tests.tiny import tiny_tokenizer, tiny_value_model

    config = dataclasses.replace(PPOConfig(cliprange=0.1), **sized("grpo"))
    assert config.cliprange == 0.1 and config.resolved.cliprange == 0.1 and config.resolved.kl_in == "loss"
    trainer = PPOTrainer(config, tiny_value_model("gpt2"), tokenizer=tiny_tokenizer())
    assert trainer.resolved == config.resolved and config.kl_in is None  # the caller's config untouched
    assert (trainer.config.kl_in, trainer.config.kl_loss_coef, trainer.config.init_kl_coef) == ("loss", 0.04, 0.0)
    assert (trainer.config.loss_aggregation, trainer.config.cliprange) == ("seq-mean-token-mean", 0.1)
    assert trainer.config.resolved == trainer.resolved  # the filled copy resolves to the same settings
