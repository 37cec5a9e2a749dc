"""Getting values from ``log()`` to the backends: the hub, its workers and the journal.

- :mod:`~accelkit.trackers.delivery.hub` -- ``TrackerHub``: one ``log()`` fanned out to every
  tracker, the trackers' lifecycle (``init``, ``flush``, ``finish``, exit, pickling);
- :mod:`~accelkit.trackers.delivery.roster` -- ``Roster``: the hub's workers, which of them
  ``log()`` feeds, and when each tracker's run opens (at ``init``, or deferred to its first use);
- :mod:`~accelkit.trackers.delivery.runs` -- ``RunPlan``: the run key, the step counter, the
  runs a loaded checkpoint continues, the references a checkpoint records;
- :mod:`~accelkit.trackers.delivery.waits` -- the hub's bounded waits (a run's opening, a
  flush, the end of the run) and what a late worker costs;
- :mod:`~accelkit.trackers.delivery.worker` -- ``Worker``: one tracker's queue and the thread
  that empties it;
- :mod:`~accelkit.trackers.delivery.items` -- the typed items that queue holds;
- :mod:`~accelkit.trackers.delivery.session` -- ``TrackerSession``: one tracker's calls, its
  ``start()`` (retried with backoff) and its state (started, failed, busy);
- :mod:`~accelkit.trackers.delivery.outbox` -- ``Outbox``: journaled delivery (each value
  written to the journal before the backend sees it, acknowledged after, retried with
  backoff, drained at the end of the run) and the run's opening around it;
- :mod:`~accelkit.trackers.delivery.send` -- handing journal entries to a tracker (in
  batches where it can), settling entries in doubt, the replay ``accelkit track sync`` runs;
- :mod:`~accelkit.trackers.delivery.journal` -- ``Journal``: the durable record per tracker,
  and ``AckRecord``, its acknowledgement file;
- :mod:`~accelkit.trackers.delivery.failures` -- ``FailurePolicy``, ``classify``,
  ``retry_policy``: what a failure, a hang or an outage costs, and when to try again (the
  classifier, the backoff and the drain's deadline are :mod:`accelkit.delivery`'s, shared with
  checkpoint storage and replication);
- :mod:`~accelkit.trackers.delivery.sync` -- ``accelkit track status`` and ``sync``.

Delivery stands on the registry and the tracker interface, never on a backend's module (the
file primitives of ``backends/_files`` aside).
"""
