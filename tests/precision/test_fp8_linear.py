"""fp8-master's tensorwise linear: the same bits as torchao's Float8Linear with half the casts, fp8 saved input."""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

float8 = pytest.importorskip("torchao.float8")

from mptrain.precision.fp8 import is_float8_linear, unswap_fp8_linears  # noqa: E402
from mptrain.precision.fp8_linear import Fp8Linear, single_casts_apply, use_single_casts  # noqa: E402


def _pair(recipe="tensorwise", bias=True):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128, bias=bias), nn.GELU(), nn.Linear(128, 32, bias=False)).bfloat16()
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    float8.convert_to_float8_training(theirs, config=config)
    float8.convert_to_float8_training(ours, config=config)
    return theirs, ours, use_single_casts(ours)


def _step(model, x):
    x = x.clone().requires_grad_()
    y = model(x)
    (y.float() ** 2).sum().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return y.detach(), x.grad, grads


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(u is v is None or torch.equal(u, v) for u, v in zip(a[2], b[2]))


@pytest.mark.parametrize("bias", [True, False])
def test_eager_equals_torchao_bit_for_bit(bias):
    theirs, ours, names = _pair(bias=bias)
    assert names == ["0", "2"] and all(type(m) is Fp8Linear for m in (ours[0], ours[2]))
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)  # 3-D: reshaped to rows and back
    _assert_same(_step(theirs, x), _step(ours, x))


def _graph_ops(model, x):
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = _step(torch.compile(model, backend=aot_autograd(fw_compiler=grab, bw_compiler=grab), fullgraph=True), x)
    return out, collections.Counter(str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function")


def test_compiled_it_casts_each_operand_once_and_equals_torchao():
    theirs, ours, _ = _pair()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    out_theirs, ops_theirs = _graph_ops(theirs, x)
    out_ours, ops_ours = _graph_ops(ours, x)
    _assert_same(out_theirs, out_ours)
    # one amax per cast: torchao casts input, weight and output gradient twice each, this linear once, each amax
    # taken along rows first and then over the rows' maxima (two reductions)
    assert ops_theirs["aten.max.default"] == 12 and ops_ours["aten.max.default"] == 0
    assert ops_ours["aten.amax.default"] == 2 * 6
    assert ops_theirs["aten._scaled_mm.default"] == ops_ours["aten._scaled_mm.default"] == 6


@pytest.mark.slow
def test_inductor_equals_torchao_compiled():
    theirs, ours, _ = _pair()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    results = []
    for model in (theirs, ours):
        torch._dynamo.reset()
        results.append(_step(torch.compile(model), x))
    _assert_same(*results)


def test_backward_keeps_the_fp8_input_not_the_bf16_one():
    _, ours, _ = _pair()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ours[0](x)
    assert len(saved) == 2 and all(type(t).__name__ == "Float8TrainingTensor" for t in saved)
    assert all(t._data.dtype == torch.float8_e4m3fn for t in saved)


def test_rowwise_keeps_torchaos_linear_saying_why():
    theirs, ours, names = _pair("rowwise")
    assert names == [] and type(ours[0]).__name__ == "Float8Linear"
    assert "tensorwise" in single_casts_apply(ours[0].config)
    assert single_casts_apply(float8.Float8LinearConfig.from_recipe_name("tensorwise")) is None


def test_unswap_turns_it_back_into_a_linear_with_the_same_parameters():
    _, ours, _ = _pair()
    w = ours[0].weight
    assert is_float8_linear(ours[0])
    assert unswap_fp8_linears(ours) == ["0", "2"]
    assert type(ours[0]) is nn.Linear and ours[0].weight is w and not is_float8_linear(ours[0])


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does():
    theirs, ours, _ = _pair()
    for model in (theirs, ours):
        model[0].weight.requires_grad_(False)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    a, b = _step(theirs[0], x), _step(ours[0], x)
    _assert_same(a, b)
    assert b[2][0] is None and b[2][1] is not None  # the weight's none, the bias's as torchao


def test_import_mptrain_does_not_import_torchao():
    """torchao is imported by a run that converts layers, not by ``import mptrain`` (it costs a quarter second)."""
    import subprocess
    import sys

    code = "import sys, mptrain, mptrain.precision.fp8_linear; print('torchao' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_the_class_pickles_by_name():
    import pickle

    _, ours, _ = _pair()
    again = pickle.loads(pickle.dumps(ours))
    assert type(again[0]) is Fp8Linear


@pytest.mark.parametrize("shape, transpose", [((), False), ((7,), False), ((5, 9), False), ((5, 9), True),
                                              ((3, 4, 6), False)])
def test_tensor_amax_is_the_whole_tensors_amax(shape, transpose):
    from mptrain.precision.fp8_linear import tensor_amax

    x = torch.randn(shape, dtype=torch.bfloat16)
    x.view(-1)[0] = -8.0  # the largest magnitude, negative
    if transpose:
        x = x.t()  # a weight's transposed view: reduced along its contiguous dimension first
    got = tensor_amax(x)
    assert got.dtype == torch.float32 and got.shape == ()
    assert got == x.abs().amax().float() == 8.0
