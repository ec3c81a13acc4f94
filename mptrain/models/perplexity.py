"""Epoch perplexity for the language models: exp of the token-weighted mean loss.

Averaging per-batch exps would overstate it, so the models sum loss and token count over
the epoch (torchmetrics ``SumMetric``: synced across ranks) and take one exp at the end.
"""
from __future__ import annotations

import torch


def log_epoch_perplexity(module, loss_sum, count, name: str = "val/perplexity") -> None:
    """Log exp(sum / count) through ``module.log`` and reset both metrics (no-op on no tokens)."""
    total = count.compute()
    if float(total) == 0:
        return
    module.log(name, torch.exp((loss_sum.compute() / total).clamp(max=50.0)))
    loss_sum.reset()
    count.reset()
