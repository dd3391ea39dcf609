"""The floor: the bare model work of one PPO step, with plain transformers calls and nothing else.

One PPO step of the seed's loop cannot cost less than:
  1. one `generate` of the whole batch (left-padded, with attention mask, the seed's sampling kwargs),
  2. two no-grad forwards of the full (batch, query + response) sequences: policy and reference,
  3. ppo_epochs * batch / mini_batch optimizer steps (16 here), each a forward with `labels=input_ids`
     (so transformers computes a loss from the full logits), a backward and an `Adam` step.
No value head, no KL, no advantages, no per-token bookkeeping: a trainer's "ratio to floor" is the price of
everything it does on top of this.

    python bench/floor.py --shape 32k --steps 5 --warmup 1 --json /tmp/floor.json
    python bench/floor.py --shape 32k --serve     # a worker of compare.py: steps on request
"""

import argparse
import copy
import tempfile

import common
import torch
from transformers import AutoModelForCausalLM


def load_models(shape: str, setting: common.Setting, bf16: bool, dev: torch.device):
    """Policy (trainable) and a frozen reference copy, from a `save_pretrained` dir like ppo_step.py."""
    with tempfile.TemporaryDirectory() as model_dir:
        common.build_model_dir(shape, model_dir, seed=setting.seed)
        policy = AutoModelForCausalLM.from_pretrained(model_dir)
    if bf16:
        policy = policy.to(torch.bfloat16)
    policy = policy.to(dev)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    return policy, ref


def floor_step(policy, ref, optimizer, queries: list, setting: common.Setting, dev: torch.device) -> dict:
    """One step of bare model work; returns the seconds spent in each phase."""
    input_ids, attention_mask = (t.to(dev) for t in common.left_pad(queries))

    # 1. generate: (B, Tq) -> (B, Tq + max_new_tokens), left padding kept
    with common.Timer() as t_gen, torch.no_grad():
        sequences = policy.generate(input_ids=input_ids, attention_mask=attention_mask, **common.gen_kwargs(setting))
    new_tokens = sequences.shape[1] - input_ids.shape[1]
    full_mask = torch.cat([attention_mask, torch.ones_like(sequences[:, input_ids.shape[1] :])], dim=1)  # (B, T)

    # 2. policy and reference forwards of the full sequences (logprobs/values/ref_logprobs in a trainer)
    with common.Timer() as t_fwd, torch.no_grad():
        policy(input_ids=sequences, attention_mask=full_mask)
        ref(input_ids=sequences, attention_mask=full_mask)

    # 3. ppo_epochs passes over shuffled mini-batches: forward + backward + Adam
    with common.Timer() as t_train:
        for _ in range(setting.ppo_epochs):
            for idx in torch.randperm(setting.batch_size).split(setting.mini_batch_size):
                mb_ids, mb_mask = sequences[idx], full_mask[idx]  # (mb, T)
                loss = policy(input_ids=mb_ids, attention_mask=mb_mask, labels=mb_ids).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()

    timers = (t_gen, t_fwd, t_train)
    return {
        "gen_s": t_gen.s,
        "forward_s": t_fwd.s,
        "train_s": t_train.s,
        "total_s": sum(t.s for t in timers),
        "cpu_s": sum(t.cpu_s for t in timers),
        "gen_tokens": new_tokens * len(queries),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    args = parser.parse_args()

    common.set_threads(args.threads)
    setting, dev = common.setting_for(args.shape), common.device()
    torch.manual_seed(setting.seed)
    policy, ref = load_models(args.shape, setting, args.bf16, dev)
    optimizer = torch.optim.Adam(policy.parameters(), lr=setting.learning_rate)
    vocab = common.SHAPES[args.shape].vocab_size

    def step_fn(step: int) -> dict:
        queries = common.make_queries(step, vocab, setting)
        return floor_step(policy, ref, optimizer, queries, setting, dev)

    if args.serve:
        common.serve(step_fn, lambda: common.describe("floor", args, setting, common.weights_digest(ref)))
        return
    steps, others_frac = common.run_steps(step_fn, args.warmup + args.steps)
    result = common.summarize("floor", args, setting, common.weights_digest(ref), steps, others_frac)
    result.update(
        median_forward_s=common.median_after_warmup([s["forward_s"] for s in steps], args.warmup),
        median_train_s=common.median_after_warmup([s["train_s"] for s in steps], args.warmup),
    )
    common.report(result, args.json)


if __name__ == "__main__":
    main()
