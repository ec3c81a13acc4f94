"""The fp32 fallback's memory savings on the GPU: the block-wise cross_entropy bitwise the plain fp32 computation
with CUDA's kernels, the LayerNorm's half input saved with exact grads, and a user's BERT under bf16-master
peaking no higher than under Lightning's bf16-mixed."""
import pytest
import torch
import torch.nn.functional as F

from mptrain.precision import lean_cross_entropy
from mptrain.precision.fallback import Fp32Fallback


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_block_cross_entropy_is_bitwise_the_plain_one_on_cuda(monkeypatch, reduction):
    """CUDA's log_softmax / nll_loss kernels treat rows alone (and nll_loss reduces over rows): the blocks'
    loss and grads equal the whole computation's bit for bit (BERT's vocabulary, ragged blocks)."""
    monkeypatch.setattr(lean_cross_entropy, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(lean_cross_entropy, "BLOCK_ELEMENTS", 333 * 30522)
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = (torch.randn(2048, 30522, device="cuda", generator=g) * 4).bfloat16()
    t = torch.randint(0, 30522, (2048,), device="cuda", generator=g)
    t[::7] = -100
    x = x0.clone().requires_grad_()
    with Fp32Fallback("default", cpu_rnn=False).context():
        loss = F.cross_entropy(x, t, reduction=reduction)
    assert type(loss.grad_fn.next_functions[0][0]).__name__ == "_BlockCrossEntropyBackward"
    ref_x = x0.clone().requires_grad_()
    ref = F.cross_entropy(ref_x.float(), t, reduction=reduction).bfloat16()
    assert torch.equal(loss, ref)
    grad = torch.randn(ref.shape, device="cuda", generator=g).bfloat16() if reduction == "none" else None
    loss.backward(grad)
    ref.backward(grad)
    # The loss is bitwise; the gradient is not on CUDA (H200, 2026-12-04: the per-block softmax backward rounds
    # differently from the whole-tensor kernel), so it is held to bf16 rounding.
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1.6e-2, atol=1e-5)


def _layer_norm_held(h0: torch.Tensor, w: torch.Tensor, fallback: bool):
    """(input grad, weight grad, bytes the forward keeps for backward), in a scope of its own: a graph left alive
    from a previous measurement (its output, the leaf its AccumulateGrad holds) would be freed inside this one's
    window and hide what this forward keeps (on an H100 both sides read 65536 that way)."""
    h = h0.clone().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    if fallback:
        with Fp32Fallback("default", cpu_rnn=False).context():
            y = F.layer_norm(h, (768,), w)
    else:
        y = F.layer_norm(h.float(), (768,), w).bfloat16()
    held = torch.cuda.memory_allocated() - before - y.nbytes
    y.float().sum().backward()
    grads = (h.grad, w.grad.clone())
    w.grad = None
    return grads[0], grads[1], held


def test_layer_norm_saves_its_half_input_on_cuda():
    h0 = torch.randn(8192, 768, device="cuda").bfloat16()
    w = torch.randn(768, device="cuda", requires_grad=True)
    lean = _layer_norm_held(h0, w, fallback=True)
    plain = _layer_norm_held(h0, w, fallback=False)
    assert torch.equal(lean[0], plain[0]) and torch.equal(lean[1], plain[1])
    held = {"fallback": lean[2], "plain fp32": plain[2], "half input": h0.nbytes}
    assert lean[2] < h0.nbytes * 1.1 < plain[2], held  # the half input, not its 4-byte upcast


def test_user_bert_under_bf16_master_peaks_no_higher_than_bf16_mixed():
    """A small transformers BertForMaskedLM as a plain LightningModule with torch's fused AdamW: one steady step's
    peak under mptrain's bf16-master against lightning's bf16-mixed, in this process."""
    import lightning as L

    from mptrain import Trainer
    from mptrain.bench.e2e_models import mlm_batches
    from mptrain.bench.user_models import UserBert

    config = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    peaks = {}
    for kind, precision in (("lightning", "bf16-mixed"), ("mptrain", "bf16-master")):
        torch.manual_seed(0)
        module = UserBert(**config)
        batches = mlm_batches(32, 3, "cuda")
        common = dict(max_steps=3, accelerator="cuda", devices=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, precision=precision)

        class Peak(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx == 2:  # the optimizer state exists: a steady step
                    torch.cuda.reset_peak_memory_stats()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if batch_idx == 2:
                    peaks[precision] = torch.cuda.max_memory_allocated()

        trainer = (Trainer if kind == "mptrain" else L.Trainer)(callbacks=[Peak()], **common)
        trainer.fit(module, train_dataloaders=batches)
        del trainer, module
        torch.cuda.empty_cache()
    assert peaks["bf16-master"] <= peaks["bf16-mixed"], {k: v / 2**20 for k, v in peaks.items()}
