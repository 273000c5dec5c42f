"""Typed run config (package: one module per section): one pydantic root model, one sub-model per process.

``RunConfig`` is what a YAML/TOML file or the Prefect parameter form parses into. Each
process receives only its sub-config (``model``, ``server``, ``rollout``; the packing
sub-model is added beside them). Every model forbids unknown keys so a typo is an error,
and the cross-field checks name the fields involved and the fix.

Only pydantic and the standard library are imported here (STYLE.md, module boundaries).
"""

from grpo_core.config.base import (  # noqa: F401 - the package's names, as one module had them
    LOOPBACK_HOSTS,
    REMOVED_ROLLOUT_FIELDS,
    REMOVED_SERVER_FIELDS,
    SERVER_API_KEY_ENV,
    VLLM_LORA_RANKS,
    _CandidateFilter,
    _changed,
    _number_field,
    _refuse_removed,
    _ServerKey,
    _Strict,
    _view,
    _warn_unused,
    default_cache_dir,
    url_port,
    user_path,
)
from grpo_core.config.loading import (  # noqa: F401 - the package's names, as one module had them
    _error_lines,
    _field_path,
    _parse,
    _read_config,
    _section_model,
    _set_dotted,
    _shown,
    _unique_json_keys,
    _validate,
    _yaml_load,
    _yaml_where,
    load_config,
    load_trainer_config,
)
from grpo_core.config.rollout import (  # noqa: F401 - the package's names, as one module had them
    COLUMN_TYPES,
    DATA_PREFIXES,
    DatasetSource,
    RolloutConfig,
    dataset_form,
)
from grpo_core.config.run import (  # noqa: F401 - the package's names, as one module had them
    ALGORITHM_PRESETS,
    TRACKING_ONLY_FIELDS,
    RunConfig,
    _check_fixed_ports,
    apply_algorithm_preset,
)
from grpo_core.config.security import TLSConfig  # noqa: F401 - the package's names
from grpo_core.config.server import (  # noqa: F401 - the package's names, as one module had them
    DEPLOYMENT_ONLY_FIELDS,
    EMBEDDED_ONLY_FIELDS,
    SERVER_LAUNCH_FIELDS,
    VLLM_ONLY_FIELDS,
    ModelConfig,
    ServerConfig,
    check_server_urls,
)
from grpo_core.config.shown_once import forget_shown, show_package_once  # noqa: F401 - forget_shown: the package's
from grpo_core.config.tracking import (  # noqa: F401 - the package's names, as one module had them
    FlowConfig,
    TrackingConfig,
)
from grpo_core.config.train import (  # noqa: F401 - the package's names, as one module had them
    ExportConfig,
    LoraConfig,
    PackingConfig,
    TrainConfig,
)
from grpo_core.config.views import (  # noqa: F401 - the package's names, as one module had them
    TRAINER_EXPORT_FIELDS,
    TRAINER_PACKING_FIELDS,
    TRAINER_ROLLOUT_FIELDS,
    TRAINER_SERVER_FIELDS,
    RolloutProcessConfig,
    TrainerExportView,
    TrainerPackingView,
    TrainerProcessConfig,
    TrainerRolloutView,
    TrainerServerView,
    _check_trainer_fields,
    _refuse_masked,
)
from grpo_core.run.layout import ADAPTER_DIR, WEIGHTS_DIR  # noqa: F401 - re-exported as before

# Each config warning once per process, from every module of the package (grpo_core/config/shown_once.py).
show_package_once(__name__, __path__)
