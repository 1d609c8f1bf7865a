"""A restore's destinations (destinations.py): which live memory each stored tensor is read into.

``first_free`` decides for all stored tensors at once what a restore used to decide one by one against the
ranges taken so far; these tests compare it with that one-by-one rule on the cases that break a wrong merge
(overlapping, adjacent, out of order, duplicates, chains of overlaps, empty ranges) and on random ones.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tiersave.destinations import cpu_byte_view, first_free, span


def one_by_one(choices: list[list[tuple[int, int]]]) -> list[int]:
    """The rule itself, quadratic and obvious: each item takes its first range overlapping no taken range."""
    taken: list[tuple[int, int]] = []
    picks = []
    for spans in choices:
        pick = -1
        for k, (start, end) in enumerate(spans):
            if end > start and any(start < t_end and t_start < end for t_start, t_end in taken):
                continue
            if end > start:
                taken.append((start, end))
            pick = k
            break
        picks.append(pick)
    return picks


@pytest.mark.parametrize(
    ("choices", "expected"),
    [
        ([], []),
        ([[(0, 10)], [(10, 20)], [(20, 30)]], [0, 0, 0]),  # adjacent ranges do not overlap
        ([[(20, 30)], [(0, 10)], [(10, 20)]], [0, 0, 0]),  # out of order
        ([[(0, 10)], [(0, 10)]], [0, -1]),  # duplicates: the second is copied into, not read into again
        ([[(0, 10)], [(5, 15)]], [0, -1]),  # overlapping
        ([[(5, 15)], [(0, 10)]], [0, -1]),  # overlapping, the later item lower in memory
        ([[(0, 10)], [(0, 10), (100, 110)]], [0, 1]),  # the second takes its next free range
        ([[(0, 10)], [(2, 4)], [(8, 12)]], [0, -1, -1]),  # inside, and across the end
        ([[(0, 10)], [(9, 20)], [(19, 30)]], [0, -1, 0]),  # a chain: the third only overlaps the untaken second
        ([[(0, 100)], [(10, 20), (200, 210)], [(200, 205)]], [0, 1, -1]),  # a second choice blocks a later first
        ([[], [(0, 10)]], [-1, 0]),  # no live tensor to read into
        ([[(5, 5)], [(0, 10)], [(5, 5)]], [0, 0, 0]),  # an empty range takes no memory, and is never refused
        ([[(0, 10), (0, 10)], [(20, 30)]], [0, 0]),  # one item's live tensors may share memory (tied)
    ],
)
def test_first_free_cases(choices, expected):
    assert one_by_one(choices) == expected  # the cases say what the rule is
    assert first_free(choices) == expected


def test_first_free_matches_the_rule_on_random_layouts():
    rng = random.Random(15)
    for trial in range(2000):
        n = rng.randint(1, 12)
        choices = []
        for _ in range(n):
            spans = []
            for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
                start = rng.randint(0, 60)
                spans.append((start, start + rng.choice([0, 1, 3, 5, 10, 20])))
            choices.append(spans)
        assert first_free(choices) == one_by_one(choices), (trial, choices)


def test_first_free_at_many_tensors_is_not_quadratic():
    # 10^5 disjoint ranges in shuffled order, and a few duplicates among them: the bulk path plus a short
    # one-by-one part (the old insertion into a sorted list took seconds here)
    rng = random.Random(1)
    starts = list(range(0, 100_000 * 64, 64))
    rng.shuffle(starts)
    choices = [[(s, s + 64)] for s in starts] + [[(starts[7], starts[7] + 64)], [(starts[9] + 8, starts[9] + 16)]]
    picks = first_free(choices)
    assert picks[:100_000] == [0] * 100_000
    assert picks[100_000:] == [-1, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5)])
def test_cpu_byte_view_is_the_tensors_memory(dtype, shape):
    t = torch.zeros(shape, dtype=dtype)
    view = cpu_byte_view(t)
    assert len(view) == t.numel() * t.element_size() and view.format == "B"
    if t.numel():
        assert not view.readonly
        view[:] = bytes(range(1, len(view) + 1))  # writing through the view writes the tensor
        assert bytes(t.view(-1).view(torch.uint8).numpy()) == bytes(range(1, len(view) + 1))
        assert span(t) == (t.data_ptr(), t.data_ptr() + len(view))


def test_cpu_byte_view_keeps_the_tensor_alive():
    view = cpu_byte_view(torch.full((1024,), 7, dtype=torch.uint8))  # the only reference to the tensor is the view
    garbage = [torch.zeros(1024, dtype=torch.uint8) for _ in range(64)]  # reuse freed memory, if any was freed
    assert bytes(view) == b"\x07" * 1024
    del garbage


def test_span_of_an_array():
    a = np.zeros(10, dtype=np.float32)
    start, end = span(a)
    assert end - start == 40 and start == a.__array_interface__["data"][0]


def test_a_restore_under_another_default_device_still_reads_into_cpu_tensors(tmp_path):
    # `with torch.device(...)` around model building is common; torch.empty follows it, and a meta (or CUDA)
    # tensor's pointer handed to the reader threads as host memory crashed the process
    import tiersave

    state = {"small": torch.arange(6.0), "large": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB: aligned
    with tiersave.Checkpointer(tmp_path / "ckpt") as ck:
        ck.save(1, state)
        with torch.device("meta"):
            out = ck.restore(1)
    for name, want in state.items():
        assert out[name].device.type == "cpu" and torch.equal(out[name], want), name


def test_cpu_byte_view_refuses_a_tensor_not_in_host_memory():
    with pytest.raises(TypeError, match="CPU tensor"):
        cpu_byte_view(torch.empty(4, device="meta"))


def test_a_strict_restore_into_a_dict_subclass_with_its_own_keys(tmp_path):
    import tiersave
    from tiersave.errors import StateMismatchError

    class Keys(dict):  # keys() returning a list, as some config/attribute dicts do
        def keys(self):  # type: ignore[override]
            return list(super().keys())

    with tiersave.Checkpointer(tmp_path / "ckpt") as ck:
        ck.save(1, {"a": torch.ones(2)})
        out = ck.restore(1, into=Keys(a=torch.zeros(2)))
        assert torch.equal(out["a"], torch.ones(2))
        with pytest.raises(StateMismatchError, match="'b'"):
            ck.restore(1, into=Keys(a=torch.zeros(2), b=torch.zeros(1)))
