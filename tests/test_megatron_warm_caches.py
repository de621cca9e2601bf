"""A warm rank keeps no tensor of one scenario for the next: megatron-core's function caches
are emptied, and its global memory buffer is a new one, before each scenario.

GDN caches its head permutation under context parallelism (``functools.lru_cache``). A warm
rank that ran ``cp2-dp2`` and then ``cp2-dp2@dp-cp`` read the permutation cached in the first
case's checked region, a tensor of unknown type in the second's: 20.9% of the second case's
op calls were typed, 99.4% when it ran first. The global memory buffer (sequence parallelism's
all-gathers) came back with the saved groups of the same global layout, so a case after
``tp2-cp2-sp`` made one op call fewer per rank than the same case run alone.
"""

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("megatron.core.ssm.gated_delta_net.common")  # GDN's package: 0.19 on (0.16.1 has one module)

import torch  # noqa: E402
from megatron.core.ssm.gated_delta_net.common import _build_head_perm_for_split_sections  # noqa: E402

import shardcheck as sc  # noqa: E402
from shardcheck.megatron.audit.rank import run_case  # noqa: E402
from shardcheck.megatron.audit.runner import PRELOAD, _importable  # noqa: E402
from shardcheck.megatron.cpu.caches import forget_function_caches, function_caches  # noqa: E402
from shardcheck.parity.pool import RankPool  # noqa: E402


def _permuted_type(axis: str):
    """The type of a replicated tensor's columns permuted by GDN's cached head permutation,
    in a region on a mesh of ``axis``."""
    with sc.typecheck(sc.Mesh(rank=0, **{axis: [0, 1]}), mode="collect") as checker:
        x = sc.annotate(torch.randn(3, 8), **{axis: sc.R})
        return checker.types(x.index_select(-1, _build_head_perm_for_split_sections((4, 4), 2, "cpu")))


def test_megatron_lru_caches_are_found_and_emptied_so_each_region_builds_its_own():
    assert _build_head_perm_for_split_sections in function_caches()
    forget_function_caches()
    assert _permuted_type("dp") == (sc.R,)
    assert _permuted_type("cp") is None  # the permutation cached in the dp region
    forget_function_caches()
    assert _build_head_perm_for_split_sections.cache_info().currsize == 0
    assert _permuted_type("cp") == (sc.R,)


def _gdn_ops(layouts: list[str]) -> list:
    """Each rank's op calls of GDN's default case under the last of ``layouts`` (typed and
    unknown, by site and origin), run after the others in one fresh pool."""
    with RankPool(4, timeout=120, preload=_importable(PRELOAD)) as pool:
        for layout in layouts:
            ranks = pool.run(layout, run_case, "gdn", (), (), True)
    return [r.ops for r in ranks]


@pytest.mark.slow
def test_a_case_after_another_layout_in_a_warm_pool_is_typed_as_when_run_alone():
    alone = _gdn_ops(["tp2-cp2-sp@cp-tp"])
    assert alone[0]["typed"] > 50 * alone[0]["unknown"]
    assert _gdn_ops(["tp2-cp2-sp", "tp2-cp2-sp@cp-tp"]) == alone
