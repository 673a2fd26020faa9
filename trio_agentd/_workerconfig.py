"""What a supervisor hands a worker it starts, and what it reads back from it: the worker's
config (one JSON line on the worker's stdin) and the bound of the line a worker that cannot
load its agent writes instead of ``ready``. The supervisor imports only this of the worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    session_id: str
    agent: str
    token: str
    supervisor_socket: str
    registry: str
    worker_socket: str
    journal: str
    session_dir: str
    cwd: str
    agent_path: tuple[str, ...] = ()  # where a module:attribute agent is imported from

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__slots__})

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        fields = json.loads(text)
        fields["agent_path"] = tuple(fields.get("agent_path") or ())
        return cls(**fields)


# the most of an agent's load error the supervisor reads from a worker's stdout
FAILED_LINE_MAX = 4096
