"""Time the seed's PPO loop (generate -> rule score -> step) with TRL 0.11.4 or ppo_core.

The two libraries share one API, so the code below is the same for both apart from the import:

    # ppo_core, in the project venv
    .venv/bin/python bench/ppo_step.py --impl ppo_core --shape 32k --steps 5 --warmup 1
    # TRL's legacy PPOTrainer, in the scratch venv (see bench/README.md)
    /work/trl-venv/bin/python bench/ppo_step.py --impl trl --shape 32k --steps 5 --warmup 1
    # ppo_core with a LoRA policy (reference = the adapter-disabled model, no second copy of the weights)
    .venv/bin/python bench/ppo_step.py --impl ppo_core --shape 32k --steps 5 --warmup 1 --lora
    # ppo_core sampling from a bf16 rollout copy with the static cache (on CUDA: a compiled decoding step); on a CUDA
    # GPU with bf16 that is the default (rollout_dtype "auto"), which --policy-sampling turns off (TRL 0.11's sampling)
    .venv/bin/python bench/ppo_step.py --impl ppo_core --shape 32k --steps 5 --warmup 1 --bf16 --fast-generate
    # a worker of compare.py's interleaved runs: builds the trainer, then runs steps on request
    .venv/bin/python bench/ppo_step.py --impl ppo_core --shape 32k --serve

Setting (bench/common.py): fp32 unless --bf16, batch 64, mini-batch 16, 4 PPO epochs, 24 new tokens per
response (EOS/PAD suppressed so every impl generates exactly 64 * 24 tokens), a random-init GPT-2 saved
with `save_pretrained` and loaded back from that directory.
"""

import argparse
import importlib
import statistics
import sys
import tempfile
from pathlib import Path

import common
import torch

# Stats both libraries report under TRL's names; kept per step as a sanity check that the impls agree.
# --fast-generate's generate() kwargs: a static KV cache, which on CUDA transformers compiles (CUDA graphs)
FAST_GENERATE = {"cache_implementation": "static"}
STAT_KEYS = ("objective/kl", "objective/kl_coef", "ppo/loss/total", "ppo/policy/approxkl", "ppo/policy/clipfrac")


def import_impl(impl: str):
    """(PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead) from `trl` or `ppo_core`."""
    if impl == "ppo_core":  # importable from a plain checkout too, without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    lib = importlib.import_module(impl)
    return lib.PPOConfig, lib.PPOTrainer, lib.AutoModelForCausalLMWithValueHead


ESTIMATORS = ["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dapo", "gspo",
              "cispo"]


def lora_config(r: int, alpha: int, shape: str):
    """LoRA on the attention projections, no dropout: GPT-2's fused `c_attn` (peft's default for GPT-2), a Llama's
    q/k/v/o (as the real-model example)."""
    from peft import LoraConfig

    if common.SHAPES[shape].real or common.SHAPES[shape].config:
        return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
                      task_type="CAUSAL_LM")


GROUP_SIZE = 4  # samples per prompt of the group estimators (the same 64 rollouts per step: 16 prompts x 4)


def group_size(estimator: str) -> int:
    """G for ``--estimator``: 1 for GAE and REINFORCE++, which compare no samples of one prompt."""
    return 1 if estimator in ("gae", "reinforce_plus_plus") else GROUP_SIZE


def build_trainer(impl: str, shape: str, setting: common.Setting, bf16: bool, lora=None, estimator: str = "gae",
                  bf16_weights: bool = False, fast_generate: bool = False, compile_layers: bool = False,
                  policy_sampling: bool = False):
    """The seed's construction: value-head model from a local dir, default reference, local tokenizer.

    With `lora` (a peft LoraConfig) the policy gets a fresh adapter on the loaded model: the trainer then
    trains the adapter and the value head only, and takes the reference from the adapter-disabled model.
    With `bf16_weights` the model's weights are bf16 (the value head stays float32), no autocast, and the optimizer
    keeps float32 master copies (`PPOConfig(weights_dtype="bfloat16")`: ppo_core's `MasterAdam`): the lever against
    autocast's per-use casts; the policy then samples itself (no rollout copy), on a GPU with the static cache. With
    `fast_generate` generate() samples from a bf16 rollout copy of the policy (`rollout_dtype`; with `FAST_GENERATE`'s
    static cache), as ppo_core's defaults do on a CUDA GPU with bf16; with `policy_sampling` the policy samples itself,
    as TRL 0.11 did (`rollout_dtype=None`, the dynamic cache).
    With `compile_layers` each decoder layer of the policy is compiled (`torch.compile`, dynamic shapes): the lever
    against the update's kernel launches (its elementwise work fused per layer); the reference, a copy made before,
    stays as it is."""
    bf16 = bf16 and not bf16_weights
    PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead = import_impl(impl)
    config = PPOConfig(
        batch_size=setting.batch_size,
        mini_batch_size=setting.mini_batch_size,
        ppo_epochs=setting.ppo_epochs,
        learning_rate=setting.learning_rate,
        seed=setting.seed,
        # bf16 is mixed precision through accelerate (autocast, float32 master weights), as users run it.
        accelerator_kwargs={"mixed_precision": "bf16"} if bf16 else {},
        # ppo_core's critic-free estimators (each with its reference defaults); the legacy PPOConfig has no such field
        **({"advantage_estimator": estimator, "num_generations": group_size(estimator)} if estimator != "gae" else {}),
        **({"rollout_dtype": "bfloat16"} if fast_generate else {}),  # ppo_core's; the legacy PPOConfig has none
        **({"rollout_dtype": None} if policy_sampling else {}),
        **({"weights_dtype": "bfloat16"} if bf16_weights else {}),  # the LM cast by the trainer, masters in its Adam
    )
    torch.manual_seed(setting.seed)  # the value head is initialised at load time
    if common.SHAPES[shape].config:  # GBs of weights: handed over in memory (from_pretrained takes a model too)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(common.build_model(shape, seed=setting.seed))
    else:
        with tempfile.TemporaryDirectory() as model_dir:
            common.build_model_dir(shape, model_dir, seed=setting.seed)
            model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    digest = common.weights_digest(model.pretrained_model)  # the base weights, before any adapter
    if lora is not None:
        model = AutoModelForCausalLMWithValueHead.from_pretrained(model.pretrained_model, peft_config=lora)
    tokenizer = common.build_tokenizer(common.SHAPES[shape].vocab_size)
    trainer = PPOTrainer(config=config, model=model, ref_model=None, tokenizer=tokenizer)
    if compile_layers:
        for layer in decoder_layers(trainer.model.pretrained_model):
            layer.compile(dynamic=True)
    return trainer, digest


def decoder_layers(lm) -> torch.nn.ModuleList:
    """The decoder blocks of a transformers causal LM: Llama-like `model.layers`, GPT-2's `transformer.h`."""
    body = lm.model if hasattr(lm, "model") else lm.transformer
    return body.layers if hasattr(body, "layers") else body.h


def memory_breakdown(trainer) -> dict:
    """MiB of the weights the trainer holds (policy and reference together, each storage counted once:
    a frozen copy doubles them, a LoRA reference adds nothing), of the optimizer state, and the number of
    trainable parameters. Exact and machine-independent, unlike peak RSS."""
    models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
    storages = {}
    for model in models:
        for t in list(model.parameters()) + list(model.buffers()):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    optimizer_bytes = sum(v.numel() * v.element_size() for state in trainer.optimizer.state.values()
                          for v in state.values() if torch.is_tensor(v))
    return {
        "weights_mb": sum(storages.values()) / 2**20,
        "optimizer_state_mb": optimizer_bytes / 2**20,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "has_ref_copy": trainer.ref_model is not None,
    }


def run_step(trainer, step: int, vocab_size: int, setting: common.Setting, group: int = 1,
             generation: dict | None = None) -> dict:
    """One iteration of the seed's loop; returns its timings, mean score and a few trainer stats. With ``group``
    G, the batch is its first ``batch_size / G`` queries, each G times in a row (as the trainer's dataloader lays
    it out); ``generation``: kwargs of generate() over the seed's."""
    queries = common.make_queries(step, vocab_size, setting)
    queries = [q for q in queries[: len(queries) // group] for _ in range(group)]

    # 1. generate (the trainer pads, batches and strips the prompt)
    with common.Timer() as t_gen:
        responses = trainer.generate(
            queries, batch_size=setting.batch_size, return_prompt=False,
            **common.gen_kwargs(setting), **(generation or {})
        )
    # 2. score with a rule
    with common.Timer() as t_score:
        scores = common.rule_scores(responses, vocab_size)
    # 3. PPO step
    with common.Timer() as t_step:
        stats = trainer.step(queries, responses, scores)

    timers = (t_gen, t_score, t_step)
    return {
        "gen_s": t_gen.s,
        "score_s": t_score.s,
        "step_s": t_step.s,
        # step's phases by the trainer's own timers (both libraries report TRL's): the no-grad passes of policy and
        # reference (old and reference log-probs, values), then the PPO epochs
        "logprobs_s": float(stats["time/ppo/forward_pass"]),
        "update_s": float(stats["time/ppo/optimize_step"]),
        "total_s": sum(t.s for t in timers),
        "cpu_s": sum(t.cpu_s for t in timers),
        "gen_tokens": sum(len(r) for r in responses),
        "prompt_tokens": sum(len(q) for q in queries),
        "reward_mean": torch.stack(scores).mean().item(),
        "stats": {k: float(stats[k]) for k in STAT_KEYS if k in stats},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["ppo_core", "trl"], default="ppo_core", help="which PPOTrainer to time")
    common.add_common_args(parser)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (ppo_core only; needs peft)")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (TRL's example: 16)")
    parser.add_argument("--lora-alpha", type=int, default=16, help="LoRA alpha (TRL's example: 16)")
    parser.add_argument("--estimator", default="gae", choices=ESTIMATORS,
                        help=f"advantage estimator (ppo_core only; the group ones with G={GROUP_SIZE})")
    parser.add_argument("--compile-layers", action="store_true",
                        help="torch.compile each decoder layer of the policy (ppo_core only)")
    parser.add_argument("--fast-generate", action="store_true",
                        help="sample from a bf16 rollout copy with the static cache (ppo_core only; rollout_dtype)")
    parser.add_argument("--policy-sampling", action="store_true",
                        help="sample from the policy itself, as TRL 0.11 (ppo_core only; rollout_dtype None)")
    args = parser.parse_args()
    if args.policy_sampling and (args.impl != "ppo_core" or args.fast_generate):
        parser.error("--policy-sampling is ppo_core's (not with --fast-generate)")
    if args.compile_layers and args.impl != "ppo_core":
        parser.error("--compile-layers is benchmarked for --impl ppo_core")
    if args.fast_generate and (args.impl != "ppo_core" or args.bf16_weights):
        parser.error("--fast-generate is ppo_core's rollout copy of float32 weights (not with --bf16-weights)")
    if args.lora and args.impl != "ppo_core":
        parser.error("--lora is benchmarked for --impl ppo_core only (the TRL venv has no peft)")
    if args.estimator != "gae" and args.impl != "ppo_core":
        parser.error("--estimator is ppo_core's (legacy TRL has GAE only)")

    common.set_threads(args.threads)
    setting = common.setting_for(args.shape)
    lora = lora_config(args.lora_r, args.lora_alpha, args.shape) if args.lora else None
    if args.bf16_weights and (args.impl != "ppo_core" or args.lora):
        parser.error("--bf16-weights is benchmarked for --impl ppo_core without --lora")
    trainer, digest = build_trainer(args.impl, args.shape, setting, args.bf16, lora, args.estimator,
                                    args.bf16_weights, args.fast_generate, args.compile_layers, args.policy_sampling)
    generation = FAST_GENERATE if args.fast_generate else None
    vocab, group = common.SHAPES[args.shape].vocab_size, group_size(args.estimator)

    impl = f"{args.impl}, LoRA r={args.lora_r}" if args.lora else args.impl
    impl += ", bf16 weights" if args.bf16_weights else ""
    impl += ", bf16 rollout copy + static cache" if args.fast_generate else ""
    impl += ", sampling from the policy" if args.policy_sampling else ""
    impl += ", compiled layers" if args.compile_layers else ""
    impl += f", {args.estimator}" + (f" G={group}" if group > 1 else "") if args.estimator != "gae" else ""
    if args.serve:
        common.serve(lambda step: run_step(trainer, step, vocab, setting, group, generation),
                     lambda: dict(common.describe(impl, args, setting, digest), memory=memory_breakdown(trainer)))
        return
    n_steps = args.warmup + args.steps
    one_step = lambda step: run_step(trainer, step, vocab, setting, group, generation)  # noqa: E731
    steps, others_frac = common.run_steps(one_step, n_steps)
    last = steps[-max(1, len(steps) // 4) :]  # the last quarter of the run
    result = common.summarize(impl, args, setting, digest, steps, others_frac)
    result.update(
        median_step_s=common.median_after_warmup([s["step_s"] for s in steps], args.warmup),
        reward_mean_last=statistics.mean(s["reward_mean"] for s in last),
        lora={"r": args.lora_r, "alpha": args.lora_alpha, "target_modules": sorted(lora.target_modules)}
        if lora else None,
        memory=memory_breakdown(trainer),
    )
    common.report(result, args.json)
    mem = result["memory"]
    print(f"  weights held (policy + reference) {mem['weights_mb']:.1f} MiB"
          f"{'' if mem['has_ref_copy'] else ' (no reference copy)'}, "
          f"optimizer state {mem['optimizer_state_mb']:.1f} MiB, "
          f"{mem['trainable_params']:,} trainable parameters")


if __name__ == "__main__":
    main()
