"""`python -m moe.report DIR`: the run and sweep reports live in moe/tools/report.py."""
import sys

from moe.tools.report import find_runs, load_run, main, report, run_row

__all__ = ["find_runs", "load_run", "main", "report", "run_row"]

if __name__ == "__main__":
    sys.exit(main())
