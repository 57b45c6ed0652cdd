"""trio_router: an OpenAI-compatible router for vLLM engines on Kubernetes, built on Trio."""

from ._version import __version__
from .config import Config, load_config
from .errors import ConfigError, RouterError
from .server import run

__all__ = ["Config", "ConfigError", "RouterError", "__version__", "load_config", "run"]
