"""Suite-wide setup.

One intra-op thread: ``spawn_ranks`` forks, and a child forked after the parent ran an
OpenMP-parallel kernel (e.g. a layer_norm backward) hangs in its first parallel kernel.
With one thread the parent never starts the OpenMP pool. (Also kinder to 2 shared cores.)
"""

import re
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


_MEGATRON_IMPORT = re.compile(
    r"^\s*(?:from|import)\s+(?:megatron|shardcheck\.megatron)\b|importorskip\(\s*[\"']megatron", re.M)
_uses_megatron: dict[str, bool] = {}


def pytest_collection_modifyitems(items):
    """Mark ``megatron`` every test of a module that imports megatron-core or the adapter, so
    that ``-m megatron`` reruns them all on another megatron-core release."""
    for item in items:
        path = str(item.path)
        if path not in _uses_megatron:
            _uses_megatron[path] = bool(_MEGATRON_IMPORT.search(Path(path).read_text()))
        if _uses_megatron[path]:
            item.add_marker(pytest.mark.megatron)
