"""`python -m moe.supervise -- CMD`: the supervisor lives in moe/tools/supervise.py."""
import sys

from moe.tools.supervise import Supervisor, main, prepare_command, relaunch_command

__all__ = ["Supervisor", "main", "prepare_command", "relaunch_command"]

if __name__ == "__main__":
    sys.exit(main())
