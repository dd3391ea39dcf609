"""PPO steps on a fixed global batch, run by ``tests/test_core_distributed.py`` in N processes or in one.

    accelerate launch --multi_gpu --num_processes 2 tests/distributed_step.py OUT_DIR SCENARIO
    python tests/distributed_step.py OUT_DIR global              # one process, the whole global batch

Process ``p`` of ``N`` takes samples ``[p * 8 / N, (p + 1) * 8 / N)`` of each step's 8; process 0 holds
far more response tokens than process 1, so token means differ from means of per-process means.
Scenarios (each writes ``OUT_DIR/rank{p}.pt``):

* ``global``: for each of ``CONFIGS`` (one mini-batch per epoch, so the mini-batches are the same in
  N processes and in one), the stats of ``STEPS`` steps and the final parameters;
* ``global+shuffled``: that, and under ``"shuffled"`` a run with mini-batches of 2 per process,
  checkpointed after step 1 and resumed in a fresh trainer (one launch for both saves a process start-up);
* ``bad_input``: the last process passes a NaN score (the others valid ones) and ``step`` must raise.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ppo_core import PPOConfig, PPOTrainer  # noqa: E402
from tests.tiny import VOCAB, random_queries, tiny_tokenizer, tiny_value_model  # noqa: E402

GLOBAL_BATCH, STEPS = 8, 3
RESPONSE_LENS = [6, 5, 6, 4, 1, 2, 1, 1]  # 21 tokens in the first half, 5 in the second
# Plain SGD: Adam divides each gradient entry by its own RMS, so where the true gradient is 0 (e.g. GPT-2's key
# biases) it turns float noise into lr-sized steps, and the parameters of two exact computations differ by ~lr.
SGD_LR = 1.0
CONFIGS = {  # per-config options; batch sizes are set per process below
    "whiten": dict(ppo_epochs=2, whiten_rewards=True, use_score_scaling=True, use_score_norm=True),
    "skip": dict(ppo_epochs=3, ratio_threshold=1.0005),
    "early_stop": dict(ppo_epochs=4, early_stopping=True, target_kl=1e-5),
}


def global_batch(step: int):
    """The ``step``-th global batch of (query, response, score) triples."""
    gen = torch.Generator().manual_seed(100 + step)
    responses = [torch.randint(3, VOCAB, (n,), generator=gen) for n in RESPONSE_LENS]
    return random_queries(GLOBAL_BATCH, seed=step), responses, list(torch.randn(GLOBAL_BATCH, generator=gen))


def make_trainer(num_processes: int, mini_batches: int = 1, sgd: bool = False, **options) -> PPOTrainer:
    batch_size = GLOBAL_BATCH // num_processes
    config = PPOConfig(**{"batch_size": batch_size, "mini_batch_size": batch_size // mini_batches,
                          "learning_rate": 1e-3, "seed": 0, **options})
    model = tiny_value_model("gpt2", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR) if sgd else None
    return PPOTrainer(config, model, tokenizer=tiny_tokenizer(), optimizer=optimizer)


def local_step(trainer: PPOTrainer, step: int, corrupt: bool = False) -> dict:
    """``step`` on this process's share of the ``step``-th global batch; the stats without timings."""
    n, p = trainer.accelerator.num_processes, trainer.accelerator.process_index
    part = slice(p * GLOBAL_BATCH // n, (p + 1) * GLOBAL_BATCH // n)
    queries, responses, scores = (x[part] for x in global_batch(step))
    if corrupt:
        scores[0] = torch.tensor(float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ratio-threshold skips warn, by design
        stats = trainer.step(queries, responses, scores)
    return {k: v for k, v in stats.items() if not k.startswith("time/")}


def params(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def run_global(num_processes: int) -> dict:
    out = {}
    for name, options in CONFIGS.items():
        trainer = make_trainer(num_processes, sgd=True, **options)
        stats = [local_step(trainer, step) for step in range(STEPS)]
        out[name] = {"stats": stats, "params": params(trainer)}
    return out


def run_shuffled(num_processes: int, out_dir: str) -> dict:
    path = os.path.join(out_dir, "ckpt.pt")
    trainer = make_trainer(num_processes, mini_batches=2)
    seed = trainer._shuffle.initial_seed()
    local_step(trainer, 0)
    trainer.save_checkpoint(path)
    expected = local_step(trainer, 1)
    resumed = make_trainer(num_processes, mini_batches=2)
    resumed.load_checkpoint(path)
    got = local_step(resumed, 1)
    return {"shuffle_seed": seed, "params": params(trainer), "resumed_params": params(resumed),
            "stats": expected, "resumed_stats": got}


def main(out_dir: str, scenario: str) -> None:
    torch.set_num_threads(1)
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if scenario == "global":
        result = run_global(num_processes)
    elif scenario == "global+shuffled":
        result = {**run_global(num_processes), "shuffled": run_shuffled(num_processes, out_dir)}
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
