"""Where one PPO step's time goes: torch.profiler over `trainer.step` (the no-grad log-prob passes and the update),
its device time by kind of work, and the kernels that take the most.

    python bench/profile_step.py --shape qwen2.5_0.5b --bf16 --out $OUT/profile      # a GPU (gpu_real.sh)
    .venv/bin/python bench/profile_step.py --shape tiny_qwen2                        # a CPU: operators' CPU time

One warmup step first (allocator growth, lazy init), then a second step's generate and score untimed, then its
`step()` under the profiler. On a GPU the time is the kernels' (device) time; "idle" is the step's wall time that
no kernel covered: launches, Python and host work the GPU waited for. On a CPU it is the operators' own CPU time.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import common
import ppo_step
import torch

# Kinds of work, matched in order against a kernel's (GPU) or operator's (CPU) name.
KINDS = (
    ("matmul", r"gemm|xmma|cutlass|matmul|aten::mm$|aten::addmm|aten::bmm|nvjet|splitk"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("log-prob (softmax, gather)", r"softmax|logsumexp|gather|cross_entropy|nll"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("norms, rotary, activations, casts (elementwise)", r"elementwise|vectorized|reduce|norm|copy|cast|mul|add|silu"),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny_qwen2", choices=sorted(common.SHAPES))
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (accelerate's autocast)")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="bf16 weights, no autocast, float32 master Adam (PPOConfig.weights_dtype)")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="kernels (operators) listed")
    parser.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    common.set_threads(args.threads)
    setting, vocab = common.setting_for(args.shape), common.SHAPES[args.shape].vocab_size
    lora = ppo_step.lora_config(16, 16, args.shape) if args.lora else None
    trainer, _ = ppo_step.build_trainer("ppo_core", args.shape, setting, args.bf16, lora,
                                        bf16_weights=args.bf16_weights)
    ppo_step.run_step(trainer, 0, vocab, setting)  # warmup

    queries = common.make_queries(1, vocab, setting)
    responses = trainer.generate(queries, batch_size=setting.batch_size, return_prompt=False,
                                 **common.gen_kwargs(setting))
    scores = common.rule_scores(responses, vocab)
    gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=activities) as prof, common.Timer() as wall:
        stats = trainer.step(queries, responses, scores)

    averages = prof.key_averages()
    if gpu:  # the kernels (device events); where a profiler lists none apart, the operators' own device time
        events = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA] or \
            [e for e in averages if e.self_device_time_total > 0]
        self_us = lambda e: e.self_device_time_total  # noqa: E731
    else:
        events = [e for e in averages if e.self_cpu_time_total > 0]
        self_us = lambda e: e.self_cpu_time_total  # noqa: E731
    busy_s = sum(self_us(e) for e in events) / 1e6
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + self_us(e) / 1e6
    launches = sum(e.count for e in events) if gpu else None
    top = sorted(events, key=self_us, reverse=True)[: args.top]

    tokens = sum(len(q) for q in queries) + sum(len(r) for r in responses)
    update_s, logprobs_s = float(stats["time/ppo/optimize_step"]), float(stats["time/ppo/forward_pass"])
    flops = setting.ppo_epochs * common.update_flops(args.shape, [tokens / len(queries)] * len(queries), bool(lora))
    peak = common.peak_flops("bf16" if args.bf16 or args.bf16_weights else "fp32")
    precision = "bf16 weights, float32 master Adam" if args.bf16_weights else "bf16 mixed" if args.bf16 else "float32"
    m = common.machine_info()
    where = m["gpu"] or m["cpu"]
    lines = [f"One PPO step of ppo_core under torch.profiler: {args.shape}, {precision}"
             f"{', LoRA r=16' if lora else ''}, {setting.batch_size} sequences of {tokens / len(queries):.0f} tokens, "
             f"{setting.ppo_epochs} epochs of mini-batches of {setting.mini_batch_size}; on {where}, "
             f"torch {m['torch']}.",
             "",
             f"Step {wall.s:.2f} s under the profiler (log-prob passes {logprobs_s:.2f} s, update {update_s:.2f} s; "
             f"update MFU {'-' if peak is None else format(flops / update_s / peak, '.1%')}); "
             + (f"kernels busy {busy_s:.2f} s ({busy_s / wall.s:.0%} of the step), {launches} kernel launches."
                if gpu else f"operators' own CPU time {busy_s:.2f} s."),
             "", f"| kind of work | {'device' if gpu else 'CPU'} s | share |", "|---|---:|---:|"]
    for kind, s in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {s:.3f} | {s / busy_s:.0%} |")
    if gpu:
        lines.append(f"| idle (no kernel running) | {max(0.0, wall.s - busy_s):.3f} | of the wall time: "
                     f"{max(0.0, wall.s - busy_s) / wall.s:.0%} |")
    lines += ["", f"| {'kernel' if gpu else 'operator'} | calls | s | kind |", "|---|---:|---:|---|"]
    for e in top:
        lines.append(f"| `{e.key[:90]}` | {e.count} | {self_us(e) / 1e6:.3f} | {kind_of(e.key)} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out + ".md").write_text(report)
        Path(args.out + ".json").write_text(json.dumps(
            {"machine": m, "shape": args.shape, "wall_s": wall.s, "busy_s": busy_s, "by_kind": by_kind,
             "launches": launches, "update_s": update_s, "logprobs_s": logprobs_s, "update_flops": flops,
             "top": [{"name": e.key, "count": e.count, "s": self_us(e) / 1e6} for e in top]}, indent=1))


if __name__ == "__main__":
    main()
