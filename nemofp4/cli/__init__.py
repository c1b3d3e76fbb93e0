"""nemofp4.cli: the command-line entry points (thin Hydra apps over the typed core).

Every ``nemofp4-*`` command, and ``python -m nemofp4.train`` that torchrun and srun start, imports
this package before torch, so it is where the process asks PyTorch's CPU allocator for transparent
huge pages (``THP_MEM_ALLOC_ENABLE=1``, read once, at torch's first CPU allocation): a large tensor
then faults in 2 MiB pages instead of 4 KiB ones. On CPU that made the tiny training step 1.2x-1.5x
faster and the FP4 quantizer 1.6x-2.9x (docs/benchmarks.md, "The CPU quantizer against the copy
floor"); it changes no value, only CPU allocations of 2 MiB and more, and nothing where the kernel's
huge pages are ``never``. A value already in the environment (``0`` to turn it off) is kept.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
