"""`embshard train CONFIG [key.sub=value ...] [--nproc N]`: train a YAML-configured model.

Under torchrun (one process per GPU, any number of hosts) each process joins the job from torchrun's
environment; with `--nproc N` (and no torchrun) N local processes are started here. Rank 0 makes the sharding
plan (by default with the planner, embshard.planner: docs/planner.md) and broadcasts it; it prints the plan with
the predicted memory and time per rank, a progress bar with samples/s, the training loss every
logging.log_every steps, and the held-out loss and AUC (torchmetrics BinaryAUROC, synced over ranks) at every
evaluation (raw-id tables: ids admitted, evicted and resident, every logging.log_every steps); it also writes
TensorBoard event files and an optional JSON-lines metrics file. Each step runs through
the training pipeline (embshard/training/pipeline.py, `training.pipeline`): the next batch's copy and id exchange overlap
the current step by default. See docs/config.md for the configuration and docs/launch.md for launching."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from embshard.config import DenseOptimizerConfig, LoggingConfig, TrainConfig, load_config
from embshard.planner.policy import plan_for_job
from embshard.planner.step_choice import GraphChoice
from embshard.runtime import comm
from embshard.runtime.heap import import_frozen
from embshard.spec.plan import ShardingPlan
from embshard.spec.tables import AllRanksError, ConfigError
from embshard.training import launch_checks
from embshard.training.group_plan import auto_group_plan_for_job, dense_spec, graph_request
from embshard.training.mode import Fallback, StepMode, resolve_step_mode
from embshard.training.schedule import past_schedule, run_schedule


def plan_job(cfg: TrainConfig, device: torch.device, world: int, local_world: int, log: Callable[[str], None]):
    """The job's sharding plan: `plan_job_and_choice`'s plan."""
    return plan_job_and_choice(cfg, device, world, local_world, log)[0]


def plan_job_and_choice(
    cfg: TrainConfig, device: torch.device, world: int, local_world: int, log: Callable[[str], None]
) -> tuple[ShardingPlan, GraphChoice | None]:
    """The job's sharding plan (planner.*, priced for schedule.batch_size per rank, the lookups' output dtype and
    cfg.batch_counts; a plan the whole-step CUDA graph holds first where the job asks for it, or with
    training.cuda_graph auto on GPUs the faster of that and the eager step's: `graph_request`), made on rank 0 and
    broadcast (`plan_on_rank0`), and the planner's choice between the two (None: none made; for `resolve_step_mode`).
    The auto settings are those of the job's step mode before the plan (`resolve_step_mode`)."""
    asked = resolve_step_mode(cfg, device.type).applied(cfg)  # what the planner is asked for: auto settings resolved
    request = graph_request(cfg, asked) if device.type == "cuda" else False  # auto: graphed or eager, the faster
    cfg = asked
    tables, batch = list(cfg.model.tables), cfg.schedule.batch_size
    counts = cfg.batch_counts
    twod = cfg.sharding
    if twod.group_size == "auto":  # the planner picks the group size (or no 2D) and plans the group
        return plan_on_rank0(lambda: auto_group_plan_for_job(cfg, world, local_world, device.type, log)), None
    if twod.group_size is not None:  # 2D: plan one sharding group (the step mode above turned CUDA graphs off)
        group_local = twod_local_world(twod.group_size, world, local_world)
        plan = plan_on_rank0(
            lambda: plan_for_job(
                tables, cfg.planner, twod.group_size, group_local, device.type, batch, cfg.sparse_optimizer, log,
                cfg.lookup, "device", whole_step_graph=False,
            )
        )  # fmt: skip
        plan = replace(
            plan, world_size=world, local_world_size=local_world, sharding_group_size=twod.group_size,
            replica_sync=twod.replica_sync, replica_sync_every=twod.replica_sync_every,
        )  # fmt: skip
        log(str(plan))
        return plan, None

    def make() -> tuple[ShardingPlan, GraphChoice | None]:
        reports: list = []
        plan = plan_for_job(
            tables, cfg.planner, world, local_world, device.type, batch, cfg.sparse_optimizer, log, cfg.lookup,
            counts, whole_step_graph=request, on_report=reports.append, dense=dense_spec(cfg),
        )  # fmt: skip
        return plan, (reports[0].graph_choice if reports else None)

    return plan_on_rank0(make)


def twod_local_world(group_size: int, world: int, local_world: int) -> int:
    """Ranks per host within one sharding group of `group_size` ranks (ConfigError naming sharding.group_size
    unless it divides the world and is a multiple or a divisor of the ranks per host)."""
    if world % group_size or (group_size % local_world and local_world % group_size):
        raise ConfigError(
            f"sharding.group_size={group_size} does not fit this job of {world} ranks, {local_world} per host: it "
            "must divide the world size and be a multiple or a divisor of the ranks per host (e.g. "
            f"{local_world}: one group per host), or null for no 2D sharding"
        )
    return local_world if group_size % local_world == 0 else group_size


def build_model(
    cfg: TrainConfig,
    plan: ShardingPlan,
    num_dense: int,
    device: torch.device,
    world: int,
    log: Callable[[str], None],
    mode: StepMode | None = None,
) -> tuple[Any, torch.optim.Optimizer, Any, StepMode]:
    """(RecModel, dense optimizer, ModelGraphs, StepMode) of the job on `plan`, built in the step `mode` (default:
    `resolve_step_mode` of cfg, the device and the plan: training.cuda_graph, training.graph_scope, training.compile
    and lookup.output_dtype, their auto values resolved). What only the built model tells (the dense optimizer's
    capturable step, the model's own refusal) may turn the graphs off: the returned mode says so (`log` gets nothing;
    print `mode.line()`). Hand the graphs to the pipeline (`TrainPipeline(graphs=...)`)."""
    from embshard.models.build import RecModel
    from embshard.training.model_graphs import ModelGraphs, compile_dense

    mode = mode or resolve_step_mode(cfg, device.type, plan)
    cfg = mode.applied(cfg)
    model = RecModel(cfg.model, num_dense, plan, cfg.sparse_optimizer, device, world, cfg.seed, cfg.lookup)
    dense_opt = make_dense_optimizer(cfg.dense_optimizer, model.dense_parameters())
    graphs = ModelGraphs(model)
    compiled = None if mode.compile == "none" else mode.compile
    if mode.scope != "eager":
        bf16 = cfg.training.precision == "bf16"
        why_not = graphs.capture_dense_step(dense_opt, cfg.schedule.batch_size, bf16, compiled, mode.scope == "dense")
        if why_not is not None:
            mode = mode.fallen_back("eager", Fallback("CUDA graphs off", why_not, "", "training.cuda_graph=false"))
        elif mode.scope == "step":
            why_not = graphs.capture_whole_step(cfg.training.graph_overlap)
            if why_not is not None:
                off = Fallback("whole-step graph off", why_not, "", "training.graph_scope=dense")
                mode = mode.fallen_back("dense", off)
    if compiled is not None and mode.scope == "eager":
        compile_dense(model, compiled, cfg.schedule.batch_size)  # the dense graph, where there is one, holds it
    return model, dense_opt, graphs, mode


def plan_on_rank0(make: Callable[[], Any]) -> Any:
    """Run `make` on rank 0 and broadcast its plan (with what else it returns; or its ConfigError) to every rank, so
    all ranks train with the same plan even where free memory differs; every rank raises on an error."""
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
def evaluate(model, source, device: torch.device, host_group=None) -> dict[str, float]:
    """Mean loss (weighted by samples), AUC (for models that score pairs), recall@K (two-tower catalog mode) and
    the model's own per-sample metrics (StepOutput.metrics: HR@K, NDCG@K of kind hstu) over every rank's held-out
    batches. Collective: a rank with fewer batches feeds empty ones until every rank's
    have ended (`pipeline.even_batches`, over `host_group` if given, else the default group)."""
    from torchmetrics.classification import BinaryAUROC

    from embshard.training.pipeline import empty_batch, even_batches

    comm.wait_for_graphs()  # torchmetrics' gather and the sums below are collectives outside any graph
    model.eval()
    auroc = BinaryAUROC().to(device)
    scored = False
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
    hits: dict[int, torch.Tensor] = {}
    named: dict[str, torch.Tensor] = {}
    for batch in even_batches(source.eval_batches(), empty_batch(model), host_group, device):
        out = model.step(batch.to(device))  # every rank steps, an empty batch too (the exchanges are collective)
        if batch.size:  # ranks whose held-out data ended first (or had bad rows skipped) step on empty batches
            totals[0] += out.loss.double() * batch.size
        totals[1] += batch.size
        if out.scores is not None:  # also an empty batch: every rank then joins AUROC's gather in compute()
            auroc.update(torch.sigmoid(out.scores.float()), out.labels.long())
            scored = True
        for k, h in out.hits.items():
            hits[k] = hits.get(k, 0) + h.double()
        for name, v in out.metrics.items():  # every rank reports the same names (an empty batch: zeros)
            named[name] = named.get(name, 0) + v.double()
    ks, names = sorted(hits), sorted(named)
    extra = [hits[k] for k in ks] + [named[n] for n in names]
    summed = torch.cat([totals, torch.stack(extra).to(totals)]) if extra else totals
    if dist.is_initialized():
        dist.all_reduce(summed)
    result = {"loss": float(summed[0] / summed[1])}
    if scored:
        result["auc"] = float(auroc.compute())  # torchmetrics gathers every rank's scores
    result.update({f"recall@{k}": float(summed[2 + i] / summed[1]) for i, k in enumerate(ks)})
    result.update({n: float(summed[2 + len(ks) + i] / summed[1]) for i, n in enumerate(names)})
    result["samples"] = int(summed[1])
    model.train()
    return result


def log_raw_ids(ebc, report: Reporter, step: int) -> None:
    """Raw-id tables: ids admitted and evicted since the last call and ids resident now, per table (TensorBoard
    `raw_ids/<table>/<admitted|evicted|resident>`) and in total (one console line). Collective."""
    if not any(t.raw_ids for t in ebc.tables):
        return
    stats = ebc.raw_id_stats(gather=True)
    ebc.reset_raw_id_stats()
    total = {k: sum(st[k] for st in stats.values()) for k in ("admitted", "evicted", "resident", "capacity")}
    report.line(
        f"raw ids step {step:6d}  {len(stats)} tables: admitted {total['admitted']:,}  evicted {total['evicted']:,}  "
        f"resident {total['resident']:,} of {total['capacity']:,}"
    )
    scalars = {f"{name}/{k}": float(st[k]) for name, st in stats.items() for k in ("admitted", "evicted", "resident")}
    scalars.update({f"all/{k}": float(v) for k, v in total.items() if k != "capacity"})
    report.scalars(step, scalars, "raw_ids")


def format_eval(step: int, m: dict[str, float]) -> str:
    """One console line of an evaluation's metrics."""
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in m.items() if k != "samples")
    return f"eval  step {step:6d}  {metrics}  ({m['samples']} samples)"


def run(config_path: str, overrides: Sequence[str]) -> None:
    """One rank's training job."""
    from tqdm import tqdm

    from embshard.checkpoint import checkpointer
    from embshard.data import build_source
    from embshard.runtime.distributed import init_distributed
    from embshard.training.pipeline import TrainPipeline

    cfg: TrainConfig = load_config(config_path, overrides)
    device = init_distributed(cfg.runtime.collective_timeout_s, whole_step_graph=cfg.whole_step_graph)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    report = Reporter(cfg.logging, rank)
    tables = list(cfg.model.tables)
    sched = cfg.schedule
    report.line(f"embshard train {config_path}: {cfg.model.kind}, {len(tables)} tables, {world} ranks on {device.type}")
    import_frozen(*launch_checks.RANK_MODULES)  # a rank's libraries, left out of Python's collections (runtime/heap.py)

    t_build = time.time()
    plan, choice = plan_job_and_choice(cfg, device, world, local_world, report.line)
    source = build_source(cfg.data, tables, sched.batch_size, cfg.seed, rank, world)
    mode = resolve_step_mode(cfg, device.type, plan, choice)  # the planner's choice of graph or eager step
    model, dense_opt, graphs, mode = build_model(cfg, plan, source.num_dense, device, world, report.line, mode)
    cfg = mode.applied(cfg)  # the settings as the job runs them
    report.line(mode.line())
    report.line(f"plan and model built in {time.time() - t_build:.1f} s")
    ck = cfg.checkpoint
    if rank == 0:
        launch_checks.clear_checkpoints(ck, report.line)  # checkpoint.overwrite: before any save of this run
    ckpt = checkpointer(ck, model, dense_opt, config=cfg, log=report.line)
    start, position = ckpt.resume(ck.resume_from)  # position: after the last trained batch (or the step count)
    s = run_schedule(sched, source.steps_per_epoch, world, start, position, saved_samples_per_step(ckpt.resumed))
    start, total = s.start, s.total  # start: this run's step holding the checkpoint's samples
    if s.note:
        report.line(s.note)
    past = past_schedule(s, sched, source.steps_per_epoch, world, ckpt.resumed)
    if past is not None:
        if start > total:
            raise AllRanksError(past)  # every rank computes the same
        report.line(past)
    tr = cfg.training
    pipeline = TrainPipeline(
        model,
        dense_opt,
        tr.pipeline,
        check_finite=cfg.runtime.nan_check,
        precision=tr.precision,
        prefetch_batches=tr.prefetch_batches,
        ids_checked=getattr(source, "ids_in_range", False),
        start_step=start,
        graphs=graphs,
    )

    def do_eval(step: int) -> None:
        m = evaluate(model, source, device, pipeline.host_group)
        report.line(format_eval(step, m))
        report.scalars(step, m, "eval")

    if sched.eval_at_start and start == 0:
        do_eval(0)
    bar = tqdm(
        total=s.samples_total,
        initial=s.samples_done,  # the samples really trained (the checkpoint's steps may hold other counts)
        unit="samples",
        unit_scale=True,
        disable=rank != 0 or not cfg.logging.progress_bar,
        file=sys.stdout,
        mininterval=1.0,
        dynamic_ncols=True,
    )
    try:
        step, position = train_steps(cfg, model, pipeline, source, s, bar, report, do_eval, ckpt, device)
    finally:
        bar.close()  # ends the bar's line: a message printed next (an error too) starts on its own
    pipeline.close()
    replays = graphs.summary()
    if replays:
        report.line(replays)
    if getattr(model.ebc, "twod", None) is not None:
        report.line(model.ebc.replica_report())  # periodic: averaged, so every group ends with the same model
    do_eval(step)
    if ck.dir and step > start:
        ckpt.save(step, position)
    ckpt.close()
    if ck.dir and step > start:
        report.line(f"saved checkpoint {ckpt.history[-1].path}")
    report.close()
    graphs.release()  # before the process group goes: a live graph with NCCL in it hangs the teardown
    dist.destroy_process_group()


def train_steps(cfg: TrainConfig, model, pipeline, source, s, bar, report: Reporter, do_eval, ckpt, device):
    """The training loop from step s.start to s.total (or the data's end): logs, evaluations and checkpoints as
    configured; returns (last step, data position after its batch)."""
    sched, ck = cfg.schedule, cfg.checkpoint
    start, total, samples_per_step = s.start, s.total, s.samples_per_step
    window = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, steps
    t0, batches = time.time(), source.train_batches(s.position)
    step, position = start, s.position
    while step < total:
        # model.ebc.step is set to each batch's step before its training forward (inside the pipeline).
        done = pipeline.progress(batches)
        if done is None:  # every rank's data has ended
            break
        step, position = done.step, done.position  # position: the data position after the last TRAINED batch
        if done.size:  # an empty batch (this rank's data ended first) adds no loss
            window += torch.stack([done.output.loss.detach().double(), torch.ones_like(window[0])])
        bar.update(samples_per_step)
        if step % cfg.logging.log_every == 0 or step == total:
            comm.start_all_reduce(window, what="training loss sum").wait(host=True)
            loss = float(window[0] / window[1].clamp(min=1))
            rate = (step - start) * samples_per_step / (time.time() - t0)
            bar.set_postfix(loss=f"{loss:.4f}")
            report.line(f"train step {step:6d}  loss {loss:.4f}  {rate:,.0f} samples/s")
            report.scalars(step, {"loss": loss, "samples_per_s": rate}, "train")
            window.zero_()
            log_raw_ids(model.ebc, report, step)
        if sched.eval_every and step % sched.eval_every == 0 and step != total:
            do_eval(step)
        if ck.dir and ck.every and step % ck.every == 0 and step != total:
            comm.wait_for_graphs()
            ckpt.save(step, position)
    return step, position


def saved_samples_per_step(resumed: Any) -> int | None:
    """Samples (all ranks) of each step of the run that saved the resumed checkpoint (its world size x its
    config's schedule.batch_size; None: nothing resumed, or a checkpoint saved without its config)."""
    if resumed is None:
        return None
    from embshard.checkpoint import read_manifest

    config = read_manifest(resumed.path).get("config") or {}
    batch = (config.get("schedule") or {}).get("batch_size")
    return int(batch) * resumed.saved_world_size if batch else None


def make_dense_optimizer(o: DenseOptimizerConfig, params: list) -> torch.optim.Optimizer:
    """torch.optim optimizer of the dense parameters (gets only the dense_optimizer section). On a GPU, torch's fused
    implementation (one kernel launch for every parameter, and little host work) where this torch has it for the
    kind; elsewhere torch's default (foreach)."""
    own = {
        "adam": {"betas": (o.beta1, o.beta2), "eps": o.eps},
        "adagrad": {"eps": o.eps},
        "sgd": {"momentum": o.momentum},
    }
    fused = {"fused": True} if _fused_available(o.kind, params) else {}
    return _OPTIMIZERS[o.kind](params, lr=o.lr, weight_decay=o.weight_decay, **own[o.kind], **fused)


_OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}
_FUSED: dict[tuple[str, str], bool] = {}


def _fused_available(kind: str, params: list) -> bool:
    """Whether torch's fused `kind` runs on the parameters' device (CUDA only: the CPU keeps the foreach path the
    tests compare with): one step of a one-element parameter, once per process."""
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return False
    device = next(iter(devices))
    key = (kind, str(device))
    if key not in _FUSED:
        try:
            probe = torch.zeros(1, device=device, requires_grad=True)
            probe.grad = torch.ones(1, device=device)
            _OPTIMIZERS[kind]([probe], lr=0.1, fused=True).step()
            _FUSED[key] = True
        except (RuntimeError, NotImplementedError, TypeError):
            _FUSED[key] = False
    return _FUSED[key]


def _run_or_exit(config_path: str, overrides: Sequence[str]) -> None:
    try:
        run(config_path, overrides)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        if isinstance(e, AllRanksError) and dist.is_initialized():
            comm.barrier()  # no rank exits (and gets the others killed) before rank 0 has printed the message
        sys.exit(2)


def preflight(config_path: str, overrides: Sequence[str], nproc: int | None) -> TrainConfig:
    """Everything `embshard train` checks before any rank starts (ConfigError naming the flag or key, the value
    and the fix): --nproc, the config, the checkpoint folder (no earlier run's checkpoints replaced unless told
    to), the data sources (opened as the ranks will); prints a notice where the run is sized for GPUs but runs
    on CPUs. Under torchrun every process checks (before joining the group); rank 0 prints the notice."""
    from embshard.data import check_source

    launch_checks.check_nproc(nproc)
    cfg = load_config(config_path, overrides)
    conflict = launch_checks.checkpoint_conflict(cfg.checkpoint)
    if conflict:
        raise ConfigError(conflict)
    check_source(cfg.data, list(cfg.model.tables), cfg.schedule.batch_size, cfg.seed)
    notice = None if torch.cuda.is_available() else launch_checks.cpu_notice(cfg, config_path)
    if notice and os.environ.get("RANK", "0") == "0":
        print(notice, flush=True)
    return cfg


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="embshard train", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="YAML config file (see docs/config.md and configs/)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. schedule.steps=100")
    ap.add_argument("--nproc", type=int, default=None, help="start N local processes (ignored under torchrun)")
    args = ap.parse_intermixed_args(argv)
    try:
        preflight(args.config, args.overrides, args.nproc)  # fail fast, before any process starts
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if "RANK" in os.environ or args.nproc is None:
        _run_or_exit(args.config, args.overrides)
        return
    if torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        print(
            f"error: --nproc {args.nproc} starts one process per GPU, but {torch.cuda.device_count()} GPU(s) are "
            "visible: lower --nproc, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU",
            file=sys.stderr,
        )
        sys.exit(2)
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from embshard.runtime.distributed import spawn_local

    try:
        spawn_local(_run_or_exit, args.nproc, args.config, args.overrides, preload=launch_checks.RANK_MODULES)
    except ProcessExitedException as e:
        sys.exit(e.exit_code or 1)
    except ProcessRaisedException:
        print(flush=True)  # rank 0's progress bar may have been cut off mid-line: the error starts on a line of its own
        raise


if __name__ == "__main__":
    main()
