"""trio-agentd: a per-user session daemon whose sessions survive anything.

The public names are loaded lazily (PEP 562) so that ``trio-agentd -p`` — which imports
``trio_agentd.cli`` and hence this package — does not pay for trio on its warm path.
"""

from __future__ import annotations

from ._errors import AgentdError as AgentdError
from ._errors import ErrorCode as ErrorCode
from ._version import APP_VERSION as __version__

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from typing import Any
if TYPE_CHECKING:
    from ._client import Client as Client
    from ._client import TurnResult as TurnResult
    from ._client import open_client as open_client
    from ._supervisor import Supervisor as Supervisor
    from ._supervisor import SupervisorConfig as SupervisorConfig
    from ._supervisor import open_supervisor as open_supervisor
    from .timing import DEFAULT_TIMING as DEFAULT_TIMING
    from .timing import Timing as Timing


_LAZY = {
    "Timing": ".timing",
    "DEFAULT_TIMING": ".timing",
    "Client": "._client",
    "TurnResult": "._client",
    "open_client": "._client",
    "Supervisor": "._supervisor",
    "SupervisorConfig": "._supervisor",
    "open_supervisor": "._supervisor",
}

__all__ = [
    "DEFAULT_TIMING",
    "AgentdError",
    "Client",
    "ErrorCode",
    "Supervisor",
    "SupervisorConfig",
    "Timing",
    "TurnResult",
    "__version__",
    "open_client",
    "open_supervisor",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trio_agentd' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
