"""Sound pruning: an option whose config fields the component's default run never read under a
layout is not run there, and running it anyway changes nothing (real megatron-core, Gloo ranks)."""

import pytest

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.sweep import Case, changed_config_fields  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow
TP2SP = Layout(tp=2, sp=True)
UNREAD = [(("tp_comm_overlap", True),), (("moe_token_dispatcher_type", "alltoall"),)]
READ = [(("calculate_per_token_loss", True),), (("padding", True),)]  # a config field; a setup field


@pytest.fixture(scope="module")
def both(audit_pools):
    cases = [Case("moe_router", options, TP2SP) for options in [(), *UNREAD, *READ]]
    return audit(cases, run_pools=audit_pools), audit(cases, run_pools=audit_pools, prune=False)


def test_options_the_default_run_never_read_are_pruned_and_the_others_run(both):
    pruned, _ = both
    assert set(pruned.pruned) == {("moe_router", options) for options in UNREAD}
    assert {o.case.options for o in pruned.outcomes} == {(), *READ}
    assert pruned.coverage()["moe_router"]["options_not_read"] == 2


def test_a_pruned_case_run_anyway_gives_the_defaults_numbers_and_no_finding(both):
    _, unpruned = both
    by_options = {o.case.options: o for o in unpruned.outcomes}
    for options in UNREAD:
        assert by_options[options].reference_digest == by_options[()].reference_digest
        assert not by_options[options].failed and not by_options[options].error
    # the read option does change the router (so the check above can fail)
    assert by_options[READ[0]].reference_digest != by_options[()].reference_digest


def test_pruning_keeps_every_finding(both):
    pruned, unpruned = both
    assert {f.id for f in pruned.findings} == {f.id for f in unpruned.findings}
    assert pruned.findings  # padding under tp2-sp: the router's token count


def test_changed_fields_include_what_the_config_derives():
    assert changed_config_fields("gpt", (("tp_comm_overlap", True),), Layout(tp=2)) >= {"tp_comm_overlap"}
    assert changed_config_fields("gpt", (("loss_mask", True),), Layout(tp=2)) is None  # a setup field
