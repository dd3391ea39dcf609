"""Time TRL 1.16's `GRPOTrainer` on the work of `ppo_step.py --estimator grpo`: one round is one generation cycle.

ppo_core's GRPO round (bench/ppo_step.py --estimator grpo): batch/G prompts x G samples, the no-grad passes of policy
and reference, then 4 epochs over mini-batches (16 optimizer steps). The same work through TRL's own trainer, its
defaults overridden to match (run in its own venv: `pip install torch==2.13.0 trl==1.16.0`, see bench/README.md):

    GRPOConfig field             here                  why
    num_generations              4                     G, as ppo_core's group estimators in the bench
    steps_per_generation         batch / mini-batch    one generation of `batch` completions feeds 4 optimizer steps
    per_device_train_batch_size  mini-batch            completions per optimizer step
    num_iterations               4                     ppo_epochs: each generation is reused 4 times (16 steps)
    gradient_accumulation_steps  1                     so TRL computes the old log-probs (as ppo_core always does)
    beta                         0.04                  ppo_core grpo's kl_loss_coef (k3 in the loss): a reference pass
    loss_type                    "grpo"                ppo_core grpo's seq-mean-token-mean (TRL's default is "dapo")
    scale_rewards                "group"               ppo_core grpo's scale_rewards
    max_completion_length        the setting's         with EOS and PAD suppressed, every completion is that long
    temperature, top_p, top_k    1.0, 1.0, 0           the seed's sampling
    learning_rate                1.41e-5               legacy TRL's, as every row; AdamW at weight decay 0 is Adam
    bf16                         False (--bf16: True)  TRL's configs default to bf16 mixed precision on the CPU too
    gradient_checkpointing       False                 TRL's configs default to True: a second forward in backward

What still differs: TRL's optimizer is transformers' default AdamW (fused where torch has it) with a linear decay of
the learning rate, ppo_core's a fused Adam at a constant one; TRL's policy has no value head (ppo_core's GRPO keeps the
legacy value-head model and skips its loss); prompts are the same token ids (TRL tokenizes "t5 t77 ..." back to them).

    /work/trl116-venv/bin/python bench/grpo_trl.py --shape smollm2 --steps 3 --warmup 1
    /work/trl116-venv/bin/python bench/grpo_trl.py --shape smollm2 --serve     # a worker of compare.py
"""

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time

import common
import torch

GROUP_SIZE = 4  # ppo_step.GROUP_SIZE


def prompts_of_round(step: int, vocab_size: int, setting: common.Setting) -> list[str]:
    """The batch/G prompts of round `step` as text: the first ones of `make_queries(step)`, as ppo_step.run_step takes
    them (there each repeated G times; here TRL repeats them)."""
    queries = common.make_queries(step, vocab_size, setting)[: setting.batch_size // GROUP_SIZE]
    return [" ".join(f"t{int(i)}" for i in q) for q in queries]


def build_trainer(shape: str, setting: common.Setting, rounds: int, bf16: bool = False, lora=None):
    """A GRPOTrainer over `rounds` rounds of prompts (in order, unshuffled), on the shape's model; with `lora` (a peft
    LoraConfig, ppo_step.lora_config's) TRL trains that adapter and takes the adapter-disabled model as reference."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    vocab = common.SHAPES[shape].vocab_size
    model_dir = tempfile.mkdtemp(prefix="bench-grpo-")  # TRL loads its reference from the model's own path
    atexit.register(shutil.rmtree, model_dir, ignore_errors=True)
    common.build_model_dir(shape, model_dir, seed=setting.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    digest = common.weights_digest(model)

    def lower_half(completion_ids, **_):  # common.rule_scores on token ids
        return [sum(int(t) < vocab // 2 for t in ids) / max(1, len(ids)) for ids in completion_ids]

    updates = setting.batch_size // setting.mini_batch_size * setting.ppo_epochs  # per round
    out_dir = tempfile.mkdtemp(prefix="bench-grpo-out-")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    config = GRPOConfig(
        output_dir=out_dir, report_to=[], save_strategy="no", logging_steps=10**9, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), seed=setting.seed, shuffle_dataset=False,
        per_device_train_batch_size=setting.mini_batch_size, gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE, steps_per_generation=setting.batch_size // setting.mini_batch_size,
        num_iterations=setting.ppo_epochs, max_steps=rounds * updates,
        max_completion_length=setting.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"suppress_tokens": [common.PAD_ID, common.EOS_ID]},
        beta=0.04, epsilon=0.2, loss_type="grpo", scale_rewards="group", learning_rate=setting.learning_rate,
        bf16=bf16, gradient_checkpointing=False,
    )
    prompts = [p for r in range(rounds) for p in prompts_of_round(r, vocab, setting)]
    trainer = GRPOTrainer(model=model, reward_funcs=lower_half, args=config, peft_config=lora,
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=common.build_tokenizer(vocab))
    return trainer, digest, updates


class Phases:
    """Wraps the trainer's generation (`_generate`) and its rollout (`_generate_and_score_completions`: generation,
    rewards, old and reference log-probs) to split a round's seconds the way ppo_step.py does."""

    def __init__(self, trainer):
        self.gen_s = self.rollout_s = 0.0
        self.gen_tokens = self.prompt_tokens = 0
        generate, rollout = trainer._generate, trainer._generate_and_score_completions

        def timed_generate(*args, **kwargs):
            with common.Timer() as t:
                out = generate(*args, **kwargs)
            self.gen_s += t.s
            return out

        def timed_rollout(*args, **kwargs):
            with common.Timer() as t:
                out = rollout(*args, **kwargs)
            self.rollout_s += t.s
            self.gen_tokens += int(out["completion_mask"].sum())
            self.prompt_tokens += int(out["prompt_mask"].sum())
            return out

        trainer._generate, trainer._generate_and_score_completions = timed_generate, timed_rollout

    def take(self) -> dict:
        out = {"gen_s": self.gen_s, "logprobs_s": self.rollout_s - self.gen_s, "gen_tokens": self.gen_tokens,
               "prompt_tokens": self.prompt_tokens}
        self.gen_s = self.rollout_s = 0.0
        self.gen_tokens = self.prompt_tokens = 0
        return out


def run(trainer, updates: int, on_round) -> None:
    """Train, calling `on_round(step, result)` after each round of `updates` optimizer steps; it returns False to stop
    (what compare.py's `done` does)."""
    from transformers import TrainerCallback

    phases = Phases(trainer)

    class Rounds(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start()

        def start(self):
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.load = common.OthersLoad().__enter__()
            self.gpu = common.GpuPeak().__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % updates:
                return
            common.sync()
            total, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
            self.load.__exit__(None, None, None)
            self.gpu.__exit__(None, None, None)
            split = phases.take()
            result = dict(split, total_s=total, cpu_s=cpu, update_s=total - split["gen_s"] - split["logprobs_s"],
                          others_cpu_frac=self.load.frac, step_peak_gpu_mb=self.gpu.mb)
            if on_round(state.global_step // updates - 1, result) is False:
                control.should_training_stop = True
            else:
                self.start()

    trainer.add_callback(Rounds())
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (ppo_step.py --lora's; needs peft)")
    args = parser.parse_args()
    common.set_threads(args.threads)
    setting = common.setting_for(args.shape)
    rounds = 1000 if args.serve else args.warmup + args.steps
    lora = None
    if args.lora:
        from ppo_step import lora_config

        lora = lora_config(16, 16, args.shape)
    trainer, digest, updates = build_trainer(args.shape, setting, rounds, args.bf16, lora)
    impl = f"TRL GRPOTrainer G={GROUP_SIZE}" + (", bf16 mixed" if args.bf16 else "") + (", LoRA r=16" if lora else "")

    if args.serve:  # common.serve's protocol, driven from inside TRL's loop
        answer = lambda obj: print(common.PROTOCOL + json.dumps(obj), flush=True)  # noqa: E731

        def wait_for_step() -> bool:
            for line in sys.stdin:
                if line.startswith("step"):
                    return True
                if line.startswith("done"):
                    answer(common.describe(impl, args, setting, digest))
                    return False
            return False

        def on_round(step, result):
            answer(result)
            return wait_for_step()

        answer({"ready": True})
        if wait_for_step():
            run(trainer, updates, on_round)
        return

    steps = []
    run(trainer, updates, lambda step, result: steps.append(result) or len(steps) < rounds)
    result = common.summarize(impl, args, setting, digest, steps, None)
    common.report(result, args.json)


if __name__ == "__main__":
    main()
