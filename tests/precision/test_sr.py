"""bf16-sr (StochasticRoundingPrecision) on the CPU: through mptrain.Trainer, plain lightning.Trainer and Fabric;
bf16 weights without a master copy; reproducible from the seed; the checkpoint holds the generator's position and a
resume is bitwise; a learning rate at which bf16-true loses every update moves the weights in expectation."""
from __future__ import annotations

import lightning as L
import pytest
import test_resume_matrix as RM
import torch
from _models import Classifier, classification_data, mlp
from lightning.pytorch.callbacks import ModelCheckpoint

import mptrain
from mptrain import StochasticRoundingPrecision, Trainer
from mptrain.optim import FusedAdamW, FusedSGD


def _loader(n=64, d=8, shuffle=False):
    return torch.utils.data.DataLoader(classification_data(n=n, d=d), batch_size=8, shuffle=shuffle)


def _trainer(precision="bf16-sr", **kw):
    args = dict(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_progress_bar=False,
                enable_checkpointing=False, enable_model_summary=False)
    args.update(kw)
    return Trainer(precision=precision, **args)


def test_mode_is_listed_and_built():
    assert "bf16-sr" in mptrain.PRECISIONS
    plugin = mptrain.precision.precision_plugin("bf16-sr")
    assert isinstance(plugin, StochasticRoundingPrecision) and plugin.loss_scaler is None
    with pytest.raises(ValueError, match="no loss scaler"):
        StochasticRoundingPrecision("bf16-sr", loss_scaler={"init_scale": 8.0})
    with pytest.raises(ValueError, match="bf16-sr"):
        StochasticRoundingPrecision("bf16-master")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_trainer_runs_bf16_weights_no_master_and_the_loss_falls(optimizer):
    torch.manual_seed(0)
    model = Classifier(mlp(d=8), lr=1e-2 if optimizer == "adamw" else 5e-2, optimizer=optimizer)
    trainer = _trainer(seed=3)
    trainer.fit(model, _loader())
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["net.0.weight"] == dtypes["net.4.weight"] == torch.bfloat16
    assert dtypes["net.1.weight"] == torch.float32  # the LayerNorm keeps fp32 weights
    opt = trainer.optimizers[0]
    assert isinstance(opt, FusedAdamW if optimizer == "adamw" else FusedSGD) and opt.stochastic_rounding == 3
    for p, st in opt.state.items():
        assert "master_param" not in st  # no fp32 copy of any parameter
        assert all(v.dtype == torch.float32 for k, v in st.items() if k != "step")  # fp32 moments
        assert not any(torch.is_tensor(v) and v.shape == p.shape and v.dtype == torch.float32 and k not in
                       ("exp_avg", "exp_avg_sq", "momentum_buffer") for k, v in st.items())
    losses = torch.stack(model.losses)
    assert losses[-8:].mean() < 0.7 * losses[:8].mean()


def test_plain_lightning_and_fabric_accept_the_plugin():
    torch.manual_seed(0)
    model = Classifier(mlp(d=8), lr=1e-2)
    trainer = L.Trainer(plugins=[StochasticRoundingPrecision("bf16-sr", seed=5)], accelerator="cpu", devices=1,
                        max_epochs=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(model, _loader())
    assert model.net[0].weight.dtype == torch.bfloat16 and trainer.optimizers[0].stochastic_rounding == 5
    assert torch.stack(model.losses)[-4:].mean() < torch.stack(model.losses)[:4].mean()

    torch.manual_seed(0)
    fabric = L.Fabric(plugins=[StochasticRoundingPrecision("bf16-sr", seed=5)], accelerator="cpu", devices=1)
    net = mlp(d=8)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt = fabric.setup(net, opt)
    losses = []
    for _ in range(3):
        for x, y in _loader():
            loss = torch.nn.functional.cross_entropy(net(x).float(), y)
            fabric.backward(loss)
            fabric.clip_gradients(net, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    assert net.module[0].weight.dtype == torch.bfloat16
    assert sum(losses[-4:]) < sum(losses[:4])


def test_other_optimizers_are_refused_naming_the_ones_that_work():
    class RMSModel(Classifier):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    with pytest.raises(ValueError, match="torch.optim.RMSprop.*torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD"):
        _trainer(max_steps=1).fit(RMSModel(mlp(d=8)), _loader())

    class AmsgradModel(Classifier):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3, amsgrad=True)

    with pytest.raises(ValueError, match="amsgrad"):
        _trainer(max_steps=1).fit(AmsgradModel(mlp(d=8)), _loader())


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_reproducible_from_the_seed_and_different_for_another():
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        torch.manual_seed(0)
        model = Classifier(mlp(d=8), lr=1e-2)
        L.Trainer(plugins=[StochasticRoundingPrecision(seed=seed)], accelerator="cpu", devices=1, max_epochs=2,
                  logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  enable_model_summary=False).fit(model, _loader())
        runs[name] = _weights(model)
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert not torch.equal(runs["a"]["net.0.weight"], runs["c"]["net.0.weight"])


def test_the_run_seed_is_the_default_and_a_checkpoint_holds_the_generator_position(tmp_path):
    torch.manual_seed(0)
    model = Classifier(mlp(d=8), lr=1e-2)
    trainer = _trainer(seed=11, max_epochs=1, default_root_dir=str(tmp_path))
    trainer.fit(model, _loader())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    ckpt = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert ckpt["StochasticRoundingPrecision"]["sr_seed"] == 11  # the seed ...
    steps = {float(st["step"]) for st in ckpt["optimizer_states"][0]["state"].values()}
    assert steps == {8.0}  # ... and the step: every parameter's count
    assert ckpt["state_dict"]["net.0.weight"].dtype == torch.bfloat16  # what trains, exactly


@pytest.fixture
def sr_matrix(monkeypatch):
    """The resume matrix's helpers (tests/test_resume_matrix.py) with bf16-sr accumulating 2 batches."""
    monkeypatch.setitem(RM.CONFIGS, "bf16-sr", 2)
    return RM


def test_resume_is_bitwise(tmp_path, sr_matrix):
    RM = sr_matrix
    root = tmp_path / "straight"
    every_step = ModelCheckpoint(dirpath=root / "positions", filename="{step}", every_n_train_steps=1,
                                 save_top_k=-1)
    epoch_end = ModelCheckpoint(dirpath=root / "positions", filename="{epoch}", save_top_k=-1)
    trainer, losses, end = RM._fit(root, "bf16-sr", callbacks=[every_step, epoch_end])
    assert end["StochasticRoundingPrecision"]["sr_seed"] == 0  # Trainer(seed=0)
    positions = dict(RM._positions("bf16-sr"))
    for position in ("step=2", "step=5", "epoch=0", "epoch=1"):
        trained = positions[position]
        _, rest, resumed = RM._fit(tmp_path / position, "bf16-sr", ckpt_path=str(root / "positions" /
                                                                              f"{position}.ckpt"))
        assert torch.equal(rest, losses[trained:]), position
        for name, t in end["state_dict"].items():
            assert t.dtype == resumed["state_dict"][name].dtype and torch.equal(t, resumed["state_dict"][name]), name
        for a, b in zip(end["optimizer_states"][0]["state"].values(),
                        resumed["optimizer_states"][0]["state"].values()):
            for key in a:
                assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), (position, key)


class Drift(L.LightningModule):
    """A weight vector at 1.0 with a constant gradient of 1: each SGD step's update is exactly lr."""

    def __init__(self, n=8192, lr=2.0 ** -12):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return self.w.float().sum() + 0 * batch[0].sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_low_learning_rate_bf16_true_loses_every_update_bf16_sr_moves_in_expectation():
    steps, lr = 16, 2.0 ** -12  # each update 1/16 of the bf16 ulp below 1.0 (2^-8): round-to-nearest drops it
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(steps, 1)), batch_size=1)
    moved = {}
    for precision in ("bf16-true", "bf16-sr", "32-true"):
        model = Drift(lr=lr)
        _trainer(precision, max_steps=steps, max_epochs=1).fit(model, data)
        assert model.w.dtype == (torch.float32 if precision == "32-true" else torch.bfloat16)
        moved[precision] = 1.0 - model.w.detach().double().mean().item()
    assert moved["bf16-true"] == 0.0
    assert moved["32-true"] == pytest.approx(steps * lr)
    assert moved["bf16-sr"] == pytest.approx(steps * lr, rel=0.05)  # 8192 weights: the mean within 5%


class RankSeed(L.Callback):
    """Each rank sees a different run seed before setup; saves its weights and rounding seed at the end."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def setup(self, trainer, pl_module, stage):
        import os

        os.environ["PL_GLOBAL_SEED"] = str(100 + trainer.global_rank)

    def on_train_end(self, trainer, pl_module):
        torch.save({"weights": [p.detach().clone() for p in pl_module.parameters()],
                    "seed": trainer.precision_plugin.seed, "precision": trainer.precision_plugin.precision},
                   f"{self.out_dir}/rank{trainer.global_rank}.pt")


@pytest.mark.slow  # two spawned ranks
def test_ddp_ranks_round_identically_with_rank_0s_seed_and_switch_to_fp32(tmp_path):
    from mptrain.callbacks.fp32_finetune import Fp32Finetune

    torch.manual_seed(0)
    model = Classifier(mlp(), lr=0.05, optimizer="sgd")
    t = L.Trainer(plugins=[StochasticRoundingPrecision("bf16-sr")], strategy="ddp_spawn", devices=2,
                  accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                  enable_model_summary=False, callbacks=[RankSeed(str(tmp_path)), Fp32Finetune(steps=2)])
    t.fit(model, torch.utils.data.DataLoader(classification_data(n=320), batch_size=16))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["seed"] == r1["seed"] == 100  # rank 0's, broadcast
    assert r0["precision"] == r1["precision"] == "32-true"  # the late switch: fp32 weights, rounding off
    assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"]))  # the replicas never drifted
