"""Programs on which the checker once disagreed with the numbers, shrunk, with their ground
truth: the oracle's outcome by the one-rank run ("right", "wrong" at a step, or "undecided"
where the checker makes no claim the numbers could test)."""

from shardcheck.fuzz.oracle import Input, Program, Step


def one(layout, placements, *steps, inputs=1):
    ins = tuple(Input((8, 8), placements) for _ in range(inputs))
    return Program(layout, ins, tuple(Step(op, args, params) for op, args, params in steps), seed=3)


TP = (("tp", "P"),)
TS0, TS1 = (("tp", "S(0)"),), (("tp", "S(1)"),)
G = (("g", "tp"),)

# (name, program, outcome, first wrong step)
REGRESSIONS = [
    # typed R: every rank got rank 0's partial
    ("broadcast of a partial sum", one("tp2", TP, ("broadcast", (0,), G)), "wrong", 0),
    # typed R: the mean of partial sums is the sum over n on every rank, a P(even)
    ("all_reduce AVG of a partial sum", one("tp2", TP, ("all_reduce", (0,), (*G, ("op", "avg")))), "right", None),
    ("reduce_scatter AVG of a partial sum",
     one("tp2", TP, ("reduce_scatter_tensor", (0,), (*G, ("op", "avg")))), "wrong", 0),
    # typed R: x ** n
    ("all_reduce PRODUCT of R", one("tp2", (("tp", "R"),), ("all_reduce", (0,), (*G, ("op", "product")))),
     "wrong", 0),
    # typed S(0): the pieces were cut along dim 1
    ("list reduce_scatter along dim 1", one("tp2", TP, ("reduce_scatter_list", (0,), (*G, ("dim", 1)))),
     "right", None),
    ("Megatron's reduce-scatter along the last dim", one("tp2-dp2", (("tp", "P"), ("dp", "R")),
                                                         ("reduce_scatter_last_dim", (0,), G)), "right", None),
    ("functional reduce-scatter along dim 1", one("tp4", TP, ("f_reduce_scatter", (0,), (*G, ("dim", 1)))),
     "right", None),
    # typed V: the all-to-all of stacked column blocks of a sequence shard is the column shard
    ("Megatron's sp2hp all-to-all", one("tp2", TS0, ("sp_to_hp", (0,), G)), "right", None),
    # typed R: a gather of a sequence shard joined along the last dim
    ("gather along the last dim of a dim-0 shard", one("tp2", TS0, ("gather_last_dim", (0,), G)), "wrong", 0),
    ("reduce of R to one rank", one("tp2", (("tp", "R"),), ("reduce", (0,), G)), "wrong", 0),
    # typed S(1): a Python number read from a shard differs per rank
    ("x * shard.sum().item()", one("tp4", TS1, ("scale_by_item", (0, 0), ())), "undecided", 0),
    # typed S(0): each rank wrote into the first half of its own rows
    ("in place into a view cut along the shard dim", one("tp2", TS0, ("add_into_view", (0, 0), (("dim", 0),))),
     "undecided", 0),
    # typed G(1): a softmax of gathered blocks mixes them
    ("softmax of gathered blocks", one("tp2", TS1, ("all_gather_into_tensor", (0,), G),
                                       ("log_softmax", (1,), (("dim", 0),))), "undecided", 1),
    # gathered over both axes of a 2x2 mesh: blocks in world-rank order
    ("gather over a group spanning two axes", one("tp2-dp2", (("tp", "S(1)"), ("dp", "S(1)")),
                                                  ("f_all_gather", (0,), (("g", "world"), ("dim", 0)))),
     "right", None),
]

# the loss added on one rank only, then summed: its contribution, no double count
REGRESSIONS += [
    ("zeros added into on one rank, then summed",
     one("tp2", (("tp", "R"),), ("accumulate_on_first_rank", (0,), G), ("all_reduce", (1,), G)), "right", None),
    ("zeros added into on every rank, then summed", one("tp2", (("tp", "R"),), ("zeros_plus", (0,), ()),
                                                        ("all_reduce", (1,), G)), "wrong", 1),
]

# a dim sharded on both axes (dp outside tp): gathering the inner axis leaves the outer one's
# shard whole (was typed sections), gathering the outer one leaves the inner one's pieces as
# sections
S1_BOTH = (("tp", "S(1)"), ("dp", "S(1)"))
REGRESSIONS += [
    ("gather the inner axis of a dim sharded twice",
     one("tp2-dp2", S1_BOTH, ("f_all_gather", (0,), (("g", "tp"), ("dim", 1)))), "right", None),
    ("gather the outer axis of a dim sharded twice",
     one("tp2-dp2", S1_BOTH, ("gather_last_dim", (0,), (("g", "dp"),))), "right", None),
]
REGRESSIONS += [
    # gathering the outer axis of rows sharded twice: the inner axis' rows are sections
    ("gather the outer axis of rows sharded twice",
     one("tp2-dp2", (("tp", "S(0)"), ("dp", "S(0)")), ("all_gather_into_tensor", (0,), (("g", "dp"),))),
     "right", None),
]

# a branch on the rank (``if rank == 0: x = x + b``): typed R (or S, P + R reported as an
# affine term on every rank); the frame that compared the rank makes V, so no claim
R_TP = (("tp", "R"),)
REGRESSIONS += [
    ("a term added to a replicated value on the first rank", one("tp2", R_TP, ("add_on_first_rank", (0, 0), G)),
     "undecided", 0),
    ("a term added to a shard on the first rank",
     one("tp2-dp2", (("tp", "S(0)"), ("dp", "R")), ("add_on_first_rank", (0, 0), G)), "undecided", 0),
    # right (the term is added once to the partial sum), but V: a rank cannot tell whether
    # the others added it too
    ("a term added to a partial sum on the first rank",
     Program("tp2", (Input((8, 8), TP), Input((8, 8), R_TP)), (Step("add_on_first_rank", (0, 1), G),)),
     "undecided", None),
]

# masked_select / masked_scatter: unknown before (every op after them untyped, as in the MoE
# allgather dispatcher); row shards stay row shards
REGRESSIONS += [
    ("masked select and scatter back of a row shard",
     one("tp2", TS0, ("masked_roundtrip", (0, 1), ()), inputs=2), "right", None),
    ("masked sum of a row shard", one("tp2", TS0, ("masked_sum", (0, 1), ()), inputs=2), "right", None),
    ("masked sum of a partial sum under a replicated mask",
     Program("tp2", (Input((8, 8), TP), Input((8, 8), R_TP)), (Step("masked_sum", (0, 1), ()),)),
     "right", None),
    ("a mask made from a partial sum", one("tp2", TP, ("masked_roundtrip", (0, 1), ()), inputs=2), "wrong", 0),
]

# a max over a dim of one element is each element itself: linear, a partial sum stays one
# (was reported "non-linear on partial"); over a dim of several elements it is the bug
REGRESSIONS += [
    ("amax over a dim of one element of a partial sum",
     one("tp2", TP, ("mean", (0,), (("dim", 0),)), ("amax", (1,), (("dim", 0),))), "right", None),
    ("amax over a dim of a partial sum", one("tp2", TP, ("mean", (0,), (("dim", 0),)), ("amax", (1,), (("dim", 1),))),
     "wrong", 1),
]

# a reduce-scatter over the outer axis (dp) of rows the inner axis (tp) shards: dp's chunks sit
# inside tp's, which S(0) on both does not say (was typed S(0) there, then V on dp); tp's shard
# holds them, S(0, outside); scattered over the inner axis, inside the outer one's rows, it is S(0)
REGRESSIONS += [
    ("reduce-scatter over the outer axis of rows the inner one shards",
     one("tp2-dp2", (("tp", "S(0)"), ("dp", "R")), ("reduce_scatter_tensor", (0,), (("g", "dp"), ("op", "avg")))),
     "right", None),
    ("reduce-scatter over the inner axis of rows the outer one shards",
     one("tp2-dp2", (("tp", "R"), ("dp", "S(0)")), ("reduce_scatter_tensor", (0,), (("g", "tp"), ("op", "avg")))),
     "right", None),
]

# x.chunk(n)[get_rank(group)] of a value not replicated on the group: one rank's chunk of each
# rank's own part is no layout (was: the part's type kept); V claims nothing. Of a replicated
# value it is the rank's shard; a piece picked by a fixed index keeps the part's type
REGRESSIONS += [
    ("a by-rank pick of a chunk of a partial sum", one("tp2", TP, ("slice_by_rank", (0,), (*G, ("dim", 0)))),
     "undecided", 0),
    ("a by-rank pick of a row chunk of a column shard", one("tp2", TS1, ("slice_by_rank", (0,), (*G, ("dim", 0)))),
     "undecided", 0),
    ("a pick by the rank over both axes of a dim-0 shard of one",
     one("tp2-dp2", (("tp", "R"), ("dp", "S(0)")), ("slice_by_rank", (0,), (("g", "world"), ("dim", 1)))),
     "undecided", 0),
    ("a by-rank pick of a chunk of a replicated value", one("tp2", R_TP, ("slice_by_rank", (0,), (*G, ("dim", 0)))),
     "right", None),
    ("a by-tp-rank pick of a chunk of a value partial over dp",
     one("tp2-dp2", (("tp", "R"), ("dp", "P")), ("slice_by_rank", (0,), (*G, ("dim", 1)))), "right", None),
    ("a fixed pick of a chunk of a partial sum", one("tp2", TP, ("chunk", (0,), (("dim", 0), ("i", 1)))),
     "right", None),
]

# zeros one rank added a value into, then an op on them: the value itself, or that rank's
# contribution (was: read as the value, R, on every rank); a copy of them summed is the value
REGRESSIONS += [
    ("an op on zeros one rank added into",
     one("tp2", R_TP, ("accumulate_on_first_rank", (0,), G), ("neg", (1,), ())), "undecided", None),
    ("a copy of zeros one rank added into, then summed",
     one("tp2", R_TP, ("accumulate_on_first_rank", (0,), G), ("clone", (1,), ()), ("all_reduce", (2,), G)),
     "right", None),
]

# a SUM reduce-scatter of zeros one rank added into: that rank's contribution, summed (was
# reported "scatter of replicated"); added on every rank, a double count
REGRESSIONS += [
    ("reduce-scatter of zeros one rank added into",
     one("tp2", R_TP, ("accumulate_on_first_rank", (0,), G), ("reduce_scatter_list", (1,), (*G, ("dim", 0)))),
     "right", None),
    ("reduce-scatter of zeros every rank added into",
     one("tp2", R_TP, ("zeros_plus", (0,), ()), ("reduce_scatter_tensor", (1,), (*G, ("op", "sum")))), "wrong", 1),
]

# a dim sharded on both axes (dp outside tp), continued: sections on both axes nest (the outer
# axis' sections hold the inner axis' joined pieces); the functional gather over the outer axis
# leaves the inner one's pieces as sections (was S); a list gather over the inner axis leaves
# the outer one's shard whole (was sections); Megatron's last-dim reduce-scatter keeps a rank's
# rows of blocks stacked on dim 0 (was the stacked sections); a gather over both axes of a value
# they shard along different dims stacks a grid of blocks (was G(1) and R), V
S0_BOTH = (("tp", "S(0)"), ("dp", "S(0)"))
TP_P_DP_S0 = (("tp", "P"), ("dp", "S(0)"))
REGRESSIONS += [
    ("cat of a value sharded twice with itself", one("tp2-dp2", S0_BOTH, ("cat", (0, 0), (("dim", 0),))),
     "right", None),
    ("functional gather over the outer axis of rows sharded twice",
     one("tp2-dp2", S0_BOTH, ("f_all_gather", (0,), (("g", "dp"), ("dim", 0)))), "right", None),
    ("list gather over the inner axis of rows sharded twice",
     one("tp2-dp2", S0_BOTH, ("all_gather_list", (0,), (*G, ("dim", 0)))), "right", None),
    ("Megatron's last-dim reduce-scatter of a partial sum of row shards",
     one("tp2-dp2", TP_P_DP_S0, ("reduce_scatter_last_dim", (0,), G)), "right", None),
    ("functional reduce-scatter along dim 1 of a partial sum of row shards",
     one("tp2-dp2", TP_P_DP_S0, ("f_reduce_scatter", (0,), (*G, ("dim", 1)))), "right", None),
    ("gather over both axes of a value they shard along different dims",
     one("tp2-dp2", (("tp", "S(1)"), ("dp", "S(0)")), ("all_gather_into_tensor", (0,), (("g", "world"),))),
     "undecided", 0),
]

# the judge: a product of partial sums reported where it reads x - x (zero on one rank, parts
# that cancel on the ranks): the numbers fit by the cancellation, they cannot tell (was a false
# alarm); a send into a buffer shaped like a transposed value (was a rank error: Gloo needs
# contiguous buffers)
REGRESSIONS += [
    ("a product of partial sums next to a value zero on one rank",
     one("tp2-dp2", (("tp", "P"), ("dp", "P")), ("all_reduce", (0,), (*G, ("op", "avg"))), ("sub", (0, 1), ()),
         ("div", (2, 1), ())), "undecided", None),
    ("send and receive of a transposed value", one("tp2", R_TP, ("transpose", (0,), ()), ("send_recv", (1,), G)),
     "undecided", None),
]

# a cut inside one rank's block of gathered blocks (was typed R, as a whole block is): V
REGRESSIONS += [
    ("a row of gathered column blocks",
     one("tp2", TS1, ("all_gather_into_tensor", (0,), G), ("narrow", (1,), (("dim", 0),))), "undecided", 1),
]

# a rank's chunk joined with itself along its dim (seed 1): its copies make no whole (was
# typed R, as distinct chunks put back together are): V
REGRESSIONS += [
    ("a by-rank chunk joined with itself", one("tp2", R_TP, ("slice_by_rank", (0,), (*G, ("dim", 1))),
                                               ("cat", (1, 1), (("dim", 1),))), "undecided", 1),
]

# a gather of sections (a dim joined from pieces each cut over the axis) stacks each rank's
# part of every section in turn, in rank order: no layout of the joined value (was R), V; the
# mean over an axis of zeros one rank added into is the value over n on every rank, a partial
# sum of equal shares (was R); added on every rank it is the value; what a scatter delivers is
# the root's, which the other ranks cannot type on the axes outside the group (was the
# receiving buffer's type there), V; an add into an empty view adds nothing (was reported)
TI_DS1 = (("tp", "I"), ("dp", "S(1)"))
REGRESSIONS += [
    ("Megatron's last-dim gather of sections", one("tp2-dp2", TI_DS1, ("cat", (0, 0), (("dim", 1),)),
                                                   ("gather_last_dim", (1,), (("g", "dp"),))), "undecided", 1),
    ("gather of rows gathered over the outer axis, over the inner one",
     one("tp2-dp2", S0_BOTH, ("all_gather_into_tensor", (0,), (("g", "dp"),)),
         ("all_gather_into_tensor", (1,), G)), "undecided", 1),
    ("mean all-reduce of zeros one rank added into",
     one("tp2", R_TP, ("accumulate_on_first_rank", (0,), G), ("all_reduce", (1,), (*G, ("op", "avg")))),
     "right", None),
    ("mean all-reduce of zeros every rank added into",
     one("tp2", R_TP, ("zeros_plus", (0,), ()), ("all_reduce", (1,), (*G, ("op", "avg")))), "right", None),
    ("a scatter over tp of a value dp shards, gathered",
     one("tp2-dp2", (("tp", "R"), ("dp", "S(1)")), ("scatter", (0,), (*G, ("dim", 1))),
         ("all_gather_into_tensor", (1,), G)), "undecided", None),
    ("an add of a partial sum into an empty view",
     Program("tp2", (Input((8, 8), TP), Input((8, 8), R_TP)),
             (Step("sum", (1,), (("dim", 0),)), Step("add_into_view", (2, 0), (("dim", 0),)))), "right", None),
    ("an add of a partial sum into a view", Program("tp2", (Input((8, 8), TP), Input((8, 8), R_TP)),
                                             (Step("add_into_view", (1, 0), (("dim", 0),)),)), "wrong", 0),
]

# pieces of a list reduce-scatter laid out in memory in another order than their elements'
# (chunks of a transposed value): Gloo reduces them wrong, with no error (was S(0)), unknown; a tensor all-gather over dp of
# blocks gathered over tp interleaves them (was G(1) kept), V; the functional reduce-scatter and
# all-reduce of zeros one rank added into sum their contribution (was "scatter of replicated")
REGRESSIONS += [
    ("list reduce-scatter of chunks of a transposed value",
     one("tp4", TP, ("transpose", (0,), ()), ("reduce_scatter_list", (1,), (*G, ("dim", 0)))), "undecided", 1),
    ("list reduce-scatter of contiguous chunks", one("tp4", TP, ("reduce_scatter_list", (0,), (*G, ("dim", 0)))),
     "right", None),
    ("a gather over dp of blocks gathered over tp",
     one("tp2-dp2", (("tp", "S(1)"), ("dp", "S(0)")), ("all_gather_into_tensor", (0,), G),
         ("all_gather_into_tensor", (1,), (("g", "dp"),))), "undecided", 1),
    ("functional reduce-scatter of zeros one rank added into",
     one("tp4", R_TP, ("accumulate_on_first_rank", (0,), G), ("f_reduce_scatter", (1,), (*G, ("dim", 0)))),
     "right", None),
    ("functional reduce-scatter of zeros every rank added into",
     one("tp4", R_TP, ("zeros_plus", (0,), ()), ("f_reduce_scatter", (1,), (*G, ("dim", 0)))), "wrong", 1),
    ("functional all-reduce of zeros one rank added into",
     one("tp2", R_TP, ("accumulate_on_first_rank", (0,), G), ("f_all_reduce", (1,), G)), "right", None),
    # a broadcast copy into a buffer shaped like a shard fills a shard of the broadcast value
    # (was R: the buffer's new_empty read as a fresh R tensor, the copy as its source's type)
    ("a broadcast copy into a buffer shaped like a row shard",
     Program("tp4", (Input((8, 8), R_TP), Input((8, 8), TS0)),
             (Step("narrow", (0,), (("dim", 0),)), Step("copy_into", (1, 2), ()))), "right", None),
    # typed S(1, outside) on tp, S(1) on dp (right): the oracle rebuilt it in the mesh's order,
    # dp's pieces holding tp's, and counted a miss; a shard marked outside joins last
    ("a by-dp-rank pick of a column chunk of a tp column shard",
     one("tp2-dp2", (("tp", "S(1)"), ("dp", "R")), ("slice_by_rank", (0,), (("g", "dp"), ("dim", 1)))),
     "right", None),
]
