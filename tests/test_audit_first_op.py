"""A numeric-only divergence narrowed to its first op: the ops recorded with their call sites,
aligned between a one-rank run and the ranks of a layout, rebuilt from their types, and the
first that parts ways named (in process, no ranks: recorded op lists from two runs)."""

import dataclasses
import textwrap

import torch

from shardcheck.megatron.audit.divergence import first_op_gap, op_gaps, split_gradient_gap
from shardcheck.parity.layout import Layout
from shardcheck.parity.op_record import OpRecord, recording_ops
from shardcheck.typecheck.locations import harness_code

TP2 = Layout(tp=2)


def _op(site, op, values, placements=None, index=0, mark=0, backward=""):
    values = tuple(values)
    return OpRecord(f"/x/megatron/core/{site}", "forward", op, backward, index, values,
                    tuple(placements or (None,) * len(values)), mark)


def _program(x, w, planted=False):
    """The one-rank run and two tp ranks of ``y = x @ w`` (w cut by columns), ``z = y * 2``,
    ``s = z.sum()`` (a partial sum on each rank), ``loss = s / 4``; ``planted``: rank 1's
    ``z`` off by 0.5 (the bug)."""
    y, z = x @ w, (x @ w) * 2
    reference = [_op("layers.py:10", "aten.mm.default", [y]), _op("model.py:20", "aten.mul.Tensor", [z]),
                 _op("model.py:21", "aten.sum.default", [z.sum()]),
                 _op("model.py:22", "aten.div.Tensor", [z.sum() / 4])]
    ranks = []
    for rank, piece in enumerate(w.chunk(2, 1)):
        y_r = x @ piece
        z_r = y_r * 2 + (0.5 if planted and rank == 1 else 0.0)
        ranks.append([_op("layers.py:10", "aten.mm.default", [y_r], [{"tp": "S(1)"}]),
                      _op("model.py:20", "aten.mul.Tensor", [z_r], [{"tp": "S(1)"}]),
                      _op("model.py:21", "aten.sum.default", [z_r.sum()], [{"tp": "P"}]),
                      _op("model.py:22", "aten.div.Tensor", [z_r.sum() / 4], [{"tp": "P"}])])
    return ranks, reference


def test_the_first_op_that_parts_ways_is_named_and_a_correct_run_names_none():
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 6)
    assert first_op_gap(TP2, *_program(x, w)) is None
    found = first_op_gap(TP2, *_program(x, w, planted=True))
    assert found is not None
    assert found.line().startswith("first op: megatron/core/model.py:20 in forward: aten.mul.Tensor (max abs error 0.5")
    assert found.location == "megatron/core/model.py:20"


def test_ops_after_the_first_diverging_contracted_call_are_passed_over():
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 6)
    ranks, reference = _program(x, w, planted=True)
    assert [ref.site.rsplit("/", 1)[1] for ref, _ in op_gaps(TP2, ranks, reference)] == [
        "model.py:20", "model.py:21", "model.py:22"]
    late = [OpRecord(*[getattr(r, f) for f in ("site", "function", "op", "backward", "index", "values",
                                              "placements")], mark=1) for r in reference]
    assert first_op_gap(TP2, ranks, late, until=0) is None
    assert first_op_gap(TP2, ranks, late, until=1).location == "megatron/core/model.py:20"


def test_ops_whose_types_cannot_rebuild_them_or_whose_count_differs_are_not_compared():
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 6)
    ranks, reference = _program(x, w, planted=True)
    varying = [[OpRecord(*[getattr(r, f) for f in ("site", "function", "op", "backward", "index", "values")],
                         placements=({"tp": "V"},)) for r in calls] for calls in ranks]
    assert first_op_gap(TP2, varying, reference) is None
    twice = [[*calls, OpRecord(*[getattr(calls[1], f) for f in ("site", "function", "op", "backward")], 1,
                               calls[1].values, calls[1].placements)] for calls in ranks]
    assert first_op_gap(TP2, twice, reference).location == "megatron/core/model.py:21"


def test_a_pipeline_stage_op_is_rebuilt_from_the_stage_that_ran_it():
    value = torch.arange(6.0)
    reference = [_op("stage.py:1", "aten.mul.Tensor", [value]), _op("head.py:2", "aten.add.Tensor", [value + 1])]
    ranks = [[_op("stage.py:1", "aten.mul.Tensor", [value], [{"pp": "V"}])],
             [_op("head.py:2", "aten.add.Tensor", [value + 1.5], [{"pp": "V"}])]]
    assert first_op_gap(Layout(pp=2), ranks, reference).location == "megatron/core/head.py:2"


def test_a_step_that_a_later_step_of_the_same_function_corrects_is_not_where_values_part_ways():
    """``aux_loss * num_local_tokens * cp_size``: the first product is each rank's share of
    another factoring, the second the global value; a vocab-parallel embedding's lookup is
    masked on its next line. Only a result that stays different counts."""
    reference = [_op("router.py:633", "aten.mul.Tensor", [torch.tensor(16.0)]),
                 _op("router.py:633", "aten.mul.Tensor", [torch.tensor(16.0)], index=1)]
    ranks = [[_op("router.py:633", "aten.mul.Tensor", [torch.tensor(4.0)], [{"cp": "P"}]),
              _op("router.py:633", "aten.mul.Tensor", [torch.tensor(8.0)], [{"cp": "P"}], index=1)]] * 2
    assert first_op_gap(Layout(cp=2), ranks, reference) is None
    assert first_op_gap(Layout(cp=2), [calls[:1] for calls in ranks], reference[:1]) is not None
    rows = torch.arange(6.0).reshape(3, 2)
    reference = [_op("layers.py:356", "aten.embedding.default", [rows])]  # one rank masks nothing
    ranks = [[_op("layers.py:356", "aten.embedding.default", [rows / 2 + 1], [{"tp": "P"}]),
              _op("layers.py:359", "aten.index_put_.default", [rows / 2], [{"tp": "P"}])]] * 2
    assert first_op_gap(TP2, ranks, reference) is None
    elsewhere = [[calls[0], _op("other.py:1", "aten.add.Tensor", [rows], [{"tp": "P"}]), calls[1]]
                 for calls in ranks]
    assert first_op_gap(TP2, elsewhere, reference).location == "megatron/core/layers.py:356"


def test_a_sequence_gathered_over_cp_in_the_ranks_order_agrees_with_one_rank():
    keys = torch.arange(8.0).reshape(4, 2)  # four sequence chunks; rank r holds r and 3 - r
    gathered = keys[[0, 3, 1, 2]]
    ranks = [[_op("attention.py:186", "aten.view.default", [gathered], [{"cp": "R"}])]] * 2
    assert first_op_gap(Layout(cp=2), ranks, [_op("attention.py:186", "aten.view.default", [keys])]) is None


def test_recorded_ops_carry_their_call_site_and_a_backward_op_its_forward_line(tmp_path):
    code = tmp_path / "lib" / "model.py"
    code.parent.mkdir()
    code.write_text(textwrap.dedent("""\
        import torch

        def build():
            return torch.ones(3)

        def forward(x, w, probe):
            y = x * w
            probe(y)
            keep = 1.0 - (x > 0).float()
            return (y.sin() * keep).sum()
        """))
    probe = tmp_path / "probe.py"
    probe.write_text("def copy(x):\n    return x.clone()\n")
    namespace: dict = {}
    exec(compile(code.read_text(), str(code), "exec"), namespace)
    probe_ns: dict = {}
    exec(compile(probe.read_text(), str(probe), "exec"), probe_ns)
    started = [False]
    x = torch.randn(3, requires_grad=True)
    with harness_code(str(probe)), recording_ops(str(code.parent) + "/", started=lambda: started[0],
                                                 probes=(str(probe),)) as records:
        namespace["build"]()
        started[0] = True
        loss = namespace["forward"](x, torch.full((3,), 2.0), probe_ns["copy"])
        loss.backward()
    lines = [(r.site.rsplit("/", 1)[1], r.function, r.op, r.backward) for r in records]
    assert lines[:4] == [("model.py:7", "forward", "aten.mul.Tensor", ""),  # not the mask's cast and rsub
                         ("model.py:10", "forward", "aten.sin.default", ""),
                         ("model.py:10", "forward", "aten.mul.Tensor", ""),
                         ("model.py:10", "forward", "aten.sum.default", "")]
    assert ("model.py:10", "forward", "aten.cos.default", "SinBackward0") in lines
    assert ("model.py:7", "forward", "aten.mul.Tensor", "MulBackward0") in lines
    assert not any(r.function == "build" for r in records)
    assert all(r.op != "aten.clone.default" for r in records)  # the probe's copy, called at line 8
    mul = next(r for r in records if r.op == "aten.mul.Tensor" and not r.backward)
    assert torch.equal(mul.values[0], x.detach() * 2) and mul.placements == (None,)


SPLIT_FREE = '''\
import torch


class Attach(torch.autograd.Function):
    """A loss term joined to the loss through an activation's backward (as Megatron's MoE
    attaches its auxiliary losses)."""

    @staticmethod
    def forward(ctx, output, term):
        ctx.save_for_backward(term)
        return output

    @staticmethod
    def backward(ctx, grad):
        (term,) = ctx.saved_tensors
        return grad, torch.ones_like(term)


def attach(scores, term, count):
    return Attach.apply(scores, term * count)


def forward(x, w, tokens_counted):
    scores = (x @ w).softmax(-1)
    term = (scores.sum(0) ** 2).sum() / x.shape[1]
    scores = attach(scores, term, x.shape[1] if tokens_counted else 1)
    return (scores * x[..., :1]).sum()
'''


def _micro_batches(tmp_path, batches, tokens_counted):
    """The ops recorded while ``forward`` of :data:`SPLIT_FREE` (a per-token loss and a term,
    a mean over the micro-batch's sequences, scaled by the micro-batch's size where
    ``tokens_counted``, else by 1: the bug) runs forward and backward on each of ``batches``
    (``[seq, batch, hidden]``) in turn."""
    code = tmp_path / "lib" / "model.py"
    code.parent.mkdir(exist_ok=True)
    code.write_text(SPLIT_FREE)
    namespace: dict = {}
    exec(compile(SPLIT_FREE, str(code), "exec"), namespace)
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with recording_ops(str(code.parent) + "/") as records:
        for x in batches:
            namespace["forward"](x, w, tokens_counted).backward()
    return records


def test_a_gradient_that_depends_on_the_micro_batch_split_is_located_where_its_term_was_scaled(tmp_path):
    """A split-free loss's one-rank reference takes the whole batch; two data-parallel ranks
    take two micro-batches each. The term's scalars are no values the ranks' shares compare by;
    the first gradient per token that parts ways is named, located at the line of the function
    holding the term's steps that attached it to the loss (Megatron-LM e3fe5508c9's class)."""
    x = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(0))
    for counted in (True, False):
        reference = _micro_batches(tmp_path, [x], counted)
        ranks = [_micro_batches(tmp_path, [x[:, 2 * r:2 * r + 1], x[:, 2 * r + 1:2 * r + 2]], counted)
                 for r in range(2)]
        assert first_op_gap(Layout(dp=2), ranks, reference) is None  # untyped shares: nothing rebuilt
        found = split_gradient_gap(Layout(dp=2), ranks, reference)
        if counted:
            assert found is None
            continue
        assert found is not None
        attach_line = SPLIT_FREE.splitlines().index("    scores = attach(scores, term, x.shape[1] if "
                                                    "tokens_counted else 1)") + 1
        assert found.location.endswith(f"lib/model.py:{attach_line}")
        assert found.line().startswith(f"first op: {found.site} in forward: aten.")
        assert found.line().endswith(f"; its gradient scaled at {found.location} in forward")
        assert found.site.endswith(f"lib/model.py:{attach_line - 1}")  # the term's per-sequence sum
        assert split_gradient_gap(Layout(tp=2), ranks, reference) is None  # untyped: no tp piece rebuilt


def _sequence_shards(records, layout, rank, seq):
    """``records`` as tp rank ``rank`` of ``layout`` holds them under sequence parallelism: each
    value of ``seq`` rows (``[seq, batch, ...]``) its shard of rows, typed S(0) over tp, any other
    (a value reduced over the sequence) whole, typed R."""
    tp = layout.coords(rank)["tp"]

    def held(value):
        if value is None or value.dim() == 0 or value.shape[0] != seq:
            return value, {"tp": "R"}
        return value.chunk(layout.tp)[tp], {"tp": "S(0)"}

    return [dataclasses.replace(r, values=tuple(v for v, _ in kept), placements=tuple(p for _, p in kept))
            for r in records for kept in [[held(v) for v in r.values]]]


def test_a_gradient_that_depends_on_the_split_is_located_from_tp_pieces_rebuilt_by_their_types(tmp_path):
    """Under tp with sequence parallelism each rank holds a shard of a micro-batch's
    ``[seq, batch, ...]`` gradients: each micro-batch's value is rebuilt from the tp ranks'
    pieces by their types before the micro-batches are summed over the batch dim; the bug is
    located where its term was scaled, the correct variant clean (e3fe5508c9 at tp2-sp)."""
    x = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(0))
    attach_line = SPLIT_FREE.splitlines().index("    scores = attach(scores, term, x.shape[1] if "
                                                "tokens_counted else 1)") + 1
    for layout in (Layout(tp=2), Layout(tp=2, dp=2)):
        for counted in (True, False):
            reference = _micro_batches(tmp_path, [x], counted)
            ranks = []
            for rank in range(layout.world_size):
                share = x.chunk(layout.dp, 1)[layout.coords(rank)["dp"]]
                recorded = _micro_batches(tmp_path, list(share.split(1, 1)), counted)
                ranks.append(_sequence_shards(recorded, layout, rank, len(x)))
            found = split_gradient_gap(layout, ranks, reference)
            assert (found is None) == counted, (layout, found)
            if not counted:
                assert found.location.endswith(f"lib/model.py:{attach_line}")
                assert found.site.endswith(f"lib/model.py:{attach_line - 1}")
            untyped = [[dataclasses.replace(r, placements=(None,) * len(r.values)) for r in calls]
                       for calls in ranks]
            assert split_gradient_gap(layout, untyped, reference) is None  # pieces its types cannot rebuild
