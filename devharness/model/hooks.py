"""Where the model lets a watcher in, without knowing who watches.

The decoder loop calls the installed hooks at each layer's start and end and once the layers are done.
The worker installs what it needs (layer tracking and layer breakpoints, activation capture for
`devharness check`, planted faults); the model imports nothing of theirs. With nothing installed a
layer pays a loop over an empty tuple.
"""
from __future__ import annotations

import torch


class ModelHooks:
    """Override what you need; called in the step's thread, in layer order."""

    def layer_start(self, layer: int) -> None:
        """Before decoder layer `layer` (its global index) runs."""

    def layer_end(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """After it ran: its output and the residual stream beside it (their sum is the stream)."""

    def layers_done(self) -> None:
        """After this stage's last layer."""


# The overridden methods of the installed hooks, in install order: the model loops over these.
layer_start: tuple = ()
layer_end: tuple = ()
layers_done: tuple = ()
_installed: list[ModelHooks] = []


def install(hooks: ModelHooks) -> ModelHooks:
    """Call `hooks` from every forward from now on (once, however often installed); returns it."""
    if hooks not in _installed:
        _installed.append(hooks)
        _rebuild()
    return hooks


def remove(hooks: ModelHooks) -> None:
    if hooks in _installed:
        _installed.remove(hooks)
        _rebuild()


def _rebuild() -> None:
    global layer_start, layer_end, layers_done

    def overridden(name: str) -> tuple:
        return tuple(getattr(h, name) for h in _installed
                     if getattr(type(h), name) is not getattr(ModelHooks, name))

    layer_start, layer_end, layers_done = overridden("layer_start"), overridden("layer_end"), overridden("layers_done")
