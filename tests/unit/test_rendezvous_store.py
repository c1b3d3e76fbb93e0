"""The batch script's rendezvous store: it serves torchrun's agents, outlives Slurm's signals, and
leaves with the shell that started it."""

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.conftest import free_port, process_gone


def _wait(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _outward_address() -> str | None:
    """This machine's IPv4 address on its default route (no packet is sent), None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_the_store_serves_clients_ignores_slurms_signals_and_leaves_with_its_parent(tmp_path):
    outward = _outward_address()
    if outward is None:
        pytest.skip("no non-loopback IPv4 address: cannot check that agents on other nodes reach the store")
    port, ready = free_port(), tmp_path / "ready"
    # a stand-in batch shell: starts the store in the background, then waits until told to exit
    shell = subprocess.Popen(
        [
            "bash",
            "-c",
            f"{sys.executable} -m nemofp4.cli.rendezvous_store --port {port} --ready-file {ready} & echo $!; read -r",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        store_pid = int(shell.stdout.readline())
        _wait(ready.is_file, "the ready file")
        assert ready.read_text() == f"{port}\n"
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            os.kill(store_pid, number)  # what scancel and a preemption warning send to every process
        time.sleep(0.3)
        assert not process_gone(store_pid)
        # two clients: one on the address agents on other nodes use, one on the loopback
        first = dist.TCPStore(outward, port, is_master=False, timeout=timedelta(seconds=10))
        second = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        first.set("agent/0", "done")
        assert second.get("agent/0") == b"done"
        assert second.add("members", 1) == 1 and first.add("members", 1) == 2
        shell.communicate("\n", timeout=10)  # the batch shell exits: the store follows within a poll
        _wait(lambda: process_gone(store_pid), "the store to exit after its parent", timeout_s=10)
    finally:
        if shell.poll() is None:
            shell.kill()


def test_a_taken_port_is_an_error_and_no_ready_file(tmp_path):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "nemofp4.cli.rendezvous_store",
                "--port",
                str(port),
                "--ready-file",
                str(tmp_path / "ready"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode != 0
    assert not (tmp_path / "ready").exists()
