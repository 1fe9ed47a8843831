r"""Activation monitoring: the largest absolute activation $\max_i \lvert a_i\rvert$ each block
outputs ($a$ its output's entries), collected with forward hooks (Newhouse et al. 2025,
arXiv:2507.13338 reports max activations $\approx 100$ for Lipschitz transformers against very
large ones for unconstrained baselines; small maxima are what makes fp8 inference possible).

Cost: one ``abs().amax()`` reduction per monitored module per forward, kept on the
device as a scalar tensor in the output's own dtype (promoted across a module's outputs,
as ``torch.maximum`` does; no host synchronisation until :meth:`summary`). Values are
exact in any dtype: a max involves no rounding, and neither does widening a bf16, fp16 or
fp32 maximum to the Python float of :meth:`summary` (a cast to fp32 on the way would round
a float64 model's maxima, and overflow those beyond $3.4\times10^{38}$ to ``inf``); bf16
outputs under autocast are reported as they are.

Usage:

```python
with ActivationMonitor(model) as monitor:
    model(batch)
monitor.summary()   # {"h.0": 3.1, "h.1": 4.7, "max": 4.7}
```
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping

import torch
import torch.nn as nn

__all__ = ["ActivationMonitor", "default_blocks", "nan_max"]


def nan_max(values: Iterable[float]) -> float:
    """The largest of ``values``, NaN if any is NaN (Python's ``max`` keeps whichever of a
    NaN and a number comes first, so a metric could hide the NaN it is there to show);
    ``-inf`` for none."""
    return max(values, key=lambda v: (v != v, v), default=-math.inf)


def default_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The modules monitored by default: every element of every outermost ``nn.ModuleList`` (a
    transformer's blocks, e.g. ``h.0``, ``h.1``); a model without any gets its leaf modules.

    A ``ModuleList`` inside a block (a mixture of experts' ``h.0.mlp.experts``) is part of that
    block: its elements had been monitored as blocks too, so ``"max"`` reported an expert's
    output (before gating, on the tokens routed to it) as a block output."""
    blocks: dict[str, nn.Module] = {}
    for name, module in model.named_modules():  # pre-order: an outer list comes before what it holds
        inside_a_block = any(name.startswith(block + ".") for block in blocks)
        if isinstance(module, nn.ModuleList) and not inside_a_block:
            blocks.update({f"{name}.{index}" if name else str(index): child for index, child in enumerate(module)})
    if blocks:
        return blocks
    return {
        name: module
        for name, module in model.named_modules()
        if name and next(module.children(), None) is None
    }


def _tensors(output) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, Mapping):
        for value in output.values():
            yield from _tensors(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _tensors(value)


class ActivationMonitor:
    """Records ``max |output|`` of chosen modules over every forward pass while attached.

    Args:
        model: the module tree.
        modules: ``None`` (:func:`default_blocks`), an iterable of submodule names, a
            ``{name: module}`` mapping, or a predicate ``(name, module) -> bool`` over
            ``model.named_modules()``.

    Attach with ``with`` (hooks removed on exit) or :meth:`attach` / :meth:`remove`.
    :meth:`reset` clears the maxima; :meth:`summary` returns ``{name: max, ..., "max":
    overall}`` as Python floats (``nan`` if a module produced a NaN; names with no forward
    yet are absent).
    """

    def __init__(
        self,
        model: nn.Module,
        modules: None | Iterable[str] | Mapping[str, nn.Module] | Callable[[str, nn.Module], bool] = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"ActivationMonitor: model must be an nn.Module, got {type(model).__name__}")
        self.modules = self._select(model, modules)
        if not self.modules:
            raise ValueError("ActivationMonitor: no module selected to monitor")
        self._maxima: dict[str, torch.Tensor] = {}
        self._handles: list = []

    @staticmethod
    def _select(model, modules) -> dict[str, nn.Module]:
        if modules is None:
            return default_blocks(model)
        if isinstance(modules, Mapping):
            return dict(modules)
        named = dict(model.named_modules())
        if callable(modules):
            return {name: module for name, module in named.items() if modules(name, module)}
        # a lone name is one name, not its letters; any other iterable is read once (a generator
        # of names had been used up by the check below, leaving nothing selected)
        modules = [modules] if isinstance(modules, str) else list(modules)
        unknown = [name for name in modules if name not in named]
        if unknown:
            raise ValueError(
                f"ActivationMonitor: no submodule named {unknown}; names come from "
                "model.named_modules()"
            )
        return {name: named[name] for name in modules}

    def _hook(self, name: str):
        def record(module, inputs, output):
            for tensor in _tensors(output):
                if tensor.numel() == 0 or not tensor.is_floating_point():
                    continue
                peak = tensor.detach().abs().amax()
                previous = self._maxima.get(name)
                # torch.maximum propagates NaN, so a NaN activation stays visible.
                self._maxima[name] = peak if previous is None else torch.maximum(previous, peak)

        return record

    def attach(self) -> "ActivationMonitor":
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules.items()]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        self._maxima = {}

    def summary(self) -> dict[str, float]:
        result = {name: self._maxima[name].item() for name in self.modules if name in self._maxima}
        if result:
            result["max"] = nan_max(result.values())
        return result

    def __enter__(self) -> "ActivationMonitor":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.remove()
