"""The load sequence (:mod:`.sequence`): the phases every ``load_state`` runs, what is checked
before anything is restored and what is said when it cannot be (:mod:`.loading`), and the reader
of accelkit's own checkpoints (:mod:`.native`)."""
