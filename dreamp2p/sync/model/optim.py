"""The sync object as a ``torch.optim.Optimizer``: LR schedulers and ``GradScaler`` act on it as on any optimizer.

PyTorch code that drives an optimizer expects an ``Optimizer`` instance: every LR scheduler checks
``isinstance(optimizer, torch.optim.Optimizer)`` and then reads and writes ``optimizer.param_groups``;
``torch.amp.GradScaler.step(opt)`` looks for inf/NaN in the gradients of ``opt.param_groups`` and calls
``opt.step()``. :class:`OptimizerFacade` is that view of a strategy (every
:class:`~dreamp2p.sync.strategies.base.Strategy` derives from it) over the user's own ("inner") optimizer:

- ``param_groups``, ``state`` and ``defaults`` *are* the inner optimizer's objects, not copies: a scheduler
  that sets ``group["lr"]`` changes the learning rate the inner optimizer applies at its next step.
  ``Optimizer.__init__`` is never called: the facade owns no parameters or state of its own.
- ``step()`` is the strategy's step (it runs every synchronization round of the step), and
  ``zero_grad``/``state_dict``/``load_state_dict`` are the strategy's (its checkpoint holds the inner
  optimizer's state).

Mixed precision: the facade sets ``_step_supports_amp_scaling``. An ordinary optimizer under
``GradScaler.step`` is *not called at all* on a step whose gradients hold inf/NaN. For a strategy that
would be wrong: its step is where the rounds of that step are launched and landed, and rounds meet by
(group, round id = step + 1) across members, so a member that skipped it alone would run one step behind
the others and its rounds would never match theirs again. With the flag set, ``GradScaler`` always calls
``step()`` and hands over ``grad_scale`` (the scale still in the gradients, None once ``unscale_`` ran)
and ``found_inf`` as attributes of the optimizer (torch/amp/grad_scaler.py). The step then unscales the
gradients itself and, on overflow, skips only the *inner* optimizer's update (:meth:`_inner_step`) while
the step count, the rounds and the buffers advance exactly as on every other member. S-SGD averages
gradients before its update; there an overflowing member's non-finite gradients are refused by the
contribution guard (it sends zeros marked excluded), every member gets the others' mean and applies the
same update, and if every member overflowed the round fails everywhere and every member skips it.
``GradScaler.update()`` then lowers this member's scale as usual; scales may differ between members,
which is harmless since gradients are unscaled before anything is averaged.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch

log = logging.getLogger(__name__)


class OptimizerFacade(torch.optim.Optimizer):
    """An ``Optimizer`` in type and in the attributes schedulers and ``GradScaler`` use; see the module docstring.

    Subclasses set ``self.optimizer`` (the inner optimizer) and call :meth:`_take_amp` at the start and
    :meth:`_inner_step` in place of ``self.optimizer.step()`` during their step.
    """

    # GradScaler.step calls step() even on an overflow and passes grad_scale/found_inf (module docstring)
    _step_supports_amp_scaling = True
    optimizer: torch.optim.Optimizer
    # whether this step's gradients overflowed under GradScaler (set by _take_amp, read by _inner_step)
    _overflow = False
    amp_steps_skipped = 0

    # the inner optimizer's objects themselves, so that schedulers change what the inner step uses
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        return self.optimizer.state

    @state.setter
    def state(self, state: defaultdict[torch.Tensor, Any]) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "a strategy syncs the parameters it was attached with; add the group to the optimizer before attach"
        )

    def register_step_pre_hook(self, hook: Any) -> Any:
        """A hook on the inner optimizer's step (skipped with it on an overflow)."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        """A hook on the inner optimizer's step (skipped with it on an overflow)."""
        return self.optimizer.register_step_post_hook(hook)

    def __getstate__(self) -> dict[str, Any]:  # Optimizer's keeps only defaults/state/param_groups
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        inner = self.__dict__.get("optimizer")
        return f"{type(self).__name__}(step={self.__dict__.get('step_count')}, optimizer={type(inner).__name__})"

    # ------------------------------------------------------------------ mixed precision

    def _take_amp(self) -> None:
        """Read what ``GradScaler.step`` handed over: unscale the gradients, note an overflow (module docstring)."""
        found = self.__dict__.get("found_inf")
        self._overflow = False
        if found is None:
            return  # not called by a GradScaler (or one that is disabled): plain fp32 gradients
        scale = self.__dict__.get("grad_scale")
        if scale is not None:  # the gradients still carry the loss scale: take it out before anything else
            inv = scale.double().reciprocal().float()
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inv.to(p.grad.device))
        self._overflow = bool(found.item() > 0)

    def _inner_step(self) -> None:
        """The inner optimizer's update from this member's own gradients; skipped on an AMP overflow."""
        if self._overflow:
            self.amp_steps_skipped += 1
            step = self.__dict__.get("step_count")
            log.info("step %s: gradients overflowed under GradScaler; local update skipped", step)
            return
        self.optimizer.step()
