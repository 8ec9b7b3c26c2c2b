"""The arithmetic of parallel layouts, no processes: which GPU each rank binds, how items split
into whole units, and where a quantized checkpoint's input columns split."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("tp, pp, multi_node, expected", [
    (1, 2, False, [0, 1]),  # one node, two stages: a GPU each (not both on GPU 0)
    (2, 2, False, [0, 1, 2, 3]),
    (2, 2, True, [0, 1, 0, 1]),  # a node per stage: each numbers its own GPUs from 0
    (4, 1, False, [0, 1, 2, 3])])
def test_each_rank_takes_a_gpu_of_its_own(tp, pp, multi_node, expected):
    """Which GPU of its machine each rank binds (a CUDA-only path, so its arithmetic is
    checked here: two pipeline stages on one node used to share GPU 0, which NCCL refuses)."""
    from ksana_llm.distributed.runtime import LaunchSpec, node_local_rank

    spec = LaunchSpec("m", "bfloat16", "cuda", tp_size=tp, pp_size=pp)
    assert [node_local_rank(r, spec, multi_node=multi_node) for r in range(tp * pp)] == expected


def test_balanced_splits_in_whole_units():
    """Items split as evenly as whole units allow, the first parts one unit larger; every item
    in exactly one part, in order. A total that is no whole number of units is refused."""
    from ksana_llm.distributed.context import balanced_split

    for total, parts, unit in ((10, 3, 1), (2880, 4, 32), (2880, 8, 32), (96, 2, 32), (64, 4, 32)):
        splits = [balanced_split(total, parts, index, unit) for index in range(parts)]
        assert [start for start, _ in splits] == [sum(s for _, s in splits[:i])
                                                  for i in range(parts)]
        assert sum(size for _, size in splits) == total
        sizes = [size // unit for _, size in splits]
        assert all(size % unit == 0 for _, size in splits)
        assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert [balanced_split(2880, 4, i, 32) for i in range(4)] == \
        [(0, 736), (736, 736), (1472, 704), (2176, 704)]
    with pytest.raises(ValueError, match="units of 32"):
        balanced_split(100, 2, 0, 32)


def test_quantized_columns_split_evenly_unless_the_kernels_lose_their_groups():
    """Row-parallel input columns of a quantized checkpoint: the even split while every rank's
    slice starts where groups of 32 (or the whole scale block, when smaller) still fit;
    otherwise whole scale blocks, where every rank gets one."""
    from ksana_llm.distributed.context import ParallelContext
    from ksana_llm.layers.parallel import scale_aligned_split

    def splits(total: int, ranks: int, group: int) -> list[tuple[int, int]]:
        return [scale_aligned_split(total, ParallelContext(tp_size=ranks, tp_rank=rank), group)
                for rank in range(ranks)]

    # gpt-oss's experts (blocks of 32): 720 / 360 each would leave groups of 16 / 8
    assert [size for _, size in splits(2880, 4, 32)] == [736, 736, 704, 704]
    assert [size for _, size in splits(2880, 8, 32)] == [384, 384] + [352] * 6
    assert splits(2880, 2, 32) == [(0, 1440), (1440, 1440)]
    # 128-column blocks whose even splits start at multiples of 64: even, regrouped to 64
    for total, ranks in ((768, 4), (1536, 8), (29568, 2), (18432, 32)):
        assert {size for _, size in splits(total, ranks, 128)} == {total // ranks}
    assert splits(48, 2, 16) == [(0, 32), (32, 16)]  # 24 would leave groups of 8
    assert splits(40, 2, 16) == [(0, 20), (20, 20)]  # no whole number of blocks: even
    assert splits(64, 4, 32) == [(0, 16), (16, 16), (32, 16), (48, 16)]  # fewer blocks than ranks
    assert splits(96, 2, 1) == [(0, 48), (48, 48)]  # not quantized in groups
