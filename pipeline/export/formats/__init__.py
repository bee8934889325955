"""Export formats, one file each (sglang.py, vllm.py, eagle1.py, gguf.py), registered by name. A new format is a new
file with an `ExportFormat` subclass and its `register_format(...)` call, plus one import line here; the format
names the head kind it holds (`kind`, and `default` for the kind's format when export.format is unset)."""
from . import eagle1, gguf, sglang, vllm  # noqa: F401,E402  (registration)
from .base import (  # noqa: F401
                   DTYPE_NAMES,
                   FORMATS,
                   INDEX_DTYPES,
                   SAFETENSORS_DTYPES,
                   ExportContext,
                   ExportError,
                   ExportFormat,
                   aux_order,
                   check_aux_layers,
                   detect_format,
                   export_format,
                   format_for_head,
                   register_format,
)
