"""A run checkpointed and resumed in a fresh trainer equals the uninterrupted run, bit for bit on CPUs (on a GPU,
within float tolerances: CUDA's kernels are not all deterministic)."""

from pathlib import Path

import pytest
import torch

from ppo_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from tests.tiny import random_queries, tiny_causal_lm, tiny_tokenizer


def make_trainer():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"))
    config = PPOConfig(batch_size=8, mini_batch_size=4, learning_rate=1e-3, seed=0, use_score_scaling=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return PPOTrainer(config, model, None, tiny_tokenizer(), optimizer=optimizer, lr_scheduler=scheduler)


def run(trainer, steps):
    for step in steps:
        queries = random_queries(8, seed=step)
        responses = trainer.generate(queries, batch_size=8, return_prompt=False, do_sample=True, top_k=0,
                                     top_p=1.0, max_new_tokens=6)
        stats = trainer.step(queries, responses, [(r == 10).float().sum() for r in responses])
    return stats


def test_resume_reproduces_the_uninterrupted_run_on_cpu(tmp_path):
    torch.set_num_threads(1)
    uninterrupted = make_trainer()
    expected = run(uninterrupted, range(5))

    first = make_trainer()
    run(first, range(2))
    first.save_checkpoint(str(tmp_path / "ckpt.pt"), extra={"data_position": 2})
    del first

    resumed = make_trainer()
    assert resumed.load_checkpoint(str(tmp_path / "ckpt.pt")) == {"data_position": 2}
    got = run(resumed, range(2, 5))

    for name, param in uninterrupted.model.state_dict().items():
        assert torch.equal(param, resumed.model.state_dict()[name]), name
    assert resumed.kl_ctl.value == uninterrupted.kl_ctl.value
    assert resumed.running.state_dict() == uninterrupted.running.state_dict()
    assert resumed.optimizer.param_groups[0]["lr"] == uninterrupted.optimizer.param_groups[0]["lr"]
    assert got["ppo/loss/total"] == expected["ppo/loss/total"]


def test_a_resumed_run_goes_on_along_the_configs_schedule(tmp_path):
    def scheduled():  # the schedule built from the config (lr_scheduler_type), over 5 step() calls
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"))
        config = PPOConfig(batch_size=8, mini_batch_size=4, learning_rate=1e-3, seed=0, steps=40,
                           lr_scheduler_type="linear")
        return PPOTrainer(config, model, None, tiny_tokenizer())

    first = scheduled()
    run(first, range(2))
    first.save_checkpoint(str(tmp_path / "ckpt.pt"))
    resumed = scheduled()
    resumed.load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert run(resumed, [2])["ppo/learning_rate"] == pytest.approx(1e-3 * 3 / 5)  # not the fresh 1e-3


def test_unreadable_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(b"truncated")
    with pytest.raises(ValueError, match="ckpt.pt.*cannot be read"):
        make_trainer().load_checkpoint(str(bad))


def test_a_deepspeed_checkpoint_is_refused_without_deepspeed(tmp_path):
    """Its weights and optimizer state are DeepSpeed's shards (a directory, ``trainer.pt`` beside them), which a
    run without DeepSpeed cannot read: the message says how to resume it (tests/stages/test_distributed.py runs
    the DeepSpeed ones)."""
    trainer = make_trainer()
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    state = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=True)
    (tmp_path / "ds").mkdir()
    torch.save(state | {"zero_stage": 3}, tmp_path / "ds" / "trainer.pt")
    with pytest.raises(ValueError, match=r"ds: written by a run under DeepSpeed ZeRO-3, this one runs without "
                                         r"DeepSpeed; launch it as the checkpoint's run was to resume, or delete it"):
        trainer.load_checkpoint(str(tmp_path / "ds"))


def test_a_checkpoint_is_one_directory_swapped_in_whole(tmp_path):
    """Without DeepSpeed too: ``trainer.pt`` beside ``engine/`` (here the state dicts, in ``state.pt``), assembled
    under a temporary name and renamed into place; a second save replaces the first and leaves nothing beside it."""
    trainer = make_trainer()
    path = tmp_path / "state"
    trainer.save_checkpoint(str(path), extra={"at": 0})
    run(trainer, range(1))
    trainer.save_checkpoint(str(path), extra={"at": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["state"]
    assert sorted(p.name for p in path.iterdir()) == ["engine", "trainer.pt"]
    assert [p.name for p in (path / "engine").iterdir()] == ["state.pt"]
    state = torch.load(path / "trainer.pt", weights_only=True)
    assert state["zero_stage"] is None and state["step_count"] == 1 and state["extra"] == {"at": 1}
    assert len(state["processes"]) == 1 and {"shuffle", "rng"} <= state["processes"][0].keys()
    assert state["resolved"] == trainer.resolved.to_dict()  # what the run trains with, beside the legacy copy
    engine = torch.load(path / "engine" / "state.pt", weights_only=True)
    assert engine.keys() == {"model", "optimizer", "lr_scheduler"}
    assert make_trainer().load_checkpoint(str(path)) == {"at": 1}


def test_a_checkpoint_of_the_old_one_file_format_is_refused(tmp_path):
    """ppo_core wrote a single file without DeepSpeed before: it is not read, and the message says what to do."""
    old = tmp_path / "state.pt"
    torch.save({"format_version": 1, "model": {}}, old)
    with pytest.raises(ValueError, match=r"state.pt: cannot be read \(a file: ppo_core's old one-file format.*"
                                         r"delete it to start fresh"):
        make_trainer().load_checkpoint(str(old))
    old_dir = tmp_path / "old-deepspeed"  # the old DeepSpeed layout, format 1
    old_dir.mkdir()
    torch.save({"format_version": 1}, old_dir / "trainer.pt")
    with pytest.raises(ValueError, match=r"not a ppo_core checkpoint of format 2.*delete it to start fresh"):
        make_trainer().load_checkpoint(str(old_dir))
    with pytest.raises(ValueError, match=r"missing: cannot be read \(no such directory\)"):
        make_trainer().load_checkpoint(str(tmp_path / "missing"))
    trainer = make_trainer()
    trainer.save_checkpoint(str(old))  # the file is replaced by a checkpoint directory
    assert old.is_dir() and trainer.load_checkpoint(str(old)) == {}


def test_a_directory_checkpoint_is_swapped_in_whole(tmp_path):
    """A checkpoint is a directory every process may write into (under DeepSpeed) under a temporary name (the same
    on every process), then renamed over the previous one; nothing else is left beside it."""
    from ppo_core import checkpoint

    target = tmp_path / "state"
    target.mkdir()
    (target / "old.pt").write_text("old")
    tmp = Path(checkpoint.temporary_dir(str(target), "4"))
    assert tmp.name.startswith(".tmp-") and tmp.parent == tmp_path  # what the stages' clean-up removes
    tmp.mkdir()
    (tmp / "new.pt").write_text("new")
    Path(f"{tmp}-old").mkdir()  # left by a writer killed while deleting the checkpoint before
    checkpoint.replace_dir(str(tmp), str(target))
    assert [p.name for p in target.iterdir()] == ["new.pt"]
    assert [p.name for p in tmp_path.iterdir()] == ["state"]


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temporary_directory(tmp_path, monkeypatch):
    """A full disk mid-checkpoint (torch.save then raises a RuntimeError naming no file and no errno): the error goes
    up, the previous checkpoint is untouched, and the half-written temporary directory is gone."""
    trainer = make_trainer()
    path = tmp_path / "state"
    trainer.save_checkpoint(str(path), extra={"at": 0})
    before = {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}

    def disk_full(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"the first bytes")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        trainer.save_checkpoint(str(path), extra={"at": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["state"]
    assert {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()} == before


def test_non_finite_loss_stops_the_step_before_any_update():
    trainer = make_trainer()
    queries = random_queries(8, seed=0)
    responses = trainer.generate(queries, batch_size=8, return_prompt=False, max_new_tokens=4)
    with torch.no_grad():
        trainer.model.v_head.summary.bias.fill_(float("inf"))  # values inf -> value loss non-finite
    before = {k: v.clone() for k, v in trainer.model.pretrained_model.state_dict().items()}
    with pytest.raises(FloatingPointError, match=r"PPO step 1, mini-batch 1: non-finite ppo/(loss|returns|val)/"):
        trainer.step(queries, responses, [torch.tensor(1.0)] * 8)
    for name, value in trainer.model.pretrained_model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_non_finite_gradient_stops_the_step_naming_the_mini_batch():
    """A finite loss with an infinite gradient: the step stops before that mini-batch's update, and the message
    says which mini-batch and what the weights hold (here: the first mini-batch's update, not the second's)."""
    trainer = make_trainer()  # batch 8, mini-batch 4: two mini-batches per epoch
    queries = random_queries(8, seed=0)
    responses = trainer.generate(queries, batch_size=8, return_prompt=False, max_new_tokens=4)
    weight = trainer.model.v_head.summary.weight
    calls = []

    def blow_up_second(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 2 else grad

    weight.register_hook(blow_up_second)
    before = weight.detach().clone()
    with pytest.raises(FloatingPointError, match=r"PPO step 1, mini-batch 2: non-finite gradient norm \(inf\) before "
                                                 r"the update; the weights hold this step's first 1 mini-batch update, "
                                                 r"not this one"):
        trainer.step(queries, responses, [torch.tensor(1.0)] * 8)
    assert torch.isfinite(weight).all() and not torch.equal(weight.detach(), before)  # mini-batch 1's update only
