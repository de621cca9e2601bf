"""``shardcheck train``: the user's Megatron training job on N CPU ranks against one rank."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import click

import shardcheck
from shardcheck.cli.errors import HarnessFailure, InputError, writable_folder
from shardcheck.megatron.cpu import megatron_preload
from shardcheck.megatron.train.args import REFERENCES, RunPlan, TrainInputError, plan_runs
from shardcheck.megatron.train.config import flags_from_model_config
from shardcheck.megatron.train.entry import CPU_ENV, ENTRY_ENV
from shardcheck.megatron.train.model_check import MARKER, summary
from shardcheck.megatron.train.record import RECORD_ENV, SAVE_INIT_ENV, TYPECHECK_ENV
from shardcheck.parity.launch import run_script
from shardcheck.train import (
    RecordError,
    Run,
    Tolerance,
    compare_runs,
    load_run,
    write_golden,
    write_model_config,
)

REPO_ROOT = str(Path(shardcheck.__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Launch:
    """How each rank is started: CPU layer or not, which megatron-core, whose entry script."""

    cpu: bool
    megatron: Path | None
    entry: Path | None
    timeout: float
    typecheck: bool = False

    def env(self, record: Path) -> dict[str, str]:
        paths = [str(self.megatron)] if self.megatron else []
        paths += [REPO_ROOT, os.environ.get("PYTHONPATH", "")]
        env = {RECORD_ENV: str(record), "PYTHONPATH": os.pathsep.join(p for p in paths if p),
               "PYTHONWARNINGS": "ignore", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
        if self.cpu:
            env.update({CPU_ENV: "1", "OMP_NUM_THREADS": "1"})
        if self.entry:
            env[ENTRY_ENV] = str(self.entry)
        if self.typecheck:
            env[TYPECHECK_ENV] = "1"
        return env


class RunFailed(Exception):
    """A rank of one run failed or hung; the message is one line."""


class ModelMismatch(RunFailed):
    """The built model lacks what a flag asks for (the ranks' model check); the message is one line."""


@dataclass
class TrainedRun(Run):
    """A recorded run and the module classes of its layers (global index -> line; -1 the MTP block)."""

    layers: dict[int, str] = field(default_factory=dict)

    def built(self) -> str:
        return summary(self.layers)


def run_training(args: list[str], nproc: int, launch: Launch, label: str,
                 save_init: Path | None = None) -> TrainedRun:
    """Run Megatron's ``pretrain`` with ``args`` on ``nproc`` ranks; return its recorded steps
    and layers. A model that misses what its flags ask for raises :class:`ModelMismatch`.

    With ``save_init``, the weights before the first step are saved there (Megatron's
    torch_dist checkpoint of iteration 0), for :func:`start_from` to load in another layout.
    """
    with tempfile.TemporaryDirectory(prefix="shardcheck-train-") as folder:
        env = launch.env(Path(folder))
        if save_init is not None:
            env[SAVE_INIT_ENV] = str(save_init)
        outcome = run_script("-m", ["shardcheck.megatron.train.entry", *args], nproc, launch.timeout,
                             env=env, log_stdout=True, preload=megatron_preload(args, launch.cpu))
        if outcome.failed:
            mismatch = _model_mismatch(outcome)
            if mismatch:
                raise ModelMismatch(mismatch)
            raise RunFailed(f"{label}: {_failure(outcome)}")
        try:
            run = load_run(Path(folder))
        except RecordError as exc:
            raise RunFailed(f"{label}: {exc} (did the entry script call pretrain?)") from exc
        return TrainedRun(**vars(run), layers=_recorded_layers(Path(folder)))


def _model_mismatch(outcome) -> str | None:
    """The model check's one line, when a rank stopped on it."""
    for rank in outcome.failed:
        for line in reversed(rank.stderr.splitlines()):
            head, _, message = line.partition(f"{MARKER}: ")
            if message and (not head or head.endswith(".")):
                return message.strip()
    return None


def _recorded_layers(folder: Path) -> dict[int, str]:
    """Every rank's layer lines, merged (pipeline stages hold different layers)."""
    layers: dict[int, str] = {}
    for path in sorted(folder.glob("rank*.json")):
        layers.update({int(k): v for k, v in json.loads(path.read_text()).get("layers", {}).items()})
    return layers


def start_from(initial: Path) -> list[str]:
    """Flags that load the initial weights saved by ``run_training(..., save_init=initial)``."""
    return ["--load", str(initial), "--finetune", "--no-load-optim", "--no-load-rng"]


KNOWN_MEGATRON_BUGS = {
    "Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace": (
        "megatron-core bug: an expert MLP adds its fc2 bias in place to the output of "
        "reduce_from_tensor_model_parallel_region, which without expert or tensor parallelism "
        "returns its input as is (a custom Function's view, which autograd refuses to modify); "
        "MoE with biases cannot run on such a layout, and the one-rank run is one: "
        "pass --disable-bias-linear"),
}
"""A megatron-core failure recognised in a rank's output -> the one line that explains it."""

_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)')
_OWN_CODE = str(Path(shardcheck.__file__).resolve().parent)


def _failure(outcome) -> str:
    for rank in outcome.failed:
        if rank.returncode is None:
            return f"rank {rank.rank} hung: killed after {outcome.timeout:g} s"
    rank = outcome.failed[0]
    if os.environ.get("SHARDCHECK_TRAIN_DEBUG"):
        click.echo(rank.stderr, err=True)
    lines = [ln.strip() for ln in rank.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln.split(":")[0]]
    at = _failing_frame(lines)
    known = next((why for marker, why in KNOWN_MEGATRON_BUGS.items() if marker in rank.stderr), None)
    return (f"rank {rank.rank} failed (exit code {rank.returncode}): "
            f"{known or (errors or lines or ['no output'])[-1]}{at}")


def _failing_frame(lines: list[str]) -> str:
    """`` (at FILE:LINE)`` of the innermost traceback frame outside shardcheck's own code."""
    frames = [m for ln in lines if (m := _FRAME.match(ln))]
    theirs = [m for m in frames if not m["path"].startswith(_OWN_CODE)] or frames
    if not theirs:
        return ""
    path = theirs[-1]["path"]
    short = path[path.rfind("/megatron/") + 1:] if "/megatron/" in path else path
    return f" (at {short}:{theirs[-1]['line']})"


@click.command("train", context_settings={"ignore_unknown_options": True})
@click.option("-n", "--nproc", type=click.IntRange(1, 64), help="Ranks of the parallel run.")
@click.option("--model-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A functional test's model_config.yaml: its MODEL_ARGS, shrunk for a CPU.")
@click.option("--steps", type=click.IntRange(1, 1000), default=None, help="Training steps (default 3).")
@click.option("--megatron", "megatron_path", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A megatron-core copy to run instead of the installed one (its parent of megatron/).")
@click.option("--entry", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Your own entry script (e.g. pretrain_gpt.py) instead of shardcheck's GPT entry point.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Write each run as a Megatron golden-values JSON into this folder.")
@click.option("--repeats", type=click.IntRange(1, 20), default=1,
              help="Runs of each layout, with seeds seed, seed+1, ... (written with --out).")
@click.option("--resume-at", type=click.IntRange(1, 999), default=None,
              help="Also save a checkpoint at this step, restart from it, and compare with the uninterrupted run.")
@click.option("--rtol", type=float, default=None,
              help="Relative tolerance on lm loss and grad norm at step 1 (grows with the step); default "
                   f"{Tolerance().rtol:.3g} in fp32, {Tolerance.for_precision('bf16').rtol:.3g} in bf16.")
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds before a run is a hang.")
@click.option("--typecheck", is_flag=True,
              help="Also run every step of the parallel run under the type checker (slower).")
@click.option("--reference", type=click.Choice(REFERENCES), default=None,
              help="The one-rank run's batching: the whole global batch in one micro-batch, or the "
                   "parallel run's micro-batches (default: whole-batch with --calculate-per-token-loss, "
                   "else same-micro-batches).")
@click.option("--gpu", is_flag=True, help="Run on this node's GPUs with NCCL and no CPU layer (untested).")
@click.argument("megatron_args", nargs=-1, type=click.UNPROCESSED)
def train_command(nproc, model_config, steps, megatron_path, entry, out, repeats, resume_at, rtol, timeout,
                  typecheck, reference, gpu, megatron_args) -> None:
    """Run your Megatron training job on N ranks and on one, and compare every step.

    Pass Megatron's own flags after ``--``. Exit 0 when the runs agree, 1 when they part
    ways, 2 on bad input or a rank that fails or hangs.
    """
    launch = Launch(cpu=not gpu, megatron=megatron_path, entry=entry, timeout=timeout, typecheck=typecheck)
    if megatron_path and not (megatron_path / "megatron" / "core").is_dir():
        raise InputError(f"--megatron {megatron_path}: no megatron/core package in it")
    try:
        args = list(megatron_args)
        if model_config is not None:
            shrunk = flags_from_model_config(model_config, nproc, own_entry=entry is None)
            for line in shrunk.mapping:
                click.echo(f"config: {line}")
            args, nproc = shrunk.flags + args, shrunk.nproc
        if nproc is None:
            raise TrainInputError("give -n N (the ranks of the parallel run) or --model-config")
        plan = plan_runs(args, nproc, steps, cpu=launch.cpu, own_entry=entry is None, reference=reference)
        if resume_at is not None and resume_at >= plan.steps:
            raise TrainInputError(f"--resume-at {resume_at} must be before the last step ({plan.steps})")
    except TrainInputError as exc:
        raise InputError(str(exc)) from None
    if out is not None:
        writable_folder(out)
    for line in plan.changes:
        click.echo(f"changed: {line}")
    for line in plan.reference_lines:
        click.echo(f"reference: {line}")
    try:
        with tempfile.TemporaryDirectory(prefix="shardcheck-init-") as inits:
            tolerance = Tolerance.for_precision(plan.precision)
            if rtol is not None:
                tolerance = replace(tolerance, rtol=rtol)
            agree = _compare_and_resume(plan, launch, out, repeats, tolerance, resume_at, Path(inits))
    except (RunFailed, RecordError) as exc:
        raise HarnessFailure(str(exc)) from None
    sys.exit(0 if agree else 1)


def _compare_and_resume(plan: RunPlan, launch: Launch, out: Path | None, repeats: int, tolerance: Tolerance,
                        resume_at: int | None, inits: Path) -> bool:
    """Print the verdict of each comparison (and write ``out``); whether all agree."""
    verdict, parallel = _compare(plan, launch, out, repeats, tolerance, inits)
    for line in verdict.lines():
        click.echo(line)
    agree = verdict.agree and not parallel.violations
    for line, ranks in parallel.violations.items():
        click.echo(f"{line}  [ranks {', '.join(map(str, ranks))}]")
    if resume_at is None:
        return agree
    before, after = _resumed(plan, launch, resume_at, _initial(inits, 0) if plan.same_init else None)
    check = compare_runs(Run(before.steps + after.steps, before.notes), parallel, tolerance)
    if out is not None:
        write_golden(after, out / f"golden_values_{plan.world}ranks_2nd.json")
        write_model_config(plan.parallel, out / "model_config.yaml", resume_at=resume_at)
    click.echo(f"resumed at step {resume_at} (Megatron's torch_dist save and load), against the "
               f"uninterrupted {plan.world}-rank run:")
    for line in check.lines():
        click.echo(f"  {line}")
    if check.agree and not check.exact:
        click.echo("  note: within tolerance, but not bit for bit: on a CPU a resumed run repeats the "
                   "uninterrupted one exactly unless something the checkpoint restores (the optimizer's "
                   "state, the data position, the RNG) came back different")
    return agree and check.agree


def _initial(inits: Path, repeat: int) -> Path:
    """Where the one-rank run of ``repeat`` saves the initial weights the parallel runs start from."""
    return inits / f"repeat{repeat}"


def _resumed(plan: RunPlan, launch: Launch, step: int, init: Path | None) -> tuple[Run, Run]:
    """The parallel run (from the initial weights ``init``, where it needs them) saved at
    ``step``, and the run restarted from that checkpoint and continued (the steps after it)."""
    with tempfile.TemporaryDirectory(prefix="shardcheck-resume-") as folder:
        start = start_from(init) if init else []
        ckpt = ["--save", str(Path(folder) / "ckpt"), "--save-interval", str(step)]
        first = run_training(plan.parallel + start + ckpt + ["--exit-interval", str(step)], plan.world,
                             launch, f"{plan.world}-rank run to step {step}")
        second = run_training(plan.parallel + ckpt + ["--load", str(Path(folder) / "ckpt")], plan.world,
                              launch, f"{plan.world}-rank run resumed at step {step}")
    return first, second


def _compare(plan: RunPlan, launch: Launch, out: Path | None, repeats: int, tolerance: Tolerance, inits: Path):
    seed = int(_flag(plan.parallel, "--seed") or 1234)
    verdict = None
    for repeat in range(repeats):
        seeded = ["--seed", str(seed + repeat)]
        save = _initial(inits, repeat) if plan.same_init else None
        reference = run_training(plan.reference + seeded, 1, replace(launch, typecheck=False),
                                 "one-rank run", save_init=save)
        start = start_from(save) if save else []
        parallel = run_training(plan.parallel + seeded + start, plan.world, launch, f"{plan.world}-rank run")
        if out is not None:
            write_model_config(plan.parallel, out / "model_config.yaml")
            (out / "reference.txt").write_text("".join(f"reference: {ln}\n" for ln in plan.reference_lines))
            suffix = "" if repeat == 0 else f"_repeat{repeat}"
            write_golden(parallel, out / f"golden_values_{plan.world}ranks{suffix}.json")
            write_golden(reference, out / f"golden_values_1rank{suffix}.json")
        if verdict is None:
            verdict, first = compare_runs(parallel, reference, tolerance), parallel
            _report_built(plan.world, parallel, reference, out)
            for note in parallel.notes:
                click.echo(f"note: {note}")
    return verdict, first


def _report_built(world: int, parallel: TrainedRun, reference: TrainedRun, out: Path | None) -> None:
    """One line per run: the module classes of its layers (what was compared)."""
    lines = [f"built: {world}-rank run: {parallel.built()}", f"built: one-rank run: {reference.built()}"]
    for line in lines:
        click.echo(line)
    if out is not None:
        (out / "layers.txt").write_text("\n".join(lines) + "\n")


def _flag(tokens: list[str], flag: str) -> str | None:
    return tokens[tokens.index(flag) + 1] if flag in tokens else None


