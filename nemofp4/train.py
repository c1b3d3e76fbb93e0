"""`python -m nemofp4.train ...` (the same app as `nemofp4-train`; what torchrun and srun launch)."""

from nemofp4.cli.train import main

if __name__ == "__main__":
    main()
