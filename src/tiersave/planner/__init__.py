"""The planner: how big a checkpoint is, how often to save it, and what bandwidth that takes.

Modules:
    sizing: checkpoint bytes from a model description, a precision recipe and a parallel layout.
    schedule: the failure model, Young/Daly intervals, bandwidth needs and the runtime schedules.

The planner imports only the standard library, :mod:`tiersave.errors` and :mod:`tiersave.units`: no torch,
no storage, no engine, so ``tiersave plan`` runs on any machine.
"""
