"""Model definitions. Knows nothing of precision or parallelism."""

from .loss import lm_loss
from .nemotron_h import NemotronHConfig, NemotronHModel, build_model, get_model_config
from .weight_decay import param_groups

__all__ = ["NemotronHConfig", "NemotronHModel", "build_model", "get_model_config", "lm_loss", "param_groups"]
