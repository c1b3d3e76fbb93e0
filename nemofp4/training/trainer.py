"""The training loop.

Build order (each arrow one call with a typed argument):
data -> model on meta -> recipe swap -> parallelize + materialize (or init_from) -> quant state ->
optimizer -> engine -> checkpoint load. Per step: tick the quantizers' reference schedule, the engine's
step (``training/engine.py``: begin, forward/backward per micro-batch with gradient accumulation and its
sync toggle, then clip and update), metrics, periodic eval, periodic checkpoint, preemption check.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from nemofp4 import kernels
from nemofp4.data import build_train_loader, build_validation_batches, check_model_vocab
from nemofp4.evaluation.nll import validation_nll
from nemofp4.evaluation.run_config import read_saved_config
from nemofp4.models import build_model, lm_loss, param_groups
from nemofp4.quant import QuantTraining, QuantTrainingConfig
from nemofp4.recipes import apply_recipe
from nemofp4.training.checkpoint import CheckpointError, CheckpointManager, step_of
from nemofp4.training.config import JobConfig, compute_budget
from nemofp4.training.console import memory_record, run_summary
from nemofp4.training.dist_env import (
    all_reduce_mean,
    collective_timeout,
    destroy_distributed,
    detect_dist_env,
    init_distributed,
    local_device,
    require_process_group,
    set_collective_timeout,
)
from nemofp4.training.engine import build_engine
from nemofp4.training.faults import Faults
from nemofp4.training.init_from import initialize_from, starts_fresh, write_record
from nemofp4.training.job_plan import JobPlanner, log_plan_in_background, resolve_activation_checkpointing
from nemofp4.training.memory_check import check_first_step_fits
from nemofp4.training.metrics import MetricsLogger, peak_tflops, quant_role_summary, read_metrics
from nemofp4.training.nonfinite import (
    NonFiniteError,
    first_nonfinite_state_on_any_rank,
    where_nonfinite_starts,
)
from nemofp4.training.optim import build_optimizer
from nemofp4.training.parallel import parallelize_and_materialize
from nemofp4.training.plots import plot_run
from nemofp4.training.preemption import PreemptionHandler, flush_and_exit
from nemofp4.training.resume import ResumableState, load_resume_checkpoint
from nemofp4.training.rng import seed_everything
from nemofp4.training.run_dir import RUN_CONFIG, RunDirectory, describe_used
from nemofp4.training.run_identity import check_resume_config, validate_accept_list
from nemofp4.training.schedule import lr_multiplier

log = logging.getLogger("nemofp4")
COLLECTIVE_TIMEOUT_EXIT_CODE = 1


@contextlib.contextmanager
def cuda_sync_debug(mode: str):
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block; the previous mode is restored after."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def evaluate(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    *,
    device: torch.device,
    autocast: Any,
    head_chunk_tokens: int = 0,
) -> dict[str, float]:
    """The model's validation NLL in eval mode (:func:`~nemofp4.evaluation.nll.validation_nll`,
    data-parallel over the ranks)."""
    was_training = model.training
    model.eval()
    try:
        return validation_nll(model, batches, device=device, autocast=autocast, head_chunk_tokens=head_chunk_tokens)
    finally:
        model.train(was_training)


class _Progress:
    """The trainer's progress as a stateful object (entries of the trainer state): the step, the tokens
    seen, the skipped steps, the wandb run and the source of the initial weights."""

    def __init__(self, trainer: Trainer):
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        return {
            "step": t.step,
            "tokens_seen": t.tokens_seen,
            "skipped_steps": t.skipped_steps,
            "wandb_id": t.metrics.wandb_id if t.metrics else t.wandb_id,
            "init_from": t.init_record,  # the source of the initial weights and their hash (None: random init)
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        t = self._trainer
        t.step, t.tokens_seen, t.skipped_steps = state["step"], state["tokens_seen"], state["skipped_steps"]
        t.wandb_id, t.init_record = state.get("wandb_id"), state.get("init_from")


class Trainer:
    """One training run; `run()` trains to the budget (or until preempted) and returns a summary.
    ``planner`` (from whoever builds the job: nemofp4-train passes the memory planner's) resolves
    ``distributed.activation_checkpointing=auto`` and logs the plan of a GPU run; without one, ``auto``
    is an error and no plan is logged."""

    def __init__(self, cfg: JobConfig, *, planner: JobPlanner | None = None):
        self._started = time.perf_counter()
        self.cfg = cfg
        self.planner = planner
        # the long timeout until the first step is done (index build, first checkpoint load, compilation)
        self.env = init_distributed(detect_dist_env(), timeout_s=cfg.distributed.startup_timeout_s)
        self.rank, self.world = self.env.rank, self.env.world_size
        self.device = local_device(self.env)
        self.sync_debug = cfg.train.sync_debug if self.device.type == "cuda" else "off"
        if cfg.train.sync_debug != "off" and self.device.type != "cuda" and self.rank == 0:
            log.warning(
                "train.sync_debug=%s has no effect on %s: it checks CUDA host synchronizations",
                cfg.train.sync_debug,
                self.device.type,
            )
        self.run_dir = Path(cfg.run_dir)
        self.budget = compute_budget(cfg.train, self.world)
        validate_accept_list(cfg.resume_accept, cfg)
        self.run_directory = RunDirectory(self.run_dir, rank=self.rank, world=self.world, overwrite=cfg.overwrite)
        try:
            if self.budget.budget_remainder_tokens:
                log.warning(
                    "train.tokens=%g is not a whole number of steps of %d tokens: %d tokens are left over and "
                    "will not be trained on (%d steps)",
                    cfg.train.tokens,
                    self.budget.tokens_per_step,
                    self.budget.budget_remainder_tokens,
                    self.budget.total_steps,
                )
            # before anything large is allocated: a step that cannot fit stops here, with one line
            check_first_step_fits(
                cfg,
                world_size=self.world,
                local_world_size=self.env.local_world_size,
                device=self.device,
                rank=self.rank,
            )
            self._build()
        except BaseException:
            self.run_directory.abandon()  # release the lock; leave no empty run directory behind
            raise

    # ------------------------------------------------------------------------------------ build
    def _build(self) -> None:
        cfg = self.cfg
        seed_everything(cfg.train.seed)
        # data
        check_model_vocab(cfg.data, cfg.model.vocab_size)
        self.loader = build_train_loader(
            cfg.data,
            seq_len=cfg.train.seq_len,
            global_batch=cfg.train.global_batch,
            micro_batch=cfg.train.micro_batch,
            seed=cfg.train.seed,
            dp_rank=self.rank,
            dp_size=self.world,
            num_samples=self.budget.total_steps * cfg.train.global_batch,
        )
        self.val_batches = (
            build_validation_batches(
                cfg.data,
                seq_len=cfg.train.seq_len,
                num_sequences=cfg.eval.num_sequences,
                batch_size=cfg.eval.batch_size,
            )
            if cfg.eval.num_sequences
            else []
        )
        # the model on meta, its linears swapped by the recipe
        model = build_model(cfg.model, device="meta")
        self.recipe = cfg.recipe
        self.layer_table = apply_recipe(model, self.recipe, log=self.rank == 0)  # logs the per-layer table
        plan = log_plan_in_background(self.planner, cfg, rank=self.rank, world_size=self.world, device=self.device)
        # auto becomes a policy here, before anything is wrapped; the config and checkpoints record it
        cfg = self.cfg = resolve_activation_checkpointing(
            cfg, self.planner, rank=self.rank, world_size=self.world, device=self.device
        )
        if self.rank == 0 and self.layer_table.count("fp4"):
            log.info("%s", kernels.describe(self.device, cfg.train.kernels))
        # parallelized, with weights
        dist_cfg = cfg.distributed
        require_process_group(dist_cfg.backend, self.env)
        # with train.init_from the weights are the source's: materialize shards only, never the whole model
        model = parallelize_and_materialize(
            model, dist_cfg, device=self.device, seed=cfg.train.seed, full_init=not cfg.train.init_from
        )
        self.init_record: dict[str, Any] | None = None  # the source of the initial weights, when not random
        if cfg.train.init_from and starts_fresh(cfg.resume, self.run_dir, used=describe_used(self.run_dir) is not None):
            self.init_record = initialize_from(
                model, cfg.train.init_from, model_config=cfg.model, data=cfg.data, run_dir=self.run_dir
            )
        self.model = model
        # the FP4 linears, converted once (kernels, the reduction of held references, every quantizer knob);
        # then optimizer, engine, checkpoints
        self.quant = QuantTraining(
            model,
            QuantTrainingConfig(
                kernels=cfg.train.kernels,
                seed=cfg.train.seed,
                rank=self.rank,
                held_reduce_group=dist.group.WORLD if self.world > 1 and dist_cfg.reduce_references else None,
                stats_interval=cfg.logging.quant_stats_interval,
                weight_cache=cfg.train.weight_cache and self.budget.grad_accum > 1,
                restore_references=cfg.precision.restore_references,
            ),
        )
        self.optimizer = build_optimizer(cfg.optim, param_groups(model, cfg.optim.weight_decay))
        self.engine = build_engine(
            model,
            self.optimizer,
            cfg,
            grad_accum=self.budget.grad_accum,
            world_size=self.world,
            device_type=self.device.type,
            rank=self.rank,
        )
        self.ckpt = CheckpointManager(
            self.run_dir / "checkpoints", cfg.checkpoint, group_timeout_s=cfg.distributed.startup_timeout_s
        )
        self.ckpt.recover()  # interrupted saves repaired or removed, unmarked folders set aside
        self.autocast = (
            functools.partial(torch.autocast, self.device.type, dtype=torch.bfloat16)
            if cfg.train.dtype == "bfloat16"
            else contextlib.nullcontext
        )
        self._steady = False  # past the first step: the short collective timeout applies
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.wandb_id: str | None = None
        # the resume (every piece of resumable state, one stateful object each), then the run's records
        self.resumable = ResumableState(
            engine=self.engine, quant=self.quant, progress=_Progress(self), loader=self.loader, rank=self.rank
        )
        self._maybe_resume()
        self.faults = Faults(cfg.debug, resumed=self.resumed_from is not None)  # the one seam of debug.*
        if self.rank == 0:
            (self.run_dir / RUN_CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            if self.init_record is not None:
                write_record(self.run_dir, self.init_record)
        self.flops_per_token = cfg.model.flops_per_token(cfg.train.seq_len)
        self.peak_flops = peak_tflops(cfg.logging) * 1e12
        if plan is not None:
            plan.join()  # logged before training starts; the build above normally outlasts it

    def _dcp_state(self) -> dict[str, Any] | None:
        return self.resumable.dcp_state()

    def _maybe_resume(self) -> None:
        self.resumed_from = load_resume_checkpoint(
            self.ckpt, self.cfg.resume, run_dir=self.run_dir, rank=self.rank, state=self.resumable, refuse=self._refuse
        )
        if self.resumed_from is not None and self.rank == 0:
            log.info("resumed from %s at step %d (%d tokens seen)", self.resumed_from, self.step, self.tokens_seen)
        saved = self.run_dir / RUN_CONFIG
        if self.resumed_from is None and saved.is_file():  # an earlier start of this run that never wrote a checkpoint
            check_resume_config(
                read_saved_config(saved),
                self.cfg,
                step=0,
                saved_total=None,
                new_total=self.budget.total_steps,
                where=f"run_dir {self.run_dir}",
                log_notes=self.rank == 0,
            )

    def _refuse(self, trainer_state: Mapping[str, Any], folder: Path) -> None:
        """Refuse a checkpoint trained with another configuration, from its saved trainer state alone."""
        if "config" not in trainer_state:
            raise CheckpointError(
                f"checkpoint {folder}: its trainer state has no config; it was not written by nemofp4"
            )
        check_resume_config(
            trainer_state["config"],
            self.cfg,
            step=int(trainer_state["step"]),
            saved_total=trainer_state.get("total_steps"),
            new_total=self.budget.total_steps,
            where=f"checkpoint {folder}",
            log_notes=self.rank == 0,
        )

    def _trainer_state(self) -> dict[str, Any]:
        return {
            **self.resumable.trainer_state(),
            # the run's metadata, which the resume check reads (:meth:`_refuse`)
            "schedule": asdict(self.cfg.schedule),
            "config": OmegaConf.to_yaml(OmegaConf.structured(self.cfg)),
            "world_size": self.world,
            "total_steps": self.budget.total_steps,
        }

    def _rank_state(self) -> dict[str, Any]:
        return self.resumable.rank_state()

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded FP32 weights on CPU (collective under FSDP2 / ZeRO-3)."""
        return self.engine.full_model_state_dict()

    def save_checkpoint(self, *, final: bool = False) -> Path | None:
        """Write a checkpoint of the current state, unless it is not finite (then None: a checkpoint is
        only ever a good one, and retention keeps the last healthy checkpoint)."""
        unhealthy = first_nonfinite_state_on_any_rank(self.model, self.world)
        if unhealthy is not None:
            if self.rank == 0:
                last = self.ckpt.latest()
                log.error(
                    "step %d: not checkpointing: %s is not finite; the last healthy checkpoint is %s",
                    self.step,
                    unhealthy,
                    last if last else "none (no checkpoint yet)",
                )
            return None
        weights = self.full_model_state_dict() if final and self.cfg.checkpoint.export_safetensors else None

        def extra_files(folder: Path) -> None:
            if weights is not None:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
            self.faults.during_checkpoint_write(self.step)

        self._log_published(self.ckpt.wait())  # one save in flight at most
        folder = self.ckpt.save(
            self.step,
            dcp_state=self._dcp_state(),
            trainer_state=self._trainer_state(),
            rank_state=self._rank_state(),
            write_collective=self.engine.write_collective,
            extra_files=extra_files,
            hold_background_s=self.faults.async_save_hold_s(self.step),
        )
        if not self.ckpt.pending:
            self._log_published(folder)
        return folder

    def _log_published(self, folder: Path | None) -> None:
        """Record the step at which a checkpoint became complete (an async one: after its own step)."""
        if folder is not None:
            self.metrics.log("event", self.step, {"event": "checkpoint", "checkpoint_step": step_of(folder)})

    # ------------------------------------------------------------------------------------ loop
    def run(self) -> dict[str, Any]:
        """Train to the budget (or until preempted); returns a summary. A collective that times out
        ends this process at once, after one message naming the rank and the operation, as NCCL's
        error handling ends it on GPUs: the launcher then stops the other ranks."""
        try:
            return self._run()
        except RuntimeError as err:
            operation = collective_timeout(err) if self.world > 1 else None
            if operation is None:
                raise
            self._exit_after_collective_timeout(operation, err)

    def _exit_after_collective_timeout(self, operation: str, err: BaseException) -> None:
        timeout = self.cfg.distributed.collective_timeout_s if self._steady else self.cfg.distributed.startup_timeout_s
        name = "distributed.collective_timeout_s" if self._steady else "distributed.startup_timeout_s"
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        log.error(
            "rank %d of %d: %s timed out after %g s (%s) at step %d: a rank it waits for is stuck or gone; "
            "this process exits now [%s]",
            self.rank,
            self.world,
            operation,
            timeout,
            name,
            self.step,
            first_line,
        )
        # no clean-up: the group is broken, and a background save's thread may wait in it for its own timeout
        flush_and_exit(COLLECTIVE_TIMEOUT_EXIT_CODE)

    def _shorten_timeouts(self) -> None:
        """After the first step: every collective of the training loop waits at most
        distributed.collective_timeout_s (the async saves' own group keeps the start-up timeout)."""
        self._steady = True
        if self.world == 1:
            return
        timeout = self.cfg.distributed.collective_timeout_s
        set_collective_timeout(timeout, keep=[self.ckpt.save_group])
        if self.rank == 0:
            log.info(
                "collective timeout: %g s from now on (distributed.collective_timeout_s; start-up and the first "
                "step had %g s)",
                timeout,
                self.cfg.distributed.startup_timeout_s,
            )

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        total = self.budget.total_steps
        first_step = self.step
        self.metrics = MetricsLogger(
            self.run_dir,
            cfg.logging,
            rank=self.rank,
            run_name=cfg.name,
            config=OmegaConf.to_container(OmegaConf.structured(cfg)),
            total_steps=total,
            resume_step=self.step,
            wandb_id=self.wandb_id,
        )
        if self.rank == 0:
            print(f"run directory: {self.run_dir.resolve()}", flush=True)
        last_eval: dict[str, float] = {}
        if self.step == 0 and cfg.eval.at_start and self.val_batches:
            last_eval = self._eval()
        data_iter = iter(self.loader)
        stop_reason = "budget"
        with PreemptionHandler(exit_grace_s=cfg.preemption.exit_grace_s) as preemption:
            while self.step < total:
                self.step += 1
                self._train_step(data_iter)
                if not self._steady:
                    self._shorten_timeouts()
                self.faults.stall(self.step, self.rank)
                self._log_published(self.ckpt.poll())  # publish a finished async save at once
                interval_due = cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0
                if cfg.eval.interval and self.step % cfg.eval.interval == 0 and self.step < total and self.val_batches:
                    last_eval = self._eval()
                preempted = preemption.should_stop()
                if interval_due or (preempted and cfg.checkpoint.save_final):
                    self.save_checkpoint()
                self.faults.after_step(self.step, wait_for_checkpoint=self.ckpt.wait if interval_due else None)
                if preempted:
                    stop_reason = "preempted"
                    break
            if stop_reason == "budget":
                if self.val_batches:
                    last_eval = self._eval()
                already_saved = (cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0) or (
                    self.resumed_from is not None and step_of(self.resumed_from) == self.step  # a finished run, rerun
                )
                if cfg.checkpoint.save_final and (not already_saved or cfg.checkpoint.export_safetensors):
                    if cfg.checkpoint.export_safetensors and self.world > 1:  # rank 0 writes the full weights alone
                        set_collective_timeout(cfg.distributed.startup_timeout_s)
                    self.save_checkpoint(final=True)
            self._log_published(self.ckpt.wait())
            # the loggers (wandb's service process too) finish before the requeue, after which Slurm
            # signals every process of the step
            self.metrics.log("event", self.step, {"event": stop_reason, "tokens_seen": self.tokens_seen})
            self.metrics.close()
            exit_code = (
                preemption.requeue_and_exit_code(checkpoint=self.ckpt.latest(), step=self.step)
                if stop_reason == "preempted"
                else 0
            )
        plot = None
        if self.rank == 0 and cfg.logging.plots:
            plot = plot_run(self.run_dir, title=f"{cfg.name}: {cfg.precision.name}")
        if self.rank == 0 and cfg.logging.console:
            print(
                run_summary(
                    run_dir=self.run_dir,
                    records=read_metrics(self.run_dir),
                    first_step=first_step,
                    step=self.step,
                    total_steps=total,
                    tokens_seen=self.tokens_seen,
                    wall_s=time.perf_counter() - self._started,
                    stop_reason=stop_reason,
                    checkpoint=self.ckpt.latest(),
                    plot=plot,
                ),
                flush=True,
            )
        return {"step": self.step, "stop_reason": stop_reason, "exit_code": exit_code, **last_eval}

    def _eval(self) -> dict[str, float]:
        logged = [self.metrics.logged.get(("eval", self.step))]  # only rank 0 reads the history
        if self.world > 1:
            dist.broadcast_object_list(logged, src=0)  # every rank evaluates, or none (FSDP collectives)
        logged = logged[0]
        if logged is not None:  # evaluated before (a rerun of a finished run): the same weights, the same result
            return {k: v for k, v in logged.items() if k not in ("kind", "step")}
        result = evaluate(
            self.model,
            self.val_batches,
            device=self.device,
            autocast=self.autocast,
            head_chunk_tokens=self.cfg.train.head_chunk_tokens,
        )
        self.metrics.log("eval", self.step, result)
        return result

    def _train_step(self, data_iter) -> None:
        cfg = self.cfg
        step = self.step
        self.faults.before_step(self.model, step)
        lr = cfg.optim.lr * lr_multiplier(cfg.schedule, step, self.budget.total_steps)
        self.engine.begin_step(lr)
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        first_batch = None
        # the FP4 linears' step: references, SR seeds, statistics; each weight quantized once (the weights
        # change only in the engine's finish_step below)
        with self._sync_free(), self.quant.step(step):
            for micro in range(self.budget.grad_accum):
                batch = next(data_iter)
                input_ids = batch["input_ids"].to(self.device, non_blocking=True)
                labels = batch["labels"].to(self.device, non_blocking=True)
                first_batch = first_batch or (input_ids, labels)

                def loss_of(forward, input_ids=input_ids, labels=labels):
                    with self.autocast():
                        loss = lm_loss(
                            forward,
                            input_ids,
                            labels,
                            head_chunk_tokens=cfg.train.head_chunk_tokens,
                            head_precision=cfg.model.head_precision,
                        )
                    return self.faults.loss(step, loss)

                loss_sum += self.engine.forward_backward(loss_of, micro_batch=micro).detach()
            loss_avg = all_reduce_mean(loss_sum / self.budget.grad_accum)
        # clipping, the step's one host read of loss and gradient norm, and the update the engine makes
        grad_norm, finite = self.engine.finish_step(loss_avg, sync_free=self._sync_free)
        if not finite:
            self._handle_nonfinite(loss_avg, grad_norm, first_batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        self.tokens_seen += self.budget.tokens_per_step
        tokens_per_s = self.budget.tokens_per_step / elapsed
        record = {
            "loss": loss_avg.item(),
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": elapsed,
            "tokens_seen": self.tokens_seen,
        }
        if not finite:
            record["skipped"] = True
        record.update(memory_record(self.device))
        if self.device.type == "cuda":
            if self.peak_flops:
                record["mfu"] = self.flops_per_token * tokens_per_s / (self.peak_flops * self.world)
        self.metrics.log("train", step, record)
        layers = self.quant.stats(step)
        if layers is not None:
            self.metrics.log("quant", step, {"layers": layers, "roles": quant_role_summary(layers)})

    def _sync_free(self) -> contextlib.AbstractContextManager:
        """``train.sync_debug`` around a part of the step that must not synchronize with the host, from the
        second step of this process on (the first compiles, autotunes and allocates)."""
        if self.sync_debug == "off" or not self._steady:
            return contextlib.nullcontext()
        return cuda_sync_debug(self.sync_debug)

    def _handle_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> None:
        if self.cfg.train.nonfinite == "skip":
            self.skipped_steps += 1
            self.quant.discard_nonfinite()  # a reference first sampled in this step samples again
            log.warning(
                "step %d: non-finite loss %s / grad norm %s; update skipped (%d so far)",
                self.step,
                loss.item(),
                grad_norm.item(),
                self.skipped_steps,
            )
            if self.skipped_steps <= self.cfg.train.max_skipped_steps:
                return
        where = where_nonfinite_starts(self.model, batch[0], self.world)
        raise NonFiniteError(
            f"step {self.step}: non-finite loss ({loss.item()}) or gradient norm ({grad_norm.item()}); "
            f"first non-finite value: {where}"
            + (
                f"; {self.skipped_steps} steps were skipped, above train.max_skipped_steps"
                if self.skipped_steps
                else ""
            )
        )

    def close(self) -> None:
        self.ckpt.close()
        self.run_directory.close()
        destroy_distributed()


def train(cfg: JobConfig, *, planner: JobPlanner | None = None) -> dict[str, Any]:
    trainer = Trainer(cfg, planner=planner)
    try:
        return trainer.run()
    finally:
        trainer.close()
