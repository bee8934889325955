"""Draft heads: the modules (one file per kind, leaf to root: layers.py, then eagle1.py / eagle3.py / medusa.py), their
training objectives (losses.py, ttt.py), the draft vocabulary (vocab.py), the on-disk format (io.py), and the
registry of kinds (registry.py). Importing the package registers every kind."""
from . import eagle1, eagle3, medusa  # noqa: F401  (registration)
from .config import DraftHeadConfig, HeadConfig, LmHeadInit, build_draft_head, default_aux_layer_ids, head_config  # noqa: F401
from .eagle1 import Eagle1HeadConfig  # noqa: F401
from .eagle3 import Eagle3HeadConfig  # noqa: F401
from .medusa import MedusaHeadConfig  # noqa: F401
from .registry import HEADS, HeadSpec, head_spec, register_head  # noqa: F401
