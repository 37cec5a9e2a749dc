"""The process runtime: launch settings from the environment (:mod:`.environment`), this
process's identity, device and process group (:mod:`.state`), collectives (:mod:`.ops`),
seeding (:mod:`.random`) and how inputs are split between processes (:mod:`.splitting`).

The lowest room of accelkit: it imports no other room.
"""
