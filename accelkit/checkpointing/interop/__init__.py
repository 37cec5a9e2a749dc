"""Hugging Face accelerate's checkpoint folders: their pickles read as data
(:mod:`.accelerate_pickle`), the folder read safely (:mod:`.accelerate_format`) and imported as
committed accelkit checkpoints (:mod:`.accelerate_import`); a checkpoint's model exported as
Hugging Face safetensors files (:mod:`.hf_export`)."""
