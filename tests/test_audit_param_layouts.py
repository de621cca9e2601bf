"""A parameter whose checkpoint layout is not how its layer splits it (audit/param_layouts.py).

megatron-core's GatedDeltaNet splits ``in_proj.weight`` into its sections in
``sharded_state_dict`` but leaves ``in_proj.bias`` one contiguous slice per rank, while the layer
splits both per section (docs/megatron.md, tests/test_megatron_ssm.py). The audit lays global
weights out by that metadata, so with biases the tp2 run differs from one rank everywhere; the
finding names the bias and the ``sharded_state_dict`` that lays it out, not the first gradient
check that showed it. Without biases the same layer's one bug (the out-norm gradient) is no
layout's.
"""

import ast
from pathlib import Path

import pytest

pytest.importorskip("megatron.core.ssm.gated_delta_net")

from shardcheck.megatron.audit.run import audit  # noqa: E402
from shardcheck.megatron.audit.sweep import Case  # noqa: E402
from shardcheck.parity.layout import Layout  # noqa: E402

LAYOUT_TITLE = "is not how the layer splits it across ranks, so a tp2 model given one rank's weights differs"


def _function_at(path: Path, line: int) -> str:
    return next(node.name for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.FunctionDef) and node.lineno == line)


def test_gdn_in_proj_bias_layout_is_named_at_its_sharded_state_dict_and_the_out_norm_is_not(audit_pools):
    import megatron.core

    biased, plain = Case("gdn", (("bias", True),), Layout(tp=2)), Case("gdn", (), Layout(tp=2))
    findings = audit([biased, plain], run_pools=audit_pools).findings
    [layout] = [f for f in findings if f.trigger["options"] == {"bias": True}]
    assert layout.title.startswith("in_proj.bias: its checkpoint layout (") and \
        LAYOUT_TITLE in layout.title, layout.title
    path, line = layout.location.rsplit(":", 1)
    assert path.startswith("megatron/core/ssm/gated_delta_net")
    assert _function_at(Path(megatron.core.__file__).parents[2] / path, int(line)) == "sharded_state_dict"
    [out_norm] = [f for f in findings if f.trigger["options"] == {}]
    assert LAYOUT_TITLE not in out_norm.title and "sharded_state_dict" not in out_norm.location
