"""The statistics of a PPO step (TRL's legacy names), over the global batch when PPO runs in N processes.

Pure functions of tensors and a process group (``ppo_core.runtime.distributed``: a
:class:`~ppo_core.runtime.distributed.ProcessGroup`, or :class:`~ppo_core.runtime.distributed.SingleProcess` alone,
where every gather returns its input).
Sample and token statistics and histograms are computed over every process's samples (process 0's first); the
training statistics of the mini-batches are per-process shares (see ``PPOTrainer.loss``) that
:func:`mean_over_processes` averages into the global values.

Notation: ``B`` samples per process, ``R`` the longest response, ``N`` processes, ``n_p`` valid tokens on
process ``p``; ``mask`` ``(B, R)``, 1 = response token that counts.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..algo.estimators import zero_std_groups
from ..algo.functional import masked_mean, masked_variances, stats_to_np
from ..algo.kl_control import KLPlacement
from ..algo.ppo_math import PolicyLoss, ValueLoss, token_mean
from ..runtime.distributed import gather_ragged, mean_across


def _common_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The floating dtype every one of ``tensors`` converts to exactly (float32 at least): one collective for all."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)


def gather_samples(group, *per_sample: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(B,)`` tensors of this process -> ``(N * B,)`` float32 of the global batch, in one collective; alone, the
    tensors as given (stacked and split again they would be strided views, and a mean over a strided view may
    round differently: the one-process numbers must not move)."""
    if group.num_processes == 1:
        return per_sample
    stacked = torch.stack([x.to(group.device).float() for x in per_sample], dim=-1)  # (B, k)
    return group.gather(stacked).unbind(-1)


def gather_tokens(group, *per_token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(n_p,)`` tensors (this process's valid tokens) -> ``(n,)`` of the global batch, each in its own dtype."""
    dtype = _common_dtype(per_token)
    gathered = gather_ragged(torch.stack([x.to(dtype) for x in per_token]), group).unbind(0)  # k x (n,)
    return tuple(g.to(x.dtype) for g, x in zip(gathered, per_token))


def minibatch_stats(pg: PolicyLoss, vf: ValueLoss | None, vf_coef: float, mask: torch.Tensor,
                    advantages: torch.Tensor, returns: torch.Tensor, vpreds: torch.Tensor, values: torch.Tensor,
                    entropy: torch.Tensor | None, n_tokens: torch.Tensor | None, group,
                    kl: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The legacy stats of one mini-batch's loss (0-d, names without ``ppo/``); call it without gradients.

    Args:
        pg, vf: the mini-batch's policy and value losses; ``vf_coef`` weighs the value loss in ``loss/total``.
            ``vf`` is None for the critic-free estimators: no value loss, and no ``val/*`` nor ``returns/*`` stats
            (the value head is neither used nor trained).
        mask: ``(b, R)`` 1 = response token that counts.
        advantages, returns, vpreds, values, entropy: ``(b, R)``; ``entropy`` may be None (no ``policy/entropy``).
        n_tokens: the token count the losses' means divide by (``distributed.tokens_per_process``): the token
            means are this process's shares of the global mini-batch's (see ``PPOTrainer.loss``).
        group: the run's processes; the variances are over the global mini-batch.
        kl: the KL loss term (before its coefficient) when the KL is in the loss: ``policy/kl_loss``.
    """
    mean = lambda x: token_mean(x, mask, n_tokens)  # noqa: E731
    stats = {
        "loss/policy": pg.loss.detach(), "loss/total": pg.loss.detach(),
        "policy/approxkl": pg.approxkl, "policy/policykl": pg.policykl, "policy/clipfrac": pg.clipfrac,
        "policy/advantages_mean": mean(advantages), "policy/ratio_mean": pg.ratio_mean,
    }
    if kl is not None:
        stats["policy/kl_loss"] = kl.detach()
    if vf is not None:
        # both variances in two collectives, without a host sync: fewer than 2 valid tokens give NaN, which the
        # trainer's one finiteness check of the stats reports (see ``non_finite_stat``)
        returns_var, values_var = masked_variances([returns, values], mask, sum_across=group.sum_across).unbind()
        stats |= {
            "loss/value": vf.loss.detach(), "loss/total": (pg.loss + vf_coef * vf.loss).detach(),
            "returns/mean": mean(returns), "returns/var": returns_var,
            "val/vpred": mean(vpreds), "val/error": mean((vpreds - returns) ** 2),
            "val/clipfrac": vf.clipfrac, "val/mean": mean(values), "val/var": values_var,
        }
    if entropy is not None:  # absent only when a caller passes neither logits nor entropy
        stats["policy/entropy"] = mean(entropy)
    return stats


def non_finite_count(stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """0-d float: how many of a mini-batch's ``stats`` hold a non-finite element, on their device, for the caller's one
    host read per mini-batch (a check per stat would be one host sync each on a GPU)."""
    flags = [~torch.isfinite(value).all() for value in stats.values()]
    return torch.stack(flags).sum().float()


def non_finite_stat(stats: dict[str, torch.Tensor]) -> str | None:
    """``"ppo/NAME (VALUE)"`` for the first of a mini-batch's ``stats`` with a non-finite element, or None (one host
    sync per stat: for the error message, once :func:`non_finite_count` has found one). A variance says when it
    had fewer than 2 valid tokens (``masked_var``'s case)."""
    for key, value in stats.items():
        if not bool(torch.isfinite(value).all()):
            hint = ("; fewer than 2 valid tokens in the mini-batch? increase mini_batch_size or make sure responses "
                    "are non-empty" if key.endswith("/var") else "")
            return f"ppo/{key} ({value.item() if value.numel() == 1 else value}{hint})"
    return None


# The stats measured against the reference policy: not measured (NaN) in a step that skips its pass (coefficient 0)
REFERENCE_STATS = ("objective/kl", "objective/kl_dist", "objective/ref_logprobs")


def step_stats(kl_coef: float, scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
               non_score_reward: torch.Tensor, kls: torch.Tensor, masks: torch.Tensor, query_lens: torch.Tensor,
               response_lens: torch.Tensor, advantages: torch.Tensor, train_stats: list[dict[str, torch.Tensor]],
               mini_batch_size: int, group, accumulation_steps: int = 1) -> dict[str, torch.Tensor]:
    """The legacy stats dict of one step; every token statistic is masked.

    Args:
        kl_coef: the KL coefficient the step's rewards were shaped with.
        scores: ``(B,)`` the scores after scaling and clipping.
        logprobs, ref_logprobs, non_score_reward, kls, advantages: ``(B, R)``, response-aligned.
        masks: ``(B, R)`` 1 = response token that counts.
        query_lens, response_lens: ``(B,)`` float token counts.
        train_stats: the stats of each mini-batch of the step, in order (see ``PPOTrainer.loss``), each with
            ``policy/skipped`` (1.0 for a mini-batch the ratio threshold skipped) and, under fp16 loss scaling,
            ``policy/overflowed`` (1.0 where the loss scaler skipped the optimizer update).
        mini_batch_size: samples per mini-batch, for the number of epochs run.
        group: the run's processes (``ppo_core.runtime.distributed``).
        accumulation_steps: mini-batches per accumulation window (the windows whose means the stats average).
    """
    batch_size, valid = len(scores), masks.bool().nonzero(as_tuple=True)  # the tokens that count: one device read
    kl_per_sample, entropy, scores, query_lens, response_lens = gather_samples(
        group, (kls * masks).sum(-1), (-logprobs * masks).sum(-1), scores, query_lens, response_lens)
    token_logprobs, token_ref_logprobs, token_advantages = gather_tokens(
        group, logprobs[valid], ref_logprobs[valid], advantages[valid])
    stats = {
        "objective/kl": kl_per_sample.mean(), "objective/kl_dist": kl_per_sample,
        "objective/logprobs": token_logprobs, "objective/ref_logprobs": token_ref_logprobs,
        "objective/kl_coef": torch.tensor(kl_coef), "objective/entropy": entropy.mean(),
        "ppo/mean_non_score_reward": masked_mean(non_score_reward, masks, sum_across=group.sum_across),
        "ppo/mean_scores": scores.mean(), "ppo/std_scores": scores.std(),
        "tokens/queries_len_mean": query_lens.mean(), "tokens/queries_len_std": query_lens.std(),
        "tokens/queries_dist": query_lens,
        "tokens/responses_len_mean": response_lens.mean(), "tokens/responses_len_std": response_lens.std(),
        "tokens/responses_dist": response_lens,
        "ppo/policy/advantages": token_advantages,
    }
    return stats | training_stats(train_stats, batch_size, mini_batch_size, group, accumulation_steps)


# the mini-batch stats that are the global mini-batch's own (not shares of its window's means): NaN over no token
GLOBAL_PER_MINIBATCH = ("returns/var", "val/var")


def training_stats(train_stats: list[dict[str, torch.Tensor]], batch_size: int, mini_batch_size: int,
                   group, accumulation_steps: int = 1) -> dict[str, torch.Tensor]:
    """The mini-batches' stats averaged over the step (``ppo/`` names), the per-mini-batch ratios over the processes,
    the skipped and empty mini-batches (and overflowed updates), and the epochs run; ``batch_size`` samples per
    process, ``accumulation_steps`` mini-batches per window.

    A mean is over what trained: a window with no token anywhere (``policy/empty`` in each of its mini-batches) is
    left out (its shares are sums over no token, 0), and so is an empty mini-batch's variance (over no token, NaN).
    Where every window is empty, the shares' mean is 0 (nothing trained) and the variances' NaN (not measured)."""
    counted = {"policy/skipped": "ppo/policy/skipped_minibatches", "policy/empty": "ppo/policy/empty_minibatches",
               "policy/overflowed": "ppo/policy/overflowed_updates"}
    trained = trained_minibatches(train_stats, accumulation_steps)
    stats = {f"ppo/{key}": mean_over(torch.stack([s[key] for s in train_stats]).float(), trained,
                                      all_empty_is_zero=key not in GLOBAL_PER_MINIBATCH)
             for key in train_stats[0] if key not in counted}
    ratios = torch.stack([s["policy/ratio_mean"] for s in train_stats]).float()
    stats["ppo/policy/ratio"] = mean_across(ratios, group)
    for key, name in counted.items():  # empty: no token to train on; overflowed: fp16 runs only (the scaler skipped)
        if key in train_stats[0]:
            stats[name] = torch.stack([s[key] for s in train_stats]).sum()
    stats["ppo/epochs"] = torch.tensor(len(train_stats) / math.ceil(batch_size / mini_batch_size))
    # linear in the per-process val/error share (returns/var is global), so its mean over processes is global
    if "ppo/val/error" in stats:  # with a critic (GAE)
        stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
    return stats


def trained_minibatches(train_stats: list[dict[str, torch.Tensor]],
                        accumulation_steps: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(in a window that trained, trained itself)``, two ``(M,)`` bool masks over a step's ``M`` mini-batch stats
    (from their global ``policy/empty`` flags); None where no mini-batch is empty (or the stats, a user's own
    ``train_minibatch``'s, have no flags): every mean is the plain one, bit for bit."""
    if "policy/empty" not in train_stats[0]:
        return None
    empty = torch.stack([s["policy/empty"] for s in train_stats]).bool()  # (M,)
    if not bool(empty.any()):  # one host read a step
        return None
    windows = ~empty.view(-1, accumulation_steps).all(dim=1)  # (M / GA,) the windows with a token somewhere
    return windows.repeat_interleave(accumulation_steps), ~empty


def mean_over(values: torch.Tensor, trained: tuple[torch.Tensor, torch.Tensor] | None,
              all_empty_is_zero: bool) -> torch.Tensor:
    """The step's mean of one stat's ``(M,)`` per-mini-batch values: over every mini-batch where none is empty, else
    over the windows that trained (a share: ``all_empty_is_zero``) or the mini-batches that did (a variance)."""
    if trained is None:
        return values.mean()
    keep = trained[0] if all_empty_is_zero else trained[1]
    if not bool(keep.any()):
        return torch.zeros((), dtype=values.dtype, device=values.device) if all_empty_is_zero else \
            torch.full((), math.nan, device=values.device)
    return torch.where(keep, values, torch.zeros_like(values)).sum() / keep.sum()


def mean_over_processes(stats: dict[str, Any], group) -> dict[str, Any]:
    """Average the 0-d tensor stats over processes (in one collective); other values are kept as they are.

    The 0-d stats of a step are either already global (identical on every process) or per-process shares
    whose mean over processes is the one-process value over the global batch: sample means over the
    equal per-process batches, and token means divided by the global token count over N (see ``PPOTrainer.loss``).
    Each comes back in its own floating dtype (an integer one as float32).
    """
    keys = [key for key, value in stats.items() if isinstance(value, torch.Tensor) and value.ndim == 0]
    out = dict(stats)
    if keys:
        dtype = _common_dtype(stats[key] for key in keys)
        # (the host's stats go to the device without waiting for it)
        values = torch.stack([stats[key].detach().to(group.device, dtype, non_blocking=True) for key in keys])  # (k,)
        means = mean_across(values, group).unbind()
        out.update({key: mean.to(torch.promote_types(stats[key].dtype, torch.float32))
                    for key, mean in zip(keys, means)})
    return out


def reward_stats(rewards, group) -> dict[str, Any]:
    """``env/reward_mean|std|dist`` of the raw rewards of every process (``log_stats``): a list of scalars or a
    ``(B,)`` tensor per process."""
    if isinstance(rewards, list):
        rewards = torch.stack([torch.as_tensor(r).float().reshape(()) for r in rewards])
    rewards = group.gather(torch.as_tensor(rewards).float().to(group.device)).flatten().cpu()
    return {"env/reward_mean": rewards.mean().item(),
            "env/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "env/reward_dist": rewards.numpy()}


def lengths(sequences: list[torch.Tensor]) -> torch.Tensor:
    """``(B,)`` float: each sequence's length."""
    return torch.tensor([len(s) for s in sequences], dtype=torch.float)


def warn_if_negative_kl(stats: dict[str, Any], warned: bool) -> bool:
    """Warn once (returns whether it has now) when a step's mean KL is below -1: the sampling changed the distribution
    the policy scores."""
    mean_kl = stats["objective/kl"].item()
    if mean_kl < -1.0 and not warned:
        warnings.warn(f"KL divergence is negative ({mean_kl:.2f}): usually generation kwargs that change "
                      "the sampling distribution (top_k, top_p, min_length, temperature...). Sample with "
                      "top_k=0, top_p=1.0, do_sample=True and no min_length/repetition penalty.")
        return True
    return warned


def warn_if_nothing_trained(stats: dict[str, Any], n_minibatches: int, step: int) -> None:
    """Warn where every mini-batch of step ``step`` (1-based) was empty: said where it happens, as nothing trained."""
    if stats["ppo/policy/empty_minibatches"] == n_minibatches:
        warnings.warn(f"PPOTrainer: step {step}: no mini-batch had a token to train on (mask_truncated_completions, "
                      "dynamic_sampling or response_masks left none out of the loss): the weights did not move.")


def step_summary(stats: dict[str, Any], config, group, with_reference: bool, needs_groups: bool, mask: torch.Tensor,
                 trained: torch.Tensor, scores: torch.Tensor, penalties: torch.Tensor | None) -> dict[str, Any]:
    """A step's :func:`step_stats`, averaged over processes and on the host, with what the critic-free family adds:
    the KL loss's coefficient, the reference stats NaN where no reference pass ran (not measured, not 0), the share of
    groups with one score for all, the mean overlong penalty, the share of responses the loss left out. ``mask`` and
    ``trained`` ``(B, R)``: the responses' tokens and those the loss trained on; ``scores`` ``(B,)`` as shaped."""
    stats = stats_to_np(mean_over_processes(stats, group))
    kl = KLPlacement.of(config)
    if kl.in_loss:  # the coefficient in effect there (objective/kl_coef is the rewards': 0)
        stats["objective/kl_loss_coef"] = kl.loss_coef
    if not with_reference:
        stats |= {key: np.full_like(stats[key], np.nan, dtype=float) for key in REFERENCE_STATS}
    if needs_groups:  # groups with one score for all: no learning signal
        flat = group.gather(zero_std_groups(scores, config.num_generations))  # (global prompts,)
        stats["ppo/frac_reward_zero_std"] = float(flat.mean())
    if penalties is not None:
        stats["ppo/overlong_penalty_mean"] = float(group.gather(penalties).mean())
    if trained is not mask:  # the share of the (global) batch's responses the loss left out
        left_out = (trained.sum(dim=1) == 0) & (mask.sum(dim=1) > 0)
        stats["ppo/frac_responses_left_out"] = float(group.gather(left_out.float()).mean())
    return stats
