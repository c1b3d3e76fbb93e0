"""Packaging that pyproject.toml cannot say: the repository's configs/, slurm/ and data/ folders
ship inside the wheel as package data under nemofp4/share/, without moving them (the code finds
them through nemofp4.data.paths.REPO_ROOT, in a checkout and in an installed wheel alike); the
native CPU quantizer's C++ source ships beside its module, which builds it on first use."""

from setuptools import find_packages, setup

SHARED = {"nemofp4.share.configs": "configs", "nemofp4.share.slurm": "slurm", "nemofp4.share.data": "data"}
SHARED_FILES = {
    "nemofp4.share.configs": ["**/*.yaml"],
    "nemofp4.share.slurm": ["*.tmpl", "*.sh"],
    "nemofp4.share.data": [
        "README.md",
        "tokenizer/*.json",
        "tokens/*.bin",
        "tokens/*.idx",
        "tokens/*.json",
        "tasks/*.jsonl",
        "tasks/README.md",
    ],
}

setup(
    packages=[*find_packages(include=["nemofp4", "nemofp4.*"]), *SHARED],
    package_dir=SHARED,
    package_data={
        "nemofp4.evaluation": ["lm_eval_tasks/*.yaml", "lm_eval_tasks/*.py"],
        "nemofp4.kernels": ["cpu_quantize.cpp"],
        **SHARED_FILES,
    },
    exclude_package_data={"nemofp4.share.data": ["cache/**"]},
)
