"""The checkpoints of a project as a list: their states (:mod:`.listing`), which of them to keep
(:mod:`.retention`, pure policy) and the tensors inside one without loading it (:mod:`.inspect`).
"""
