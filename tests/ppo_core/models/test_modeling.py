"""ppo_core.models.modeling: value-head models, their checkpoints, the response-only fast path and a model across
GPUs. The shared-layer reference models are ``test_reference.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ppo_core import AutoModelForCausalLMWithValueHead
from ppo_core.models.logprobs import selected_logprobs_and_entropy
from ppo_core.models.modeling import VALUE_HEAD_FILE
from ppo_core.step.inputs import build_model_inputs
from ppo_core.step.rollout import policy_outputs
from tests.tiny import ARCHS, EOS, VOCAB, random_queries, tiny_causal_lm, tiny_value_model

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], atol=0, rtol=0, msg=key)


# ---- forward -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_returns_float32_logits_loss_and_values(arch):
    model = tiny_value_model(arch).eval()
    input_ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    logits, loss, values = model(input_ids)
    assert logits.shape == (2, 5, VOCAB) and logits.dtype == torch.float32
    assert loss is None
    assert values.shape == (2, 5) and values.dtype == torch.float32
    # the value is the head applied to the last hidden state
    hidden = model.pretrained_model(input_ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(values, model.v_head.summary(hidden).squeeze(-1))
    _, loss, _ = model(input_ids, labels=input_ids)
    assert loss.ndim == 0 and torch.isfinite(loss)
    *_, past = model(input_ids, return_past_key_values=True)
    assert past is not None


def test_value_head_dropout_option():
    model = tiny_value_model("gpt2", summary_dropout_prob=0.5).train()
    assert isinstance(model.v_head.dropout, torch.nn.Dropout) and model.v_head.dropout.p == 0.5
    input_ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    _, _, v1 = model(input_ids)
    _, _, v2 = model(input_ids)
    assert not torch.allclose(v1, v2)  # dropout active in train mode
    model.eval()
    torch.testing.assert_close(model(input_ids)[2], model(input_ids)[2], atol=0, rtol=0)
    for off in (None, 0.0):
        assert isinstance(tiny_value_model("gpt2", summary_dropout_prob=off).v_head.dropout, torch.nn.Identity)


def test_value_head_normal_init_option():
    model = tiny_value_model("gpt2", v_head_init_strategy="normal", v_head_initializer_range=0.5)
    weight, bias = model.v_head.summary.weight, model.v_head.summary.bias
    assert torch.all(bias == 0)
    # 32 draws from N(0, 0.5): the sample std is within 30% of 0.5 for this seed
    assert abs(weight.std().item() - 0.5) < 0.15
    default = tiny_value_model("gpt2")  # PyTorch's default init: U(-1/sqrt(32), 1/sqrt(32)), |w| < 0.18
    assert default.v_head.summary.weight.abs().max() < 1 / 32**0.5
    with pytest.raises(ValueError, match="v_head_init_strategy"):
        tiny_value_model("gpt2", v_head_init_strategy="xavier")


def test_wrapping_rejects_a_non_transformers_model():
    with pytest.raises(ValueError, match="PreTrainedModel"):
        AutoModelForCausalLMWithValueHead(torch.nn.Linear(2, 2))


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_save_and_load_round_trip(tmp_path, arch):
    model = tiny_value_model(arch).eval()
    with torch.no_grad():
        model.v_head.summary.weight.add_(1.0)  # distinct from any fresh init
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / VALUE_HEAD_FILE).is_file()

    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path)).eval()
    assert_same_state(loaded, model)

    # the directory is a plain transformers checkpoint: same logits without ppo_core
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids).logits, model(input_ids)[0], atol=0, rtol=0)


def write_legacy_checkpoint(base, directory, layout: str, v_head: dict[str, torch.Tensor]) -> None:
    """Save ``base`` as TRL did: the ``v_head.*`` tensors inside the model's own weights."""
    directory = str(directory)
    if layout == "pytorch_model.bin":
        state = {k: v.contiguous() for k, v in base.state_dict().items()}
        base.config.save_pretrained(directory)
        torch.save({**state, **v_head}, os.path.join(directory, "pytorch_model.bin"))
        return
    base.save_pretrained(directory, max_shard_size="20KB" if layout == "sharded" else "5GB")
    index_file = os.path.join(directory, "model.safetensors.index.json")
    shard = "model.safetensors"
    if layout == "sharded":
        with open(index_file) as fh:
            index = json.load(fh)
        shard = sorted(set(index["weight_map"].values()))[-1]
        index["weight_map"].update({k: shard for k in v_head})
        with open(index_file, "w") as fh:
            json.dump(index, fh)
    weights_file = os.path.join(directory, shard)
    save_file({**load_file(weights_file), **v_head}, weights_file, metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["model.safetensors", "sharded", "pytorch_model.bin"])
def test_loading_a_legacy_trl_checkpoint_restores_the_value_head(tmp_path, layout):
    """TRL saved ``v_head.summary.{weight,bias}`` inside the model's own weights file(s)."""
    base = tiny_causal_lm("gpt2", seed=3)
    v_head = {"v_head.summary.weight": torch.randn(1, 32), "v_head.summary.bias": torch.randn(1)}
    write_legacy_checkpoint(base, tmp_path, layout, v_head)
    assert not (tmp_path / VALUE_HEAD_FILE).exists()

    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    torch.testing.assert_close(model.v_head.summary.weight, v_head["v_head.summary.weight"], atol=0, rtol=0)
    torch.testing.assert_close(model.v_head.summary.bias, v_head["v_head.summary.bias"], atol=0, rtol=0)
    assert_same_state(model.pretrained_model, base)


def test_loading_a_plain_lm_gives_a_fresh_value_head(tmp_path):
    tiny_causal_lm("llama").save_pretrained(str(tmp_path))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path), summary_dropout_prob=0.3)
    assert model.v_head.dropout.p == 0.3
    assert torch.isfinite(model.v_head.summary.weight).all()


def test_from_pretrained_rejects_unsupported_options_and_files(tmp_path):
    with pytest.raises(ValueError, match="peft_config"):
        AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(), peft_config=object())
    file = tmp_path / "model.bin"
    file.write_bytes(b"")
    with pytest.raises(ValueError, match="directory"):
        AutoModelForCausalLMWithValueHead.from_pretrained(str(file))


# ---- the response-only fast path against the legacy full-logits forward -------------------------
def legacy_logprobs_and_values(model, query: torch.Tensor, response: torch.Tensor):
    """One unpadded sequence through the legacy forward: log_softmax(logits) gathered at the response tokens,
    and the values at positions query_len - 1 + j."""
    sequence = torch.cat([query, response])[None]
    logits, _, values = model(sequence)
    start = len(query) - 1
    positions = torch.arange(start, start + len(response))
    logprobs = torch.log_softmax(logits[0, positions], -1).gather(-1, response[:, None]).squeeze(-1)
    return logprobs, values[0, positions]


def mixed_batch(seed: int = 0):
    queries = random_queries(5, seed=seed, min_len=1, max_len=6)
    gen = torch.Generator().manual_seed(seed + 100)
    lengths = [1, 7, 3, 5, 2]
    responses = [torch.randint(3, VOCAB, (k,), generator=gen) for k in lengths]
    responses[2][-1] = EOS
    return queries, responses


@pytest.mark.parametrize("arch", ARCHS)
def test_policy_outputs_match_the_legacy_full_forward(arch):
    model = tiny_value_model(arch).eval()
    queries, responses = mixed_batch()
    inputs = build_model_inputs(queries, responses, pad_token_id=0)
    with torch.no_grad():
        out = policy_outputs(model, inputs, with_entropy=True, chunk_size=3)
        for i, (q, r) in enumerate(zip(queries, responses)):
            logprobs, values = legacy_logprobs_and_values(model, q, r)
            torch.testing.assert_close(out.logprobs[i, :len(r)], logprobs, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.values[i, :len(r)], values, atol=1e-5, rtol=0)
            assert torch.all(out.logprobs[i, len(r):] == 0) and torch.all(out.values[i, len(r):] == 0)
            assert torch.all(out.entropy[i, :len(r)] > 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_scoring_forward_is_the_hidden_states_through_the_lm_head_bit_for_bit(arch):
    """``forward(score_positions=...)`` (the trainer's path: the LM head inside the forward, where ZeRO-3 gathers it)
    computes exactly what the hidden-only forward followed by the LM head outside it did, gradients included."""
    model = tiny_value_model(arch).eval()  # no dropout: the two passes must see the same network
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (3, 7), generator=gen)
    positions = torch.tensor([[0, 2], [0, 5], [1, 0], [2, 6]])  # (row, position) of 4 scored tokens
    targets = torch.randint(3, VOCAB, (4,), generator=gen)
    out = model(input_ids=input_ids, score_positions=positions, score_targets=targets, score_entropy=True,
                score_hidden=True, score_chunk_size=3)
    out.logprobs.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hidden = model.last_hidden_states(input_ids)
    values = model.v_head(hidden).squeeze(-1)
    selected = hidden[positions[:, 0], positions[:, 1]]
    logprobs, entropy = selected_logprobs_and_entropy(selected, model.lm_head(), targets, chunk_size=3)
    logprobs.sum().backward()
    for got, expected in ((out.logprobs, logprobs), (out.entropy, entropy), (out.values, values),
                          (out.hidden, selected)):
        assert torch.equal(got, expected)
    assert not out.hidden.requires_grad
    for name, param in model.named_parameters():  # the value head gets none: only the log-probs are summed
        assert (param.grad is None and grads[name] is None) or torch.equal(grads[name], param.grad), name
    assert model.lm_head_parameters() == [model.pretrained_model.lm_head.weight]  # GPT-2 et al.: no head bias


# ---- a model across GPUs (device_map), with the devices faked --------------------------------------
GPT2_ACROSS_TWO_GPUS = {  # what device_map="auto" does to a 2-block GPT-2 on two GPUs, and where the value head goes
    "pretrained_model.transformer.wte": "cuda:0", "pretrained_model.transformer.wpe": "cuda:0",
    "pretrained_model.transformer.h.0": "cuda:0", "pretrained_model.transformer.h.1": "cuda:1",
    "pretrained_model.transformer.ln_f": "cuda:1", "pretrained_model.lm_head": "cuda:0",  # tied to wte
}
VALUE_HEAD_ON_THE_FIRST_GPU = {"v_head": "cuda:0"}  # model.device at construction, as legacy TRL placed it (no hook)


@pytest.mark.parametrize("with_grad", [False, True])
def test_a_model_across_gpus_scores_each_head_on_its_device_and_returns_on_the_inputs(with_grad):
    """Under device_map="auto" the hidden states come out of the last shard (cuda:1) while the value head and the tied
    LM head sit on the first (cuda:0) with the inputs: the scoring forward moves them as legacy TRL did (it raised a
    device mismatch) and returns on the inputs' device the numbers of one device, bit for bit. The devices are
    faked (tests/fake_devices.py): labels that torch's device rules are checked against, the arithmetic the CPU's."""
    from tests.fake_devices import FakeDevices

    model = tiny_value_model("gpt2").eval()
    queries, responses = mixed_batch()
    inputs = build_model_inputs(queries, responses, pad_token_id=0)
    with torch.set_grad_enabled(with_grad):
        expected = policy_outputs(model, inputs, with_entropy=True)
        with FakeDevices(model, GPT2_ACROSS_TWO_GPUS, VALUE_HEAD_ON_THE_FIRST_GPU) as fake:
            got = policy_outputs(model, fake.place(inputs, "cuda:0"), with_entropy=True)
            assert {t.device for t in (got.logprobs, got.values, got.entropy)} == {torch.device("cuda:0")}
            logits, _, values = model(fake.place(inputs.input_ids, "cuda:0"))  # the legacy forward
            assert logits.device == values.device == torch.device("cuda:0")
    for name in ("logprobs", "values", "entropy"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
