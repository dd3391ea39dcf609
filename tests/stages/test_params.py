"""stages/shared/params.py: params.yaml mirrors the dataclasses; bad keys and types fail naming the key and the file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from stages.shared.params import SECTIONS, load_params
from stages.shared.runtime import ParamsError

ROOT = Path(__file__).resolve().parents[2]


def write_params(tmp_path: Path, edit) -> Path:
    """A copy of the tiny params with `edit(dict)` applied."""
    yaml = YAML(typ="safe", pure=True)
    raw = yaml.load((ROOT / "tests/fixtures/params.tiny.yaml").read_text())
    edit(raw)
    path = tmp_path / "params.yaml"
    yaml.dump(raw, path)
    return path


@pytest.mark.parametrize("path", ["params.yaml", "tests/fixtures/params.tiny.yaml"])
def test_committed_params_load(path):
    params = load_params(ROOT / path)
    assert params.data.is_synthetic
    assert params.scorer.source == "reward_model"


@pytest.mark.parametrize("path", ["params.yaml", "tests/fixtures/params.tiny.yaml"])
def test_ppo_section_is_ppoconfig_field_for_field(path):
    """Every field a user sets, in PPOConfig's order: not the derived ones (refused) nor the deprecated aliases."""
    from ppo_core.config import DERIVED, PPOConfig

    params = load_params(ROOT / path)
    deprecated = {"forward_batch_size", "optimize_cuda_cache"}
    assert list(params.ppo) == [f.name for f in dataclasses.fields(PPOConfig) if f.name not in {*DERIVED, *deprecated}]
    assert params.ppo_config.seed == params.seed  # ppo.seed: null -> the top-level seed


@pytest.mark.parametrize("key", ["world_size", "global_batch_size", "backward_batch_size", "global_backward_batch_size",
                                 "is_encoder_decoder", "is_peft_model"])
def test_derived_ppo_fields_are_refused_saying_they_are_derived(tmp_path, key):
    path = write_params(tmp_path, lambda p: p["ppo"].update({key: None}))
    with pytest.raises(ParamsError, match=rf"params.yaml: ppo\.{key} is derived \(.+\), not set; remove it$"):
        load_params(path)


def test_sections_are_exactly_the_loader_sections():
    raw = YAML(typ="safe", pure=True).load((ROOT / "params.yaml").read_text())
    assert list(raw) == list(SECTIONS)


def test_unknown_key_names_key_and_file(tmp_path):
    path = write_params(tmp_path, lambda p: p["sft"].update(learning_rte=0.1))
    with pytest.raises(ParamsError, match=r"params.yaml: unknown key 'sft.learning_rte'"):
        load_params(path)


def test_missing_key_names_key(tmp_path):
    path = write_params(tmp_path, lambda p: p["reward"].pop("batch_size"))
    with pytest.raises(ParamsError, match=r"missing key 'reward.batch_size'"):
        load_params(path)


@pytest.mark.parametrize(("section", "key", "value", "expected"), [
    ("sft", "batch_size", 3.5, "sft.batch_size must be an integer"),
    ("sft", "batch_size", True, "sft.batch_size must be an integer"),
    ("sft", "learning_rate", "fast", "sft.learning_rate must be a number"),
    ("generation", "do_sample", "yes", "generation.do_sample must be true or false"),
    ("model", "name_or_path", 3, "model.name_or_path must be a string"),
])
def test_wrong_type_names_key(tmp_path, section, key, value, expected):
    path = write_params(tmp_path, lambda p: p[section].update({key: value}))
    with pytest.raises(ParamsError, match=expected):
        load_params(path)


def test_numeric_strings_are_floats(tmp_path):
    """`dvc exp run -S` writes 2e-05; quoted or not, a float field takes it."""
    path = write_params(tmp_path, lambda p: p["sft"].update(learning_rate="2e-05"))
    assert "learning_rate: '2e-05'" in path.read_text()  # a string in the file
    assert load_params(path).sft.learning_rate == 2e-05
    path.write_text(path.read_text().replace("learning_rate: '2e-05'", "learning_rate: 3e-05"))
    assert load_params(path).sft.learning_rate == 3e-05  # YAML 1.2: a float, not the string PyYAML would give


def test_ranges_checked_at_load(tmp_path):
    path = write_params(tmp_path, lambda p: p["generation"].update(max_new_tokens=100))
    with pytest.raises(ParamsError, match="generation.max_new_tokens must be <= model.n_positions"):
        load_params(path)
    path = write_params(tmp_path, lambda p: p["model"].update(n_head=0))
    with pytest.raises(ParamsError, match="model.n_head must be > 0, got 0"):
        load_params(path)


def test_bad_ppo_field_is_a_params_error(tmp_path):
    path = write_params(tmp_path, lambda p: p["ppo"].update(learnig_rate=0.1))
    with pytest.raises(ParamsError, match=r"params.yaml: unknown key 'ppo.learnig_rate'; did you mean "
                                          r"'ppo.learning_rate'\?$"):
        load_params(path)


def test_the_ppo_config_is_built_once_at_load_with_the_generation_s_length(tmp_path):
    """Loading builds the ppo section's PPOConfig once, and the stages reuse it; `ppo.max_completion_length: null` is
    generation.max_new_tokens at load as in the ppo stage, so an overlong buffer is checked against that length
    there too. Params with another ppo section (`dataclasses.replace`) build their own."""
    path = write_params(tmp_path, lambda p: p["ppo"].update(overlong_buffer_len=4))
    params = load_params(path)
    assert params.ppo_config is params.ppo_config
    assert params.ppo_config.max_completion_length == params.generation.max_new_tokens
    assert params.ppo_config.overlong_buffer_len == 4
    changed = dataclasses.replace(params, ppo={**params.ppo, "learning_rate": 0.5})
    assert changed.ppo_config.learning_rate == 0.5 and params.ppo_config.learning_rate != 0.5


@pytest.mark.parametrize("generation, given, expected", [
    ({"temperature": 0.7}, None, 0.7),  # null: the temperature the stage samples at
    ({"temperature": 0.7}, 0.7, 0.7),  # the same value, given
    ({"temperature": 0.7, "do_sample": False}, None, 1.0),  # greedy: the raw logits
    ({}, None, 1.0),
])
def test_ppo_temperature_is_the_generation_s(tmp_path, generation, given, expected):
    def edit(p):
        p["generation"].update(generation)
        p["ppo"]["temperature"] = given
    assert load_params(write_params(tmp_path, edit)).ppo_config.temperature == expected


def test_explicit_ppo_seed_wins(tmp_path):
    path = write_params(tmp_path, lambda p: p["ppo"].update(seed=7))
    assert load_params(path).ppo_config.seed == 7


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ParamsError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1,\n")
    with pytest.raises(ParamsError, match="bad.yaml: not valid YAML"):
        load_params(bad)


def test_a_params_file_not_in_utf8_or_a_directory_is_one_line(tmp_path):
    """A Latin-1 accent in a comment (an editor's encoding) names the line and the byte; `--params data` (a folder)
    says what to pass; neither is a traceback."""
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes((ROOT / "tests/fixtures/params.tiny.yaml").read_bytes() + "# réglages\n".encode("latin-1"))
    lines = len(latin1.read_bytes().splitlines())
    with pytest.raises(ParamsError) as err:
        load_params(latin1)
    assert str(err.value) == f"{latin1}:{lines}: not UTF-8 text (byte 0xe9); save it as UTF-8"
    with pytest.raises(ParamsError) as err:
        load_params(tmp_path)
    assert str(err.value) == f"{tmp_path}: is a directory; pass --params the params file (YAML), e.g. params.yaml"


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda p: p["ppo"].update(accelerator_kwargs={"mixed_precison": "bf16"}),
     "unknown key 'ppo.accelerator_kwargs.mixed_precison'; did you mean 'ppo.accelerator_kwargs.mixed_precision'?"),
    (lambda p: p["ppo"].update(accelerator_kwargs={"log_with": "wandb"}),
     "ppo.accelerator_kwargs.log_with: the trainer passes it from ppo.log_with; set that instead"),
    (lambda p: p["ppo"].update(project_kwargs={"logdir": "logs"}),
     "unknown key 'ppo.project_kwargs.logdir'; did you mean 'ppo.project_kwargs.logging_dir'?"),
    (lambda p: p["scorer"].update(source="callable", name="rewards.example"),
     "scorer.name must be a 'module:function' with scorer.source callable, got 'rewards.example'"),
    (lambda p: p["sft"].update(weight_decay=-1.0), "sft.weight_decay must be >= 0, got -1.0"),
    (lambda p: p["watch"]["alerts"].update(entropy_ratio=5.0),
     "watch.alerts.entropy_ratio must be < 1 (a share of the first step's entropy), got 5.0"),
])
def test_values_that_would_fail_later_fail_at_load(tmp_path, edit, expected):
    """Mistakes that passed every check at load and failed only in their stage, after DVC deleted its outputs (a
    misspelt accelerate key: a TypeError in the ppo stage once the models loaded; a callable scorer without its
    function), or never (a negative weight decay, an entropy alert that fires at every step)."""
    path = write_params(tmp_path, edit)
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: {expected}"


@pytest.mark.parametrize(("judges", "expected"), [
    ({"mine": "my_judges"}, "evaluate.judges.mine must be a 'module:function', got 'my_judges'"),
    ({"mine": "my_judges:"}, "evaluate.judges.mine must be a 'module:function', got 'my_judges:'"),
    ({"reward": "my_judges:vowels"}, "evaluate.judges.reward must be a name other than ['win_rate', 'reward', 'kl', "
                                     "'length', 'sft', 'heldout', 'accuracy'] (metric names of their own), got "
                                     "'reward'"),
    ({"sft": "my_judges:vowels"}, "evaluate.judges.sft must be a name other than ['win_rate', 'reward', 'kl', "
                                  "'length', 'sft', 'heldout', 'accuracy'] (metric names of their own), got 'sft'"),
    ({"accuracy": "my_judges:vowels"}, "evaluate.judges.accuracy must be a name other than ['win_rate', 'reward', "
                                       "'kl', 'length', 'sft', 'heldout', 'accuracy'] (metric names of their own), got "
                                       "'accuracy'"),
])
def test_a_bad_judge_is_one_line_at_load(tmp_path, judges, expected):
    """evaluate.judges names a function per metric: a value that is no 'module:function', or a name that is one of
    data/eval/metrics.json's own keys (it would overwrite the scorer's reward or the SFT group), stops every stage at
    load (the sources stage, which runs first, hashes the judges' code)."""
    path = write_params(tmp_path, lambda p: p["evaluate"].update(judges=judges))
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: {expected}"


@pytest.mark.parametrize(("values", "expected"), [
    ({"samples_per_prompt": 0}, "evaluate.samples_per_prompt must be >= 1, got 0"),
    ({"samples_per_prompt": 4, "pass_at_k": [1, 8]}, "evaluate.pass_at_k must be each in [1, "
     "evaluate.samples_per_prompt], here [1, 4] (pass@k draws k of a prompt's samples), got [1, 8]"),
    ({"pass_at_k": [0]}, "evaluate.pass_at_k must be each in [1, evaluate.samples_per_prompt], here [1, 1] (pass@k "
     "draws k of a prompt's samples), got [0]"),
    ({"pass_at_k": ["4"]}, "evaluate.pass_at_k must be a list of integers, got ['4'] (list)"),
    ({"pass_at_k": 4}, "evaluate.pass_at_k must be a list of integers, got 4 (int)"),
    ({"success_threshold": "high"}, "evaluate.success_threshold must be a number, got 'high' (str)"),
    ({"base": "always"}, "evaluate.base must be one of ['sampled', 'greedy', 'none'], got 'always' (str)"),
])
def test_bad_accuracy_params_are_one_line_at_load(tmp_path, values, expected):
    """evaluate's accuracy table: k samples per prompt, the k of pass@k (none past the samples drawn), a numeric
    threshold or null."""
    path = write_params(tmp_path, lambda p: p["evaluate"].update(values))
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: {expected}"


def test_accuracy_params_load(tmp_path):
    path = write_params(tmp_path, lambda p: p["evaluate"].update(samples_per_prompt=8, pass_at_k=[1, 4, 8],
                                                                 success_threshold=None))
    loaded = load_params(path).evaluate
    assert (loaded.samples_per_prompt, loaded.pass_at_k, loaded.success_threshold) == (8, [1, 4, 8], None)


def test_judges_load_by_name_gold_included(tmp_path):
    """The example's judges, gold included, with data of its own (beside the synthetic data's gold score a judge may
    not take the name: tests/stages/test_bad_input.py)."""
    judges = {"gold": "rewards.sentiment:vader", "minilm": "rewards.sentiment:minilm"}  # the example's
    path = write_params(tmp_path, lambda p: (p["evaluate"].update(judges=judges),
                                             p["data"]["prompts"].update(source="prompts.jsonl")))
    assert load_params(path).evaluate.judges == judges


def test_mixed_precision_is_the_ppo_accelerator_s(tmp_path):
    """model.mixed_precision reaches the ppo stage as accelerate's `mixed_precision` (PPOConfig.accelerator_kwargs, as
    a legacy user would set it), beside the other accelerator kwargs; one set there too must agree, or the params
    stop at load with one line."""
    def precision(model, accelerator_kwargs):
        path = write_params(tmp_path, lambda p: (p["model"].update(mixed_precision=model),
                                                 p["ppo"].update(accelerator_kwargs=accelerator_kwargs)))
        return load_params(path).ppo_config.accelerator_kwargs

    assert precision(None, {}) == {}
    assert precision(None, {"mixed_precision": "fp16"}) == {"mixed_precision": "fp16"}  # accelerate's own, as legacy
    assert precision("bf16", {}) == {"mixed_precision": "bf16"}
    assert precision("bf16", {"mixed_precision": "bf16", "cpu": True}) == {"mixed_precision": "bf16", "cpu": True}
    with pytest.raises(ParamsError) as err:
        precision("bf16", {"mixed_precision": "fp16"})
    assert str(err.value) == (f"{tmp_path / 'params.yaml'}: ppo.accelerator_kwargs.mixed_precision (fp16) differs "
                              "from model.mixed_precision (bf16); set one of them")
    with pytest.raises(ParamsError, match=r"model.mixed_precision must be one of .*'bf16'.*got 'bf32'"):
        precision("bf32", {})


def test_an_unknown_ppo_key_suggests_and_lists_only_keys_a_user_may_set(tmp_path):
    """`dvc exp run -S +ppo.<key>=...` with a key nothing resembles: the list is what params.yaml may set, not the
    fields PPOConfig derives (world_size, backward_batch_size, ...)."""
    path = write_params(tmp_path, lambda p: p["ppo"].update({"zzzz": 1}))
    with pytest.raises(ParamsError, match=r"unknown key 'ppo.zzzz'; the keys here are") as err:
        load_params(path)
    from ppo_core.config import DERIVED

    assert "'learning_rate'" in str(err.value)
    assert not [key for key in [*DERIVED, "forward_batch_size"] if f"'{key}'" in str(err.value)]
    # close to a derived field only: that one is not suggested
    path = write_params(tmp_path, lambda p: p["ppo"].update({"world_sise": 1}))
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert "world_size" not in str(err.value)


def test_ppo_keys_left_out_are_named_once_with_the_defaults_they_take(tmp_path, capsys):
    from stages.ppo import note_defaulted_keys
    from stages.shared.checks import defaulted_ppo_keys

    path = write_params(tmp_path, lambda p: (p["ppo"].pop("batch_size"), p["ppo"].pop("ppo_epochs")))
    params = load_params(path)
    assert defaulted_ppo_keys(params) == {"batch_size": 128, "ppo_epochs": 4}
    (tmp_path / "all").mkdir()
    assert defaulted_ppo_keys(load_params(write_params(tmp_path / "all", lambda p: None))) == {}
    note_defaulted_keys(params)
    assert capsys.readouterr().err == (f"note: {path}: 2 ppo keys not set, so PPOConfig's defaults: batch_size=128, "
                                       "ppo_epochs=4\n")


def test_best_by_may_rank_by_one_of_the_combined_scorer_s_functions(tmp_path):
    """With `scorer.source: combined`, the held-out watch measures each function (`reward_NAME`): `keep: best` may rank
    by one; a name that is neither a function's nor a judge's is one line listing those it may be."""
    def combined(best_by):
        def edit(p):
            p["scorer"].update(source="combined", name=None, functions={
                "correct": {"name": "rewards.example:keyword_sentiment", "weight": 1.0}})
            p["watch"].update(eval_every=4, keep="best", best_by=best_by)
        return edit

    assert load_params(write_params(tmp_path, combined("reward_correct"))).watch.best_by == "reward_correct"
    path = write_params(tmp_path, combined("correct"))
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == (f"{path}: watch.best_by must be reward, gold, reward_NAME of a function of "
                              "scorer.functions or a judge of evaluate.judges (reward_correct) with watch.keep: best, "
                              "got 'correct'")
