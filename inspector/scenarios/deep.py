"""``deep``: a 110-block Llama-shaped model (993 parameter tensors) in which one block, ``layers.71``,
goes unstable at step 60 while the other 990 tensors train quietly."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .base import WarmupSGD

__all__ = ["BAD_LAYER", "Deep", "Llama"]

BAD_LAYER = 71
"""The block whose attention projections carry the stiff penalty (``layers.71``)."""


class Attention(nn.Module):
    """Multi-head causal self-attention with separate bias-free q/k/v/o projections (no rotary
    embedding: the causal mask is the only sense of position)."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        assert d_model % n_head == 0, f"d_model {d_model} is not a multiple of n_head {n_head}"
        self.n_head = n_head
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            p(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """Llama's feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, bias-free."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A pre-RMSNorm decoder block: ``x + self_attn(input_layernorm(x))``, then
    ``x + mlp(post_attention_layernorm(x))``; 9 weight tensors, no biases."""

    def __init__(self, d_model: int, n_head: int, d_ff: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(d_model, eps=1e-6)
        self.self_attn = Attention(d_model, n_head)
        self.post_attention_layernorm = nn.RMSNorm(d_model, eps=1e-6)
        self.mlp = SwiGLU(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A Llama-shaped decoder: token embedding, ``n_layer`` blocks, final RMSNorm, untied head.

    Parameter names follow Hugging Face's ``LlamaModel`` without its ``model.`` prefix:
    ``embed_tokens.weight``, ``layers.{i}.input_layernorm.weight``,
    ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight``,
    ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``:
    ``9 * n_layer + 3`` tensors.
    """

    def __init__(self, *, vocab_size: int, d_model: int, n_layer: int, n_head: int, d_ff: int) -> None:
        super().__init__()
        self.n_layer = n_layer
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_head, d_ff) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d_model, eps=1e-6)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def init_weights(self) -> None:
        """Norm weights 1; the embedding N(0, 1); every projection N(0, 1 / fan_in), the residual
        ones (``o_proj``, ``down_proj``) further scaled by 1 / sqrt(2 * n_layer) so that the
        residual stream's variance does not grow with depth."""
        residual_scale = 1.0 / math.sqrt(2 * self.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.startswith("embed_tokens."):
                nn.init.normal_(p, 0.0, 1.0)
            else:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= residual_scale
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``idx`` of shape ``(B, T)``."""
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class Deep(WarmupSGD):
    """A 110-block Llama-shaped decoder (d_model 16, 2 heads, SwiGLU width 32, vocabulary 32;
    286,160 parameters in 993 tensors) learning a synthetic token stream, plain SGD.

    The data: sequences of 17 tokens from a fixed random Markov chain over the 32 tokens (each
    row of its transition matrix a softmax of N(0, 3^2) logits, drawn from the data generator),
    8 a batch; inputs the first 16, targets the next token; the loss is the mean cross entropy
    (ln 32 = 3.47 at the start, about 1.6-2.0 by step 59). SGD without momentum, the learning
    rate rising linearly from 0.002 to ``peak_lr`` = 0.1 over ``warmup_steps`` = 50 steps (set
    on the optimizer before every step, so the dashboard shows it). A step takes about 70 ms on
    one CPU thread.

    What goes wrong, in one place: ``layers.71``'s q, k and v projections are initialised
    orthogonal and, from step ``penalty_from`` = 60, kept orthogonal by a soft penalty added to
    the loss, ``penalty_coef / 4 * ||W^T W - I||^2`` each (coefficient 20). That penalty is stiff:
    its curvature is about 2 * 20 = 40, and plain SGD is stable on it only while lr * 40 < 2, that
    is lr < 0.05. At lr 0.1 every step overshoots the orthogonal weights and the overshoot triples:
    those three gradients jump from about 0.003 to about 0.1 at step 60 and then grow about 3x a
    step, to about 50 by step 66 (a robust z-score of log10 norm against their own last 32 values
    of 10-30 at step 60 and 30-85 by step 66, seeds 0-3), while the other 990 tensors stay
    within their usual noise (|z| at most about 8 until a few steps before the NaN). The loss, which includes the penalty, climbs
    to about 100; for seeds 0, 2 and 3 it turns inf, then NaN, at steps 78-83 (the demo then
    resets the scenario after 30 non-finite steps, and it all happens again); for seed 1 it
    stays finite, at about 100-150, at least to step 100.

    Scaling ``layers.71.*``'s gradients by 0.25 is, under plain SGD, that block's learning rate
    times 0.25: lr * 40 = 1 < 2, the penalty settles (the three gradients jump once at step 60,
    then fall back to their level of before) and the loss keeps falling. A per-tensor
    ``clip_norm`` (max_norm 1.0) on the same target bounds the oscillation instead of ending it:
    training goes on, those gradients stay pinned at the clip.
    """

    name = "deep"
    description = (
        "A 110-block Llama-shaped model (993 parameter tensors) on synthetic tokens, plain SGD: at "
        "step 60 a stiff orthogonality penalty switches on for layers.71's q/k/v projections, SGD "
        "at lr 0.1 overshoots it every step, and those three gradients grow ~3x a step while the loss soars "
        "(to NaN for most seeds)."
    )
    try_this = (
        "Add scale (factor 0.25) on layers.71.* before step 60 (the worst-now list leads to that block; "
        "or rewind to before step 60): its learning rate is quartered, its q/k/v gradients rise once at "
        "step 60 and settle, and the loss keeps falling."
    )

    n_layer = 110
    d_model = 16
    n_head = 2
    d_ff = 32
    vocab_size = 32
    seq_len = 16
    batch_size = 8
    peak_lr = 0.1
    warmup_steps = 50
    penalty_coef = 20.0
    penalty_from = 60
    penalized = ("q_proj", "k_proj", "v_proj")
    # the demo checkpoints every 10 steps and keeps 8 (about 1.1 MB each): "rewind to before step
    # 60" finds the one of step 50 until step 120, and none is taken while the gradients are NaN
    checkpoint_every = 10
    checkpoints = 8
    hint_step = 60  # the demo pauses at step 55: time to find layers.71 and add the hook

    def build_model(self) -> nn.Module:
        return Llama(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_ff=self.d_ff,
        )

    def init_parameters(self, model: nn.Module) -> None:
        assert isinstance(model, Llama)
        model.init_weights()
        attn = model.layers[BAD_LAYER].self_attn
        for name in self.penalized:
            nn.init.orthogonal_(getattr(attn, name).weight)

    def setup_data(self, gen: torch.Generator) -> None:
        logits = torch.randn(self.vocab_size, self.vocab_size, generator=gen) * 3.0
        self._transitions = torch.softmax(logits, dim=1)

    def next_batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.seq_len + 1
        tokens = torch.empty(self.batch_size, n, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (self.batch_size,), generator=gen)
        for t in range(1, n):
            probs = self._transitions[tokens[:, t - 1]]
            tokens[:, t] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]

    def penalty(self) -> torch.Tensor | None:
        """The orthogonality penalty on ``layers.71``'s q/k/v projections; None before ``penalty_from``."""
        if self.step_under_way < self.penalty_from:
            return None
        attn = self.model.layers[BAD_LAYER].self_attn
        total = None
        for name in self.penalized:
            w = getattr(attn, name).weight
            eye = torch.eye(w.shape[1], device=w.device, dtype=w.dtype)
            term = ((w.T @ w - eye) ** 2).sum()
            total = term if total is None else total + term
        assert total is not None
        return self.penalty_coef / 4 * total

    def compute_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        extra = self.penalty()
        return loss if extra is None else loss + extra
