"""Update rules: what an optimizer does to one element of a shard, as data the engine
reads.

A rule (:class:`Rule`) declares its per-element states (names, each a buffer of the
master dtype over what the rule updates, zero at the start), its hyperparameters (a
frozen, validated dataclass per parameter group), which of them a group or a schedule
may change, and one function that updates a block of a shard in place. Everything
else takes the rule as data: the buffer plan and the memory estimator allocate and
count its states, checkpoints and elastic snapshots write them under their names, the
step runs the rule over the same runs and segments of every stage, and mixed
precision, clipping and the non-finite skip happen around it (the rule sees the summed
gradient and the divisor that averages, clips and unscales it).

The rules, chosen by ``ZeroConfig(optimizer=...)``:

* ``"adam"``: Adam/AdamW (:mod:`zerompi.rules.adam`, the fused kernel of
  :mod:`zerompi.adam`);
* ``"sgd"``: SGD with momentum, dampening and Nesterov, torch's ``SGD``
  (:mod:`zerompi.rules.sgd`);
* ``"lion"``: Lion, Chen et al. 2023 (:mod:`zerompi.rules.lion`);
* ``"adam8bit"``: Adam/AdamW with its moments in 8 bits, blockwise (Dettmers et al.
  2022; :mod:`zerompi.rules.adam8`);
* ``"adafactor"``: Adafactor's factored second moments, Shazeer & Stern 2018
  (:mod:`zerompi.rules.adafactor`);
* ``"muon"``: Muon for matrices, AdamW for the rest (Keller Jordan 2024;
  :mod:`zerompi.rules.muon`).
"""

from __future__ import annotations

from typing import Any

from .adafactor import ADAFACTOR
from .adam import ADAM
from .adam8 import ADAM8BIT
from .base import RULE_FIELDS, Rule, check_fields, write_low
from .lion import LION
from .muon import MUON
from .sgd import SGD_RULE

#: Every rule by name.
RULES: dict[str, Rule] = {
    r.name: r for r in (ADAM, SGD_RULE, LION, ADAM8BIT, ADAFACTOR, MUON)}  # fmt: skip


def rule_of(name: Any) -> Rule:
    """The rule called ``name``; an unknown one is an error listing the rules."""
    if not isinstance(name, str) or name not in RULES:
        raise ValueError(f"optimizer must be one of {', '.join(map(repr, RULES))}, "
                         f"got {name!r:.60}")  # fmt: skip
    return RULES[name]


__all__ = ["RULES", "RULE_FIELDS", "Rule", "check_fields", "rule_of", "write_low"]
