"""The training loop.

Build order (each arrow one call with a typed argument):
data -> model on meta -> recipe swap -> parallelize -> materialize + init -> optimizer ->
checkpoint load. Per step: tick the quantizers' reference schedule, forward/backward with gradient
accumulation, clip, optimizer step, metrics, periodic eval, periodic checkpoint, preemption check.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from nemofp4 import kernels
from nemofp4.data import build_train_loader, build_validation_batches, check_model_vocab
from nemofp4.models import build_model, lm_loss, param_groups
from nemofp4.quant import QuantTraining, QuantTrainingConfig, without_quant_state
from nemofp4.recipes import apply_recipe, recipe_from_config
from nemofp4.training import deepspeed_engine
from nemofp4.training.checkpoint import CheckpointError, CheckpointManager, step_of
from nemofp4.training.config import JobConfig, compute_budget
from nemofp4.training.console import memory_record, run_summary
from nemofp4.training.dist_env import (
    collective_timeout,
    destroy_distributed,
    detect_dist_env,
    init_distributed,
    local_device,
    require_process_group,
    set_collective_timeout,
)
from nemofp4.training.faults import Faults
from nemofp4.training.init_from import initialize_from, starts_fresh, write_record
from nemofp4.training.job_plan import JobPlanner, resolve_activation_checkpointing
from nemofp4.training.metrics import MetricsLogger, peak_tflops, quant_role_summary, read_metrics
from nemofp4.training.nonfinite import (
    NonFiniteError,
    first_nonfinite_gradient,
    first_nonfinite_module,
    first_nonfinite_state,
)
from nemofp4.training.optim import build_optimizer, set_lr
from nemofp4.training.parallel import AC_AUTO, parallelize, set_gradient_sync
from nemofp4.training.plots import plot_run
from nemofp4.training.preemption import PreemptionHandler, flush_and_exit
from nemofp4.training.rng import rng_state, seed_everything, set_rng_state
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


def _all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], *, device: torch.device,
             autocast: Any, head_chunk_tokens: int = 0) -> dict[str, float]:
    """Token-weighted mean loss over a fixed list of batches, data-parallel: each rank evaluates
    every world-th batch and the NLL sums and token counts are all-reduced."""
    was_training = model.training
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # NLL sum, token count
    for index in range(rank, -(-len(batches) // world) * world, world):
        # a rank past the end re-runs the last batch uncounted: every rank makes the same number of
        # forward calls, so FSDP's / ZeRO-3's collectives stay matched
        batch = batches[min(index, len(batches) - 1)]
        input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        with autocast():
            loss = lm_loss(model, input_ids, labels, head_chunk_tokens=head_chunk_tokens)
        if index < len(batches):
            sums[0] += loss.double() * labels.numel()
            sums[1] += labels.numel()
    if world > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    model.train(was_training)
    total, count = sums.tolist()
    val_loss = total / max(count, 1)
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)), "val_tokens": int(count)}


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
            log.warning("train.sync_debug=%s has no effect on %s: it checks CUDA host synchronizations",
                        cfg.train.sync_debug, self.device.type)
        self.run_dir = Path(cfg.run_dir)
        self.budget = compute_budget(cfg.train, self.world)
        validate_accept_list(cfg.resume_accept, cfg)
        self.run_directory = RunDirectory(self.run_dir, rank=self.rank, world=self.world, overwrite=cfg.overwrite)
        try:
            if self.budget.budget_remainder_tokens:
                log.warning(
                    "train.tokens=%g is not a whole number of steps of %d tokens: %d tokens are left over and "
                    "will not be trained on (%d steps)",
                    cfg.train.tokens, self.budget.tokens_per_step, self.budget.budget_remainder_tokens,
                    self.budget.total_steps,
                )
            self._build()
        except BaseException:
            self.run_directory.abandon()  # release the lock; leave no empty run directory behind
            raise

    # ------------------------------------------------------------------------------------ build
    def _build(self) -> None:
        cfg = self.cfg
        seed_everything(cfg.train.seed)
        check_model_vocab(cfg.data, cfg.model.vocab_size)
        self.loader = build_train_loader(
            cfg.data,
            seq_len=cfg.train.seq_len,
            global_batch=cfg.train.global_batch,
            micro_batch=cfg.train.micro_batch,
            num_samples=self.budget.total_steps * cfg.train.global_batch,
            seed=cfg.train.seed,
            dp_rank=self.rank,
            dp_size=self.world,
        )
        self.val_batches = (
            build_validation_batches(
                cfg.data, seq_len=cfg.train.seq_len, num_sequences=cfg.eval.num_sequences,
                batch_size=cfg.eval.batch_size,
            )
            if cfg.eval.num_sequences
            else []
        )
        model = build_model(cfg.model, device="meta")
        self.recipe = recipe_from_config(cfg.precision)
        self.layer_table = apply_recipe(model, self.recipe, log=self.rank == 0)  # logs the per-layer table
        plan = self._log_plan_in_background()
        # auto becomes a policy here, before anything is wrapped; the config and checkpoints record it
        cfg = self.cfg = resolve_activation_checkpointing(cfg, self.planner, rank=self.rank, world_size=self.world,
                                                          device=self.device)  # fmt: skip
        if self.rank == 0 and self.layer_table.count("fp4"):
            log.info("%s", kernels.describe(self.device, cfg.train.kernels))
        dist_cfg = cfg.distributed
        require_process_group(dist_cfg.backend, self.env)
        # with train.init_from the weights are the source's: materialize shards only, never the whole model
        if dist_cfg.backend == "fsdp" and dist_cfg.init_full_model and not cfg.train.init_from:
            model.to_empty(device=self.device)
            torch.manual_seed(cfg.train.seed)
            model.init_weights()
            model = parallelize(model, dist_cfg, device_type=self.device.type)
        else:
            model = parallelize(model, dist_cfg, device_type=self.device.type)
            model.to_empty(device=self.device)
            torch.manual_seed(cfg.train.seed)
            model.init_weights()
        if self.world > 1 and dist_cfg.backend == "none":
            raise ValueError(
                f"{self.world} processes were launched but distributed.backend=none; "
                "use distributed=fsdp (or a deepspeed_zero* backend)"
            )
        self.init_record: dict[str, Any] | None = None  # the source of the initial weights, when not random
        if cfg.train.init_from and starts_fresh(cfg.resume, self.run_dir, used=describe_used(self.run_dir) is not None):
            self.init_record = initialize_from(model, cfg.train.init_from, model_config=cfg.model, data=cfg.data,
                                               run_dir=self.run_dir)
        self.model = model
        self.quant = QuantTraining(model, QuantTrainingConfig(  # the FP4 linears, converted once
            kernels=cfg.train.kernels, seed=cfg.train.seed, rank=self.rank,
            held_reduce_group=dist.group.WORLD if self.world > 1 and dist_cfg.reduce_references else None,
            stats_interval=cfg.logging.quant_stats_interval,
            weight_cache=cfg.train.weight_cache and self.budget.grad_accum > 1,
            restore_references=cfg.precision.restore_references,
        ))  # fmt: skip
        self.optimizer = build_optimizer(cfg.optim, param_groups(model, cfg.optim.weight_decay))
        self.engine = None  # a DeepSpeed engine when distributed.backend=deepspeed_zero*
        if dist_cfg.backend.startswith("deepspeed"):
            if cfg.train.nonfinite == "skip":
                raise ValueError("train.nonfinite=skip is not supported with DeepSpeed (its step cannot be "
                                 "undone after the fact); use train.nonfinite=stop")
            ds_config = deepspeed_engine.deepspeed_config(
                stage=deepspeed_engine.zero_stage(dist_cfg.backend), micro_batch=cfg.train.micro_batch,
                grad_accum=self.budget.grad_accum, world_size=self.world, grad_clip=cfg.train.grad_clip,
                bf16=cfg.train.dtype == "bfloat16" and self.device.type == "cuda",
            )
            self.engine = deepspeed_engine.initialize(model, self.optimizer, ds_config)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint,
                                      group_timeout_s=cfg.distributed.startup_timeout_s)
        if cfg.checkpoint.async_save and self.engine is not None and self.rank == 0:
            log.warning("checkpoint.async_save=true has no effect with distributed.backend=%s: DeepSpeed writes "
                        "its checkpoints synchronously", dist_cfg.backend)
        self.ckpt.remove_incomplete()
        if cfg.train.dtype == "bfloat16":
            self.autocast = lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)
        else:
            self.autocast = contextlib.nullcontext
        self._steady = False  # past the first step: the short collective timeout applies
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0
        self.wandb_id: str | None = None
        self.resumed_from: Path | None = None
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

    def _log_plan_in_background(self) -> threading.Thread | None:
        """Rank 0 logs the memory plan of a configured policy (seconds of meta-device tracing at 8B) in
        a thread, while every rank builds, shards and loads: the others never wait for it in a
        collective. (``auto`` logs the plan that chose its policy instead.)"""
        if self.rank != 0 or self.planner is None or self.cfg.distributed.activation_checkpointing == AC_AUTO:
            return None
        thread = threading.Thread(target=self.planner.log_plan, args=(self.cfg,), name="nemofp4-memory-plan", daemon=True,
                                  kwargs={"world_size": self.world, "device": self.device, "log": log})  # fmt: skip
        thread.start()
        return thread

    def _dcp_state(self) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state: dict[str, Any] = {}
        if self.engine is None:  # DeepSpeed writes model and optimizer in its own format
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optim": optim_sd}  # the model's: weights and held FP4 references
        return state or None

    def _maybe_resume(self) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        cfg = self.cfg
        used = describe_used(self.run_dir)
        if cfg.resume == "none" and used:
            raise ValueError(
                f"resume=none, but run_dir {self.run_dir} already holds a run ({used}). Resume it (resume=auto), "
                "choose another run_dir, or pass overwrite=true to move it aside and start over"
            )
        candidates = self.ckpt.candidates(cfg.resume)
        failures = []
        for folder in candidates:
            state = self._dcp_state()
            try:
                trainer_state, rank_state, own = self.ckpt.load(
                    folder, dcp_state=state,
                    read_collective=(lambda f: deepspeed_engine.load(self.engine, f)) if self.engine else None,
                    check=lambda saved, folder=folder, state=state: self._check_identity(saved, folder, state),
                )
            except CheckpointError as err:
                if cfg.resume != "auto":
                    raise
                log.warning("%s; falling back to the previous complete checkpoint", err)
                failures.append(folder)
                continue
            self.quant.finish_load(trainer_state, rank_state, state)  # before the model state is set
            if state is not None and "model" in state:
                set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
            self._restore(trainer_state, rank_state, own)
            self.resumed_from = folder
            if self.rank == 0:
                log.info("resumed from %s at step %d (%d tokens seen)", folder, self.step, self.tokens_seen)
            for damaged in failures:  # only once another one loaded: if none does, the refusal lists them in place
                aside = self.ckpt.set_aside(damaged)
                if self.rank == 0:
                    log.warning("moved the damaged checkpoint %s aside to %s: it is not tried again and "
                                "checkpoint.keep_last_k does not count it (nothing was deleted)", damaged, aside)
            return
        if failures:
            raise CheckpointError(
                f"no checkpoint in {self.ckpt.root} could be loaded (tried {', '.join(f.name for f in failures)}; "
                "reasons above). "
                "Repair or restore one, resume from another with resume=<path>, or pass overwrite=true to move this "
                "run aside and start over"
            )
        saved = self.run_dir / RUN_CONFIG
        if saved.is_file():  # an earlier start of this run that never wrote a checkpoint
            check_resume_config(saved.read_text(), cfg, step=0, saved_total=None, new_total=self.budget.total_steps,
                                where=f"run_dir {self.run_dir}", log_notes=self.rank == 0)

    def _check_identity(self, trainer_state: dict[str, Any], folder: Path, dcp_state: dict[str, Any] | None) -> None:
        """Refuse a checkpoint trained with another configuration before any of its tensors is read;
        an older checkpoint's held references are read where it kept them."""
        if "config" not in trainer_state:
            raise CheckpointError(f"checkpoint {folder}: its trainer state has no config; it was not written by nemofp4")
        check_resume_config(trainer_state["config"], self.cfg, step=int(trainer_state["step"]),
                            saved_total=trainer_state.get("total_steps"), new_total=self.budget.total_steps,
                            where=f"checkpoint {folder}", log_notes=self.rank == 0)
        if dcp_state is not None:
            self.quant.select_for_load(trainer_state, dcp_state)

    def _restore(self, state: dict[str, Any], rank_state: dict[str, Any], own: bool) -> None:
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.skipped_steps = state["skipped_steps"]
        self.wandb_id = state.get("wandb_id")
        self.init_record = state.get("init_from")
        self.loader.load_state_dict(state["loader"])
        if own:
            set_rng_state(rank_state["rng"])
        else:
            log.warning("rank %d is new to this run (checkpoint written by %d ranks): its generators keep the "
                        "seed's state", self.rank, state["world_size"])

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "loader": self.loader.state_dict(),
            "schedule": asdict(self.cfg.schedule),
            "wandb_id": self.metrics.wandb_id if self.metrics else self.wandb_id,
            "config": OmegaConf.to_yaml(OmegaConf.structured(self.cfg)),
            "world_size": self.world,
            "total_steps": self.budget.total_steps,
            **self.quant.trainer_entries(),
            "init_from": self.init_record,  # the source of the initial weights and their hash (None: random init)
        }

    def _rank_state(self) -> dict[str, Any]:
        return {"rng": rng_state(), **self.quant.rank_entries()}

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded FP32 weights on CPU (collective under FSDP2 / ZeRO-3)."""
        if self.engine is not None:
            return {k: v.cpu() for k, v in deepspeed_engine.full_model_state_dict(self.engine).items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return without_quant_state(state)

    def _unhealthy_state(self) -> str | None:
        """The first non-finite parameter or held reference on any rank (collective), or None."""
        found = first_nonfinite_state(self.model)
        if self.world > 1:
            gathered: list[str | None] = [None] * self.world
            dist.all_gather_object(gathered, found)
            found = next((f"{g} (rank {r})" for r, g in enumerate(gathered) if g), None)
        return found

    def save_checkpoint(self, *, final: bool = False) -> Path | None:
        """Write a checkpoint of the current state, unless it is not finite (then None: a checkpoint is
        only ever a good one, and retention keeps the last healthy checkpoint)."""
        unhealthy = self._unhealthy_state()
        if unhealthy is not None:
            if self.rank == 0:
                last = self.ckpt.latest()
                log.error("step %d: not checkpointing: %s is not finite; the last healthy checkpoint is %s",
                          self.step, unhealthy, last if last else "none (no checkpoint yet)")
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
            write_collective=(lambda f: deepspeed_engine.save(self.engine, f)) if self.engine else None,
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
        log.error("rank %d of %d: %s timed out after %g s (%s) at step %d: a rank it waits for is stuck or gone; "
                  "this process exits now [%s]", self.rank, self.world, operation, timeout, name, self.step,
                  first_line)  # fmt: skip
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
            log.info("collective timeout: %g s from now on (distributed.collective_timeout_s; start-up and the first "
                     "step had %g s)", timeout, self.cfg.distributed.startup_timeout_s)  # fmt: skip

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        total = self.budget.total_steps
        first_step = self.step
        self.metrics = MetricsLogger(
            self.run_dir, cfg.logging, rank=self.rank, run_name=cfg.name,
            config=OmegaConf.to_container(OmegaConf.structured(cfg)), total_steps=total,
            resume_step=self.step, wandb_id=self.wandb_id,
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
                if stop_reason == "preempted" else 0
            )  # fmt: skip
        plot = None
        if self.rank == 0 and cfg.logging.plots:
            plot = plot_run(self.run_dir, title=f"{cfg.name}: {cfg.precision.name}")
        if self.rank == 0 and cfg.logging.console:
            print(run_summary(
                run_dir=self.run_dir, records=read_metrics(self.run_dir), first_step=first_step, step=self.step,
                total_steps=total, tokens_seen=self.tokens_seen, wall_s=time.perf_counter() - self._started,
                stop_reason=stop_reason, checkpoint=self.ckpt.latest(), plot=plot,
            ), flush=True)  # fmt: skip
        return {"step": self.step, "stop_reason": stop_reason, "exit_code": exit_code, **last_eval}

    def _eval(self) -> dict[str, float]:
        logged = [self.metrics.logged.get(("eval", self.step))]  # only rank 0 reads the history
        if self.world > 1:
            dist.broadcast_object_list(logged, src=0)  # every rank evaluates, or none (FSDP collectives)
        logged = logged[0]
        if logged is not None:  # evaluated before (a rerun of a finished run): the same weights, the same result
            return {k: v for k, v in logged.items() if k not in ("kind", "step")}
        result = evaluate(self.model, self.val_batches, device=self.device, autocast=self.autocast,
                          head_chunk_tokens=self.cfg.train.head_chunk_tokens)
        self.metrics.log("eval", self.step, result)
        return result

    def _train_step(self, data_iter) -> None:
        cfg = self.cfg
        step = self.step
        self.faults.before_step(self.model, step)
        lr = cfg.optim.lr * lr_multiplier(cfg.schedule, step, self.budget.total_steps)
        set_lr(self.engine.optimizer if self.engine is not None else self.optimizer, lr)
        if self.engine is None:
            self.optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        first_batch = None
        forward = self.engine if self.engine is not None else self.model
        # the FP4 linears' step: references, SR seeds, statistics; each weight quantized once (the weights
        # change only in the optimizer step below)
        with self._sync_free(), self.quant.step(step):
            for micro in range(self.budget.grad_accum):
                set_gradient_sync(self.model, cfg.distributed, micro_batch=micro, grad_accum=self.budget.grad_accum)
                batch = next(data_iter)
                input_ids = batch["input_ids"].to(self.device, non_blocking=True)
                labels = batch["labels"].to(self.device, non_blocking=True)
                first_batch = first_batch or (input_ids, labels)
                with self.autocast():
                    loss = lm_loss(forward, input_ids, labels, head_chunk_tokens=cfg.train.head_chunk_tokens,
                                   head_precision=cfg.model.head_precision)
                loss = self.faults.loss(step, loss)
                if self.engine is not None:
                    self.engine.backward(loss)  # scales by 1/grad_accum itself
                    self.engine.step()  # clips and steps at the accumulation boundary
                else:
                    # this rank's share of the global mean loss (FSDP sums gradients over ranks): dY, and so the
                    # held dY references, do not depend on how the batch is split over ranks
                    (loss / (self.budget.grad_accum * self.world)).backward()
                loss_sum += loss.detach()
            loss_avg = _all_reduce_mean(loss_sum / self.budget.grad_accum)
            if self.engine is None:
                max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
        if self.engine is not None:
            grad_norm = torch.as_tensor(float(self.engine.get_global_grad_norm()))
        # the step's one host read of loss and gradient norm (the non-finite policy), outside the check
        finite = bool(torch.isfinite(loss_avg)) and bool(torch.isfinite(grad_norm))
        if finite and self.engine is None:
            with self._sync_free():
                self.optimizer.step()
        elif not finite:
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

    def _handle_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor, batch) -> None:
        if self.cfg.train.nonfinite == "skip":
            self.skipped_steps += 1
            self.quant.discard_nonfinite()  # a reference first sampled in this step samples again
            log.warning("step %d: non-finite loss %s / grad norm %s; update skipped (%d so far)",
                        self.step, loss.item(), grad_norm.item(), self.skipped_steps)
            if self.skipped_steps <= self.cfg.train.max_skipped_steps:
                return
        # where it starts: weights, then held FP4 references (they poison outputs or gradients downstream),
        # then the first layer output in execution order, then the first gradient in backward order
        where = self._unhealthy_state()  # the same answer on every rank, so they all take the same path
        if where is None:
            input_ids, labels = batch
            module = first_nonfinite_module(self.model, lambda: self.model(input_ids))
            where = f"output of {module}" if module else None
        if where is None:
            grad = first_nonfinite_gradient(self.model)
            where = f"gradient of {grad}" if grad else "no single layer (the loss itself)"
        raise NonFiniteError(
            f"step {self.step}: non-finite loss ({loss.item()}) or gradient norm ({grad_norm.item()}); "
            f"first non-finite value: {where}"
            + (f"; {self.skipped_steps} steps were skipped, above train.max_skipped_steps" if self.skipped_steps else "")
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
