"""The planner: how big a checkpoint is, how often the job fails, how often to save, and what that costs.

One module per question, importing only downward (nothing here imports its siblings in a loop):

* :mod:`~tiersave.planner.architecture`: how many parameters a transformer has; the model presets.
* :mod:`~tiersave.planner.recipes`: how many bytes each parameter costs; the precision recipes.
* :mod:`~tiersave.planner.sizing`: how many bytes a checkpoint and each rank hold, computed or measured.
* :mod:`~tiersave.planner.failures`: how often the job fails; the cluster MTTF.
* :mod:`~tiersave.planner.interval`: how often to save; Young, Daly, goodput, the interval plan.
* :mod:`~tiersave.planner.bandwidth`: what each storage tier must sustain, and the cadence that keeps up.
* :mod:`~tiersave.planner.schedule`: when the training loop saves; the policies a Checkpointer asks.

The planner imports only the standard library, :mod:`tiersave.errors` and :mod:`tiersave.units`: no torch,
no storage, no engine, so ``tiersave plan`` runs and starts fast on any machine.
"""
