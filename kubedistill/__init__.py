"""kubedistill: Kubernetes-native online policy distillation and async RL post-training."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# In a source checkout the kubedistill.operator and kubedistill.runtime packages live in the
# repository's operator/ and runtime/ folders (pyproject's package-dir; a wheel installs them
# under kubedistill/). Those folders have no top-level __init__.py, so a checkout on sys.path
# can never shadow the standard library's `operator`; here they join this package's path.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "operator").is_dir():
    __path__.append(str(_checkout))
