"""A colder node's worker: wait MOE_TEST_COLD_START_S seconds (a node whose disk cache, imports and
interpreter start later than its peer's), then become `python <args>` in the same process (exec keeps the
pid torchrun's agent started and watches). torchrun runs `python _cold_start.py train.py ...`."""
import os
import sys
import time

time.sleep(float(os.environ.get("MOE_TEST_COLD_START_S", "1.5")))
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
