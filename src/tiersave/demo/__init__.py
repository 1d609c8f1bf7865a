"""The demo: train a small GPT on the CPU with checkpoints, SIGKILL it, resume, compare bit for bit.

``tiersave demo`` runs :func:`tiersave.demo.run.main`. The training worker is
``python -m tiersave.demo.train``; it prints one JSON event per line so the orchestrator can follow it.
"""
