"""The audit's repro scripts run the harness's own CPU kernels and patches: same code, same results;
their own code is the source of the modules in :mod:`shardcheck.megatron.repro.parts`.

Each template's script is generated; every definition in it named like one of
:mod:`shardcheck.megatron.cpu.kernels` or :mod:`shardcheck.megatron.cpu.patches` must be that
function's source (its code as it is, the docstrings left where they live) and, executed on its
own, give the harness function's results on the same inputs: a kernel on random tensors (Mamba's
SSD scan with ``dt_limit`` and ``initial_states`` included), a patch around a recording original.
A planted drift (the scan copied without ``dt_limit`` and ``initial_states``) fails both checks.
"""

import ast
import inspect
import textwrap
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from shardcheck.fuzz.findings import AUDIT, Finding  # noqa: E402
from shardcheck.fuzz.repro import ReproError  # noqa: E402
from shardcheck.megatron.audit.findings import ONE_RANK_CRASH, REPAIRED  # noqa: E402
from shardcheck.megatron.audit.report import GLOBAL_GROUP_CONTRACT  # noqa: E402
from shardcheck.megatron.checks import piece_gradients  # noqa: E402
from shardcheck.megatron.cpu import kernels, patches  # noqa: E402
from shardcheck.megatron.repro.scripts import write_audit_script  # noqa: E402
from shardcheck.megatron.repro.snippets import PARTS, part_source  # noqa: E402
from shardcheck.megatron.repro.templates import TEMPLATES  # noqa: E402

HARNESS = {name: value for module in (kernels, patches) for name, value in vars(module).items()
           if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__}
CONV = {"_refuse", "causal_conv1d_fn"}
GPT = {"_norm_with_sequence_parallel"}  # under sequence parallelism
FROM_HARNESS = {"gdn": CONV | GPT | {"causal_conv1d", "l2norm", "chunk_gated_delta_rule"},
                "mamba": CONV | {"mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "RMSNormGated"},
                "gpt": GPT, "moe": {"_to_host"}, "mtp": GPT, "t5": GPT,
                "multimodal": GPT | {"_with_default_norms"}}
LAYOUTS = ("tp2-cp2-sp-pp2", "tp2-cp2-sp", "tp2-sp", "cp2-pp2")  # the first a template takes: the most extras
OPTIONS = {"moe": {"moe_token_dispatcher_type": "alltoall"}}  # its stand-ins (tp1: Gloo takes its pieces)

# the copy the scripts kept as text until the harness's source replaced it
DRIFTED_SCAN = '''
def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D, z=None, dt_bias=None, dt_softplus=False, **_):
    dt = dt.float() + (0 if dt_bias is None else dt_bias)
    dt = torch.nn.functional.softplus(dt) if dt_softplus else dt
    B, C = (t.repeat_interleave(x.shape[2] // t.shape[2], dim=2) for t in (B, C))
    state, ys = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[3]), []
    for t in range(x.shape[1]):
        write = torch.einsum("bhp,bh,bhn->bhpn", x[:, t], dt[:, t], B[:, t])
        state = torch.exp(dt[:, t] * A)[..., None, None] * state + write
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, 1) + x * (D[:, None] if D.dim() == 1 else D)
    return y * torch.nn.functional.silu(z) if z is not None else y
'''


def _script(component: str, tmp_path, contract: str = "outputs match the one-rank run",
            kind: str = "numeric-only", control: dict | None = None) -> str:
    """The script of a finding of ``component`` in the first layout its template takes (with the
    audit's corrected ``control``, if given)."""
    for layout in LAYOUTS:
        finding = Finding(title=f"{component} under {layout}", target=component, location="megatron/core/x.py:1",
                          contract=contract, layout=layout, config=OPTIONS.get(component, {}), observed=None,
                          reference=None, kind=kind, origin=AUDIT)
        finding.control = control
        try:
            return write_audit_script(finding, tmp_path / f"{component}.py").read_text()
        except ReproError:
            continue
    raise AssertionError(f"no layout of {LAYOUTS} gets a {component} script")


def _definitions(script: str) -> dict[str, ast.stmt]:
    """The script's top-level functions and classes named like a harness kernel."""
    return {node.name: node for node in ast.parse(script).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in HARNESS}


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and len(node.body) > 1 \
                and ast.get_docstring(node) is not None:
            node.body = node.body[1:]
    return tree


def _harness_code(name: str) -> str:
    """The harness kernel's code (its docstrings removed) as text, for a script's to equal."""
    source = textwrap.dedent(inspect.getsource(HARNESS[name]))
    docstrings = {line for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and len(node.body) > 1
                  and ast.get_docstring(node) is not None
                  for line in range(node.body[0].lineno, node.body[0].end_lineno + 1)}
    return "\n".join(line for number, line in enumerate(source.strip().splitlines(), 1) if number not in docstrings)


def _source_drifts(script: str) -> set[str]:
    """The kernels whose code in the script is not the harness's: as text, or as syntax."""
    drifts = set()
    for name, node in _definitions(script).items():
        harness = _without_docstrings(ast.parse(textwrap.dedent(inspect.getsource(HARNESS[name])))).body[0]
        if ast.get_source_segment(script, node) != _harness_code(name) or ast.dump(harness) != ast.dump(node):
            drifts.add(name)
    return drifts


def _script_kernels(script: str) -> dict[str, object]:
    """The script's kernels and patches, executed on their own (with its imports of torch, math and copy)."""
    tree = ast.parse(script)
    imports = [node for node in tree.body
               if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("__future__", "torch")
               or isinstance(node, ast.Import) and all(a.name.split(".")[0] in ("torch", "math", "copy") for a in node.names)]
    namespace: dict[str, object] = {}
    exec(compile(ast.Module(body=imports + list(_definitions(script).values()), type_ignores=[]),
                 "<script kernels>", "exec"), namespace)
    return {name: namespace[name] for name in _definitions(script)}


def _inputs(seed: int = 0) -> dict[str, tuple[tuple, dict]]:
    """Random arguments of each kernel, every option the harness implements set."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)
    b, steps, heads, headdim, groups, state, width = 2, 5, 4, 3, 2, 4, 4
    inner, bc = heads * headdim, groups * state
    scan = dict(D=rand(heads), z=rand(b, steps, heads, headdim), dt_bias=rand(heads),
                initial_states=rand(b, heads, headdim, state), dt_softplus=True, dt_limit=(0.2, 0.7),
                return_final_states=True)
    conv = inner + 2 * bc
    return {
        "causal_conv1d_fn": ((rand(b, conv, steps), rand(conv, width), rand(conv)), dict(activation="silu")),
        "causal_conv1d": ((rand(b, steps, conv), rand(conv, width), rand(conv)), dict(activation="swish")),
        "l2norm": ((rand(b, steps, heads, headdim),), {}),
        "chunk_gated_delta_rule": ((rand(b, steps, heads, state), rand(b, steps, heads, state),
                                    rand(b, steps, heads, headdim), -rand(b, steps, heads).abs(),
                                    rand(b, steps, heads).sigmoid()),
                                   dict(initial_state=rand(b, heads, state, headdim), output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)),
        "mamba_chunk_scan_combined": ((rand(b, steps, heads, headdim), rand(b, steps, heads), -rand(heads).exp(),
                                       rand(b, steps, groups, state), rand(b, steps, groups, state), 4), scan),
        "mamba_split_conv1d_scan_combined": ((rand(b, steps, 2 * inner + 2 * bc + heads), rand(conv, width),
                                              rand(conv), rand(heads), -rand(heads).exp(), rand(heads), 4),
                                             dict(headdim=headdim, ngroups=groups, dt_limit=(0.2, 0.7))),
    }


def _outputs(kernel, name: str, args: tuple, kwargs: dict):
    if name == "RMSNormGated":  # a module: the same weights, gated after and before the norm
        outputs = []
        for before in (False, True):
            norm = kernel(6, eps=1e-5, group_size=3, norm_before_gate=before)
            norm.weight.data.copy_(torch.linspace(0.5, 1.5, 6))
            outputs.append(norm(*args, **kwargs))
        return tuple(outputs)
    return kernel(*args, **kwargs)


def _same(got, want) -> bool:
    if isinstance(want, tuple) or isinstance(got, tuple):
        return (type(got) is type(want) and len(got) == len(want)
                and all(_same(g, w) for g, w in zip(got, want, strict=True)))
    if want is None or got is None:
        return got is want
    return got.shape == want.shape and torch.equal(got, want)


def _to_host_results(to_host) -> list:
    """A CPU tensor asked for as numpy, and one not: through ``to_host`` around a recording original."""
    move = to_host(lambda tensor, as_numpy=False, record_stream=False: ("original", as_numpy, record_stream))
    return [move(torch.arange(3.0), as_numpy=True).tolist(), move(torch.arange(3.0), record_stream=True)]


def _norm_results(norm_with_sp) -> list:
    """What the original gets, and how the norm's parameters are marked, with and without SP."""
    seen = []

    def original_new(cls, config, hidden_size, *args, **kwargs):
        seen.append((cls, config.sequence_parallel, hidden_size, args, kwargs))
        return torch.nn.LayerNorm(hidden_size)
    marks = []
    for sp in (True, False):
        norm = norm_with_sp(original_new)(object, types.SimpleNamespace(sequence_parallel=sp), 4, 1e-5, bias=True)
        marks.append([getattr(param, "sequence_parallel", None) for param in norm.parameters()])
    return [seen, marks]


def _clip_results(with_default_norms) -> list:
    """The arguments the original ``__init__`` gets, with the norms passed or not."""
    seen = []
    init = with_default_norms(lambda self, *args, **kwargs: seen.append((args, kwargs)), "norm")
    for args, kwargs in (((), {}), (("config", "spec"), {"ln_pre_impl": "mine"}), (("a", "b", "c"), {})):
        init(None, *args, **kwargs)
    return seen


PATCH_RESULTS = {"_to_host": _to_host_results, "_norm_with_sequence_parallel": _norm_results,
                 "_with_default_norms": _clip_results}


def _number_drifts(script: str) -> set[str]:
    """The kernels whose script copy gives other outputs than the harness's on the same inputs."""
    inputs = {**_inputs(), "RMSNormGated": ((torch.randn(2, 5, 6), torch.randn(2, 5, 6)), {}), "_refuse": None}
    drifts = set()
    for name, kernel in _script_kernels(script).items():
        if name in PATCH_RESULTS:
            drifts |= {name} if PATCH_RESULTS[name](kernel) != PATCH_RESULTS[name](HARNESS[name]) else set()
            continue
        if name == "_refuse":  # no numbers: it must refuse what the harness refuses
            for options in ({"seq_idx": None}, {"seq_idx": torch.ones(1)}):
                results = [_refusal(k, options) for k in (kernel, HARNESS[name])]
                drifts |= {name} if results[0] != results[1] else set()
            continue
        args, kwargs = inputs[name]
        if not _same(_outputs(kernel, name, args, kwargs), _outputs(HARNESS[name], name, args, kwargs)):
            drifts.add(name)
    return drifts


def _refusal(refuse, options: dict) -> str | None:
    try:
        refuse(options)
    except NotImplementedError as why:
        return str(why)
    return None


@pytest.mark.parametrize("component", sorted(TEMPLATES))
def test_each_templates_kernels_and_patches_are_the_harness_source_and_give_its_results(component, tmp_path):
    script = _script(component, tmp_path)
    assert set(_definitions(script)) == FROM_HARNESS.get(component, set())
    assert _source_drifts(script) == set()
    assert _number_drifts(script) == set()


def test_a_planted_drift_of_the_mamba_scan_fails_both_checks(tmp_path):
    script = _script("mamba", tmp_path)
    harness_scan = _definitions(script)["mamba_chunk_scan_combined"]
    lines = script.splitlines()
    planted = "\n".join(lines[:harness_scan.lineno - 1] + DRIFTED_SCAN.strip().splitlines()
                        + lines[harness_scan.end_lineno:])
    assert _source_drifts(planted) == {"mamba_chunk_scan_combined"}
    # the copy ignores dt_limit and initial_states: the scan and the fused step that calls it differ
    assert _number_drifts(planted) == {"mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"}


def test_each_part_is_the_code_of_some_script_which_imports_no_shardcheck(tmp_path):
    scripts = [_script(component, tmp_path) for component in sorted(TEMPLATES)]
    scripts.append(_script("gpt", tmp_path, GLOBAL_GROUP_CONTRACT))  # a finding with a fix
    scripts.append(_script("gpt", tmp_path, kind=ONE_RANK_CRASH))  # megatron-core raising on one rank
    piece = f"{piece_gradients.PREFIX}tp:1:megatron/core/transformer/multi_latent_attention.py:749"
    scripts.append(_script("mla", tmp_path, control={"fix": "all-reduce piece 1", "name": piece,  # a verified piece fix
                                                     "result": REPAIRED, "equal_to_reference": True}))
    for path in PARTS.glob("*.py"):
        if path.stem in ("__init__", "script"):  # what a script defines around its parts
            continue
        imports, code = part_source(path.stem)
        assert "shardcheck" not in imports and code.strip(), path
        assert any(code in script for script in scripts), f"{path.stem} is in no script"
    for script in scripts:
        top_level = [node for node in ast.parse(script).body if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not any("shardcheck" in ast.unparse(node) for node in top_level)
