"""The save sequence: the commit protocol every save runs (:mod:`.protocol`), its background
driver (:mod:`.async_save`), what it writes (:mod:`.payload`, :mod:`.snapshot`), the project's
run lock (:mod:`.lock`), deletion (:mod:`.deletion`) and per-process folders
(:mod:`.per_process`)."""
