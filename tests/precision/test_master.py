"""*-master: half params, fp32 masters, exact against a hand-written fp32 reference."""
from __future__ import annotations

import pytest
import torch

from _models import Classifier, classification_data, mlp, quiet_trainer


@pytest.mark.parametrize("precision,half", [("bf16-master", torch.bfloat16), ("16-master", torch.float16)])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_masters_match_fp32_reference(precision, half, opt):
    torch.manual_seed(0)
    model = Classifier(mlp(), lr=1e-2 if opt == "adamw" else 0.1, optimizer=opt)
    grads_per_step = []

    class Grab:
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            skipped = bool(trainer.found_inf.item())  # 16-master's first steps may overflow at 2**16
            grads_per_step.append(None if skipped else {n: g.detach().clone() for n, g in trainer.unscaled_grads().items()})

    trainer = quiet_trainer(precision=precision, max_steps=5, callbacks=[Grab()])
    names = [n for n, _ in model.named_parameters()]
    dl = torch.utils.data.DataLoader(classification_data(n=160), batch_size=32, shuffle=False)
    # The masters start from the full fp32 init (not its half copy).
    trainer.fit(model, dl)
    prec = trainer._precision
    # dtypes: Linear params half, LayerNorm params fp32; masters fp32
    assert model.net[0].weight.dtype == half and model.net[1].weight.dtype == torch.float32
    assert all(m.dtype == torch.float32 for m in prec.masters)
    assert len(grads_per_step) == 5

    # Hand-written reference: an fp32 optimizer stepping fp32 copies with the upcast half grads.
    torch.manual_seed(0)
    ref_model = Classifier(mlp())
    ref_params = {}
    for n, p in ref_model.named_parameters():
        ref_params[n] = torch.nn.Parameter(p.detach().float().clone())
    plist = [ref_params[n] for n in names]
    ref_opt = (torch.optim.AdamW(plist, lr=1e-2) if opt == "adamw" else torch.optim.SGD(plist, lr=0.1, momentum=0.9))
    assert sum(g is not None for g in grads_per_step) >= 3
    for grads in grads_per_step:
        if grads is None:
            continue
        for n in names:
            ref_params[n].grad = grads[n].float()
        ref_opt.step()
    for n, p in model.named_parameters():
        m = prec.master_of.get(id(p), p)
        torch.testing.assert_close(m.detach(), ref_params[n].detach(), rtol=0, atol=1e-6)
        if p.dtype == half:
            assert torch.equal(p.detach(), m.detach().to(half)), f"{n}: param != master cast down"


def test_checkpoint_holds_fp32_master_weights(tmp_path):
    torch.manual_seed(0)
    model = Classifier(mlp())
    trainer = quiet_trainer(precision="bf16-master", max_steps=3, enable_checkpointing=True, default_root_dir=str(tmp_path))
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(n=96), batch_size=32))
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    prec = trainer._precision
    for n, p in model.named_parameters():
        assert ckpt["state_dict"][n].dtype == torch.float32
        m = prec.master_of.get(id(p))
        if m is not None:
            assert torch.equal(ckpt["state_dict"][n], m.detach())


@pytest.mark.parametrize("precision", ["bf16-master", "16-master"])
def test_mptrain_fused_adamw_takes_the_whole_step(precision):
    """With mptrain's FusedAdamW the precision hands over the step: masters live in its state."""
    from mptrain.optim import FusedAdamW

    class M(Classifier):
        def configure_optimizers(self):
            return FusedAdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    model = M(mlp())
    init = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    grads_per_step = []

    class Grab:
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            skipped = bool(trainer.found_inf.item())
            grads_per_step.append(None if skipped else {n: g.detach().clone() for n, g in trainer.unscaled_grads().items()})

    trainer = quiet_trainer(precision=precision, max_steps=5, callbacks=[Grab()])
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(n=160), batch_size=32))
    opt = trainer.optimizer
    assert trainer._precision.fused and opt.master_weights
    ref = {n: torch.nn.Parameter(v) for n, v in init.items()}
    names = list(ref)
    ref_opt = torch.optim.AdamW([ref[n] for n in names], lr=1e-2)
    for grads in grads_per_step:
        if grads is None:
            continue
        for n in names:
            ref[n].grad = grads[n].float()
        ref_opt.step()
    for n, p in model.named_parameters():
        master = opt.master_param(p)
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.detach(), ref[n].detach(), rtol=0, atol=1e-6)
        if p.dtype != torch.float32:
            assert torch.equal(p.detach(), master.detach().to(p.dtype))


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mptrain_fused_sgd_under_other_precisions_skips_on_device(precision):
    from mptrain.optim import FusedSGD

    class M(Classifier):
        def configure_optimizers(self):
            return FusedSGD(self.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    model = M(mlp(), inf_at_steps={1})
    before = {}

    class Snap:
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    trainer = quiet_trainer(precision=precision, max_steps=4, callbacks=[Snap()], loss_scaler={"init_scale": 256.0})
    trainer.fit(model, torch.utils.data.DataLoader(classification_data(n=128), batch_size=32))
    after_skip = before[2]
    assert all(torch.equal(a, b) for a, b in zip(before[1], after_skip))  # step 1 (inf) changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(before[2], [p.detach() for p in model.parameters()]))
    assert trainer.skipped_steps == 1
