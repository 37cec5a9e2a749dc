"""Hugging Face accelerate's checkpoint folders: read safely (:mod:`.accelerate_format`) and
imported as committed accelkit checkpoints (:mod:`.accelerate_import`)."""
