"""PPO steps on a fixed global batch, run by ``tests/ppo_core/runtime/test_distributed.py`` in N processes or in one.

    accelerate launch --multi_gpu --num_processes 2 tests/distributed_step.py OUT_DIR SCENARIO
    python tests/distributed_step.py OUT_DIR global              # one process, the whole global batch

Process ``p`` of ``N`` takes samples ``[p * 8 / N, (p + 1) * 8 / N)`` of each step's 8; process 0 holds
far more response tokens than process 1, so token means differ from means of per-process means.
Scenarios (each writes ``OUT_DIR/rank{p}.pt``):

* ``global``: for each of ``CONFIGS`` (one mini-batch per epoch, so the mini-batches are the same in
  N processes and in one), the stats of ``STEPS`` steps and the final parameters;
* ``global+shuffled``: that, and under ``"shuffled"`` a run with mini-batches of 2 per process,
  checkpointed after step 1 and resumed in a fresh trainer (one launch for both saves a process start-up);
* ``bad_input``: the last process passes a NaN score (the others valid ones) and ``step`` must raise;
* ``deepspeed`` (under an accelerate DeepSpeed config, ZeRO-2 or ZeRO-3): ``global``, then under ``"rollout"``
  two rounds of ``generate`` (policy and reference) and ``step`` with the whole-vocabulary KL, and what ZeRO-3
  did: whether the LM heads were sharded, and how many module forwards fetched ZeRO-3 parameters while
  generating (none: the weights are gathered once per call) and while stepping; then a step whose second
  mini-batch has an infinite gradient (the error, and the weights before and after); under ZeRO-3 the configs with
  a rollout copy are refused, and their errors recorded instead;
* ``deepspeed+resume`` (under a DeepSpeed config): ``"shuffled"`` as above, the checkpoint DeepSpeed's own (the
  engine saves and loads its module's state dict);
* ``accumulation`` (one process, with or without DeepSpeed): ``ACCUMULATION``'s steps, where DeepSpeed (not the
  trainer) accumulates gradients over mini-batches, some of them skipped by the ratio threshold;
* ``reference_dtype`` (one process, under a DeepSpeed config and bf16): the dtypes of the policy's and the
  reference's weights, and the first step's KL (the policy is its own reference then);
* ``split`` (DDP): the two-process cells of tests/ppo_core/test_one_update.py's matrix, the weight change of one
  step per estimator, aggregation and per-process split;
* ``window_skip`` (DDP): windows of two mini-batches whose second one is always skipped, so that no mini-batch's own
  backward runs outside ``no_sync``: the processes must still all-reduce each window's gradients.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ppo_core import PPOConfig, PPOTrainer
from ppo_core.runtime.zero import gathered
from tests.tiny import PAD, VOCAB, random_queries, tiny_tokenizer, tiny_value_model

GLOBAL_BATCH, STEPS = 8, 3
RESPONSE_LENS = [6, 5, 6, 4, 1, 2, 1, 1]  # 21 tokens in the first half, 5 in the second
# Plain SGD: Adam divides each gradient entry by its own RMS, so where the true gradient is 0 (e.g. GPT-2's key
# biases) it turns float noise into lr-sized steps, and the parameters of two exact computations differ by ~lr.
SGD_LR = 1.0
CONFIGS = {  # per-config options; batch sizes are set per process below
    "whiten": dict(ppo_epochs=2, whiten_rewards=True, use_score_scaling=True, use_score_norm=True),
    "skip": dict(ppo_epochs=3, ratio_threshold=1.0005),
    "early_stop": dict(ppo_epochs=4, early_stopping=True, target_kl=1e-5),
    # critic-free: groups of 2 samples of one prompt (whole groups per process), the KL in the loss; and the
    # group baseline of REINFORCE++, whitened over the global batch
    "grpo": dict(ppo_epochs=2, advantage_estimator="grpo", num_generations=2),
    # the constant normaliser of Dr. GRPO is the global batch's longest response, whichever process holds it
    "dr_grpo": dict(ppo_epochs=2, advantage_estimator="dr_grpo", num_generations=2),
    "reinforce_baseline": dict(ppo_epochs=2, advantage_estimator="reinforce_plus_plus_baseline", num_generations=2),
    # the rollout correction: importance weights per sample, their sampling/* stats over every process's tokens
    "rollout_correction": dict(ppo_epochs=2, rollout_dtype="bfloat16", rollout_correction="token_truncate"),
    # a schedule over the run's STEPS calls (ppo/learning_rate 1, 2/3, 1/3 of the rate), not over N times as many
    # (accelerate steps a prepared scheduler once per process)
    "linear_lr": dict(ppo_epochs=2, lr_scheduler_type="linear"),
}

# Windows of 2 mini-batches of 2 (batch 8); the ratio threshold skips some mini-batches, some of them at the end
# of a window whose first one was not skipped (DeepSpeed steps only in the backward of a window's last one).
ACCUMULATION = dict(ppo_epochs=3, ratio_threshold=1.0005, gradient_accumulation_steps=2)


def global_batch(step: int, group_size: int = 1):
    """The ``step``-th global batch of (query, response, score) triples; with ``group_size``, each query that many
    times in a row."""
    gen = torch.Generator().manual_seed(100 + step)
    responses = [torch.randint(3, VOCAB, (n,), generator=gen) for n in RESPONSE_LENS]
    queries = [q for q in random_queries(GLOBAL_BATCH // group_size, seed=step) for _ in range(group_size)]
    return queries, responses, list(torch.randn(GLOBAL_BATCH, generator=gen))


def make_trainer(num_processes: int, mini_batches: int = 1, sgd: bool = False, model=None, **options) -> PPOTrainer:
    batch_size = GLOBAL_BATCH // num_processes
    config = PPOConfig(**{"batch_size": batch_size, "mini_batch_size": batch_size // mini_batches,
                          "steps": batch_size * STEPS, "learning_rate": 1e-3, "seed": 0, **options})
    model = model if model is not None else tiny_value_model("gpt2", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR) if sgd else None
    return PPOTrainer(config, model, tokenizer=tiny_tokenizer(), optimizer=optimizer)


def local_step(trainer: PPOTrainer, step: int, corrupt: bool = False) -> dict:
    """``step`` on this process's share of the ``step``-th global batch; the stats without timings."""
    n, p = trainer.accelerator.num_processes, trainer.accelerator.process_index
    part = slice(p * GLOBAL_BATCH // n, (p + 1) * GLOBAL_BATCH // n)
    queries, responses, scores = (x[part] for x in global_batch(step, trainer.config.num_generations))
    if corrupt:
        scores[0] = torch.tensor(float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ratio-threshold skips warn, by design
        stats = trainer.step(queries, responses, scores)
    return {k: v for k, v in stats.items() if not k.startswith("time/")}


def params(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    """The full parameters (and buffers); under ZeRO-3 gathered from every process's shards."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    with gathered(model.parameters()):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_global(num_processes: int, models: dict | None = None, configs: dict | None = None) -> dict:
    out = {}
    for name, options in (CONFIGS if configs is None else configs).items():
        trainer = make_trainer(num_processes, sgd=True, model=(models or {}).get(name), **options)
        stats = [local_step(trainer, step) for step in range(STEPS)]
        out[name] = {"stats": stats, "params": params(trainer)}
    return out


def zero_stage() -> int | None:
    """The ZeRO stage ``accelerate launch`` runs this process under (None: no DeepSpeed)."""
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    return None if stage is None else int(stage)


def run_shuffled(num_processes: int, out_dir: str, models: tuple | None = None) -> dict:
    """A step, a checkpoint and a second step; then a trainer resumed from the checkpoint takes the second step too.
    ``models``: the two trainers' policies, built beforehand (under ZeRO-3 a model built later comes out sharded)."""
    path = os.path.join(out_dir, "ckpt.pt")
    models = models or (None, None)
    trainer = make_trainer(num_processes, mini_batches=2, model=models[0])
    seed = trainer._shuffle.initial_seed()
    local_step(trainer, 0)
    trainer.save_checkpoint(path)
    expected = local_step(trainer, 1)
    resumed = make_trainer(num_processes, mini_batches=2, model=models[1])
    resumed.load_checkpoint(path)
    got = local_step(resumed, 1)
    return {"shuffle_seed": seed, "params": params(trainer), "resumed_params": params(resumed),
            "stats": expected, "resumed_stats": got}


def run_deepspeed(num_processes: int) -> dict:
    """``run_global`` and two rollout steps under DeepSpeed. Every model is built first: once an Accelerator
    runs ZeRO-3 in a process, transformers builds later models sharded (deepspeed.zero.Init), and a sharded policy
    cannot be copied into a reference."""
    models = {name: tiny_value_model("gpt2", seed=0) for name in [*CONFIGS, "rollout"]}
    # ZeRO-3 shards the weights a rollout copy would copy whole: the trainer refuses the copy (its error recorded)
    refused = {name for name, options in CONFIGS.items() if "rollout_dtype" in options} if zero_stage() == 3 else set()
    out = run_global(num_processes, models, {k: v for k, v in CONFIGS.items() if k not in refused})
    for name in refused:
        try:
            make_trainer(num_processes, sgd=True, model=models[name], **CONFIGS[name])
            out[name] = {"refused": None}
        except ValueError as err:
            out[name] = {"refused": str(err)}
    trainer = make_trainer(num_processes, mini_batches=2, model=models["rollout"], kl_penalty="full")
    heads = [trainer.accelerator.unwrap_model(m).lm_head_parameters()[0] for m in (trainer.model, trainer.ref_model)]
    rollout = {"stats": [], "generate_fetches": 0, "step_fetches": 0,
               "heads_sharded": [h.numel() == 0 and h.ds_numel > 0 if hasattr(h, "ds_id") else False for h in heads]}
    for step in range(2):
        queries = random_queries(GLOBAL_BATCH // num_processes, seed=10 * step + trainer.accelerator.process_index)
        with counted_fetches(trainer.model) as fetches:
            responses, _ = trainer.generate(queries, return_prompt=False, generate_ref_response=True, max_new_tokens=5,
                                            do_sample=True, top_k=0, top_p=1.0, pad_token_id=PAD)
        rollout["generate_fetches"] += fetches[0]
        with counted_fetches(trainer.model) as fetches:
            stats = trainer.step(queries, responses, [torch.tensor(float(len(r))) for r in responses])
        rollout["step_fetches"] += fetches[0]
        rollout["stats"].append({k: v for k, v in stats.items() if not k.startswith("time/")})
    rollout["params"] = params(trainer)
    # the filter of DeepSpeed's deprecated collectives lives only as long as a trainer method runs
    filters = [f for f in warnings.filters if f[1] is not None and "all_gather_into_tensor" in f[1].pattern]
    return {**out, "rollout": rollout, "non_finite": non_finite_step(trainer), "collectives_filters": len(filters)}


def non_finite_step(trainer: PPOTrainer) -> dict:
    """A step whose second mini-batch's value-head gradient is infinite: the error and the weights around it."""
    weight = trainer.accelerator.unwrap_model(trainer.model).v_head.summary.weight
    calls = []

    def blow_up_second(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 2 else grad

    handle = weight.register_hook(blow_up_second)
    before, error = params(trainer), None
    try:
        local_step(trainer, 0)
    except FloatingPointError as exc:
        error = str(exc)
    handle.remove()
    return {"error": error, "before": before, "after": params(trainer)}


def run_accumulation() -> dict:
    trainer = make_trainer(1, mini_batches=4, sgd=True, **ACCUMULATION)
    return {"stats": [local_step(trainer, step) for step in range(STEPS)], "params": params(trainer)}


def run_reference_dtype() -> dict:
    trainer = make_trainer(1)
    dtypes = {name: sorted({str(p.dtype) for p in model.parameters()})
              for name, model in (("policy", trainer.model), ("reference", trainer.ref_model))}
    return {"dtypes": dtypes, "stats": local_step(trainer, 0)}


def run_window_skip(num_processes: int) -> dict:
    """Two steps of 2 epochs, each a window of 2 mini-batches (gradient accumulation 2) whose second is skipped."""
    trainer = make_trainer(num_processes, mini_batches=2, ppo_epochs=2, gradient_accumulation_steps=2)
    loss, calls = trainer.loss, []

    def over_threshold_every_second(*args, **kwargs):
        loss_p, loss_v, stats = loss(*args, **kwargs)
        calls.append(1)
        if len(calls) % 2 == 0:  # the last mini-batch of each window (2 per epoch): its ratio "explodes"
            stats["policy/ratio_sum"] = stats["policy/ratio_sum"] + 1e3 * stats["policy/tokens"]
        return loss_p, loss_v, stats

    trainer.loss = over_threshold_every_second
    return {"stats": [local_step(trainer, step) for step in range(2)], "params": params(trainer)}


def run_split(num_processes: int, process_index: int) -> dict:
    from tests.ppo_core.test_one_update import TWO_PROCESS_SPLITS, cells, update

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no dataset: by design
        return {(estimator, aggregation, split): update(estimator, aggregation, *split, num_processes, process_index)
                for estimator, aggregation in cells() for split in TWO_PROCESS_SPLITS}


@contextlib.contextmanager
def counted_fetches(engine):
    """Yields ``[n]``: how many module forwards fetched ZeRO-3 parameters of ``engine`` in the block (0 without
    ZeRO-3). The fetch is a method of the engine's parameter-offload object, looked up at each call."""
    count = [0]
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is None:
        yield count
        return
    fetch = offload.pre_sub_module_forward_function

    def counting(module):
        count[0] += 1
        return fetch(module)

    offload.pre_sub_module_forward_function = counting
    try:
        yield count
    finally:
        del offload.pre_sub_module_forward_function  # the class's method again


def main(out_dir: str, scenario: str) -> None:
    torch.set_num_threads(1)
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if scenario == "global":
        result = run_global(num_processes)
    elif scenario == "global+shuffled":
        result = {**run_global(num_processes), "shuffled": run_shuffled(num_processes, out_dir)}
    elif scenario == "deepspeed":
        result = run_deepspeed(num_processes)
    elif scenario == "deepspeed+resume":  # the engine's own checkpoint: its module's (legacy-keyed) state dict
        models = tuple(tiny_value_model("gpt2", seed=0) for _ in range(2))
        result = {"shuffled": run_shuffled(num_processes, out_dir, models)}
    elif scenario == "accumulation":
        result = run_accumulation()
    elif scenario == "reference_dtype":
        result = run_reference_dtype()
    elif scenario == "window_skip":
        result = run_window_skip(num_processes)
    elif scenario == "split":
        result = run_split(num_processes, int(os.environ.get("RANK", "0")))
    elif scenario == "bad_input":
        trainer = make_trainer(num_processes)
        local_step(trainer, 0, corrupt=trainer.accelerator.process_index == num_processes - 1)
        result = {}
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    rank = int(os.environ.get("RANK", "0"))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
