"""The rendezvous store of a multi-node torchrun job, hosted by the batch script instead of an agent.

    python -m nemofp4.cli.rendezvous_store --port 29555 --ready-file <path>

torchrun's c10d rendezvous lets one agent host the TCPStore that every agent's exit barrier runs
on. That agent leaves as soon as the barrier opens, and an agent whose last request was still in
flight then logs ``DistNetworkError: Failed to recv`` with a traceback at the end of a run that
succeeded (pytorch/pytorch#69520). The batch script starts this process on the head node before
``srun`` and stops it after ``srun`` has returned, so the store outlives every agent
(``torchrun --rdzv_conf=is_host=false`` makes each agent a client).

Slurm signals every process of the job on ``scancel`` and preemption; the store ignores those
signals (the agents still need it while the trainer checkpoints) and leaves when it receives
SIGKILL, or when the batch shell that started it is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
PARENT_POLL_S = 1.0


def serve(port: int, ready_file: Path | None = None) -> None:
    """Host a TCPStore on ``port`` (every interface) until the parent process exits."""
    parent = os.getppid()  # before the slow torch import, as are the signals: the shell may go meanwhile
    for number in IGNORED_SIGNALS:  # a scancel may come at any time
        signal.signal(number, signal.SIG_IGN)
    import torch.distributed as dist

    # The server listens on every interface; host_name is only where its own client connects.
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    if ready_file is not None:  # renamed into place: the batch script never sees it half written
        partial = ready_file.with_name(f".{ready_file.name}.partial")
        partial.write_text(f"{store.port}\n")
        partial.replace(ready_file)
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nemofp4.cli.rendezvous_store", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the port given to torchrun's --rdzv_endpoint")
    parser.add_argument("--ready-file", type=Path, help="written (with the port) once the store listens")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    serve(args.port, args.ready_file)


if __name__ == "__main__":
    main()
