"""LoRA (Hu et al. 2021), hand-written: a low-rank update beside each frozen linear layer, merged for export.

Every linear layer of the transformer blocks (attention q/k/v/o, MLP gate/up/down; not the embeddings or the
LM head) gets y = W x + (alpha / r) * B A x (eq. 3), W frozen, A random, B = 0, so training starts exactly at
the pretrained model; `merge_lora` writes W + (alpha / r) B A into plain nn.Linear layers. The paper's SFT
baseline uses rank 64, alpha 32 (Appendix G, `sft_baseline.py --lora-rank`); `train.py --lora-rank` uses it
for RL, to fit larger models on one card, where `adapters_off` turns the policy back into its frozen base:
the KL reference without a second copy of the weights (verl's `ref_in_actor`). peft's initialisation
otherwise.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / r) * B A x (Hu et al. 2021, eq. 3); base frozen, A ~ nn.Linear's init, B = 0."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scale = alpha / rank
        w = base.weight
        # [r, in] and [out, r]
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        # as nn.Linear (and peft): B = 0 keeps y = base(x)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.off = False  # set by adapters_off: the frozen base alone

    def forward(self, x):
        if self.off:
            return self.base(x)
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain nn.Linear with W + (alpha / r) B A (same bias): what save_pretrained writes."""
        w = self.base.weight
        out = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None,
                        device=w.device, dtype=w.dtype)
        out.weight.copy_(w + self.scale * (self.lora_B.float() @ self.lora_A.float()).to(w.dtype))
        if self.base.bias is not None:
            out.bias.copy_(self.base.bias)
        return out


def add_lora(model: nn.Module, rank: int, alpha: float) -> list[str]:
    """Freeze `model` and wrap every nn.Linear except the LM head in a LoRALinear; -> the wrapped names."""
    head = model.get_output_embeddings()
    model.requires_grad_(False)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, LoRALinear(getattr(owner, child), rank, alpha))
    return names


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Inside the block `model` computes its frozen base alone (every LoRALinear's update skipped): a LoRA
    run's KL reference, the initial policy (B = 0 at the start and the base never trains), at no extra memory
    (verl's `ref_in_actor` does the same)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.off = True
    try:
        yield model
    finally:
        for m in layers:
            m.off = False


def merge_lora(model: nn.Module) -> int:
    """Replace every LoRALinear by its merged nn.Linear (in place); -> how many were merged."""
    names = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, getattr(owner, child).merged())
    return len(names)


@torch.no_grad()
def plain_state_dict(model: nn.Module) -> dict | None:
    """The model's weights as a plain model has them (each LoRALinear merged, on the CPU), for
    save_pretrained's `state_dict=`: checkpoints of a LoRA run load like any other model. None when the model
    has no LoRA."""
    if not any(isinstance(m, LoRALinear) for m in model.modules()):
        return None
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            sd[f"{name}.weight"] = m.merged().weight.detach().cpu()
            sd.pop(f"{name}.base.weight")
            if m.base.bias is not None:
                sd[f"{name}.bias"] = sd.pop(f"{name}.base.bias")
    return sd


def adapter_state(model: nn.Module) -> dict:
    """The trained LoRA matrices (what a checkpoint needs, beside the frozen base, to resume exactly)."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if ".lora_" in k}


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters that train (under LoRA the adapters): load_state_dict(..., strict=False) puts
    them back (sft_baseline.py keeps the lowest-test-loss ones)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def apply_levers(models, rank: int, alpha: float, grad_checkpoint: bool, seed: int) -> None:
    """train.py's memory levers on each model (the policy, the critic's backbone): LoRA adapters of `rank`
    (0 = train every weight) with their random init seeded by `seed`, so that a run and its resumed copy
    agree, and activation checkpointing per decoder layer."""
    torch.manual_seed(seed)
    for model in models:
        if model is not None and rank:
            add_lora(model, rank, alpha)
        if model is not None and grad_checkpoint:
            kw = {"use_reentrant": False}
            # transformers 5.2x's name; there the old one warns that it goes in v6
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
