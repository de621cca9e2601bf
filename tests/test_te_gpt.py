"""A GPT built from Megatron's Transformer Engine spec, run on TE's own modules and shardcheck's
CPU kernels: against the local-spec GPT with the same weights at one rank, and against one rank
at TP2, TP2+SP and CP2 (TE's own context-parallel ring), in fp32 and bf16.

megatron-core decides whether it has Transformer Engine when its modules are first imported, so
the models are built in a fresh interpreter that installs TE before importing megatron-core.
"""

import importlib.util
import multiprocessing as mp
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist

from shardcheck.megatron.cpu.te import installed, te_dir

if not (te_dir() / "transformer_engine").is_dir():
    pytest.skip(f"transformer-engine is not installed in {te_dir()}", allow_module_level=True)

def _loss_and_grads(model, batches) -> dict[str, np.ndarray]:
    from shardcheck.megatron.scenarios.reference import gather_global, gradient_of

    losses = []
    for batch in batches:
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = per_token.float().mean() / len(batches)
        loss.backward()
        losses.append(loss.detach())
    grads, _ = gather_global(model, gradient_of)
    out = {f"grad/{k}": v.double().numpy() for k, v in grads.items()}
    out["loss"] = np.array(float(sum(losses)))
    return out


def _te_and_local_gpt(dtype_names: list[str], port: int) -> dict[str, tuple[dict, dict, list[str]]]:
    """In a fresh process, per dtype: one step's loss and gradients of the TE-spec and
    local-spec GPTs, and the TE modules the TE-spec GPT holds."""
    import torch.distributed as dist

    from shardcheck.megatron.cpu.te import install

    install()  # before megatron-core is imported
    from megatron.core.transformer.module import Float16Module

    from shardcheck.megatron.cpu.parallel import megatron_parallel
    from shardcheck.megatron.cpu.runner import RankContext
    from shardcheck.megatron.scenarios.gpt import (
        GPTSetup,
        TEGPTSetup,
        build_gpt,
        global_batches,
        transformer_config,
    )
    from shardcheck.megatron.scenarios.reference import load_global_weights
    from shardcheck.parity.layout import Layout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    setup = GPTSetup()
    results = {}
    for dtype_name in dtype_names:
        dtype = getattr(torch, dtype_name)
        with megatron_parallel(RankContext(Layout(), 0)):
            half = {"bf16": True} if dtype is torch.bfloat16 else {}
            config = transformer_config(Layout(), setup, params_dtype=dtype, pipeline_dtype=dtype, **half)
            local = build_gpt(config, setup)
            te_model = build_gpt(config, TEGPTSetup())
            # the same global weights: the local spec's checkpoint keys are TE's (layer norms
            # fused into linear_qkv and linear_fc1)
            for model in (local, te_model):
                load_global_weights(model, seed=setup.seed)
            modules = sorted({type(m).__name__ for m in te_model.modules()
                              if type(m).__module__ == "megatron.core.extensions.transformer_engine"})
            if dtype is torch.bfloat16:  # as Megatron trains in 16 bits: inputs cast in, loss out
                local, te_model = (Float16Module(config, m) for m in (local, te_model))
            batches = global_batches(setup)
            results[dtype_name] = (_loss_and_grads(te_model, batches), _loss_and_grads(local, batches), modules)
    return results


TWO_RANK_LAYOUTS = ("tp2", "tp2-sp", "cp2")
DTYPE_CONFIG = {"float32": {}, "bfloat16": {"bf16": True}}
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}
# TE's own answer to fp32 under context parallelism, as on a GPU: its fused backends (the only
# ones with a CP ring) take fp16 and bf16, its unfused one has no CP
NO_BACKEND = "No dot product attention backend is available"


def _te_setup(dtype_name: str):
    from shardcheck.megatron.scenarios.gpt import TEGPTSetup

    return TEGPTSetup(optimizer_step=False, config=DTYPE_CONFIG[dtype_name])


def _refused_without_backend(ctx, setup) -> torch.Tensor:
    """1 when the scenario raises TE's no-backend error, 0 when it runs."""
    from shardcheck.megatron.scenarios.gpt import train_step

    try:
        train_step(ctx, setup)
    except ValueError as exc:
        if NO_BACKEND not in str(exc):
            raise
        return torch.tensor(1.0)
    return torch.tensor(0.0)


def _ring_against_plain_attention(rank: int) -> dict[str, torch.Tensor]:
    """TE's DotProductAttention at cp2 in bf16 (its p2p ring on Gloo, on our fused kernels)
    against plain causal attention over the whole sequence in fp32: this rank's output and
    q, k, v gradients (load-balanced chunks), relative errors, the worst over both ranks."""
    import torch.nn.functional as F
    import transformer_engine.pytorch as te
    from megatron.core import parallel_state

    from shardcheck.megatron.cpu.cp_attention import load_balanced_positions
    from shardcheck.megatron.cpu.parallel import megatron_parallel
    from shardcheck.megatron.cpu.runner import RankContext
    from shardcheck.parity.layout import Layout

    seq, batch, heads, dim = 16, 2, 4, 8
    gen = torch.Generator().manual_seed(7)
    q, k, v, grad = (torch.randn(seq, batch, heads, dim, generator=gen) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in full), is_causal=True)
    expected = expected.permute(2, 0, 1, 3)  # [b, h, s, d] -> [s, b, h, d]
    expected.backward(grad)
    with megatron_parallel(RankContext(Layout.parse("cp2"), rank)):
        group = parallel_state.get_context_parallel_group()
        mine = load_balanced_positions(seq // 2, group.rank(), group.size())
        local = [t[mine].bfloat16().requires_grad_() for t in (q, k, v)]
        attention = te.DotProductAttention(heads, dim, attn_mask_type="causal", qkv_format="sbhd")
        attention.set_context_parallel_group(group, dist.get_process_group_ranks(group),
                                             torch.cuda.Stream(), "p2p")
        out = attention(*local)
        out.backward(grad[mine].reshape(out.shape).bfloat16())
    pairs = {"out": (out, expected[mine].reshape(out.shape)),
             **{f"d{n}": (t.grad, f.grad[mine]) for n, t, f in zip("qkv", local, full, strict=True)}}
    errors = torch.stack([(ours.float() - ref).abs().max() / ref.abs().max() for ours, ref in pairs.values()])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)  # the worst over the ranks' chunks
    return {f"ring/{name}": error for name, error in zip(pairs, errors, strict=True)}


def _every_two_rank_layout(ctx) -> dict[str, torch.Tensor]:
    """On each of two ranks, in turn: the TE-spec gpt scenario under every two-rank layout and
    dtype (Megatron's model parallelism set up and torn down for each), then TE's CP ring
    against plain attention."""
    from shardcheck.megatron.cpu.runner import RankContext
    from shardcheck.megatron.scenarios.gpt import train_step
    from shardcheck.parity.layout import Layout

    outputs = {}
    for name in TWO_RANK_LAYOUTS:
        layout = Layout.parse(name)
        for dtype_name in DTYPE_CONFIG:
            run_ctx, setup = RankContext(layout, ctx.rank), _te_setup(dtype_name)
            if layout.cp > 1 and dtype_name == "float32":
                outputs[f"{name}/{dtype_name}/refused"] = _refused_without_backend(run_ctx, setup)
                continue
            outputs.update({f"{name}/{dtype_name}/{k}": v for k, v in train_step(run_ctx, setup).items()})
    outputs.update(_ring_against_plain_attention(ctx.rank))
    return outputs


def _te_gpt_on_two_ranks() -> dict[str, dict[str, float]]:
    """In a fresh process: per two-rank layout and dtype, the TE-spec gpt scenario's relative
    errors against one rank (``refused``: fp32 under CP), and the ring's errors. The ranks are
    forked from this TE-enabled process, once for each dtype's reference and once for all the
    two-rank runs."""
    from shardcheck.megatron.cpu.te import install

    install()  # before megatron-core is imported
    import megatron.core.pipeline_parallel.schedules  # noqa: F401  (imported once, before forking)

    from shardcheck.megatron.cpu.runner import relative_errors, run_layout
    from shardcheck.megatron.scenarios.gpt import train_step
    from shardcheck.parity.layout import Layout

    references = {dtype_name: run_layout(partial(train_step, setup=_te_setup(dtype_name)), Layout())
                  for dtype_name in DTYPE_CONFIG}
    two_ranks = run_layout(_every_two_rank_layout, Layout.parse("tp2"))
    results: dict[str, dict[str, float]] = {}
    for name in TWO_RANK_LAYOUTS:
        for dtype_name, reference in references.items():
            prefix = f"{name}/{dtype_name}/"
            observed = {k[len(prefix):]: v for k, v in two_ranks.items() if k.startswith(prefix)}
            results[prefix.rstrip("/")] = (observed if "refused" in observed
                                           else relative_errors(observed, reference))
    results["ring"] = {k: float(v) for k, v in two_ranks.items() if k.startswith("ring/")}
    return results


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def te_and_local():
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_te_and_local_gpt, ["float32", "bfloat16"], _free_port()).result(600)


@pytest.mark.parametrize("dtype_name,tolerance", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_te_spec_gpt_matches_local_spec_gpt_at_one_rank(te_and_local, dtype_name, tolerance):
    te_out, local_out, te_modules = te_and_local[dtype_name]
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention"} <= set(te_modules)
    assert set(te_out) == set(local_out)
    for name, reference in local_out.items():
        scale = max(float(np.abs(reference).max()), 1e-12)
        error = float(np.abs(te_out[name] - reference).max()) / scale
        assert error < tolerance, (name, error)


def test_installed_leaves_no_transformer_engine_behind():
    """After ``installed()``, megatron-core modules imported later still find no TE."""
    capability = torch.cuda.get_device_capability
    with installed() as te:
        assert importlib.util.find_spec("transformer_engine") is not None
        assert te.Linear.__module__ == "transformer_engine.pytorch.module.linear"
    assert importlib.util.find_spec("transformer_engine") is None
    assert not [name for name in sys.modules if name.startswith("transformer_engine")]
    assert torch.cuda.get_device_capability is capability


@pytest.fixture(scope="module")
def te_on_two_ranks():
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_te_gpt_on_two_ranks).result(600)


@pytest.mark.parametrize("dtype_name", DTYPE_CONFIG)
@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
def test_te_spec_gpt_matches_one_rank_on_two_ranks(te_on_two_ranks, layout, dtype_name):
    """TP2 and TP2+SP: TE's own tensor- and sequence-parallel communication (its all-gathers
    and reduce-scatters, on Gloo); CP2: TE's own context-parallel ring (its point-to-point
    exchange, on Gloo) on our fused attention; through Megatron's DDP, schedule and
    finalize_model_grads. fp32 under CP is refused by TE itself, as on a GPU."""
    errors = te_on_two_ranks[f"{layout}/{dtype_name}"]
    if layout.startswith("cp") and dtype_name == "float32":
        assert errors == {"refused": 1.0}
        return
    assert any(name.startswith("grad/decoder.layers.self_attention.linear_qkv.layer_norm") for name in errors)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < TOLERANCE[dtype_name], (worst, errors[worst])


def test_te_context_parallel_ring_matches_plain_causal_attention(te_on_two_ranks):
    """TE's ring at cp2, on Gloo with its requests waited on once (``cpu.te.WaitOnce``): this
    rank's output and gradients are plain causal attention's over the whole sequence."""
    errors = te_on_two_ranks["ring"]
    assert set(errors) == {"ring/out", "ring/dq", "ring/dk", "ring/dv"}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < 2e-2, (worst, errors[worst])
