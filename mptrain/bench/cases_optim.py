"""Optimizer / multi-tensor benchmark cases (`python -m mptrain.bench.kernels --only optim`).

Every case times one step over BERT-large's parameter list (392 tensors, 335M parameters, from
small biases to the 31M-element word embedding: several GB, far beyond L2) on random data.

Floors (bytes moved per parameter / 4.25 TB/s):
  AdamW, bf16 params+grads, fp32 master/m/v: read g2 w4 m4 v4, write w4 m4 v4 p2 = 28 B
  SGD momentum, same:                        read g2 w4 b4,    write w4 b4 p2     = 20 B
  unscale + inf check, fp16/bf16 grads:      read 2, write 2                      =  4 B
  l2norm, bf16 grads:                        read 2                               =  2 B
"""
from __future__ import annotations

import itertools
from functools import partial
from typing import Optional

import torch

from mptrain import ops
from mptrain.bench.common import Result, floor_ms, median_ms
from mptrain.bench.graph_timing import capture_graph
from mptrain.compat import torch as compat

#: Calls per timed batch: one multi-tensor call costs the host ~0.3-0.6 ms before its launch, so
#: timed alone (after do_bench's L2 flush) the GPU idles that long; in training the host runs ahead,
#: so ours and torch's are timed as BACK_TO_BACK calls (the single-call time is in `extra`).
BACK_TO_BACK = 4


def per_call_ms(fn) -> float:
    return median_ms(lambda: [fn() for _ in range(BACK_TO_BACK)]) / BACK_TO_BACK


def graph_ms(fn) -> Optional[float]:
    """GPU time per call without the host (BACK_TO_BACK calls captured in one CUDA graph, replayed):
    beside the eager time, it tells whether an op is host-bound.  Rounded; None if the capture fails."""
    try:
        graph, _ = capture_graph(lambda: [fn() for _ in range(BACK_TO_BACK)], warmup=fn)
        return round(median_ms(graph.replay) / BACK_TO_BACK, 4)
    except Exception as e:  # noqa: BLE001 - a diagnostic only: never lose the other numbers
        print(f"[optim] graph timing failed: {type(e).__name__}: {e}")
        return None


def bert_large_shapes(layers: int = 24, hidden: int = 1024, inter: int = 4096, vocab: int = 30522) -> list[tuple]:
    shapes = [(vocab, hidden), (512, hidden), (2, hidden), (hidden,), (hidden,)]  # embeddings + LayerNorm
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4  # q, k, v, attention output
        shapes += [(hidden,), (hidden,)]  # attention LayerNorm
        shapes += [(inter, hidden), (inter,), (hidden, inter), (hidden,)]  # feed-forward
        shapes += [(hidden,), (hidden,)]  # output LayerNorm
    shapes += [(hidden, hidden), (hidden,), (vocab,)]  # pooler, MLM decoder bias
    return shapes


def _randn(shapes, dtype, scale=1.0, positive=False):
    out = (torch.randn(s, device="cuda", dtype=torch.float32) for s in shapes)  # one fp32 tensor at a time
    return [(t.abs_() if positive else t).mul_(scale).to(dtype) for t in out]


def _master_state(shapes):
    """bf16 params and grads, their fp32 masters and per-tensor step counts: a master-weight step's inputs."""
    params = _randn(shapes, torch.bfloat16)
    grads = _randn(shapes, torch.bfloat16, 1e-2)
    return params, grads, [p.float() for p in params], [torch.full((), 10.0, device="cuda") for _ in shapes]


def _torch_master_path(params, grads, make_optimizer):
    """PyTorch's master-weight step today: grads up to fp32, ``make_optimizer(masters)``
    (a fused torch optimizer) steps the fp32 masters, params down.  Returns the step."""
    masters = [p.float() for p in params]
    for w in masters:
        w.grad = torch.empty_like(w)
    opt = make_optimizer(masters)
    master_grads = [w.grad for w in masters]

    def step():
        compat.foreach_copy_(master_grads, grads)
        opt.step()
        compat.foreach_copy_(params, masters)

    return step


def _adamw_cases(shapes, n) -> list[Result]:
    params, grads, masters, steps = _master_state(shapes)
    m, v = _randn(shapes, torch.float32, 1e-3), _randn(shapes, torch.float32, 1e-5, positive=True)
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, fused=True)
    ours = partial(ops.multi_tensor_adam, grads, params, m, v, steps, masters, **kw)
    found = torch.zeros((), device="cuda")

    def ours_checked():  # what step(grad_scale=, found_inf=) does: inf check pass + update
        ops.multi_tensor.multi_tensor_check_finite_(grads, found, fused=True)
        ops.multi_tensor_adam(grads, params, m, v, steps, masters, grad_scale=1.0, found_inf=found, **kw)

    torch_path = _torch_master_path(params, grads,
                                    lambda w: torch.optim.AdamW(w, lr=1e-4, weight_decay=0.01, fused=True))

    ours_ms = per_call_ms(ours)
    single_ms = median_ms(ours)
    torch_ms = per_call_ms(torch_path)
    checked_ms = per_call_ms(ours_checked)
    assert found.item() == 0, "benchmark data produced a non-finite gradient"
    del torch_path  # frees torch's fp32 masters and state before the next case

    # torch's fused AdamW on fp32 params alone (no master, no copies).
    f_params = _randn(shapes, torch.float32)
    for w, g in zip(f_params, _randn(shapes, torch.float32, 1e-2)):
        w.grad = g
    f_opt = torch.optim.AdamW(f_params, lr=1e-4, weight_decay=0.01, fused=True)
    f_ms = per_call_ms(f_opt.step)
    del f_opt, f_params

    extra = dict(params=n, tensors=len(shapes), single_call_ms=round(single_ms, 4))
    return [
        Result(f"AdamW master bf16 BERT-large ({len(shapes)} tensors, {n / 1e6:.0f}M)", ours_ms, torch_ms,
               floor_ms(28 * n), extra),
        Result("AdamW master bf16 + inf check (30 B/param)", checked_ms, torch_ms, floor_ms(30 * n)),
        Result("torch AdamW(fused=True), fp32 params alone (28 B/param)", f_ms, None, floor_ms(28 * n)),
    ]


def _sgd_case(shapes, n) -> Result:
    params, grads, masters, steps = _master_state(shapes)
    bufs = _randn(shapes, torch.float32, 1e-2)
    ours = partial(ops.multi_tensor_sgd, grads, params, bufs, steps, masters, lr=1e-4, momentum=0.9,
                   dampening=0.0, weight_decay=0.0, nesterov=False, fused=True)
    torch_path = _torch_master_path(params, grads, lambda w: torch.optim.SGD(w, lr=1e-4, momentum=0.9, fused=True))

    return Result("SGD momentum master bf16 BERT-large (20 B/param)", per_call_ms(ours), per_call_ms(torch_path),
                  floor_ms(20 * n), dict(single_call_ms=round(median_ms(ours), 4)))


def _unscale_cases(shapes, n) -> list[Result]:
    results = []
    for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        grads = _randn(shapes, dtype)
        found = torch.zeros(1, device="cuda")
        scales = [torch.full((1,), s, device="cuda") for s in (0.5, 2.0)]  # values survive repeated calls
        next_scale = itertools.cycle(scales[::-1]).__next__  # 2.0, 0.5, 2.0, ...

        def ours():
            ops.multi_tensor_unscale_(grads, next_scale(), found, fused=True)

        label = "torch._amp_foreach_non_finite_check_and_unscale_"
        try:
            compat.amp_unscale_and_check_(grads[:1], found, scales[1])  # supported?

            def theirs():
                compat.amp_unscale_and_check_(grads, found, next_scale())
        except RuntimeError:
            label = "torch: bf16 unsupported -> upcast to fp32, unscale, copy back"
            up = [torch.empty_like(g, dtype=torch.float32) for g in grads]

            def theirs():
                compat.foreach_copy_(up, grads)
                compat.amp_unscale_and_check_(up, found, next_scale())
                compat.foreach_copy_(grads, up)

        ours_ms = per_call_ms(ours)
        torch_ms = per_call_ms(theirs)
        g_ms = graph_ms(ours)
        assert found.item() == 0, "benchmark data produced a non-finite gradient"
        results.append(Result(f"unscale + inf check {name} grads (4 B/param)", ours_ms, torch_ms, floor_ms(4 * n),
                              dict(baseline=label, single_call_ms=round(median_ms(ours), 4), graph_ms=g_ms)))
        del grads
    return results


def _l2norm_case(shapes, n) -> Result:
    grads = _randn(shapes, torch.bfloat16)
    ours = partial(ops.multi_tensor_l2norm, grads, fused=True)

    def theirs():  # what torch.nn.utils.clip_grad_norm_ computes
        torch.linalg.vector_norm(torch.stack(compat.foreach_norm(grads)))

    exact = torch.stack([g.double().norm() for g in grads]).norm()  # torch's bf16 _foreach_norm rounds to bf16
    torch.testing.assert_close(ours().double(), exact, rtol=1e-5, atol=0)
    g_ms = graph_ms(ours)
    return Result("l2norm bf16 grads (2 B/param)", per_call_ms(ours), per_call_ms(theirs), floor_ms(2 * n),
                  dict(single_call_ms=round(median_ms(ours), 4), graph_ms=g_ms))


def run(args) -> list[Result]:
    ops.get_extension(required=True)  # a build failure must be loud here, not a silent fallback
    shapes = bert_large_shapes(layers=4 if args.quick else 24)
    n = sum(torch.Size(s).numel() for s in shapes)
    results = _adamw_cases(shapes, n)
    torch.cuda.empty_cache()
    results.append(_sgd_case(shapes, n))
    torch.cuda.empty_cache()
    results += _unscale_cases(shapes, n)
    results.append(_l2norm_case(shapes, n))
    torch.cuda.empty_cache()
    return results
