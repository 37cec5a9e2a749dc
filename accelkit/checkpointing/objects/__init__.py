"""What a checkpoint captures from the live training objects and restores into them: the
model, optimizer, scheduler, dataloader and registered states (:mod:`.contents`) and the
random generator states (:mod:`.rng`). Used by both the commit and the restore layers."""
