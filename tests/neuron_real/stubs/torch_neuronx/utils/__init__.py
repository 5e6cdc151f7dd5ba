from .utils import get_platform_target  # noqa: F401
