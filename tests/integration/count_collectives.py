"""Under torchrun: train with the given overrides while counting FSDP2's gradient reduce-scatters.

Writes ``<run_dir>/collectives-rank<R>.json`` with the number of reduce-scatters issued, the number
of FSDP parameter groups and the steps trained, for tests that check one gradient sync per step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

COUNT = {"reduce_scatters": 0}


def _counting(fn):
    def wrapper(*args, **kwargs):
        COUNT["reduce_scatters"] += 1
        return fn(*args, **kwargs)

    return wrapper


def main(overrides: list[str]) -> None:
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # FSDP2 calls one of them by torch version
        if hasattr(dist, name):
            setattr(dist, name, _counting(getattr(dist, name)))
    from torch.distributed.fsdp import FSDPModule

    from nemofp4.cli.train import compose_job_config
    from nemofp4.training.trainer import Trainer

    trainer = Trainer(compose_job_config(overrides))
    try:
        summary = trainer.run()
        groups = sum(
            1
            for m in trainer.model.modules()
            if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
        )
        record = {**COUNT, "fsdp_groups": groups, "steps": summary["step"], "grad_accum": trainer.budget.grad_accum}
        Path(trainer.cfg.run_dir, f"collectives-rank{trainer.rank}.json").write_text(json.dumps(record))
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
