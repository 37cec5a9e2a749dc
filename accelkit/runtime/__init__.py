"""The process runtime: launch settings from the environment (:mod:`.environment`), this
process's identity, device and process group (:mod:`.state`), collectives (:mod:`.ops`),
seeding (:mod:`.random`), how inputs are split between processes (:mod:`.splitting`),
preemption: signal flags and the agreement every process reaches at step boundaries
(:mod:`.preemption`), save decisions: the save policies and their decider (:mod:`.saving`), and
leaving a distributed run at exit (:mod:`.teardown`).

The lowest room of accelkit: it imports no other room.
"""
