"""Sample from the example GPT with a KV cache: prefill the prompts once, then one token per step.

    python -m examples.flax_gpt.generate --ckpt-dir DIR --prompt "def fibonacci(n):" [--tokens N]
        [--temperature T] [--top-k K] [--seed S]

The checkpoint is one that ``python -m examples.flax_gpt.train --ckpt-dir DIR`` wrote; give the model
flags it was trained with (``--preset`` and the overrides), as for ``--resume``. ``--prompt`` may be
repeated: the prompts are generated together as one batch.

How it runs (:func:`generate_ids`): the prompts, left-aligned in a ``[batch, seq_len]`` window with
their own lengths, go through the model once (the prefill), which fills one ``fa2_jax.KVCache`` per
layer; then a ``lax.scan`` runs one compiled decode step per token: each row's newest token at its own
position, its keys and values appended to the caches, its query attending them through
``fa2_jax.flash_attention`` (``KVCache.attend``). The model's parameters are the training model's (the
same ``GPT`` module, called with ``cache=``). Greedy output (temperature 0) is token for token the
uncached sampler's (``train.generate``) while the text fits the context (``seq_len``); there the
uncached sampler slides its window by one token per step, and this one, when a row's cache is full,
refills it from the row's last ``keep`` tokens (one prefill per ``seq_len - keep + 1`` tokens;
``keep = seq_len`` is exactly the sliding window, one prefill per token).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import fa2_jax

from . import data as data_lib
from .cli import _OVERRIDES, add_model_flags, cli_message, describe_configs, flag_names
from .config import PRESETS, GPTConfig, get_preset
from .model import FLASH_IMPLEMENTATIONS, GPT, attention_core, count_params, init_cache

PROG = "python -m examples.flax_gpt.generate"
DEFAULT_PROMPT = "def fibonacci(n):\n"  # train.py's sample prompt for the default data


@dataclasses.dataclass(frozen=True)
class Generated:
  """The tokens :func:`generate_ids` sampled and how long it took.

  Attributes:
    tokens: int32 ``[batch, n_tokens]``, the new tokens of each prompt.
    prefill_s: seconds of the prefill (the prompts through the model once).
    decode_s: seconds of the ``n_tokens`` decode steps (every row advances one token per step).
    compile_s: seconds spent compiling the prefill and the decode loop, and the prefill's first
      run (0 when an earlier call compiled them).
  """

  tokens: np.ndarray
  prefill_s: float
  decode_s: float
  compile_s: float

  @property
  def ms_per_token(self) -> float:
    """Milliseconds per decode step (one token of every row)."""
    return 1e3 * self.decode_s / max(self.tokens.shape[1], 1)

  @property
  def tokens_per_s(self) -> float:
    """New tokens per second over the decode steps, every row counted."""
    return self.tokens.size / self.decode_s if self.decode_s else float("nan")


def _sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
  """Next tokens ``[B]`` from logits ``[B, vocab]``: the argmax at temperature 0, else a sample of
  ``softmax(logits / temperature)`` over the ``top_k`` most likely tokens (all with None); the
  draw is ``train.generate``'s (``jax.random.categorical`` with the step's key)."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def _cache_lengths(config: GPTConfig, cache) -> jax.Array:
  return cache.lengths[0] if config.scan_layers else cache[0].lengths


def _select_rows(config: GPTConfig, rows: jax.Array, new, old):
  """``new`` where ``rows`` [B] is True, else ``old``, leaf by leaf (caches: batch axis 0, or 1
  when stacked over layers)."""
  axis = 1 if config.scan_layers else 0

  def pick(a, b):
    shape = [1] * a.ndim
    shape[axis] = rows.shape[0]
    return jnp.where(rows.reshape(shape), a, b)
  return jax.tree.map(pick, new, old)


def _fill(model: GPT, params, window: jax.Array, lengths: jax.Array):
  """The caches of the first ``lengths[b]`` tokens of each row of ``window`` ``[B, seq_len]``."""
  c = model.config
  _, cache = model.apply({"params": params}, window, cache=init_cache(c, window.shape[0]),
                         lengths=lengths)
  return cache


@functools.lru_cache(maxsize=8)
def _programs(model: GPT, batch: int, n_tokens: int, temperature: float, top_k: int | None,
              keep: int):
  """The compiled prefill and decode loop of one setting, and the seconds compiling them took."""
  c, width = model.config, model.config.seq_len

  def prefill(params, window, lengths, key):
    """The caches of each prompt but its last token, which is the first decode step's input."""
    cache = _fill(model, params, window, lengths - 1)
    pending = window[jnp.arange(batch), lengths - 1]
    return {"cache": cache, "pending": pending, "window": window, "key": key}

  def refill(params, cache, window, full):
    """Rows whose cache is full start again from their last ``keep - 1`` tokens (the pending one
    makes ``keep``)."""
    shift = width - (keep - 1)
    kept = jnp.concatenate([window[:, shift:], jnp.zeros((batch, shift), window.dtype)], axis=1)
    fresh = _fill(model, params, kept, jnp.full((batch,), keep - 1, jnp.int32))
    return _select_rows(c, full, fresh, cache), jnp.where(full[:, None], kept, window)

  def step(params, state, _):
    cache, window = state["cache"], state["window"]
    full = _cache_lengths(c, cache) >= width
    cache, window = jax.lax.cond(full.any(), functools.partial(refill, params),
                                 lambda cache, window, full: (cache, window), cache, window, full)
    held = _cache_lengths(c, cache)
    window = window.at[jnp.arange(batch), held].set(state["pending"], mode="drop")
    logits, cache = model.apply({"params": params}, state["pending"][:, None], cache=cache)
    key, sub = jax.random.split(state["key"])
    token = _sample(logits[:, 0], sub, temperature, top_k)
    return {"cache": cache, "pending": token, "window": window, "key": key}, token

  def decode(params, state):
    state, tokens = jax.lax.scan(functools.partial(step, params), state, length=n_tokens)
    return tokens.T, state

  t0 = time.perf_counter()
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                             jnp.zeros((1, width), jnp.int32))["params"])
  window = jax.ShapeDtypeStruct((batch, width), jnp.int32)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  prefill_c = jax.jit(prefill).lower(params, window, lengths, key).compile()
  state = jax.eval_shape(prefill, params, window, lengths, key)
  decode_c = jax.jit(decode, donate_argnums=1).lower(params, state).compile()
  return prefill_c, decode_c, time.perf_counter() - t0


def check_settings(config: GPTConfig, n_tokens: int, temperature: float, top_k: int | None,
                   keep: int | None) -> int:
  """Checks the sampling settings (ValueError naming the argument); returns ``keep`` (default
  ``seq_len // 2``, at least 1)."""
  if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
    raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
  if not temperature >= 0:  # NaN too
    raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
  if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                            or top_k < 1):
    raise ValueError(f"top_k must be an int >= 1 (None: every token), got {top_k!r}")
  keep = max(config.seq_len // 2, 1) if keep is None else keep
  if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or not 1 <= keep <= config.seq_len:
    raise ValueError(f"keep must be an int in [1, seq_len={config.seq_len}], got {keep!r}")
  return int(keep)


def generate_ids(model: GPT, params, prompts: Sequence[Sequence[int]], n_tokens: int, *,
                 temperature: float = 0.8, top_k: int | None = None, seed: int = 0,
                 keep: int | None = None) -> Generated:
  """Continues each prompt (byte ids) by ``n_tokens`` tokens with the KV cache, all prompts in one
  batch.

  Args:
    model, params: the GPT and its parameters (a training checkpoint's ``params``).
    prompts: one sequence of token ids per batch row, each of length >= 1 (a longer one than
      ``seq_len`` keeps its last ``seq_len`` tokens, as ``train.generate`` does).
    n_tokens: new tokens per prompt.
    temperature: 0 is greedy (the argmax, token for token ``train.generate``'s within the
      context), else sampling from ``softmax(logits / temperature)``.
    top_k: sample among the ``top_k`` most likely tokens only (None: all).
    seed: the sampling key's seed (``jax.random.PRNGKey(seed)``, split once per step as
      ``train.generate`` does: a batch of one samples the same tokens).
    keep: tokens a full row keeps when its cache is refilled (default ``seq_len // 2``): see the
      module docstring.

  Returns:
    :class:`Generated`: the tokens and the prefill, decode and compile times.

  Raises:
    ValueError: an empty prompt or batch, or a bad setting (named).
  """
  keep = check_settings(model.config, n_tokens, temperature, top_k, keep)
  if len(prompts) == 0:
    raise ValueError("prompts must hold at least one prompt")
  width, batch = model.config.seq_len, len(prompts)
  window = np.zeros((batch, width), np.int32)
  lengths = np.zeros((batch,), np.int32)
  for row, ids in enumerate(prompts):
    ids = np.asarray(ids, np.int32).reshape(-1)[-width:]
    if ids.size == 0:
      raise ValueError(f"prompt {row} is empty: give at least one token")
    window[row, :ids.size], lengths[row] = ids, ids.size
  if n_tokens == 0:
    return Generated(np.zeros((batch, 0), np.int32), 0.0, 0.0, 0.0)
  params = jax.device_put(params)  # host arrays (a checkpoint's) once, not at every call
  hits = _programs.cache_info().hits
  prefill, decode, compile_s = _programs(model, batch, int(n_tokens), float(temperature),
                                         None if top_k is None else int(top_k), keep)
  if _programs.cache_info().hits > hits:  # compiled by an earlier call
    compile_s = 0.0
  else:  # a new program's first run pays one-time costs (~0.1 s on CPU): count them as compiling
    t0 = time.perf_counter()
    jax.block_until_ready(prefill(params, window, lengths, jax.random.PRNGKey(seed)))
    compile_s += time.perf_counter() - t0
  t0 = time.perf_counter()
  state = prefill(params, window, lengths, jax.random.PRNGKey(seed))
  jax.block_until_ready(state)
  t1 = time.perf_counter()
  tokens, state = decode(params, state)
  tokens = np.asarray(tokens)  # waits for the device
  t2 = time.perf_counter()
  return Generated(tokens, t1 - t0, t2 - t1, compile_s)


def generate(model: GPT, params, prompt: str | Sequence[str], n_tokens: int, *,
             temperature: float = 0.8, top_k: int | None = None, seed: int = 0,
             keep: int | None = None) -> str | list[str]:
  """``train.generate`` with the KV cache: the prompt (or each of a list of prompts, in one batch)
  and its continuation of ``n_tokens`` bytes, as text. An empty prompt starts from a newline, as
  ``train.generate``'s. The arguments as in :func:`generate_ids`."""
  texts = [prompt] if isinstance(prompt, str) else list(prompt)
  ids = [list(data_lib.encode(text)) or [ord("\n")] for text in texts]
  out = generate_ids(model, params, ids, n_tokens, temperature=temperature, top_k=top_k, seed=seed,
                     keep=keep)
  samples = [data_lib.decode([*p, *t]) for p, t in zip(ids, out.tokens)]
  return samples[0] if isinstance(prompt, str) else samples


# --- checkpoints ----------------------------------------------------------------------------------

class CheckpointError(ValueError):
  """A checkpoint folder that cannot give this model's parameters."""


def load_params(ckpt_dir: str, model: GPT) -> tuple[dict, int]:
  """The parameters of the newest checkpoint in ``ckpt_dir`` (train.py's orbax checkpoints) and its
  step, checked against ``model``'s shapes.

  Raises:
    CheckpointError: a missing folder, one without checkpoints, an unreadable checkpoint or one of
      another model, with a one-line message naming ``--ckpt-dir``.
  """
  if not os.path.exists(ckpt_dir):
    raise CheckpointError(f"--ckpt-dir {ckpt_dir}: no such folder")
  if not os.path.isdir(ckpt_dir):
    raise CheckpointError(f"--ckpt-dir {ckpt_dir} is a file, not a folder of checkpoints")
  if not os.access(ckpt_dir, os.R_OK | os.X_OK):
    raise CheckpointError(f"--ckpt-dir {ckpt_dir}: permission denied")
  import orbax.checkpoint as ocp
  try:
    manager = ocp.CheckpointManager(os.path.abspath(ckpt_dir))
    step = manager.latest_step()
  except Exception as e:  # noqa: BLE001 - orbax raises many kinds
    raise CheckpointError(f"--ckpt-dir {ckpt_dir}: cannot read it ({_first_line(e)})") from e
  if step is None:
    raise CheckpointError(f"--ckpt-dir {ckpt_dir} holds no checkpoint: train with "
                          f"`python -m examples.flax_gpt.train --ckpt-dir {ckpt_dir}` first")
  try:
    restored = manager.restore(step, args=ocp.args.StandardRestore())
  except Exception as e:  # noqa: BLE001
    raise CheckpointError(f"--ckpt-dir {ckpt_dir}: cannot read the checkpoint of step {step} "
                          f"({_first_line(e)})") from e
  finally:
    manager.close()
  params = restored.get("params") if isinstance(restored, dict) else None
  want = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                           jnp.zeros((1, model.config.seq_len), jnp.int32))["params"])
  got = None if params is None else jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype),
                                                 params)
  expected = jax.tree.map(lambda x: (x.shape, x.dtype), want)
  if got is None or jax.tree.structure(got, is_leaf=_is_pair) != jax.tree.structure(
      expected, is_leaf=_is_pair) or jax.tree.leaves(got, is_leaf=_is_pair) != jax.tree.leaves(
          expected, is_leaf=_is_pair):
    raise CheckpointError(
        f"--ckpt-dir {ckpt_dir}: the checkpoint of step {step} holds another model than these "
        "flags build; pass the model flags it was trained with (--preset and its overrides)")
  return params, int(step)


def _is_pair(x) -> bool:
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  return (text.splitlines()[0][:300] if text else type(e).__name__)


# --- the command line -----------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
  """argparse with its usage errors on one line, as this command's other errors."""

  def error(self, message):
    _fail(message)


def build_parser() -> argparse.ArgumentParser:
  """The command line: the checkpoint, the prompts, the sampler and the model flags of train.py."""
  p = _Parser(prog=PROG, description="Sample from a checkpoint of the example GPT "
                              "with a KV cache (fa2_jax.KVCache): one prefill, then one compiled "
                              "decode step per token.")
  p.add_argument("--ckpt-dir", metavar="DIR", required=True,
                 help="a folder of checkpoints written by `python -m examples.flax_gpt.train "
                      "--ckpt-dir DIR`; its newest checkpoint is sampled")
  p.add_argument("--prompt", action="append",
                 help="a prompt; repeat it for a batch of prompts generated together (default: "
                      "'def fibonacci(n):' and a newline)")
  p.add_argument("--tokens", type=int, default=300, help="new bytes per prompt (default: 300)")
  p.add_argument("--temperature", type=float, default=0.8,
                 help="sampling temperature, >= 0 (0: greedy) (default: 0.8)")
  p.add_argument("--top-k", type=int, help="sample among the K most likely bytes only "
                 "(default: all)")
  p.add_argument("--seed", type=int, default=0, help="the sampling seed (default: 0)")
  g = p.add_argument_group("model (the flags the checkpoint was trained with; defaults: the "
                           "preset's)")
  g.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="(default: tiny)")
  add_model_flags(g, bools=("tie_embeddings", "scan_layers"))
  return p


def model_config(args: argparse.Namespace) -> GPTConfig:
  """The preset's model config with the model flags that were given."""
  mc, _ = get_preset(args.preset)
  changes = {field: getattr(args, name) for name, (cls, field) in _OVERRIDES.items()
             if cls is GPTConfig and getattr(args, name, None) is not None}
  return dataclasses.replace(mc, **changes)


def describe_decode_attention(mc: GPTConfig, batch: int) -> str:
  """One line: what fa2_jax runs for a decode step's attention (one query row per batch row
  against the cache) here."""
  q = jax.ShapeDtypeStruct((batch, 1, mc.n_head, mc.head_dim), jnp.dtype(mc.dtype))
  k = jax.ShapeDtypeStruct((batch, mc.seq_len, mc.kv_heads, mc.head_dim), jnp.dtype(mc.dtype))
  rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
  implementation = FLASH_IMPLEMENTATIONS.get(mc.attention)
  dispatch = fa2_jax.backend_for(q, k, is_causal=True, q_offset=rows, key_value_seq_lengths=rows,
                                 implementation=implementation,
                                 interpret=True if mc.flash_interpret else None,
                                 local_window_size=None if mc.window is None else (mc.window, 0),
                                 logits_soft_cap=mc.soft_cap)
  kernels = ", ".join(dispatch.forward) or "the XLA formula"  # the cache path is forward-only
  return (f"decode attention: fa2_jax "
          f"{cli_message(f'{dispatch.backend} ({kernels}): {dispatch.reason}')}")


def _fail(message: str) -> None:
  print(f"generate: error: {' '.join(str(message).splitlines())}", file=sys.stderr)
  raise SystemExit(2)


def main(argv=None) -> dict:
  """Parses ``argv`` (None: ``sys.argv``), samples, prints the samples and the timing, and returns
  them. A bad flag, prompt or checkpoint exits with one line naming it (status 2)."""
  args = build_parser().parse_args(argv)
  try:
    mc = model_config(args)
  except (ValueError, TypeError) as e:
    _fail(flag_names(str(e)))
  prompts = args.prompt if args.prompt is not None else [DEFAULT_PROMPT]
  for i, prompt in enumerate(prompts):
    if not prompt:
      _fail("--prompt is empty" + (f" (prompt {i + 1})" if len(prompts) > 1 else "")
            + ": give the text to continue")
  if args.tokens < 1:
    _fail(f"--tokens must be >= 1, got {args.tokens}")
  if args.top_k is not None and args.top_k < 1:
    _fail(f"--top-k must be >= 1, got {args.top_k}")
  try:
    check_settings(mc, args.tokens, args.temperature, args.top_k, None)
  except ValueError as e:
    _fail(str(e).replace("temperature", "--temperature"))
  if mc.attention == "flash_triton" and not mc.flash_interpret and jax.default_backend() != "gpu":
    _fail("--attention flash_triton needs a GPU here; pass --interpret true or --attention flash")
  if mc.flash_interpret and not mc.attention.startswith("flash"):
    _fail(f"--interpret true runs the fa2_jax kernels, which --attention {mc.attention} does not "
          "use; pass --attention flash or flash_triton")
  try:  # before the checkpoint: the model's init runs its attention
    attention_core(mc)  # raises for an attention that cannot run here (cudnn without a GPU, ...)
    attention_line = describe_decode_attention(mc, len(prompts))
  except ValueError as e:
    _fail(cli_message(str(e)))
  model = GPT(mc)
  try:
    params, step = load_params(args.ckpt_dir, model)
  except CheckpointError as e:
    _fail(str(e))
  devices = jax.local_devices()
  print(f"checkpoint of step {step} in {os.path.abspath(args.ckpt_dir)}: "
        f"{count_params(params):,} parameters")
  print("\n".join(describe_configs(args.preset, mc, get_preset(args.preset)[1])[:2]))
  print(f"jax {jax.__version__}, {devices[0].device_kind} ({jax.default_backend()})")
  print(attention_line, flush=True)
  ids = [list(data_lib.encode(p)) for p in prompts]
  out = generate_ids(model, params, ids, args.tokens, temperature=args.temperature,
                     top_k=args.top_k, seed=args.seed)
  samples = [data_lib.decode([*p, *t]) for p, t in zip(ids, out.tokens)]
  settings = f"temperature {args.temperature}" + (f", top-k {args.top_k}" if args.top_k else "")
  for i, sample in enumerate(samples):
    title = f"sample {i + 1} of {len(samples)}" if len(samples) > 1 else "sample"
    print(f"\n--- {title} ({settings}) ---\n{sample}\n---")
  batch, width = len(prompts), max(len(p) for p in ids)
  print(f"\nprefill: {1e3 * out.prefill_s:.1f} ms ({batch} x {min(width, mc.seq_len)} prompt "
        f"tokens); decode: {args.tokens} steps x {batch} row{'s' if batch > 1 else ''} in "
        f"{out.decode_s:.3f} s = "
        f"{out.ms_per_token:.2f} ms/token, {out.tokens_per_s:,.0f} tokens/s; compile "
        f"{out.compile_s:.1f} s")
  return {"step": step, "samples": samples, "prefill_s": out.prefill_s, "decode_s": out.decode_s,
          "ms_per_token": out.ms_per_token, "tokens_per_s": out.tokens_per_s,
          "compile_s": out.compile_s}


if __name__ == "__main__":
  main()
