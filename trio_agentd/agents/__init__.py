"""Agents: what a worker hosts. ``load_agent(spec)`` turns a spec into an agent."""

from ._base import Agent as Agent
from ._base import AgentLoadError as AgentLoadError
from ._base import AgentStartError as AgentStartError
from ._base import Chunk as Chunk
from ._base import ExitStatus as ExitStatus
from ._base import Stderr as Stderr
from ._base import TurnContext as TurnContext
from ._base import Waiting as Waiting
from ._echo import EchoAgent as EchoAgent
from ._exec import ExecAgent as ExecAgent
from ._load import load_agent as load_agent
from ._shell import ShellAgent as ShellAgent
from ._spec import validate_agent_spec as validate_agent_spec
