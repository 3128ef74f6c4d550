"""The attention of public model configs, forward+backward, every implementation of a cell in one process.

Each cell is one model's attention layer as it trains (bf16, causal, self-attention T = S) at 4k and at
16k tokens per sequence, with 16k tokens per call (``TOKENS``: batch 4 at 4k, batch 1 at 16k, so the
cells of one model do the same number of token rows), the model's own variants passed to every
implementation under that implementation's names:

  model               heads N/K   head_dim   variants
  GPT-2               12/12       64
  Llama-3 8B          32/8        128
  Llama-3 70B         64/8        128
  Qwen2 7B            28/4        128
  Mistral 7B          32/8        128        local window (4095, 0) (its sliding window of 4096 keys)
  Gemma-2 9B global   16/8        256        soft cap 50 (the global layers)
  Gemma-2 9B local    16/8        256        soft cap 50, local window (4095, 0) (the local layers)
  Gemma 2B            8/1 (MQA)   256
  StarCoder           48/1 (MQA)  128
  Phi-3-mini          32/32       96
  DeepSeek-V2-Lite    16/16       192 / 128  query/key head_dim 192, value head_dim 128 (MLA expanded
                                             to heads, as in training)

and shapes no kernel setting was tuned for (``untuned-*``): head_dim 80 (Phi-2's 32 × 80) and 112 (GQA
32/8), GQA 40/8 at 128 (Qwen2.5-14B's), at 4k and 16k; and T = S = 6000 (not a power of two, not a
multiple of a tile) with batch 3 (18000 tokens: not the 16k of the other cells) for Llama-3 8B's shape
and for Gemma-2's local layer. A window (4095, 0) at 4k covers every causal key, so it changes nothing
there: the window cells that differ from causal ones are the 16k and 6000 ones.

Rows (``--impls``, default ``fa2,fa2_det,cudnn,fa3,tokamax``; benchmarks/impls.py):
  fa2       fa2_jax.flash_attention(is_causal=True, local_window_size, logits_soft_cap)
  fa2_det   the same with deterministic=True: measured where it is a different program from fa2
            (fa2_jax.backend_for), else recorded as the same
  cudnn     jax.nn.dot_product_attention(implementation="cudnn", is_causal=True, local_window_size)
  fa3       flash_attn3_jax.flash_mha(is_causal=True, window_size, softcap): head_dim 128 only
  tokamax   tokamax.dot_product_attention(implementation="mosaic", is_causal=True, local_window_size,
            logits_soft_cap)
A variant is passed under the implementation's own name (``VARIANT_ARGS``), never dropped: where an
implementation refuses the call (no such argument, a head_dim or a value head_dim it does not take) the
refusal is caught before any compile (fa2_jax: ``fa2_jax.backend_for``, which validates the call as
``flash_attention`` does; the peers: ``jax.eval_shape`` of the row's forward+backward) and the cell says
n/a with the exception's text; a failure when compiling or running says ✗ with its text. Nothing is special-cased per model: the DeepSeek cells run whatever fa2_jax accepts today.

FLOPs (the harness's convention, benchmarks/timing.py): forward 2·B·N·pairs·(H + Hv), the QK^T product
over the query/key head_dim H and PV over the value head_dim Hv (4·B·N·pairs·H when they are equal), with
pairs = T·S/2 for a causal call (the paper's count) and the exact number of attended (query, key) pairs
where a local window leaves keys out (as benchmarks/variants.py counts); forward+backward 3.5× the
forward. Every implementation of a cell is credited with the same FLOPs, so rates compare as times.
Bars (fa2_jax's defaults, forward+backward): ≥ 1.00× cuDNN's rate where cuDNN runs the cell, ≥ 0.95×
FA3's where FA3 runs it. Each forward output is checked against fa2_jax.reference_attention in float32
(batch 0, the first REF_HEADS heads; ⚠ when off).

    python -m benchmarks.models [--quick] [--cells 'llama3-*,untuned-*'] [--impls fa2,cudnn]
    python -m benchmarks.models --list-cells
    python -m benchmarks.models --merge a/models.json b/models.json --out DIR

``--quick``: the 4k cells and the 6000-token ones (no 16k cell), REPS_QUICK repetitions unless --reps says
otherwise. ``--smoke`` (automatic without a GPU): tiny cells of the same kinds (GQA, MQA, a window with a
soft cap, value head_dim != head_dim, a head_dim and a length no power of two) in Pallas interpret mode.
Writes models.json / .md and models.png (fwd+bwd TFLOP/s per model and implementation).
"""
from __future__ import annotations

import dataclasses
import functools
import time
import zlib

from . import harness as h
from . import impls
from .attention import attach_ratios
from .timing import REPS, fwd_bwd_fn
from .variants import causal_pairs

STEM = "models"
DTYPE = "bf16"
FAMILIES = ("fa2", "fa2_det", "cudnn", "fa3", "tokamax")  # the registry entries with rows here
REF_HEADS = 2  # the reference check compares batch 0, the first REF_HEADS query heads
REPS_QUICK = 3  # --quick: repetitions per row (the full run: timing.REPS)
WINDOW = (4095, 0)  # Mistral 7B's and Gemma-2's local layers' sliding window of 4096 keys, the query's own
SOFT_CAP = 50.0  # Gemma-2's attention logit soft cap
# fa2_jax's forward+backward rate over these implementations' on the same cell must reach at least this.
BARS = {"cudnn": 1.00, "fa3": 0.95}
RATIO_TO = {"cudnn": "cuDNN", "fa3": "FA3"}
# Each implementation's own names for (the local window, the soft cap): benchmarks/impls.py passes
# keyword arguments to its call as they are.
VARIANT_ARGS = {
    "fa2": ("local_window_size", "logits_soft_cap"),
    "fa2_det": ("local_window_size", "logits_soft_cap"),
    "cudnn": ("local_window_size", "logits_soft_cap"),  # jax.nn.dot_product_attention's names
    "tokamax": ("local_window_size", "logits_soft_cap"),  # tokamax follows jax.nn's signature
    "fa3": ("window_size", "softcap"),  # FlashAttention-3's names
}


# --- the configs ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Model:
  """One model's attention: N query heads over K key/value heads, query/key head_dim H and value
  head_dim Hv, its local window and soft cap (None: none)."""

  key: str  # its cells' id prefix
  name: str  # tables and plots
  heads: int  # N
  kv_heads: int  # K
  head_dim: int  # H
  v_head_dim: int  # Hv
  window: tuple[int, int] | None = None
  soft_cap: float | None = None

  def shape_text(self) -> str:
    """``32/8 × 128``, ``16/16 × 192/128`` (H/Hv), variants after a comma."""
    dims = f"{self.head_dim}" + (f"/{self.v_head_dim}" if self.v_head_dim != self.head_dim else "")
    parts = [f"{self.heads}/{self.kv_heads} × {dims}"]
    if self.window is not None:
      parts.append(f"window {tuple(self.window)}")
    if self.soft_cap is not None:
      parts.append(f"cap {self.soft_cap:g}")
    return ", ".join(parts)


MODELS = (
    Model("gpt2", "GPT-2", 12, 12, 64, 64),
    Model("llama3-8b", "Llama-3 8B", 32, 8, 128, 128),
    Model("llama3-70b", "Llama-3 70B", 64, 8, 128, 128),
    Model("qwen2-7b", "Qwen2 7B", 28, 4, 128, 128),
    Model("mistral-7b", "Mistral 7B", 32, 8, 128, 128, window=WINDOW),
    Model("gemma2-9b-global", "Gemma-2 9B global", 16, 8, 256, 256, soft_cap=SOFT_CAP),
    Model("gemma2-9b-local", "Gemma-2 9B local", 16, 8, 256, 256, window=WINDOW, soft_cap=SOFT_CAP),
    Model("gemma-2b", "Gemma 2B", 8, 1, 256, 256),
    Model("starcoder", "StarCoder", 48, 1, 128, 128),
    Model("phi3-mini", "Phi-3-mini", 32, 32, 96, 96),
    Model("deepseek-v2-lite", "DeepSeek-V2-Lite", 16, 16, 192, 128),
)
UNTUNED = (
    Model("untuned-h80", "head_dim 80", 32, 32, 80, 80),
    Model("untuned-h112", "head_dim 112", 32, 8, 112, 112),
    Model("untuned-gqa40x8", "GQA 40/8", 40, 8, 128, 128),
)
_BY_KEY = {m.key: m for m in MODELS}
# (model, T = S, batch): lengths that are no power of two, at a batch that is not TOKENS / T.
FIXED = ((_BY_KEY["llama3-8b"], 6000, 3), (_BY_KEY["gemma2-9b-local"], 6000, 3))

# The CPU smoke size: the same kinds of cell, tiny (Pallas interpret mode).
SMOKE_MODELS = (
    Model("gqa", "GQA", 4, 2, 32, 32),
    Model("mqa", "MQA", 4, 1, 32, 32),
    Model("window-cap", "window + cap", 4, 2, 32, 32, window=(15, 0), soft_cap=SOFT_CAP),
    Model("mla", "value head_dim 32", 2, 2, 48, 32),
)
SMOKE_UNTUNED = (Model("untuned-h40", "head_dim 40", 2, 2, 40, 40),)
SMOKE_FIXED = ((SMOKE_MODELS[0], 48, 3),)

# seqs: T = S of the model cells; tokens: per call (batch = tokens // seq).
SIZES = {
    "full": dict(seqs=(4096, 16384), tokens=16384, models=MODELS, untuned=UNTUNED, fixed=FIXED),
    "smoke": dict(seqs=(32, 128), tokens=128, models=SMOKE_MODELS, untuned=SMOKE_UNTUNED,
                  fixed=SMOKE_FIXED),
}
TOKENS = SIZES["full"]["tokens"]


def attended_pairs(seq: int, window) -> float:
  """(query, key) pairs per sequence and head of a causal T = S = ``seq`` call: ``seq²/2`` (the
  harness's causal count), or the exact count of keys in ``[i - left, i]`` where the window ``(left,
  0)`` leaves keys out."""
  if window is None or window[0] >= seq - 1:
    return seq * seq / 2
  return float(causal_pairs(seq, window[0]))


def make_cell(model: Model, seq: int, batch: int, group: str, prefix: str = "") -> dict:
  """Cell ``<prefix><model key>-<seq>`` (e.g. ``llama3-8b-4k``, ``untuned-llama3-8b-6000``)."""
  pairs = attended_pairs(seq, model.window)
  return dict(id=f"{prefix}{model.key}-{h.seq_label(seq)}", group=group, model=model.key, name=model.name,
              shape=model.shape_text(), batch=batch, seq_q=seq, seq_k=seq, heads=model.heads,
              kv_heads=model.kv_heads, head_dim=model.head_dim, v_head_dim=model.v_head_dim,
              window=list(model.window) if model.window else None, soft_cap=model.soft_cap, causal=True,
              tokens=batch * seq, pairs=pairs,
              flops_fwd=2.0 * batch * model.heads * pairs * (model.head_dim + model.v_head_dim))


def group_name(seq: int, batch: int) -> str:
  return f"models at {h.seq_label(seq)} tokens per sequence (B={batch})"


UNTUNED_GROUP = "shapes not tuned for"


def build_cells(size: str = "full") -> list[dict]:
  """Every cell of a size (``quick``: the full size's first length and the fixed-length cells), the
  most wanted first: the models at each length, then the untuned shapes."""
  s = SIZES["full" if size == "quick" else size]
  seqs = s["seqs"][:1] if size == "quick" else s["seqs"]
  cells = [make_cell(m, t, s["tokens"] // t, group_name(t, s["tokens"] // t)) for t in seqs
           for m in s["models"]]
  cells += [make_cell(m, t, s["tokens"] // t, UNTUNED_GROUP) for t in seqs for m in s["untuned"]]
  # the fixed-length cells run a model's config: their ids say they are shapes not tuned for
  cells += [make_cell(m, t, b, UNTUNED_GROUP, "" if m.key.startswith("untuned-") else "untuned-")
            for m, t, b in s["fixed"]]
  return cells


def variant_kwargs(impl: str, cell: dict) -> dict:
  """The cell's variants under ``impl``'s own argument names (VARIANT_ARGS)."""
  window, cap = VARIANT_ARGS[impl]
  kw = {}
  if cell.get("window") is not None:
    kw[window] = tuple(cell["window"])
  if cell.get("soft_cap") is not None:
    kw[cap] = float(cell["soft_cap"])
  return kw


def reference_kwargs(cell: dict) -> dict:
  """fa2_jax.reference_attention's arguments for the cell's attention."""
  return dict(is_causal=True, **variant_kwargs("fa2", cell))


def call_text(impl: str, cell: dict) -> str:
  args = ", ".join(["is_causal=True"] + [f"{k}={v}" for k, v in variant_kwargs(impl, cell).items()])
  return {"fa2": f"flash_attention({args})", "fa2_det": f"flash_attention({args}, deterministic=True)",
          "cudnn": f'jax.nn.dot_product_attention(implementation="cudnn", {args})',
          "fa3": f"flash_mha({args})",
          "tokamax": f'tokamax.dot_product_attention(implementation="mosaic", {args})'}[impl]


# --- measuring ------------------------------------------------------------------------------------------

def cell_key(c):
  return (c.get("id"), c.get("impl"))


def build_parser():
  p = h.script_parser("models", __doc__)
  h.add_cell_args(p, "*-16k,untuned-*", "print the cell ids and shapes, and exit")
  p.add_argument("--impls", type=h.impl_names, default=None,
                 help=f"rows of these registry entries only: comma list of {', '.join(FAMILIES)} "
                      "(default all)")
  p.add_argument("--no-check", action="store_true", help="skip the f32 reference check")
  h.add_common_args(p, counts=True)
  p.set_defaults(reps=None)  # timing.REPS, --quick REPS_QUICK, --smoke harness.SMOKE_REPS
  return p


def select_cells(args) -> list[dict]:
  size = "smoke" if args.smoke else "quick" if args.quick else "full"
  which = {"smoke": "the CPU smoke cells (--smoke, or no GPU)", "quick": "the quick GPU cells",
           "full": "the GPU cells"}[size]
  return h.select(build_cells(size), args.cells, lambda c: c["id"], f"{which}; their ids")


def inputs_of(cell: dict, seed: int):
  """Fresh normals ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]``, drawn from the cell's id
  (a --cells subset measures the same inputs)."""
  b, t, s = cell["batch"], cell["seq_q"], cell["seq_k"]
  return h.random_inputs(zlib.crc32(f"{cell['id']}/{seed}".encode()),
                         [(b, t, cell["heads"], cell["head_dim"]), (b, s, cell["kv_heads"], cell["head_dim"]),
                          (b, s, cell["kv_heads"], cell["v_head_dim"])], h.jnp_dtype(DTYPE))


def refusal(impl: impls.Impl, f, q, k, v, kw: dict) -> str | None:
  """None when ``impl`` takes the call ``f`` (``impl`` with the variant arguments ``kw``) on these
  inputs, else the exception's text: an implementation refusing the call (an argument it does not
  have, a shape it does not take) says so here, before anything is compiled. fa2_jax's entries:
  ``fa2_jax.backend_for``, which validates the call as ``flash_attention`` does (without tracing
  the kernels); the others: ``jax.eval_shape`` of the forward+backward, which traces the call and its
  gradient."""
  import jax
  try:
    if impl.describe is not None:
      impl.describe(q, k, v, causal=True, **kw)
    else:
      jax.eval_shape(fwd_bwd_fn(f), q, k, v)
  except Exception as e:  # noqa: BLE001 - the refusal is the cell's result
    return h.err_str(e)
  return None


def run(args) -> dict:
  import jax
  families = args.impls or list(FAMILIES)
  if set(families) - set(FAMILIES):
    bad = [n for n in families if n not in FAMILIES]
    raise SystemExit(f"--impls: {', '.join(bad)} {'has' if len(bad) == 1 else 'have'} no rows here; "
                     f"the models' rows run {', '.join(FAMILIES)}")
  if args.list_cells:
    for c in select_cells(args):
      print(f"{c['id']:<26} {c['name']}: {c['shape']}; B={c['batch']} T=S={c['seq_q']}")
    return {}
  info = h.device_info()
  h.cpu_fallback(args, info, STEM)
  if args.reps is None:
    args.reps = REPS_QUICK if args.quick else REPS
  cells = select_cells(args)
  names, info["absent_impls"] = impls.split_available(families)
  info["impls"] = {n: impls.get(n).about for n in names}
  size = "smoke" if args.smoke else "quick" if args.quick else "full"
  run = h.Run(args, STEM, info, dict(
      size=size, cells=cells, impls=names, dtype=DTYPE, iters=args.iters, reps=args.reps,
      tokens=SIZES["smoke" if args.smoke else "full"]["tokens"], variant_args=VARIANT_ARGS,
      bars=BARS, flops="forward 2·B·N·pairs·(H + Hv), pairs = T·S/2 causal (the attended pairs where "
      "a window leaves keys out); forward+backward 3.5× that",
      method="benchmarks.timing: jit; 2 warm-up calls; median of reps x (iters back-to-back calls, then "
             "block_until_ready), the repetitions of a cell's implementations and passes interleaved "
             "(order rotated each repetition); fwd+bwd = jit(grad(f32 sum of the output)); bwd = "
             "fwd+bwd - fwd"), cell_key, len(cells) * len(names))
  for cell in cells:
    run.bar.set_postfix_str(cell["id"])
    t0, inputs, refs, rows = time.time(), None, {}, {}
    for name in names:
      rec = dict(cell, impl=name, dtype=DTYPE, status="ok", about=call_text(name, cell))
      if run.skip(rec):
        continue
      try:
        if inputs is None:
          inputs = inputs_of(cell, args.seed)
        q, k, v = inputs
        impl, kw = impls.get(name), variant_kwargs(name, cell)
        f = functools.partial(impl, causal=True, **kw)
        why = impls.unsupported(name, q.shape, k.shape, q.dtype, True) or refusal(impl, f, q, k, v, kw)
        if why:
          run.add(dict(rec, status="unsupported", error=why), check=False)
          continue
        if impl.describe is not None:
          if name == "fa2_det" and impls.get("fa2").describe(q, k, v, causal=True, **kw).deterministic:
            run.add(dict(rec, status="same", same_as="fa2", note="fa2's default backward is already "
                         "deterministic here: the same program"), check=False)
            continue
          rec["backend"] = str(impl.describe(q, k, v, causal=True, **kw))
        rows[name] = (rec, f, inputs)
      except Exception as e:  # noqa: BLE001
        run.add(dict(rec, status="error", error=h.err_str(e)))

    def check(name, out, cell=cell, inputs=inputs, refs=refs):
      del name
      if args.no_check:
        return None
      if not refs:
        refs[0] = h.reference(*inputs, REF_HEADS, **reference_kwargs(cell))
      return h.rel_err(out, *refs[0])

    if rows:
      run.together(rows, iters=args.iters, reps=args.reps, check=check, t0=t0)
    del inputs, refs, rows, check
    jax.clear_caches()  # compiled programs of this cell's shapes are not used again
  attach_ratios(run.rec.cells)
  return run.finish(render, summary)


# --- report ---------------------------------------------------------------------------------------------

def cells_of(data) -> list[dict]:
  """A result's cells, with their ratios to cuDNN and FA3 (``vs_cudnn``, ``vs_fa3``)."""
  return attach_ratios([dict(c) for c in data.get("cells") or [] if "impl" in c and "id" in c])


def _fb(c, key="tflops"):
  return ((c or {}).get(key) or {}).get("fwd+bwd")


def evaluate(cells) -> list[dict]:
  """fa2_jax's bars per cell (BARS): ``{id, ref, ratio, threshold, ok}`` where both rows ran
  forward+backward."""
  by = {(c["id"], c["impl"]): c for c in cells}
  out = []
  for c in cells:
    if c["impl"] != "fa2" or _fb(c) is None:
      continue
    for ref, threshold in BARS.items():
      r = h.ratio(_fb(c), _fb(by.get((c["id"], ref))))
      if r is not None:
        out.append(dict(id=c["id"], ref=ref, ratio=r, threshold=threshold, ok=r >= threshold))
  return out


def cell_text(c, pass_: str = "fwd+bwd") -> str:
  """``412 (3.21 ms)``: TFLOP/s and time of one pass; ``=`` the same program as fa2_jax; n/a refused."""
  if c is None:
    return "–"
  status = c.get("status")
  if status in ("same", "skipped", "unsupported"):
    return {"same": "=", "skipped": "skip", "unsupported": "n/a"}[status]
  tf, ms = (c.get("tflops") or {}).get(pass_), (c.get("ms") or {}).get(pass_)
  if tf is None:
    return "✗ crash" if "crash" in (c.get("error") or "") else "✗"
  return f"{h.fmt_tf(tf)} ({h.fmt_ms(ms)} ms)" + (" ⚠" if c.get("warning") else "")


def _ratio_text(r, threshold) -> str:
  if r is None:
    return "–"
  return f"{h.fmt_ratio(r)} {'✓' if r >= threshold else '✗'}"


def groups(cells) -> dict:
  """Group -> its cells (one per id) in the order build_cells gives them (the measured order for ids
  it does not know)."""
  known = [c["id"] for size in ("full", "smoke") for c in build_cells(size)]
  out: dict = {}
  for c in cells:
    out.setdefault(c["group"], {}).setdefault(c["id"], c)
  order = lambda c: known.index(c["id"]) if c["id"] in known else len(known)  # noqa: E731
  gs = sorted(out, key=lambda g: min(order(c) for c in out[g].values()))
  return {g: sorted(out[g].values(), key=order) for g in gs}


def table(cells, pass_: str = "fwd+bwd", ratios: bool = True) -> str:
  names = h.ordered(c["impl"] for c in cells if c.get("status") != "unavailable")
  by = {(c["impl"], c["id"]): c for c in cells}
  refs = [n for n in RATIO_TO if n in names and "fa2" in names] if ratios else []
  header = (["cell", "model", "heads × head_dim, variants", "B × T"] + [h.style(n)[0] for n in names]
            + [f"fa2_jax ÷ {RATIO_TO[n]} (bar {BARS[n]:.2f})" for n in refs])
  rows = []
  for cs in groups(cells).values():
    for c in cs:
      fa2 = by.get(("fa2", c["id"])) or {}
      rows.append([f"`{c['id']}`", c["name"], c["shape"], f"{c['batch']} × {h.seq_label(c['seq_q'])}"]
                  + [cell_text(by.get((n, c["id"])), pass_) for n in names]
                  + [_ratio_text((fa2.get(f"vs_{n}") or {}).get(pass_), BARS[n]) for n in refs])
  return h.md_table(header, rows)


def render(data, base):
  cells, cfg = cells_of(data), data.get("config", {})
  lines = h.header(data, "Attention of public model configs: forward+backward (bf16, causal)")
  tokens = cfg.get("tokens", TOKENS)
  lines += [f"- {h.seq_label(tokens)} tokens per call (batch = {h.seq_label(tokens)} ÷ T) except the "
            "fixed-length cells not tuned for (their B × T says); self-attention T = S",
            f"- FLOPs: {cfg.get('flops', '')}",
            f"- timing: {cfg.get('method', '')}", ""]
  bars = evaluate(cells)
  if bars:
    lines += ["## Bars: fa2_jax forward+backward", ""]
    for ref, threshold in BARS.items():
      got = [b for b in bars if b["ref"] == ref]
      if got:
        bad = [f"{b['id']} {h.fmt_ratio(b['ratio'])}" for b in got if not b["ok"]]
        lines.append(f"- ≥ {threshold:.2f}× {RATIO_TO[ref]} where {RATIO_TO[ref]} runs the cell: met in "
                     f"{len(got) - len(bad)} of {len(got)} cells" + (f"; not met: {', '.join(bad)}"
                                                                      if bad else ""))
    lines.append("")
  lines += ["## Forward+backward", "",
            "TFLOP/s (ms per call); `=`: the same program as the fa2_jax column; n/a: the implementation "
            "refuses the call (its reason below); ✗: failed when compiled or run (below); ⚠: output off "
            "the f32 reference; skip: left out (time budget). Ratios: fa2_jax's rate over the other's, "
            "✓ where it meets the bar.", "", table(cells), "",
            "## Forward", "", table(cells, "fwd", ratios=False), ""]
  backends = {c["id"]: c["backend"] for c in cells if c["impl"] == "fa2" and c.get("backend")}
  if backends:
    lines += ["fa2_jax ran (`fa2_jax.backend_for`): " + "; ".join(
        f"{k}: {v.split(':')[0]}" for k, v in backends.items()), ""]
  lines += h.failures(cells, lambda c: h.style(c["impl"])[0], lambda c: c["id"])
  lines += [f"- note: {n}" for n in data.get("notes", [])]
  return [h.write_md(lines, base)] + plot(data, cells, base)


def _mark(c) -> str:
  """A plot's label for a bar without a number: n/a (refused), ✗ (failed), skip; '' when measured."""
  if c is None or _fb(c) is not None:
    return ""
  return {"unsupported": "n/a", "skipped": "skip", "same": "="}.get(c.get("status"), "✗")


def plot(data, cells, base):
  """Forward+backward TFLOP/s, a panel per group of cells (the models at each length, the shapes not
  tuned for), a bar per implementation in the palette's colours, one panel per row."""
  plt, grouped = h.pyplot(), groups(cells)
  if plt is None or not grouped:
    return []
  by = {(c["impl"], c["id"]): c for c in cells}
  names = h.ordered(c["impl"] for c in cells)
  panels = []
  for group, gcells in grouped.items():
    ticks = [c["name"].replace(" ", "\n", 1) + (f"\n{h.seq_label(c['seq_q'])} (B={c['batch']})"
                                                if group == UNTUNED_GROUP else "") for c in gcells]
    series = [(n, [_fb(by.get((n, c["id"]))) or 0.0 for c in gcells]) for n in names
              if any(_fb(by.get((n, c["id"]))) for c in gcells)]
    panels.append((group, ticks, series))
  fig = h.bar_panels(plt, panels, ylabel="fwd+bwd TFLOP/s", ncol=1, panel_width=13.0)
  for ax, (_, _, series), gcells in zip(fig.axes, panels, grouped.values()):
    for bars, (n, _) in zip(ax.containers, series):  # a row without a number says why at its base
      ax.bar_label(bars, labels=[_mark(by.get((n, c["id"]))) for c in gcells], fontsize=7, rotation=90,
                   padding=2)
  return h.save(plt, fig, base, data, "Attention of model configs: forward+backward TFLOP/s, bf16, "
                "causal (higher is better)")


def summary(data) -> str:
  cells, smoke = cells_of(data), h.is_smoke(data)
  caveat = f" ({h.SMOKE_CAVEAT})" if smoke else ""
  lines = [f"{STEM}: fwd+bwd TFLOP/s (ms)" + caveat]
  for cs in groups(cells).values():
    for c in cs:
      lines.append(f"  {c['id']:<26} " + "  ".join(
          f"{x['impl']} {cell_text(x)}"
          for x in sorted((x for x in cells if x["id"] == c["id"]), key=lambda x: h.rank(x["impl"]))))
  for ref, threshold in BARS.items():
    got = [b for b in evaluate(cells) if b["ref"] == ref]
    if got:
      lines.append(f"  BAR fa2 fwd+bwd >= {threshold:.2f}x {ref}: {sum(b['ok'] for b in got)}/{len(got)} "
                   "met" + "".join(f"; {b['id']} {b['ratio']:.2f}" for b in got if not b["ok"]) + caveat)
  return "\n".join(lines)


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
