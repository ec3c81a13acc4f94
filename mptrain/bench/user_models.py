"""The user-model benchmarks' LightningModules: what a plain Lightning user writes around torchvision's
ResNet-50, transformers' ``BertForMaskedLM`` and ``LlamaForCausalLM`` at 1.2B -- no mptrain module inside, the network stored as
``self.model``, ``training_step`` calling ``self.model(...)``, torch's own fused optimizers.

``quick=True`` (``--quick``) shrinks them (ResNet-18 on 16-pixel images, a 2-layer BERT and Llama) for CPU smoke
tests.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from mptrain.bench.e2e_models import DeviceBatches, image_batches, mlm_batches

USER_MODELS = ("user_resnet50", "user_bert", "user_llama")
#: per-GPU batch of each user model
USER_BATCH = {"user_resnet50": 256, "user_bert": 128, "user_llama": 8}
SEQ_LEN, IMAGE_SIZE, LLAMA_SEQ_LEN = 128, 224, 2048
#: the llama_1b recipe's widths (1.2B parameters), as a user configures transformers' Llama
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=16, vocab_size=32000, max_position_embeddings=LLAMA_SEQ_LEN)
QUICK = {"batch": 2, "image_size": 16, "seq_len": 16,
         "bert": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                      vocab_size=1000),
         "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=1000, max_position_embeddings=16)}


class UserResNet(L.LightningModule):
    """torchvision's ResNet (``arch``) with cross-entropy, stepped by ``SGD(momentum=0.9, fused=fused)``; its
    weights in channels_last, the layout of its input batches (as PyTorch's performance guide advises)."""

    def __init__(self, arch: str = "resnet50", num_classes: int = 1000, lr: float = 0.1, fused: bool = True,
                 channels_last: bool = True):
        super().__init__()
        try:
            import torchvision
        except ImportError as e:  # pragma: no cover - a dependency of mptrain
            raise ImportError("the user ResNet model needs torchvision: pip install torchvision") from e
        self.model = getattr(torchvision.models, arch)(num_classes=num_classes)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.lr, self.fused = lr, fused

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, fused=self.fused)


class UserBert(L.LightningModule):
    """transformers' ``BertForMaskedLM(BertConfig(attn_implementation="sdpa", **config))``: the masked-LM loss
    over every position (labels -100 where unmasked), stepped by ``AdamW(fused=fused)``."""

    def __init__(self, lr: float = 1e-4, fused: bool = True, **config):
        super().__init__()
        try:
            from transformers import BertConfig, BertForMaskedLM
        except ImportError as e:
            raise ImportError("the user BERT model needs transformers: pip install transformers") from e
        self.model = BertForMaskedLM(BertConfig(attn_implementation="sdpa", **config))
        self.lr, self.fused = lr, fused

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused)


class UserLlama(L.LightningModule):
    """transformers' ``LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **config))``: next-token loss
    (``labels=input_ids``, no padding, no attention mask), stepped by ``AdamW(fused=fused)``."""

    def __init__(self, lr: float = 3e-4, fused: bool = True, **config):
        super().__init__()
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as e:
            raise ImportError("the user Llama model needs transformers: pip install transformers") from e
        self.model = LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **config))
        self.lr, self.fused = lr, fused

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=self.fused)


def build_user(model: str, steps: int, device: str, quick: bool = False, batch: int | None = None,
               seed: int = 0) -> tuple[L.LightningModule, DeviceBatches, int]:
    """(LightningModule, train batches on ``device``, batch size) of a user model; fp32 weights as built."""
    if model not in USER_MODELS:
        raise ValueError(f"unknown user model {model!r}; valid: {', '.join(USER_MODELS)}")
    batch = batch or (QUICK["batch"] if quick else USER_BATCH[model])
    if model == "user_resnet50":
        module = UserResNet("resnet18" if quick else "resnet50", num_classes=1000)
        size = QUICK["image_size"] if quick else IMAGE_SIZE
        return module, image_batches(batch, steps, device, size, seed=seed), batch
    if model == "user_llama":
        module = UserLlama(**(QUICK["llama"] if quick else LLAMA_1B))
        vocab = module.model.config.vocab_size
        seq_len = QUICK["seq_len"] if quick else LLAMA_SEQ_LEN
        return module, mlm_batches(batch, steps, device, seq_len, vocab, seed=seed), batch
    config = QUICK["bert"] if quick else {}
    module = UserBert(**config)
    vocab = module.model.config.vocab_size
    seq_len = QUICK["seq_len"] if quick else SEQ_LEN
    return module, mlm_batches(batch, steps, device, seq_len, vocab, seed=seed), batch
