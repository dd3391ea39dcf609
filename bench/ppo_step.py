"""Time the seed's PPO loop (generate -> rule score -> step) with TRL 0.11.4 or ppo_core.

The two libraries share one API, so the code below is the same for both apart from the import:

    # ppo_core, in the project venv
    .venv/bin/python bench/ppo_step.py --impl ppo_core --shape 32k --steps 5 --warmup 1
    # TRL's legacy PPOTrainer, in the scratch venv (see bench/README.md)
    /work/trl-venv/bin/python bench/ppo_step.py --impl trl --shape 32k --steps 5 --warmup 1

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

import torch

import common

# Stats both libraries report under TRL's names; kept per step as a sanity check that the impls agree.
STAT_KEYS = ("objective/kl", "objective/kl_coef", "ppo/loss/total", "ppo/policy/approxkl", "ppo/policy/clipfrac")


def import_impl(impl: str):
    """(PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead) from `trl` or `ppo_core`."""
    if impl == "ppo_core":  # importable from a plain checkout too, without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    lib = importlib.import_module(impl)
    return lib.PPOConfig, lib.PPOTrainer, lib.AutoModelForCausalLMWithValueHead


def build_trainer(impl: str, shape: str, setting: common.Setting, bf16: bool):
    """The seed's construction: value-head model from a local dir, default reference, local tokenizer."""
    PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead = import_impl(impl)
    config = PPOConfig(
        batch_size=setting.batch_size,
        mini_batch_size=setting.mini_batch_size,
        ppo_epochs=setting.ppo_epochs,
        learning_rate=setting.learning_rate,
        seed=setting.seed,
        # bf16 is mixed precision through accelerate (autocast, float32 master weights), as users run it.
        accelerator_kwargs={"mixed_precision": "bf16"} if bf16 else {},
    )
    torch.manual_seed(setting.seed)  # the value head is initialised at load time
    with tempfile.TemporaryDirectory() as model_dir:
        common.build_model_dir(shape, model_dir, seed=setting.seed)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(model_dir)
    tokenizer = common.build_tokenizer(common.SHAPES[shape].vocab_size)
    trainer = PPOTrainer(config=config, model=model, ref_model=None, tokenizer=tokenizer)
    digest = common.weights_digest(model.pretrained_model)
    return trainer, digest


def run_step(trainer, step: int, vocab_size: int, setting: common.Setting) -> dict:
    """One iteration of the seed's loop; returns its timings, mean score and a few trainer stats."""
    queries = common.make_queries(step, vocab_size, setting)

    # 1. generate (the trainer pads, batches and strips the prompt)
    with common.Timer() as t_gen:
        responses = trainer.generate(
            queries, batch_size=setting.batch_size, return_prompt=False, **common.gen_kwargs(setting)
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
        "total_s": sum(t.s for t in timers),
        "cpu_s": sum(t.cpu_s for t in timers),
        "gen_tokens": sum(len(r) for r in responses),
        "reward_mean": torch.stack(scores).mean().item(),
        "stats": {k: float(stats[k]) for k in STAT_KEYS if k in stats},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["ppo_core", "trl"], default="ppo_core", help="which PPOTrainer to time")
    common.add_common_args(parser)
    args = parser.parse_args()

    common.set_threads(args.threads)
    setting = common.Setting()
    trainer, digest = build_trainer(args.impl, args.shape, setting, args.bf16)
    vocab = common.SHAPES[args.shape].vocab_size

    n_steps = args.warmup + args.steps
    steps, others_frac = common.run_steps(lambda step: run_step(trainer, step, vocab, setting), n_steps)
    last = steps[-max(1, len(steps) // 4) :]  # the last quarter of the run
    result = common.summarize(args.impl, args, setting, digest, steps, others_frac)
    result.update(
        median_step_s=common.median_after_warmup([s["step_s"] for s in steps], args.warmup),
        reward_mean_last=statistics.mean(s["reward_mean"] for s in last),
    )
    common.report(result, args.json)


if __name__ == "__main__":
    main()
