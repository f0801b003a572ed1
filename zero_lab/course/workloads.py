"""Demo models, synthetic data and the measured training loop that worker scripts share.

Models:
- `deep_mlp(d, depth)`: the seed blog's model, `depth` blocks of Linear(d, d) + ReLU. The
  blog used d = 10000 and depth 6: 6 x (10000² + 10000) = 600,060,000 parameters (it calls
  them "2.3B"); the default here is small enough for a CPU.
- `TinyGPT`: a small GPT-style transformer (token and position embeddings, pre-LayerNorm
  attention blocks, a final LayerNorm and an output head tied to the token embedding).
- `GPTLayer`: one transformer layer written out op by op, as Korthikanti et al. count its
  activations (notebooks 01 and 07 measure what autograd saves against their formula).

Data: every step has one *global* batch, generated from (seed, step) so every rank and a
single-process reference see the same numbers; `rank_slice` gives each rank its rows. With
equal slices, the average of the ranks' mean losses is the mean loss of the global batch,
so data-parallel training must match one process training on the global batch.

`train()` runs the ordinary loop and measures it (bytes held and peak: `zero_lab.measure.memory`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zero_lab.measure.memory import PeakMemory, held_bytes

# ------------------------------------------------------------------------------ models


def deep_mlp(d: int = 256, depth: int = 6, bias: bool = True) -> nn.Sequential:
    """`depth` x (Linear(d, d) + ReLU) in one nn.Sequential, as in the seed blog."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(d, d, bias=bias), nn.ReLU()]
    return nn.Sequential(*layers)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, bias: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, bias: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_heads, bias)
        self.ln2 = nn.LayerNorm(d_model, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=bias), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT: tokens (B, T) -> logits (B, T, vocab). The head shares the token
    embedding's weight (one nn.Parameter used by two modules: a tied weight).

    `bias=False` drops the biases of Linear and LayerNorm layers (as nanoGPT allows). The
    key projection's bias gets a zero gradient in exact arithmetic (softmax ignores a shift
    shared by a whole row), so with bias=True it is driven by rounding noise alone, which
    Adam amplifies to full-size steps: equivalence tests use bias=False.
    """

    def __init__(self, vocab_size: int = 64, seq_len: int = 16, d_model: int = 32,
                 n_heads: int = 2, n_layers: int = 2, bias: bool = True) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, bias) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the head use the token embedding's weight (one Parameter, two modules).

        Call it again after `to_empty()`: that gives every parameter its own storage, so a
        model built on the meta device comes back with an untied head and Ψ grown by
        vocab x d_model."""
        self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTLayer(nn.Module):
    """A pre-LN GPT layer on [s, b, h] inputs: attention and a 4h MLP, dropout after the
    softmax, the projection and the MLP. Attention is written out (no fused kernel) so the
    tensors autograd keeps are the ones Korthikanti et al. (2022, section 4) count:
    `memory.activation_bytes_per_layer`. TinyGPT uses PyTorch's fused attention instead,
    which keeps no s x s matrix."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        a, d = self.heads, h // self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(s, b, a, d).permute(1, 2, 0, 3).contiguous() for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * d**-0.5
        attn = F.dropout(scores.softmax(-1), self.dropout, self.training)
        context = (attn @ v).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + F.dropout(self.proj(context), self.dropout, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + F.dropout(mlp, self.dropout, self.training)


class SometimesMLP(nn.Module):
    """A trunk and a head; a `spare` layer no forward uses; a `sometimes` layer, scaled by a
    0-d `gate`, used only when `forward(x, use=True)`: parameters that get no gradient in
    some steps, which one process leaves alone (`.grad` None, no optimizer step)."""

    def __init__(self, d_in: int = 7, d: int = 9, d_out: int = 3) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d_in, d), nn.Tanh())
        self.sometimes = nn.Linear(d, d)
        self.spare = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.tensor(0.3))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor, use: bool = True) -> torch.Tensor:
        h = self.trunk(x)
        if use:
            h = h + self.gate * torch.tanh(self.sometimes(h))
        return self.head(h)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Ψ: elements of the model's distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# ------------------------------------------------------------------------------ data


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * seed + step)


def mlp_batch(step: int, batch_size: int, d: int, seed: int = 0,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step` for the MLP: random inputs and regression targets (B, d)."""
    gen = _generator(seed, step)
    x = torch.randn(batch_size, d, generator=gen)
    y = torch.randn(batch_size, d, generator=gen)
    return x.to(device), y.to(device)


def gpt_batch(step: int, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step` for TinyGPT: random tokens and next-token targets (B, T)."""
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=_generator(seed, step))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world_size: int
               ) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s rows of a global batch (equal slices; the batch must divide by N)."""
    rows = batch[0].shape[0]
    if rows % world_size:
        raise ValueError(f"global batch of {rows} rows does not split evenly over "
                         f"{world_size} ranks; use a multiple of {world_size}")
    per_rank = rows // world_size
    return tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in batch)


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ------------------------------------------------------------------------------ training


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    model: nn.Module,
    optimizer: object,
    batches: Callable[[int], tuple[torch.Tensor, ...]],
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor] = mse_loss,
    steps: int = 10,
    accumulation: int = 1,
    clip: float | None = None,
    measure_memory: bool = True,
    device: torch.device | str = "cpu",
) -> dict:
    """Train `steps` steps of the ordinary loop and measure them (on this rank).

    `batches(step)` returns this rank's batch of `step` (e.g. `rank_slice(mlp_batch(...))`).
    With `accumulation = k` each step runs k forward/backward passes on k equal parts of it,
    each loss divided by k, before one optimizer step; `clip` clips the global gradient norm.
    Returns a JSON-ready dict: per-step "losses" (this rank's, averaged over micro-batches),
    "grad_norms" (when clipping), "step_times" (seconds; the memory-tracked last step is
    left out), "held_after_backward" and "held_after_step" (`measure.memory.held_bytes` on the
    last step) and "peak_bytes" (the last step's peak, `zero_lab.measure.memory.PeakMemory`).
    """
    device = torch.device(device)
    out: dict = {"losses": [], "grad_norms": [], "step_times": []}
    for step in range(steps):
        last = step == steps - 1
        tracked = measure_memory and last
        batch = batches(step)
        if batch[0].shape[0] % accumulation:
            raise ValueError(f"batch of {batch[0].shape[0]} rows cannot be split into "
                             f"{accumulation} equal micro-batches")
        parts = list(zip(*(t.chunk(accumulation) for t in batch), strict=True))
        peak = PeakMemory(device, baseline=_held_total(model, optimizer, batch)) \
            if tracked else None
        _synchronize(device)
        start = time.perf_counter()
        if peak is not None:
            peak.__enter__()
        loss_sum = 0.0
        for part in parts:
            loss = loss_fn(model, part) / accumulation
            loss.backward()
            loss_sum += loss.item()
        if tracked:
            out["held_after_backward"] = held_bytes(model, optimizer)
        if clip is not None:
            norm = optimizer.clip_grad_norm_(clip) if hasattr(optimizer, "clip_grad_norm_") \
                else torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            out["grad_norms"].append(float(norm))
        optimizer.step()
        if tracked:
            out["held_after_step"] = held_bytes(model, optimizer)
        optimizer.zero_grad()
        if peak is not None:
            peak.__exit__(None, None, None)
            out["peak_bytes"] = peak.peak_bytes
        _synchronize(device)
        if not tracked:
            out["step_times"].append(time.perf_counter() - start)
        out["losses"].append(loss_sum)
    out["final_loss"] = out["losses"][-1] if out["losses"] else math.nan
    return out


def _held_total(model: nn.Module, optimizer: object, batch: tuple[torch.Tensor, ...]) -> int:
    """What is alive when a step starts: model states plus the batch."""
    return held_bytes(model, optimizer)["total"] + sum(
        t.untyped_storage().nbytes() for t in batch)
