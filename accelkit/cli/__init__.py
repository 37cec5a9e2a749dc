"""The ``accelkit`` command line: ``launch``, ``env`` and ``ckpt``."""
