"""The client's timing defaults, importable without the dataclasses module.

``trio_agentd.timing.Timing`` takes its client defaults from here, so there is one source of
truth; the CLI's blocking client reads them from here so its warm path stays lean.
"""

STARTUP_TIMEOUT = 30.0
PROBE_INTERVAL = 0.025
HELLO_TIMEOUT = 1.5
CONNECT_TIMEOUT = 0.3


class ClientTiming:
    """The four client constants, duck-typed like :class:`trio_agentd.timing.Timing`."""

    startup_timeout = STARTUP_TIMEOUT
    probe_interval = PROBE_INTERVAL
    hello_timeout = HELLO_TIMEOUT
    connect_timeout = CONNECT_TIMEOUT


CLIENT = ClientTiming()
