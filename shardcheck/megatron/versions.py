"""What differs between megatron-core releases that the adapter calls, in one place.

Everything else follows the code by what it does (:mod:`shardcheck.megatron.cpu`,
:mod:`shardcheck.megatron.annotations`); what is here are call signatures that changed.

* ``get_batch_on_this_cp_rank``: 0.19 added a required ``is_hybrid_cp`` (hybrid context
  parallelism, which the catalogue does not run): :func:`cp_batch_kwargs` passes ``False``.
  Its ``cp_group=None`` means parallel_state's CP group in 0.16 and the whole world in 0.19:
  the scenarios always pass the group.
"""

from __future__ import annotations

import inspect
from typing import Any


def cp_batch_kwargs(cut: Any) -> dict[str, Any]:
    """The keyword arguments this release's ``get_batch_on_this_cp_rank`` (``cut``) needs
    besides the batch and the CP group."""
    return {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(cut).parameters else {}
