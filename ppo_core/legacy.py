"""TRL 0.11's ``PPOTrainer`` API beyond the loop, kept thin: the methods its users call that ``step`` does not need,
and the legacy-named entry points to the statistics (``record_step_stats``, ``gather_stats``, ``log_stats``).

:class:`LegacyMethods` is mixed into :class:`~ppo_core.trainer.PPOTrainer` and reads its attributes (``config``,
``accelerator``, ``model``, ``kl_ctl``, ...). Beside it, what the legacy constructor starts from: the checks of its
arguments, the data collator of ``prepare_dataloader`` and the default Adam optimizer.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from .config import PPOConfig
from .distributed import quiet_deepspeed_collectives
from .modeling import AutoModelForCausalLMWithValueHead, PreTrainedModelWrapper
from .ppo_math import kl_penalty, shape_rewards
from .rollout import build_response_masks, checked_step_inputs, policy_outputs
from .stats import mean_over_processes, reward_stats, step_stats
from .zero import gathered


def check_arguments(config, model, ref_model, tokenizer) -> None:
    """Raise a ValueError saying what to pass instead, for a constructor argument ``PPOTrainer`` cannot use."""
    if not isinstance(config, PPOConfig):
        raise ValueError(f"PPOTrainer: config must be a PPOConfig, got {type(config).__name__}.")
    if not isinstance(model, PreTrainedModelWrapper):
        raise ValueError("PPOTrainer: model must be an AutoModelForCausalLMWithValueHead or an "
                         f"AutoModelForSeq2SeqLMWithValueHead (got {type(model).__name__}); wrap it with "
                         "AutoModelForCausalLMWithValueHead.from_pretrained.")
    if ref_model is not None and ref_model is model:
        raise ValueError("PPOTrainer: ref_model is the policy itself; pass ref_model=None for a frozen copy "
                         "(or, for a PEFT policy, the adapter-disabled model).")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ValueError("PPOTrainer: tokenizer must be a transformers PreTrainedTokenizerBase.")


def repeated(collate: Callable, times: int) -> Callable:
    """``collate`` of each row ``times`` times in a row (``num_generations`` samples of every prompt)."""
    if times == 1:
        return collate
    return lambda rows: collate([row for row in rows for _ in range(times)])


def ragged_collator(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``[{k: v}, ...] -> {k: [v, ...]}``: keeps variable-length queries as a list of tensors."""
    return {key: [row[key] for row in rows] for key in rows[0]}


def default_optimizer(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """Adam over the trainable parameters, as legacy TRL, with torch's fused kernel where it has one.

    The fused kernel updates each tensor in one pass, where the default (foreach) Adam makes about ten
    elementwise passes: on a 2-core CPU and 10M parameters that is 3x faster per optimizer step.
    """
    params = [p for p in params if p.requires_grad]
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except RuntimeError:  # a device or dtype without a fused kernel
        return torch.optim.Adam(params, lr=lr)


class LegacyMethods:
    """``PPOTrainer``'s legacy TRL 0.11 methods beyond the loop (see the module docstring)."""

    def prepare_dataloader(self, dataset, data_collator=None) -> DataLoader:
        """Shuffled ``DataLoader`` of ``batch_size`` rows per process (last ragged batch dropped)."""
        if hasattr(dataset, "remove_columns") and self.config.remove_unused_columns:
            dataset = self._remove_unused_columns(dataset)
        generator = torch.Generator().manual_seed(self.config.seed)
        size = self.config.num_generations  # batch_size / G prompts, each G times in a row: step's groups
        return DataLoader(dataset, batch_size=self.config.batch_size // size,
                          collate_fn=repeated(data_collator or ragged_collator, size), shuffle=True, drop_last=True,
                          generator=generator)

    def _remove_unused_columns(self, dataset):
        # Called before the model is prepared: the columns the value-head model's forward takes.
        keep = set(inspect.signature(AutoModelForCausalLMWithValueHead.forward).parameters)
        keep |= {"label", "query", "response", "input_ids", "attention_mask"}
        drop = [c for c in dataset.column_names if c not in keep]
        return dataset.remove_columns(drop) if drop else dataset

    def _step_safety_checker(self, batch_size, queries, responses, scores, masks=None):
        """Validate lengths, types and shapes; return device tensors (scores as one ``(B,)`` tensor)."""
        return checked_step_inputs(batch_size, queries, responses, scores, masks, self.current_device)

    def prepare_model_inputs(self, queries: torch.Tensor, responses: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"input_ids", "attention_mask", "query_lens", "response_lens"}``, right-padded; for an
        encoder-decoder, the queries as ``input_ids`` and ``start + response`` as ``decoder_input_ids``."""
        inputs = self._model_inputs(list(queries), list(responses))
        lengths = inputs.query_lens + inputs.response_lens
        attention_mask = torch.arange(inputs.input_ids.shape[1], device=lengths.device)[None] < lengths[:, None]
        if self.config.is_encoder_decoder:
            return {"input_ids": inputs.encoder_input_ids, "attention_mask": inputs.encoder_attention_mask,
                    "decoder_input_ids": inputs.input_ids, "decoder_attention_mask": attention_mask.long()}
        return {"input_ids": inputs.input_ids, "attention_mask": attention_mask.long(),
                "query_lens": inputs.query_lens, "response_lens": inputs.response_lens}

    @quiet_deepspeed_collectives
    @torch.no_grad()
    def batched_forward_pass(self, model, queries, responses, model_inputs=None, return_logits: bool = False,
                             response_masks=None):
        """``(logprobs, logits or None, values, masks)``, all response-aligned ``(B, R)`` (logits ``(B, R, V)``)."""
        inputs = self._model_inputs(list(queries), list(responses))
        model.eval()
        with self._forward_precision():
            out = policy_outputs(model, inputs, keep_hidden=return_logits)
        logits = None
        if return_logits:
            valid = inputs.response_mask()
            unwrapped = self.accelerator.unwrap_model(model)
            with gathered(unwrapped.lm_head_parameters()):  # under ZeRO-3: read outside any forward
                head = unwrapped.lm_head()
                logits = torch.zeros(*valid.shape, head.weight.shape[0], device=valid.device)
                logits[valid] = head.logits(out.hidden)
        return out.logprobs, logits, out.values, build_response_masks(response_masks, inputs)

    def compute_rewards(self, scores, logprobs, ref_logprobs, masks):
        """``(rewards, non_score_rewards, kls)``, each ``(B, R)`` (``kl_penalty`` ``full`` needs ``step``)."""
        mode = "kl" if self.config.kl_penalty == "full" else self.config.kl_penalty
        return tuple(shape_rewards(scores, kl_penalty(logprobs, ref_logprobs, mode), masks, self.kl_ctl.value))

    def record_step_stats(self, kl_coef: float, **data) -> dict[str, Any]:
        """The legacy stats dict of one step (see :func:`ppo_core.stats.step_stats`), from ``step``'s tensors:
        ``scores``, ``logprobs``, ``ref_logprobs``, ``non_score_reward``, ``kls``, ``masks``, ``advantages``,
        ``queries``, ``responses`` and ``train_stats``."""
        stats = step_stats(
            kl_coef, data["scores"], data["logprobs"], data["ref_logprobs"], data["non_score_reward"], data["kls"],
            data["masks"], torch.tensor([len(q) for q in data["queries"]], dtype=torch.float),
            torch.tensor([len(r) for r in data["responses"]], dtype=torch.float), data["advantages"],
            data["train_stats"], self.config.mini_batch_size, self._group)
        mean_kl = stats["objective/kl"].item()
        if mean_kl < -1.0 and not self._warned_negative_kl:
            self._warned_negative_kl = True
            warnings.warn(f"KL divergence is negative ({mean_kl:.2f}): usually generation kwargs that change "
                          "the sampling distribution (top_k, top_p, min_length, temperature...). Sample with "
                          "top_k=0, top_p=1.0, do_sample=True and no min_length/repetition penalty.")
        return stats

    def gather_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The 0-d tensor stats averaged over processes (:func:`ppo_core.stats.mean_over_processes`)."""
        return mean_over_processes(stats, self._group)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log: Iterable[str] = ("query", "response")):
        """Send ``stats`` plus ``env/reward_mean|std|dist`` (raw rewards, all processes) to the trackers."""
        logs = dict(stats) | reward_stats(rewards, self._group)
        self.current_step += 1
        if self.config.log_with is not None and self.accelerator.is_main_process:
            scalars = {k: v for k, v in logs.items() if isinstance(v, (int, float)) or getattr(v, "size", 2) == 1}
            self.accelerator.log(scalars, step=self.current_step)
        return logs

    def _push_to_hub_if_best(self, scores: torch.Tensor) -> None:
        """``push_to_hub_if_best_kwargs``: every ``compare_steps`` logged steps, push the policy when the mean score
        (``(B,)`` per process, all processes) is the best so far."""
        kwargs = self.config.push_to_hub_if_best_kwargs
        if not kwargs or self.current_step % self.config.compare_steps:
            return
        mean = self._group.gather(scores).mean().item()
        if mean > self._best_score:
            self._best_score = mean
            if self.accelerator.is_main_process:
                self.accelerator.unwrap_model(self.model).push_to_hub(**kwargs)

    def create_model_card(self, path: str, model_name: str | None = "TRL Model") -> None:
        """Write a short model card (``README.md``) into ``path``."""
        os.makedirs(path, exist_ok=True)
        card = (f"---\nlicense: apache-2.0\ntags:\n- ppo_core\n- reinforcement-learning\n- rlhf\n---\n\n"
                f"# {model_name}\n\nA language model fine-tuned with PPO (ppo_core, the legacy TRL PPOTrainer API).\n\n"
                "```python\nfrom ppo_core import AutoModelForCausalLMWithValueHead\n"
                f"model = AutoModelForCausalLMWithValueHead.from_pretrained({path!r})\n```\n")
        with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as fh:
            fh.write(card)
