"""What a checkpoint captures from the live training objects and restores into them: the
model, optimizer, scheduler, dataloader and registered states (:mod:`.contents`), the random
generator states (:mod:`.rng`) and the resume fingerprint (:mod:`.fingerprint`). Used by both
the commit and the restore layers."""
