"""The benchmark harness on the CPU: the timing statistics (fake clock), the implementations registry,
the FLOP count, the markdown / merge / render logic, the plots (GPU in the title, the palette's legend
names and colours, tick labels apart), the grid's and the variants' CPU smoke runs, run_all's resume
after a crash, the diagnostics' flags, the results index's links, the model configs' cells, table and
CPU smoke run. GPU-only parts (Mosaic diagnostics and sweeps) are the tests marked ``gpu``."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ is a package of the repository, not of the wheel

import fa2_jax  # noqa: E402
from benchmarks import attention, harness, impls, numerics, timing, tune, variants  # noqa: E402
from benchmarks.attention import attach_ratios  # noqa: E402
from benchmarks.timing import attention_flops, tflops  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(path):
  return json.loads(Path(path).read_text())


# --- timing -----------------------------------------------------------------------------------------

class FakeDevice:
  """A clock that only moves when a result is waited for: ``block`` advances it by the cost of the
  calls issued since the last wait (``cost(output)`` each), as a device queue would."""

  def __init__(self, cost):
    self.now, self.pending, self.calls, self.blocks, self.cost = 0.0, 0.0, 0, 0, cost

  def clock(self):
    return self.now

  def fn(self, x):
    self.calls += 1
    self.pending += self.cost(x)
    return x

  def block(self, out):
    self.blocks += 1
    self.now += self.pending
    self.pending = 0.0
    return out


def test_time_calls_median_of_reps_of_back_to_back_calls():
  costs = iter([9.0, 9.0] + [c for c in (1.0, 4.0, 2.0, 8.0, 3.0) for _ in range(10)])
  dev = FakeDevice(lambda x: next(costs))
  st, out = timing.time_calls(dev.fn, ("x",), clock=dev.clock, block=dev.block)
  assert out == "x"
  assert dev.calls == 2 + 5 * 10 and dev.blocks == 2 + 5  # one wait per warm-up call and per rep
  assert st["samples_s"] == [1.0, 4.0, 2.0, 8.0, 3.0]  # the warm-up calls (9 s) are not timed
  assert (st["median_s"], st["min_s"], st["max_s"]) == (3.0, 1.0, 8.0)
  assert st["spread"] == pytest.approx(7.0 / 3.0)
  assert (st["iters"], st["reps"], st["warmup"]) == (10, 5, 2)
  with pytest.raises(ValueError, match="iters"):
    timing.time_calls(dev.fn, ("x",), iters=0)
  with pytest.raises(ValueError, match="reps"):
    timing.time_calls(dev.fn, ("x",), reps=True)


def test_time_interleaved_rotates_the_order_and_isolates_failures():
  """Each repetition times every entry once, in an order rotated by the repetition; an entry whose
  call raises is reported as its exception and the others are still timed."""
  order, now = [], [0.0]
  cost = {"a": 1.0, "b": 2.0, "c": 3.0}

  def make(name):
    def fn(x):
      if name == "bad" and len(order) > 3:
        raise RuntimeError("boom")
      order.append(name)
      now[0] += cost.get(name, 0.0) * (1 + 0.5 * (len(order) > 5))  # a drift: later calls cost more
      return name
    return fn

  entries = {n: (make(n), (0,)) for n in ("a", "b", "c")}
  started = []
  res = timing.time_interleaved(entries, iters=1, reps=3, warmup=1, clock=lambda: now[0],
                                block=lambda o: o, before=started.append)
  assert started == ["a", "b", "c"]
  assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
  # every entry sampled once at each position of the round: the drift (+50% from the 6th call) falls
  # on each of them alike
  for name, (st, out) in res.items():
    assert out == name and len(st["samples_s"]) == 3
  assert [res[n][0]["median_s"] for n in "abc"] == [1.5, 3.0, 4.5]
  order.clear()
  res = timing.time_interleaved({"bad": (make("bad"), (0,)), "a": (make("a"), (0,))}, iters=1,
                                reps=4, warmup=1, clock=lambda: now[0], block=lambda o: o)
  assert isinstance(res["bad"], RuntimeError) and len(res["a"][0]["samples_s"]) == 4
  with pytest.raises(ValueError, match="reps"):
    timing.time_interleaved(entries, reps=0)


def test_device_seconds_sums_the_gpu_process_events():
  """device_seconds: the complete events of a process named /device:GPU... count, host events do
  not; a trace without a device process (a CPU's): None."""
  events = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
      {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
      {"ph": "X", "pid": 7, "name": "split", "ts": 110.0, "dur": 10.0},
      {"ph": "X", "pid": 7, "name": "combine", "ts": 149.0, "dur": 4.0},
      {"ph": "i", "pid": 7, "name": "marker", "ts": 150.0},
      {"ph": "X", "pid": 1, "name": "host work", "ts": 120.0, "dur": 20.0},
  ]
  assert timing.device_seconds(events) == pytest.approx(14e-6)
  assert timing.device_seconds(events[:1] + events[-1:]) is None


def test_decode_report_has_a_device_time_table_only_where_measured():
  from benchmarks import decode
  rec = dict(row="fa2", id="1x8k", label="1 × 8k", kv_bytes=34e6, us=50.0, tbps=0.68)
  assert decode.busy_table([rec]) is None
  table = decode.busy_table([dict(rec, busy_us=20.0, busy_tbps=1.7),
                             dict(rec, row="cudnn", us=80.0)])
  assert "20.0 (1.70)" in table and "–" in table and "device µs per call" in table


def test_time_latency_synchronises_every_call():
  costs = iter([5.0] * 5 + [1e-6 * c for c in range(1, 101)])
  dev = FakeDevice(lambda x: next(costs))
  st = timing.time_latency(dev.fn, [("a",), ("b",)], calls=100, clock=dev.clock, block=dev.block)
  assert dev.blocks == 105 and st["calls"] == 100
  assert st["median_us"] == pytest.approx(50.5) and st["min_us"] == pytest.approx(1.0)
  assert st["p10_us"] <= st["median_us"] <= st["p90_us"]
  with pytest.raises(ValueError, match="arg_sets"):
    timing.time_latency(dev.fn, [])


def test_measure_times_forward_and_the_anchors_grad_and_derives_backward():
  """fwd = jit(f); fwd+bwd = jit(grad(f32 sum)) returns (dq, dk, dv); bwd = their difference."""
  dev = FakeDevice(lambda x: 0.0)
  seen = []

  def block(out):  # the forward costs 1 ms per call, forward+backward (a tuple of 3 grads) 3 ms
    seen.append(type(out))
    dev.now += (3e-3 if isinstance(out, tuple) and len(out) == 3 else 1e-3) * 2  # iters=2 calls
    return out

  q = jnp.ones((1, 4, 1, 8), jnp.float32)
  f = lambda q, k, v: (q * k * v).astype(jnp.bfloat16)  # noqa: E731
  res = timing.measure(f, q, q, q, flops_fwd=1e9, iters=2, reps=3, warmup=1, clock=dev.clock,
                       block=block)
  assert res["ms"]["fwd"] == pytest.approx(1.0) and res["ms"]["fwd+bwd"] == pytest.approx(3.0)
  assert res["ms"]["bwd"] == pytest.approx(2.0)
  assert res["tflops"]["fwd"] == pytest.approx(1e9 / 1e-3 / 1e12)
  assert res["tflops"]["fwd+bwd"] == pytest.approx(3.5e9 / 3e-3 / 1e12)
  assert res["tflops"]["bwd"] == pytest.approx(2.5e9 / 2e-3 / 1e12)
  assert tuple in seen and res["out"].shape == q.shape
  bad = timing.measure(lambda q, k, v: q @ k, q, q, q, flops_fwd=1.0, iters=1, reps=1, warmup=0)
  assert "fwd_error" in bad and "fwd+bwd_error" in bad and not bad["ms"]  # recorded, not raised


# --- FLOPs and the registry ---------------------------------------------------------------------------

def test_flops_paper_convention():
  assert attention_flops(2, 16, 8192, 8192, 128, False) == 4.0 * 2 * 16 * 8192 ** 2 * 128
  assert attention_flops(1, 1, 8, 8, 8, True) == attention_flops(1, 1, 8, 8, 8, False) / 2
  assert attention_flops(16, 16, 128, 8192, 128, False) == 4.0 * 16 * 16 * 128 * 8192 * 128
  assert tflops(1e12, "fwd+bwd", 3.5) == pytest.approx(1.0)
  assert tflops(1e12, "bwd", 2.5) == pytest.approx(1.0) and tflops(1e12, "fwd", 0.0) is None
  with pytest.raises(ValueError, match="head_dim"):
    attention_flops(1, 1, 8, 8, 0, False)
  with pytest.raises(ValueError, match="pass_"):
    tflops(1.0, "bwd+fwd", 1.0)


def test_registry_reports_availability_and_shape_limits(monkeypatch):
  real_import = impls.importlib.import_module

  def no_peers(name, *a):
    if name in ("tokamax", "flash_attn3_jax"):
      raise ImportError(f"No module named {name!r}")
    return real_import(name, *a)

  monkeypatch.setattr(impls.importlib, "import_module", no_peers)
  monkeypatch.setattr(impls, "_PROBED", {})
  avail = impls.availability()
  assert set(avail) == set(impls.NAMES) >= {"fa2", "fa2_det", "fa2_triton", "cudnn", "xla", "tokamax",
                                            "fa3"}
  assert avail["fa2"] is None and avail["fa2_det"] is None and avail["xla"] is None  # CPU: interpret
  assert "GPU" in avail["cudnn"]
  assert "tokamax is not importable" in avail["tokamax"]
  assert "flash_attn3_jax is not importable" in avail["fa3"]
  run, absent = impls.split_available(["fa3", "fa2", "cudnn", "xla"])
  assert run == ["fa2", "xla"] and set(absent) == {"fa3", "cudnn"}
  assert "head_dim 128 only" in impls.unsupported("fa3", (1, 64, 4, 64), (1, 64, 4, 64), "bfloat16", True)
  assert impls.unsupported("fa3", (1, 64, 4, 128), (1, 64, 1, 128), "float16", True) is None
  assert "bf16/fp16" in impls.unsupported("cudnn", (1, 64, 4, 64), (1, 64, 4, 64), "float32", False)
  assert impls.unsupported("xla", (1, 16384, 16, 128), (1, 16384, 16, 128), "bfloat16",
                           True).startswith("skipped above seq 8192")
  assert impls.parse_names("fa2, cudnn") == ["fa2", "cudnn"]
  with pytest.raises(ValueError, match="unknown.*'fa4'"):
    impls.parse_names("fa2,fa4")


# --- markdown, ratios, merge -------------------------------------------------------------------------

def _cell(cid, impl, fwd, fb, group="head_dim 128, causal", **kw):
  c = dict(id=cid, group=group, batch=2, seq_q=8192, seq_k=8192, heads=16, kv_heads=16, head_dim=128,
           causal=True, dtype="bf16", impl=impl, label=impl.upper(), status="ok",
           tflops={"fwd": fwd, "fwd+bwd": fb} if fwd else {})
  c.update(kw)
  return c


def _result(cells, notes=()):
  return {"script": "attention", "status": "done", "meta": {"versions": {}, "command": "x"},
          "config": {"dtype": "bf16"}, "cells": cells, "notes": list(notes)}


def test_attention_markdown_rows_ratios_and_marks(tmp_path, monkeypatch):
  monkeypatch.setattr(harness, "pyplot", lambda: None)  # the md alone (plots: the next test)
  cells = [_cell("d128-8k-c", "fa2", 500.0, 400.0), _cell("d128-8k-c", "cudnn", 400.0, 500.0),
           _cell("d128-8k-c", "fa3", 625.0, 800.0), _cell("d128-8k-c", "fa2_det", None, None,
                                                          status="same", same_as="fa2"),
           _cell("d128-8k-c", "xla", None, None, status="skipped", error="skipped above seq 8192"),
           _cell("d256-8k-c", "fa3", None, None, group="other shapes", head_dim=256, heads=8, kv_heads=8,
                 status="unsupported", error="head_dim 128 only"),
           _cell("d256-8k-c", "fa2", 300.0, 200.0, group="other shapes", head_dim=256, heads=8,
                 kv_heads=8)]
  attach_ratios(cells)
  assert cells[0]["vs_cudnn"]["fwd"] == pytest.approx(1.25)
  assert cells[0]["vs_fa3"]["fwd+bwd"] == pytest.approx(0.5)
  lines = attention.render(_result(cells), tmp_path / "grid")[0].read_text().splitlines()
  row = lambda name: next(x for x in lines if x.startswith(f"| {name}"))  # noqa: E731
  # a row per cell, a column per implementation (user-facing names), fa2_jax's ratios
  assert row("cell") == ("| cell | fa2_jax | fa2_jax (deterministic) | cuDNN | FlashAttention-3 | XLA | "
                         "fa2_jax ÷ cuDNN | fa2_jax ÷ FA3 |")
  assert row("h128 8k causal (B=2)") == (
      "| h128 8k causal (B=2) | 500 / 400 | = | 400 / 500 | 625 / 800 | skip | 1.25 / 0.80 | 0.80 / 0.50 |")
  assert row("h256 8k causal (B=2)") == "| h256 8k causal (B=2) | 300 / 200 | – | – | n/a | – | – / – | – / – |"
  assert lines.index(row("h128")) < lines.index(row("h256"))  # the paper's groups first
  assert "- **XLA** error (d128-8k-c): `skipped above seq 8192`" in lines
  # Without cuDNN or FA3 rows nothing names them (the CPU smoke table).
  alone = [c for c in cells if c["impl"] not in ("cudnn", "fa3")]
  md = attention.render(_result(alone), tmp_path / "alone")[0].read_text()
  assert "cuDNN" not in md and "FA3" not in md
  assert "cuDNN" not in attention.summary(_result(alone))


def test_plots_name_the_gpu_and_keep_one_colour_per_implementation(tmp_path, monkeypatch):
  """The committed results' bar and line plots, redrawn: every title names the GPU, legends use the palette's
  user-facing names, an implementation has the same colour in every plot, and no two x tick labels
  overlap (the grid's other shapes have the longest); ``--render`` writes a result's md and plots beside
  it."""
  from matplotlib.colors import to_hex

  from benchmarks import latency
  figs, save = [], harness.save  # each figure kept for the checks below, written at a low resolution
  monkeypatch.setattr(harness, "save", lambda plt, fig, *a, **kw: figs.append(fig) or save(
      plt, fig, *a, **dict(kw, dpi=20)))
  results = ROOT / "benchmarks" / "results" / "h200"
  (tmp_path / "grid.json").write_text((results / "grid.json").read_text())
  attention.main(["--render", str(tmp_path / "grid.json")])
  assert {p.name for p in tmp_path.iterdir()} == {"grid.json", "grid.md", "grid.png", "grid_fwd.png"}
  for mod in (variants, latency, numerics):
    mod.render(harness.read_json(results / f"{mod.STEM}.json"), tmp_path / mod.STEM)
  assert len(figs) == 5
  colours, names = {}, {harness.style(n)[0] for n in harness.PALETTE}
  for fig in figs:
    assert fig._suptitle.get_text().endswith("— NVIDIA H200") and not harness.overlapping_ticks(fig)
    for lg in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
      for handle, text in zip(lg.legend_handles, lg.get_texts()):
        if text.get_text() in names:
          colour = handle.get_color() if hasattr(handle, "get_xdata") else handle.get_facecolor()
          colours.setdefault(text.get_text(), set()).add(to_hex(colour))
  assert set(colours) >= {"fa2_jax", "fa2_jax (deterministic)", "fa2_jax (Triton)", "cuDNN",
                          "FlashAttention-3", "FlashAttention-3 varlen", "tokamax", "XLA", "cuDNN on a batch"}
  assert all(len(c) == 1 for c in colours.values()), colours  # one colour per name in every plot
  one = {n: next(iter(c)) for n, c in colours.items()}
  assert one["cuDNN"] == one["cuDNN on a batch"] and one["fa2_jax"] == one["fa2_jax dense causal"]
  assert len({one[n] for n in ("fa2_jax", "fa2_jax (deterministic)", "fa2_jax (Triton)", "cuDNN",
                               "FlashAttention-3", "tokamax", "XLA")}) == 7  # implementations differ


def test_merge_later_measurement_wins_but_not_a_skip(tmp_path, monkeypatch):
  monkeypatch.setattr(harness, "pyplot", lambda: None)  # the merge alone (plots: the test above)
  a = [_cell("d128-8k-c", "fa2", 500.0, 400.0), _cell("d128-2k-c", "fa2", 300.0, 200.0)]
  b = [_cell("d128-8k-c", "fa2", 510.0, 410.0), _cell("d128-2k-c", "fa2", None, None, status="skipped"),
       _cell("d128-4k-c", "cudnn", 450.0, 420.0)]
  # a row that ran the same program as another, then a skip of it: the record of "same" stays
  a.append(dict(_cell("d128-1k-c", "fa2_det", None, None, status="same"), same_as="fa2"))
  b.append(_cell("d128-1k-c", "fa2_det", None, None, status="skipped"))
  # a measurement, then a crash of a partial rerun: the measurement stays; an error after a skip wins
  a.append(_cell("d128-16k-c", "fa2", 540.0, 480.0))
  b.append(dict(_cell("d128-16k-c", "fa2", None, None, status="crashed"), error="killed"))
  a.append(_cell("d128-512-c", "fa2", None, None, status="skipped"))
  b.append(dict(_cell("d128-512-c", "fa2", None, None, status="error"), error="boom"))
  p1, p2 = tmp_path / "a.json", tmp_path / "b.json"
  p1.write_text(json.dumps(_result(a, ["same note", "first note"])))
  p2.write_text(json.dumps(_result(b, ["same note"])))
  merged = harness.merge_json([p1, p2], attention.cell_key)
  by = {c["id"]: c for c in merged["cells"]}
  assert len(merged["cells"]) == 6
  assert by["d128-1k-c"]["status"] == "same" and by["d128-1k-c"]["source"] == str(p1)
  assert by["d128-16k-c"]["tflops"]["fwd"] == 540.0 and by["d128-16k-c"]["source"] == str(p1)
  assert by["d128-512-c"]["status"] == "error" and by["d128-512-c"]["source"] == str(p2)
  assert by["d128-8k-c"]["tflops"]["fwd"] == 510.0 and by["d128-8k-c"]["source"] == str(p2)
  assert by["d128-2k-c"]["tflops"]["fwd"] == 300.0 and by["d128-2k-c"]["source"] == str(p1)
  assert merged["notes"] == ["same note", "first note"] and merged["merged_from"] == [str(p1), str(p2)]
  other = tmp_path / "c.json"
  other.write_text(json.dumps(dict(_result([]), script="latency")))
  with pytest.raises(ValueError, match="different scripts"):
    harness.merge_json([p1, other], attention.cell_key)
  other.write_text("[1, 2]")
  with pytest.raises(ValueError, match="not a benchmark result"):
    harness.merge_json([other], attention.cell_key)
  data = attention.main(["--merge", str(p1), str(p2), "--out", str(tmp_path / "m")])
  assert len(data["cells"]) == 6 and (tmp_path / "m" / "attention_merged.md").exists()


def test_merge_of_a_bad_file_is_a_usage_error(tmp_path, capsys):
  """--merge with a missing, non-JSON or non-result file (or results of two scripts): usage and one
  line naming the file, exit code 2, no traceback; in every script that has --merge."""
  from benchmarks import context_schedule, latency, memory, models
  good, listed, text = tmp_path / "a.json", tmp_path / "list.json", tmp_path / "text.json"
  good.write_text(json.dumps(_result([_cell("d128-8k-c", "fa2", 500.0, 400.0)])))
  listed.write_text("[1, 2]")
  text.write_text("not json {")
  other = tmp_path / "lat.json"
  other.write_text(json.dumps(dict(_result([]), script="latency")))
  cases = [([tmp_path / "missing.json"], f"--merge: cannot read {tmp_path / 'missing.json'}: No such file"),
           ([tmp_path], f"--merge: cannot read {tmp_path}: Is a directory"),
           ([listed], f"--merge: {listed}: not a benchmark result (a JSON object with a 'cells' list)"),
           ([text], f"--merge: {text}: not a JSON file (Expecting value"),
           ([good, other], "--merge: cannot merge results of different scripts")]
  for paths, msg in cases:
    with pytest.raises(SystemExit) as e:
      attention.main(["--merge", *map(str, paths), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "usage: python -m benchmarks.attention" in err, err
  for mod in (variants, latency, memory, numerics, tune, models, context_schedule):
    for paths, msg in cases[:1] + cases[2:3]:
      with pytest.raises(SystemExit) as e:
        mod.main(["--merge", *map(str, paths), "--out", str(tmp_path / "m")])
      err = capsys.readouterr().err
      assert e.value.code == 2 and msg in err and f"usage: python -m {mod.__name__}" in err, err
  assert not (tmp_path / "m").exists()  # nothing written


def test_grid_cells_and_filters():
  head = attention.GRIDS["headline"]()
  ids = [c["id"] for c in head]
  assert len(ids) == len(set(ids)) == 24 + 6
  by = {c["id"]: c for c in head}
  assert by["d64-512-nc"]["batch"] == 32 and by["d64-512-nc"]["heads"] == 32
  assert by["d128-16k-c"]["batch"] == 1 and by["d128-16k-c"]["heads"] == 16
  assert (by["d128-8k-c-kv8"]["heads"], by["d128-8k-c-kv8"]["kv_heads"], by["d128-8k-c-kv8"]["batch"]) == (
      32, 8, 1)
  assert by["d128-4k-nc-kv8"]["batch"] == 2 and by["d256-8k-nc"]["heads"] == 8
  assert by["d128-32k-c"]["batch"] == 1 and by["d128-t128-s8k-nc"]["batch"] == 16
  args = attention.build_parser().parse_args(["--cells", "d64-*,*-kv8"])
  args.smoke = False
  got = {c["id"] for c in attention.select_cells(args)}
  assert got == {i for i in ids if i.startswith("d64-")} | {"d128-8k-c-kv8", "d128-4k-nc-kv8"}
  args = attention.build_parser().parse_args(["--cells", "d99-*"])
  args.smoke = False
  with pytest.raises(SystemExit, match="matches no cell of the headline grid"):
    attention.select_cells(args)


def test_cells_error_lists_the_ids_of_the_grid_that_runs():
  """On the CPU the smoke grid runs: an id of the GPU grid matches nothing there, and the message lists
  the smoke ids, not the GPU grid's (which hold the id asked for)."""
  with pytest.raises(SystemExit) as e:
    attention.main(["--cells", "d128-8k-c"])  # no GPU here: the CPU smoke size is chosen
  smoke_ids = " ".join(c["id"] for c in attention.GRIDS["smoke"]())
  assert str(e.value.code).endswith(f"matches no cell of the CPU smoke grid (--smoke, or no GPU); "
                                    f"its ids: {smoke_ids}"), e.value.code
  args = variants.build_parser().parse_args(["--smoke", "--cells", "window-32k"])
  with pytest.raises(SystemExit) as e:
    variants.select_cells(args)
  smoke_ids = " ".join(c.id for c in variants.build_cells("smoke"))
  assert "window-32k" not in smoke_ids.split()
  assert str(e.value.code).endswith(f"matches no cell of the CPU smoke cells (--smoke, or no GPU); "
                                    f"their ids: {smoke_ids}"), e.value.code


def test_smoke_summaries_say_they_are_no_measurement():
  """The console summary of a smoke-size result says its numbers (and ratios, gains, best settings)
  are no measurement; a GPU result's does not."""
  from benchmarks import context_schedule, models
  for summary in (attention.summary, tune.summary, models.summary, context_schedule.summary):
    for smoke in (False, True):
      first = summary({"config": {"smoke": smoke}, "cells": []}).splitlines()[0]
      assert first.endswith("(smoke size (CPU, Pallas interpret mode): not a measurement)") == smoke, (
          summary.__module__, first)


def test_count_flags_must_be_positive(capsys):
  """--iters / --reps and the other counts and sizes: a whole number >= 1, else usage + exit code 2."""
  from benchmarks import latency, memory, run_all
  bad = [(attention, ["--iters", "0"], "argument --iters: must be at least 1, got 0"),
         (attention, ["--reps", "-3"], "argument --reps: must be at least 1, got -3"),
         (variants, ["--iters", "2.5"], "argument --iters: not a whole number: '2.5'"),
         (tune, ["--iters", "0"], "argument --iters: must be at least 1"),
         (latency, ["--calls", "0"], "argument --calls: must be at least 1"),
         (latency, ["--input-sets", "0"], "argument --input-sets: must be at least 1"),
         (memory, ["--heads", "0"], "argument --heads: must be at least 1"),
         (numerics, ["--ref-chunk", "0"], "argument --ref-chunk: must be at least 1"),
         (numerics, ["--seqs", "1k,0"], "argument --seqs: sizes must be at least 1"),
         (attention, ["--budget-s", "0"], "argument --budget-s: must be a finite number > 0"),
         (run_all, ["--budget-s", "-1"], "argument --budget-s: must be a finite number > 0")]
  for mod, argv, msg in bad:
    with pytest.raises(SystemExit) as e:
      mod.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "usage:" in err, (mod.__name__, argv, err)
  args = attention.build_parser().parse_args(["--iters", "7", "--reps", "1", "--budget-s", "0.5"])
  assert (args.iters, args.reps, args.budget_s) == (7, 1, 0.5)
  harness.cpu_fallback(args, {"backend": "cpu"}, "attention")  # no GPU: the smoke size, a few calls
  assert args.smoke and (args.iters, args.reps) == (harness.SMOKE_ITERS, harness.SMOKE_REPS)


# --- the CPU smoke run of the grid and of run_all ----------------------------------------------------

def test_grid_smoke_on_cpu(tmp_path, capsys):
  # jax.nn.dot_product_attention (the xla peer) promotes its bfloat16 inputs with float32 implicitly,
  # forward and backward, which the suite's strict dtype promotion (tests/conftest.py) refuses.
  with jax.numpy_dtype_promotion("standard"):
    data = attention.main(["--smoke", "--out", str(tmp_path), "--cells", "d32-t32*", "--iters", "7",
                           "--reps", "5"])
  js = _load(tmp_path / "attention.json")
  # The smoke size times SMOKE_ITERS x SMOKE_REPS calls whatever --iters / --reps say: the config
  # records the counts that ran.
  assert (js["config"]["iters"], js["config"]["reps"]) == (2, 2) and js["config"]["smoke"]
  assert capsys.readouterr().out.startswith(
      "attention TFLOP/s fwd / fwd+bwd (smoke size (CPU, Pallas interpret mode): not a measurement)")
  # The command is the process's own argv (here pytest's, since main() runs in this process).
  assert js["status"] == "done" and js["meta"]["versions"]["jax"] and js["meta"]["command"].strip()
  assert "cudnn" in js["meta"]["absent_impls"]  # no GPU here: named, not measured
  by = {(c["id"], c["impl"]): c for c in js["cells"]}
  assert set(by) == {("d32-t32-s64-nc-kv2", n) for n in ("fa2", "fa2_det", "xla")}
  for cid in ("d32-t32-s64-nc-kv2",):
    assert by[(cid, "fa2_det")]["status"] == "same"  # the Triton backward is deterministic anyway
    for n in ("fa2", "xla"):
      c = by[(cid, n)]
      assert c["status"] == "ok", c
      assert c["tflops"]["fwd"] > 0 and c["tflops"]["fwd+bwd"] > 0 and c["rel_err"] < 2e-2
      assert c["flops_fwd"] == attention_flops(c["batch"], c["heads"], c["seq_q"], c["seq_k"],
                                               c["head_dim"], c["causal"])
      assert {(t["iters"], t["reps"]) for t in c["timing"].values()} == {(2, 2)}
  assert by[("d32-t32-s64-nc-kv2", "fa2")]["backend"].startswith("triton")
  md = (tmp_path / "attention.md").read_text()
  assert "| h32 T=32 S=64 non-causal (B=1, GQA 4/2) | " in md and " | = | " in md
  assert "smoke size on the CPU (Pallas interpret mode)" in md
  for png in ("attention.png", "attention_fwd.png"):
    assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC
  assert data["files"][0].endswith("attention.json")


def test_run_all_resumes_after_a_crash(tmp_path):
  out = tmp_path / "out"
  env = dict(os.environ, FA2_BENCH_TEST_CRASH="fa2")  # the fa2 cell "crashes" the stage process
  r = subprocess.run(
      [sys.executable, "-m", "benchmarks.run_all", "--only", "attention", "--out", str(out),
       "--budget-s", "200", "--stage-args", "attention=--cells d32-64-nc --impls fa2,xla"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "no GPU: running the CPU smoke size" in r.stdout and "resuming" in r.stdout
  js = _load(out / "attention.json")
  by = {c["impl"]: c for c in js["cells"]}
  assert by["fa2"]["status"] == "crashed" and by["xla"]["status"] == "ok" and js["resumed"] == 1
  assert (out / "run_all.md").exists() and (out / "attention.md").exists()


@pytest.mark.parametrize("module, args, message", [
    ("benchmarks.attention", ["--cells", ",,"], "--cells: names nothing"),
    ("benchmarks.variants", ["--impls", ""], "--impls: names no implementation"),
    ("benchmarks.diag.compile_time", ["--shape", "a,b"], "--shape: not B,T,N,H"),
    ("benchmarks.diag.compile_time", ["--shape", "1,2,3"], "--shape: must be four whole numbers"),
    ("benchmarks.diag.compile_time", ["--shapes", ""], "--shapes: names no shape"),
    ("benchmarks.diag.compile_time", ["--length-multiple", "-8", "--reuse-kernels"],
     "--length-multiple: must be at least 1"),
    ("benchmarks.diag.registers", ["--shapes", "1,2"], "--shapes: must be four whole numbers"),
    ("benchmarks.diag.ab", ["--base", "x", "--rounds", "0"], "--rounds: must be at least 1"),
])
def test_bad_flags_are_one_line_errors_naming_the_flag(module, args, message):
  """An empty list means nothing, not every cell; a malformed shape or count stops before any work,
  as an argparse error (exit 2, no traceback)."""
  r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                     timeout=120, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_resume_without_earlier_results_says_it_starts_afresh(tmp_path, capsys):
  from benchmarks.harness import Recorder
  rec = Recorder(tmp_path / "grid.json", {}, {}, "test", resume=True)
  assert rec.done == set() and "no earlier results" in capsys.readouterr().err
  Recorder(tmp_path / "grid.json", {}, {}, "test", resume=True)  # the file exists now: no notice
  assert "no earlier results" not in capsys.readouterr().err


def test_diag_ab_checks_its_flags_before_timing():
  """--new-config and --kwargs are tried on this checkout's call for every cell first: a bad value
  is a one-line error naming the flag, before the base version is imported or anything is timed."""
  from benchmarks.diag import ab
  cells = ab.parse_cells("1,256,2,64,c")
  for new_config, kwargs, flag in (({"block_k": 3}, {}, "--new-config: MosaicConfig.block_k"),
                                   ({}, {"foo": 1}, "--kwargs: .*foo"),
                                   ({}, {"local_window_size": -1}, "--kwargs: local_window_size")):
    with pytest.raises(SystemExit, match=flag):
      ab.check_arguments(cells, new_config, kwargs)
  ab.check_arguments(cells, {"dq_fused": False}, {"logits_soft_cap": 30.0})
  with pytest.raises(SystemExit, match="--new-config: at 2,8192,16,128,nc: .*shared memory"):
    ab.check_arguments(ab.parse_cells("2,8192,16,128,nc"), {"num_stages_dkv": 3}, {})
  with pytest.raises(SystemExit, match=r"--kwargs: \['deterministic'\] are set by"):
    ab.check_arguments(cells, {}, {"deterministic": True})
  with pytest.raises(SystemExit, match="--cells: 1,256,2,72,c: head_dim: .*multiples of 16"):
    ab.check_arguments(ab.parse_cells("1,256,2,72,c"), {"dq_fused": False}, {})
  with pytest.raises(SystemExit, match="--cells: '0,8,2,64,c'"):
    ab.parse_cells("0,8,2,64,c")
  # GQA cells: K KV heads after the mask, a divisor of N
  assert ab.parse_cells("4,4096,28,128,c,4;2,512,8,64,nc") == [(4, 4096, 28, 128, True, 4),
                                                               (2, 512, 8, 64, False, 8)]
  assert ab.cell_name(4, 4096, 28, 128, True, 4) == "4,4096,28,128,c,4"
  assert ab.cell_name(2, 512, 8, 64, False, 8) == "2,512,8,64,nc"
  for bad in ("1,64,6,32,c,4", "1,64,6,32,c,0", "1,64,6,32,c,2,1"):
    with pytest.raises(SystemExit, match="K a divisor of N"):
      ab.parse_cells(bad)
  with pytest.raises(SystemExit, match="--kwargs: local_window_size"):
    ab.check_arguments(ab.parse_cells("1,256,4,64,c,2"), {}, {"local_window_size": -1})


def test_gpu_script_rejects_an_unknown_mode(tmp_path):
  for args, env, msg in ((["nope"], {}, "mode must be one of"), (["gpt", "flash", "fa9"], {}, "'fa9'"),
                         (["ablation"], {}, "mode must be one of"),  # a mode that was removed
                         (["tests grid"], {}, "mode must be one of"),  # one word, not two modes
                         (["gpt", "pmap", "flash"], {}, "takes no further arguments"),
                         (["gpt", "flash", "pmap"], {}, "pmap alone"),
                         (["grid"], {"GPU_TIMEOUT": "10m"}, "GPU_TIMEOUT"),
                         (["tests"], {"GPU_TEST_WORKERS": "0"}, "GPU_TEST_WORKERS"),
                         (["tests"], {"GPU_TEST_WORKERS": "two"}, "GPU_TEST_WORKERS")):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), *args], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, OUT=str(tmp_path), **env))
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_gpu_script_runs_just_the_node_ids_given(tmp_path):
  """``gpu.sh tests FILE::TEST`` runs that test alone (collected here, not run: no GPU), not the whole
  suite and the fuzz profile after it."""
  node = "tests/test_gpt.py::test_resume_is_bit_identical_on_gpu_with_deterministic_ops"
  path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
  r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), "tests", node, "--collect-only"],
                     capture_output=True, text=True, timeout=300, cwd=ROOT,
                     env=dict(os.environ, OUT=str(tmp_path), GPU_TIMEOUT="240", PATH=path))
  log = (tmp_path / "tests" / "tests.log").read_text()
  assert r.returncode == 0, r.stdout + r.stderr
  assert "1 test collected" in log and node in log, log
  assert not (tmp_path / "tests" / "fuzz.log").exists()


def test_durations_file_gets_each_test_as_it_finishes(tmp_path):
  """FA2_TEST_DURATIONS (set by ``gpu.sh tests``): one line per test, outcome, seconds and node id,
  skipped ones too (here a GPU test on a CPU machine)."""
  if jax.default_backend() == "gpu":
    pytest.skip("the GPU case below would run")
  path = tmp_path / "durations.tsv"
  nodes = ["tests/test_dispatch.py::test_non_hopper_gpus_get_the_triton_kernels",
           "tests/test_gpt.py::test_resume_is_bit_identical_on_gpu_with_deterministic_ops"]
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes],
                     capture_output=True, text=True, timeout=300, cwd=ROOT,
                     env=dict(os.environ, FA2_TEST_DURATIONS=str(path)))
  assert r.returncode == 0, r.stdout + r.stderr
  lines = [line.split("\t") for line in path.read_text().splitlines()]
  assert {o for o, _, n in lines if "dispatch" in n} == {"passed"} and len(lines) > 2
  assert [o for o, _, n in lines if "test_gpt" in n] == ["skipped"]
  assert all(float(d) >= 0 for _, d, _ in lines)


def test_first_tests_start_at_the_heads_of_the_worker_shares():
  """FA2_TEST_FIRST (passed on by ``gpu.sh tests``): the tests it names come first, one at the head of
  each xdist worksteal share, in a real collection and in the ordering helper itself."""
  from conftest import _heads_first
  assert _heads_first(list(range(20)), lambda x: x in (5, 17, 18, 19), 4) == [
      5, 0, 1, 2, 3, 17, 4, 6, 7, 8, 18, 9, 10, 11, 12, 19, 13, 14, 15, 16]  # shares of 5 items
  assert _heads_first(list(range(6)), lambda x: x > 3, 1) == [4, 5, 0, 1, 2, 3]
  assert sorted(_heads_first(list(range(3)), lambda x: x > 0, 8)) == [0, 1, 2]  # more workers than items
  def collected(**env):  # the node names pytest collects, in order, with FA2_TEST_FIRST etc. in env
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--collect-only", "-k", "not hopper_gets", "tests/test_dispatch.py"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={k: v for k, v in dict(os.environ, **env).items() if v is not None})
    assert r.returncode == 0, r.stdout + r.stderr
    return [line.split("::")[1] for line in r.stdout.splitlines() if "::" in line]
  plain = collected(FA2_TEST_FIRST=None)
  first = ["test_mosaic_refusal_names_the_reason", "test_compute_capability_parsing"]
  ids = collected(FA2_TEST_FIRST="refusal_names,capability_parsing", PYTEST_XDIST_WORKER_COUNT="2")
  # reordered after the -k deselection: two shares of the tests that run, each led by one
  rest = [x for x in plain if x not in first]
  half = len(plain) // 2
  assert ids == [first[0]] + rest[:half - 1] + [first[1]] + rest[half - 1:], ids


# --- the variants' speed bars ----------------------------------------------------------------------------

def test_variants_attended_pairs_match_the_library_masks():
  """Every row's pair count is the number of (query, key) pairs its reference attends: with q = k = 0
  each row's lse is log(number of allowed keys), read back from fa2_jax.reference_attention."""
  assert variants.causal_pairs(5) == 15 and variants.causal_pairs(5, 1) == 9  # 1 + 2 + 2 + 2 + 2
  i, j = np.arange(300)[:, None], np.arange(300)[None, :]
  for left in (0, 7, 298, 299, 1000):
    assert variants.causal_pairs(300, left) == int(((j <= i) & (j >= i - left)).sum()), left
  counted = {}
  for cell in variants.build_cells("smoke"):
    for row in cell.rows:
      key = (cell.id, row.layout, repr(sorted(row.ref.items())))  # rows of one attention: counted once
      if key not in counted:
        kw = variants._resolve(row.ref, cell.arrays)
        z = np.zeros((*cell.layouts[row.layout], 1, 8), np.float32)
        lse = jax.jit(lambda z: fa2_jax.reference_attention(z, z, z, return_residual=True, **kw)[1])(z)
        counted[key] = float(jnp.exp(lse).sum())
      assert counted[key] == pytest.approx(row.pairs, rel=1e-5), (cell.id, row.name)


def test_variants_cells_documents_and_bars():
  lens = variants.ragged_lengths(32768, 100, 8192)
  assert sum(lens) == 32768 and min(lens) >= 100 and max(lens) <= 8192 and len(lens) > 4
  assert lens == variants.ragged_lengths(32768, 100, 8192)  # a fixed seed: the same documents
  with pytest.raises(ValueError, match="lo <= hi"):
    variants.ragged_lengths(10, 20, 10)
  cells = {c.id: c for c in variants.build_cells("full")}
  assert list(cells) == ["window-32k", "window-128k", "packed-8x4k", "packed-ragged", "softcap-8k-c",
                         "softcap-8k-nc", "padding-8k-nc", "padding-8k-c", "maskfn-causal-32k",
                         "maskfn-window-32k"]
  packed = cells["packed-8x4k"]
  assert packed.layouts == {"packed": (1, 32768), "batch": (8, 4096)}
  assert {r.name: r.pairs for r in packed.rows} == dict.fromkeys(
      ("fa2", "fa2_batch", "fa3_varlen", "cudnn_batch"), 8 * 4096 * 4097 // 2)
  assert packed.arrays["cu"].tolist() == list(range(0, 32769, 4096))
  ragged = cells["packed-ragged"]
  assert ragged.layouts["batch"] == (len(lens), -(-max(lens) // 128) * 128)
  assert variants.timed_fn(ragged.rows[0])[1] == ("seg", "seg")  # runtime arrays, one per argument
  # Bars: window rate >= 0.9x dense causal per pass; padding time <= 0.55x; missing rows give n/a.
  row = lambda cid, kind, name, ms, tf: dict(id=cid, kind=kind, row=name, ms=ms, tflops=tf)  # noqa: E731
  fake = [row("w", "window", "fa2", {}, {"fwd": 450.0, "fwd+bwd": 300.0}),
          row("w", "window", "fa2_dense", {}, {"fwd": 500.0, "fwd+bwd": 400.0}),
          row("p", "padding", "fa2", {"fwd": 1.0, "fwd+bwd": 2.0}, {}),
          row("p", "padding", "fa2_full", {"fwd": 2.0, "fwd+bwd": 4.0}, {}),
          row("m", "maskfn", "fa2", {"fwd": 1.0, "fwd+bwd": 2.0}, {})]
  got = {b["cell"]: b for b in variants.evaluate(fake)}
  assert got["w"]["ratio"] == {"fwd": pytest.approx(0.9), "fwd+bwd": pytest.approx(0.75)}
  assert got["w"]["ok"] == {"fwd": True, "fwd+bwd": False} and got["w"]["verdict"] == "fail"
  assert got["p"]["ratio"]["fwd+bwd"] == pytest.approx(0.5) and got["p"]["verdict"] == "pass"
  assert got["m"]["verdict"] == "n/a"
  # The log's BAR lines: a verdict of the smoke size is marked as no measurement, a GPU run's is not.
  for smoke in (False, True):
    text = variants.summary({"config": {"smoke": smoke}, "cells": fake})
    bar = next(ln for ln in text.splitlines() if "BAR p " in ln)
    assert bar.endswith("-> pass (smoke size (CPU, Pallas interpret mode): not a measurement)"
                        if smoke else "-> pass"), bar
  with pytest.raises(SystemExit, match="xla has no rows here"):
    variants.main(["--impls", "fa2,xla", "--list-cells"])


def test_variants_smoke_on_cpu(tmp_path, capsys):
  data = variants.main(["--smoke", "--out", str(tmp_path), "--cells", "padding-*-nc"])
  js = _load(tmp_path / "variants.json")
  assert js["status"] == "done" and js["config"]["smoke"] and data["files"][0].endswith("variants.json")
  assert (js["config"]["iters"], js["config"]["reps"]) == (2, 2)
  # The console marks the bars' verdicts at the smoke size as no measurement, as the .md does.
  out = capsys.readouterr().out
  bars = [ln for ln in out.splitlines() if ln.lstrip().startswith("BAR ")]
  assert bars and all(re.search(r"-> (pass|fail|n/a) \(smoke size \(CPU, Pallas interpret mode\): "
                                r"not a measurement\)$", ln) for ln in bars), bars
  assert "the bars' verdicts mean nothing" in out.splitlines()[0]
  by = {c["row"]: c for c in js["cells"]}
  assert set(by) == {"fa2", "fa2_full", "cudnn"}
  assert by["cudnn"]["status"] == "unavailable" and "GPU" in by["cudnn"]["error"]  # named, not measured
  for name in ("fa2", "fa2_full"):
    c = by[name]
    assert c["status"] == "ok", c
    assert c["ms"]["fwd"] > 0 and c["tflops"]["fwd+bwd"] > 0 and c["rel_err"] < 2e-2, c
    assert c["flops_fwd"] == 4.0 * c["heads"] * c["head_dim"] * c["pairs"]
  assert by["fa2"]["pairs"] * 4 == by["fa2_full"]["pairs"]  # half the rows and half the keys
  md = (tmp_path / "variants.md").read_text()
  assert "## Bars" in md and "fa2 at 50% fill ≤ 0.55× the unpadded time" in md and "absent" in md
  assert (tmp_path / "variants.png").read_bytes()[:8] == PNG_MAGIC


def test_numerics_reference_matches_autodiff():
  """The chunked float64 reference (forward and analytic gradients) equals jax autodiff of the plain
  formula, also across chunk boundaries and with a causal mask."""
  q, k, v, do = numerics.exact_inputs(3, (1, 48, 2, 16))
  cpu = jax.devices("cpu")[0]
  for causal in (False, True):
    ref = numerics.reference_f64(q, k, v, do, scale=0.25, causal=causal, device=cpu,
                                 chunk_elems=16 * 48)  # chunks of 16 rows
    with jax.enable_x64(True):
      @jax.jit
      def autodiff(q, k, v, do):
        (o, lse), pull = jax.vjp(lambda q, k, v: fa2_jax.reference_attention(
            q, k, v, scale=0.25, is_causal=causal, return_residual=True), q, k, v)
        return (o, lse, *pull((do, jnp.zeros_like(lse))))
      got = autodiff(*[jnp.asarray(x, jnp.float64) for x in (q, k, v, do)])
      for name, g in zip(("out", "lse", "dq", "dk", "dv"), got):
        np.testing.assert_allclose(ref[name], np.asarray(g), atol=1e-11, err_msg=name)


# slow (CI time: two processes compiling, about 15 s): the compile-time diagnostic's persistent-cache mode
@pytest.mark.slow
def test_compile_time_new_shapes_with_a_persistent_cache(tmp_path):
  """``--shapes`` times one call site per shape in order (CPU-sized shapes without a GPU), and
  ``--cache-dir`` turns on JAX's persistent compilation cache there: its entries are written."""
  cache, out = tmp_path / "cache", tmp_path / "out"
  cmd = [sys.executable, "-m", "benchmarks.diag.compile_time", "--impls", "fa2_triton",
         "--shapes", "1,64,2,32;1,128,2,32", "--cache-dir", str(cache), "--out", str(out)]
  subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300,
                 cwd=Path(__file__).resolve().parents[1])
  rows = json.loads((out / "compile_time_shapes.json").read_text())["rows"]
  assert [r["order"] for r in rows] == [0, 1] and all("error" not in r for r in rows)
  assert all(r["lower_s"] > 0 and r["compile_s"] > 0 for r in rows)
  assert any(cache.iterdir())
  subprocess.run(cmd[:-2] + ["--non-causal", "--out", str(out)], check=True, capture_output=True,
                 text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
  rows = json.loads((out / "compile_time_shapes.json").read_text())["rows"]
  assert [r["causal"] for r in rows] == [False, False] and all("error" not in r for r in rows)


# slow (CI time: two processes lowering, about 15 s): the compile-time diagnostic's sm90 lowering and
# kernel cache; a later process reading the kernel cache runs in CI in test_kernel_reuse.py
@pytest.mark.slow
def test_compile_time_lowers_for_sm90_and_reads_the_kernel_cache(tmp_path):
  """``--lower-for-sm90`` lowers the Mosaic kernels for sm90 without a GPU, shapes as given, and
  times the lowering alone; with ``--cache-dir --reuse-kernels`` a second process reads the kernels
  that the first wrote (``DIR/fa2_jax_kernels``)."""
  cache, out = tmp_path / "cache", tmp_path / "out"
  cmd = [sys.executable, "-m", "benchmarks.diag.compile_time", "--impls", "fa2", "--shapes",
         "1,512,2,128;1,768,2,128", "--lower-for-sm90", "--cache-dir", str(cache), "--reuse-kernels",
         "--out", str(out)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for process in range(2):
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300, env=env,
                   cwd=Path(__file__).resolve().parents[1])
    data = json.loads((out / "compile_time_shapes_lowered_sm90.json").read_text())
    reuse, rows = data["meta"]["kernel_reuse"], data["rows"]
    assert (reuse["writes"], reuse["reads"]) == ((reuse["misses"], 0) if process == 0 else
                                                  (0, reuse["misses"]))
    assert data["meta"]["lower_for_sm90"] and [r["shape"] for r in rows] == [[1, 512, 2, 128],
                                                                             [1, 768, 2, 128]]
    assert all("error" not in r and r["lower_s"] > 0 and "compile_s" not in r for r in rows)
  assert len(list((cache / "fa2_jax_kernels").glob("*.jax_exported"))) >= 4


@pytest.mark.parametrize("argv, message", [
    (["--other-programs"], "--other-programs needs --shapes"),
    (["--shapes", "1,64,2,32", "--length-multiple", "64"], "--length-multiple needs --reuse-kernels"),
])
def test_compile_time_rejects_flags_without_their_mode(argv, message, capsys):
  from benchmarks.diag import compile_time
  with pytest.raises(SystemExit):
    compile_time.main(argv)
  assert message in capsys.readouterr().err


def test_ab_compares_a_copy_of_this_checkout(tmp_path):
  """The A/B diagnostic imports another version's sources (here a copy of this checkout's, laid out
  as `git archive` writes them) beside fa2_jax and times both: identical code gives identical
  gradients, and every rate is positive."""
  import shutil
  from benchmarks.diag import ab
  base = tmp_path / "base"
  for name in ("fa2_jax", "kernels"):
    shutil.copytree(ROOT / name, base / name, ignore=shutil.ignore_patterns("__pycache__"))
  ab.main(["--base", str(base), "--cells", "1,64,2,32,c", "--rounds", "1", "--iters", "1",
           "--reps", "1", "--out", str(tmp_path / "out"),
           "--kwargs", "{'logits_soft_cap': 5.0, 'local_window_size': [20, 0]}"])
  report = _load(tmp_path / "out" / "ab.json")
  (row,) = report["rows"]
  assert report["kwargs"] == {"logits_soft_cap": "5.0", "local_window_size": "(20, 0)"}
  assert row["cell"] == "1,64,2,32,c" and row["grad_rel_diff"] == [0.0, 0.0, 0.0]
  assert all(row["tflops"][v][p] > 0 for v in ("base", "new") for p in ("fwd", "fwd+bwd"))
  assert sys.modules[ab.BASE_NAME].flash_attention.__module__.startswith(ab.BASE_NAME + ".")
  with pytest.raises(SystemExit, match="--base"):
    ab.import_base(str(tmp_path / "out"))
  with pytest.raises(SystemExit, match="B,T,N,H,c"):
    ab.parse_cells("1,64,2,32")
  assert ab.parse_config("compute_registers=240,memory_registers=24,dq_fused=false") == dict(
      compute_registers=240, memory_registers=24, dq_fused=False)
  assert fa2_jax.MosaicConfig.default(64).replace(**ab.parse_config("dq_fused_min_t=0")).dq_fused_min_t == 0
  with pytest.raises(SystemExit, match="--new-config: 'registers=240'"):
    ab.parse_config("registers=240")
  with pytest.raises(SystemExit, match="--kwargs"):
    harness.call_kwargs("logits_soft_cap=5")
  with pytest.raises(SystemExit, match="--kwargs"):
    harness.call_kwargs("[1, 2]")
  kw = harness.call_kwargs('{"alibi_slopes": [0.5, 0.25], "local_window_size": [3, 0]}')
  assert kw["local_window_size"] == (3, 0) and kw["alibi_slopes"].dtype == np.float32
  x = jnp.ones((1, 8, 2, 16))
  assert fa2_jax.flash_attention(x, x, x, implementation="xla", **kw).shape == x.shape


def test_registers_parses_ptxas_reports():
  """The register diagnostic reads ptxas' -v report, one row per entry function."""
  from benchmarks.diag import registers
  text = """ptxas info    : (C7519) warpgroup.arrive is injected in around line 621 by compiler
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fa2_mosaic_dkdv_dq_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for fa2_mosaic_dkdv_dq_mosaic_gpu_kernel
    160 bytes stack frame, 208 bytes spill stores, 232 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 160 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compiling entry function 'fa2_mosaic_dq_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for fa2_mosaic_dq_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 16 barriers, 1 bytes smem
"""
  assert registers.parse_ptxas(text) == [
      dict(kernel="fa2_mosaic_dkdv_dq", registers=168, stack_bytes=160, spill_store_bytes=208,
           spill_load_bytes=232),
      dict(kernel="fa2_mosaic_dq", registers=128, stack_bytes=0, spill_store_bytes=0,
           spill_load_bytes=0)]
  assert registers.parse_ptxas("ptxas info    : 0 bytes gmem\n") == []
  serial = ("ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are "
            "serialized due to insufficient register resources for the wgmma pipeline in the function "
            "'fa2_mosaic_dkdv_dq_mosaic_gpu_kernel'\n")
  assert registers.advisories(text) == dict(serialized=0, arrive=1, codes={"C7519": 1})
  assert registers.advisories(serial + text) == dict(serialized=1, arrive=1,
                                                     codes={"C7510": 1, "C7519": 1})
  case = dict(shape="2,8192,16,128", causal=True, impl="fa2")
  line = registers.format_row(dict(case, **registers.parse_ptxas(text)[0],
                                   advisories=registers.advisories(serial)))
  assert line.split() == ["2,8192,16,128", "c", "fa2", "fa2_mosaic_dkdv_dq", "168", "160", "208", "232",
                          "1", "0"]
  assert registers.format_row(dict(case, causal=False, error="boom")).split() == [
      "2,8192,16,128", "nc", "fa2", "boom"]


# --- decode latency against a KV cache -------------------------------------------------------------------

def test_decode_cells_parse_and_select(capsys):
  """The cell list: readable ids and labels, the quick subset, ragged lengths and shuffled page tables
  from fixed seeds, the K/V bytes the TB/s count, the flags, each row's limits, FA3's split count."""
  from benchmarks import decode
  from fa2_jax import DecodeConfig
  full = decode.build_cells("full")
  by = {c.id: c for c in full}
  assert list(by) == ["1x8k", "1x128k", "8x32k", "16x32k", "64x8k", "8x32k-ragged", "32x16k-ragged",
                      "8x32k-t4", "8x32k-t16", "8x32k-mqa", "8x32k-d64", "8x32k-d256", "8x32k-paged16",
                      "8x32k-paged256"]
  assert [c.id for c in decode.build_cells("quick")] == list(decode.QUICK)
  assert by["8x32k-ragged"].label == "8 × 32k ragged (4k–32k)" and by["1x8k"].label == "1 × 8k"
  assert by["8x32k-t4"].label == "8 × 32k, T_new 4" and by["8x32k-mqa"].label == "8 × 32k, MQA 32/1"
  assert by["8x32k-paged16"].label == "8 × 32k, paged (16-key pages)"
  assert (by["8x32k-d256"].head_dim, by["8x32k-mqa"].kv_heads, by["8x32k-t16"].t_new) == (256, 1, 16)
  big = by["1x128k"]
  assert big.kv_bytes() == 2 * 131072 * 8 * 128 * 2 and big.block_table() is None
  assert big.lengths().tolist() == [131072]
  ragged = by["32x16k-ragged"].lengths()
  assert ragged.dtype == np.int32 and ragged.min() >= 2048 and ragged.max() <= 16384
  assert len(set(ragged.tolist())) > 16 and ragged.tolist() == by["32x16k-ragged"].lengths().tolist()
  assert by["32x16k-ragged"].kv_bytes() == 2 * int(ragged.sum()) * 8 * 128 * 2
  table = by["8x32k-paged16"].block_table()
  assert table.shape == (8, 2048) and sorted(table.ravel().tolist()) == list(range(8 * 2048))
  assert table.ravel().tolist() != sorted(table.ravel().tolist())  # shuffled
  # flags: the issue's 5 x 20 calls; patterns of ids; rows by name; FA3's splits
  args = decode.build_parser().parse_args(["--cells", "8x32k-paged*"])
  assert (args.iters, args.reps, args.fa3_splits) == (20, 5, None)
  args.smoke = False
  assert [c.id for c in decode.select_cells(args)] == ["8x32k-paged16", "8x32k-paged256"]
  args = decode.build_parser().parse_args(["--quick", "--cells", "16x32k", "--fa3-splits", "3"])
  assert args.fa3_splits == 3
  args.smoke = False
  with pytest.raises(SystemExit, match="matches no cell of the quick cells"):
    decode.select_cells(args)
  with pytest.raises(SystemExit):
    decode.build_parser().parse_args(["--impls", "fa2,fa4"])
  assert "unknown rows ['fa4']" in capsys.readouterr().err
  assert decode.build_parser().parse_args(["--impls", "fa2,fa3"]).impls == ["fa2", "fa3"]
  # what each row cannot express, and the size each row runs
  rows = decode.ROWS
  assert "T_new = 1 only" in decode.unsupported(rows["cudnn"], by["8x32k-t4"])
  assert "no paged cache" in decode.unsupported(rows["xla"], by["8x32k-paged256"])
  assert "head_dim 128 only" in decode.unsupported(rows["fa3"], by["8x32k-d64"])
  assert decode.unsupported(rows["fa3"], by["8x32k-paged16"]) is None
  assert all(decode.unsupported(rows[n], c) is None for n in ("fa2", "fa2_train") for c in full)
  assert decode.unsupported(rows["xla"], by["64x8k"]) is None  # 64 MiB of f32 scores
  # FA3's own heuristic (batch counted as 1 with cache_seqlens): 15 splits of 8 K/V heads' tiles
  assert decode.fa3_num_splits(by["8x32k"]) == 15 and decode.fa3_num_splits(by["8x32k-mqa"]) == 109
  assert decode.fa3_num_splits(decode.make_cell(1, 512)) == 1  # 3 key blocks: never split
  # --sweep: the DecodeConfig grid, the default left out (it is the fa2 row)
  assert len(decode.sweep_configs()) == 36
  sweep = decode.sweep_rows(by["8x32k"])
  default = DecodeConfig.default(128, jnp.bfloat16)
  assert len(sweep) == 35 and all(r.impl == "fa2" and r.config != default for r in sweep)
  # the references the md gives: the copy rate (read + write bytes) and the dispatch floor
  copy = timing.copy_rate(2 ** 16)
  assert copy["bytes"] == 2 ** 16 and copy["tbps"] == pytest.approx(2 * 2 ** 16 / copy["median_s"] / 1e12)
  assert decode.dispatch_floor(2, 2)["us"] > 0


def test_decode_fa3_row_passes_the_cache_lengths_and_page_table(monkeypatch):
  """FlashAttention-3's kvcache call (a stand-in module here: the wheel is GPU-only) gets the pages
  as its cache, the page table, the lengths as cache_seqlens, causal, and the split count."""
  import types
  from benchmarks import decode
  seen = {}

  def kvcache(q, k_cache, v_cache, **kw):
    seen.update(kw, shape=k_cache.shape)
    return q

  monkeypatch.setitem(sys.modules, "flash_attn3_jax", types.SimpleNamespace(flash_mha_with_kvcache=kvcache))
  cell = decode.make_cell(2, 256, t_new=4, heads=4, kv_heads=2, head_dim=32, page_size=16,
                          base=decode.SMOKE_BASE)
  q, k, v, lens, off, table = decode.make_inputs(cell, 0)
  assert k.shape == (32, 16, 2, 32) and table.shape == (2, 16) and off.tolist() == [252, 252]
  assert decode.call_fn(decode.ROWS["fa3"], cell, fa3_splits=3)(q, k, v, lens, off, table) is q
  assert seen.pop("page_table") is table and seen.pop("cache_seqlens") is lens
  assert seen == dict(is_causal=True, num_splits=3, shape=(32, 16, 2, 32))


def _decode_result(tmp_path):
  """A synthetic result: two cells, every row, a flagged output, a sweep row."""
  from benchmarks import decode
  plain, t4 = decode.make_cell(8, 32768), decode.make_cell(8, 32768, t_new=4)
  timed = {("8x32k", "fa2"): 400.0, ("8x32k", "fa2_train"): 900.0, ("8x32k", "cudnn"): 500.0,
           ("8x32k", "fa3"): 320.0, ("8x32k", "xla"): 2000.0, ("8x32k-t4", "fa2"): 450.0,
           ("8x32k-t4", "fa3"): 360.0, ("8x32k", decode.config_name(decode.sweep_configs()[0])): 380.0}
  cells = []
  for cell in (plain, t4):
    for row in list(decode.ROWS.values()) + [decode.Row(decode.config_name(decode.sweep_configs()[0]),
                                                        "fa2", "a sweep row", decode.sweep_configs()[0])]:
      rec = decode.record(cell, row)
      us = timed.get((cell.id, row.name))
      if us is None:
        if decode.unsupported(row, cell) is None:
          continue
        rec.update(status="unsupported", error=decode.unsupported(row, cell))
      else:
        rec.update(us=us, tbps=rec["kv_bytes"] / us / 1e6, max_abs_err=2e-4, ref_max=0.05,
                   err_vs="fa2" if row.name != "fa2" else "f32 formula, rows 0, 7")
      if row.name == "fa2":
        rec["config"] = "bk64 splits auto waves 2 warps 4 stages 2"
      cells.append(rec)
  flagged = next(c for c in cells if (c["id"], c["row"]) == ("8x32k", "fa3"))
  flagged.update(max_abs_err=0.04, warning="output off the fa2: max abs error 0.04")
  data = {"script": "decode", "status": "done", "meta": {"gpu_name": "NVIDIA H200", "versions": {},
                                                         "command": "python -m benchmarks.decode"},
          "config": {"dtype": "bf16", "iters": 20, "reps": 5, "err_tol": decode.ERR_TOL},
          "copy": {"tbps": 4.1, "what": "jit(x + 1)"}, "floor": {"us": 9.5, "what": "q * 2"},
          "cells": cells, "notes": []}
  path = tmp_path / "decode.json"
  path.write_text(json.dumps(data))
  return path


def test_decode_table_and_plot_render_from_json(tmp_path, monkeypatch):
  """``--render``: a row per cell with µs (TB/s) per implementation, fa2_jax's time ratios to cuDNN
  and FA3, the copy rate in the header, the flagged output marked, the error table, the sweep; the
  plot's two panels (time, TB/s) with the GPU in the title and the palette's names."""
  from benchmarks import decode
  figs, save = [], harness.save
  monkeypatch.setattr(harness, "save", lambda plt, fig, *a, **kw: figs.append(fig) or save(
      plt, fig, *a, **dict(kw, dpi=20)))
  path = _decode_result(tmp_path)
  data = decode.main(["--render", str(path)])
  assert {p.name for p in tmp_path.iterdir()} == {"decode.json", "decode.md", "decode.png"}
  lines = (tmp_path / "decode.md").read_text().splitlines()
  row = lambda start: next(x for x in lines if x.startswith(start))  # noqa: E731
  assert row("| cell") == (
      "| cell: µs per call (TB/s); copy rate 4.10 TB/s | K/V read | fa2_jax | fa2_jax (training kernels) "
      "| cuDNN | FlashAttention-3 | XLA | fa2_jax ÷ cuDNN (time) | fa2_jax ÷ FA3 (time) |")
  assert row("| 8 × 32k |") == ("| 8 × 32k | 1,074 MB | 400 (2.68) | 900 (1.19) | 500 (2.15) "
                                "| 320 (3.36) ⚠ | 2000 (0.54) | 0.80 | 1.25 |")
  assert row("| 8 × 32k, T_new 4 |") == ("| 8 × 32k, T_new 4 | 1,074 MB | 450 (2.39) | – | n/a "
                                          "| 360 (2.98) | n/a | – | 1.25 |")
  assert "| 8 × 32k | 2.0e-04 | 2.0e-04 | 2.0e-04 | 4.0e-02 ⚠ | 2.0e-04 |" in lines
  assert any("copy rate: 4.10 TB/s" in x for x in lines) and any("9.5 µs per call" in x for x in lines)
  assert "## DecodeConfig sweep" in lines
  assert row("| cfg bk32").endswith("| 380 | 2.83 | 0.95 | – |")
  assert row("| default (bk64").endswith("| 400 | 2.68 | 1.00 | – |")
  assert any(x.startswith("- **FlashAttention-3** warning (8x32k)") for x in lines)
  assert decode.summary(data).splitlines()[1].split() == ["8x32k", "fa2", "400", "(2.68)", "err", "2.0e-04"]
  (fig,) = figs
  assert fig._suptitle.get_text().endswith("— NVIDIA H200") and len(fig.axes) == 2
  assert fig.axes[0].get_yscale() == "log" and not harness.overlapping_ticks(fig)
  legend = [t.get_text() for t in fig.legends[0].get_texts()]
  assert legend[:5] == ["fa2_jax", "fa2_jax (training kernels)", "cuDNN", "FlashAttention-3", "XLA"]
  assert "cfg" not in " ".join(legend) and "copy rate (4.10 TB/s)" in legend
  # --merge: a later run's cell wins unless that run only skipped it
  later = _load(path)
  later["cells"] = [dict(c, status="skipped", us=None) if (c["id"], c["row"]) == ("8x32k", "fa2")
                    else dict(c, us=c["us"] / 2) if (c["id"], c["row"]) == ("8x32k", "cudnn") else c
                    for c in later["cells"] if c["id"] == "8x32k"]
  (tmp_path / "later.json").write_text(json.dumps(later))
  merged = decode.main(["--merge", str(path), str(tmp_path / "later.json"), "--out", str(tmp_path / "m")])
  us = {(c["id"], c["row"]): c.get("us") for c in merged["cells"]}
  assert us[("8x32k", "fa2")] == 400.0 and us[("8x32k", "cudnn")] == 250.0 and len(us) == len(data["cells"])


def test_decode_smoke_on_cpu(tmp_path, monkeypatch, capsys):
  """The CPU smoke size runs the decode kernels in Pallas interpret mode on ragged lengths and on a
  paged cache, beside XLA and a --sweep setting: times, TB/s and every output checked; cuDNN and the
  absent peers are named, not measured; the md and plot are written. (The training kernels' row is
  the same call with implementation="triton" here: left out to keep the test short.)"""
  from benchmarks import decode
  from fa2_jax import DecodeConfig
  monkeypatch.setattr(decode, "sweep_configs", lambda: [DecodeConfig(block_k=32, num_splits=1)])
  data = decode.main(["--smoke", "--out", str(tmp_path), "--cells", "2x512-ragged,2x256-paged16",
                      "--impls", "fa2,cudnn,fa3,xla", "--sweep"])
  js = _load(tmp_path / "decode.json")
  assert js["status"] == "done" and js["config"]["smoke"]
  assert (js["config"]["iters"], js["config"]["reps"]) == (2, 2)
  assert "cudnn" in js["meta"]["absent_impls"] and data["files"][0].endswith("decode.json")
  assert capsys.readouterr().out.startswith("decode: us per call (TB/s) (smoke size")
  by = {(c["id"], c["row"]): c for c in js["cells"]}
  sweep = decode.config_name(DecodeConfig(block_k=32, num_splits=1))
  ran = {("2x512-ragged", n) for n in ("fa2", "xla", sweep)} | {("2x256-paged16", n) for n in ("fa2", sweep)}
  assert {k for k, c in by.items() if c["status"] == "ok"} == ran, by
  assert by[("2x256-paged16", "xla")]["status"] == "unsupported"
  for key in ran:
    c = by[key]
    assert c["us"] > 0 and c["tbps"] > 0 and not c.get("warning"), c
    assert c["max_abs_err"] < decode.ERR_TOL * c["ref_max"], c
    assert c["err_vs"] == ("fa2" if key[1] != "fa2" else "f32 formula, rows 0, 1")
    assert {(c["timing"]["iters"], c["timing"]["reps"])} == {(2, 2)}
  fa2 = by[("2x512-ragged", "fa2")]
  assert fa2["backend"].startswith("decode") and fa2["kv_bytes"] == 2 * sum(fa2["lengths"]) * 2 * 32 * 2
  paged = by[("2x256-paged16", "fa2")]["backend"]
  assert paged.startswith("decode") and "reads the 16 pages of 16 keys per row through the table" in paged
  md = (tmp_path / "decode.md").read_text()
  assert "smoke size on the CPU" in md and "| 2 × 512 ragged (64–512) |" in md
  assert "## DecodeConfig sweep" in md
  assert (tmp_path / "decode.png").read_bytes()[:8] == PNG_MAGIC


# --- the attention of public model configs -----------------------------------------------------------------

def test_models_cells_batches_variants_and_flops():
  """The model table's cells: 16k tokens per call (B=4 at 4k, B=1 at 16k) but for the fixed-length
  untuned cells, each model's variants under every implementation's own argument names, the FLOPs of
  the harness's convention (value head_dim counted in the PV product, a window's attended pairs)."""
  from benchmarks import models
  cells = {c["id"]: c for c in models.build_cells("full")}
  model_ids = [f"{m.key}-{s}" for s in ("4k", "16k") for m in models.MODELS]
  assert list(cells)[:len(model_ids)] == model_ids and len(models.MODELS) == 11
  assert {i for i in cells if i.startswith("untuned-")} == {
      "untuned-h80-4k", "untuned-h112-4k", "untuned-gqa40x8-4k", "untuned-h80-16k", "untuned-h112-16k",
      "untuned-gqa40x8-16k", "untuned-llama3-8b-6000", "untuned-gemma2-9b-local-6000"}
  for c in cells.values():
    fixed = c["id"].endswith("-6000")
    assert (c["batch"], c["seq_q"], c["seq_k"]) == ((3, 6000, 6000) if fixed else
                                                    (16384 // c["seq_q"], c["seq_q"], c["seq_q"]))
    assert c["causal"] and c["heads"] % c["kv_heads"] == 0
  assert [c["id"] for c in models.build_cells("quick")] == [
      i for i in cells if i.endswith("-4k")] + ["untuned-llama3-8b-6000", "untuned-gemma2-9b-local-6000"]
  shape = lambda i: tuple(cells[i][k] for k in ("heads", "kv_heads", "head_dim", "v_head_dim"))  # noqa: E731
  assert shape("gemma-2b-4k") == (8, 1, 256, 256) and shape("starcoder-16k") == (48, 1, 128, 128)
  assert shape("deepseek-v2-lite-4k") == (16, 16, 192, 128) and shape("phi3-mini-4k") == (32, 32, 96, 96)
  glob, local, mistral = cells["gemma2-9b-global-16k"], cells["gemma2-9b-local-16k"], cells["mistral-7b-4k"]
  assert (glob["soft_cap"], glob["window"]) == (50.0, None)
  assert (local["soft_cap"], local["window"]) == (50.0, [4095, 0])
  assert (mistral["window"], mistral["soft_cap"]) == ([4095, 0], None)
  assert models.variant_kwargs("fa2", local) == {"local_window_size": (4095, 0), "logits_soft_cap": 50.0}
  for impl in ("fa2_det", "cudnn", "tokamax"):  # jax.nn's names
    assert models.variant_kwargs(impl, local) == models.variant_kwargs("fa2", local), impl
  assert models.variant_kwargs("fa3", local) == {"window_size": (4095, 0), "softcap": 50.0}
  assert models.variant_kwargs("cudnn", cells["llama3-8b-4k"]) == {}
  # FLOPs: the grid's causal count where H = Hv and no window cuts keys (a window of 4096 keys at 4k
  # cuts none); QK^T over H and PV over Hv; a window cutting keys: its attended pairs.
  for cid in ("llama3-8b-4k", "gpt2-16k", "mistral-7b-4k", "untuned-llama3-8b-6000"):
    c = cells[cid]
    assert c["flops_fwd"] == attention_flops(c["batch"], c["heads"], c["seq_q"], c["seq_k"], c["head_dim"],
                                             True), cid
  ds = cells["deepseek-v2-lite-4k"]
  assert ds["flops_fwd"] == 2 * 4 * 16 * (4096 * 4096 / 2) * (192 + 128)
  assert local["pairs"] == variants.causal_pairs(16384, 4095) and local["pairs"] < 16384 ** 2 / 4
  assert local["flops_fwd"] == 4 * 1 * 16 * local["pairs"] * 256
  assert cells["untuned-gemma2-9b-local-6000"]["pairs"] == variants.causal_pairs(6000, 4095)


def test_models_refusals_are_caught_before_compiling():
  """A call an implementation refuses gives the exception's text (traced, nothing compiled): jax.nn
  has no soft-cap argument and wants value head_dim = head_dim; fa2_jax (through backend_for) refuses
  query heads that are no multiple of the key heads; a call that traces gives None."""
  import functools

  from benchmarks import models
  q, k, v = (jnp.zeros((1, 16, n, d), jnp.bfloat16) for n, d in ((4, 32), (2, 32), (2, 16)))

  def refusal(name, q, k, v, **kw):
    impl = impls.get(name)
    return models.refusal(impl, functools.partial(impl, causal=True, **kw), q, k, v, kw)

  with jax.numpy_dtype_promotion("standard"):  # jax.nn in half precision (strict refuses it)
    assert refusal("xla", q, k, k, local_window_size=(3, 0)) is None
    assert refusal("xla", q, k, k, logits_soft_cap=50.0) == (
        "TypeError: dot_product_attention() got an unexpected keyword argument 'logits_soft_cap'")
    assert refusal("xla", q, k, v).startswith("ValueError: value shape should be [1, 16, 2, 32]")
  assert refusal("fa2", q[:, :, :3], k, k).startswith("ValueError: ")
  assert refusal("fa2", q, k, k, local_window_size=(3, 0), logits_soft_cap=50.0) is None


def _models_result():
  """A GPU result of a few cells: measured rows, refusals (n/a), a failure (✗), the same program."""
  from benchmarks import models
  cells = {c["id"]: c for c in models.build_cells("full")}

  def rec(cid, impl, fb=None, **kw):  # fb: forward+backward ms (the forward: a third of it)
    c = dict(cells[cid], impl=impl, dtype="bf16", **{"status": "ok", **kw})
    if fb is not None:
      c["ms"] = {"fwd": fb / 3, "fwd+bwd": fb}
      c["tflops"] = {p: tflops(c["flops_fwd"], p, ms * 1e-3) for p, ms in c["ms"].items()}
    return c

  refuse_cap = "TypeError: dot_product_attention() got an unexpected keyword argument 'logits_soft_cap'"
  refuse_mla = "ValueError: key and value must have the same shape [B, S, K, H]"
  return {"script": "models", "status": "done", "notes": [],
          "meta": {"gpu_name": "NVIDIA H100 80GB HBM3", "versions": {},
                   "command": "python -m benchmarks.models"},
          "config": {"tokens": 16384, "flops": "forward 2·B·N·pairs·(H + Hv)", "method": "m"},
          "cells": [rec("llama3-8b-4k", "fa2", 4.0, backend="mosaic: ..."),
                    rec("llama3-8b-4k", "fa2_det", 4.4), rec("llama3-8b-4k", "cudnn", 4.2),
                    rec("llama3-8b-4k", "fa3", 3.6), rec("llama3-8b-4k", "tokamax", 5.0),
                    rec("gemma2-9b-global-4k", "fa2", 3.0),
                    rec("gemma2-9b-global-4k", "fa2_det", status="same"),
                    rec("gemma2-9b-global-4k", "cudnn", status="unsupported", error=refuse_cap),
                    rec("gemma2-9b-global-4k", "fa3", status="unsupported",
                        error="head_dim 128 only, got 256"),
                    rec("gemma2-9b-global-4k", "tokamax", 4.0),
                    rec("deepseek-v2-lite-4k", "fa2", status="unsupported", error=refuse_mla),
                    rec("deepseek-v2-lite-4k", "tokamax", status="error", **{
                        "fwd_error": "XlaRuntimeError: INTERNAL",
                        "fwd+bwd_error": "XlaRuntimeError: INTERNAL"}),
                    rec("untuned-llama3-8b-6000", "fa2", 5.0),
                    rec("untuned-llama3-8b-6000", "cudnn", 4.5)]}


def test_models_table_bars_and_plot_render_from_json(tmp_path, monkeypatch):
  """``--render``: a row per cell with TFLOP/s (ms) per implementation, n/a for a refused call with its
  reason listed, ✗ for a failed one, fa2_jax's ratios to cuDNN and FA3 against the bars, the bars'
  count; the plot names the GPU, uses the palette's names and marks the bars without a number."""
  from benchmarks import models
  figs, save = [], harness.save
  monkeypatch.setattr(harness, "save", lambda plt, fig, *a, **kw: figs.append(fig) or save(
      plt, fig, *a, **dict(kw, dpi=20)))
  path = tmp_path / "models.json"
  path.write_text(json.dumps(_models_result()))
  data = models.main(["--render", str(path)])
  assert {p.name for p in tmp_path.iterdir()} == {"models.json", "models.md", "models.png"}
  lines = (tmp_path / "models.md").read_text().splitlines()
  row = lambda start: next(x for x in lines if x.startswith(start))  # noqa: E731
  assert row("| cell") == (
      "| cell | model | heads × head_dim, variants | B × T | fa2_jax | fa2_jax (deterministic) | cuDNN | "
      "FlashAttention-3 | tokamax | fa2_jax ÷ cuDNN (bar 1.00) | fa2_jax ÷ FA3 (bar 0.95) |")
  assert row("| `llama3-8b-4k`") == (
      "| `llama3-8b-4k` | Llama-3 8B | 32/8 × 128 | 4 × 4k | 481 (4 ms) | 437 (4.4 ms) | 458 (4.2 ms) "
      "| 534 (3.6 ms) | 385 (5 ms) | 1.05 ✓ | 0.90 ✗ |")
  assert row("| `gemma2-9b-global-4k`") == (
      "| `gemma2-9b-global-4k` | Gemma-2 9B global | 16/8 × 256, cap 50 | 4 × 4k | 641 (3 ms) | = "
      "| n/a | n/a | 481 (4 ms) | – | – |")
  assert row("| `deepseek-v2-lite-4k`") == ("| `deepseek-v2-lite-4k` | DeepSeek-V2-Lite | 16/16 × 192/128 "
                                            "| 4 × 4k | n/a | – | – | – | ✗ | – | – |")
  assert row("| `untuned-llama3-8b-6000` | Llama-3 8B | 32/8 × 128 | 3 × 6000").endswith(
      "| 0.90 ✗ | – |")
  assert lines.index(row("| `deepseek")) < lines.index(row("| `untuned-llama3-8b-6000`"))
  assert ("- ≥ 1.00× cuDNN where cuDNN runs the cell: met in 1 of 2 cells; not met: "
          "untuned-llama3-8b-6000 0.90") in lines
  assert "- ≥ 0.95× FA3 where FA3 runs the cell: met in 0 of 1 cells; not met: llama3-8b-4k 0.90" in lines
  assert ("- **cuDNN** error (gemma2-9b-global-4k): `TypeError: dot_product_attention() got an unexpected "
          "keyword argument 'logits_soft_cap'`") in lines
  assert any(x.startswith("- **fa2_jax** error (deepseek-v2-lite-4k): `ValueError:") for x in lines)
  assert any(x.startswith("- **tokamax** fwd+bwd_error (deepseek-v2-lite-4k)") for x in lines)
  assert "## Forward" in lines and any(x.startswith("| `llama3-8b-4k` | Llama-3 8B | 32/8 × 128 | 4 × 4k | "
                                                    "412 (1.33 ms) |") for x in lines)
  summary = models.summary(data).splitlines()
  assert "BAR fa2 fwd+bwd >= 1.00x cudnn: 1/2 met; untuned-llama3-8b-6000 0.90" in summary[-2]
  (fig,) = figs
  assert fig._suptitle.get_text().endswith("— NVIDIA H100 80GB HBM3") and len(fig.axes) == 2
  assert not harness.overlapping_ticks(fig)
  assert [t.get_text() for t in fig.legends[0].get_texts()] == [
      "fa2_jax", "fa2_jax (deterministic)", "cuDNN", "FlashAttention-3", "tokamax"]
  marks = [t.get_text() for t in fig.axes[0].texts if t.get_text()]
  assert sorted(marks) == ["=", "n/a", "n/a", "n/a", "✗"], marks


def test_models_smoke_on_cpu(tmp_path, capsys):
  """The CPU smoke size in Pallas interpret mode: a window with a soft cap and GQA measured and checked
  against the f32 reference; the cell with value head_dim != head_dim records what fa2_jax does with it
  (measured, or its refusal's text) without stopping the run; cuDNN and the absent peers are named."""
  from benchmarks import models
  data = models.main(["--smoke", "--out", str(tmp_path), "--cells", "window-cap-128,mla-32"])
  js = _load(tmp_path / "models.json")
  assert js["status"] == "done" and js["config"]["smoke"] and data["files"][0].endswith("models.json")
  assert (js["config"]["iters"], js["config"]["reps"]) == (2, 2) and "cudnn" in js["meta"]["absent_impls"]
  assert capsys.readouterr().out.startswith("models: fwd+bwd TFLOP/s (ms) (smoke size")
  by = {(c["id"], c["impl"]): c for c in js["cells"]}
  assert set(by) == {(i, n) for i in ("window-cap-128", "mla-32") for n in ("fa2", "fa2_det")}
  fa2 = by[("window-cap-128", "fa2")]
  assert fa2["status"] == "ok" and fa2["rel_err"] < 2e-2 and fa2["tflops"]["fwd+bwd"] > 0, fa2
  assert fa2["about"] == "flash_attention(is_causal=True, local_window_size=(15, 0), logits_soft_cap=50.0)"
  assert fa2["pairs"] == variants.causal_pairs(128, 15)
  assert by[("window-cap-128", "fa2_det")]["status"] == "same"  # Triton's backward is deterministic
  mla = by[("mla-32", "fa2")]
  assert mla["status"] == "ok" or (mla["status"] == "unsupported" and re.match(
      r"(ValueError|TypeError): ", mla["error"])), mla
  md = (tmp_path / "models.md").read_text()
  assert "smoke size on the CPU" in md
  assert "| `window-cap-128` | window + cap | 4/2 × 32, window (15, 0), cap 50 | 1 × 128 |" in md
  assert (tmp_path / "models.png").read_bytes()[:8] == PNG_MAGIC



# --- the ring's per-step schedule on one device --------------------------------------------------------------

def test_context_schedule_cells_and_contexts():
  """The sweep's cells (T = S 32k ... 128k, causal and not; --quick 32k and 128k), the ring sizes
  (--contexts, each cutting T into 2C chunks) and the kernel call of each ring step."""
  from benchmarks import context_schedule as cs
  assert [c["id"] for c in cs.build_cells("full")] == ["32k-c", "32k-nc", "64k-c", "64k-nc", "128k-c",
                                                       "128k-nc"]
  assert [c["id"] for c in cs.build_cells("quick")] == ["32k-c", "32k-nc", "128k-c", "128k-nc"]
  c = cs.build_cells("full")[0]
  assert (c["heads"], c["kv_heads"], c["head_dim"], c["batch"]) == (32, 8, 128, 1)
  assert c["flops_fwd"] == timing.attention_flops(1, 32, 32768, 32768, 128, True)
  args = cs.build_parser().parse_args(["--quick"])
  args.smoke = False
  assert cs.contexts_of(args, c) == [4, 8]
  args = cs.build_parser().parse_args(["--smoke", "--contexts", "3"])
  with pytest.raises(SystemExit, match="--contexts 3: the zigzag layout cuts T = 64 into 2C"):
    cs.contexts_of(args, cs.build_cells("smoke")[0])
  # one call per step: the local chunks first; causal, then every row x the first key chunk or the
  # later query chunk x both (the same number of pairs)
  assert cs.step_calls(64, 4, True) == dict(first=[16, 16], later=[[16, 8], [8, 16]])
  assert cs.step_calls(64, 4, False) == dict(first=[16, 16], later=[[16, 16]])
  # --kernels-alone: each distinct call and how many the C devices run (C + C(C-1) in all)
  assert cs.call_counts(64, 4, True) == [("first", [16, 16], True, 4), ("later0", [16, 8], False, 6),
                                         ("later1", [8, 16], False, 6)]
  assert cs.call_counts(64, 4, False) == [("first", [16, 16], False, 4),
                                          ("later0", [16, 16], False, 12)]


def test_context_schedule_smoke_on_cpu(tmp_path, capsys):
  """The CPU smoke size (Triton kernels in Pallas interpret mode), its causal cell: the one call and the
  ring's schedule of C = 2 (the ring's own steps, a lax.cond between the later steps' calls), timed
  forward and forward+backward, the ring's out, dq, dk, dv equal to the one call's; the md's columns
  and the plot are written. (The whole smoke size, non-causal and C = 4 too: the slow test below.)"""
  from benchmarks import context_schedule as cs
  data = cs.main(["--smoke", "--out", str(tmp_path), "--cells", "64-c", "--contexts", "2"])
  js = _load(tmp_path / "context_schedule.json")
  assert js["status"] == "done" and js["config"]["smoke"] and data["files"][0].endswith(".json")
  assert (js["config"]["iters"], js["config"]["reps"]) == (2, 2)
  assert capsys.readouterr().out.startswith("context_schedule: ms fwd+bwd (ratio to one call) (smoke size")
  by = {(c["id"], c["row"]): c for c in js["cells"]}
  assert set(by) == {("64-c", "one_call"), ("64-c", "ring_c2")}
  for (_, row), c in by.items():
    assert c["status"] == "ok" and c["ms"]["fwd"] > 0 and c["ms"]["fwd+bwd"] > 0, c
    if row == "ring_c2":
      assert set(c["err"]) == {"out", "dq", "dk", "dv"} and max(c["err"].values()) < cs.ERR_TOL, c
      assert not c.get("warning") and c["vs_one_call"]["fwd+bwd"] > 0 and c["bar_ok"] in (True, False)
      assert c["calls_per_device"] == 2 and c["step_calls"] == dict(first=[32, 32],
                                                                    later=[[32, 16], [16, 32]])
    else:
      assert c["backend"].startswith("triton")
  md = (tmp_path / "context_schedule.md").read_text()
  assert "smoke size on the CPU" in md and "attention_backward per step call" in md
  assert "`64-c` C=2: step 0 32×32, then 32×16 or 16×32" in md
  assert ("| cell | causal | one call: ms (TFLOP/s) | ring C=2: ÷ one call (bar ≤ 1.05) | ring C=2: ms |"
          in md)
  assert "| cell | C | out | dq | dk | dv |" in md and "| `64-c` | 2 |" in md
  assert (tmp_path / "context_schedule.png").read_bytes()[:8] == PNG_MAGIC
  # a --kernels-alone record renders its column and summary (the timing itself: the slow test)
  for c in js["cells"]:
    if c["row"] == "ring_c2":
      c["kernels_alone_ms"] = {"fwd": 1.0, "fwd+bwd": 2.0}
      c["kernels_alone_vs_one_call"] = {"fwd": 1.25, "fwd+bwd": 1.125}
  cs.render(js, str(tmp_path / "alone"))
  md = (tmp_path / "alone.md").read_text()
  assert "| ring C=2: ÷ one call (bar ≤ 1.05) | C=2 kernels alone: ÷ one call | ring C=2: ms |" in md
  assert "| 1.125 |" in md and "| 1.250 |" in md
  assert "[kernels alone 1.125]" in cs.summary(js)


@pytest.mark.slow
def test_context_schedule_whole_smoke_size_on_cpu(tmp_path):
  """The whole smoke size: causal and not (one call of all local rows x all keys per step, no
  lax.cond), C = 2 and 4, every ring row's output and gradients equal to the one call's."""
  from benchmarks import context_schedule as cs
  cs.main(["--smoke", "--out", str(tmp_path), "--kernels-alone"])
  cells = _load(tmp_path / "context_schedule.json")["cells"]
  assert {(c["id"], c["row"]) for c in cells} == {
      (i, r) for i in ("64-c", "64-nc") for r in ("one_call", "ring_c2", "ring_c4")}
  for c in cells:
    assert c["status"] == "ok" and not c.get("warning"), c
    if c["row"] != "one_call":
      assert max(c["err"].values()) < cs.ERR_TOL and c["step_calls"] == cs.step_calls(
          64, c["contexts"], c["causal"]), c
      assert set(c["kernels_alone_ms"]) == {"fwd", "fwd+bwd"}, c
      assert min(c["kernels_alone_vs_one_call"].values()) > 0, c

# --- on a GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_grid_cell_on_gpu(tmp_path):
  data = attention.main(["--grid", "quick", "--cells", "d128-8k-c", "--impls", "fa2,fa2_det,cudnn,xla",
                         "--iters", "2", "--reps", "2", "--no-matmul", "--out", str(tmp_path)])
  by = {c["impl"]: c for c in data["cells"]}
  for n in ("fa2", "cudnn", "xla"):
    assert by[n]["status"] == "ok" and by[n]["rel_err"] < 2e-2 and by[n]["tflops"]["fwd+bwd"] > 1, by[n]
  assert by["fa2"]["vs_cudnn"]["fwd+bwd"] > 0


@pytest.mark.gpu
def test_variants_packed_cell_on_gpu(tmp_path):
  """The packed documents' cell compiled: fa2 (segment ids), fa2 on the batch, cuDNN on the batch and,
  when flash_attn3_jax imports, FA3's varlen call, each matching the f32 reference."""
  from benchmarks import variants
  data = variants.main(["--cells", "packed-8x4k", "--iters", "2", "--reps", "2", "--out", str(tmp_path)])
  by = {c["row"]: c for c in data["cells"]}
  for name in ("fa2", "fa2_batch", "cudnn_batch") + (("fa3_varlen",) if impls.unavailable("fa3") is None
                                                     else ()):
    c = by[name]
    assert c["status"] == "ok" and c["rel_err"] < 2e-2 and c["tflops"]["fwd+bwd"] > 1, c


@pytest.mark.gpu
def test_registers_and_mosaic_tune_run_on_hopper(tmp_path):
  from benchmarks.diag import registers
  if not impls.is_hopper():
    pytest.skip("the Mosaic kernels need a Hopper GPU")
  registers.main(["--shapes", "1,1024,4,128", "--causal", "true", "--out", str(tmp_path)])
  rows = _load(tmp_path / "registers.json")["rows"]
  assert any(r.get("kernel") == "fa2_mosaic_dkdv" and r["registers"] > 0 for r in rows), rows
  tune.main(["--backend", "mosaic", "--head-dims", "128", "--seqs", "1k", "--causal", "true",
             "--iters", "2", "--reps", "2", "--out", str(tmp_path)])
  cells = _load(tmp_path / "tune_mosaic.json")["cells"]
  assert any(c["sweep"] == "default" and c["status"] == "ok" for c in cells)
  assert all(math.isfinite(c["ms"].get("fwd") or c["ms"].get("fwd+bwd")) for c in cells
             if c["status"] == "ok")


def test_result_metadata_names_no_machine_paths(monkeypatch):
  """A result's command writes the device tool's output folder as ``$OUT`` and the checkout's files
  relative to it; no working directory or host name is recorded; ``FA2_GIT_COMMIT`` names the
  commit where the checkout is a copy without git."""
  monkeypatch.setenv("OUT", "/scratch/out")
  monkeypatch.setattr(sys, "orig_argv", ["python3", "-m", "benchmarks.attention", "--out",
                                         "/scratch/out/grid", "--merge", str(harness.ROOT / "a.json"),
                                         "--cells", "d64-*", "/scratch/outside"])
  assert harness.command_line() == (
      "python3 -m benchmarks.attention --out $OUT/grid --merge a.json --cells 'd64-*' /scratch/outside")
  monkeypatch.setenv("FA2_GIT_COMMIT", "abc1234")
  info = harness.device_info(init_backend=False)
  assert info["git_commit"] == "abc1234"
  assert "cwd" not in info and "hostname" not in info


def test_results_index_links_every_result_file():
  """benchmarks/results/README.md links only files that exist, and every result file is reachable from
  it: linked itself, the data of a linked md (same name), or in a linked folder (runs/ and ab/)."""
  results = ROOT / "benchmarks" / "results"
  links = {(results / x).resolve() for x in re.findall(r"\]\(([^)#\s]+)\)", (results / "README.md").read_text())
           if "://" not in x}
  assert links and not [x for x in links if not x.exists()], [x for x in links if not x.exists()]
  files = {p.resolve() for p in results.rglob("*") if p.is_file() and p.name != "README.md"}
  unreached = [p for p in files if not any(x in (p, p.with_suffix(".md")) or x in p.parents for x in links)]
  assert not unreached, unreached
