"""Typed params: one frozen dataclass per section of params.yaml, loaded strictly (`load_params`).

The sections are in stages/shared/param_sections.py, where each field is documented once and which params.yaml
mirrors key for key; the whole file is `Params` (stages/shared/typed_params.py); their checks beyond types are in
stages/shared/checks.py. Every name of the first two imports from here too. Loading rejects unknown keys, missing
keys, wrong types and out-of-range values with one line naming the file and the key, worded as PPOConfig words its
own problems (one checker, `ppo_core.fields`). Float fields also take numeric strings ("2e-05"): `dvc exp run -S`
writes small floats that way. The file is read as YAML 1.2 (ruamel.yaml), so `2e-05` is a float and `yes` is a
string.

The `ppo` section is ppo_core's `PPOConfig`, field for field but for the fields it derives (refused here): loading
builds it once (`Params.ppo_config`), and PPOConfig checks the names, types and ranges (its defaults fill keys left
out). Every stage loads the params, so a typo there stops `dvc repro` at its first stage.
"""

from __future__ import annotations

from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from ppo_core.fields import ConfigError, check_keys, checked
from stages.shared.checks import check_group_sampling, check_values

# the sections and Params, importable from here as before they had modules of their own
from stages.shared.param_sections import (  # noqa: F401
    COLUMNS,
    MIN_TEXTS_FROM_SCRATCH,
    SYNTHETIC,
    AlertParams,
    ChatParams,
    CheckpointParams,
    DataParams,
    DatasetSpec,
    EvaluateParams,
    GenerationParams,
    LoraParams,
    ModelParams,
    NumericsParams,
    RewardParams,
    ScorerParams,
    SFTParams,
    TokenizeParams,
    WatchParams,
)
from stages.shared.runtime import ParamsError
from stages.shared.typed_params import SECTIONS, Params


def load_params(path: str | Path) -> Params:
    """Read and check a params file; raise ParamsError naming the file and key on any problem."""
    path = Path(path)
    try:
        raw = YAML(typ="safe", pure=True).load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found; pass --params PATH or run from the project root") from None
    except IsADirectoryError:
        raise ParamsError(f"{path}: is a directory; pass --params the params file (YAML), e.g. params.yaml") from None
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise ParamsError(f"{path}:{line}: not UTF-8 text (byte 0x{err.object[err.start]:02x}); save it as "
                          "UTF-8") from None
    except YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)})")
    try:
        check_keys(raw, SECTIONS, required=True)
        params = Params(path=path, **{name: checked(raw[name], tp, name) for name, tp in SECTIONS.items()})
        check_values(params)
    except ConfigError as err:
        hint = ""
        if err.key == "scorer.source" and ":" in str(raw.get("scorer", {}).get("source", "")):
            hint = "; a function goes in scorer.name ('module:function') with scorer.source: callable"
        raise ParamsError(f"{path}: {err.message('')}{hint}") from None
    check_group_sampling(params, params.ppo_config)  # every stage checks the ppo section: a typo fails at once
    return params
