"""Rollout engines side by side: how fast each samples a step's responses, and whether they give the same tokens.

The engines, each on the same model, prompts and sampling (the seed's kwargs, EOS and PAD suppressed):
  generate   HF `generate` with its dynamic KV cache, one left-padded batch: what ppo_core's `generate` runs today
  static     HF `generate` with `cache_implementation="static"` (a preallocated cache; no compile)
  cb         transformers' continuous batching (`generate_batch`, transformers >= 5.8; TRL 1.16's
             `use_transformers_continuous_batching`): paged KV cache, prompts as ragged requests, no padding
  shared     ppo_core's `generate_batched(share_prompts=True)`: with `--group G`, each prompt's G copies in a round are
             prefilled once and share that KV cache (what the trainer does where num_generations > 1)
  generate_bf16w, static_bf16w, compiled_bf16w
             the same on a bf16 copy of the weights, no autocast (a rollout copy, as veRL and OpenRLHF keep one for
             their engines): `generate`; the static cache with `disable_compile=True`; the static cache with
             transformers' own compilation of the decoding step (on CUDA: `torch.compile`, CUDA graphs)

Interleaved: round r runs every engine once on round r's prompts, in an order that rotates each round; the table
gives each engine's median seconds and generated tokens/s, its ratio to `generate` (median of per-round ratios), and
how many sequences match their reference's token for token (`generate` in the same precision: `generate_bf16w` for
the engines on the bf16 copy, which are also compared with autocast's `generate`), greedy (do_sample=False: the
kernels' agreement) and sampled from the same seed (whether the engine draws its random numbers in the same order).

    .venv/bin/python bench/rollout.py --shape smollm2_135m --batch 16 --new-tokens 64 --rounds 3   # a 2-core CPU
    .venv/bin/python bench/rollout.py --engines generate shared --batch 32 --group 4 --query-len 46 49 --new-tokens 32
    python bench/rollout.py --shape qwen2.5_0.5b --bf16 --rounds 3 --out $OUT/rollout    # a GPU (gpu_real.sh)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import common
import torch

ENGINES = ("generate", "static", "cb", "shared", "generate_bf16w", "static_bf16w", "compiled_bf16w")
BF16W = {"generate_bf16w", "static_bf16w", "compiled_bf16w"}  # on the bf16 copy, no autocast


def sample_kwargs(setting: common.Setting, greedy: bool) -> dict:
    """The seed's sampling kwargs (common.gen_kwargs), or greedy decoding with the same length and suppression."""
    kwargs = common.gen_kwargs(setting)
    if greedy:
        kwargs.update(do_sample=False, top_k=None, top_p=None)
    kwargs.pop("min_length")
    return kwargs


def run_generate(model, queries: list, kwargs: dict, seed: int, static: bool = False, compile: bool = False) -> list:
    """HF `generate` on the left-padded batch; the responses as lists of ids. `static`: a static cache, compiled by
    transformers where it compiles (CUDA) only with `compile`."""
    input_ids, mask = common.left_pad(queries)
    dev = model.device
    torch.manual_seed(seed)
    extra = {"cache_implementation": "static", "disable_compile": not compile} if static else {}
    out = model.generate(input_ids=input_ids.to(dev), attention_mask=mask.to(dev), **kwargs, **extra)
    return [row.tolist() for row in out[:, input_ids.shape[1]:].cpu()]


def run_cb(model, queries: list, kwargs: dict, seed: int) -> list:
    """transformers' continuous batching on the ragged prompts; the responses as lists of ids, in the prompts' order."""
    from transformers import GenerationConfig

    config = GenerationConfig(**{k: v for k, v in kwargs.items() if k != "pad_token_id"}, pad_token_id=common.PAD_ID,
                              eos_token_id=common.EOS_ID)
    torch.manual_seed(seed)
    out = model.generate_batch(inputs=[q.tolist() for q in queries], generation_config=config, progress_bar=False)
    by_id = sorted(out.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
    return [list(o.generated_tokens) for o in by_id]


def run_shared(model, queries: list, kwargs: dict, seed: int) -> list:
    """ppo_core's generation with each distinct prompt prefilled once; transformers' own sampling draws, as
    `generate`'s (so that the same seed may give the same tokens)."""
    from types import SimpleNamespace

    from ppo_core.models.generation import generate_batched

    torch.manual_seed(seed)
    tokenizer = SimpleNamespace(pad_token_id=common.PAD_ID, eos_token_id=common.EOS_ID)
    out = generate_batched(model, tokenizer, [q.to(model.device) for q in queries], model.device, None, len(queries),
                           False, kwargs, fast_sampling=False, share_prompts=True)
    return [row.tolist() for row in out]


def make_queries(r: int, vocab: int, setting: common.Setting, group: int) -> list:
    """Round ``r``'s prompts: ``batch / group`` distinct ones, each ``group`` times in a row (a group's samples)."""
    distinct = common.make_queries(r, vocab, dataclasses.replace(setting, batch_size=setting.batch_size // group))
    return [q for q in distinct for _ in range(group)]


def engine_fn(name: str):
    static = lambda *a: run_generate(*a, static=True)  # noqa: E731
    return {"generate": run_generate, "static": static, "cb": run_cb, "shared": run_shared,
            "generate_bf16w": run_generate, "static_bf16w": static,
            "compiled_bf16w": lambda *a: run_generate(*a, static=True, compile=True)}[name]


def engine_context(name: str, autocast: bool):
    """The engine's precision: bf16 autocast over the float32 weights where asked, none on the bf16 copy."""
    if autocast and name not in BF16W:
        return torch.autocast(common.device().type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def reference(name: str, engines: list) -> str:
    """The engine whose tokens `name`'s are checked against: `generate` in the same precision (`generate_bf16w` for
    the bf16 copy, where it ran), so that the engine's agreement is told apart from the weights' precision."""
    return "generate_bf16w" if name in BF16W and "generate_bf16w" in engines else "generate"


def same(a: list, b: list) -> int:
    """How many of the sequences in `a` equal those of `b`, token for token."""
    return sum(x == y for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2_135m", choices=sorted(common.SHAPES))
    parser.add_argument("--engines", nargs="+", default=["generate", "static", "cb"], choices=ENGINES,
                        help="default: the float32/autocast engines (the bf16 copy's are for GPUs: bf16 matmuls on a "
                             "CPU without native bf16 are emulated and slow)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds, after one of warmup")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="under bf16 autocast over float32 weights, as ppo_core")
    parser.add_argument("--batch", type=int, default=None, help="prompts per round (default: the shape's work)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per response (default: the shape's)")
    parser.add_argument("--query-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="prompt lengths in tokens (default: the shape's)")
    parser.add_argument("--group", type=int, default=1, help="samples per prompt: batch / group distinct prompts, "
                        "each group times in a row (default 1: every prompt distinct)")
    parser.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    common.set_threads(args.threads)
    setting, vocab = common.setting_for(args.shape), common.SHAPES[args.shape].vocab_size
    setting = dataclasses.replace(setting, batch_size=args.batch or setting.batch_size,
                                  max_new_tokens=args.new_tokens or setting.max_new_tokens)
    if args.query_len:
        setting = dataclasses.replace(setting, query_len_min=args.query_len[0], query_len_max=args.query_len[1])
    model = common.build_model(args.shape, seed=setting.seed).to(common.device())
    models = {name: model for name in args.engines}
    if BF16W & set(args.engines):
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        models.update({name: bf16 for name in BF16W})

    rounds, errors = [], {}
    engines = list(args.engines)
    for r in range(1 + args.rounds):
        queries = make_queries(r, vocab, setting, args.group)
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        this = {}
        for name in order:
            try:
                with engine_context(name, args.bf16), torch.no_grad(), common.Timer() as t:
                    tokens = engine_fn(name)(models[name], queries, sample_kwargs(setting, greedy=False), 1000 + r)
                this[name] = {"s": t.s, "tokens": sum(len(x) for x in tokens), "sampled": tokens}
            except Exception as exc:  # noqa: BLE001  (an engine this transformers or device lacks: a row saying why)
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                engines.remove(name)
        print(f"  {'warmup' if r == 0 else 'round'} {r}: " + ", ".join(f"{k} {v['s']:.2f} s" for k, v in this.items()),
              flush=True)
        if r:
            rounds.append(this)
    # agreement with `generate`, on the last round's prompts: greedy, and sampled from one seed
    queries, agree = make_queries(0, vocab, setting, args.group), {}
    greedy = {}
    for name in engines:
        with engine_context(name, args.bf16), torch.no_grad():
            greedy[name] = engine_fn(name)(models[name], queries, sample_kwargs(setting, greedy=True), 0)
    for name in engines:
        ref = reference(name, engines)
        agree[name] = {"reference": ref, "greedy": same(greedy[name], greedy[ref]),
                       "sampled": same(rounds[-1][name]["sampled"], rounds[-1][ref]["sampled"])}
        if ref != "generate":  # and against autocast's generate: what the weights' precision changes
            agree[name].update(greedy_generate=same(greedy[name], greedy["generate"]),
                               sampled_generate=same(rounds[-1][name]["sampled"], rounds[-1]["generate"]["sampled"]))

    m = common.machine_info()
    prompts = (f"{setting.batch_size // args.group} prompts x {args.group} copies" if args.group > 1
               else f"{setting.batch_size} prompts")
    lines = [f"Rollout engines, {args.shape} ({prompts} of {setting.query_len_min}-{setting.query_len_max} tokens, "
             f"{setting.max_new_tokens} new tokens), "
             f"{'bf16 autocast' if args.bf16 else 'float32'}"
             f"{' (the *_bf16w engines: a bf16 copy of the weights, no autocast)' if BF16W & set(engines) else ''}"
             f", on {m['gpu'] or m['cpu']}; torch {m['torch']}, "
             f"transformers {m['transformers']}; {args.rounds} interleaved rounds after 1 warmup.", "",
             "| engine | median s | generated tokens/s | ratio to generate (s) | same tokens as its reference: greedy "
             "| sampled, same seed | bf16 copy against autocast's generate: greedy, sampled |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in args.engines:
        if name in errors:
            lines.append(f"| {name} | failed: {errors[name]} | | | | | |")
            continue
        secs = [rnd[name]["s"] for rnd in rounds]
        tps = statistics.median(rnd[name]["tokens"] / rnd[name]["s"] for rnd in rounds)
        ratio = statistics.median(rnd[name]["s"] / rnd["generate"]["s"] for rnd in rounds)
        n = setting.batch_size
        a = agree[name]
        agreement = ("(the reference) | (the reference)" if name == a["reference"] else
                     f"{a['greedy']}/{n} | {a['sampled']}/{n}")
        agreement += f" | {a['greedy_generate']}/{n}, {a['sampled_generate']}/{n}" if "greedy_generate" in a else " |"
        lines.append(f"| {name} | {statistics.median(secs):.2f} | {tps:.0f} | {ratio:.2f} | {agreement} |")
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    if args.out:
        Path(args.out + ".md").write_text(report)
        Path(args.out + ".json").write_text(json.dumps(
            {"machine": m, "shape": args.shape, "bf16": args.bf16, "errors": errors, "agree": agree,
             "rounds": [{k: {"s": v["s"], "tokens": v["tokens"]} for k, v in rnd.items()} for rnd in rounds]},
            indent=1))
    sys.exit(1 if "generate" in errors else 0)


if __name__ == "__main__":
    main()
