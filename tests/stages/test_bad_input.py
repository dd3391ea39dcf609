"""Every bad input the pipeline can be given: one `error:` line naming the file, key, column or step and what to
do, exit status 2, no traceback, and no output written (the resumable state in data/checkpoints aside)."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import SafetensorError
from typer.testing import CliRunner

from ppo_core import AutoModelForCausalLMWithValueHead
from stages.shared.cli import app
from tests.conftest import write_params
from tests.stages.test_by_hand import start_holder

SCORERS = '''import math

def wrong_count(texts):
    return [1.0] * (len(texts) - 1)

def words(texts):
    return ["good"] * len(texts)

def nan(texts):
    return [math.nan] * len(texts)

def one_number(texts):
    return 1.0

def raises(texts):
    return [len(t) / 0 for t in texts]

CALLS = []

def nan_at_step_2(texts):
    CALLS.append(1)
    return [math.nan if len(CALLS) == 2 else 1.0] * len(texts)

def huge_at_step_2(texts):  # finite scores, but the value loss overflows: a non-finite loss, not a bad score
    CALLS.append(1)
    return [1e30 * (1 + t.count("e")) if len(CALLS) == 2 else 1.0 for t in texts]

def exits(texts):
    import sys
    sys.exit(0)

def two_args(texts, labels):
    return [1.0] * len(texts)

def needs_answer(completions, answer, **kwargs):
    return [1.0] * len(completions)
'''
LONG_PROMPT = "the movie was long and the plot was slow and the cast was good but the music was loud " * 3


def project(tiny_run: Path, tmp_path: Path, upstream_of: str | None) -> Path:
    """An empty project, or one holding every artifact the stage `upstream_of` reads (and none it writes)."""
    root = tmp_path / "project"
    root.mkdir()
    keep = {None: [], "sft": ["raw"], "tokenize": ["raw", "models/sft"],
            "ppo": ["raw", "tokenized", "models/sft", "models/reward"],
            "evaluate": ["raw", "tokenized", "models"],
            "report": ["raw", "tokenized", "models", "ppo", "eval"]}[upstream_of]
    for part in keep:
        src = tiny_run / "data" / part
        shutil.copytree(src, root / "data" / part)
    (root / "scorers.py").write_text(SCORERS)
    return root


def files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def setup_empty_jsonl(root):
    (root / "empty.jsonl").write_text("")


def setup_no_text_column(root):
    (root / "texts.jsonl").write_text("\n".join(json.dumps({"body": f"review {i}"}) for i in range(5)) + "\n")


def setup_long_prompts(root):
    for name in ("prompts_train", "prompts_eval"):
        pd.DataFrame({"query": [LONG_PROMPT] * 4}).to_parquet(root / "data" / "raw" / f"{name}.parquet")


def setup_long_eval_prompts(root):
    pd.DataFrame({"query": [LONG_PROMPT] * 4}).to_parquet(root / "data" / "raw" / "prompts_eval.parquet")


def setup_truncated_sft_parquet(root):
    path = root / "data" / "raw" / "sft.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def setup_empty_pairs_parquet(root):
    (root / "data" / "raw" / "pairs.parquet").write_bytes(b"")


def setup_prompts_not_parquet(root):
    (root / "data" / "raw" / "prompts_train.parquet").write_text("query\nthe movie was\n")


def setup_empty_model_dir(root):
    (root / "empty_model").mkdir()


def setup_qa_prompts(root, bad_row: int | None = None):
    """prompts.jsonl: 20 prompts with an integer answer each (one a mapping at ``bad_row``, counted from 1)."""
    rows = [{"question": f"the film number {i} was", "answer": i} for i in range(20)]
    if bad_row is not None:
        rows[bad_row - 1]["answer"] = {"not": "a number"}
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


QA = {"data.prompts.source": "prompts.jsonl", "data.prompts.columns": {"query": "question"}}


def setup_broken_scorer(root):
    (root / "broken.py").write_text("def score(texts):\n    return [1.0 for t in texts\n")


def setup_unwritable(folder: str):
    """`folder` made immutable (chattr +i: even root cannot create files in it); undone after the test."""
    def setup(root):
        path = root / folder
        path.mkdir(parents=True, exist_ok=True)
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode:
            pytest.skip("needs chattr +i (an immutable directory) to make a directory root cannot write")
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    return setup


# What libraries raise on a full disk: pyarrow an OSError with errno 28 but no file name, safetensors its own error,
# torch.save a RuntimeError about a short write (measured on a full tmpfs); none names the file.
PYARROW_DISK_FULL = OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
SAFETENSORS_DISK_FULL = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
TORCH_DISK_FULL = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


def disk_full(owner, name: str, where: str, error: Exception):
    """A setup: the writer ``owner.name`` runs out of space (writes some bytes, then raises ``error`` as the library
    does) when it writes to a path containing ``where``; undone after the test."""
    real = getattr(owner, name)

    def writer(*args, **kwargs):
        target = Path(next(arg for arg in args if isinstance(arg, (str, Path))))
        if where not in target.as_posix():
            return real(*args, **kwargs)
        partial = target / "model.safetensors" if name == "save_pretrained" else target
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(b"the first bytes")
        raise error

    def setup(root):
        patch = pytest.MonkeyPatch()
        patch.setattr(owner, name, writer)
        return patch.undo
    return setup


def setup_running(stage: str):
    """Another run of `stage` in progress: a process holding its lock; stopped after the test."""
    def setup(root):
        holder = start_holder(root / "data" / ".locks" / f"{stage}.lock", stage)
        return lambda: (holder.kill(), holder.wait())
    return setup


# (id, stage, upstream artifacts, params changes, extra setup, message fragment after "error: <stage>: ")
CASES = [
    ("unknown-key", "prepare", None, {"sft.learnin_rate": 0.1},
     None, "params.yaml: unknown key 'sft.learnin_rate'; did you mean 'sft.learning_rate'?"),
    ("wrong-type", "sft", "sft", {"sft.batch_size": "many"},
     None, "params.yaml: sft.batch_size must be an integer, got 'many' (str)"),
    ("not-a-number", "reward", None, {"reward.learning_rate": "fast"},
     None, "params.yaml: reward.learning_rate must be a number, got 'fast' (str)"),
    ("zero-size", "sft", "sft", {"sft.batch_size": 0},
     None, "params.yaml: sft.batch_size must be > 0, got 0"),
    ("negative-lr", "sft", "sft", {"sft.learning_rate": -0.001},
     None, "params.yaml: sft.learning_rate must be > 0, got -0.001"),
    ("ppo-typo-stops-the-first-stage", "prepare", None, {"ppo.learnin_rate": 1e-5},
     None, "params.yaml: unknown key 'ppo.learnin_rate'; did you mean 'ppo.learning_rate'?"),
    ("zero-ppo-lr", "ppo", "ppo", {"ppo.learning_rate": 0},
     None, "params.yaml: ppo.learning_rate must be > 0, got 0.0"),
    ("zero-ppo-size", "ppo", "ppo", {"ppo.mini_batch_size": 0},
     None, "params.yaml: ppo.mini_batch_size must be > 0, got 0"),
    ("batch-does-not-divide", "ppo", "ppo", {"ppo.mini_batch_size": 3},
     None, "params.yaml: ppo.batch_size must be a multiple of mini_batch_size * gradient_accumulation_steps "
           "(3 * 1 = 3), got 8"),
    ("fewer-prompts-than-a-step", "ppo", "ppo", {"ppo.batch_size": 64},
     None, "prompts, fewer than the 64 of one step (ppo.batch_size=64 x 1 processes / ppo.num_generations=1); "
           "lower ppo.batch_size in params.yaml or give more prompts"),
    ("dataset-missing", "prepare", None, {"data.sft.source": "missing.jsonl"},
     None, "missing.jsonl: file not found (data.sft.source)"),
    ("dataset-empty", "prepare", None, {"data.sft.source": "empty.jsonl"},
     setup_empty_jsonl, "empty.jsonl: no rows (data.sft.source in"),
    ("column-missing", "prepare", None, {"data.sft.source": "texts.jsonl"},
     setup_no_text_column, "texts.jsonl: column 'text' not found (data.sft.columns in"),
    ("prompts-beyond-context-scratch", "prepare", None, {"tokenize.max_query_tokens": 45},
     None, "params.yaml: generation.max_new_tokens must be <= model.n_positions - tokenize.max_query_tokens"),
    ("prompts-beyond-context", "tokenize", "tokenize",
     {"model.name_or_path": "data/models/sft", "tokenize.max_query_tokens": 100},
     setup_long_prompts, "data/raw/prompts_train.parquet: all 4 queries are 48 tokens or longer after truncation"),
    ("eval-prompts-beyond-context", "tokenize", "tokenize",  # the train prompts fit: neither table is written
     {"model.name_or_path": "data/models/sft", "tokenize.max_query_tokens": 100},
     setup_long_eval_prompts, "data/raw/prompts_eval.parquet: all 4 queries are 48 tokens or longer after truncation"),
    ("model-path-missing", "sft", "sft", {"model.name_or_path": "no/such-model"},
     None, "model.name_or_path 'no/such-model': no such directory, and no hub model of that id in the local cache "
           "(downloads are off: HF_HUB_OFFLINE=1); give the directory that save_pretrained wrote, or set "
           "HF_HUB_OFFLINE=0 to download it"),
    ("model-path-empty-dir", "sft", "sft", {"model.name_or_path": "empty_model"},
     setup_empty_model_dir, "model.name_or_path 'empty_model': the directory holds no saved model (no config.json)"),
    ("raw-parquet-truncated", "sft", "sft", {},
     setup_truncated_sft_parquet, "data/raw/sft.parquet: not a readable Parquet file ("),
    ("raw-parquet-empty", "reward", "tokenize", {},
     setup_empty_pairs_parquet, "data/raw/pairs.parquet: not a readable Parquet file ("),
    ("raw-parquet-not-parquet", "tokenize", "tokenize", {},
     setup_prompts_not_parquet, "data/raw/prompts_train.parquet: not a readable Parquet file ("),
    ("outputs-not-writable", "prepare", None, {},
     setup_unwritable("data/raw"), "operation not permitted; cannot write there (make it writable, or free space)"),
    ("models-not-writable", "ppo", "ppo", {},
     setup_unwritable("data/models"), "operation not permitted; cannot write there (make it writable, or free space)"),
    ("ppo-outputs-not-writable", "ppo", "ppo", {},
     setup_unwritable("data/ppo"), "data/ppo/.write-check-"),
    ("checkpoints-not-writable", "ppo", "ppo", {},
     setup_unwritable("data/checkpoints"), "data/checkpoints/ppo: operation not permitted; cannot write there"),
    ("scorer-source-is-a-function", "prepare", None, {"scorer.source": "myreward:score"},
     None, "params.yaml: scorer.source must be one of ['reward_model', 'pipeline', 'callable', 'combined'], got "
           "'myreward:score' (str); a function goes in scorer.name ('module:function') with scorer.source: callable"),
    ("reward-raises", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:raises"},
     None, "PPO step 1: scorer (callable scorers:raises) raised ZeroDivisionError: division by zero (scorers.py:16)"),
    ("reward-syntax-error", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "broken:score"},
     setup_broken_scorer, "params.yaml: scorer.name 'broken:score': broken.py:2: SyntaxError: '[' was never closed"),
    ("reward-wrong-count", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:wrong_count"},
     None, "PPO step 1: scorer (callable scorers:wrong_count) returned 7 scores for 8 texts; return one number per "
           "text"),
    ("reward-not-a-number", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:words"},
     None, "PPO step 1: scorer (callable scorers:words) returned 'good' (str) for text 0; return a number"),
    ("reward-nan", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:nan"},
     None, "PPO step 1: scorer (callable scorers:nan) returned nan for text 0; scores must be finite numbers"),
    ("reward-nan-in-evaluate", "evaluate", "evaluate", {"scorer.source": "callable", "scorer.name": "scorers:nan"},
     None, "the sft policy's samples 1-8: scorer (callable scorers:nan) returned nan for text 0"),
    ("reward-nan-at-step-2", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:nan_at_step_2"},
     None, "PPO step 2: scorer (callable scorers:nan_at_step_2) returned nan for text 0; scores must be finite"),
    ("loss-non-finite", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:huge_at_step_2"},
     None, "PPO step 2, mini-batch 1: non-finite ppo/"),
    ("loss-non-finite-names-the-scale", "ppo", "ppo",
     {"scorer.source": "callable", "scorer.name": "scorers:huge_at_step_2"},
     None, "e+30, a scale that overflows float32 in the loss: scale the scorer's output down (scores of a few units "
           "train best); the checkpoint in data/checkpoints/ppo (if any) is intact: a rerun resumes from it once that "
           "is changed"),
    ("reward-not-a-list", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:one_number"},
     None, "PPO step 1: scorer (callable scorers:one_number) returned float, not a list"),
    ("scorer-not-importable", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:missing"},
     None, "params.yaml: scorer.name 'scorers:missing' is not an importable 'module:function'"),
    ("raw-disk-full", "prepare", None, {},
     disk_full(pq, "write_table", "data/raw/.prompts_train.parquet.tmp-", PYARROW_DISK_FULL),
     "data/raw/prompts_train.parquet: no space left on device; cannot write there (make it writable, or free space)"),
    ("ppo-disk-full", "ppo", "ppo", {},
     disk_full(pq, "write_table", "data/ppo/.stats.parquet.tmp-", PYARROW_DISK_FULL),
     "data/ppo/stats.parquet: no space left on device; cannot write there (make it writable, or free space)"),
    ("ppo-model-disk-full", "ppo", "ppo", {},
     disk_full(AutoModelForCausalLMWithValueHead, "save_pretrained", "data/models/.ppo.tmp-", SAFETENSORS_DISK_FULL),
     "data/models/ppo: no space left on device; cannot write there (make it writable, or free space)"),
    ("checkpoints-disk-full", "ppo", "ppo", {},
     disk_full(torch, "save", "data/checkpoints/ppo/.tmp-state-", TORCH_DISK_FULL),
     "data/checkpoints/ppo/state: no space left on device; cannot write there (make it writable, or free space)"),
    ("stage-already-running", "ppo", "ppo", {},
     setup_running("ppo"), "another ppo run holds data/.locks/ppo.lock: pid "),
    ("upstream-missing", "ppo", None, {},
     None, "data/tokenized/train.parquet: not found; run the stage that writes it"),
]


def setup_bad_jsonl_line(root):
    (root / "bad.jsonl").write_text('{"text": "a fine film"}\n\n{"text": "slow",}\n{"text": "good"}\n')


def setup_blank_prompts(root):
    (root / "blank.jsonl").write_text("".join(json.dumps({"query": q}) + "\n" for q in ["", "   ", "\t"] * 10))


# Settings that were silently ignored or changed, or that failed late with a library's traceback (issue #23).
CASES += [
    ("seed-negative", "prepare", None, {"seed": -1},
     None, "params.yaml: seed must be >= 0, got -1"),
    ("temperature-zero", "ppo", "ppo", {"generation.temperature": 0},
     None, "params.yaml: generation.temperature must be > 0 (sampling divides the logits by it; greedy decoding is "
           "generation.do_sample: false), got 0.0"),
    ("temperature-negative", "prepare", None, {"generation.temperature": -1},
     None, "params.yaml: generation.temperature must be > 0"),
    ("top-k-negative", "ppo", "ppo", {"generation.top_k": -5},
     None, "params.yaml: generation.top_k must be >= 0 (0: no top-k filtering), got -5"),
    ("top-p-above-1", "ppo", "ppo", {"generation.top_p": 1.5},
     None, "params.yaml: generation.top_p must be in (0, 1] (1.0: no nucleus filtering), got 1.5"),
    ("min-query-tokens-negative", "tokenize", "tokenize", {"tokenize.min_query_tokens": -3},
     None, "params.yaml: tokenize.min_query_tokens must be >= 1, got -3"),
    ("vocab-below-the-bytes", "sft", "sft", {"model.vocab_size": 8},
     None, "params.yaml: model.vocab_size must be >= 258 (the 256 bytes of the byte-level BPE and its 2 special "
           "tokens), got 8"),
    ("kl-loss-coef-with-the-kl-in-the-reward", "ppo", "ppo", {"ppo.kl_loss_coef": 0.5},
     None, "params.yaml: ppo.kl_loss_coef must be unset (or 0) when the KL is in the reward (kl_in 'reward', whose "
           "coefficient is init_kl_coef), got 0.5; set kl_in: 'loss' for a KL loss term"),
    ("rollout-correction-without-a-rollout-copy", "ppo", "ppo", {"ppo.rollout_correction": "token_truncate"},
     None, "params.yaml: ppo.rollout_correction must be unset without rollout_dtype (without a rollout copy the policy "
           "samples itself: every weight would be 1), got 'token_truncate'; set rollout_dtype"),
    ("warmup-without-a-schedule", "ppo", "ppo", {"ppo.warmup_ratio": 0.1},
     None, "params.yaml: ppo.warmup_ratio must be 0 with lr_scheduler_type 'constant', which has no warmup, got 0.1; "
           "set lr_scheduler_type to 'constant_with_warmup' (or 'linear', 'cosine')"),
    ("lr-scheduler-type-unknown", "ppo", "ppo", {"ppo.lr_scheduler_type": "cosine_with_restarts"},
     None, "params.yaml: ppo.lr_scheduler_type must be one of ['constant', 'constant_with_warmup', 'linear', "
           "'cosine'], got 'cosine_with_restarts' (str)"),
    ("ppo-temperature-not-the-sampled-one", "ppo", "ppo", {"ppo.temperature": 0.7},
     None, "params.yaml: ppo.temperature is 0.7, but the ppo stage samples at 1.0 (generation.temperature, do_sample "
           "True); remove ppo.temperature or set it to 1.0"),
    ("group-estimator-decoding-greedily", "ppo", "ppo",
     {"ppo.advantage_estimator": "grpo", "ppo.num_generations": 4, "generation.do_sample": False},
     None, "params.yaml: generation.do_sample is false, but ppo.advantage_estimator grpo compares "
           "ppo.num_generations=4 samples of each prompt: greedy decoding makes them identical (every advantage 0); "
           "set generation.do_sample: true"),
    ("jsonl-bad-line", "prepare", None, {"data.sft.source": "bad.jsonl"},
     setup_bad_jsonl_line, "bad.jsonl:3: not valid JSON (Expecting property name enclosed in double quotes, column "
                           "17); fix that line"),
    ("model-path-absolute-missing", "sft", "sft", {"model.name_or_path": "/no/such/model"},
     None, "model.name_or_path '/no/such/model': no such directory; give the directory that save_pretrained wrote, "
           "or a Hugging Face hub id (namespace/name)"),
    ("prompts-all-blank", "prepare", None, {"data.prompts.source": "blank.jsonl"},
     setup_blank_prompts, "blank.jsonl: every row's query is blank (empty or only whitespace) (data.prompts.source)"),
]


def setup_numbers_in_texts(root):
    texts = ["a fine film", 5, "slow", None]
    (root / "numbers.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


# Mistakes found only by the stage that reads them, after DVC had deleted that stage's outputs, or as a library's
# TypeError: the sources stage (first in every `dvc repro`, deleting nothing) or the params' load now stops them.
CASES += [
    ("sources-model-path-missing", "sources", None, {"model.name_or_path": "/no/such/model"},
     None, "model.name_or_path '/no/such/model': no such directory; give the directory that save_pretrained wrote, "
           "or a Hugging Face hub id (namespace/name)"),
    ("sources-dataset-missing", "sources", None, {"data.prompts.source": "my_prompts.jsonl"},
     None, "my_prompts.jsonl: file not found (data.prompts.source); give an existing file, a Hugging Face dataset id, "
           "or 'synthetic'"),
    ("sources-pipeline-scorer-missing", "sources", None, {"scorer.source": "pipeline", "scorer.name": "./no_clf"},
     None, "scorer.name './no_clf': no such directory; give the directory that save_pretrained wrote, or a Hugging "
           "Face hub id (namespace/name)"),
    ("ppo-pipeline-scorer-missing", "ppo", "ppo", {"scorer.source": "pipeline", "scorer.name": "./no_clf"},
     None, "scorer.name './no_clf': no such directory; give the directory that save_pretrained wrote"),
    ("scorer-callable-without-function", "sources", None,
     {"scorer.source": "callable", "scorer.name": "rewards.example"},
     None, "params.yaml: scorer.name must be a 'module:function' with scorer.source callable, got 'rewards.example'"),
    ("accelerator-kwargs-typo", "ppo", "ppo", {"ppo.accelerator_kwargs": {"mixed_precison": "bf16"}},
     None, "params.yaml: unknown key 'ppo.accelerator_kwargs.mixed_precison'; did you mean "
           "'ppo.accelerator_kwargs.mixed_precision'?"),
    ("column-not-text", "prepare", None, {"data.sft.source": "numbers.jsonl"},
     setup_numbers_in_texts, "numbers.jsonl: column 'text' has 2 values that are not text (missing or numbers), the "
                             "first in row 2 (5); clean the file"),
]


def setup_metrics(text: str):
    def setup(root):
        (root / "data" / "eval" / "metrics.json").write_text(text)
    return setup


def setup_truncated_sft_weights(root):
    path = root / "data" / "models" / "sft" / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def setup_empty_prompt_rows(root):
    path = root / "data" / "tokenized" / "train.parquet"
    table = pq.read_table(path)
    ids = table.column("input_ids").to_pylist()
    ids[0] = ids[3] = []
    pq.write_table(table.set_column(1, "input_ids", pa.array(ids, type=table.schema.field("input_ids").type)), path)


# Inputs that acted silently or ended in a library's traceback (issue #35): each now one line, nothing written.
RESTORE = "rerun the stage that writes it (`dvc repro -f {0}`), or `dvc checkout {0}` for the last good one"
CASES += [
    ("prompts-over-the-limit-refused", "tokenize", "tokenize", {"tokenize.truncation": "refuse"},
     setup_long_prompts, "data/raw/prompts_train.parquet (data.prompts.source's train prompts): 4 of 4 queries have "
                         "more than tokenize.max_query_tokens=8 tokens (the longest "),
    ("ppo-reward-model-label", "prepare", None, {"ppo.reward_model": "/no/such"},
     None, "params.yaml: ppo.reward_model is '/no/such', but the ppo stage scores with scorer.source (its reward "
           "model is the reward stage's); remove ppo.reward_model or set it to data/models/reward"),
    ("ppo-model-name-label", "ppo", "ppo", {"ppo.model_name": "gpt2"},
     None, "params.yaml: ppo.model_name is 'gpt2', but the ppo stage starts from the sft stage's model"),
    ("ppo-query-dataset-label", "prepare", None, {"ppo.query_dataset": "imdb"},
     None, "params.yaml: ppo.query_dataset is 'imdb', but the ppo stage draws its prompts from the tokenize stage's"),
    ("scorer-name-with-the-reward-model", "ppo", "ppo", {"scorer.name": "rewards.example:keyword_sentiment"},
     None, "params.yaml: scorer.name must be null with scorer.source reward_model (the reward stage's model scores; "
           "a function goes with scorer.source: callable, a classifier with pipeline), got "
           "'rewards.example:keyword_sentiment'"),
    ("columns-renamed-for-synthetic-data", "prepare", None, {"data.prompts.columns": {"qurey": "query"}},
     None, "params.yaml: data.prompts.columns must be {query: query} with data.prompts.source synthetic (it makes its "
           "own columns), got {'qurey': 'query'}"),
    ("eval-metrics-empty", "report", "report", {},
     setup_metrics("{}"), "data/eval/metrics.json: no 'win_rate' in it; " + RESTORE.format("evaluate")),
    ("eval-metrics-cut-short", "report", "report", {},
     setup_metrics('{"win_rate": 0.5, "rew'), "data/eval/metrics.json: not valid JSON ("),
    ("sft-weights-truncated", "ppo", "ppo", {},
     setup_truncated_sft_weights, "data/models/sft: the saved model could not be read ("),
    ("tokenized-prompts-empty-rows", "ppo", "ppo", {},
     setup_empty_prompt_rows, "data/tokenized/train.parquet: 2 rows have no input_ids (the first: row 0); "
                              + RESTORE.format("tokenize")),
    ("reward-calls-sys-exit", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:exits"},
     None, "PPO step 1: scorer (callable scorers:exits) called sys.exit(0) (scorers.py:"),
    ("reward-takes-two-arguments", "ppo", "ppo", {"scorer.source": "callable", "scorer.name": "scorers:two_args"},
     None, "params.yaml: scorer.name 'scorers:two_args': two_args(texts, labels) (scorers.py:32) cannot be called with "
           "one argument, the list of texts; give its other parameters defaults, or wrap it in a def score(texts)"),
    ("kept-column-missing", "prepare", None, {**QA, "data.prompts.keep": ["answr"]},
     setup_qa_prompts, "prompts.jsonl: column 'answr' not found (data.prompts.keep names it); its columns are "
                       "['question', 'answer']"),
    ("kept-column-not-storable", "prepare", None, {**QA, "data.prompts.keep": ["answer"]},
     lambda root: setup_qa_prompts(root, bad_row=7),
     "prompts.jsonl: column 'answer' (data.prompts.keep) cannot be stored: row 7 holds {'not': 'a number'} (dict), "
     "which does not go with the rows before it ("),
    ("kept-column-with-synthetic-prompts", "prepare", None, {"data.prompts.keep": ["answer"]},
     None, "params.yaml: data.prompts.keep must be [] with data.prompts.source synthetic (its prompts have no other "
           "column), got ['answer']"),
    ("kept-column-reserved-name", "prepare", None, {**QA, "data.prompts.keep": ["score"]},
     None, "params.yaml: data.prompts.keep must be names other than the pipeline's own columns"),
    ("row-reward-needs-a-column-not-kept", "ppo", "ppo",
     {"scorer.source": "callable", "scorer.name": "scorers:needs_answer"},
     None, "params.yaml: scorer.name 'scorers:needs_answer': needs_answer (scorers.py:35) takes 'answer', which is not "
           "a column of the prompts: add it to data.prompts.keep (kept now: none), or give it a default"),
    ("combined-without-functions", "prepare", None, {"scorer.source": "combined"},
     None, "params.yaml: scorer.functions must be a mapping of reward names to {name, weight} with scorer.source "
           "combined, and {} otherwise, got {}"),
    ("functions-without-combined", "prepare", None,
     {"scorer.source": "callable", "scorer.name": "scorers:words", "scorer.functions": {"a": {"name": "scorers:nan"}}},
     None, "params.yaml: scorer.functions must be a mapping of reward names to {name, weight} with scorer.source "
           "combined, and {} otherwise, got {'a': {'name': 'scorers:nan'}}"),
    ("combined-function-bad-key", "prepare", None,
     {"scorer.source": "combined", "scorer.functions": {"a": {"name": "scorers:words", "wieght": 2}}},
     None, "params.yaml: scorer.functions.a must be a mapping with keys among ['name', 'weight', 'source', 'label'], "
           "got {'name': 'scorers:words', 'wieght': 2}"),
    ("combined-function-raises", "ppo", "ppo",
     {"scorer.source": "combined", "scorer.functions": {"acc": {"name": "scorers:raises", "weight": 1.0}}},
     None, "PPO step 1: scorer function acc raised ZeroDivisionError: division by zero (scorers.py:"),
    ("judge-named-gold-with-synthetic-data", "prepare", None, {"evaluate.judges": {"gold": "scorers:words"}},
     None, "params.yaml: evaluate.judges.gold must be a name other than 'gold' with the synthetic data (its gold "
           "score, the lexicon's, is 'gold' already; a judge takes that name with data of your own), got 'gold'"),
]


def setup_not_chats(root):
    (root / "chats.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in (
        [{"role": "user", "content": "a film"}], "a film", [{"role": "user", "content": "a play"}])))


# Chat prompts (issue 47): a template asked of a tokenizer that has none, and chats that are not chats.
CASES += [
    ("chat-template-missing", "tokenize", "tokenize", {"chat.template": True},
     None, "data/models/sft: its tokenizer has no chat template, but chat.template is true; give a model whose "
           "tokenizer has one (model.name_or_path), or set chat.template: false with plain text rows"),
    ("chat-template-missing-before-sft-trains", "sft", "sft", {"chat.template": True},
     None, "model.name_or_path null: its tokenizer has no chat template, but chat.template is true"),
    ("messages-not-chats", "prepare", None,
     {"data.prompts.source": "chats.jsonl", "data.prompts.columns": {"messages": "turns"}},
     setup_not_chats, "chats.jsonl: column 'turns' row 2 is not a chat (a list of {role, content} objects), got "
                      "'a film'; clean the file"),
    ("kept-messages-with-chat-prompts", "prepare", None,
     {"data.prompts.source": "chats.jsonl", "data.prompts.columns": {"messages": "turns"},
      "data.prompts.keep": ["messages"]},
     None, "params.yaml: data.prompts.keep must be names other than 'messages' with chat prompts (their chats travel "
           "under that name), got ['messages']"),
]


if not torch.cuda.is_available():  # fp16 autocast is a GPU's: on a CPU the run would be float32's, byte for byte
    CASES.append(("fp16-on-a-cpu", "sft", "sft", {"model.mixed_precision": "fp16"},
                  None, "params.yaml: model.mixed_precision is fp16, which needs a CUDA GPU and none is visible: on a "
                        "CPU the run would compute in float32 (the same as null); set auto, bf16 or null"))
if importlib.util.find_spec("wandb") is None:  # accelerate would only warn, and log nothing
    CASES.append(("tracker-not-installed", "prepare", None, {"ppo.log_with": "wandb"},
                  None, "params.yaml: ppo.log_with is 'wandb', but wandb is not installed (pip install wandb), so "
                        "nothing would be logged; install it or set log_with to None"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, tiny_run, tmp_path, monkeypatch, request):
    _, stage, upstream, changes, setup, fragment = case
    root = project(tiny_run, tmp_path, upstream)
    params = write_params(root, changes)
    cleanup = setup(root) if setup else None
    if cleanup:
        request.addfinalizer(cleanup)
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    for module in ("scorers", "broken"):  # this project's files, with fresh state
        monkeypatch.delitem(sys.modules, module, raising=False)
    before = files(root)
    result = CliRunner().invoke(app, [stage, "--params", "params.yaml"])
    assert result.exit_code == 2, result.output + str(result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {stage}: "), result.stderr
    assert fragment in lines[0]
    assert result.stdout == "" and "Traceback" not in result.stderr
    after = files(root)
    new = {path for path in after if path not in before and not path.startswith("data/checkpoints/")}
    assert not new and all(after[path] == digest for path, digest in before.items()), new
    assert params.exists()


def test_debug_keeps_the_traceback_of_the_user_s_reward_function(tiny_run, tmp_path, monkeypatch):
    """`--debug`: the scorer's own exception, with its traceback into the user's file, not one line."""
    import traceback

    root = project(tiny_run, tmp_path, "ppo")
    write_params(root, {"scorer.source": "callable", "scorer.name": "scorers:raises"})
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "scorers", raising=False)
    result = CliRunner().invoke(app, ["ppo", "--params", "params.yaml", "--debug"])
    assert result.exit_code != 0 and "error: ppo:" not in result.stderr
    cause = result.exception.__cause__
    assert isinstance(cause, ZeroDivisionError)
    assert traceback.extract_tb(cause.__traceback__)[-1][:2] == (str(root / "scorers.py"), 16)


def test_missing_params_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["prepare", "--params", "nope.yaml"])
    assert result.exit_code == 2
    assert result.stderr == "error: prepare: nope.yaml: params file not found; pass --params PATH or run from the " \
                            "project root\n"
    assert not list(tmp_path.iterdir())


def test_tokenizer_without_pad_token_is_handled_and_said(tiny_run, tmp_path, monkeypatch):
    """A pretrained model whose tokenizer has no pad token: sft adds one, resizes, says so, and trains."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = project(tiny_run, tmp_path, "sft")
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / "data" / "models" / "sft")
    model = AutoModelForCausalLM.from_pretrained(tiny_run / "data" / "models" / "sft")
    tokenizer.pad_token = None
    tokenizer.save_pretrained(root / "base")
    model.save_pretrained(root / "base")
    write_params(root, {"model.name_or_path": "base"})
    monkeypatch.chdir(root)
    result = CliRunner().invoke(app, ["sft", "--params", "params.yaml"])
    assert result.exit_code == 0, result.stderr
    assert "note: sft: the tokenizer of base has no pad token; added '<pad>'" in result.stderr
    saved = AutoTokenizer.from_pretrained(root / "data" / "models" / "sft")
    assert saved.pad_token == "<pad>" and saved.pad_token_id != saved.eos_token_id


def test_reward_model_with_its_own_tokenizer_scores_the_decoded_text(tiny_run, tiny_params, tmp_path):
    """The RM's tokenizer differs from the policy's (another vocabulary): the ppo stage scores the decoded
    text re-encoded with the RM's tokenizer, so the scores are what the RM gives those texts on its own."""
    import dataclasses

    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from stages import ppo
    from stages.sft import train_tokenizer
    from stages.shared import scoring
    from stages.shared.artifacts import REWARD_MODEL

    root = project(tiny_run, tmp_path, "ppo")
    texts = pd.read_parquet(root / "data" / "raw" / "sft.parquet")["text"].tolist()
    rm_tokenizer = train_tokenizer(texts, 280, 64)
    policy_vocab = json.loads((root / "data" / "models" / "sft" / "tokenizer.json").read_text())["model"]["vocab"]
    assert rm_tokenizer.get_vocab() != policy_vocab
    torch.manual_seed(0)
    rm = GPT2ForSequenceClassification(GPT2Config(vocab_size=len(rm_tokenizer), n_positions=64, n_embd=16, n_layer=1,
                                                  n_head=2, num_labels=1, pad_token_id=rm_tokenizer.pad_token_id))
    shutil.rmtree(root / REWARD_MODEL)
    rm.save_pretrained(root / REWARD_MODEL)
    rm_tokenizer.save_pretrained(root / REWARD_MODEL)

    sample = ["the movie was good.", "the plot was slow and the cast was bad"]
    with torch.no_grad():
        expected = [float(rm.eval()(**rm_tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in sample]
    assert scoring.build_scorer(tiny_params, root)(sample) == pytest.approx(expected, abs=1e-5)
    assert "steps" in ppo.run(dataclasses.replace(tiny_params), root)


def test_sizes_beyond_the_data_are_said_in_one_line(tiny_run, tmp_path, monkeypatch):
    """More rows or prompts asked for than there are: the stage uses what there is, and says so in one line."""
    root = project(tiny_run, tmp_path, None)
    (root / "texts.jsonl").write_text("\n".join(json.dumps({"text": f"review {i}"}) for i in range(5)) + "\n")
    write_params(root, {"data.sft.source": "texts.jsonl", "data.sft.n": 4000})
    monkeypatch.chdir(root)
    result = CliRunner().invoke(app, ["prepare", "--params", "params.yaml"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == "note: prepare: data.sft.n is 4000, but texts.jsonl has 5 rows: using all 5\n"
    assert len(pd.read_parquet(root / "data" / "raw" / "sft.parquet")) == 5

    shutil.rmtree(root / "data")
    shutil.copytree(tiny_run / "data", root / "data", ignore=shutil.ignore_patterns("eval"))
    write_params(root, {"evaluate.n_prompts": 5000})
    result = CliRunner().invoke(app, ["evaluate", "--params", "params.yaml"])
    assert result.exit_code == 0, result.stderr
    assert "note: evaluate: evaluate.n_prompts is 5000, but data/tokenized/eval.parquet holds 8 held-out prompts: " \
           "evaluating all 8\n" in result.stderr
    assert len(pd.read_parquet(root / "data" / "eval" / "samples.parquet")) == 2 * 8
