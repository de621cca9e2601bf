"""What differs between megatron-core releases that the adapter calls, in one place.

Everything else follows the code by what it does (:mod:`shardcheck.megatron.cpu.patches`,
:mod:`shardcheck.megatron.audit.annotations`); what is here are call signatures that changed.

* ``get_batch_on_this_cp_rank``: 0.19 added a required ``is_hybrid_cp`` (hybrid context
  parallelism, which the catalogue does not run): :func:`cp_batch_kwargs` passes ``False``.
  Its ``cp_group=None`` means parallel_state's CP group in 0.16 and the whole world in 0.19:
  the scenarios always pass the group.
* ``vocab_parallel_cross_entropy``: 0.19 takes the ``tp_group`` its caller has (and
  ``LanguageModule`` passes it); 0.16 reads parallel_state's. :func:`tp_group_kwargs` gives
  the group where the release takes one.
* ``MambaContextParallel``: 0.16 takes the mixer's ``conv1d`` module (0.19 its weight and bias,
  and sets the gated norm's tp group from the model's groups). On 0.16 the Mamba mixer under
  explicit groups disagrees with one rank for a reason not pinned down yet (setting the norm's
  group as 0.19 does is not enough): :func:`mamba_takes_conv_module` says which form is here.
"""

from __future__ import annotations

import inspect
from typing import Any


def cp_batch_kwargs(cut: Any) -> dict[str, Any]:
    """The keyword arguments this release's ``get_batch_on_this_cp_rank`` (``cut``) needs
    besides the batch and the CP group."""
    return {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(cut).parameters else {}


def tp_group_kwargs(function: Any, tp_group: Any) -> dict[str, Any]:
    """``{"tp_group": tp_group}`` where this release's ``function`` takes one, else nothing."""
    takes = "tp_group" in inspect.signature(function).parameters
    return {"tp_group": tp_group} if takes and tp_group is not None else {}


def mamba_takes_conv_module() -> bool:
    """Whether this release's ``MambaContextParallel`` takes the ``conv1d`` module (0.16)."""
    from megatron.core.ssm.mamba_context_parallel import MambaContextParallel

    return "conv1d_cp1" in inspect.signature(MambaContextParallel.__init__).parameters
