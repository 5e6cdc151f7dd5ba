# Stub protobuf module (imported by NxD trace/hlo_utils.py:21; used only in function bodies).
