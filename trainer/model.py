"""A small GPT (GPT-2's architecture at a toy size): byte-level tokens, pre-LayerNorm blocks, tied
embedding. :class:`ModelConfig` fixes the weights' shapes; every checkpoint stores it, so a resumed
run rebuilds the same model whatever flags it was launched with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class ModelConfig:
    """The architecture: plain numbers, so it round-trips through a checkpoint as a dict.

    Raises:
        ValueError: a field is out of range, or ``n_embd`` is not a multiple of ``n_head``.
    """

    vocab_size: int = 256  # byte-level: one token per byte, no tokenizer to ship
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} should be an integer >= 1, but got {name}={value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd must be a multiple of n_head, but got n_embd={self.n_embd}, n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout should be in [0, 1), but got dropout={self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head attention where each position sees only itself and earlier positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads): attention runs per head.
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        # The fused kernel (flash attention on CUDA) applies the causal mask itself.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward layer, 4x wide as in GPT-2."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm residual block: normalizing the input of each branch keeps deep stacks stable."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model over bytes.

    Example:
        >>> model = GPT(ModelConfig(n_layer=2, n_embd=64))
        >>> logits, loss = model(x, targets=y)  # x, y: (batch, time) int64
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the output layer reuses the token embedding (fewer parameters, and it
        # trains better at small sizes).
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer), so the residual stream's
        # variance does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Number of parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay: float) -> list[dict[str, object]]:
        """AdamW groups: decay only the matrices of linear layers.

        Decaying norms and biases pulls them towards 0 for no benefit, and decaying the embedding
        shrinks rare tokens' vectors just because they are rarely updated.
        """
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        decay, no_decay = [], []
        for param in self.parameters():
            (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy when ``targets`` are given.

        Raises:
            ValueError: the sequence is longer than ``block_size``.
        """
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size {self.config.block_size}")
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss
