import os


def get_platform_target():
    """Stub: the real function detects the Trainium/Inferentia generation of the host.

    Here: $NEURON_PLATFORM_TARGET_OVERRIDE (the same variable NxD's utils.hardware reads), else "trn1".
    NxD calls this at import time (modules/moe/model_utils.py:96 unless NEURON_LOGICAL_NC_CONFIG is
    set) and in initialize_model_parallel (parallel_state.py:560), so it must return a value.
    """
    return os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")


# Only read inside trace/functions.py (compile path).
SUPPORTED_TYPES = ["trn1", "trn1n", "inf2", "trn2", "trn3"]
