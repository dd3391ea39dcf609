"""TRL 0.11's ``PPOTrainer`` methods that send a run out: ``log_stats`` to the trackers, ``save_pretrained`` (the
policy, its tokenizer and a model card) and ``push_to_hub`` (legacy's ``PyTorchModelHubMixin``), and what
``push_to_hub_if_best_kwargs`` asks of ``step``.

:class:`LegacyHub` is a base of :class:`~ppo_core.legacy.LegacyMethods` (the legacy surface ``PPOTrainer`` inherits);
the attributes its methods read are declared on it (set by ``PPOTrainer.__init__``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from .config import PPOConfig
from .models.weights import push_saved
from .step.stats import reward_stats

if TYPE_CHECKING:
    from accelerate import Accelerator


def push_to_hub_if_best(trainer: LegacyHub, scores: torch.Tensor) -> None:
    """``push_to_hub_if_best_kwargs``: every ``compare_steps`` logged steps, ``push_to_hub(**kwargs)`` when the mean
    score (``(B,)`` per process, all processes) is the best so far."""
    kwargs = trainer.config.push_to_hub_if_best_kwargs
    if not kwargs or trainer.current_step % trainer.config.compare_steps:
        return
    mean = trainer._group.gather(scores).mean().item()
    if mean > trainer._best_score:
        trainer._best_score = mean
        trainer.push_to_hub(**kwargs)


class LegacyHub:
    """``PPOTrainer``'s legacy logging, saving and hub methods (see the module docstring)."""

    # what the methods read, set by ``PPOTrainer.__init__``
    config: PPOConfig
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    current_step: int
    _group: Any  # ``runtime.distributed.ProcessGroup`` or ``SingleProcess``
    _best_score: float
    whole_policy: Callable[[], contextlib.AbstractContextManager]

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log: Iterable[str] = ("query", "response")):
        """Send ``stats`` plus ``env/reward_mean|std|dist`` (raw rewards, all processes) to the trackers; returns them.

        As legacy: to wandb everything, the arrays as histograms, and a ``game_log`` table of ``columns_to_log`` of
        ``batch`` (every process's rows) beside each reward; with ``tensorboard`` the step is ``current_step``, the
        others count their own. To every other tracker the scalars only (an array is no metric to them: MLflow would
        warn at every step)."""
        logs = dict(stats) | reward_stats(rewards, self._group)
        self.current_step += 1
        tracker = self.config.log_with
        columns = list(columns_to_log)
        if tracker == "wandb" and any(c not in batch for c in columns):
            raise ValueError(f"log_stats: columns_to_log {columns} are not all in the batch (keys: {list(batch)}).")
        rows = (list(zip(*(self._group_rows(batch[c]) for c in columns), logs["env/reward_dist"].tolist()))
                if tracker == "wandb" else None)  # every process gathers; the main one logs
        if tracker is None or not self.accelerator.is_main_process:
            return logs
        if tracker == "wandb":
            import wandb

            sent = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v
                    for k, v in logs.items()}
            if "query" not in batch and "response" not in batch:
                warnings.warn("log_stats: the game logs are not logged: the batch has no 'query' nor 'response'.")
            else:
                sent["game_log"] = wandb.Table(columns=[*columns, "reward"], rows=[list(r) for r in rows])
        else:
            sent = {k: v for k, v in logs.items() if isinstance(v, (int, float)) or getattr(v, "size", 2) == 1}
        self.accelerator.log(sent, step=self.current_step if tracker == "tensorboard" else None)
        return logs

    def _group_rows(self, values) -> list:
        """A batch column, every process's rows in process order (a list here; tensors as they are)."""
        return [row for part in self._group.gather_object(list(values)) for row in part]

    def _save_pretrained(self, save_directory: str) -> None:
        """Legacy: the policy (``save_pretrained``: the model and its value head), the tokenizer and a model card in
        ``save_directory``. Every process calls it (under ZeRO-3 the weights are gathered from all); the main process
        writes."""
        with self.whole_policy() as model:
            if self.accelerator.is_main_process:
                model.save_pretrained(save_directory)
                self.tokenizer.save_pretrained(save_directory)
                self.create_model_card(save_directory)
        self.accelerator.wait_for_everyone()

    def save_pretrained(self, save_directory: str, push_to_hub: bool = False, repo_id: str | None = None,
                        **push_to_hub_kwargs) -> None:
        """Legacy (``PyTorchModelHubMixin``): :meth:`_save_pretrained` into ``save_directory``, then with
        ``push_to_hub=True`` :meth:`push_to_hub` to ``repo_id`` (default: the directory's name)."""
        os.makedirs(save_directory, exist_ok=True)
        self._save_pretrained(save_directory)
        if push_to_hub:
            self.push_to_hub(repo_id or os.path.basename(os.path.abspath(save_directory)), **push_to_hub_kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Legacy (``PyTorchModelHubMixin``): upload what :meth:`_save_pretrained` writes to the hub repository
        ``repo_id`` (``ppo_core.models.weights.push_saved`` says where each kwarg goes). Every process calls it;
        the main process uploads."""
        return push_saved(self._save_pretrained, repo_id, upload=self.accelerator.is_main_process, **kwargs)


    def create_model_card(self, path: str, model_name: str | None = "TRL Model") -> None:
        """Write a short model card (``README.md``) into ``path``."""
        os.makedirs(path, exist_ok=True)
        card = (f"---\nlicense: apache-2.0\ntags:\n- ppo_core\n- reinforcement-learning\n- rlhf\n---\n\n"
                f"# {model_name}\n\nA language model fine-tuned with PPO (ppo_core, the legacy TRL PPOTrainer API).\n\n"
                "```python\nfrom ppo_core import AutoModelForCausalLMWithValueHead\n"
                f"model = AutoModelForCausalLMWithValueHead.from_pretrained({path!r})\n```\n")
        with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as fh:
            fh.write(card)
