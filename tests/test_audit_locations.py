"""Where a finding is located: the line that chose a wrong group (walking out from the
collective), one finding for causes that share a checker violation when no fix is verified,
and a corrected control shown only where it repaired the finding. In-process, on recorded
findings and on frames of code compiled under megatron-core-looking paths."""

import sys

import torch

from shardcheck.fuzz.findings import Finding, finding_id
from shardcheck.megatron.audit.divergence import Gap
from shardcheck.megatron.audit.findings import _merged_causes, _unique_ids
from shardcheck.megatron.audit.outcome import Outcome
from shardcheck.megatron.audit.report import (
    GRADIENT_CONTRACT,
    NORM_CONTRACT,
    case_entry,
    causes,
    control_line,
    global_group_use,
    group,
    minimal_case,
    seen_in,
    title,
)
from shardcheck.megatron.audit.sweep import Case
from shardcheck.megatron.checks.explicit import RULE, _chooser
from shardcheck.parity.layout import Layout

GENERIC = "/site/megatron/core/tensor_parallel/fake_layers.py"
MODEL = "/site/megatron/core/models/fake_model.py"

LAYERS = '''
def collective(x, group):
    return WHERE(sys._getframe(0), group)

def scatter(x, group=None):
    group = group or GLOBAL
    return collective(x, group)

def ignoring(x, group):
    return WHERE(sys._getframe(0), GLOBAL)

class Linear(torch.nn.Module):
    def forward(self, x):
        return collective(x, self.group)
'''
MODEL_CODE = '''
def passes_none(x):
    return scatter(x)

def reads_and_passes(x):
    group = GLOBAL
    return forwards(x, group)

def forwards(x, group):
    return collective(x, group)

def through_layer(layer, x):
    return layer(x)

def given_explicit(x, explicit):
    return ignoring(x, explicit)
'''


def _namespace(where):
    """Both fake files' functions in one namespace, each compiled under its own path."""
    space = {"sys": sys, "torch": torch, "GLOBAL": GLOBAL, "WHERE": where}
    exec(compile(LAYERS, GENERIC, "exec"), space)
    exec(compile(MODEL_CODE, MODEL, "exec"), space)
    return space


GLOBAL = object()  # stands for parallel_state's global group


def _line(code: str, path: str, text: str) -> str:
    number = next(n for n, line in enumerate(code.splitlines()) if text in line)
    return f"{path.split('/site/', 1)[1]}:{number + 1}"  # the code opens with a blank line 1


def test_the_call_that_passes_no_group_is_the_root_not_the_generic_layer_that_ran_it():
    space = _namespace(lambda frame, group: _chooser(frame, group))
    assert space["passes_none"](1) == f"{_line(MODEL_CODE, MODEL, 'return scatter(x)')} in passes_none"


def test_a_group_passed_down_as_an_argument_is_chosen_where_it_was_read():
    space = _namespace(lambda frame, group: _chooser(frame, group))
    assert space["reads_and_passes"](1) == f"{_line(MODEL_CODE, MODEL, 'return forwards(x, group)')} in reads_and_passes"


def test_a_layer_built_without_the_group_is_located_where_it_was_built():
    built = {}
    space = _namespace(lambda frame, group: _chooser(frame, group, built))
    layer = space["Linear"]()
    layer.group = GLOBAL
    built[layer] = "megatron/core/transformer/attention.py:2097 in CrossAttention.__init__"
    assert space["through_layer"](layer, 1) == built[layer]


def test_the_harness_choosing_the_group_gives_no_megatron_root():
    space = _namespace(lambda frame, group: _chooser(frame, group))
    assert space["collective"](1, GLOBAL) is None  # called from this test: the harness


def test_a_generic_function_that_ignores_the_group_it_was_given_is_the_root():
    import torch.distributed as dist

    explicit = dist.ProcessGroup(dist.HashStore(), 0, 1)  # the model's group, never initialised
    space = _namespace(lambda frame, group: _chooser(frame, group))
    assert space["given_explicit"](1, explicit) == f"{_line(LAYERS, GENERIC, 'WHERE(sys._getframe(0), GLOBAL)')} in ignoring"


def test_a_group_given_to_transformer_engine_is_chosen_by_the_megatron_line_that_gave_it():
    """TE's Python is passed like torch's: MTP's ``te_checkpoint`` call handing parallel_state's
    group to TE's checkpoint, whose backward gathers on it, is the root (#7452 finding 4)."""
    library = "/site/transformer_engine/pytorch/fake_distributed.py"
    space = {"sys": sys, "GLOBAL": GLOBAL, "WHERE": lambda frame, group: _chooser(frame, group)}
    exec(compile("\ndef checkpoint(x, tp_group):\n    return WHERE(sys._getframe(0), tp_group)\n",
                 library, "exec"), space)
    code = "\ndef checkpointed(x):\n    return checkpoint(x, GLOBAL)\n"
    exec(compile(code, MODEL, "exec"), space)
    assert space["checkpointed"](1) == f"{_line(code, MODEL, 'return checkpoint(x, GLOBAL)')} in checkpointed"


def _use(line: int, function: str = "CrossAttention.__init__", file: str = "megatron/core/transformer/attention.py"):
    return {"rule": RULE, "location": f"{file}:{line}", "op": "all_reduce", "group": "tp", "function": function,
            "showed": "megatron/core/tensor_parallel/layers.py:639", "line": f"checker: {file}:{line}: ..."}


def test_a_constructor_building_two_layers_without_the_group_is_one_place_under_every_layout():
    """Under sp the kv projection's all-gather runs first, without sp the q projection's
    backward all-reduce: either way the finding is at the function's first such line."""
    outcome = Outcome(Case("t5", (), Layout.parse("tp2-dp2-sp@dp-tp")),
                      violations=[_use(2109), _use(2097), _use(50, "other", "megatron/core/x.py")])
    assert global_group_use(outcome)["location"] == "megatron/core/transformer/attention.py:2097"
    assert "CrossAttention.__init__ builds the layer without it (issued at megatron/core/tensor_parallel/" \
        "layers.py:639)" in title(("", ""), outcome)


def _finding(options: dict, checker: str | None, repaired: bool | None) -> Finding:
    control = None if repaired is None else {"fix": "global smoothing", "equal_to_reference": repaired,
                                             "result": "corrected == reference" if repaired else "still differs"}
    trigger = {"component": "output_loss", "options": options, "layout": "tp2"}
    return Finding.audited(trigger, [], control, title="t", kind="type+numeric", location="x.py:1", contract="c",
                           checker=checker, cases=[{"layout": "tp2", "options": options}])


DOUBLE = "checker: double count at megatron/core/tensor_parallel/cross_entropy.py:150 in c10d.allreduce_.default: {tp:R}"


def test_causes_with_no_verified_fix_and_one_violation_are_one_finding_with_both_triggers():
    smoothing = _finding({"label_smoothing": 0.1}, "checker: mean over shard at x.py:176 in aten.sub: {tp:R}", True)
    gathered = _finding({"parallel_output": False}, DOUBLE, False)
    runtime = _finding({"runtime_gather_output": True}, DOUBLE.replace("{tp:R}", "{tp:R, dp:R}"), False)
    kept = _merged_causes([smoothing, gathered, runtime])
    assert kept == [smoothing, gathered]
    assert [s["options"] for s in gathered.same_fix] == [{"runtime_gather_output": True}]
    assert gathered.same_fix[0]["corrected"] is None
    assert "the independent trigger runtime_gather_output=True" in gathered.seen_in[-1]
    # a fix shown only where it repaired the finding
    assert control_line(smoothing) == "corrected == reference"
    assert control_line(gathered).startswith("no verified fix")
    assert control_line(_finding({}, None, None)).startswith("no verified fix")


def test_causes_without_a_checker_line_or_a_verified_fix_stay_apart():
    first, second = _finding({"a": 1}, None, False), _finding({"b": 1}, None, None)
    assert _merged_causes([first, second]) == [first, second]


ROUTER = "checker: contract at megatron/core/transformer/moe/router.py:420 in contract: {cp:R}"


def test_a_cause_the_fix_repairs_and_one_it_does_not_with_one_violation_are_one_finding():
    """The router's token count reached by the MoE model's padding_mask (its fix leaves other
    outputs differing) and by the router's padding (repaired): one finding, shown with the
    verified fix, the other trigger noted with what the fix left."""
    model = _finding({"padding_mask": True}, ROUTER, False)
    model.control["result"] = "still differs: grad/w (max abs error 0.025 after the fix)"
    router = _finding({"padding": True}, ROUTER, True)
    assert _merged_causes([model, router]) == [router]
    assert router.same_fix == [{**model.trigger, "cases": model.cases, "corrected": None}]
    assert router.seen_in[-1] == ("the same violation shows for the independent trigger padding_mask=True "
                                  "(under tp2; the fix tried there: still differs: grad/w (max abs error "
                                  "0.025 after the fix))")
    # a cause sharing its fix with one and its violation with another joins both
    other = _finding({"bias": True}, "checker: non-linear on partial at y.py:3 in aten.gt: {cp:P}", True)
    third = _finding({"seq": 4}, "checker: non-linear on partial at y.py:3 in aten.gt: {cp:P}", False)
    assert _merged_causes([other, _finding({"a": 1}, None, True), third]) == [other]
    assert [s["options"] for s in other.same_fix] == [{"a": 1}, {"seq": 4}]


def test_two_causes_at_one_place_whose_options_differ_in_values_only_get_two_ids():
    findings = [Finding.audited({"component": "hybrid", "options": {"position_embedding": value}, "layout": "tp2"},
                                [], None, title="t", kind="numeric-only", location="x.py:1", contract="c")
                for value in ("mrope", "none")]
    assert findings[0].id == findings[1].id  # the id hashes the option names
    ids = [f.id for f in _unique_ids(findings)]
    assert ids[0] != ids[1] and ids[0] == finding_id("x.py:1", "c", ["position_embedding"])

def test_a_parameter_the_norm_miscounts_is_titled_by_where_its_tp_was_declared():
    declared = {"w": "has no tensor_model_parallel (built at megatron/core/transformer/dot_product_attention.py:127 "
                     "in __init__)"}
    outcome = Outcome(Case("gpt", (("softmax_type", "learnable"),), Layout(tp=2)),
                      [Gap("norm_counted/w", 0.5, 1.0, 0.5, 0.5, 1e-6)], declared=declared)
    assert title(("megatron/core/transformer/dot_product_attention.py:127", NORM_CONTRACT), outcome) == (
        f"the gradient norm miscounts w, which {declared['w']}, under tp2 (softmax_type=learnable)")


# ---- a gradient bug at the line that built the parameter, whichever component reached it ----

GDN_LINE = "megatron/core/ssm/gated_delta_net/common.py:256"


def _unreduced(param: str, location: str, op: str = "check_gradients") -> dict:
    return {"rule": "unreduced gradient", "location": location, "op": op,
            "line": f"checker: unreduced gradient at {location} in {op}: {param}: parameter R on tp, gradient P"}


def _gradient_outcome(component: str, param: str, *violations: dict) -> Outcome:
    return Outcome(Case(component, (), Layout(tp=2)), [Gap(f"grad/{param}", 0.5, 1.0, 0.5, 0.5, 1e-6)],
                   violations=list(violations), entry=f"megatron/core/{component}_entry.py:1")


def test_a_layer_alone_and_in_a_model_are_one_finding_at_the_line_that_built_the_parameter():
    layer = _gradient_outcome("gdn", "out_norm.weight", _unreduced("out_norm.weight", GDN_LINE))
    model = _gradient_outcome("hybrid", "decoder.layers.1.self_attention.out_norm.weight",
                              _unreduced("decoder.layers.1.self_attention.out_norm.weight", GDN_LINE))
    [(key, members)] = group([layer, model]).items()
    assert key == (GDN_LINE, GRADIENT_CONTRACT)
    [cause] = causes(members)
    trigger = minimal_case(cause)
    assert trigger is layer and seen_in(cause, trigger)[-1] == "components: gdn, and through hybrid"
    assert [case_entry(o.case, trigger.case.component) for o in cause] == [
        {"layout": "tp2", "options": {}}, {"component": "hybrid", "layout": "tp2", "options": {}}]


def test_a_gradient_checked_only_at_the_optimizer_step_or_right_is_not_located_where_built():
    at_step = _unreduced("w", "megatron/core/optimizer/optimizer.py:1296", op="optimizer.step")
    other = _unreduced("v", GDN_LINE)  # a parameter whose gradient agrees with one rank
    for outcome in (_gradient_outcome("gpt", "w", at_step), _gradient_outcome("gpt", "w", other)):
        [key] = group([outcome])
        assert key == ("megatron/core/gpt_entry.py:1", "outputs match the one-rank run")


TE_NORM = "/site/transformer_engine/pytorch/ops/fake_norm.py"
GDN_MODULE = "/site/megatron/core/ssm/fake_gdn.py"
NORM_CODE = """
class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
"""
LAYER_CODE = """
class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.ones(2))
        self.out_norm = Norm()
"""


def _compiled_class(monkeypatch, code: str, path: str, module: str, **names) -> type:
    """The one class ``code`` defines, compiled under ``path`` as module ``module`` (registered
    for the test, its source readable by inspect through linecache)."""
    import linecache
    import types

    monkeypatch.setitem(linecache.cache, path, (len(code), None, code.splitlines(True), path))
    space = types.ModuleType(module)
    space.__file__ = path
    space.__dict__.update(torch=torch, **names)
    monkeypatch.setitem(sys.modules, module, space)
    exec(compile(code, path, "exec"), space.__dict__)
    return next(v for k, v in vars(space).items() if isinstance(v, type) and k not in names)


def test_a_parameter_of_a_library_module_is_built_where_megatron_core_builds_that_module(monkeypatch):
    from shardcheck.megatron.checks.typecheck import construction_site

    norm = _compiled_class(monkeypatch, NORM_CODE, TE_NORM, "transformer_engine.pytorch.ops.fake_norm")
    layer = _compiled_class(monkeypatch, LAYER_CODE, GDN_MODULE, "megatron.core.ssm.fake_gdn", Norm=norm)()
    # Transformer Engine's norm assigns its weight itself, but megatron-core's line built the norm
    assert construction_site(layer, "out_norm.weight") == f"{GDN_MODULE}:6"
    assert construction_site(layer, "A_log") == f"{GDN_MODULE}:5"


# ---- a typed case that a contracted result confirms: numeric, at the contracted function ----

ROUTER_CALL = "megatron/core/transformer/moe/router.py:420"


def _token_count_case(layout: str, counted: bool) -> Outcome:
    """The MoE GPT given a padding mask: the checker breaks the token count's contract at the
    router's call; where the calls align with one rank's (not under dp), the count itself is
    compared: twice the one-rank count (read after the in-place all-reduce), no output moved."""
    from shardcheck.megatron.audit.divergence import CallGap

    gap = Gap("get_tokens_per_expert_and_token_count#0.local_num_tokens", 58.0, 29.0, 29.0, 1.0, 1e-6)
    violation = {"rule": "contract", "location": ROUTER_CALL, "op": "contract",
                 "line": f"checker: contract at {ROUTER_CALL} in contract: {{tp:R}}"}
    return Outcome(Case("moe", (("padding_mask", True),), Layout.parse(layout)), [],
                   CallGap("get_tokens_per_expert_and_token_count", 0, gap) if counted else None,
                   [violation])


def test_a_checker_violation_whose_contracted_result_differs_is_confirmed_at_the_function():
    from shardcheck.megatron.audit.report import effect, kind, outputs_moved
    from shardcheck.megatron.checks.contracts import BY_NAME

    counted, under_dp = _token_count_case("tp2-sp", True), _token_count_case("tp2-dp2-sp", False)
    [(key, members)] = group([counted, under_dp]).items()
    contract = BY_NAME["get_tokens_per_expert_and_token_count"]
    assert key == (contract.location(), contract.notation())  # moe_utils.py, not the router's call
    assert key[0].startswith("megatron/core/transformer/moe/moe_utils.py:")
    assert minimal_case(members) is counted and kind(members, "checker: contract") == "type+numeric"
    # a type-only case stays type-only, and a finding that moved no output gets no script
    assert kind([under_dp], "checker: contract") == "type-only"
    found = Finding.audited({"component": "moe", "options": {}, "layout": "tp2-sp"}, effect(counted), None,
                            title="", location=key[0], contract=key[1],
                            first_divergence=counted.call_gap.gap.summary())
    assert not outputs_moved(found)


def test_mtp_losses_add_up_over_data_parallel_ranks_where_one_micro_batch_holds_the_whole_batch():
    from shardcheck.megatron.audit.divergence import first_call_gap
    from shardcheck.megatron.checks.contracts import ProbeRecord

    def calls(loss: float) -> list[ProbeRecord]:
        return [ProbeRecord("process_mtp_loss", 0, [torch.tensor([loss])], {})]

    reference = calls(4.0)
    assert first_call_gap(Layout(dp=2), [calls(1.0), calls(3.0)], reference) is None
    # each rank normalised by its own token counts: the sum over dp parts ways
    found = first_call_gap(Layout(dp=2), [calls(1.0), calls(2.5)], reference)
    assert found is not None and found.gap.name == "process_mtp_loss#0.mtp_losses"
