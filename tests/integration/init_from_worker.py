"""A training process (torchrun or plain) that writes the weights the trainer built before it trains.

    python tests/integration/init_from_worker.py WEIGHTS.safetensors override ...

The trainer's own code throughout: compose the job config as nemofp4-train does, build the Trainer
(train.init_from loads there), gather its full weights (rank 0 writes them), then run it.
"""

from __future__ import annotations

import logging
import sys


def main() -> None:
    from safetensors.torch import save_file

    from nemofp4.cli.train import compose_job_config
    from nemofp4.training.trainer import Trainer

    logging.basicConfig(level=logging.INFO)
    out, overrides = sys.argv[1], sys.argv[2:]
    trainer = Trainer(compose_job_config(overrides))
    try:
        weights = trainer.full_model_state_dict()  # collective
        if trainer.rank == 0:
            save_file({k: v.contiguous() for k, v in weights.items()}, out)
        summary = trainer.run()
    finally:
        trainer.close()
    if summary["stop_reason"] != "budget":
        raise SystemExit(f"stopped early: {summary}")


if __name__ == "__main__":
    main()
