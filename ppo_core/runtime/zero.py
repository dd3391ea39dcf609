"""DeepSpeed ZeRO under accelerate: what ``PPOTrainer`` needs beyond ``accelerator.prepare``.

ZeRO-2 shards the optimizer state and the gradients; every process keeps the whole weights, so forward
passes, generation and reading the LM head work as without DeepSpeed. ZeRO-3 also shards the weights: a
parameter holds its full value only during the forward (and backward) of a module that owns it, or that has
it registered as an *external* parameter. Hence, under ZeRO-3:

* the value-head model computes its log-probabilities inside its ``forward`` (``score_positions``, see
  ``modeling``), and the LM-head weights read there are registered as its external parameters
  (:func:`register_lm_head`), so they are gathered for that forward and its backward;
* a no-grad read outside any forward (whole-vocabulary KL, legacy logits) gathers them explicitly
  (:func:`gathered`);
* generation gathers the whole model once per call and switches the ZeRO-3 hooks off meanwhile, instead of
  gathering every layer again at every new token (:func:`gathered_for_generation`, as TRL's
  ``unwrap_model_for_generation``); the weights must fit whole on a device for that long;
* the frozen reference model is sharded too, as a DeepSpeed engine without optimizer
  (:func:`prepare_reference`): whole, it would cost every process a full copy of the weights, which is what
  ZeRO-3 is used to avoid. It is copied from the policy before the policy is sharded (:func:`check_reference_copy`).

Under DeepSpeed the engine, not the trainer, accumulates gradients, clips them and steps the optimizer (inside
``accelerator.backward``); :func:`fill_config` (through :func:`configure_engine`, before ``accelerator.prepare``)
takes those settings from ``PPOConfig`` so that there is one source for them. deepspeed is imported only where one
of these runs under DeepSpeed. Launching and connecting the processes is ``ppo_core.runtime.distributed``'s.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator

import torch


def is_zero3(accelerator) -> bool:
    """Whether ``accelerator`` runs DeepSpeed ZeRO stage 3 (weights sharded)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def is_sharded(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a ZeRO-3 parameter (DeepSpeed tags each with a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in params)


def check_reference_copy(model: torch.nn.Module, num_shared_layers: int | None) -> None:
    """Under ZeRO-3 the reference must be a separate, whole copy of ``model`` before it is sharded in its own
    engine: raise if ``model`` is sharded already, or if layers are to be shared."""
    if is_sharded(model.parameters()):
        raise ValueError("PPOTrainer: the policy's weights are already ZeRO-3 shards (built under deepspeed.zero.Init: "
                         "transformers does so for every model built once an Accelerator runs ZeRO-3 in the process), "
                         "so no reference copy can be made from it; build the policy before the first PPOTrainer, or "
                         "pass a ref_model built the same way as the policy.")
    if num_shared_layers is not None:
        raise ValueError("PPOTrainer: num_shared_layers is not supported under ZeRO-3 (policy and reference are "
                         "sharded in separate DeepSpeed engines, which cannot share weights); drop it.")


def fill_config(ds_config: dict, mini_batch_size: int, gradient_accumulation_steps: int,
                max_grad_norm: float | None, num_processes: int) -> None:
    """Fill the ``"auto"`` (or absent) entries of a DeepSpeed config dict from ``PPOConfig``, in place.

    DeepSpeed accumulates ``gradient_accumulation_steps`` mini-batches and clips at ``gradient_clipping``
    (0: no clipping) itself, so they must be the trainer's; a different number set in the DeepSpeed config
    raises. The batch sizes only feed DeepSpeed's bookkeeping (it never sees the data): one micro-batch is a
    mini-batch.
    """
    wanted = {"gradient_accumulation_steps": gradient_accumulation_steps,
              "gradient_clipping": float(max_grad_norm or 0.0)}
    ppo_names = {"gradient_accumulation_steps": "ppo.gradient_accumulation_steps",
                 "gradient_clipping": "ppo.max_grad_norm (null: 0, no clipping)"}
    for key, value in wanted.items():
        given = ds_config.get(key, "auto")
        if given == "auto":
            ds_config[key] = value
        elif float(given) != value:
            raise ValueError(f"PPOTrainer: the DeepSpeed config sets {key}={given}, but PPOConfig gives {value} "
                             f"({ppo_names[key]}); DeepSpeed applies it, so drop it from the DeepSpeed config (the "
                             "trainer fills it) or make the two equal.")
    if ds_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds_config["train_micro_batch_size_per_gpu"] = mini_batch_size
    if ds_config.get("train_batch_size", "auto") == "auto":
        ds_config["train_batch_size"] = (ds_config["train_micro_batch_size_per_gpu"] * gradient_accumulation_steps
                                         * num_processes)


def configure_engine(accelerator, model: torch.nn.Module, mini_batch_size: int, gradient_accumulation_steps: int,
                     max_grad_norm: float | None) -> None:
    """Before ``accelerator.prepare`` under DeepSpeed: its config filled from ``PPOConfig`` (:func:`fill_config`), and
    under ZeRO-3 the LM head of the value-head ``model`` registered (:func:`register_lm_head`: the scoring forward
    reads it outside the head module's own forward). A no-op without DeepSpeed."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    fill_config(plugin.deepspeed_config, mini_batch_size, gradient_accumulation_steps, max_grad_norm,
                accelerator.num_processes)
    if plugin.zero_stage == 3:
        register_lm_head(model)


def register_lm_head(model: torch.nn.Module) -> None:
    """Register the LM-head parameters of a value-head ``model`` as external parameters of ``model``, so that
    ZeRO-3 gathers them for its whole forward and backward (the scoring path reads them outside the head
    module's own forward); another model (a reward model placed by ``PPOTrainer._prepare_deepspeed``) has none. Call
    it before the model becomes a ZeRO-3 engine."""
    import deepspeed

    for param in model.lm_head_parameters() if hasattr(model, "lm_head_parameters") else ():  # else: not a policy
        deepspeed.zero.register_external_parameter(model, param)


def gathered(params: Iterable[torch.nn.Parameter]):
    """A context in which the ZeRO-3 ``params`` hold their full values (read-only); a no-op for plain ones.

    A collective: every process must enter it with the same parameters.
    """
    params = list({id(p): p for p in params}.values())  # a PEFT policy is its own reference: same head twice
    if not is_sharded(params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


@contextlib.contextmanager
def gathered_for_generation(model) -> Iterator[None]:
    """Within the block, every weight of the ZeRO-3 engine ``model`` is whole on every process and its ZeRO-3
    hooks are off, so that ``generate`` runs as on an unsharded model; a no-op for anything else.

    One gather per block instead of one per layer and token; the hooks are restored (and the gathered copies
    freed) on the way out, exceptions included.
    """
    offload = _parameter_offload(model)
    if offload is None:
        yield
        return
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
        # The hooks would release the gathered weights after each module's forward, and gather them again at
        # the next token. A parameter still marked in use by a module would not be released on the way out.
        for param in iter_params(offload.module, recurse=True):
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)


def _parameter_offload(model):
    """The object holding a ZeRO-3 engine's module hooks (its ``DeepSpeedZeRoOffload``), or None."""
    is_zero3_engine = getattr(model, "zero_optimization_partition_weights", None)
    if is_zero3_engine is None or not is_zero3_engine():
        return None
    optimizer = model.optimizer
    return getattr(optimizer, "parameter_offload", optimizer)  # a training engine's, or an inference engine's


def prepare_reference(model: torch.nn.Module, ds_config: dict):
    """The frozen reference ``model`` as a ZeRO-3 engine without optimizer, sharded as the policy is.

    ``ds_config`` is the policy's (filled) DeepSpeed config; its optimizer and scheduler sections are dropped.
    Returns the engine in eval mode: call it like the model.
    """
    import deepspeed

    config = copy.deepcopy(ds_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    register_lm_head(model)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # DeepSpeedEngine.eval returns None, not the engine
    return engine
