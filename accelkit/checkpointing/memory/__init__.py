"""The memory tier: snapshots of the whole training state in the job's shared memory, restored
by a restarted group in seconds (``ProjectConfiguration.memory``; see
``docs/guides/memory-tier.md``).

:mod:`.options` holds the settings (:class:`~.options.MemoryOptions`), :mod:`.tier` the tier
composed with the checkpoint manager (:class:`~.tier.MemoryTier`: where the snapshots live,
their rotation, and the resolve of ``load_state()`` without a folder), :mod:`.peer` the copies
each process keeps of a peer's snapshots (:class:`~.peer.PeerCopies`), :mod:`.promote` the
commit of a failed job's newest snapshots to disk, which ``accelkit launch`` runs before the
job's memory goes (:func:`~.promote.promote_snapshots`). The snapshots
themselves are taken by the ``Accelerator``'s memory part
(:mod:`accelkit._accelerator.memory`) at the step boundaries.
"""
