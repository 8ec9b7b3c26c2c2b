"""`Engine.update_weights`: new weights for the served model while it serves (an RL trainer's
weight sync after each training step; SGLang's `update_weights_from_disk` / `_from_tensor`,
vLLM's `model.load_weights` through `collective_rpc`)."""

from __future__ import annotations

from typing import Any

from ksana_llm.api.engine_thread import EngineThreadWork
from ksana_llm.models.weight_update import weight_update


class WeightControl(EngineThreadWork):
    """Mixed into `Engine`, which provides `model`, `_core`, `_requests`, `_on_engine_thread`
    and `_dispatch_step`."""

    model: Any

    def update_weights(self, weights: Any) -> int:
        """Replace the model's weights, in place, between two steps; the number of tensors
        loaded.

        `weights`: a checkpoint folder of the same model type (safetensors or .bin, quantized
        as the served model is or not), a GGUF file (or a folder holding one), or tensors under
        their checkpoint (Hugging Face) names: a state dict or (name, tensor) pairs, in any
        dtype and on any device. A subset updates those tensors only, so a trainer may send its
        weights in several calls.

        Every tensor is checked first (each name must have a place, each shape must fit, on
        every tensor-parallel rank): a ValueError naming the first that does not, and no weight
        changes. Then the tensors are copied in and the prefix cache is emptied (its KV came
        from the old weights). Requests running meanwhile go on with the new weights from their
        next token on; their KV so far stays as the old weights made it. A ValueError while
        another running engine serves the same `Model`: its steps would read weights half
        copied, and its prefix cache the old weights' KV."""
        self.model.check_sole_engine(self, "update_weights")
        update = weight_update(weights, self.model.path, self.model.hf_config)

        def swap() -> int:
            # The step in flight (async scheduling) still reads the old weights: settle it first.
            self._dispatch_step(self._core.settle())
            runner = self._core.runner
            try:
                count = runner.stage_weights(update)
            except ValueError:
                raise
            except Exception as exc:
                raise RuntimeError(f"the weight update could not be checked ({type(exc).__name__}"
                                   f": {exc}); no weight changed") from exc
            try:
                runner.commit_weights(True)
            except Exception as exc:
                raise RuntimeError("the weight update failed while its tensors were copied in "
                                   f"({type(exc).__name__}: {exc}): the model may hold a mix of "
                                   "old and new weights; update them all again") from exc
            finally:
                self._core.block_manager.reset_prefix_cache()
                if self._requests.kv_layout is not None:
                    # Imported KV must now come from these weights (the new fingerprint).
                    self._requests.kv_layout = runner.kv_layout
            return count

        return self._on_engine_thread(swap)
