"""A runner's side of a weight update (`models.weight_update`): check it, then apply it or drop
it. Two calls, so that under tensor or pipeline parallelism every rank checks its own slices
before any rank changes a value (`DistributedRunner.stage_weights`)."""

from __future__ import annotations

from torch import nn

from ksana_llm.models.weight_update import WeightUpdate, apply_update, check_update


class WeightSync:
    """Mixed into `ModelRunner`, which provides `model` and the sleep mode's `asleep` and
    `weights_loaded` (`runner.sleep_mode`)."""

    model: nn.Module
    asleep: tuple[str, ...]
    _staged_weights: tuple[WeightUpdate, frozenset[str]] | None = None

    def stage_weights(self, update: WeightUpdate) -> int:
        """Check `update` against this rank's module (ValueError if a tensor has no place or the
        wrong shape; nothing changes) and keep it for `commit_weights`; its tensor count."""
        self._staged_weights = None
        if "weights" in self.asleep:
            raise ValueError("weights: the weights are asleep; wake them first "
                             "(wake_up(tags=['weights']))")
        checked = check_update(self.model, update)
        self._staged_weights = (update, checked.filled)
        return checked.num_tensors

    def commit_weights(self, apply: bool) -> None:
        """Copy the staged update into the weights (`apply`), or forget it."""
        staged, self._staged_weights = self._staged_weights, None
        if apply and staged is not None:
            update, filled = staged
            apply_update(self.model, update)
            self.weights_loaded(filled)  # type: ignore[attr-defined] - SleepMode's
            self.weights_changed()  # type: ignore[attr-defined] - KvTransferSteps'
