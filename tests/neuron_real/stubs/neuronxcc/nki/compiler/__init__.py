from _neuron_stub import lazy_decorator as _ld

# Kernel decorator used at import time in modules/moe/moe_fused_tkg_mx.py:68,119,197.
skip_middle_end_transformations = _ld("neuronxcc.nki.compiler.skip_middle_end_transformations")
