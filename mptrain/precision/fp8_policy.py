"""Which linear layers of a model run their GEMMs in fp8 under ``fp8-master``, and why the others stay in bf16.

The policy is a list in ``fp32_fallback``'s grammar (:mod:`.list_grammar`): ``"default"``, a list of entries
(``"+entry"`` / ``"-entry"`` edit the default list), or ``[]`` (every eligible layer in fp8).  An entry is either an
fnmatch pattern over the layer's qualified name (``"lm_head"``, ``"*.head"``, ``"model.layers.0.*"``) or a rule:

- ``<first>``: the first ``nn.Linear`` in module order when it is not inside a repeated block (a
  ``ModuleList`` or ``Sequential`` of several like blocks): the network's input projection, whose input
  statistics differ most from the rest (Transformer Engine and DeepSeek-V3 keep the first and last layers
  in higher precision).
- ``<small>``: layers with fewer than ``SMALL_WEIGHTS`` weights.  Tensorwise quantization costs an amax,
  a cast and a transposed copy of each operand; at BERT-base's 768x768 projections (16384 tokens, H200)
  that cost made the fp8 forward+backward slower than bf16 (0.131 vs 0.110 ms), while 768x3072 gained
  (0.330 vs 0.375 ms): 2^21 weights sits between the two.

Always kept, whatever the list says (hardware, not policy): layers that are not exactly ``nn.Linear``
(a subclass may override forward) and layers whose in/out features are not multiples of 16 (fp8 tensor-core
GEMMs need them).
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Union

from torch import nn

from mptrain.precision.list_grammar import ListGrammar

SMALL_WEIGHTS = 2 ** 21
RULES = ("<first>", "<small>")
#: output heads by their usual names (transformers, torchvision, torchtitan), plus the two rules
DEFAULT_KEEP: tuple[str, ...] = ("<first>", "<small>", "lm_head", "*.lm_head", "head", "*.head", "fc", "*.fc",
                                 "classifier", "*.classifier", "decoder", "*.decoder", "output", "*.output")


KEEP_BF16 = ListGrammar("keep_bf16", DEFAULT_KEEP, "layer-name patterns or rules",
                        "['+model.layers.0.*'] or keep_bf16=['-<small>']",
                        known=lambda entry: not entry.startswith("<") or entry in RULES, noun="rule",
                        vocabulary=f"rules are {', '.join(RULES)}; any other entry is an fnmatch pattern")


def resolve_keep_list(spec: Union[str, Iterable[str], None]) -> tuple[str, ...]:
    """``"default"``, a list (``"+x"`` / ``"-x"`` edit the default) or ``[]``: a checked tuple of entries
    (:mod:`.list_grammar`)."""
    return KEEP_BF16.resolve(spec)


def plan_fp8_layers(module: nn.Module, keep: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """(names of the linear layers to run in fp8, {name of each kept linear: why}) for ``module``."""
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    first = _first_input_layer(module, linears)
    convert, kept = [], {}
    for name, m in linears:
        reason = _kept_because(name, m, keep, first)
        if reason is None:
            convert.append(name)
        else:
            kept[name] = reason
    return convert, kept


def _kept_because(name: str, m: nn.Linear, keep: tuple[str, ...], first: str | None) -> str | None:
    if type(m) is not nn.Linear:
        return f"a {type(m).__name__}, not an exact nn.Linear"
    if m.in_features % 16 or m.out_features % 16:
        return f"{m.in_features}x{m.out_features}: fp8 GEMMs need multiples of 16"
    if "<first>" in keep and name == first:
        return "<first>: the network's input layer"
    if "<small>" in keep and m.in_features * m.out_features < SMALL_WEIGHTS:
        return f"<small>: {m.in_features}x{m.out_features} < {SMALL_WEIGHTS} weights"
    pattern = next((p for p in keep if not p.startswith("<") and fnmatch.fnmatchcase(name, p)), None)
    return None if pattern is None else f"keep_bf16 pattern {pattern!r}"


def _first_input_layer(module: nn.Module, linears: list) -> str | None:
    """The first linear in module order, unless it sits in a repeated block (then there is no input layer)."""
    if not linears:
        return None
    name = linears[0][0]
    repeated = {f"{parent}.{child}" if parent else child
                for parent, m in module.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
                and _repeats(m) for child, _ in m.named_children()}
    parts = name.split(".")
    inside = any(".".join(parts[:i]) in repeated for i in range(1, len(parts) + 1))
    return None if inside else name


def _repeats(container: nn.Module) -> bool:
    """Several like blocks: a ModuleList of one class (transformer layers, a stack of linears), or a Sequential
    of one block class (not an MLP written as Sequential(Linear, ..., Linear))."""
    kinds = [type(c) for c in container.children()]
    if len(kinds) < 2 or len(set(kinds)) != 1:
        return False
    return isinstance(container, nn.ModuleList) or not issubclass(kinds[0], nn.Linear)
