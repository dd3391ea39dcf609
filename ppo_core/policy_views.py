"""The trainer's views of its models: ``generate`` (sampling from the policy, its rollout copy or the reference), the
reference policy and the whole policy for a block, and the precision of the scoring passes.

:class:`PolicyViews` is mixed into :class:`~ppo_core.trainer.PPOTrainer`, whose loop (``step``) reads the same views;
the attributes the methods read are declared on it (set by ``PPOTrainer.__init__``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from .config import PPOConfig
from .models.cpu_attention import scoring_precision
from .models.generation import check_group_sampling, generate_batched, warn_if_temperature_differs
from .models.reference import reference_policy
from .models.rollout_copy import RolloutCopy, static_cache_by_default
from .runtime.distributed import deprecated_collectives_ignored, quiet_deepspeed_collectives
from .runtime.precision import with_tf32
from .runtime.zero import gathered, gathered_for_generation

if TYPE_CHECKING:
    from accelerate import Accelerator


class PolicyViews:
    """``PPOTrainer``'s sampling and its views of the policy and the reference (see the module docstring)."""

    # what the methods read, set by ``PPOTrainer.__init__``
    config: PPOConfig
    accelerator: Accelerator
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    tokenizer: PreTrainedTokenizerBase
    current_device: torch.device
    is_deepspeed: bool
    step_count: int
    _rollout: RolloutCopy | None
    _generated_max_new_tokens: int | None
    _warned_temperature = False  # generate() at another temperature than the config's, said once

    def generate(self, query_tensor, length_sampler: Callable[[], int] | None = None, batch_size: int = 4,
                 return_prompt: bool = True, generate_ref_response: bool = False, **generation_kwargs):
        """Sample responses: a 1-D query tensor gives a ``(1, L)`` tensor; a list gives a list of 1-D tensors.

        Lists are generated ``batch_size`` at a time, left-padded, with the KV cache; padding is
        stripped and each response is cut after its first EOS (the EOS kept). An encoder-decoder gets
        right-padded queries and returns the response alone (whatever ``return_prompt``), without the
        decoder start token. ``generate_ref_response`` also samples from the reference (for a PEFT
        policy without ``ref_model``: the adapter-disabled model) and returns both.
        """
        generation_config = self.accelerator.unwrap_model(self.model).pretrained_model.generation_config
        check_group_sampling(self.config, generation_kwargs, generation_config)
        if not self._warned_temperature:
            self._warned_temperature = warn_if_temperature_differs(self.config, generation_kwargs, generation_config)
        if length_sampler is None:  # a length limit the same for every step (one drawn per batch is not)
            self._generated_max_new_tokens = generation_kwargs.get("max_new_tokens",
                                                                   generation_config.max_new_tokens)

        def sample(lm, precision, copy: bool = False):  # the static cache by default for weights in their own
            own_dtype = copy or self.config.weights_dtype is not None  # dtype (a copy, bf16 weights) on a GPU alone
            kwargs = static_cache_by_default(generation_kwargs, own_dtype and self.accelerator.device.type == "cuda")
            return self._sample(lm, precision, query_tensors=query_tensor, length_sampler=length_sampler,
                                batch_size=batch_size, return_prompt=return_prompt, **kwargs)

        if self._rollout is None:
            outputs = sample(*self._sampling(self.model))
        else:  # the copy: whole on this process, its weights already in the dtype it samples in
            outputs = sample(self._rollout_lm(), contextlib.nullcontext(), copy=True)
        if not generate_ref_response:
            return outputs
        with self.reference_policy() as ref_model:  # float32 under autocast: the static cache would take its dtype
            return outputs, sample(*self._sampling(ref_model))

    def _sampling(self, model) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
        """The ``transformers`` LM of ``model`` (the policy or the reference, value-head models) and the context it
        samples in: the run's autocast, and under ZeRO-3 its weights gathered once for the whole call, not per layer
        and token."""
        model.eval()  # sample from the distribution step() scores (no dropout), even after a train pass
        precision = contextlib.ExitStack()
        precision.enter_context(gathered_for_generation(model))
        precision.enter_context(self.accelerator.autocast())
        return self.accelerator.unwrap_model(model).pretrained_model, precision

    def _rollout_lm(self) -> torch.nn.Module:
        """The policy's rollout copy (``config.rollout_dtype``), its weights the policy's as they are now."""
        return self._rollout.current(self.accelerator.unwrap_model(self.model).pretrained_model, self.step_count)

    @quiet_deepspeed_collectives
    @with_tf32
    def _sample(self, lm: torch.nn.Module, precision: contextlib.AbstractContextManager, query_tensors,
                length_sampler: Callable[[], int] | None = None, batch_size: int = 4, return_prompt: bool = True,
                **generation_kwargs):
        """``generate`` for ``lm`` in the context ``precision`` (``_sampling``'s): ``batch_size`` queries at a time,
        each response cut after its first EOS, a group's prompt prefilled once (``num_generations`` > 1). ``lm`` is in
        eval mode already (``_sampling`` sets it; the rollout copy is made in it)."""
        with precision:
            return generate_batched(lm, self.tokenizer, query_tensors, self.current_device, length_sampler,
                                    batch_size, return_prompt, generation_kwargs, self.config.is_encoder_decoder,
                                    share_prompts=self.config.num_generations > 1)

    @contextlib.contextmanager
    def whole_policy(self):
        """The policy (unwrapped: the value-head model) with every weight whole on this process, for the block, e.g.
        to save it; read-only. Under ZeRO-3 the shards are gathered from every process: every process must enter
        the block, even where only one of them saves."""
        model = self.accelerator.unwrap_model(self.model)
        with deprecated_collectives_ignored(self.is_deepspeed), gathered(model.parameters()):
            yield model

    def _forward_precision(self) -> contextlib.AbstractContextManager:
        """The scoring passes' precision (``models.cpu_attention.scoring_precision``): the rollout and loss passes
        both run in it, so that the first ratio of a step stays exactly 1."""
        return scoring_precision(self.accelerator.autocast(), self.current_device)

    def reference_policy(self):
        """The reference policy, for a block: ``with trainer.reference_policy() as ref: ...``. The frozen copy
        (``ref_model``), or for a PEFT policy without one the policy itself with its adapters disabled inside the
        block (see ``models.reference``); e.g. to score held-out samples against the reference between steps."""
        return reference_policy(self.model, self.ref_model, self.accelerator.unwrap_model)
