"""The built-in tracker backends, one module per service; none is imported until a run asks.

- :mod:`~accelkit.trackers.backends.jsonl` -- ``JSONLTracker`` (no dependency) and ``read_jsonl``;
- :mod:`~accelkit.trackers.backends.tensorboard` -- ``TensorBoardTracker``;
- :mod:`~accelkit.trackers.backends.wandb` -- ``WandBTracker``;
- :mod:`~accelkit.trackers.backends.comet_ml` -- ``CometMLTracker``;
- :mod:`~accelkit.trackers.backends.mlflow` -- ``MLflowTracker``;
- :mod:`~accelkit.trackers.backends.trackio` -- ``TrackioTracker``;
- :mod:`~accelkit.trackers.backends.swanlab` -- ``SwanLabTracker``;
- :mod:`~accelkit.trackers.backends.clearml` -- ``ClearMLTracker``;
- :mod:`~accelkit.trackers.backends.dvclive` -- ``DVCLiveTracker``;
- :mod:`~accelkit.trackers.backends.aim` -- ``AimTracker``.

Each imports its SDK when its run starts, never at import time. Beside them: ``_files`` (the
local files a tracker writes, never followed nor blocked on; the journal uses it too),
``_reference`` (the check a hosted tracker runs on a checkpoint's run reference), ``_images``
(images as HWC ``uint8`` arrays, for trackio, SwanLab, ClearML, DVCLive and Aim), and
``_mlflow_runs`` (which run MLflow continues when a job resumes: run keys, references, finding
and reopening the run). A backend imports only ``trackers.base``, ``trackers.events``,
``trackers.values`` and these private helpers; the registry
(:mod:`accelkit.trackers.registry`) names them by module path.
"""
