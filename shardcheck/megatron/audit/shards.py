"""An audit in shares: ``--shard K/N`` runs a deterministic K-th share of the plan, and
``merge`` joins the shares into the report and findings one run gives.

Every share runs the defaults tier (each component's defaults under every layout): the rest of
the plan depends on it (a layout whose defaults fail is not tried with options; the config
fields the defaults read decide which options are pruned). The option sets are dealt out by a
hash of (component, options), so each option set runs all its layouts in one share. A share
keeps what it ran in ``DIR/share.pkl``; ``merge`` takes the union (the defaults once), then
builds the findings as one run does, rerunning each finding's corrected control.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardcheck.megatron.audit.sweep import Case

SHARE_FILE = "share.pkl"
FORMAT = 4  # 2: left_to_full; 3: one_rank; 4: unreached


class ShareError(ValueError):
    """Shares that cannot be merged (one line for the user)."""


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N`` -> (K, N) with 1 <= K <= N; ShareError otherwise."""
    k_text, sep, n_text = text.partition("/")
    try:
        k, n = int(k_text), int(n_text)
    except ValueError:
        k = n = 0
    if not sep or not 1 <= k <= n:
        raise ShareError(f"--shard {text!r} is not K/N with 1 <= K <= N (e.g. 2/3)")
    return k, n


def share_of(case: Case, count: int) -> int | None:
    """The share (1..count) an option case belongs to; None for a default case (every share)."""
    if not case.options:
        return None
    digest = hashlib.sha1(repr((case.component, case.options)).encode()).digest()
    return int.from_bytes(digest[:8], "big") % count + 1


def shard(cases: Iterable[Case], k: int, n: int) -> list[Case]:
    """The cases of share ``k`` of ``n``: the defaults tier and the option sets dealt to it."""
    return [c for c in cases if share_of(c, n) in (None, k)]


@dataclass
class Share:
    """What one share ran: enough to build the findings of the union."""

    shard: tuple[int, int]
    outcomes: list[Any]
    not_swept: dict[tuple, str]
    not_applicable: list[str]
    pruned: dict[tuple, list[str]]
    stopped_early: bool
    seconds: float
    patches: dict[str, str] = field(default_factory=dict)
    left_to_full: dict[tuple, int] = field(default_factory=dict)  # (component, options) -> cases
    one_rank: list[Any] = field(default_factory=list)  # option sets whose one-rank reference raised
    unreached: dict[tuple, list[str]] = field(default_factory=dict)  # (component, options) -> layouts
    format: int = FORMAT


def save_share(result: Any, k: int, n: int, out_dir: Path) -> Path:
    """Write ``out_dir/share.pkl`` for an :class:`~shardcheck.megatron.audit.summary.AuditResult`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    share = Share((k, n), result.outcomes, result.left_out, result.not_applicable, result.pruned,
                  result.stopped_early, result.seconds, result.patches, result.left_to_full, result.one_rank,
                  result.unreached)
    path = out_dir / SHARE_FILE
    path.write_bytes(pickle.dumps(share))
    return path


def load_shares(dirs: Sequence[Path | str]) -> list[Share]:
    """The shares in ``dirs``: all N of one plan, each once, or ShareError."""
    shares = []
    for directory in dirs:
        path = Path(directory) / SHARE_FILE
        if not path.is_file():
            raise ShareError(f"{directory}: no {SHARE_FILE} (run `shardcheck audit --shard K/N --out DIR` first)")
        try:
            share = pickle.loads(path.read_bytes())
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to replace
            raise ShareError(f"{path}: not a share this shardcheck wrote ({exc})") from None
        if not isinstance(share, Share) or share.format != FORMAT:
            raise ShareError(f"{path}: not a share this shardcheck wrote")
        shares.append(share)
    counts = {s.shard[1] for s in shares}
    if len(counts) != 1:
        raise ShareError(f"shares of different splits: {sorted(f'{k}/{n}' for k, n in (s.shard for s in shares))}")
    [n] = counts
    have = sorted(s.shard[0] for s in shares)
    if have != list(range(1, n + 1)):
        missing = sorted(set(range(1, n + 1)) - set(have))
        twice = sorted({k for k in have if have.count(k) > 1})
        raise ShareError(f"need each of the {n} shares once: missing {missing or 'none'}, "
                         f"given twice {twice or 'none'}")
    return shares


def _union(maps: Iterable[dict[tuple, list[str]]]) -> dict[tuple, list[str]]:
    """Per key, the sorted union of the lists the maps give it."""
    joined: dict[tuple, list[str]] = {}
    for mapping in maps:
        for key, values in mapping.items():
            joined[key] = sorted({*joined.get(key, []), *values})
    return joined


def merged(shares: Sequence[Share]) -> Share:
    """The union of the shares: each case once (the defaults tier ran in every share)."""
    outcomes, seen = [], set()
    one_rank = list({(o.case.component, o.case.options): o for s in shares for o in s.one_rank}.values())
    not_swept: dict[tuple, str] = {}
    patches: dict[str, str] = {}
    for share in shares:
        for outcome in share.outcomes:
            key = (outcome.case.component, outcome.case.options, str(outcome.case.layout))
            if key not in seen:
                seen.add(key)
                outcomes.append(outcome)
        for key, why in share.not_swept.items():
            not_swept.setdefault(key, why)
        patches.update(share.patches)
    return replace(shares[0], shard=(1, 1), outcomes=outcomes, not_swept=not_swept,
                   pruned=_union(s.pruned for s in shares),
                   not_applicable=sorted({a for s in shares for a in s.not_applicable}),
                   stopped_early=any(s.stopped_early for s in shares),
                   seconds=max(s.seconds for s in shares), patches=patches,
                   left_to_full={k: n for s in shares for k, n in s.left_to_full.items()}, one_rank=one_rank,
                   unreached=_union(s.unreached for s in shares))
