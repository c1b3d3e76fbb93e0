"""Evaluation of trained checkpoints: inference policies, held-out NLL, multiple-choice tasks.

    from nemofp4.evaluation import load_checkpoint_model, EvalSession, InferencePolicy, PolicyForward
    model, job, trainer_state = load_checkpoint_model("runs/tiny-ue5m3")
    with PolicyForward(model, InferencePolicy(name="delayed", delay=50)) as forward:
        logits = forward(input_ids)

The lm-eval adapter (``--model nemofp4``) lives in :mod:`nemofp4.evaluation.lm_eval_adapter`
and needs the optional ``lm-eval`` package.
"""

from .checkpoint import (
    is_hf_folder,
    load_checkpoint_model,
    load_hf_model,
    resolve_checkpoint,
)
from .config import EvaluateConfig, ExportConfig
from .multiple_choice import (
    LoglikelihoodRequest,
    MultipleChoiceItem,
    encode_request,
    load_task,
    run_task,
    score_requests,
)
from .nll import validation_nll
from .policies import POLICIES, ActivationAmaxRecorder, InferencePolicy, PolicyForward, unquantized_copy
from .run_config import TrainedRunConfig, run_config_from_yaml
from .runner import EvalSession, evaluate, format_markdown, write_results

__all__ = [
    "POLICIES",
    "ActivationAmaxRecorder",
    "EvalSession",
    "EvaluateConfig",
    "ExportConfig",
    "InferencePolicy",
    "LoglikelihoodRequest",
    "MultipleChoiceItem",
    "PolicyForward",
    "encode_request",
    "evaluate",
    "format_markdown",
    "is_hf_folder",
    "run_config_from_yaml",
    "TrainedRunConfig",
    "load_checkpoint_model",
    "load_hf_model",
    "load_task",
    "resolve_checkpoint",
    "run_task",
    "score_requests",
    "unquantized_copy",
    "validation_nll",
    "write_results",
]
