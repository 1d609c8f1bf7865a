"""Shared by the examples: a small classifier and a generated data set, so each example runs on a CPU in seconds
with nothing to download. Not an example itself."""

from __future__ import annotations

import torch


class Classifier(torch.nn.Module):
    """An encoder (the part a new task reuses) and a head (the part it replaces)."""

    def __init__(self, classes: int = 10, features: int = 32, width: int = 64) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(features, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU()
        )
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def dataset(n: int, classes: int = 10, features: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Points around one centre per class: learnable in a few hundred steps."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(1234)) * 2
    labels = torch.randint(0, classes, (n,), generator=g)
    return centres[labels] + 2 * torch.randn(n, features, generator=g), labels


class Batches:
    """An endless, resumable stream of batches: its position is part of the checkpoint (state_dict)."""

    def __init__(self, data: tuple[torch.Tensor, torch.Tensor], batch: int = 32) -> None:
        self.x, self.y = data
        self.batch = batch
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = (self.position * self.batch) % len(self.x)
        self.position += 1
        return self.x[start : start + self.batch], self.y[start : start + self.batch]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
