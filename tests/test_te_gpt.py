"""A GPT built from Megatron's Transformer Engine spec, run on TE's own modules and shardcheck's
CPU kernels, against the local-spec GPT with the same weights, at one rank.

megatron-core decides whether it has Transformer Engine when its modules are first imported, so
both models are built in a fresh interpreter that installs TE before importing megatron-core.
"""

import importlib.util
import multiprocessing as mp
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

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


def _te_gpt_against_one_rank(layouts: list[str]) -> dict[str, dict[str, float]]:
    """In a fresh process: the gpt scenario on the TE spec under each layout against one rank
    (relative error per output); the ranks are forked from this TE-enabled process."""
    from functools import partial

    from shardcheck.megatron.cpu.te import install

    install()  # before megatron-core is imported
    import megatron.core.pipeline_parallel.schedules  # noqa: F401  (imported once, before forking)

    from shardcheck.megatron.cpu.runner import relative_errors, run_layout
    from shardcheck.megatron.scenarios.gpt import TEGPTSetup, train_step
    from shardcheck.parity.layout import Layout

    step = partial(train_step, setup=TEGPTSetup(optimizer_step=False))
    reference = run_layout(step, Layout())
    return {name: relative_errors(run_layout(step, Layout.parse(name)), reference) for name in layouts}


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


def test_te_spec_gpt_matches_one_rank_under_tp2_with_sequence_parallelism():
    """TE's own tensor- and sequence-parallel communication (its all-gathers and
    reduce-scatters, on Gloo), through Megatron's DDP, schedule and finalize_model_grads."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        errors = pool.submit(_te_gpt_against_one_rank, ["tp2-sp"]).result(600)["tp2-sp"]
    assert any(name.startswith("grad/decoder.layers.self_attention.linear_qkv.layer_norm") for name in errors)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < 1e-5, (worst, errors[worst])
