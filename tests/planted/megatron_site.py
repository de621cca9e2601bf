"""Changes planted in megatron-core for the processes of a repro script: a bug, or a fix.

``planted_env(directory, code)`` writes ``code`` as a ``sitecustomize`` module, which Python
runs at the start of every process whose path holds ``directory``; the returned environment
puts it there. So a test runs an emitted script, unchanged, against a megatron-core with one
function replaced, as a user would run it against a patched release.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

# The GDN out_norm fix: its gradient (partial over tp, since each rank normalises its own
# heads) summed over tp by finalize_model_grads when sequence parallelism does not do it.
GDN_OUT_NORM_FIX = """
import importlib

finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

broken = finalize._allreduce_non_tensor_model_parallel_grads

def with_out_norm(model, config, tp_group=None):
    broken(model, config, tp_group)
    group = finalize.get_tensor_model_parallel_group_if_none(tp_group)
    for chunk in model:
        for name, param in chunk.named_parameters():
            if "out_norm" in name and not config.sequence_parallel and group.size() > 1:
                finalize.torch.distributed.all_reduce(param.main_grad, group=group)

finalize._allreduce_non_tensor_model_parallel_grads = with_out_norm
"""

# A Mamba context-parallel bug: the mixer forgets that the sequence reaches it in attention's
# load-balanced order (CP rank r holds chunks r and 2*cp-1-r), so after its all-to-all the
# convolution and the scan run over the chunks out of order.
MAMBA_CP_ORDER_BUG = """
import importlib

cp = importlib.import_module("megatron.core.ssm.mamba_context_parallel")

def in_given_order(input_, cp_size, packed_seq_params=None):
    return input_

cp._undo_attention_load_balancing = cp._redo_attention_load_balancing = in_given_order
"""


# The router's per-token aux-loss fix of megatron-core 0.19: with calculate_per_token_loss the
# aux loss is scaled by the rank-local token count times the tp x cp size (finalize_model_grads
# divides by the global count), not by the local count alone. Its logged value is left alone.
ROUTER_PER_TOKEN_AUX_LOSS_FIX = """
from megatron.core.transformer.moe.router import TopKRouter

attach = TopKRouter.attach_and_log_load_balancing_loss

def scaled_over_tp_cp(self, activation, aux_loss_coeff, aux_loss, *args, **kwargs):
    if self.calculate_per_token_loss:
        size = self.tp_cp_group.size()  # the coefficient only divides the logged value
        aux_loss, aux_loss_coeff = aux_loss * size, aux_loss_coeff * size
    return attach(self, activation, aux_loss_coeff, aux_loss, *args, **kwargs)

TopKRouter.attach_and_log_load_balancing_loss = scaled_over_tp_cp
"""


# The fix of megatron-core 0.19 for the gradient norm without initialisation: the tensor-parallel
# layers mark their weights as tp shards (partition dim and stride) when they do not initialise
# them too, so the norm counts each shard once per rank instead of as a duplicate.
TP_WEIGHTS_MARKED_WITHOUT_INIT_FIX = """
from megatron.core.tensor_parallel import layers

def marking(built, dim):
    def marked(self, *args, **kwargs):
        built(self, *args, **kwargs)
        weight = getattr(self, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            layers.set_tensor_model_parallel_attributes(weight, True, dim, kwargs.get("stride", 1))
    return marked

for cls, dim in ((layers.VocabParallelEmbedding, 0), (layers.ColumnParallelLinear, 0), (layers.RowParallelLinear, 1)):
    cls.__init__ = marking(cls.__init__, dim)
"""


# The learnable softmax offset fix: each tp rank holds its own heads' offsets, so mark them
# as Megatron marks its other shards (the gradient norm then counts every rank's heads).
SOFTMAX_OFFSET_MARKED_FIX = """
from megatron.core.transformer import dot_product_attention as attention

built = attention.DotProductAttention.__init__

def marked(self, *args, **kwargs):
    built(self, *args, **kwargs)
    offset = getattr(self, "softmax_offset", None)
    if offset is not None:
        offset.tensor_model_parallel, offset.partition_dim, offset.partition_stride = True, 0, 1

attention.DotProductAttention.__init__ = marked
"""


def planted_env(directory: Path, code: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment (over ``base``) whose Python processes run ``code`` first."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(textwrap.dedent(code))
    paths = [str(directory), (base or {}).get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    return {**(base or {}), "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


# A planted MoE bug: expert weights not marked ``allreduce=False``, so DDP averages their
# gradients over the whole data-parallel group, whose ranks hold different experts under ep.
EXPERTS_REDUCED_OVER_DP = """
from megatron.core.transformer.moe import experts

built = experts.SequentialMLP.__init__

def marked_dense(self, *args, **kwargs):
    built(self, *args, **kwargs)
    for param in self.parameters():
        param.allreduce = True

experts.SequentialMLP.__init__ = marked_dense
"""


# A planted pipeline bug: the tied word-embedding gradients of the first and last stages are
# not summed, so each stage steps its copy with half of the gradient.
TIED_EMBEDDINGS_NOT_SUMMED = """
import importlib

finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
finalize._allreduce_word_embedding_grads = lambda *args, **kwargs: None
"""


# A T5 bug: the decoder's pre-cross-attention norm left unmarked for sequence parallelism, so
# finalize_model_grads does not sum its gradient (partial over tp under SP) over tp.
T5_CROSS_NORM_NOT_SUMMED = """
import importlib

layer_module = importlib.import_module("megatron.core.transformer.transformer_layer")
built = layer_module.TransformerLayer.__init__

def unmarked_cross_norm(self, *args, **kwargs):
    built(self, *args, **kwargs)
    for param in self.pre_cross_attn_layernorm.parameters():
        param.sequence_parallel = False

layer_module.TransformerLayer.__init__ = unmarked_cross_norm
"""

# A LLaVA bug: the combined embeddings cut for sequence parallelism with a plain slice, not
# megatron's scatter, so the backward gives each rank only its chunk's gradient (no all-gather).
LLAVA_SP_SLICE = """
import importlib

tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
parallel_state = importlib.import_module("megatron.core.parallel_state")

def sliced(tensor, *args, **kwargs):
    group = parallel_state.get_tensor_model_parallel_group()
    return tensor.chunk(group.size())[group.rank()]

tensor_parallel.scatter_to_sequence_parallel_region = sliced
"""


# A planted MTP bug: the word-embedding gradients synced as before MTP kept a copy of the table
# on the last stage, so under pp the MTP stage's copy and the first stage's are not summed.
MTP_WORD_EMBEDDINGS_NOT_SUMMED = """
import importlib

finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
synced = finalize._allreduce_word_embedding_grads

def without_mtp(model, config, embd_group=None, pp_group=None):
    if not getattr(config, "mtp_num_layers", None):
        synced(model, config, embd_group, pp_group)

finalize._allreduce_word_embedding_grads = without_mtp
"""
