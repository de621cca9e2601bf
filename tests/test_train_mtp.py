"""A DeepSeek-V3-style multi-token-prediction job under ``shardcheck train``: #7452 finding 3.

With ``--calculate-per-token-loss``, megatron-core 0.19.2's ``process_mtp_loss``
(``transformer/multi_token_prediction.py``) scales each micro-batch's MTP loss by that
micro-batch's own ``original_num_tokens / num_tokens`` (its valid tokens before and after the
roll); the schedule then divides every gradient by the global token count. Where the valid
tokens are uneven, the ratio differs between micro-batches, so the MTP gradients depend on how
the global batch is split over data-parallel ranks and micro-batches, and the whole-batch
reference parts ways on an MTP parameter. Without loss masking every row's ratio is the same,
and the job agrees.

The uneven tokens come from the user's flags alone: ``MockGPTDataset``'s documents count their
tokens up modulo the vocabulary, so with ``--vocab-size 30`` every 30th token of a document is
the end-of-document token, which ``--eod-mask-loss`` masks; in the first global batch one
sequence starts with one (its first token masked, so its ratio is 1 where the others' is 15/14).
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from test_train import BASE  # skips this module where test_train is skipped (megatron-core < 0.19)

from shardcheck.cli import main

pytestmark = pytest.mark.timeout(900)

MTP_JOB = [*BASE, "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "30",
           "--mtp-num-layers", "1", "--position-embedding-type", "rope", "--calculate-per-token-loss"]
WHOLE_BATCH = ("reference: one rank, the whole global batch of 4 in one micro-batch (--calculate-per-token-loss: "
               "the loss is summed over tokens and divided by the global token count, so the split does not matter)")
BUILT = "layers 0-1: SelfAttention + MLP; mtp: MultiTokenPredictionBlock (1 layer(s))"


def _train(*args: str):
    return CliRunner().invoke(main, ["train", "-n", "2", *args])


def test_mtp_per_token_loss_at_dp2_with_uneven_valid_tokens_differs_on_an_mtp_parameter():
    """megatron-core 0.19.2 still holds #7452 finding 3: the MTP loss normalised per micro-batch."""
    result = _train("--steps", "1", "--", *MTP_JOB, "--eod-mask-loss")
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert WHOLE_BATCH in lines
    assert f"built: 2-rank run: {BUILT}" in lines
    first = next(line for line in lines if line.startswith("first parameter to part ways: "))
    assert first.startswith("first parameter to part ways: step 1, gradient norm of mtp.layers.0."), first
    assert lines[-1] == "verdict: DIFFER"


def test_the_same_mtp_job_without_loss_masking_builds_the_mtp_block_and_agrees_at_dp2():
    """The control; and --mtp-num-layers used to crash in cross_entropy (an IndexError): the
    block was never built."""
    result = _train("--steps", "2", "--", *MTP_JOB)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert WHOLE_BATCH in lines
    assert f"built: one-rank run: {BUILT}" in lines
    assert lines[-1] == "verdict: AGREE"
