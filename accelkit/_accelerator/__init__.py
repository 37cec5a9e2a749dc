"""The parts of the :class:`~accelkit.Accelerator` facade: the process part
(:mod:`.processes`), the training part (:mod:`.training`), the checkpointing part
(:mod:`.checkpointing`), the read-only settings scripts read (:mod:`.settings`), the typed
registry of prepared objects (:mod:`.prepared_objects`), how the facade forwards a method
(:mod:`.delegation`), the link between checkpoints and trackers (:mod:`.experiment`), the
checks made at construction (:mod:`.preflight`) and save decisions and preemption
(:mod:`.preemption`).

Nothing outside :mod:`accelkit.accelerator` imports these.
"""
