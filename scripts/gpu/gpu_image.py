"""What the GPU machine's Python holds, and what the GPU check carries to it as wheels.

The device image (see docs/gpu.md) has torch, Triton and most of the scientific stack, but not the
configuration layer of ``nemofp4-train`` and ``nemofp4-eval``: :data:`WHEELHOUSE` lists the pure-Python
distributions scripts/gpu/gpu_wheelhouse.sh downloads for it, at the versions of requirements/dev.txt.

    python scripts/gpu/gpu_image.py wheelhouse          # name==version of each wheel to carry
    python scripts/gpu/gpu_image.py hide DIR [SITE ...] # DIR/sitecustomize.py: this Python as the image sees it

``hide`` is the CPU rehearsal's stand-in for the image: with DIR first on PYTHONPATH, a top-level
module of an installed distribution the image lacks imports only from the SITE folders (where the
wheelhouse was installed), else fails as it would there.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

IMAGE = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split()
)
"""Distributions of the device image's python3 (Python 3.12, torch 2.11 + CUDA 13, Triton 3.6), as its
package list was read on 2026-11-17."""

WHEELHOUSE = ("hydra-core", "omegaconf", "antlr4-python3-runtime")
"""What the trainer and evaluation CLIs import that the image lacks (all pure Python)."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(names=WHEELHOUSE, lock: Path = REPO / "requirements" / "dev.txt") -> list[str]:
    """``name==version`` of each distribution, at the version the development lock pins."""
    pins = {}
    for line in lock.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if match:
            pins[normalize(match[1])] = match[2]
    missing = [n for n in names if normalize(n) not in pins]
    if missing:
        raise SystemExit(f"no pin for {', '.join(missing)} in {lock}")
    return [f"{n}=={pins[normalize(n)]}" for n in names]


def hide_missing(site_dirs: list[str] = (), keep=()) -> None:
    """Make this interpreter import like the image's: a top-level module whose distributions are neither
    in :data:`IMAGE` nor in ``keep`` (nor nemofp4 itself) is looked up only in ``site_dirs``."""
    import importlib.machinery
    import importlib.metadata

    allowed = IMAGE | {normalize(k) for k in keep} | {"nemofp4"}
    hidden = {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if not any(normalize(d) in allowed for d in dists)
    }

    class _ImageFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if "." in name or name not in hidden:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, list(site_dirs))
            if spec is None:
                raise ModuleNotFoundError(f"No module named {name!r} (not in the GPU image)", name=name)
            return spec

    sys.meta_path.insert(0, _ImageFinder)


def write_sitecustomize(folder: Path, site_dirs: list[str], keep=()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sitecustomize.py"
    path.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import gpu_image\n"
        "sys.path.pop(0)\n"
        f"gpu_image.hide_missing({[str(Path(s).resolve()) for s in site_dirs]!r}, {list(keep)!r})\n"
    )
    return path


def main(argv: list[str]) -> int:
    if argv[:1] == ["wheelhouse"]:
        print("\n".join(pinned()))
        return 0
    if argv[:1] == ["hide"] and len(argv) >= 2:
        write_sitecustomize(Path(argv[1]), argv[2:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
