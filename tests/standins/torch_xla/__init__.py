"""STAND-IN for torch_xla (tests only; see tests/standins/README.md)."""
STANDIN = True
