"""Character-level GPT on the Python help texts bundled with the standard library.

The corpus is ``pydoc_data.topics.topics`` (no download), concatenated in
sorted key order. The vocabulary is fixed to ASCII: codes 0..127, with every
non-ASCII character mapped to ``?``, so models do not depend on the data.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchmetrics import MeanMetric

from lightning_sync.models._common import (
    OPTIMIZERS,
    SplitDataModule,
    build_optimizer,
    check_choice,
    check_fraction,
    check_non_negative_float,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
    require_optimizer,
)

__all__ = ["CHAR_GPT_OPTIMIZERS", "VOCAB_SIZE", "CharDataModule", "CharGPT", "DeferredCharGPT", "decode", "encode"]
__all__ += ["load_corpus"]

#: Size of the fixed ASCII vocabulary.
VOCAB_SIZE = 128
_UNKNOWN = ord("?")
#: Optimizers :class:`CharGPT` accepts: its own AdamW (betas 0.9, 0.95), or any of :func:`build_optimizer`'s.
CHAR_GPT_OPTIMIZERS: tuple[str, ...] = ("adamw", *OPTIMIZERS)


@functools.lru_cache(maxsize=1)
def _full_corpus() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def load_corpus(max_chars: int | None = None) -> str:
    """Return the pydoc topics text (values in sorted key order), cut to ``max_chars`` if given."""
    text = _full_corpus()
    if max_chars is None:
        return text
    return text[: check_positive_int("max_chars", max_chars)]


def encode(text: str) -> Tensor:
    """Map ``text`` to a 1-D LongTensor of ASCII codes; non-ASCII characters become ``?`` (63)."""
    data = text.encode("ascii", errors="replace")
    return torch.tensor(list(data), dtype=torch.long)


def decode(ids: Tensor | Iterable[int]) -> str:
    """Map a 1-D sequence of codes in ``[0, VOCAB_SIZE)`` back to a string."""
    if isinstance(ids, Tensor):
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    codes = [int(i) for i in ids]
    bad = [i for i in codes if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}), got {bad[0]!r}")
    return "".join(map(chr, codes))


class _WindowDataset(Dataset):
    """Windows ``(x, y)`` starting every ``block_size`` tokens; ``y`` is ``x`` shifted by one."""

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(f"need at least block_size + 1 = {block_size + 1} tokens, got {len(tokens)}")
        self._tokens = tokens
        self._block_size = block_size

    def __len__(self) -> int:
        return (len(self._tokens) - 1) // self._block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range [0, {len(self)})")
        start = index * self._block_size
        chunk = self._tokens[start : start + self._block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(SplitDataModule):
    """LightningDataModule of next-character windows over the pydoc topics corpus.

    The first ``1 - val_fraction`` of the text is for training, the rest for
    validation. Each split is cut into windows that start every
    ``block_size`` characters; an item is ``(x, y)`` with ``y`` being ``x``
    shifted one character ahead.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        max_chars: int | None = None,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            block_size: characters per training window (>= 1).
            batch_size: per-process batch size (>= 1).
            val_fraction: share of the text (its tail) used for validation, in (0, 1).
            max_chars: if given (>= 1), keep only the first ``max_chars`` characters.
            num_workers: DataLoader worker processes (>= 0).
        """
        super().__init__(batch_size, num_workers)
        self._block_size = check_positive_int("block_size", block_size)
        self._val_fraction = check_fraction("val_fraction", val_fraction)
        if max_chars is not None:
            check_positive_int("max_chars", max_chars)
        self._max_chars = max_chars
        self.save_hyperparameters()

    @property
    def vocab_size(self) -> int:
        """Size of the (fixed, ASCII) vocabulary."""
        return VOCAB_SIZE

    def _build_datasets(self) -> tuple[Dataset, Dataset]:
        tokens = encode(load_corpus(self._max_chars))
        n_train = int(len(tokens) * (1.0 - self._val_fraction))
        return (
            _WindowDataset(tokens[:n_train], self._block_size),
            _WindowDataset(tokens[n_train:], self._block_size),
        )


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then a 4x MLP, each residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self._n_head = n_head
        self._dropout = dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )
        self.resid_drop = nn.Dropout(dropout)

    def _attention(self, x: Tensor) -> Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time, self._n_head, channels // self._n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self._dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_drop(self.proj(y))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self._attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(pl.LightningModule):
    """Small decoder-only character transformer over the fixed 128-symbol ASCII vocabulary.

    Learned position embeddings, pre-LayerNorm blocks with causal
    ``scaled_dot_product_attention``, and (by default) an output head whose
    weight is the token-embedding matrix itself. Trained with AdamW by default
    (or LAMB, LARS, ... via ``optimizer``), with weight decay on matrices only.
    Logs ``train_loss``, ``val_loss`` and ``val_bpc`` (validation bits per
    character, ``val_loss / ln 2``).
    """

    def __init__(
        self,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        tie_weights: bool = True,
        optimizer: str = "adamw",
    ) -> None:
        """
        Args:
            block_size: longest context the model attends over (>= 1).
            n_layer: number of transformer blocks (>= 1).
            n_head: attention heads per block (>= 1, must divide ``n_embd``).
            n_embd: embedding width (>= 1).
            dropout: dropout probability in [0, 1).
            lr: learning rate (> 0).
            weight_decay: weight decay applied to matrices (>= 0).
            tie_weights: share one parameter between token embedding and output head.
            optimizer: one of :data:`CHAR_GPT_OPTIMIZERS`: ``"adamw"`` (betas 0.9, 0.95) or a
                :func:`~lightning_sync.models._common.build_optimizer` name (``"lamb"``, ``"lars"``, ...),
                over the same two param groups (decay on matrices, none on vectors).
        """
        super().__init__()
        check_positive_int("block_size", block_size)
        check_positive_int("n_layer", n_layer)
        check_positive_int("n_head", n_head)
        check_positive_int("n_embd", n_embd)
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd!r}) must be divisible by n_head ({n_head!r})")
        check_fraction("dropout", dropout, allow_zero=True)
        self._lr = check_positive_float("lr", lr)
        self._weight_decay = check_non_negative_float("weight_decay", weight_decay)
        if not isinstance(tie_weights, bool):
            raise ValueError(f"tie_weights must be True or False, got {tie_weights!r}")
        self._optimizer_name = check_choice("optimizer", optimizer, CHAR_GPT_OPTIMIZERS)
        require_optimizer(self._optimizer_name)
        self.save_hyperparameters()
        self._block_size = block_size
        # synced as (weighted sum, weight): the mean over every validation token, however the ranks' shares differ
        self.val_loss = MeanMetric()
        self.val_bpc = MeanMetric()

        if not self._layers_in_configure_model:
            self._build_layers()

    #: :class:`DeferredCharGPT` sets this: the layers are created in ``configure_model`` instead of ``__init__``.
    _layers_in_configure_model = False

    def _build_layers(self) -> None:
        hp = self.hparams
        self.tok_emb = nn.Embedding(VOCAB_SIZE, hp.n_embd)
        self.pos_emb = nn.Embedding(hp.block_size, hp.n_embd)
        self.drop = nn.Dropout(hp.dropout)
        self.blocks = nn.ModuleList(_Block(hp.n_embd, hp.n_head, hp.dropout) for _ in range(hp.n_layer))
        self.ln_f = nn.LayerNorm(hp.n_embd)
        self.head = nn.Linear(hp.n_embd, VOCAB_SIZE, bias=False)
        self.apply(self._init_weights)  # on the meta device a no-op: the layers' reset_parameters() initialize them
        if hp.tie_weights:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def block_size(self) -> int:
        """Longest context the model attends over."""
        return self._block_size

    def forward(self, idx: Tensor) -> Tensor:
        """Return next-token logits ``(batch, time, VOCAB_SIZE)`` for ``(batch, time)`` ids."""
        time = idx.shape[1]
        if time > self._block_size:
            raise ValueError(f"sequence length {time} exceeds block_size {self._block_size}")
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        tokens = batch[1].numel()
        self.val_loss.update(loss, weight=tokens)
        self.val_bpc.update(loss / math.log(2), weight=tokens)
        self.log("val_loss", self.val_loss, on_epoch=True)
        self.log("val_bpc", self.val_bpc, prog_bar=True, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.parameters())  # deduplicated, so a tied weight appears once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self._weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if self._optimizer_name == "adamw":
            return torch.optim.AdamW(groups, lr=self._lr, betas=(0.9, 0.95))
        return build_optimizer(groups, self._optimizer_name, self._lr, self._weight_decay)

    @torch.no_grad()
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> str:
        """Sample a continuation of ``prompt``; return only the ``max_new_tokens`` new characters.

        Runs in eval mode without gradients (the previous mode is restored);
        the context is cropped to the last ``block_size`` characters. With
        ``seed`` the result is reproducible.

        Args:
            prompt: non-empty text to continue (non-ASCII characters read as ``?``).
            max_new_tokens: number of characters to sample (>= 0).
            temperature: softmax temperature (> 0).
            top_k: if given (>= 1), sample only among the ``top_k`` likeliest characters.
            seed: seed of the sampling generator; ``None`` uses the global RNG.
        """
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt must be a non-empty str, got {prompt!r}")
        check_non_negative_int("max_new_tokens", max_new_tokens)
        check_positive_float("temperature", temperature)
        if top_k is not None:
            check_positive_int("top_k", top_k)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            idx = encode(prompt).to(self.device).unsqueeze(0)
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self._block_size :])[:, -1, :] / temperature
                if top_k is not None and top_k < VOCAB_SIZE:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
                idx = torch.cat([idx, next_id], dim=1)
        finally:
            self.train(was_training)
        return decode(idx[0, idx.shape[1] - max_new_tokens :])


class DeferredCharGPT(CharGPT):
    """:class:`CharGPT` whose layers are created in ``configure_model()``, Lightning's route to a strategy's deferred
    initialization: ``ShardedStrategy(stage=3)`` and the FSDP2 baseline run it on the meta device and each rank
    materializes only its shards; DDP runs it with storage, as ``__init__`` would. The metrics stay in ``__init__``
    with real storage (a torchmetrics state built on the meta device has no values to restore). Same arguments,
    parameters and forward as :class:`CharGPT`; built deferred, the layers get their own ``reset_parameters()``
    initialization instead of :class:`CharGPT`'s normal(0, 0.02). Calling ``configure_model()`` before ``fit``
    builds the layers eagerly; a second call (Lightning calls it in every fit) changes nothing."""

    _layers_in_configure_model = True

    def configure_model(self) -> None:
        if not hasattr(self, "blocks"):
            self._build_layers()
