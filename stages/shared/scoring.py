"""The ppo stage's reward, which evaluate reports too: the function `scorer.source` names, where it comes from, and a
check of what it returns.

`scorer.source` is the trained reward model (default), a transformers text-classification pipeline (the raw score
of `scorer.label`, as in the seed), or a Python callable `module:function` taking the list of texts. A user's reward
function goes in the `rewards/` package (`scorer.name: rewards.<module>:<function>`), which dvc.yaml lists among the
deps of the ppo and evaluate stages, or anywhere Python finds it: the sources stage hashes the module's file wherever
it is, and one from an installed package is known by its version (`stages.shared.origins.scorer_origin`), so editing it
reruns ppo and evaluate. The resumable state's fingerprint covers it too.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from transformers import pipeline

from stages.shared.artifacts import CHATS, REWARD_ADAPTER, REWARD_MODEL
from stages.shared.models import load_reward_model, reward_scores
from stages.shared.origins import check_model_source
from stages.shared.params import Params, ScorerParams
from stages.shared.runtime import StageError, device, reason, untracked_hint
from stages.shared.synthetic import gold_score

REWARDS = "rewards"  # the package of user reward functions, a dep of the ppo stage in dvc.yaml


def build_scorer(params: Params, root: Path, policy=None) -> Callable[[list[str]], list[float]]:
    """The reward function chosen by `scorer.source`: texts (query + response) -> one float each, or with "combined"
    a `Combined` of `scorer.functions`. `policy`: the policy carrying the reward stage's adapter (see
    `reward_adapter`), which then scores instead of a reward model of its own."""
    spec = params.scorer
    if spec.source == "combined":
        return Combined({name: (one_function(params, root, dataclasses.replace(
            spec, source=entry.get("source", "callable"), name=entry.get("name"), label=entry.get("label", spec.label),
            functions={}), policy, f"scorer.functions.{name}.name"), float(entry.get("weight", 1.0)))
            for name, entry in spec.functions.items()})
    return one_function(params, root, spec, policy, "scorer.name")


def one_function(params: Params, root: Path, spec: ScorerParams, policy, key: str) -> Callable:
    """One reward function, of ``spec``'s source (params ``key`` names it in errors)."""
    if spec.source == "reward_model":
        model, tokenizer = load_reward_model(root / REWARD_MODEL, policy)
        return lambda texts: reward_scores(model, tokenizer, texts, spec.batch_size)
    if spec.source == "pipeline":
        check_model_source(spec.name, key)
        try:
            pipe = pipeline("text-classification", model=spec.name, device=device())
        except (OSError, ValueError) as err:
            raise StageError(f"{params.path}: {key} '{spec.name}' could not be loaded as a text-classification "
                             f"model ({reason(err)}); give a local path or a model id") from None

        def score_with_pipeline(texts: list[str]) -> list[float]:
            outputs = pipe(texts, batch_size=spec.batch_size, function_to_apply="none", top_k=None)
            by_label = [{o["label"]: o["score"] for o in out} for out in outputs]
            if spec.label not in by_label[0]:
                raise StageError(f"{params.path}: scorer.label '{spec.label}' is not a label of {spec.name} "
                                 f"(labels: {sorted(by_label[0])})")
            return [float(labels[spec.label]) for labels in by_label]

        return score_with_pipeline
    return load_callable(spec.name, key, params)  # its output is checked by `scored`


def load_callable(name: str, key: str, params: Params) -> Callable[[list[str]], list[float]]:
    """The function ``name`` ("module:function") that params ``key`` names, imported; a StageError naming the key
    and the problem (not importable, a syntax error or an exception in the module, no such function) otherwise."""
    module_name, _, attr = name.partition(":")
    where = f"{params.path}: {key} '{name}'"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = f"{(err.name or module_name).replace('.', '/')}.py"
        raise StageError(f"{where} is not an importable 'module:function' ({err}){untracked_hint(missing)}") from None
    except SyntaxError as err:  # the user's own file: say where, in one line
        raise StageError(f"{where}: {shown(err.filename)}:{err.lineno}: SyntaxError: {err.msg}") from err
    except Exception as err:  # anything the module's own code raises on import
        raise StageError(f"{where}: importing {module_name} raised {raised_at(err)}") from err
    except SystemExit as err:
        raise StageError(f"{where}: importing {module_name} called sys.exit({err.code!r}){raised_where(err)}") from err
    fn = getattr(module, attr, None) if attr else None
    if not callable(fn):
        raise StageError(f"{where} is not an importable 'module:function' ({module_name} has no function "
                         f"'{attr}')")
    if takes_the_row(fn):
        check_takes_the_row(fn, where, params.data.prompts.keep)
    else:
        check_takes_the_texts(fn, where)
    return fn


# The keyword arguments a reward function that sees the row is called with, beside each kept prompts column, as TRL's
# GRPOTrainer calls its reward functions: the prompts, the completions and the completions' token ids, each a list
# over the batch, and the trainer's state (a transformers TrainerState: its global_step, max_steps).
ROW_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")


class Row(NamedTuple):
    """What a reward function that sees the row may take of a batch: each sample's prompt (its query), completion (its
    response) and the completion's token ids (EOS kept, no padding), each `data.prompts.keep` column's value for its
    prompt (and, where the prompts are chats, its chat: ``artifacts.CHATS``, JSON text), all lists of one length (with
    ppo.num_generations G, a prompt's G samples each hold its values), and the run's progress (``trainer_state``:
    `trainer_state`'s TrainerState, or None where unknown)."""

    prompts: list[str]
    completions: list[str]
    columns: dict[str, list]
    completion_ids: list[list[int]] | None = None
    trainer_state: object | None = None

    def sliced(self, start: int, stop: int) -> Row:
        """The samples ``start:stop`` of the batch (the same trainer state)."""
        ids = None if self.completion_ids is None else self.completion_ids[start:stop]
        return Row(self.prompts[start:stop], self.completions[start:stop],
                   {k: v[start:stop] for k, v in self.columns.items()}, ids, self.trainer_state)


def trainer_state(global_step: int, max_steps: int):
    """TRL's ``trainer_state`` argument of a reward function, for rewards shaped by the run's progress: a transformers
    ``TrainerState`` with ``global_step`` (the ppo steps done: 0 while the first step's rollouts are scored) and
    ``max_steps`` (the run's steps, ceil(ppo.steps / ppo.batch_size))."""
    from transformers import TrainerState

    return TrainerState(global_step=global_step, max_steps=max_steps)


def trained_state(params: Params):
    """:func:`trainer_state` at the end of the ppo run, as evaluate scores every policy: all its steps done."""
    steps = math.ceil(params.ppo["steps"] / params.ppo["batch_size"])  # PPOConfig.total_ppo_epochs
    return trainer_state(steps, steps)


def takes_the_row(fn: Callable) -> bool:
    """Whether ``fn`` is a reward function that sees the row, called by keyword as TRL's GRPOTrainer calls them
    (``def accuracy(completions, answer, **kwargs)``): it names a parameter of ``ROW_ARGUMENTS``. Any other
    function is called with the list of texts alone, as every scorer was (``def score(texts)``)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in ROW_ARGUMENTS)


def trl_prompts_and_completions(row: Row) -> tuple[list, list]:
    """The ``prompts`` and ``completions`` a reward function is called with, in TRL's GRPOTrainer's two formats:
    strings for plain prompts (each query, templated or not, and its response's text); where the prompts are chats
    (``row.columns`` holds ``CHATS``), TRL's conversational format: each prompt its chat, a list of {role, content}
    turns (as the template formatted it, chat.system_prompt's turn included), each completion a list of one
    assistant turn, ``[{"role": "assistant", "content": response}]`` (a reward written for TRL reads
    ``completion[0]["content"]``). A chat that ends with an assistant turn (a prefill the response continued) gives
    that turn's text to the completion, as TRL does: the prompt is the turns before it."""
    if CHATS not in row.columns:
        return row.prompts, row.completions
    prompts, completions = [], []
    for chat, text in zip(row.columns[CHATS], row.completions):
        turns = json.loads(chat)
        prefill = turns.pop()["content"] if turns[-1]["role"] == "assistant" else ""
        prompts.append(turns)
        completions.append([{"role": "assistant", "content": prefill + text}])
    return prompts, completions


def row_arguments(fn: Callable, row: Row) -> dict[str, list]:
    """The keyword arguments ``fn`` is called with: ``ROW_ARGUMENTS`` (``prompts`` and ``completions`` as
    `trl_prompts_and_completions` gives them) and each kept column, all of them where it takes ``**kwargs``, else those
    it names."""
    prompts, completions = trl_prompts_and_completions(row)
    available = {"prompts": prompts, "completions": completions, "completion_ids": row.completion_ids,
                 "trainer_state": row.trainer_state, **{k: v for k, v in row.columns.items() if k != CHATS}}
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return available
    return {name: value for name, value in available.items() if name in parameters}


def check_takes_the_row(fn: Callable, where: str, kept: list[str]) -> None:
    """Refuse, where it is loaded, a reward function that sees the row but needs an argument the stages do not have:
    a parameter without a default that is neither one of ``ROW_ARGUMENTS`` nor a kept prompts column
    (`data.prompts.keep`), or one it can only take by position."""
    known = {*ROW_ARGUMENTS, *kept}
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if parameter.default is inspect.Parameter.empty and name not in known:
            code = getattr(inspect.unwrap(fn), "__code__", None)
            at = f" ({shown(code.co_filename)}:{code.co_firstlineno})" if code else ""
            raise StageError(f"{where}: {getattr(fn, '__name__', 'the function')}{at} takes '{name}', which is not a "
                             f"column of the prompts: add it to data.prompts.keep (kept now: {kept or 'none'}), or "
                             "give it a default")
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise StageError(f"{where}: its parameter '{name}' is positional-only; a reward function that sees the row "
                             "is called by keyword (prompts=, completions=, completion_ids=, trainer_state=, and each "
                             "kept column)")


def check_takes_the_texts(fn: Callable, where: str) -> None:
    """Refuse, where it is loaded, a function the stages cannot call as they call every scorer and judge: ``fn(texts)``,
    one positional argument, the list of texts. Called, its TypeError would point at this module rather than at the
    user's function. A signature Python cannot read (some builtins) is left to the call."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind([])
    except TypeError:
        code = getattr(inspect.unwrap(fn), "__code__", None) or getattr(type(fn).__call__, "__code__", None)
        at = f" ({shown(code.co_filename)}:{code.co_firstlineno})" if code else ""
        name = getattr(fn, "__name__", type(fn).__name__)
        raise StageError(f"{where}: {name}{signature}{at} cannot be called with one argument, the list of texts; give "
                         "its other parameters defaults, or wrap it in a def score(texts)") from None


def reward_adapter(params: Params, root: Path, seq2seq: bool) -> Path | None:
    """The reward stage's LoRA adapter (with its score head) when the ppo stage scores with it on the policy's own base
    weights, one copy of them for policy, reference and reward model: with `model.lora`, the trained reward model as
    `scorer.source` and a causal LM (ppo_core loads reward adapters into those only). None: the reward model is loaded
    on its own (merged, a second copy of the base weights)."""
    if params.model.lora is None or params.scorer.source != "reward_model" or seq2seq:
        return None
    path = root / REWARD_ADAPTER
    if not (path / "adapter_config.json").is_file():
        raise StageError(f"{path}: no reward adapter (the reward stage saves one with model.lora set); rerun the "
                         "reward stage with the same model.lora (`dvc repro -f reward`)")
    return path


def raised_at(err: BaseException) -> str:
    """``Type: message (file:line)`` of an exception, at the innermost frame of its traceback (the user's code)."""
    return f"{type(err).__name__}: {reason(err)}{raised_where(err)}"


def raised_where(err: BaseException) -> str:
    """`` (file:line)`` of the innermost frame of an exception's traceback, or nothing without one."""
    frames = traceback.extract_tb(err.__traceback__)
    return f" ({shown(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


def shown(filename: str | None) -> str | None:
    """A source file's name for a message: relative to the working directory when it lies under it (the
    project's own `rewards/example.py`), else as Python gave it."""
    if filename is None:
        return None
    path = Path(filename)
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except (ValueError, OSError):
        return filename


def judge_functions(params: Params) -> dict[str, Callable[[list[str]], list[float]]]:
    """The scorers the policy never trained on, by metric name: the synthetic data's gold score (the lexicon its pairs
    were labelled with), and `evaluate.judges` (one of which may take the name `gold` with data of the user's own: the
    params check refuses it beside the synthetic data's)."""
    judges = {"gold": lambda texts: [gold_score(t) for t in texts]} if params.data.is_synthetic else {}
    return judges | {name: load_callable(spec, f"evaluate.judges.{name}", params)
                     for name, spec in params.evaluate.judges.items()}


def scorer_texts(spec: ScorerParams, queries: list[str], responses: list[str]) -> list[str]:
    """What `scorer.input` gives the scorer for each sample: its query and response as one text, or the response."""
    if spec.input == "response":
        return list(responses)
    return [q + r for q, r in zip(queries, responses)]


class Combined:
    """`scorer.source: combined`: several reward functions, each with its weight; a response's reward is their
    weighted sum, a function's None (it does not apply to that response) left out of it, as TRL's GRPOTrainer sums
    them (all None: 0). After each call, ``last`` holds each function's own rewards (None where it did not apply), for
    the stats, the curves, the held-out watch and evaluate, under the function's name."""

    def __init__(self, functions: dict[str, tuple[Callable, float]]):
        self.functions = functions
        self.last: dict[str, list[float | None]] = {}

    def score(self, texts: list[str], spec: ScorerParams, at: str, row: Row | None) -> list[float]:
        self.last = {name: scored(fn, texts, spec, at, f"scorer function {name}", row, keep_none=True)
                     for name, (fn, _) in self.functions.items()}
        weights = [weight for _, weight in self.functions.values()]
        return [sum(w * v for w, v in zip(weights, values) if v is not None) for values in zip(*self.last.values())]


def function_rewards(score) -> dict[str, list[float]]:
    """A combined scorer's functions' rewards of its last call, by their metric names (``reward_NAME``), None (does
    not apply) counted 0 as in the sum; {} for any other scorer."""
    last = score.last.items() if isinstance(score, Combined) else ()
    return {f"reward_{fn}": [0.0 if v is None else v for v in values] for fn, values in last}


def component_stats(last: dict[str, list[float | None]]) -> dict[str, float]:
    """Each function's mean and std over the responses it applied to (``rewards/NAME/mean`` and ``/std``, TRL's
    names; NaN where it applied to none)."""
    out = {}
    for name, values in last.items():
        applied = np.array([v for v in values if v is not None], dtype=float)
        out[f"rewards/{name}/mean"] = float(applied.mean()) if applied.size else float("nan")
        out[f"rewards/{name}/std"] = float(applied.std(ddof=1)) if applied.size > 1 else float("nan")
    return out


def scored(score: Callable[[list[str]], list[float]], texts: list[str], spec: ScorerParams, at: str,
           who: str | None = None, row: Row | None = None, keep_none: bool = False) -> list[float]:
    """``score(texts)`` checked (see `checked_scores`), or for a reward function that sees the row (`takes_the_row`)
    ``score(prompts=..., completions=..., <kept column>=...)`` from ``row``, a None in its output (the reward does not
    apply to that response, TRL's meaning) counted as 0; an exception the scorer raises becomes one line naming where
    (``at``: "PPO step 3", "the ppo policy's samples 1-100"), the scorer (``who``: by default `scorer`'s, e.g.
    "scorer (callable rewards.example:score)"), the exception and where it was raised (``--debug`` shows the
    traceback)."""
    if isinstance(score, Combined):
        return score.score(texts, spec, at, row)
    who = who or scorer_name(spec)
    by_row = row is not None and takes_the_row(score)
    try:
        scores = score(**row_arguments(score, row)) if by_row else score(texts)
    except StageError:
        raise
    except Exception as err:  # the user's function may raise anything
        raise StageError(f"{at}: {who} raised {raised_at(err)}") from err
    except SystemExit as err:  # sys.exit() in a scorer would end the stage without a word
        raise StageError(f"{at}: {who} called sys.exit({err.code!r}){raised_where(err)}; a scorer returns its scores, "
                         "it does not end the process") from err
    checked = checked_scores(scores, len(texts), spec, at, who, allow_none=by_row)
    return checked if keep_none else [0.0 if value is None else value for value in checked]


def scorer_name(spec: ScorerParams) -> str:
    """The scorer in messages: "scorer (reward_model)", "scorer (callable module:function)"."""
    name = f" {spec.name}" if spec.name else ""
    return f"scorer ({spec.source}{name})"


def checked_scores(scores, n: int, spec: ScorerParams, at: str, who: str | None = None,
                   allow_none: bool = False) -> list[float | None]:
    """The scorer's output as n finite floats (and, with ``allow_none``, Nones: a reward that does not apply), or a
    StageError naming where (``at``: "PPO step 3", steps counted from 1 as `step()`'s errors count them), the scorer
    (``who``, see `scored`), the text and the value."""
    where = f"{at}: {who or scorer_name(spec)}"
    try:
        scores = list(scores)
    except TypeError:
        raise StageError(f"{where} returned {type(scores).__name__}, not a list; return one number per text") from None
    if len(scores) != n:
        raise StageError(f"{where} returned {len(scores)} scores for {n} texts; return one number per text")
    out = []
    for i, value in enumerate(scores):
        if value is None and allow_none:
            out.append(None)
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise StageError(f"{where} returned {value!r} ({type(value).__name__}) for text {i}; return a number")
        if not np.isfinite(value):
            raise StageError(f"{where} returned {value} for text {i}; scores must be finite numbers")
        out.append(float(value))
    return out
