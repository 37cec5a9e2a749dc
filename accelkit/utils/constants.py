"""The file names of Accelerate's checkpoints (``accelerate.utils`` constants), with its values.

They name the files *Accelerate* writes (``pytorch_model.bin``, ``optimizer.bin``,
``random_states_0.pkl``...), for scripts that look for them, e.g. to read a checkpoint that
Accelerate saved. accelkit's own checkpoints use other names (tensors in ``.safetensors`` files,
structure in ``.json`` files, a manifest ``accelkit.json``; see
:mod:`accelkit.checkpointing.formats.layout`): only the model's file and index,
``model.safetensors`` (:data:`SAFE_WEIGHTS_NAME`) and ``model.safetensors.index.json``
(:data:`SAFE_WEIGHTS_INDEX_NAME`), are the same in both.
"""

from __future__ import annotations

__all__ = [
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
]

SCALER_NAME = "scaler.pt"
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
RNG_STATE_NAME = "random_states"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
