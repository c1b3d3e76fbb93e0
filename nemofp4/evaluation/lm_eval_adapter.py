"""The lm-evaluation-harness model adapter: ``--model nemofp4``.

lm-eval has no plugin entry point for models, so the adapter is registered when this module
is imported. Run lm-eval's command line through it:

    python -m nemofp4.evaluation.lm_eval_adapter run --model nemofp4 \\
        --model_args checkpoint=runs/tiny-ue5m3,policy=current --batch_size 8 --tasks mmlu

or call ``lm_eval.simple_evaluate(model="nemofp4", ...)`` after ``register_lm_eval_model()``.
Log-likelihood requests only (multiple-choice and perplexity-style tasks): generation requests
raise. Scoring is :func:`nemofp4.evaluation.multiple_choice.score_requests`, shared with the
built-in runner, so the two agree exactly on the same task.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from lm_eval.api.model import LM

from .multiple_choice import encode_request, score_requests

__all__ = ["LOCAL_TASKS_DIR", "NemoFP4LM", "register_lm_eval_model", "write_local_task_config"]

LOCAL_TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
"""lm-eval task configs of the shipped local tasks (pass as TaskManager(include_path=...))."""


class NemoFP4LM(LM):
    """An lm-eval LM over a nemofp4 model under an inference policy.

    Either ``checkpoint=`` (a run directory, step folder or transformers folder, loaded with the
    options below) or an already prepared ``forward`` (a callable input_ids -> logits, e.g. an
    entered :class:`~nemofp4.evaluation.policies.PolicyForward`) and ``tokenizer``.
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        policy: str = "current",
        delay: int = 50,
        calibration_sequences: int = 64,
        batch_size: int | str = 1,
        max_length: int = 2048,
        device: str = "auto",
        dtype: str = "auto",
        precision: str = "",
        tokenizer=None,
        kernels: str = "auto",
        *,
        forward=None,
        **unused,
    ) -> None:
        super().__init__()
        from .runner import EvalSession

        if unused:
            unknown = sorted(k for k, v in unused.items() if v is not None and k not in ("max_batch_size",))
            if unknown:
                raise ValueError(f"nemofp4 lm-eval model: unknown argument(s) {unknown}")
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        self.max_length = int(max_length)
        self._session = None
        if forward is not None:
            if tokenizer is None:
                raise ValueError("NemoFP4LM(forward=...) needs the tokenizer too")
            self._forward, self.tokenizer, self._device = forward, tokenizer, _forward_device(forward)
            return
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes --device cuda by default.
            logging.getLogger("nemofp4").warning("device=%s requested but CUDA is unavailable; using the CPU", device)
            device = "cpu"
        if checkpoint is None:
            raise ValueError(
                "NemoFP4LM needs checkpoint=<run dir, step folder or HF folder> (or forward= and tokenizer=)"
            )
        self._session = EvalSession.open(
            checkpoint,
            device=device,
            dtype=dtype,
            precision=precision,
            tokenizer=tokenizer if isinstance(tokenizer, str) else "",
            kernels=kernels,
        )
        self.tokenizer = self._session.tokenizer
        self._forward = self._session.policy_forward(
            policy=policy, delay=int(delay), calibration_sequences=int(calibration_sequences)
        ).__enter__()
        self._device = self._session.device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod_id

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        encoded = [
            encode_request(self.tokenizer, context, continuation)
            for context, continuation in (req.args for req in requests)
        ]
        return score_requests(
            self._forward,
            encoded,
            batch_size=self.batch_size,
            max_length=self.max_length,
            pad_id=self.tokenizer.eod_id,
            device=self._device,
        )

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "the nemofp4 lm-eval adapter scores multiple-choice (loglikelihood) requests only; use "
            "nemofp4-eval for held-out perplexity over a validation stream"
        )

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            "the nemofp4 lm-eval adapter does not generate text: pick log-likelihood (multiple-choice) tasks "
            "(e.g. mmlu, arc_easy, hellaswag), not generation tasks"
        )


def _forward_device(forward):
    model = getattr(forward, "model", None)
    return next(model.parameters()).device if model is not None else "cpu"


def register_lm_eval_model() -> None:
    """Register :class:`NemoFP4LM` with lm-eval's model registry as ``nemofp4`` (idempotent)."""
    import lm_eval.models  # noqa: F401  (fills the registry with lm-eval's own models first)
    from lm_eval.api.registry import model_registry, register_model

    if "nemofp4" not in model_registry:
        register_model("nemofp4")(NemoFP4LM)


def write_local_task_config(task_file: str | Path, folder: str | Path, name: str | None = None) -> str:
    """Write an lm-eval task config for a local jsonl task into ``folder``; returns the task name.

    Use with ``TaskManager(include_path=folder)``. The data file is referenced by absolute path.
    """
    import json

    task_file = Path(task_file).resolve()
    if not task_file.is_file():
        raise FileNotFoundError(f"task file {task_file} not found")
    name = name or task_file.stem
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        f"task: {name}",
        "dataset_path: json",
        f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(task_file))}}}}}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{context}}"',
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{label}}"',
        'target_delimiter: " "',
        "metric_list:",
        "  - metric: acc",
        "  - metric: acc_norm",
    ]
    (folder / f"{name}.yaml").write_text("\n".join(lines) + "\n")
    return name


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line with the ``nemofp4`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    from nemofp4.evaluation.lm_eval_adapter import register_lm_eval_model as register  # the importable class

    register()

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
else:  # importing the module is what registers the model (lm-eval has no model entry points)
    register_lm_eval_model()
