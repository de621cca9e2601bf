"""GPTModel.forward's optional tensor inputs in the audit's search (issue 33 item 1).

The inputs are drawn as a data pipeline makes them (padding at the ends of sequences, loss
masks with uneven valid counts, the dataloader's document attention mask, documents of uneven
lengths packed into one row on Transformer Engine), and with per-token loss the one-rank
reference takes the whole batch in one micro-batch. The unit tests check the generators; one
audit over a few cases shows what each input finds and where it stays clean.
"""

import pytest
import torch
from megatron_release import RELEASE
from packaging.version import Version

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.sweep import Case, setup_options  # noqa: E402
from shardcheck.megatron.cpu.parallel import LayoutUnsupported  # noqa: E402
from shardcheck.megatron.cpu.te import te_dir  # noqa: E402
from shardcheck.megatron.scenarios.gpt import (  # noqa: E402
    PAD_TOKEN,
    GPTSetup,
    MoEGPTSetup,
    MTPGPTSetup,
    TEGPTSetup,
    document_attention_mask,
    document_bounds,
    global_batches,
    local_batches,
    packed_seq_params,
    padded_tokens,
    split_free,
    train_step,
    transformer_config,
)
from shardcheck.parity.layout import Layout  # noqa: E402


def _cp_pieces(values: torch.Tensor, cp: int = 2) -> list[torch.Tensor]:
    """Megatron's load-balanced CP pieces of the last dim: rank r holds chunks r and 2cp-1-r."""
    chunks = values.chunk(2 * cp, dim=-1)
    return [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=-1) for r in range(cp)]


def _uneven(counts: list[float]) -> bool:
    return len(set(counts)) > 1


def test_padding_ends_each_sequence_with_uneven_counts_over_every_split():
    setup = GPTSetup(padding_mask=True)
    padding = padded_tokens(setup)
    assert padding.shape == (setup.microbatches, setup.micro_batch, setup.seq)
    rows = padding.reshape(-1, setup.seq)
    for row in rows:  # padded tokens at the end: once padding starts, it goes on
        assert torch.equal(row, torch.sort(row.int())[0].bool())
    assert _uneven([float(row.sum()) for row in rows]) and not rows[:, 0].any()
    assert _uneven([float(mb.sum()) for mb in padding])  # micro-batches, and so dp2's shares
    assert _uneven([float(piece.sum()) for piece in _cp_pieces(padding)])
    batches = global_batches(setup)
    for batch, pads in zip(batches, padding, strict=True):
        assert torch.equal(batch["padding_mask"], pads)
        assert (batch["loss_mask"][pads] == 0).all() and (batch["loss_mask"][~pads] == 1).all()
        assert (batch["tokens"][pads] == PAD_TOKEN).all()


def test_the_loss_mask_is_uneven_over_micro_batches_dp_ranks_cp_pieces_and_first_tokens():
    """Uneven valid counts; and some sequences start with a masked token, others not, so the
    share of valid tokens MTP's roll keeps differs between micro-batches (#7452 finding 3)."""
    masks = torch.stack([b["loss_mask"] for b in global_batches(GPTSetup(loss_mask=True))])
    assert _uneven([float(mb.sum()) for mb in masks])
    assert _uneven([float(piece.sum()) for piece in _cp_pieces(masks)])
    first = masks[..., 0].flatten()
    assert 0 < float(first.sum()) < first.numel()
    assert (torch.stack([b["loss_mask"] for b in global_batches(GPTSetup())]) == 1).all()


def test_the_attention_mask_is_causal_and_reset_at_each_document_end():
    setup = GPTSetup(attention_mask=True)
    mask = document_attention_mask(setup)
    assert mask.shape == (setup.microbatches, setup.micro_batch, 1, setup.seq, setup.seq)
    position = torch.arange(setup.seq)
    causal = position[None, :] > position[:, None]
    starts = []
    for row in mask.reshape(-1, setup.seq, setup.seq):
        start = int(row[-1].sum())  # the last token sees its own document only
        second = position >= start
        assert 0 < start < setup.seq
        assert torch.equal(row, causal | (second[:, None] != second[None, :]))
        starts.append(start)
    assert _uneven(starts)
    assert all(torch.equal(b["attention_mask"], m) for b, m in zip(global_batches(setup), mask, strict=True))


def test_inputs_are_setup_options_the_sweep_finds():
    for setup in (GPTSetup, MoEGPTSetup, MTPGPTSetup):
        found = setup_options(setup)
        for name in ("padding_mask", "attention_mask", "packed_sequences", "loss_mask"):
            assert (name, True) in found, (setup.__name__, name)


def test_packed_sequences_are_refused_in_one_line_on_the_local_spec_and_beside_an_attention_mask():
    with pytest.raises(LayoutUnsupported, match="packed sequences .THD.*impl=te"):
        train_step(None, GPTSetup(packed_sequences=True))
    with pytest.raises(LayoutUnsupported, match="packed sequences carry their document boundaries"):
        train_step(None, TEGPTSetup(packed_sequences=True, attention_mask=True))


def test_packed_micro_batches_are_one_row_of_uneven_documents_with_positions_reset_at_each():
    """As Megatron's data pipeline packs documents (flatten_batch_for_packed_sequences): each
    micro-batch one row [1, micro_batch * seq], cu_seqlens over every document of its sequences."""
    setup = TEGPTSetup(packed_sequences=True, loss_mask=True, padding_mask=True)
    plain = global_batches(TEGPTSetup(loss_mask=True, padding_mask=True))
    lengths = []
    for i, (batch, unpacked) in enumerate(zip(global_batches(setup), plain, strict=True)):
        row = setup.micro_batch * setup.seq
        assert all(batch[name].shape == (1, row) for name in ("tokens", "labels", "loss_mask", "position_ids", "padding_mask"))
        for name in ("tokens", "labels", "loss_mask", "padding_mask"):  # the same tokens, in one row
            assert torch.equal(batch[name], unpacked[name].reshape(1, -1))
        bounds = [document_bounds(setup, i * setup.micro_batch + j) + j * setup.seq for j in range(setup.micro_batch)]
        cu = torch.cat([*(b[:-1] for b in bounds), torch.tensor([row], dtype=torch.int32)])
        assert torch.equal(batch["cu_seqlens"], cu) and cu.dtype == torch.int32
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):  # positions restart
            assert batch["position_ids"][0, start:end].tolist() == list(range(end - start))
        lengths += (cu[1:] - cu[:-1]).tolist()
        longest = int((cu[1:] - cu[:-1]).max())
        params = packed_seq_params(batch["cu_seqlens"])
        assert (params.qkv_format, params.max_seqlen_q, params.max_seqlen_kv) == ("thd", longest, longest)
        assert params.cu_seqlens_q is params.cu_seqlens_kv is batch["cu_seqlens"]
    assert _uneven(lengths) and len(set(lengths)) > 3
    [whole] = local_batches(setup, whole=True)  # the one-rank reference of a split-free loss
    batches = global_batches(setup)
    assert torch.equal(whole["tokens"], torch.cat([b["tokens"] for b in batches], dim=-1))
    assert whole["cu_seqlens"].tolist() == sorted({
        int(v) + n * setup.micro_batch * setup.seq for n, b in enumerate(batches) for v in b["cu_seqlens"]})


def test_only_a_per_token_loss_without_per_micro_batch_terms_is_split_free():
    per_token = {"calculate_per_token_loss": True}
    assert split_free(transformer_config(Layout(), GPTSetup(config=per_token)))
    assert split_free(transformer_config(Layout(), MTPGPTSetup(config=per_token)))
    assert not split_free(transformer_config(Layout(), GPTSetup()))
    assert not split_free(transformer_config(Layout(), MoEGPTSetup(config=per_token)))  # aux loss


@pytest.mark.parametrize(("kinds", "coeffs", "z_loss", "free"), [
    ("seq_aux_loss", 0.01, None, True),  # a mean over sequences (Megatron-LM e3fe5508c9's class)
    ("seq_aux_loss", 0.01, 0.1, False),  # the z loss: a mean over a micro-batch's tokens
    ("global_aux_loss", 0.01, None, False),
    ("seq_aux_loss,aux_loss", "0.01,0.01", None, False),
    ("seq_aux_loss,aux_loss", "0.01,0", None, True),
])
def test_a_sequence_level_aux_loss_is_split_free(kinds, coeffs, z_loss, free):
    from shardcheck.megatron.audit.sweep import config_value

    options = {"calculate_per_token_loss": True, "moe_z_loss_coeff": z_loss,
               "moe_router_load_balancing_type": config_value("moe_router_load_balancing_type", kinds),
               "moe_aux_loss_coeff": [float(c) for c in coeffs.split(",")] if isinstance(coeffs, str) else coeffs}
    assert split_free(transformer_config(Layout(), MoEGPTSetup(config=options))) is free


def test_the_whole_batch_is_one_micro_batch_of_every_sequence():
    setup = GPTSetup(loss_mask=True, padding_mask=True)
    [whole] = local_batches(setup, whole=True)
    batches = global_batches(setup)
    assert whole.keys() == batches[0].keys()
    for name, value in whole.items():
        assert torch.equal(value, torch.cat([b[name] for b in batches]))
    assert whole["tokens"].shape == (setup.microbatches * setup.micro_batch, setup.seq)


def test_the_repro_scripts_draw_the_same_inputs(monkeypatch):
    """The script's own copy of the batch (parts/gpt.py) gives the scenario's inputs."""
    import dataclasses

    from shardcheck.megatron.repro.parts import gpt as part

    setup = GPTSetup(loss_mask=True, padding_mask=True, attention_mask=True)
    monkeypatch.setattr(part, "SETUP", dataclasses.asdict(setup))
    [ours], [theirs] = local_batches(setup, whole=True), part.batches(None, whole=True)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours), [
        name for name in ours if not torch.equal(ours[name], theirs[name])]


# ---- one audit over the inputs: what each finds, and where it stays clean ----------------

PER_TOKEN_MASKED = (("loss_mask", True), ("calculate_per_token_loss", True))
# 0.19.2's router reads its local token count after the in-place all-reduce when given a padding
# mask: the checker sees it wherever the MoE GPT takes one, and where the calls align with one
# rank's (not under dp) the count itself differs, no output unless per-token loss scales by it
ROUTER_COUNT = "checker: contract at megatron/core/transformer/moe/router.py:"
TOKEN_COUNT = "get_tokens_per_expert_and_token_count#0.local_num_tokens"
CASES = {  # name: case, whether the numbers part ways
    # GPTModel scatters the MoE padding mask on parallel_state's global tp group (#7452 finding 5)
    "padding, explicit groups": (Case("moe", (("padding_mask", True),), Layout.parse("tp2-dp2-sp@dp-tp")), True),
    "padding, plain groups": (Case("moe", (("padding_mask", True),), Layout.parse("tp2-dp2-sp")), False),
    "padding, sequence parallel": (Case("moe", (("padding_mask", True),), Layout.parse("tp2-sp")), False),
    # MTP's per-token loss normalised per micro-batch (#7452 finding 3), against the whole batch:
    # 0.19.2 scales each micro-batch's MTP loss by its own valid-token ratio, 0.16.1 by nothing
    "mtp per-token": (Case("mtp", (*PER_TOKEN_MASKED, ("position_embedding", "rope")), Layout(dp=2)),
                      RELEASE is None or RELEASE >= Version("0.19")),
    "gpt per-token": (Case("gpt", PER_TOKEN_MASKED, Layout(dp=2)), False),  # the main loss is right
    "document attention mask": (Case("gpt", (("attention_mask", True),), Layout.parse("tp2-sp")), False),
}
# packed documents (THD) through TE's fused attention: the packed row split by sp, whole packed
# micro-batches per dp rank, explicit groups (where TE runs: installed, megatron-core 0.19 on)
if (te_dir() / "transformer_engine").is_dir() and (RELEASE is None or RELEASE >= Version("0.19")):
    CASES["packed sequences"] = (Case("gpt", (("impl", "te"), ("packed_sequences", True), ("bf16", True)),
                                      Layout.parse("tp2-dp2-sp@dp-tp")), False)


@pytest.fixture(scope="module")
def inputs_audit(audit_pools):
    from shardcheck.megatron.audit.run import audit
    from shardcheck.megatron.audit.runner import PRELOAD

    for module in PRELOAD:
        __import__(module)
    return audit([case for case, _ in CASES.values()], run_pools=audit_pools)


@pytest.mark.slow
@pytest.mark.release_specific
@pytest.mark.parametrize("name", list(CASES))
def test_each_input_finds_its_bug_or_stays_clean(inputs_audit, name):
    case, differs = CASES[name]
    assert not inputs_audit.errors, [o.error for o in inputs_audit.errors]
    [outcome] = [o for o in inputs_audit.outcomes if o.case == case]
    assert bool(outcome.gaps) == differs, (name, outcome.gaps[:2])
    if differs:
        entry = {"layout": str(case.layout), "options": dict(case.options)}
        [finding] = [f for f in inputs_audit.findings if entry in f.cases]
        if name == "padding, explicit groups":  # at the scatter, repaired by the explicit groups
            assert finding.location.startswith("megatron/core/models/gpt/gpt_model.py:"), finding.location
            assert "split on parallel_state's global tp group" in (finding.checker or ""), finding.checker
            assert finding.control is not None and finding.control["equal_to_reference"], finding.control
    else:
        assert all(v["line"].startswith(ROUTER_COUNT) for v in outcome.violations), outcome.violations
    if name == "mtp per-token" and differs:  # the MTP layers' own gradients part ways
        assert any(g.name.startswith("grad/mtp.") for g in outcome.gaps), outcome.gaps
        # located where the MTP loss is normalised by this rank's own token counts: its
        # scaled losses, summed over dp, part ways first; the counts summed over dp repair it
        assert finding.location.startswith("megatron/core/transformer/multi_token_prediction.py:"), finding.location
        assert finding.contract.startswith("process_mtp_loss:") and finding.control["equal_to_reference"]
    if name == "padding, sequence parallel":  # the count differs: confirmed, at the function
        assert outcome.call_gap is not None and outcome.call_gap.gap.name == TOKEN_COUNT
        [finding] = [f for f in inputs_audit.findings if {"layout": "tp2-sp", "options": dict(case.options)} in f.cases]
        assert finding.kind == "type+numeric" and finding.location.startswith(
            "megatron/core/transformer/moe/moe_utils.py:"), (finding.kind, finding.location)
        assert finding.control["equal_to_reference"], finding.control
