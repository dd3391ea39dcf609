"""Where the time of one step goes: each phase's seconds (from compare.py's last run) against the matmul FLOPs it
must do and this CPU's measured GEMM rate.

For each row of `bench/results/latest.json` and each phase (generate, the no-grad log-prob passes, the update), the
table gives the seconds, the FLOPs of the matrix products the phase cannot avoid (counted from the model's shape and
the step's real sequence lengths, padding excluded), and the seconds those FLOPs take at the GEMM rate this CPU
reaches on the phase's own matrix shapes (measured here, fp32 and bf16). Their ratio is how far a phase is from
pure matmul time: ~1 means it is the matmuls, much more means time goes elsewhere (memory traffic, the optimizer,
Python, small kernels). The update also steps the optimizer once per mini-batch, over every trainable weight: the
memory traffic no matmul count sees. The last two columns add that, timed here: torch's fused Adam (what both
ppo_core and TRL use) stepping float32 weights of the model's shapes, times the update's optimizer steps.

    .venv/bin/python bench/compare.py --shapes smollm2 ...     # first: writes bench/results/latest.json
    .venv/bin/python bench/phases.py                           # then this (about a minute: the GEMM rates)

FLOPs are 2 per multiply-add. Per token of a causal LM with hidden size H, MLP width I, L layers, V vocabulary and
KV width K: 2 L (2 H^2 + 2 H K + 3 H I) in the blocks, plus 4 L H t for attention over t positions, plus 2 H V for
the LM head where a logit is needed. A backward pass is counted as twice its forward.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import common
import compare
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def llama_dims(shape: common.Shape) -> dict:
    """H, I, L, V, K of the real model (its cached config)."""
    config = json.loads((common.real_model_dir(shape.real) / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return {"H": config["hidden_size"], "I": config["intermediate_size"], "L": config["num_hidden_layers"],
            "V": config["vocab_size"], "K": config["num_key_value_heads"] * head_dim}


def block_flops(d: dict, tokens: int, context: int) -> float:
    """Forward FLOPs of the transformer blocks for `tokens` positions attending over `context` positions on average."""
    per_token = 2 * d["L"] * (2 * d["H"] ** 2 + 2 * d["H"] * d["K"] + 3 * d["H"] * d["I"])
    return tokens * (per_token + 4 * d["L"] * d["H"] * context)


def step_flops(d: dict, setting: common.Setting, query_lengths: list, group: int = 1) -> dict:
    """The matmul FLOPs of one step's phases (generate; policy + reference log-prob passes; the PPO epochs), with
    logits only where they are needed: each sampled token (generate), each response token (log-probs, update)."""
    queries = query_lengths[: len(query_lengths) // group]
    queries = [q for q in queries for _ in range(group)]
    R = setting.max_new_tokens
    head = 2 * d["H"] * d["V"]
    prefill = sum(block_flops(d, q, q / 2) for q in queries)
    decode = sum(block_flops(d, 1, q + r) for q in queries for r in range(R - 1))
    generate = prefill + decode + head * len(queries) * R
    forward = sum(block_flops(d, q + R, (q + R) / 2) for q in queries) + head * len(queries) * R  # one pass
    return {"generate": generate, "log-probs": 2 * forward, "update": setting.ppo_epochs * 3 * forward}


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """FLOP/s of (m, k) @ (k, n) on this CPU in `dtype`, best of repeated timed runs."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    best, spent = float("inf"), 0.0
    while spent < seconds:
        with common.Timer() as t:
            for _ in range(5):
                a @ b
        best, spent = min(best, t.s / 5), spent + t.s
    return 2 * m * k * n / best


def parameter_shapes(d: dict) -> list[tuple[int, ...]]:
    """The trainable weights of the value-head model: the tied embedding / LM head, each layer's projections and norms,
    the final norm, the value head."""
    layer = [(d["H"], d["H"]), (d["K"], d["H"]), (d["K"], d["H"]), (d["H"], d["H"]),  # q, k, v, o
             (d["I"], d["H"]), (d["I"], d["H"]), (d["H"], d["I"]), (d["H"],), (d["H"],)]  # gate, up, down, 2 norms
    return [(d["V"], d["H"])] + layer * d["L"] + [(d["H"],), (1, d["H"]), (1,)]


def optimizer_step_seconds(d: dict, seconds: float = 3.0) -> float:
    """One fused Adam step (the default optimizer's kernel) over float32 weights of the model's shapes, with
    gradients in place, best of repeated timed runs."""
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in parameter_shapes(d)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.Adam(params, lr=1.41e-5, fused=True)
    for _ in range(2):
        optimizer.step()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        with common.Timer() as t:
            optimizer.step()
        best, spent = min(best, t.s), spent + t.s
    return best


def rates(d: dict, setting: common.Setting) -> dict:
    """GEMM rates on each phase's typical product, in fp32 and bf16: a decode step's (batch, H) x (H, I); the log-prob
    passes' and the update's (mini-batch tokens, H) x (H, I), one shape for both, measured once (two measurements of
    one shape a minute apart differ by up to 25% on this shared machine)."""
    tokens = setting.mini_batch_size * (setting.query_len_max + setting.max_new_tokens)
    shapes = {"generate": (setting.batch_size, d["H"], d["I"]), "log-probs": (tokens, d["H"], d["I"])}
    measured = {(phase, dtype): gemm_rate(*mkn, dtype, seconds=3.0) for phase, mkn in shapes.items()
                for dtype in (torch.float32, torch.bfloat16)}
    return measured | {("update", dtype): measured[("log-probs", dtype)] for dtype in (torch.float32, torch.bfloat16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS / "latest.json", help="a compare.py result (JSON)")
    results = json.loads(parser.parse_args().results.read_text())
    torch.set_num_threads(2)
    for shape_name, by_label in results.items():
        shape = common.SHAPES[shape_name]
        if not shape.real:
            continue
        setting, d = common.setting_for(shape_name), llama_dims(shape)
        measured = rates(d, setting)
        print(f"\n{shape_name}: GEMM rates (GFLOP/s) " + ", ".join(
            f"{phase} {str(dtype).removeprefix('torch.')} {rate / 1e9:.0f}"
            for (phase, dtype), rate in measured.items() if phase != "update"))
        adam = optimizer_step_seconds(d)
        steps = setting.ppo_epochs * setting.batch_size // setting.mini_batch_size
        print(f"fused Adam over {sum(math.prod(s) for s in parameter_shapes(d)) / 1e6:.1f} M float32 weights: "
              f"{adam:.3f} s a step, x {steps} optimizer steps = {adam * steps:.2f} s of each update")
        print("| impl | phase | s | GFLOPs | s at GEMM rate | ratio | + optimizer s | ratio to both |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|")
        lengths = [len(q) for q in common.make_queries(0, shape.vocab_size, setting)]  # the step the FLOPs count
        for label, r in by_label.items():
            if label.startswith("_") or "error" in r:
                continue
            group = 4 if "grpo" in label.lower() or "G=4" in label else 1
            flops = step_flops(d, setting, lengths, group)
            dtype = torch.bfloat16 if "bf16" in label else torch.float32
            for phase, s in zip(flops, compare.phase_medians(r["per_step"])):  # generate, log-probs, update
                ideal = flops[phase] / measured[(phase, dtype)]
                optimizer = adam * steps if phase == "update" and "lora" not in label.lower() else 0.0
                both = f"{optimizer:.2f} | {s / (ideal + optimizer):.1f}" if optimizer else " | "
                print(f"| {label} | {phase} | {s:.2f} | {flops[phase] / 1e9:.0f} | {ideal:.2f} | {s / ideal:.1f} | "
                      f"{both} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
