"""`embshard train CONFIG [key.sub=value ...] [--nproc N]`: train a YAML-configured model.

Under torchrun (one process per GPU, any number of hosts) each process joins the job from torchrun's
environment; with `--nproc N` (and no torchrun) N local processes are started here. Rank 0 makes the sharding
plan (by default with the planner, embshard.planner: docs/planner.md) and broadcasts it; it prints the plan with
the predicted memory and time per rank, a progress bar with samples/s, the training loss every
logging.log_every steps, and the held-out loss and AUC (torchmetrics BinaryAUROC, synced over ranks) at every
evaluation; it also writes TensorBoard event files and an optional JSON-lines metrics file. See docs/config.md
for the configuration and docs/launch.md for launching."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from embshard.config import DenseOptimizerConfig, LoggingConfig, PlannerConfig, TrainConfig, load_config
from embshard.optim import FusedOptimizerConfig
from embshard.plan import MemoryTier, ShardingPlan, ShardingType, simple_plan
from embshard.tables import ConfigError, TableConfig


def make_plan(
    tables: Sequence[TableConfig],
    planner_cfg: PlannerConfig,
    world_size: int,
    local_world_size: int,
    device_type: str,
    batch_size: int,
    optimizer: FusedOptimizerConfig,
    log: Callable[[str], None] | None = None,
) -> ShardingPlan:
    """The sharding plan (checked against `tables`): loaded from planner.plan_file, else made by the planner
    (strategy auto: embshard.planner on the topology of planner.topology_file or of this machine, for
    `batch_size` samples per rank and the sparse `optimizer`), else by the simple placement (strategy simple).
    `log` gets the plan and, for auto, the predicted memory and time per rank and the predicted step time.
    Deterministic; `run` still makes it on rank 0 only and broadcasts it."""
    say = log or (lambda _text: None)
    if planner_cfg.plan_file:
        plan = ShardingPlan.load(planner_cfg.plan_file)
        if (plan.world_size, plan.local_world_size) != (world_size, local_world_size):
            raise ConfigError(
                f"planner.plan_file={planner_cfg.plan_file!r} is a plan for world_size={plan.world_size}, "
                f"local_world_size={plan.local_world_size}, but this job has {world_size} and {local_world_size}: "
                "re-plan for this job (`embshard plan CONFIG --world-size N --out FILE`), or leave plan_file unset"
            )
        plan.check(tables)
        say(f"plan loaded from {planner_cfg.plan_file}")
        say(str(plan))
        return plan
    if planner_cfg.strategy == "simple":
        plan = _simple_plan(tables, planner_cfg, world_size, local_world_size, device_type)
        say(str(plan))
        return plan
    from embshard.planner import PlanningError, plan_with_report
    from embshard.planner.from_config import topology_for

    topo = topology_for(planner_cfg, world_size, local_world_size, device_type)
    try:
        plan, report = plan_with_report(
            tables, topo, batch_size, optimizer, planner_cfg.constraints, planner_cfg.settings
        )
    except PlanningError as e:
        raise PlanningError(
            f"planner: no sharding plan fits {topo.describe()}:\n{e}\n(in a training config: planner.hbm_gib and "
            "planner.ddr_gib set the memory per rank, planner.settings.hbm_reserve_gib the dense model's reserve, "
            "--nproc / torchrun the number of ranks, planner.constraints.<table> the allowed options)",
            e.details,
        ) from None
    except ConfigError as e:
        raise ConfigError(f"planner: {e}") from None
    plan.check(tables)
    say(str(plan))
    say(report.format_ranks())
    say(report.summary())
    return plan


def _simple_plan(
    tables: Sequence[TableConfig], planner_cfg: PlannerConfig, world_size: int, local_world_size: int, device_type: str
) -> ShardingPlan:
    """Strategy simple: the greedy placement of embshard.plan with each table's first allowed sharding type and
    tier, and the first allowed rank of table-wise tables."""
    from embshard.planner.constraints import resolve_constraints

    try:
        constraints = resolve_constraints(tables, planner_cfg.constraints, world_size)
    except ConfigError as e:
        raise ConfigError(f"planner.{e}") from None
    default_tier = planner_cfg.tier or (MemoryTier.HOST if device_type == "cpu" else MemoryTier.HBM)
    chosen = {name: c.sharding_types[0] for name, c in constraints.items() if c.sharding_types}
    columns = planner_cfg.column_shards or 2
    plan = simple_plan(tables, world_size, local_world_size, chosen, default_tier, columns)
    table_plans = []
    for tp in plan.tables:
        c = constraints[tp.table]
        if c.tiers:
            tp = replace(tp, tier=c.tiers[0])
        if c.ranks:
            if tp.sharding_type is not ShardingType.TABLE_WISE:
                raise ConfigError(
                    f"planner.constraints.{tp.table}.ranks: the simple placement pins only table_wise tables, "
                    f"not {tp.sharding_type.value}; drop ranks, make the table table_wise, or use strategy auto"
                )
            tp = replace(tp, shards=(replace(tp.shards[0], rank=c.ranks[0]),))
        table_plans.append(tp)
    plan = ShardingPlan(world_size, local_world_size, tuple(table_plans))
    plan.check(tables)
    return plan


class AllRanksError(ConfigError):
    """A ConfigError that every rank raises together (rank 0's, received in a broadcast)."""


def plan_on_rank0(make: Callable[[], ShardingPlan]) -> ShardingPlan:
    """Run `make` on rank 0 and broadcast its plan (or its ConfigError) to every rank, so all ranks train with
    the same plan even when they would detect slightly different free memory; every rank raises on an error."""
    payload: list = [None, None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload[0] = make()
        except ConfigError as e:
            payload[1] = str(e)
        except Exception as e:  # a bug: let the other ranks stop too instead of waiting in the broadcast
            failure, payload[1] = e, f"rank 0 failed while planning: {type(e).__name__}: {e}"
    dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    if payload[1] is not None:
        raise AllRanksError(payload[1])
    return payload[0]


class Reporter:
    """Rank 0's console lines, TensorBoard scalars and metrics file (gets only the logging section)."""

    def __init__(self, cfg: LoggingConfig, rank: int) -> None:
        self.active = rank == 0
        self.writer = None
        self.metrics_file = cfg.metrics_file if self.active else None
        if self.active and cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(cfg.tensorboard_dir)
            except ImportError:
                print("warning: the tensorboard package is not installed; TensorBoard logging is skipped", flush=True)

    def line(self, text: str) -> None:
        if self.active:
            from tqdm import tqdm

            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()

    def scalars(self, step: int, values: dict[str, float], kind: str) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(f"{kind}/{k}", v, step)
            self.writer.flush()
        if self.metrics_file and kind == "eval":
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True)
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@torch.no_grad()
def evaluate(model, source, device: torch.device) -> dict[str, float]:
    """Mean loss (weighted by samples), AUC (for models that score pairs) and recall@K (two-tower catalog mode)
    over every rank's held-out batches."""
    from torchmetrics.classification import BinaryAUROC

    model.eval()
    auroc = BinaryAUROC().to(device)
    scored = False
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
    hits: dict[int, torch.Tensor] = {}
    for batch in source.eval_batches():
        out = model.step(batch.to(device))
        totals[0] += out.loss.double() * batch.size
        totals[1] += batch.size
        if out.scores is not None:
            auroc.update(torch.sigmoid(out.scores), out.labels.long())
            scored = True
        for k, h in out.hits.items():
            hits[k] = hits.get(k, 0) + h.double()
    ks = sorted(hits)
    summed = torch.cat([totals, torch.stack([hits[k] for k in ks]).to(totals)]) if ks else totals
    if dist.is_initialized():
        dist.all_reduce(summed)
    result = {"loss": float(summed[0] / summed[1])}
    if scored:
        result["auc"] = float(auroc.compute())  # torchmetrics gathers every rank's scores
    result.update({f"recall@{k}": float(summed[2 + i] / summed[1]) for i, k in enumerate(ks)})
    result["samples"] = int(summed[1])
    model.train()
    return result


def format_eval(step: int, m: dict[str, float]) -> str:
    """One console line of an evaluation's metrics."""
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in m.items() if k != "samples")
    return f"eval  step {step:6d}  {metrics}  ({m['samples']} samples)"


def run(config_path: str, overrides: Sequence[str]) -> None:
    """One rank's training job."""
    from tqdm import tqdm

    from embshard.checkpoint import checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
    from embshard.data import build_source
    from embshard.distributed import init_distributed
    from embshard.models.build import RecModel

    cfg: TrainConfig = load_config(config_path, overrides)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    report = Reporter(cfg.logging, rank)
    tables = list(cfg.model.tables)
    sched = cfg.schedule
    report.line(f"embshard train {config_path}: {cfg.model.kind}, {len(tables)} tables, {world} ranks on {device.type}")
    plan = plan_on_rank0(
        lambda: make_plan(
            tables, cfg.planner, world, local_world, device.type, sched.batch_size, cfg.sparse_optimizer, report.line
        )
    )
    source = build_source(cfg.data, tables, sched.batch_size, cfg.seed, rank, world)
    total = sched.steps if sched.steps is not None else sched.epochs * source.steps_per_epoch
    model = RecModel(cfg.model, source.num_dense, plan, cfg.sparse_optimizer, device, world, cfg.seed)
    dense_opt = make_dense_optimizer(cfg.dense_optimizer, model.dense_parameters())
    start = 0
    ck = cfg.checkpoint
    if ck.resume_from:
        path = latest_checkpoint(ck.dir or ".") if ck.resume_from == "latest" else ck.resume_from
        if path is None:
            report.line(f"checkpoint.resume_from=latest: no checkpoint in {ck.dir!r} yet; starting from step 0")
        else:
            start = load_checkpoint(path, model, dense_opt)
            report.line(f"resumed from {path} at step {start}")

    def do_eval(step: int) -> None:
        m = evaluate(model, source, device)
        report.line(format_eval(step, m))
        report.scalars(step, m, "eval")

    if sched.eval_at_start and start == 0:
        do_eval(0)
    samples_per_step = sched.batch_size * world
    bar = tqdm(
        total=total * samples_per_step,
        initial=start * samples_per_step,
        unit="samples",
        unit_scale=True,
        disable=rank != 0 or not cfg.logging.progress_bar,
        file=sys.stdout,
        mininterval=1.0,
        dynamic_ncols=True,
    )
    window = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, steps
    t0, batches = time.time(), source.train_batches(start)
    step = start
    for step in range(start + 1, total + 1):
        out = model.step(next(batches).to(device))
        dense_opt.zero_grad(set_to_none=True)
        out.loss.backward()
        dense_opt.step()
        window += torch.stack([out.loss.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
        bar.update(samples_per_step)
        if step % cfg.logging.log_every == 0 or step == total:
            dist.all_reduce(window)
            loss = float(window[0] / window[1])
            rate = (step - start) * samples_per_step / (time.time() - t0)
            bar.set_postfix(loss=f"{loss:.4f}")
            report.line(f"train step {step:6d}  loss {loss:.4f}  {rate:,.0f} samples/s")
            report.scalars(step, {"loss": loss, "samples_per_s": rate}, "train")
            window.zero_()
        if sched.eval_every and step % sched.eval_every == 0 and step != total:
            do_eval(step)
        if ck.dir and ck.every and step % ck.every == 0 and step != total:
            save_checkpoint(checkpoint_path(ck.dir, step), model, dense_opt, step)
    bar.close()
    do_eval(step)
    if ck.dir:
        save_checkpoint(checkpoint_path(ck.dir, step), model, dense_opt, step)
        report.line(f"saved checkpoint {checkpoint_path(ck.dir, step)}")
    report.close()
    dist.destroy_process_group()


def make_dense_optimizer(o: DenseOptimizerConfig, params: list) -> torch.optim.Optimizer:
    """torch.optim optimizer of the dense parameters (gets only the dense_optimizer section)."""
    if o.kind == "adam":
        return torch.optim.Adam(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if o.kind == "adagrad":
        return torch.optim.Adagrad(params, lr=o.lr, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)


def _run_or_exit(config_path: str, overrides: Sequence[str]) -> None:
    try:
        run(config_path, overrides)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        if isinstance(e, AllRanksError) and dist.is_initialized():
            dist.barrier()  # no rank exits (and gets the others killed) before rank 0 has printed the message
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="embshard train", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="YAML config file (see docs/config.md and configs/)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. schedule.steps=100")
    ap.add_argument("--nproc", type=int, default=None, help="start N local processes (ignored under torchrun)")
    args = ap.parse_intermixed_args(argv)
    try:
        load_config(args.config, args.overrides)  # fail fast, before any process starts
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if "RANK" in os.environ or not args.nproc:
        _run_or_exit(args.config, args.overrides)
        return
    if torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        print(
            f"error: --nproc {args.nproc} starts one process per GPU, but {torch.cuda.device_count()} GPU(s) are "
            "visible: lower --nproc, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU",
            file=sys.stderr,
        )
        sys.exit(2)
    from torch.multiprocessing import ProcessExitedException

    from embshard.distributed import spawn_local

    try:
        spawn_local(_run_or_exit, args.nproc, args.config, args.overrides)
    except ProcessExitedException as e:
        sys.exit(e.exit_code or 1)


if __name__ == "__main__":
    main()
