"""Where the model lets a watcher in, without knowing who watches.

The decoder loop calls the installed hooks at each layer's start and end and once the layers are done;
inside a layer, each row-parallel projection (attention output, MLP down) calls them with its partial sum
and its all-reduced output.
Each model holds its own HookSet; the worker installs on its own model what it needs (layer tracking and
layer breakpoints, activation capture for `devharness check`, planted faults); the model imports nothing of
theirs, and nothing here is process-wide. With nothing installed a call site pays a loop over an empty tuple.
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

    def partial_output(self, site: str, partial: torch.Tensor) -> None:
        """The same partial sum, for a watcher that needs no weight (a weight kept in GGUF's blocks is not
        dequantized for it); a hook may change it in place (a planted fault does)."""

    def sublayer_output(self, site: str, output: torch.Tensor) -> None:
        """That projection's output after the all-reduce (and bias): the attention's or the MLP's output. A hook
        may change it in place (a planted fault does)."""


class HookSet:
    """The hooks installed on one model (DecoderForCausalLM.hooks): each site's overridden methods, in install
    order, as tuples the model loops over. Each model holds its own, so two engines in one process never see
    each other's watchers."""

    __slots__ = ("layer_start", "layer_end", "layers_done", "partial_sum", "partial_output", "sublayer_output",
                 "installed")

    def __init__(self) -> None:
        self.installed: list[ModelHooks] = []
        self._rebuild()

    def install(self, hooks: ModelHooks, first: bool = False) -> ModelHooks:
        """Call `hooks` from every forward from now on (once, however often installed), after those installed before
        (`first`: before them, as a planted fault must come before the watchers that look for it); returns it."""
        if hooks not in self.installed:
            self.installed.insert(0 if first else len(self.installed), hooks)
            self._rebuild()
        return hooks

    def remove(self, hooks: ModelHooks) -> None:
        if hooks in self.installed:
            self.installed.remove(hooks)
            self._rebuild()

    def _rebuild(self) -> None:
        def overridden(name: str) -> tuple:
            return tuple(getattr(h, name) for h in self.installed
                         if getattr(type(h), name) is not getattr(ModelHooks, name))

        self.layer_start, self.layer_end = overridden("layer_start"), overridden("layer_end")
        self.layers_done, self.partial_sum = overridden("layers_done"), overridden("partial_sum")
        self.partial_output = overridden("partial_output")
        self.sublayer_output = overridden("sublayer_output")
