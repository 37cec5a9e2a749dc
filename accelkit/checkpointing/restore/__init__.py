"""The load sequence: what ``load_state`` checks before anything is restored, and what it says
when it cannot (:mod:`.loading`)."""
