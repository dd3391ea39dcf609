"""Several CUDA devices on a machine without one, for the device logic of a model split across GPUs (``device_map``).

Within :class:`FakeDevices` every tensor may carry a device label (``cuda:0``, ``cuda:1``, ...): ``tensor.device``
reports it, an op on tensors of two labels raises as torch does for two devices, ``.to(device)`` relabels, and a
factory function given a device (``torch.arange(..., device=...)``) creates on the CPU and labels. A module of the
device map has its parameters labelled and moves its inputs to its device first, as accelerate's hooks do for
``device_map="auto"``. An unlabelled tensor (a constant made on the CPU) goes with any device. The numbers are the
CPU's, so a run under it can be compared with a plain one bit for bit.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_DEVICE_GETTER = torch.Tensor.device.__get__
_MOVES = {"to", "cuda", "cpu"}


def _label(t):
    return getattr(t, "_fake_device", None)


def _set_label(tree, device):
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            t._fake_device = torch.device(device)
    return tree


def _move(name: str, args, kwargs):
    """A ``.to``/``.cuda``/``.cpu`` call: ``(the device it asks for or None, the CPU tensor it gives)``."""
    tensor, rest, kwargs = args[0], list(args[1:]), dict(kwargs)
    if name == "cpu":
        return torch.device("cpu"), tensor.cpu(**kwargs)
    if name == "cuda":
        index = rest[0] if rest else kwargs.pop("device", None)
        return torch.device("cuda", 0 if index is None else torch.device("cuda", index).index), tensor
    device = kwargs.pop("device", None)
    for i, arg in enumerate(rest):
        if isinstance(arg, (torch.device, str)):
            device, rest[i] = arg, None
        elif isinstance(arg, torch.Tensor):  # .to(other): its device and dtype
            device, rest[i] = (_label(arg) or arg.device), arg.dtype
    return (torch.device(device) if device is not None else None), tensor.to(*[a for a in rest if a is not None],
                                                                                **kwargs)


class FakeDevices(TorchFunctionMode):
    """``device_map``: module name (in ``model``) -> device name, e.g. ``{"pretrained_model.transformer.h.1":
    "cuda:1"}``, the modules accelerate dispatches (their inputs are moved to their device); ``placed``: modules
    whose parameters are on a device without such a hook (e.g. moved there with ``.to``). Every parameter takes the
    device of the longest prefix of its name in either."""

    def __init__(self, model: torch.nn.Module, device_map: dict[str, str], placed: dict[str, str] | None = None):
        super().__init__()
        modules, everywhere = dict(model.named_modules()), device_map | (placed or {})
        for name, param in model.named_parameters():
            owner = max((m for m in everywhere if name.startswith(m + ".")), key=len)
            _set_label(param, everywhere[owner])
        self._hooks = [modules[name].register_forward_pre_hook(self._mover(device), with_kwargs=True)
                       for name, device in device_map.items()]

    @staticmethod
    def _mover(device):
        def move(module, args, kwargs):
            to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
            return tree_map(to, args), tree_map(to, kwargs)
        return move

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    @staticmethod
    def place(tree, device: str):
        """Label every tensor of ``tree`` (e.g. a batch of inputs) as on ``device``; returns ``tree``."""
        return _set_label(tree, device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            return _label(args[0]) or func(*args)
        name = getattr(func, "__name__", "")
        if name in _MOVES and args and isinstance(args[0], torch.Tensor):
            device, out = _move(name, args, kwargs)
            if device is None or _label(args[0]) == device:
                return out
            return _set_label(out.view_as(out) if out is args[0] else out, device)  # a new tensor object: the copy
        if kwargs.get("device") is not None:  # a factory function: made on the CPU, labelled
            device = kwargs["device"]
            return _set_label(func(*args, **{k: v for k, v in kwargs.items() if k != "device"}), device)
        labels = {_label(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)} - {None}
        if len(labels) > 1:
            first, second = sorted(labels, key=str)[:2]
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{first} and {second}! ({name})")
        out = func(*args, **kwargs)
        return _set_label(out, labels.pop()) if labels else out
