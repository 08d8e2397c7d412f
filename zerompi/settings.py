"""The update rule's settings per parameter group (torch's ``param_groups``), as data.

``ZeroOptimizer(..., param_groups=[{"params": [names], "weight_decay": 0.0}, ...])``:
group 0 has the constructor's settings and every parameter no group lists; group
``i`` (the ``i``-th entry, 1-based) overrides any of the rule's settings
(:attr:`zerompi.rules.Rule.settings`: Adam's ``lr``, ``betas``, ``eps``,
``weight_decay``) for the parameters it lists (the usual no-decay group for biases
and norms). The buckets do not care: the rule runs per *segment*, the elements of
consecutive parameters of one group within a run of buckets (this rank's part of
them), each with its group's config (:class:`zerompi.adam.AdamConfig` for Adam).
With one group there is one segment per run, as without groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .partition import Layout
from .rules import Rule

#: ``(start, stop, group)`` of a run's elements, in the run's own coordinates.
Segment = tuple[int, int, int]


def group_configs(
    rule: Rule, base: Any, groups: Sequence[Mapping[str, Any]] | None, names: Sequence[str]
) -> tuple[list[Any], dict[str, int]]:
    """Every group's settings (group 0: ``base``, a config of ``rule``) and each
    parameter's group; a parameter listed twice or not in the model is an error
    naming it, as is a setting the rule does not have."""
    configs, member = [base], dict.fromkeys(names, 0)
    for i, entry in enumerate(groups or (), start=1):
        where = f"param_groups[{i - 1}]"
        if not isinstance(entry, Mapping) or "params" not in entry:
            raise TypeError(f"{where} must be a dict with a 'params' list of parameter names")
        configs.append(rule.group(base, entry, where))
        listed = entry["params"]
        for name in [listed] if isinstance(listed, str) else listed:
            if name not in member:
                raise ValueError(f"{where} lists {name!r}, which is not a parameter")
            if member[name]:
                other = f"param_groups[{member[name] - 1}]"
                raise ValueError(f"{where} lists {name!r}, already in {other}")
            member[name] = i
    return configs, member


def adam_segments(
    layout: Layout, stage: int, runs: Sequence[Any], member: Mapping[str, int]
) -> list[list[Segment]]:
    """Per run (consecutive buckets, :func:`zerompi.plan.runs`), its segments: where
    this rank's part of each parameter lies in the run, consecutive ones of one group
    merged. Stage 0's part of a bucket is all of it; the other stages' its shard."""
    offsets = {spec.name: spec.offset for spec in layout.params}
    sizes = {spec.name: spec.size for spec in layout.params}
    out: list[list[Segment]] = []
    first = 0
    for run in runs:
        segs: list[Segment] = []
        at = 0
        for bucket in layout.buckets[first : run.last + 1]:
            lo, hi = (0, bucket.size) if stage == 0 else bucket.local(layout.rank)
            for name in bucket.names:
                start = offsets[name] - bucket.start
                a, b = max(start, lo), min(start + sizes[name], hi)
                if a >= b:
                    continue
                seg = (at + a - lo, at + b - lo, member[name])
                if segs and segs[-1][2] == seg[2] and segs[-1][1] == seg[0]:
                    seg = (segs.pop()[0], seg[1], seg[2])
                segs.append(seg)
            at += hi - lo
        out.append(segs)
        first = run.last + 1
    return out


def settings_token(rule: Rule, configs: Sequence[Any]) -> float:
    """Every group's settings as one number, which a float64 carries exactly, for
    the step's agreement (the same in every process: floats hash alike)."""
    key = tuple(rule.token(c) for c in configs)
    return float(hash(key) & 0x7FFFFFFF)
