"""The list grammar shared by fp32_fallback and keep_bf16: default, edits, whole lists, and one set of refusals whose
messages name the argument, the value and the fix."""
from __future__ import annotations

import pytest

from mptrain.precision.fallback import DEFAULT_FP32_OPS, FP32_FALLBACK, resolve_op_list
from mptrain.precision.fp8_policy import DEFAULT_KEEP, KEEP_BF16, resolve_keep_list
from mptrain.precision.list_grammar import ListGrammar, is_edit_list

COLORS = ListGrammar("colors", ("red", "green"), "color names", "['red']",
                     known=lambda c: c in {"red", "green", "blue"}, noun="color", vocabulary="colors are red, green, blue")


@pytest.mark.parametrize("value, want", [
    ("default", ("red", "green")),
    (None, ("red", "green")),
    ([], ()),
    (["blue"], ("blue",)),
    (("blue", "red", "blue"), ("blue", "red")),  # a tuple works; repeats go, first-seen order kept
    (["+blue"], ("red", "green", "blue")),
    (["-red", "+blue", "+green"], ("green", "blue")),
    (["-red", "-green"], ()),
])
def test_default_edits_and_whole_lists(value, want):
    assert COLORS.resolve(value) == want


@pytest.mark.parametrize("value, match", [
    ("all", r"colors='all' is not valid: expected 'default', a list of color names .* e\.g\. colors=\['red'\]"),
    (3, r"colors=3 is not valid: expected 'default'"),
    (["red", 3], r"colors=\['red', 3\]: entry 3 is not a name; every entry is a non-empty string"),
    (["red", ""], r"entry '' is not a name"),
    (["+"], r"entry '\+' is not a name"),
    (["+blue", "red"], r"colors=\['\+blue', 'red'\] mixes edits \('\+x', '-x'\) and plain entries: write either edits "
                       r"of the default list \['red', 'green'\] or the whole list"),
    (["-blue"], r"colors=\['-blue'\]: '-blue' removes 'blue', which is not in the default list \['red', 'green'\]; "
                r"remove an entry of that list, or write the whole list"),
    (["pink"], r"colors: unknown color 'pink' in colors=\['pink'\]; colors are red, green, blue"),
    (["+pink"], r"colors: unknown color 'pink' in colors=\['\+pink'\]"),
])
def test_one_set_of_refusals_naming_argument_value_and_fix(value, match):
    with pytest.raises(ValueError, match=match):
        COLORS.resolve(value)


def test_no_vocabulary_takes_any_name():
    free = ListGrammar("names", ("a",), "names", "['a']")
    assert free.resolve(["anything", "x"]) == ("anything", "x")


def test_is_edit_list():
    assert is_edit_list(["+a", "-b"]) and is_edit_list(("-b",))
    assert not is_edit_list([]) and not is_edit_list(["a", "+b"]) and not is_edit_list("default") \
        and not is_edit_list(None)


def test_fp32_fallback_and_keep_bf16_share_the_grammar():
    assert resolve_op_list("default") == DEFAULT_FP32_OPS and resolve_keep_list("default") == DEFAULT_KEEP
    assert resolve_op_list(["+logsumexp", "-softmax"]) == tuple(o for o in DEFAULT_FP32_OPS if o != "softmax")
    for grammar, edit in ((FP32_FALLBACK, "softmax"), (KEEP_BF16, "lm_head")):
        with pytest.raises(ValueError, match=f"{grammar.arg}=.* mixes edits"):
            grammar.resolve([f"+{edit}", edit])
        with pytest.raises(ValueError, match=f"{grammar.arg}=.*'-nothing' removes 'nothing'"):
            grammar.resolve(["-nothing"])
        with pytest.raises(ValueError, match=f"{grammar.arg}=.*entry None is not a name"):
            grammar.resolve([None])
    with pytest.raises(ValueError, match=r"fp32_fallback: unknown op 'softmaxx' in fp32_fallback=\['softmaxx'\]; "
                                         r"names are torch functional names"):
        resolve_op_list(["softmaxx"])
    with pytest.raises(ValueError, match=r"keep_bf16: unknown rule '<big>' in keep_bf16=\['<big>'\]; rules are "
                                         r"<first>, <small>"):
        resolve_keep_list(["<big>"])
    assert resolve_keep_list(["*.attn.*"]) == ("*.attn.*",)  # patterns are free
