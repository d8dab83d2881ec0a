"""Models that are not transformers' for the pipeline tests: a nanoGPT-shaped GPT (in the
style of karpathy's nanoGPT: token and position embeddings, blocks of LayerNorm, causal
self-attention with a fused ``c_attn`` and an MLP, a head tied to the token embedding,
``forward(idx, targets)`` returning ``(logits, loss)``) and a language model over torch's
own ``nn.TransformerEncoder``; and a tiny GPT-Neo (transformers), whose blocks return
``(hidden_states, attn_weights)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806 - nanoGPT's names
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, transposed: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)
        self.transposed = transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:  # a (T, B, C) view in and out: not contiguous
            x = x.transpose(0, 1)
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x.transpose(0, 1) if self.transposed else x


class GPT(nn.Module):
    """nanoGPT's GPT, small. ``transposed``: the blocks take and return ``(T, B, C)``
    views (a non-contiguous activation crosses each cut)."""

    def __init__(self, vocab_size: int = 128, block_size: int = 32, n_layer: int = 4,
                 n_head: int = 2, n_embd: int = 32, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, transposed) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        if self.transposed:
            x = x.transpose(0, 1)
        for block in self.transformer.h:
            x = block(x)
        if self.transposed:
            x = x.transpose(0, 1)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss


def nano_gpt(transposed: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(transposed=transposed)


class EncoderLM(nn.Module):
    """A causal language model over ``nn.TransformerEncoder`` (torch's own layers)."""

    def __init__(self, vocab: int = 128, d: int = 32, heads: int = 2, layers: int = 4,
                 seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.size(1)
        x = self.encoder(self.embed(ids), mask=self.mask[:t, :t], is_causal=True)
        return self.head(x)


def encoder_lm() -> EncoderLM:
    torch.manual_seed(0)
    return EncoderLM()


def gpt_neo(n_layer: int = 4) -> transformers.GPTNeoForCausalLM:
    """transformers' GPT-Neo, sizes shrunk (global and local attention layers)."""
    torch.manual_seed(0)
    return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        num_layers=n_layer, hidden_size=32, num_heads=2, vocab_size=128,
        max_position_embeddings=64, attention_types=[[["global", "local"], n_layer // 2]],
        window_size=8, bos_token_id=0, eos_token_id=0))
