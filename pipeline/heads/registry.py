"""The head kinds eaglet knows. A kind is one file in this package (the head module and its training
objective) ending in one `register_head(HeadSpec(...))`; everything else (train, eval's drafter, export)
asks the registry instead of testing the kind's name.

    # pipeline/heads/my_head.py
    @dataclass
    class MyHeadConfig(HeadConfig):  # its typed options (ARCHITECTURE ones go into its config.json)
        kind: str = "my_head"
        name: str = "my_head"
        my_option: int = 3
    class MyDraftHead(DraftHeadMixin, nn.Module): ...
    class MyObjective(nn.Module): ...
    register_head(HeadSpec(kind="my_head", options_class=MyHeadConfig, head_class=MyDraftHead,
                           objective_class=MyObjective, num_aux_layers=0, full_vocab=True))

plus one import line in pipeline/heads/__init__.py and `conf/head/my_head.yaml`. An export format names the
kind it holds (pipeline/export/formats/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSpec:
    kind: str
    options_class: type  # its HeadConfig subclass: the typed `head` options
    head_class: type  # nn.Module subclass taking a DraftHeadConfig
    # Head + its loss as one module (`from_config(head, head_cfg, target_lm_head_weight)`); the train loop
    # and the parallel wrapper see a plain forward.
    objective_class: type
    # Target layers the head fuses (the dump's aux states); 0: it reads the target's final hidden state.
    num_aux_layers: int
    full_vocab: bool  # predicts over the target vocabulary (no draft vocabulary of its own)
    drafter: str = "eagle"  # how eval drafts with it: pipeline/decoding/drafter.py DRAFTERS

    @property
    def fuses_target_layers(self) -> bool:
        """Reads the dump's fused aux states (else the target's final hidden state)."""
        return self.num_aux_layers > 0


HEADS: dict[str, HeadSpec] = {}


def register_head(spec: HeadSpec) -> HeadSpec:
    if spec.kind in HEADS and HEADS[spec.kind] != spec:
        raise ValueError(f"head kind {spec.kind!r} is registered twice")
    HEADS[spec.kind] = spec
    return spec


def head_spec(kind: str) -> HeadSpec:
    try:
        return HEADS[kind]
    except KeyError:
        raise ValueError(f"unknown head kind {kind!r}: registered kinds are {sorted(HEADS)}") from None
