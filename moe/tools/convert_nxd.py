"""`python -m moe.tools.convert_nxd SRC OUT.ckpt`: the name this command had for trn1 runs;
moe/tools/consolidate.py does the work for every checkpoint directory."""
import sys

from moe.tools.consolidate import convert, main

__all__ = ["convert", "main"]

if __name__ == "__main__":
    main(sys.argv[1:])
