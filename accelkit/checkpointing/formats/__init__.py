"""File formats: what the files of a checkpoint are called and what they hold.

Each module reads and writes one kind of file through a
:class:`~accelkit.checkpointing.storage.Storage`; none knows the commit protocol, manifests or
locks (those are the layer above: :mod:`accelkit.checkpointing`). Imports go to
:mod:`accelkit.checkpointing.storage`, to :mod:`accelkit.checkpointing.errors` and within this
package only. The module list: :mod:`accelkit.checkpointing`'s docstring.
"""
