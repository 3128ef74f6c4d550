"""Model and training configurations, and the named presets ``tiny``, ``small`` and ``long8k``."""
from __future__ import annotations

import dataclasses
import math

ATTENTIONS = ("flash", "flash_triton", "flash_mosaic", "xla", "cudnn")
POSITIONS = ("learned", "rotary")
DTYPES = ("bfloat16", "float32")
CONTEXT_STRATEGIES = ("ring", "all_to_all", "all_gather")

# GPT-2's 50257-token vocabulary padded to a multiple of 64 (as nanoGPT does) so the embedding
# matmuls tile evenly. The data are bytes (ids < 256); the GPU presets keep GPT-2's vocabulary so
# their parameter count and FLOPs match the models of the FlashAttention-2 paper.
GPT2_VOCAB = 50304
BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape and numerics of the model.

  Attributes:
    vocab_size: output classes (256 for byte-level text).
    seq_len: context length (also the size of the learned position table).
    n_layer: transformer blocks.
    n_head: query heads.
    n_kv_head: key/value heads (None: n_head; smaller: grouped-query attention).
    n_embd: model width; head_dim = n_embd // n_head.
    mlp_ratio: MLP hidden width = mlp_ratio * n_embd.
    position: "learned" absolute embeddings or "rotary" (RoPE on q and k).
    tie_embeddings: the output layer reuses the token embedding matrix.
    dtype: compute dtype ("bfloat16" or "float32"); parameters stay float32.
    attention: "flash" (fa2_jax.flash_attention, default backend), "flash_triton" / "flash_mosaic"
      (one fa2_jax backend forced), "xla" or "cudnn" (jax.nn.dot_product_attention).
    flash_interpret: run the fa2_jax Pallas kernels in interpret mode (CPU tests of the kernel).
    remat: recompute each block's activations in the backward pass (saves memory at long seq).
    scan_layers: run the blocks with ``flax.linen.scan`` (parameters stacked on a leading layer axis):
      one traced and compiled block instead of ``n_layer``, so compile time does not grow with depth.
    window: sliding-window attention: each token attends itself and the ``window`` tokens before it
      (``local_window_size=(window, 0)`` with the causal mask); None: the whole context.
    soft_cap: attention logits soft cap, ``cap * tanh(s / cap)`` (``logits_soft_cap``); None: none.
    context_strategy: how the attention exchanges the sequence over a mesh's ``context`` axis
      (``--mesh``): "ring", "all_to_all" or "all_gather" (``fa2_jax.context_parallel_attention``'s
      strategies); None: fa2_jax's choice (``fa2_jax.context_parallel_strategy``).
  """

  vocab_size: int = BYTE_VOCAB
  seq_len: int = 256
  n_layer: int = 4
  n_head: int = 4
  n_kv_head: int | None = None
  n_embd: int = 256
  mlp_ratio: int = 4
  position: str = "learned"
  tie_embeddings: bool = True
  dtype: str = "bfloat16"
  attention: str = "flash"
  flash_interpret: bool = False
  remat: bool = False
  scan_layers: bool = False
  window: int | None = None
  soft_cap: float | None = None
  context_strategy: str | None = None

  def __post_init__(self):
    for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "mlp_ratio"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for name in ("tie_embeddings", "flash_interpret", "remat", "scan_layers"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.n_kv_head is not None and self.n_kv_head < 1:
      raise ValueError(f"n_kv_head must be >= 1 (unset: n_head), got {self.n_kv_head}")
    if self.n_embd % self.n_head:
      raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
    if self.n_head % self.kv_heads:
      raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.kv_heads})")
    if self.position not in POSITIONS:
      raise ValueError(f"position must be one of {POSITIONS}, got {self.position!r}")
    if self.position == "rotary" and (self.n_embd // self.n_head) % 2:
      raise ValueError(f"position 'rotary' needs an even head_dim (n_embd / n_head), got "
                       f"{self.n_embd} / {self.n_head} = {self.n_embd // self.n_head}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
    if self.context_strategy is not None and self.context_strategy not in CONTEXT_STRATEGIES:
      raise ValueError(f"context_strategy must be one of {CONTEXT_STRATEGIES} or None (fa2_jax's "
                       f"choice), got {self.context_strategy!r}")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
    if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                    or self.window < 0):
      raise ValueError(f"window must be an int >= 0 (unset: the whole context), got "
                       f"{self.window!r}")
    if self.soft_cap is not None and not (isinstance(self.soft_cap, (int, float))
                                          and math.isfinite(self.soft_cap) and self.soft_cap > 0):
      raise ValueError(f"soft_cap must be a finite number > 0 (unset: no cap), got "
                       f"{self.soft_cap!r}")

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head

  @property
  def kv_heads(self) -> int:
    return self.n_kv_head or self.n_head


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation, data and bookkeeping.

  Attributes:
    batch_size: global batch in sequences (split across devices with --data-parallel pmap or mesh).
    steps: optimizer steps.
    lr: peak learning rate (after linear warm-up, then cosine decay to lr * min_lr_ratio).
    warmup_steps: linear warm-up length.
    min_lr_ratio: final learning rate as a fraction of lr.
    weight_decay: AdamW decoupled weight decay, on matrices only (not biases or LayerNorm).
    beta1, beta2: AdamW moments.
    grad_clip: global-norm gradient clipping threshold.
    eval_every: steps between validation losses (0: only at the end).
    eval_batches: batches averaged per validation loss.
    log_every: steps between progress updates (bar or log line; each one waits for the device).
    ckpt_every: steps between checkpoints when --ckpt-dir is given (0: only at the end).
    seed: parameter initialisation and data sampling seed (>= 0: numpy seeds the batches with it).
    data_bytes: cap on the bytes of text read (the corpus is split 90/10 into train/val).
    packing: each file of the corpus is a document; the windows over their concatenation carry
      per-token segment ids (no attention across documents), positions restarting at 0 at each
      document, and leave the targets in the next document out of the loss (data.py).
  """

  batch_size: int = 32
  steps: int = 500
  lr: float = 3e-3
  warmup_steps: int = 50
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  beta1: float = 0.9
  beta2: float = 0.95
  grad_clip: float = 1.0
  eval_every: int = 100
  eval_batches: int = 8
  log_every: int = 10
  ckpt_every: int = 0
  seed: int = 0
  data_bytes: int = 32 * 2**20
  packing: bool = False

  def __post_init__(self):
    for name in ("batch_size", "steps", "eval_batches", "log_every", "data_bytes"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for name in ("warmup_steps", "eval_every", "ckpt_every"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    for name in ("weight_decay", "grad_clip"):  # NaN fails every comparison: test finiteness too
      if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
    if self.seed < 0:
      raise ValueError(f"seed must be >= 0, got {self.seed}")
    if not isinstance(self.packing, bool):
      raise TypeError(f"packing must be a bool, got {self.packing!r}")
    if not (math.isfinite(self.lr) and self.lr > 0):
      raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
    if not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
    for name in ("beta1", "beta2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


# tiny: a few minutes on 2 CPU cores (float32: XLA:CPU has no fast bfloat16 matmuls).
# small: GPT-2 small (12 x 768, 12 heads, ~124M parameters with GPT-2's vocabulary), seq 1024.
# long8k: GPT-2 medium-like (24 x 1024, head_dim 128, ~362M parameters) at seq 8192, in the spirit
#   of the FlashAttention-2 paper's end-to-end training table (Table 1); fits one H200 (141 GB).
PRESETS: dict[str, tuple[GPTConfig, TrainConfig]] = {
    "tiny": (
        GPTConfig(seq_len=128, n_layer=4, n_head=4, n_embd=128, dtype="float32"),
        TrainConfig(batch_size=16, steps=600, lr=3e-3, warmup_steps=40, eval_every=150,
                    eval_batches=8, data_bytes=8 * 2**20),
    ),
    "small": (
        GPTConfig(vocab_size=GPT2_VOCAB, seq_len=1024, n_layer=12, n_head=12, n_embd=768),
        TrainConfig(batch_size=32, steps=2000, lr=6e-4, warmup_steps=200, eval_every=250,
                    eval_batches=16, log_every=20),
    ),
    "long8k": (
        GPTConfig(vocab_size=GPT2_VOCAB, seq_len=8192, n_layer=24, n_head=8, n_embd=1024),
        TrainConfig(batch_size=4, steps=500, lr=3e-4, warmup_steps=50, eval_every=250,
                    eval_batches=4, log_every=10),
    ),
}


def get_preset(name: str) -> tuple[GPTConfig, TrainConfig]:
  """The (model, train) configs of a preset; ValueError names the known ones."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name]
