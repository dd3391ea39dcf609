"""stages/shared/models.py, what the sft and reward stages share: float32 weights trained and saved from a bf16
checkpoint (``load_float32``), their Trainer's mixed-precision arguments (``precision_args``) and, built beside them in
each stage's ``training_args``, its TF32 one."""

from __future__ import annotations

import dataclasses
import shutil

from transformers import AutoModelForCausalLM, AutoTokenizer

from stages import sft
from stages.shared.artifacts import RAW_PAIRS, RAW_SFT, REWARD_MODEL, SFT_MODEL


def test_sft_and_reward_train_float32_weights_from_a_bf16_checkpoint(tiny_run, tiny_params, tmp_path):
    """transformers 5 loads a checkpoint in its saved dtype: from a bf16 model (sft's model.name_or_path, or the SFT
    model reward starts from) the stages trained bf16 weights, with no float32 master copy, and saved them so. They
    load float32 and save float32."""
    import torch
    from safetensors.torch import load_file

    from stages import reward

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_run / SFT_MODEL).to(torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL).save_pretrained(bf16)
    dtypes = lambda path: {t.dtype for t in load_file(path / "model.safetensors").values()}  # noqa: E731
    assert dtypes(bf16) == {torch.bfloat16}
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    sft.run(dataclasses.replace(tiny_params, model=dataclasses.replace(tiny_params.model, name_or_path=str(bf16))),
            tmp_path)
    assert dtypes(tmp_path / SFT_MODEL) == {torch.float32}
    shutil.copytree(tiny_run / RAW_PAIRS.parent, tmp_path / "reward" / RAW_PAIRS.parent)
    shutil.copytree(bf16, tmp_path / "reward" / SFT_MODEL)
    reward.run(tiny_params, tmp_path / "reward")
    assert dtypes(tmp_path / "reward" / REWARD_MODEL) == {torch.float32}


def test_sft_and_reward_ask_transformers_for_tf32_only_on_gpus_that_have_it(tiny_params, tmp_path, monkeypatch):
    """TrainingArguments(tf32=True) where the GPU has TF32 (ppo_core.runtime.utils.tf32_supported,
    which NVIDIA_TF32_OVERRIDE=0 turns off), else None: torch's own setting (tf32=True raises on a GPU without it)."""
    from stages import reward

    for stage in (sft, reward):
        monkeypatch.setattr(stage, "TrainingArguments", lambda **kwargs: kwargs)
        assert stage.training_args(tiny_params, tmp_path)["tf32"] is None  # this CPU
    monkeypatch.setattr("ppo_core.runtime.utils.tf32_supported", lambda device: True)  # what stages.shared.runtime asks
    for stage in (sft, reward):
        assert stage.training_args(tiny_params, tmp_path)["tf32"] is True


def test_mixed_precision_is_the_trainers_autocast(tiny_params, tmp_path, monkeypatch):
    """model.mixed_precision: sft and reward train float32 weights under transformers' bf16 or fp16 autocast; auto is
    what the machine has (stages/shared/auto.py), here faked as a CPU with native bf16, then one without."""
    from stages import reward
    from stages.shared import auto
    from stages.shared.models import precision_args

    def with_precision(precision, kernels="native"):
        return dataclasses.replace(tiny_params, model=dataclasses.replace(tiny_params.model, mixed_precision=precision),
                                   numerics=dataclasses.replace(tiny_params.numerics, kernels=kernels))

    assert precision_args(with_precision(None)) == {"bf16": False, "fp16": False, "tf32": None}  # no TF32 on a CPU
    assert precision_args(with_precision("bf16")) == {"bf16": True, "fp16": False, "tf32": None}
    assert precision_args(with_precision("fp16")) == {"bf16": False, "fp16": True, "tf32": None}
    for units, expected in (((("amx_bf16",)), True), ((), False)):
        monkeypatch.setattr(auto, "machine", lambda units=units: auto.Machine("cpu", False, units))
        assert precision_args(with_precision("auto"))["bf16"] is expected
        assert precision_args(with_precision("auto", kernels="portable"))["bf16"] is False
    for stage in (sft, reward):
        monkeypatch.setattr(stage, "TrainingArguments", lambda **kwargs: kwargs)
        for precision in (None, "bf16", "fp16"):
            params = dataclasses.replace(tiny_params,
                                         model=dataclasses.replace(tiny_params.model, mixed_precision=precision))
            args = stage.training_args(params, tmp_path)
            assert (args["bf16"], args["fp16"]) == (precision == "bf16", precision == "fp16"), (stage, precision)
