"""The ppo stage watching its run (`watch` params): a held-out evaluation every few steps, the policy it keeps by
it, and the run doctor's per-step checks.

The held-out evaluation samples `watch.eval_prompts` held-out prompts with the current policy and measures what
evaluate measures (the scorer's mean, the gold score and the judges where there are, KL to the SFT policy, response
length), through the trainer's own `generate` and `batched_forward_pass`. It draws from a random stream of its own,
seeded the same at every evaluation (the same prompts and draws, so steps compare), and restores the training
run's: the run trains the same bytes with it on or off.

The doctor compares each step's health (`health`) with its limits (`watch.alerts`) and the first step's values; what
it finds is an alert: a `warning:` line at its step, a row of the stage's metrics, a section of the report.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import numpy as np
import torch

from stages.ppo.checkpoints import save_best
from stages.shared.params import AlertParams, WatchParams
from stages.shared.runtime import to_host, warning
from stages.shared.scoring import Combined, Row, component_stats, scored, scorer_texts, trainer_state

EVAL_SEED_OFFSET = 7919  # the held-out evaluation's stream: seed + this, apart from every stream the run draws from


@contextlib.contextmanager
def own_random_stream(seed: int) -> Iterator[None]:
    """Run the block on the random stream ``seed`` (torch's, on the CPU and the visible GPUs), then put the run's
    streams back where they were."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def heldout_row(loop, prompts, judges: dict, step: int) -> dict[str, float]:
    """One held-out evaluation of the current policy at ``step`` (0-based, after its update): the scorer's mean
    (``reward``), each judge's (``gold`` first), the mean KL to the SFT policy over the samples (``kl``, summed over
    their tokens) and their mean length in tokens. Every process computes it alike (the policy is the same on all)."""
    trainer, tokenizer = loop.trainer, loop.tokenizer
    queries = prompts["query"].tolist()
    query_tensors = [torch.tensor(ids) for ids in prompts["input_ids"]]
    with own_random_stream(loop.seed + EVAL_SEED_OFFSET), torch.no_grad():
        responses = trainer.generate(query_tensors, batch_size=len(query_tensors), return_prompt=False,
                                     **loop.generation)
        logprobs, _, _, masks = trainer.batched_forward_pass(trainer.model, query_tensors, responses)
        with trainer.reference_policy() as ref_model:
            ref_logprobs, _, _, _ = trainer.batched_forward_pass(ref_model, query_tensors, responses)
    response_ids = to_host(responses)  # in one copy
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    at = f"the held-out evaluation at step {step + 1}"
    seen = Row(queries, texts, {name: prompts[name].tolist() for name in loop.columns},  # data.prompts.keep's
               [r.tolist() for r in response_ids], trainer_state(step + 1, trainer.config.total_ppo_epochs))
    row = {"step": step}
    for name, judge in judges.items():
        row[name] = float(np.mean(scored(judge, [q + t for q, t in zip(queries, texts)], loop.scorer, at,
                                         f"judge {name}", seen)))
    row["reward"] = float(np.mean(scored(loop.score, scorer_texts(loop.scorer, queries, texts), loop.scorer, at,
                                         row=seen)))
    if isinstance(loop.score, Combined):  # each function's mean, under its name
        row |= {f"reward_{key.split('/')[1]}": value for key, value in component_stats(loop.score.last).items()
                if key.endswith("/mean")}
    row["kl"] = float(((logprobs - ref_logprobs) * masks).sum(-1).mean())
    row["length"] = float(np.mean([len(r) for r in responses]))
    return row


def is_due(step: int, total: int, watch: WatchParams) -> bool:
    """Whether a held-out evaluation follows ``step`` (0-based): every `eval_every` steps, and after the last."""
    return watch.eval_every > 0 and ((step + 1) % watch.eval_every == 0 or step + 1 == total)


def ranking(row: dict[str, float], watch: WatchParams) -> float:
    """What `keep: best` maximises: `best_by` less `kl_price` times the KL to SFT."""
    return row[watch.best_by] - watch.kl_price * row["kl"]


def watch_step(loop, step: int, total: int, stats: dict, rollouts: dict, tables, heldout, judges: dict,
               watch: WatchParams, root, main: bool) -> bool:
    """After a recorded step: the doctor's checks (each alert a `warning:` line and a row of ``tables.alerts``), then
    the held-out evaluation when due (a row of ``tables.evals``; with keep: best, a better policy saved as the run's
    best). Returns whether the run stops here (an alert, with watch.on_alert: stop; the stop is evaluated too)."""
    now = health(tables.curves[-1], stats, rollouts["ends_with_eos"])
    tables.first_health = tables.first_health or now
    found = diagnose(now, tables.first_health, watch.alerts)
    for alert in found:
        if main:
            warning(alert_line(alert))
    tables.alerts += found
    stop = bool(found) and watch.on_alert == "stop"
    started = time.perf_counter()
    if heldout is not None and (is_due(step, total, watch) or stop):
        row = heldout_row(loop, heldout, judges, step)
        tables.evals.append(row)
        if watch.keep == "best" and (tables.best is None or ranking(row, watch) > tables.best["value"]):
            save_best(loop.trainer, root, step, loop.tokenizer)
            tables.best = {"step": step, "value": ranking(row, watch)}
    tables.timings[-1]["time/heldout"] = time.perf_counter() - started  # timings.csv: what watching costs
    if stop:
        tables.stopped = {"step": step, "reason": alert_text(found[0])}
    return stop


# ---- the doctor ------------------------------------------------------------------------------------------------

def health(curves_row: dict[str, float], stats: dict, ends_with_eos: list[bool]) -> dict[str, float]:
    """A step's health, what the doctor checks: its curves.csv row, the mean ratio of its updates and the share of its
    responses cut at the length limit (no EOS)."""
    return curves_row | {"ratio_mean": float(np.mean(np.asarray(stats["ppo/policy/ratio_mean"], dtype=float))),
                         "truncated_share": 1.0 - float(np.mean(ends_with_eos))}


def diagnose(now: dict[str, float], first: dict[str, float], limits: AlertParams) -> list[dict]:
    """The alerts of one step (``now``, from `health`) against its limits and the first step's values (``first``):
    each ``{"step", "check", "value", "limit", "message"}``."""
    found = []

    def alert(check: str, value: float, limit: float, message: str) -> None:
        found.append({"step": int(now["step"]), "check": check, "value": float(value), "limit": float(limit),
                      "message": message})

    def share(key: str) -> float | None:  # now / first, where both are finite and the first positive
        ok = all(math.isfinite(x.get(key, math.nan)) for x in (now, first)) and first[key] > 0
        return now[key] / first[key] if ok else None

    entropy = share("entropy")
    if entropy is not None and entropy < limits.entropy_ratio:
        alert("entropy_ratio", entropy, limits.entropy_ratio, f"the responses' entropy fell to {entropy:.0%} of the "
              f"first step's ({now['entropy']:.3g} from {first['entropy']:.3g}): the policy is collapsing")
    per_token = now["kl"] / now["response_len"] if now.get("response_len") else math.nan
    if per_token > limits.kl_per_token:
        alert("kl_per_token", per_token, limits.kl_per_token, f"the KL to the reference is {per_token:.3g} nats per "
              "response token: the policy has left the reference's neighbourhood")
    above = {"approxkl": ("an update's approximate KL", "the updates are too large (lower ppo.learning_rate)"),
             "ratio_mean": ("the updates' mean probability ratio", "the updates are too large"),
             "clipfrac": ("the share of clipped tokens", "the updates are too large")}
    for key, (what, why) in above.items():
        if now.get(key, math.nan) > getattr(limits, key):
            alert(key, now[key], getattr(limits, key), f"{what} is {now[key]:.3g}: {why}")
    growth = share("loss_value")
    if growth is not None and growth > limits.value_loss_growth:
        alert("value_loss_growth", growth, limits.value_loss_growth, f"the value loss is {growth:.3g}x the first "
              "step's: the critic diverges")
    length = share("response_len")
    if length is not None and length < limits.length_ratio:
        alert("length_ratio", length, limits.length_ratio, f"the responses shrank to {length:.0%} of the first "
              "step's length")
    if now["truncated_share"] > limits.truncated_share:
        alert("truncated_share", now["truncated_share"], limits.truncated_share, f"{now['truncated_share']:.0%} of "
              "the responses run to generation.max_new_tokens without an EOS")
    broken = [key for key, value in now.items() if not math.isfinite(value) and math.isfinite(first.get(key, math.nan))]
    if broken:
        alert("non_finite", math.nan, math.nan, f"non-finite {', '.join(broken)}")
    return found


def alert_text(alert: dict) -> str:
    """What an alert found, and the limit it crossed."""
    limit = f" (watch.alerts.{alert['check']}: {alert['limit']:g})" if math.isfinite(alert["limit"]) else ""
    return f"{alert['message']}{limit}"


def alert_line(alert: dict) -> str:
    """An alert as the terminal shows it (after ``warning: ``), its step counted from 1 as the progress line counts."""
    return f"ppo: step {alert['step'] + 1}: {alert_text(alert)}"
