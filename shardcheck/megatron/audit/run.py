"""``shardcheck audit``: the type checker and parity over the generic sweep of megatron-core.

For each case of the sweep (:mod:`shardcheck.megatron.audit.sweep`) the component runs on warm Gloo
ranks (one :class:`~shardcheck.parity.pool.RankPool` per world size, since Megatron's
``parallel_state`` spans the whole default group) and on one rank
(:mod:`shardcheck.megatron.audit.runner`), in the order :mod:`shardcheck.megatron.audit.schedule`
gives. A case fails when an output differs from the one-rank run
(:mod:`shardcheck.megatron.audit.divergence`); its contracted calls locate the divergence in
megatron-core, and the type checker, when present, gives the ``checker:`` line. Failures are
deduplicated into findings by location and contract (:mod:`shardcheck.megatron.audit.findings`),
and the result (:mod:`shardcheck.megatron.audit.summary`) lists what was left out and why.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from typing import Any

from shardcheck.megatron.audit.findings import build_findings
from shardcheck.megatron.audit.runner import Pools, Runner, cpu_patch_status, pools
from shardcheck.megatron.audit.schedule import Progress, sweep
from shardcheck.megatron.audit.shards import load_shares, merged
from shardcheck.megatron.audit.summary import AuditResult, audit_result
from shardcheck.megatron.audit.sweep import Case
from shardcheck.parity.layout import Layout


def audit(cases: Iterable[Case], *, budget: int | None = None, time_limit: float | None = None,
          typecheck: bool = True, progress: Progress | None = None,
          run_pools: Pools | None = None, prune: bool = True,
          unbuilt: Mapping[tuple, str] | None = None, full: bool = True) -> AuditResult:
    """Run the cases (screening options on one rank first, pruning the cases whose options
    the component's default run under the layout never read), then build the findings.
    ``unbuilt`` (``(component, options) -> why``, the plan's options whose config does not
    build) are listed as not swept. Without ``full`` only the default plan's selection of the
    cases runs (:func:`~shardcheck.megatron.audit.schedule.in_default_plan`); the result counts
    the rest as left to --full."""
    started = time.monotonic()
    with nullcontext(run_pools) if run_pools else pools() as owned:
        patches = owned.run(Layout(), cpu_patch_status)[0]
        runner = Runner(owned, typecheck)
        runner.prune = prune
        swept = sweep(runner, cases, budget, time_limit, progress, started, full)
        swept.not_swept.update(unbuilt or {})
        one_rank = runner.one_rank_failures()
        findings = build_findings(runner, swept.outcomes, one_rank)
    return audit_result(findings, swept.outcomes, swept.not_swept, swept.not_applicable.values(),
                        swept.pruned, time.monotonic() - started, swept.stopped_early, patches,
                        swept.left_to_full, one_rank, swept.unreached)


def merge_shares(dirs: Iterable[Any], *, typecheck: bool = True, run_pools: Pools | None = None) -> AuditResult:
    """The audit the shares in ``dirs`` make together (:mod:`shardcheck.megatron.audit.shards`):
    the same findings one run of the whole plan gives; each corrected control is rerun here."""
    share = merged(load_shares(list(dirs)))
    with nullcontext(run_pools) if run_pools else pools() as owned:
        findings = build_findings(Runner(owned, typecheck), share.outcomes, share.one_rank)
    return audit_result(findings, share.outcomes, share.not_swept, share.not_applicable, share.pruned,
                        share.seconds, share.stopped_early, share.patches, share.left_to_full, share.one_rank,
                        share.unreached)
