"""Adjacent collectives of one kind over one group are packed into one step; others are not."""

from deepinfer.compiler.pack import pack_collectives
from deepinfer.runtime.manifest import ScheduleStep

GATHER = {"op": "all_gather", "group": "tp", "dim": 0, "group_size": 2}
REDUCE = {"op": "all_reduce", "group": "world"}


def collective(spec, i, o):
    return ScheduleStep("", [i], [o], spec)


def collective_calls(steps):
    return sum(1 for step in steps if step.collective)


def test_three_adjacent_all_gathers_become_one():
    steps = [ScheduleStep("r1", ["x"], ["a", "b", "c"]), collective(GATHER, "a", "A"), collective(GATHER, "b", "B"),
             collective(GATHER, "c", "C"), ScheduleStep("r2", ["A", "B", "C"], ["y"])]
    packed = pack_collectives(steps, {n: "float32" for n in "abc"})
    assert collective_calls(steps) == 3 and collective_calls(packed) == 1
    assert packed[1] == ScheduleStep("", ["a", "b", "c"], ["A", "B", "C"], {**GATHER, "packed": 3})


def test_not_packed_across_groups_dtypes_kinds_or_dependencies():
    steps = [collective(GATHER, "a", "A"), collective({**GATHER, "group": "world"}, "b", "B"),  # another group
             collective(REDUCE, "c", "C"), collective(REDUCE, "d", "D"),  # another dtype
             collective(REDUCE, "e", "E"), collective(REDUCE, "E", "F")]  # the second needs the first
    dtypes = {"a": "float32", "b": "float32", "c": "float32", "d": "bfloat16", "e": "float32", "E": "float32"}
    assert pack_collectives(steps, dtypes) == steps
