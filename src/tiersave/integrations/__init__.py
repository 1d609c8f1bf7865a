"""Trainer integrations: tiersave behind the trainers people already use.

- :mod:`tiersave.integrations.hf`: ``TiersaveTrainer``, a Hugging Face ``transformers.Trainer`` that saves
  and resumes its full state through a :class:`tiersave.Checkpointer` (``pip install 'tiersave[hf]'``).
- :mod:`tiersave.integrations.lightning`: ``TiersaveCheckpointIO``, a Lightning ``CheckpointIO`` plugin
  (``pip install 'tiersave[lightning]'``).

Each submodule imports its trainer library; importing this package imports neither.
"""
