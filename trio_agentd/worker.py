"""``python -m trio_agentd.worker`` — a session worker (started by the supervisor only)."""

from ._worker import main

if __name__ == "__main__":
    main()
