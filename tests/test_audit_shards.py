"""``shardcheck audit --shard K/N`` and ``audit merge``: three shares merged give the findings,
coverage and left-out options of one run of the whole plan (real megatron-core, Gloo ranks)."""

from dataclasses import asdict

import pytest
from click.testing import CliRunner

from shardcheck.megatron.audit.shards import ShareError, parse_shard, shard
from shardcheck.megatron.audit.sweep import Case
from shardcheck.parity.layout import Layout


def test_shares_partition_the_option_cases_and_each_runs_the_defaults():
    cases = [Case("gpt", options, Layout.parse(lay)) for lay in ("tp2", "cp2")
             for options in [(), *[((f"o{i}", True),) for i in range(12)]]]
    shares = [shard(cases, k, 3) for k in (1, 2, 3)]
    defaults = [c for c in cases if not c.options]
    assert all([c for c in s if not c.options] == defaults for s in shares)
    optioned = [[c for c in s if c.options] for s in shares]
    assert sorted(map(repr, sum(optioned, []))) == sorted(repr(c) for c in cases if c.options)
    assert all(optioned)  # 12 option sets reach every share
    # an option set keeps all its layouts in one share
    assert all(len({c.layout for c in s if c.options == opts}) in (0, 2) for s in optioned
               for opts in {c.options for c in cases})


@pytest.mark.parametrize("text", ["0/3", "4/3", "3", "a/b", "1/0"])
def test_a_malformed_shard_is_refused(text):
    with pytest.raises(ShareError, match="K/N"):
        parse_shard(text)


@pytest.mark.slow
def test_three_shares_merged_give_the_whole_runs_findings(tmp_path, audit_pools):
    pytest.importorskip("megatron.core")
    from shardcheck.megatron.audit.run import audit, merge_shares
    from shardcheck.megatron.audit.shards import save_share
    from shardcheck.megatron.audit.sweep import component_options, plan

    cases = plan({c: component_options(c) for c in ("output_loss", "moe_router")},
                 [Layout(tp=2), Layout(tp=2, sp=True)], None)
    whole = audit(cases, run_pools=audit_pools)
    dirs = []
    for k in (1, 2, 3):
        share = audit(shard(cases, k, 3), run_pools=audit_pools)
        save_share(share, k, 3, tmp_path / f"share{k}")
        dirs.append(tmp_path / f"share{k}")
    joined = merge_shares(dirs, run_pools=audit_pools)
    # label smoothing, gathered logits (both triggers), the router's local token count (padding
    # and per-token loss: one corrected function repairs both)
    assert len(whole.findings) >= 3
    assert [asdict(f) for f in joined.findings] == [asdict(f) for f in whole.findings]
    assert _without_ops(joined.coverage()) == _without_ops(whole.coverage())
    # op counts depend a little on what a warm rank ran before (one-time allocations, e.g.
    # Megatron's memory buffer): the typed shares agree within a point, not exactly
    for component, row in whole.coverage().items():
        for layout, ops in row.get("megatron_ops", {}).get("by_layout", {}).items():
            merged = joined.coverage()[component]["megatron_ops"]["by_layout"][layout]
            assert abs(merged["typed_share"] - ops["typed_share"]) <= 0.01, (component, layout)
    assert joined.not_swept == whole.not_swept and joined.not_read == whole.not_read
    assert len(joined.outcomes) == len(whole.outcomes)


def _without_ops(coverage: dict) -> dict:
    return {component: {k: v for k, v in row.items() if k != "megatron_ops"}
            for component, row in coverage.items()}


def test_merge_refuses_an_incomplete_set_of_shares_in_one_line(tmp_path):
    from shardcheck.cli import main
    from shardcheck.megatron.audit.shards import save_share
    from shardcheck.megatron.audit.summary import AuditResult

    empty = AuditResult([], [], [], 0.0, False)
    save_share(empty, 1, 3, tmp_path / "a")
    save_share(empty, 3, 3, tmp_path / "b")
    result = CliRunner().invoke(main, ["audit", "merge", str(tmp_path / "a"), str(tmp_path / "b"),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "missing [2]" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["audit", "merge", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "no share.pkl" in result.output
    result = CliRunner().invoke(main, ["audit", "--shard", "4/3", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "K/N" in result.output
    assert not (tmp_path / "out").exists()


def test_a_case_result_crosses_a_pickle_unchanged_with_its_digest():
    """What a rank sends back (through the pool's pipe) is a frozen record that pickles."""
    import dataclasses
    import pickle

    import torch

    from shardcheck.megatron.audit.rank import CaseResult

    result = CaseResult({"loss": torch.tensor([1.0, 2.0], dtype=torch.float64)}, [], [], None,
                        "megatron/core/x.py:1", ("hidden_size",))
    digest = result.digest
    again = pickle.loads(pickle.dumps(result))
    assert again.digest == digest and again.reads == ("hidden_size",) and again.entry == result.entry
    assert torch.equal(again.outputs["loss"], result.outputs["loss"])
    other = CaseResult({"loss": torch.tensor([1.0, 3.0], dtype=torch.float64)}, [], [])
    assert other.digest != digest
    # float64 copies of float32 values travel as float32 and come back equal; others as they are
    values = torch.randn(1000, dtype=torch.float32)
    narrow = CaseResult({"grad": values.double(), "exact": torch.tensor([0.1], dtype=torch.float64)}, [], [])
    back = pickle.loads(pickle.dumps(narrow))
    assert back.digest == narrow.digest and back.outputs["exact"].item() == 0.1
    assert all(back.outputs[k].dtype == torch.float64 and torch.equal(back.outputs[k], narrow.outputs[k])
               for k in narrow.outputs)
    wide = CaseResult({"grad": values.double() + 1e-12, "exact": narrow.outputs["exact"]}, [], [])
    assert len(pickle.dumps(narrow)) < 0.6 * len(pickle.dumps(wide))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.entry = None


def test_a_share_written_before_the_audit_was_split_is_refused_in_one_line(tmp_path):
    """A share.pkl naming the outcome model where it used to live (``audit.run``) is refused."""
    import pickle

    from shardcheck.megatron.audit.outcome import Outcome
    from shardcheck.megatron.audit.shards import SHARE_FILE, Share, load_shares

    share = Share((1, 1), [Outcome(Case("gpt", (), Layout(tp=2)))], {}, [], {}, False, 1.0)
    old = pickle.dumps(share, protocol=0).replace(b"shardcheck.megatron.audit.outcome", b"shardcheck.megatron.audit.run")
    (tmp_path / SHARE_FILE).write_bytes(old)
    with pytest.raises(ShareError, match="not a share this shardcheck wrote") as raised:
        load_shares([tmp_path])
    assert "\n" not in str(raised.value)
