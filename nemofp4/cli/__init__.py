"""nemofp4.cli: the command-line entry points (thin Hydra apps over the typed core).

Every ``nemofp4-*`` command, and ``python -m nemofp4.train`` that torchrun and srun start, imports
this package before torch, so it is where the process asks PyTorch's CPU allocator for transparent
huge pages (``THP_MEM_ALLOC_ENABLE=1``, read once, at torch's first CPU allocation): a large tensor
then faults in 2 MiB pages instead of 4 KiB ones, which makes the CPU quantizer and the tiny training
step faster (docs/benchmarks.md, "Huge pages"). It changes no value, only CPU allocations of 2 MiB and
more, and nothing where the kernel's huge pages are ``never``. A value already in the environment
(``0`` to turn it off) is kept.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
