"""Where the model lets a watcher in, without knowing who watches.

The decoder loop calls the installed hooks at each layer's start and end and once the layers are done;
inside a layer, each row-parallel projection (attention output, MLP down) calls them with its partial sum
and its all-reduced output.
The worker installs what it needs (layer tracking and layer breakpoints, activation capture for
`devharness check`, planted faults); the model imports nothing of theirs. With nothing installed a
call site pays a loop over an empty tuple.
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

    def partial_sum(self, site: str, x: torch.Tensor, weight: torch.Tensor, partial: torch.Tensor) -> None:
        """A row-parallel projection (`site`: "attention" or "mlp") computed this rank's partial sum
        `partial` = x @ weight.T from its input columns; the TP all-reduce follows (it sums in place)."""

    def sublayer_output(self, site: str, output: torch.Tensor) -> None:
        """That projection's output after the all-reduce (and bias): the attention's or the MLP's output. A hook
        may change it in place (a planted fault does)."""


# The overridden methods of the installed hooks, in install order: the model loops over these.
layer_start: tuple = ()
layer_end: tuple = ()
layers_done: tuple = ()
partial_sum: tuple = ()
sublayer_output: tuple = ()
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
    global layer_start, layer_end, layers_done, partial_sum, sublayer_output

    def overridden(name: str) -> tuple:
        return tuple(getattr(h, name) for h in _installed
                     if getattr(type(h), name) is not getattr(ModelHooks, name))

    layer_start, layer_end, layers_done = overridden("layer_start"), overridden("layer_end"), overridden("layers_done")
    partial_sum, sublayer_output = overridden("partial_sum"), overridden("sublayer_output")
