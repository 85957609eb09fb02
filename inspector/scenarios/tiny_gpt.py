"""``tiny_gpt``: a 4-layer byte-level GPT (about 3.3M parameters) trained on a shipped text file."""

from __future__ import annotations

import functools
import importlib.resources
import math

import torch
from torch import nn
from torch.nn import functional as F

from .base import Scenario

__all__ = ["TinyGPT", "GPT", "load_corpus", "CORPUS_RESOURCE"]

# Located with importlib.resources, so it is found from a checkout and from an installed wheel
# (pyproject ships inspector/data/*.txt as package data).
CORPUS_RESOURCE = "data/tiny_corpus.txt"


@functools.lru_cache(maxsize=1)
def load_corpus() -> torch.Tensor:
    """The shipped corpus as a 1-D ``uint8`` tensor of its bytes (read once, then cached)."""
    data = importlib.resources.files("inspector").joinpath(CORPUS_RESOURCE).read_bytes()
    # bytearray: torch.frombuffer warns about read-only buffers such as bytes.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        assert d_model % n_head == 0, f"d_model {d_model} is not a multiple of n_head {n_head}"
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # (batch, time, d_model)
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (
            t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLPBlock(nn.Module):
    """Position-wise feed-forward: Linear(d, 4d) -> GELU -> Linear(4d, d)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLPBlock(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-shaped decoder over bytes: token and position embeddings, blocks, LayerNorm, head.

    With the defaults (vocab 256, context 128, d_model 256, 4 layers, 4 heads) it has
    3,323,392 parameters in 53 tensors: 2 embeddings, 12 per block (two LayerNorms and four
    Linears, each with a bias), the final LayerNorm's 2 and the head's weight. The head is
    a separate bias-free Linear (not tied to the token embedding), so that the embedding and
    the output layer show up as two parameters with their own gradients.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        block_size: int = 128,
        d_model: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.n_layer = n_layer
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, residual projections scaled
        down by sqrt(2 * n_layer) so that the residual stream's variance does not grow with depth."""
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_f."):
                nn.init.ones_(p)  # LayerNorm weights
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.n_layer))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for byte ids ``idx`` of shape ``(B, T)``, ``T <= block_size``."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, d_model)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab_size)


class TinyGPT(Scenario):
    """A 4-layer byte-level GPT (d_model 256, 4 heads, context 128) learning the shipped corpus.

    Batches are 16 random windows of 129 bytes of ``inspector/data/tiny_corpus.txt``
    (inputs: the first 128, targets: the last 128), accumulated over 4 micro-batches of 4
    windows (four forward and backward passes per step, as a larger model would be trained;
    it gives the gradient noise scale its two batch sizes, 4 and 16); the loss is the mean
    next-byte cross entropy, which starts near ln 256 = 5.5. AdamW, lr 1e-3, betas (0.9, 0.95), weight
    decay 0.1 on the matrices only (embeddings and Linear weights; not on biases or
    LayerNorm), no schedule. One step takes about a second of CPU time on one core (about 40 GFLOP).
    Parameters: ``tok_emb.weight``, ``pos_emb.weight``, ``blocks.{0-3}.{ln1,attn.qkv,attn.proj,
    ln2,mlp.fc,mlp.proj}.{weight,bias}``, ``ln_f.{weight,bias}``, ``head.weight``.
    """

    name = "tiny_gpt"
    description = (
        "A 4-layer byte-level GPT (3.3M parameters in 53 tensors) trained with AdamW on a small "
        "English text, 4 micro-batches accumulated per step; a realistic model to watch, nothing is broken on purpose."
    )
    try_this = (
        "Add freeze on blocks.0.* and watch that block's update ratio drop to zero while the loss "
        "keeps falling (a scale of 0 would not do this: AdamW's momentum and weight decay still move it)."
    )

    block_size = 128
    batch_size = 16
    micro_batches = 4  # gradient accumulation: 4 backward passes of 4 windows per step
    # a checkpoint holds the weights and AdamW's two moments, about 40 MB: every 25 steps, 3 kept
    checkpoint_every = 25
    checkpoints = 3
    lr = 1e-3

    def build_model(self) -> nn.Module:
        return GPT(block_size=self.block_size)

    def init_parameters(self, model: nn.Module) -> None:
        assert isinstance(model, GPT)
        model.init_weights()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))

    def setup_data(self, gen: torch.Generator) -> None:
        self._data = load_corpus()
        if self._data.numel() <= self.block_size + 1:
            raise ValueError(
                f"the corpus has {self._data.numel()} bytes, fewer than a window of {self.block_size + 1}"
            )
        self._window = torch.arange(self.block_size + 1)

    def next_batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(self._data.numel() - self.block_size, (self.batch_size, 1), generator=gen)
        chunk = self._data[starts + self._window].long()  # (B, T + 1)
        return chunk[:, :-1], chunk[:, 1:]

    def compute_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
