"""Shared helpers for the CPU-only stand-ins of torch_neuronx / neuronxcc / libneuronxla.

These stubs exist ONLY so that `import neuronx_distributed` (SDK 2.28, v2.28.0) succeeds on a
CPU-only host. Every stubbed callable raises NotImplementedError when actually called, except the
few that NxD calls at import time or on its plain-torch code paths (documented where defined).
"""


class NeuronStubError(NotImplementedError):
    """Raised by every stubbed callable: the real one needs Neuron hardware or its compiler."""


def unavailable(qualname):
    """A function that raises when called (the real one needs Neuron hardware/compiler)."""

    def _f(*args, **kwargs):
        raise NeuronStubError(f"{qualname} is a CPU stub: the real Neuron package is not installed")

    _f.__name__ = qualname.rsplit(".", 1)[-1]
    _f.__qualname__ = qualname
    return _f


def unavailable_class(qualname):
    """A class that raises when instantiated."""
    name = qualname.rsplit(".", 1)[-1]

    def __init__(self, *args, **kwargs):
        raise NeuronStubError(f"{qualname} is a CPU stub: the real Neuron package is not installed")

    return type(name, (), {"__init__": __init__, "__qualname__": qualname, "__module__": qualname.rsplit(".", 1)[0]})


def lazy_decorator(qualname):
    """Stand-in for a kernel decorator/factory such as nki.jit or nki_jit().

    Both `@deco` and `@deco(**opts)` forms are accepted at import time; the decorated kernel
    raises NotImplementedError when it is called.
    """

    def _wrap(fn):
        return unavailable(f"{qualname}({getattr(fn, '__qualname__', fn)})")

    def deco(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return _wrap(args[0])
        return _wrap

    deco.__name__ = qualname.rsplit(".", 1)[-1]
    return deco
