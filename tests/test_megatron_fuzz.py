"""The Megatron catalogue as fuzz targets: found, located as the audit locates, shrunk."""

import pytest

pytest.importorskip("megatron.core")

from hypothesis import find  # noqa: E402
from hypothesis.errors import NoSuchExample, UnsatisfiedAssumption  # noqa: E402

from shardcheck.fuzz import campaign  # noqa: E402
from shardcheck.fuzz.campaign import fuzz, registered_targets  # noqa: E402
from shardcheck.megatron import fuzz_targets  # noqa: E402
from shardcheck.megatron.scenarios import COMPONENTS  # noqa: E402
from shardcheck.megatron.scenarios.moe_router import RouterSetup  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_catalogue_component_is_a_fuzz_target():
    assert set(COMPONENTS) <= set(registered_targets())


def test_findings_stored_before_the_catalogue_moved_still_find_its_module():
    assert registered_targets()["gpt"].module == fuzz_targets.__name__ == "shardcheck.megatron.fuzz_targets"
    assert campaign._import("shardcheck.megatron.audit.fuzz_targets", "gpt") is fuzz_targets


def test_the_space_draws_accepted_layouts_few_options_and_declared_sizes():
    assert fuzz_targets.fuzzable_sizes(RouterSetup) == {"seq": (4, 8, 16), "batch": (1, 2)}
    space = fuzz_targets.component_space("moe_router")
    simplest = find(space, lambda example: True)
    assert simplest == {"layout": "cp2", "seq": 4, "batch": 1}
    with_ep = find(space, lambda example: Layout.parse(example["layout"]).ep > 1)
    assert Layout.parse(with_ep["layout"]).sp or Layout.parse(with_ep["layout"]).tp == 1
    with pytest.raises(NoSuchExample):  # the plain GPT has no experts
        find(fuzz_targets.component_space("gpt"), lambda example: Layout.parse(example["layout"]).ep > 1)


def test_a_correct_example_passes_and_the_buggy_one_is_located():
    assert fuzz_targets.check_example("output_loss", {"layout": "tp2"}).failure is None
    verdict = fuzz_targets.check_example("output_loss", {"layout": "tp2", "label_smoothing": 0.1})
    assert verdict.failure.location.startswith("megatron/core/tensor_parallel/cross_entropy.py:")
    assert verdict.failure.checker.startswith("checker: mean over shard")
    [(name, observed)] = verdict.observed.items()
    assert observed != verdict.reference[name]


def test_an_example_whose_options_mean_another_thing_on_one_rank_is_rejected():
    """Device-limited routing limits tokens to the experts of k ep ranks: on one rank, no limit."""
    limited = {"moe_router_topk_limited_devices": 1}
    with pytest.raises(UnsatisfiedAssumption):
        fuzz_targets.check_example("moe", {"layout": "dp2-ep2", **limited})
    assert fuzz_targets.check_example("moe", {"layout": "dp2", **limited}).failure is None


def test_fuzzing_the_output_loss_finds_its_bugs_and_shrinks_them(tmp_path):
    """Label smoothing, and gathered logits fed to the vocab-parallel loss, both fail at tp2."""
    campaign = fuzz("output_loss", budget=12, seed=0, root=tmp_path, write_repros=False)
    assert campaign.findings
    for finding in campaign.findings:
        assert finding.location.startswith("megatron/core/tensor_parallel/cross_entropy.py:")
        sizes = {k: finding.config.pop(k) for k in ("seq", "batch")}
        assert (finding.layout, sizes, len(finding.config)) == ("tp2", {"seq": 4, "batch": 1}, 1)
        assert set(finding.config) <= {"label_smoothing", "runtime_gather_output", "parallel_output"}
