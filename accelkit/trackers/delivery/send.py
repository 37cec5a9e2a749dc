"""Handing journal entries to a tracker: one entry with its own method, runs of ``log`` entries
in one ``log_batch`` call where the tracker has one, entries a killed sender left *in doubt*
settled before anything is sent again, and the replay ``accelkit track sync`` runs
(:func:`deliver`). The worker's :class:`~accelkit.trackers.delivery.outbox.Outbox` and
:mod:`~accelkit.trackers.delivery.sync` both send through here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.delivery.journal import Entry, Journal, JournalWarning
from accelkit.trackers.events import CheckpointEvent

__all__ = ["MEMORY", "SEND_BATCH", "batch_length", "call", "deliver", "has_log_batch", "settle"]

MEMORY = 65_536  # undelivered entries kept in memory; beyond, they are read back from disk
# Entries handed to one ``log_batch`` call at most (and the tracker's ``max_batch_values``):
# a catch-up after an outage goes out in requests of this size, each acknowledged on its own.
SEND_BATCH = 200


def call(tracker: GeneralTracker, entry: Entry, live: Any = None) -> None:
    """Hand one journal entry to ``tracker`` (``live``: the values as logged, when the entry
    is being sent by the run that logged it; else the journaled plain values are sent)."""
    if entry.kind == "log":
        kwargs = entry.extra.get("kwargs") or {}
        values = live if live is not None else dict(entry.values)
        tracker.log(values, entry.step, **kwargs)
    elif entry.kind == "config":
        tracker.store_init_configuration(live if live is not None else dict(entry.values))
    else:
        event = live
        if not isinstance(event, CheckpointEvent):
            event = CheckpointEvent.from_journal(entry.step, entry.values, entry.extra)
        tracker.on_checkpoint(event)


def has_log_batch(tracker: GeneralTracker) -> bool:
    """Whether ``tracker`` has a ``log_batch`` of its own (else the worker calls ``log`` once
    per entry, recording each as delivered: the default ``log_batch`` could not say how far it
    got when one of its calls fails)."""
    return type(tracker).log_batch is not GeneralTracker.log_batch


def batch_length(tracker: GeneralTracker, entries: list[Entry]) -> int:
    """How many of ``entries`` (the next to send, in order) go in one ``log_batch`` call:
    the ``log`` entries without keyword arguments at their head, at most ``SEND_BATCH`` and
    the tracker's ``max_batch_values`` values (an entry with more goes alone); ``1`` when
    the first is not such an entry (it is sent with its own method)."""
    limit = tracker.max_batch_values
    total = 0
    count = 0
    for entry in entries:
        if entry.kind != "log" or entry.extra:
            break
        weight = 0
        for value in entry.values.values():
            weight += len(value) if type(value) is dict else 1
        total += weight
        if count and total > limit:
            break
        count += 1
    return max(count, 1)


def settle(tracker: GeneralTracker, journal: Journal, entries: list[Entry]) -> int:
    """Settle the entries a killed sender left *in doubt* (``entries``: those after ``acked``
    up to :attr:`Journal.in_doubt`, in order): returns how many of them the backend has
    already; they are recorded as delivered and not sent again.

    They were sent in order, so the backend holds a first part of them: a tracker that can
    tell defines ``journal_delivered(step, values) -> bool`` (MLflow does), asked about as few
    entries as a bisection needs. For one that cannot, they are sent again, with a warning:
    a killed sender's one entry (or, for a tracker with ``log_batch``, its one batch) may then
    reach the backend twice.
    """
    journal.in_doubt = None
    if not entries:
        return 0
    probe = getattr(tracker, "journal_delivered", None)
    if probe is None:
        what = (
            f"journal entry {entries[0].seq} (step {entries[0].step}) was"
            if len(entries) == 1
            else f"journal entries {entries[0].seq}-{entries[-1].seq} (steps "
            f"{entries[0].step}-{entries[-1].step}) were"
        )
        warnings.warn(
            f"Tracker {tracker.name!r}: {what} being sent when the last sender stopped, and "
            "this tracker cannot tell whether its backend took them (it has no "
            "journal_delivered method); they are sent again and may appear twice.",
            JournalWarning,
            stacklevel=2,
        )
        return 0

    def delivered(entry: Entry) -> bool:
        try:
            return bool(probe(entry.step, dict(entry.values)))
        except Exception:
            return False

    low, high = 0, len(entries)  # the backend has the first `low`, not all past `high`
    while low < high:
        middle = (low + high + 1) // 2
        if delivered(entries[middle - 1]):
            low = middle
        else:
            high = middle - 1
    if low:
        journal.ack(entries[low - 1].seq)
    return low


def deliver(tracker: GeneralTracker, journal: Journal, on_sent: Callable[[Entry], None]) -> int:
    """Send every undelivered entry of ``journal`` to a started ``tracker``, in order
    (in batches to a tracker with ``log_batch``), recording each call's entries as delivered
    right after the tracker accepts them (``accelkit track sync``).

    Returns:
        How many were sent.

    Raises:
        Exception: the tracker's error; the entries before it stay delivered.
    """
    sent = 0
    batched = has_log_batch(tracker)
    while True:
        entries = journal.pending(limit=MEMORY)
        if not entries:
            return sent
        if journal.in_doubt is not None:
            doubt = journal.in_doubt
            settle(tracker, journal, [entry for entry in entries if entry.seq <= doubt])
            continue
        at = 0
        while at < len(entries):
            count = batch_length(tracker, entries[at : at + SEND_BATCH]) if batched else 1
            group = entries[at : at + count]
            journal.sending(group[-1].seq)
            if batched and group[0].kind == "log" and not group[0].extra:
                tracker.log_batch([(dict(e.values), e.step, e.time) for e in group])
            else:
                call(tracker, group[0])
            journal.ack(group[-1].seq)
            at += count
            sent += count
            for entry in group:
                on_sent(entry)
