"""Sharded training on the CPU: 2 gloo ranks under Lightning's FSDPStrategy with ShardedPrecision.

The tests launch this file as a script (Lightning's FSDP launcher re-runs the command line for
rank 1, so it cannot run inside pytest).  A launch pays two ranks' imports of torch and Lightning (~25 s
on a 2-core box), so the Trainer scenarios share one launch (``trainer_runs``); Fabric's has its own.
"""
from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

HERE = Path(__file__).resolve()


TRAINER_MODES = ("trajectory", "nan", "checkpoint-full", "checkpoint-sharded", "bert")


def _launch(out: Path, mode: str, modes: tuple = ()) -> dict:
    """Runs ``mode`` ("trainer": every one of TRAINER_MODES in turn); each mode's results by rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[2]))
    r = subprocess.run([sys.executable, str(HERE), mode, str(out)], env=env, capture_output=True, text=True,
                       timeout=900, cwd=out)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return {m: {rank: torch.load(out / f"{m}.rank{rank}.pt", weights_only=True) for rank in (0, 1)}
            for m in modes or (mode,)}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory) -> dict:
    """mode -> {rank: result} for the Trainer scenarios, from one launch."""
    return _launch(tmp_path_factory.mktemp("fsdp"), "trainer", TRAINER_MODES)


@pytest.mark.slow
def test_sharded_run_follows_the_unsharded_loss_trajectory(trainer_runs):
    out = trainer_runs["trajectory"]
    for rank, d in out.items():
        assert len(d["fsdp 32-true"]) == len(d["ddp 32-true"]) == 8
        torch.testing.assert_close(d["fsdp 32-true"], d["ddp 32-true"], rtol=1e-5, atol=1e-6)
        # bf16 compute both ways; DDP reduces bf16 grads, FSDP fp32 ones: agreement to bf16's precision
        torch.testing.assert_close(d["fsdp bf16-master"], d["ddp bf16-master"], rtol=2e-2, atol=2e-2)
        assert not torch.equal(d["fsdp bf16-master"], d["fsdp 32-true"]), "bf16-master must compute in bf16"
        # mptrain's fused optimizer steps the fp32 shards (no master mode of its own): the same numbers
        torch.testing.assert_close(d["fsdp bf16-master FusedAdamW"], d["fsdp bf16-master"], rtol=1e-6, atol=1e-6)
        assert d["compute dtype"] == torch.bfloat16, "FSDP must all-gather bf16 compute params"
        assert d["norm dtype"] == torch.float32, "the LayerNorm must keep fp32 params (its own FSDP unit)"
        assert d["shard dtypes"] == {torch.float32}, "the sharded params (the masters) must be fp32"
        assert d["shard numel"] < d["full numel"], f"rank {rank} must hold a shard, not the whole model"
    assert not torch.equal(out[0]["fsdp bf16-master"], out[1]["fsdp bf16-master"]), "ranks saw the same data"
    full0, full1 = out[0]["full weights"], out[1]["full weights"]
    for name, t in full0.items():
        assert t.dtype == torch.float32 and torch.equal(t, full1[name]), name


@pytest.mark.slow
def test_nan_on_one_rank_skips_the_step_on_both(trainer_runs):
    out = trainer_runs["nan"]
    for rank, d in out.items():
        assert d["skipped"] == 1, f"rank {rank} must skip the step whose grad shard was NaN on rank 0 only"
        assert d["steps"] == 4
        assert d["scale"] == 512.0, "one skip halves the scale on every rank (hysteresis=1)"
        for name, before in d["before skip"].items():
            assert torch.equal(before, d["after skip"][name]), f"rank {rank}: {name} changed in a skipped step"
            assert not torch.equal(before, d["final"][name]), f"rank {rank}: {name} never trained"
    for name, t in out[0]["final"].items():
        assert torch.equal(t, out[1]["final"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_checkpoint_resume_reproduces_the_uninterrupted_run(trainer_runs, state_dict_type):
    """16-master, cut after 3 of 8 steps (mid-epoch), resumed from ``last``."""
    out = trainer_runs[f"checkpoint-{state_dict_type}"]
    for rank, d in out.items():
        for name, t in d["cut"].items():
            assert torch.equal(t, d["resumed start"][name]), f"rank {rank}: {name} not restored from the checkpoint"
        assert d["resumed start scaler"] == d["cut scaler"], f"rank {rank}: loss scaler not restored"
        assert torch.equal(d["resumed losses"][:1], d["straight losses"][3:4]), f"rank {rank}: first resumed step"
    saved = out[0]["saved"]
    if state_dict_type == "full":
        assert saved["dtypes"] == {torch.float32}, "the checkpoint must hold the fp32 masters"
        assert saved["keys"] == sorted(out[0]["cut"]), "the module's own keys (load_from_checkpoint reads them)"
        assert saved["precision"]["initial_precision"] == "16-master"
    else:
        assert saved["is_dir"], "a sharded checkpoint is a directory of shards"
    for rank, d in out.items():
        assert torch.equal(d["resumed losses"], d["straight losses"][3:]), f"rank {rank}: resumed run diverged"
        for name, t in d["straight"].items():
            assert torch.equal(t, d["resumed"][name]), f"rank {rank}: {name}"
        assert d["scaler"] == d["resumed scaler"]


@pytest.mark.slow
def test_the_bert_recipe_model_shards_with_fp32_fused_layernorms(trainer_runs):
    for rank, d in trainer_runs["bert"].items():
        assert torch.isfinite(d["loss"]) and d["skipped"] == 0
        assert d["units"].count("BertLayer") == 2, d["units"]
        assert d["units"].count("FusedLayerNorm") == 2 * 2 + 2, "each LayerNorm (2 a layer, embeddings, head) " \
                                                                "must be an fp32 unit of its own"
        assert d["compute dtype"] == torch.bfloat16 and d["norm dtype"] == torch.float32


@pytest.mark.slow
def test_lightning_fabric_takes_the_sharded_plugin(tmp_path):
    for rank, d in _launch(tmp_path, "fabric")["fabric"].items():
        torch.testing.assert_close(d["fsdp 32-true"], d["ddp 32-true"], rtol=1e-5, atol=1e-6)
        # Fabric's FSDP returns fp32 outputs (Lightning's FSDPPrecision.convert_output): the loss is fp32 there
        torch.testing.assert_close(d["fsdp bf16-master"], d["ddp bf16-master"], rtol=2e-2, atol=2e-2)
        assert not torch.equal(d["fsdp bf16-master"], d["fsdp 32-true"])
        assert "holds parameters FSDP does not manage" in d["unsharded"], d["unsharded"]


# -- the launched script ---------------------------------------------------------------------------------------

def _cpu_fsdp_strategy(**kwargs):
    """Lightning's FSDPStrategy on the CPU; three CPU-only differences, the rest is Lightning's GPU path.

    * Lightning refuses ``strategy="fsdp"`` with ``accelerator="cpu"`` and passes torch's FSDP the CUDA
      index as ``device_id`` (None on the CPU); torch's FSDP runs on the CPU given ``device_id=cpu``.
    * A full checkpoint's optimizer state is gathered without ``offload_to_cpu``: torch's FSDP1 gathers
      every state tensor of a parameter (``exp_avg``, ``exp_avg_sq``) through one reused buffer and lets
      the offload's ``.cpu()`` make the copy, which is no copy for CPU tensors: each would hold the last.
    * A full checkpoint's module state too: before pytorch/pytorch#188990 (torch 2.6 among them) FSDP1's
      ``offload_to_cpu`` frees the unsharded flat parameter even when it already is on the CPU, so the
      state dict's clone reads freed memory (rank 0 segfaults). Without it the clone is the copy.
    """
    import lightning.pytorch.strategies.fsdp as lightning_fsdp
    import torch.distributed.fsdp as fsdp

    def full_without_offload(module, world_size, rank0_only=True):
        return fsdp.FullyShardedDataParallel.state_dict_type(
            module, fsdp.StateDictType.FULL_STATE_DICT, fsdp.FullStateDictConfig(rank0_only=rank0_only),
            fsdp.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only))

    class CpuFSDPStrategy(lightning_fsdp.FSDPStrategy):
        def _setup_model(self, model):
            with _fsdp_on_cpu():
                return super()._setup_model(model)

        def optimizer_state(self, optimizer):
            with _patched(lightning_fsdp, "_get_full_state_dict_context", full_without_offload):
                return super().optimizer_state(optimizer)

        def lightning_module_state_dict(self):
            with _patched(lightning_fsdp, "_get_full_state_dict_context", full_without_offload):
                return super().lightning_module_state_dict()

    kwargs.setdefault("auto_wrap_policy", {torch.nn.Linear})
    return CpuFSDPStrategy(**kwargs)


def _cpu_fabric_fsdp_strategy(**kwargs):
    """lightning.fabric's FSDPStrategy on the CPU (``device_id=cpu``, as above)."""
    from lightning.fabric.strategies import FSDPStrategy

    class CpuFSDPStrategy(FSDPStrategy):
        def setup_module(self, module):
            with _fsdp_on_cpu():
                return super().setup_module(module)

    kwargs.setdefault("auto_wrap_policy", {torch.nn.Linear})
    return CpuFSDPStrategy(**kwargs)


@contextlib.contextmanager
def _fsdp_on_cpu():
    """Lightning wraps with ``torch.distributed.fsdp.FullyShardedDataParallel`` imported at the call: for the
    call, that name gives torch's FSDP ``device_id=cpu``."""
    import torch.distributed.fsdp as fsdp

    class OnCpu(fsdp.FullyShardedDataParallel):
        def __init__(self, module, *args, device_id=None, **kw):
            super().__init__(module, *args, device_id=torch.device("cpu"), **kw)

    with _patched(fsdp, "FullyShardedDataParallel", OnCpu):
        yield


@contextlib.contextmanager
def _patched(owner, name, value):
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _fit(strategy, precision, max_epochs=1, ckpt_path=None, callbacks=(), root=None, optimizer="adamw", **kw):
    """One fit of the tiny classifier: 64 samples, 2 ranks, batch 8: 4 steps an epoch.

    ``optimizer``: ``"adamw"`` / ``"sgd"`` (torch's) or ``"fused"`` (mptrain's FusedAdamW)."""
    from _models import Classifier, classification_data, mlp
    from mptrain import Trainer
    from mptrain.optim import FusedAdamW

    class FusedAdamWClassifier(Classifier):
        def configure_optimizers(self):
            return FusedAdamW(self.parameters(), lr=self.lr)

    torch.manual_seed(0)
    if optimizer == "fused":
        model = FusedAdamWClassifier(mlp(), lr=0.02)
    else:
        model = Classifier(mlp(), lr=0.02, optimizer=optimizer)
    loader = torch.utils.data.DataLoader(classification_data(n=64), batch_size=8, shuffle=True)
    trainer = Trainer(precision=precision, strategy=strategy, accelerator="cpu", devices=2, max_epochs=max_epochs,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, seed=0,
                      callbacks=list(callbacks), default_root_dir=root, **kw)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer, model


def _full_weights(trainer) -> dict:
    """Every rank gathers the whole model (fp32: the masters)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = trainer.strategy.model
    with FSDP.summon_full_params(model, writeback=False):  # names without the nested units' wrapper prefix
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.module.named_parameters()}


class _DtypeProbe(Callback):
    """Records the dtypes the first Linear and the first LayerNorm compute with (the params FSDP all-gathered)."""

    def __init__(self):
        self.seen: dict = {}

    def on_train_start(self, trainer, pl_module):
        # the modules themselves (inside their FSDP wrappers): their forward sees the all-gathered params
        for key, cls in (("compute dtype", torch.nn.Linear), ("norm dtype", torch.nn.LayerNorm)):
            next(m for m in pl_module.modules() if isinstance(m, cls)).register_forward_hook(self._record(key))

    def _record(self, key):
        def hook(module, args, output):
            self.seen.setdefault(key, module.weight.dtype)
        return hook


def _run_trajectory(out: Path) -> dict:
    result = {}
    for precision in ("32-true", "bf16-master"):
        # clipping active (the grad norm is ~1): the sharded norm must be the whole model's;
        # accumulation: FSDP reduce-scatters every micro-batch into the fp32 grad shards
        common = dict(max_epochs=2, gradient_clip_val=0.3, accumulate_grad_batches=2)
        _, ddp = _fit("ddp", precision, **common)
        result[f"ddp {precision}"] = torch.stack(ddp.losses).float()
        probe = _DtypeProbe()
        trainer, fsdp = _fit(_cpu_fsdp_strategy(), precision, callbacks=[probe], **common)
        result[f"fsdp {precision}"] = torch.stack(fsdp.losses).float()
    result.update(probe.seen)
    _, fused = _fit(_cpu_fsdp_strategy(), "bf16-master", optimizer="fused", **common)
    result["fsdp bf16-master FusedAdamW"] = torch.stack(fused.losses).float()
    shards = list(fsdp.parameters())
    result["shard dtypes"] = {p.dtype for p in shards}
    result["shard numel"] = sum(p.numel() for p in shards)
    result["full weights"] = _full_weights(trainer)
    result["full numel"] = sum(t.numel() for t in result["full weights"].values())
    return result


def _run_nan(out: Path) -> dict:
    class NanOnRankZero(Callback):
        """At step 1, rank 0's local grad shard of the first Linear gets a NaN: the reduce-scatter is over,
        so only rank 0 can see it; only the all-reduced found_inf makes rank 1 skip too."""
        snaps: dict = {}

        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == 1 and trainer.global_rank == 0:
                g = next(p.grad for p in pl_module.parameters() if p.grad is not None and p.grad.numel())
                g.view(-1)[0] = float("nan")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step in (1, 2):
                self.snaps[trainer.global_step] = _full_weights(trainer)

    cb = NanOnRankZero()
    trainer, _ = _fit(_cpu_fsdp_strategy(), "16-master", loss_scaler={"init_scale": 1024.0, "hysteresis": 1},
                      callbacks=[cb], max_epochs=1)
    return {"skipped": trainer.skipped_steps, "steps": trainer.global_step, "scale": trainer.loss_scaler.scale,
            "before skip": cb.snaps[1], "after skip": cb.snaps[2], "final": _full_weights(trainer)}


class _AtTrainStart(Callback):
    """What a resumed run starts from: the full weights and the scaler once the checkpoint is restored."""

    def on_train_start(self, trainer, pl_module):
        self.weights = _full_weights(trainer)
        self.scaler = trainer.loss_scaler.state_dict()


def _run_checkpoint(out: Path, state_dict_type: str) -> dict:
    strategy = lambda: _cpu_fsdp_strategy(state_dict_type=state_dict_type)  # noqa: E731
    straight, model = _fit(strategy(), "16-master", max_epochs=2, root=str(out / "straight"))
    result = {"straight losses": torch.stack(model.losses).float(), "straight": _full_weights(straight),
              "scaler": straight.loss_scaler.state_dict()}
    first, _ = _fit(strategy(), "16-master", max_epochs=2, max_steps=3, checkpoint_every_n_steps=3,
                    root=str(out / "cut"))  # cut mid-epoch
    result.update({"cut": _full_weights(first), "cut scaler": first.loss_scaler.state_dict()})
    start = _AtTrainStart()
    resumed, model = _fit(strategy(), "16-master", max_epochs=2, ckpt_path="last", root=str(out / "cut"),
                          callbacks=[start])
    result.update({"resumed losses": torch.stack(model.losses).float(), "resumed": _full_weights(resumed),
                   "resumed scaler": resumed.loss_scaler.state_dict(), "resumed start": start.weights,
                   "resumed start scaler": start.scaler})
    path = Path(first.checkpoint_callback.last_model_path)
    saved = {"is_dir": path.is_dir()}
    if path.is_file():
        ckpt = torch.load(path, weights_only=True)
        saved["dtypes"] = {t.dtype for t in ckpt["state_dict"].values() if t.is_floating_point()}
        saved["keys"] = sorted(ckpt["state_dict"])
        saved["precision"] = ckpt["ShardedPrecision"]
    result["saved"] = saved
    return result


def _run_bert(out: Path) -> dict:
    """The bert_large recipe's model and wrapping, tiny: one FSDP unit per BertLayer, fused LayerNorms."""
    from transformers.models.bert.modeling_bert import BertLayer

    from mptrain import Trainer
    from mptrain.data import MLMDataModule
    from mptrain.models import BertMLM

    torch.manual_seed(0)
    model = BertMLM(vocab_size=200, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, warmup_steps=1,
                    max_predictions=4)
    data = MLMDataModule(synthetic=True, vocab_size=200, seq_len=16, batch_size=4, synthetic_batches=8)
    probe = _DtypeProbe()
    trainer = Trainer(precision="bf16-master", strategy=_cpu_fsdp_strategy(auto_wrap_policy={BertLayer}),
                      accelerator="cpu", devices=2, max_steps=4, gradient_clip_val=1.0, limit_val_batches=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[probe])
    trainer.fit(model, datamodule=data)
    units = [type(m.module).__name__ for m in trainer.strategy.model.modules()
             if isinstance(m, torch.distributed.fsdp.FullyShardedDataParallel)]
    return {"loss": trainer.callback_metrics["train/loss"], "skipped": trainer.skipped_steps, "units": units,
            **probe.seen}


def _fabric_losses(strategy, plugin) -> torch.Tensor:
    """A hand-written loop under lightning.Fabric: 8 steps of batch 8 a rank, norm clipping active."""
    import lightning as L
    from _models import classification_data, mlp

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(mlp())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.02))
    x, y = classification_data(n=128).tensors
    losses = []
    for i in range(fabric.global_rank, 16, 2):
        loss = torch.nn.functional.cross_entropy(model(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.3)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def _run_fabric(out: Path) -> dict:
    from mptrain import ShardedPrecision
    from mptrain.precision import precision_plugin

    result = {}
    for mode in ("32-true", "bf16-master"):
        result[f"ddp {mode}"] = _fabric_losses("ddp", precision_plugin(mode))
        result[f"fsdp {mode}"] = _fabric_losses(_cpu_fabric_fsdp_strategy(), ShardedPrecision(mode))
    try:
        _fabric_losses("ddp", ShardedPrecision("bf16-master"))
        result["unsharded"] = "accepted"
    except ValueError as e:
        result["unsharded"] = str(e)
    return result


def _run(mode: str, out: Path) -> dict:
    if mode == "trajectory":
        return _run_trajectory(out)
    if mode == "nan":
        return _run_nan(out)
    if mode == "bert":
        return _run_bert(out)
    if mode == "fabric":
        return _run_fabric(out)
    return _run_checkpoint(out, mode.split("-", 1)[1])


def _main(mode: str, out: Path) -> None:
    sys.path.insert(0, str(HERE.parents[1]))  # tests/: _models
    for m in TRAINER_MODES if mode == "trainer" else (mode,):
        (out / m).mkdir(exist_ok=True)  # each mode's checkpoints apart
        result = _run(m, out / m)
        torch.save(result, out / f"{m}.rank{torch.distributed.get_rank()}.pt")
    # gloo threads left to interpreter teardown abort the exit ("terminate called without an active
    # exception"): both ranks meet, drop the trainers' references to the group, then destroy it
    torch.distributed.barrier()
    del result
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], Path(sys.argv[2]))
