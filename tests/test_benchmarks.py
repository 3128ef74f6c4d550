"""The benchmark harness on the CPU: every script's --smoke mode (Pallas interpret mode, tiny shapes)
writes its JSON, markdown and plots with the expected keys and sane values; run_all resumes after a
crash and packs an archive."""
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# benchmarks/ is a package of the repository, not of the installed fa2_jax: import it from the root.
sys.path.insert(0, str(ROOT))

from benchmarks import ablation, attention, common, latency, memory, numerics  # noqa: E402
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pos(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _png(path):
  path = Path(path)
  assert path.exists(), path
  assert path.read_bytes()[:8] == PNG_MAGIC, path


def _load(path):
  with open(path) as fh:
    return json.load(fh)


def _check_meta(meta):
  for k in ("timestamp", "command", "versions", "gpu_name", "driver_version", "backend"):
    assert k in meta, k
  assert meta["versions"]["jax"]
  assert meta["versions"]["jaxlib"]
  assert "benchmarks." in meta["command"] or "pytest" in meta["command"]


# --- helpers ------------------------------------------------------------------------------------------

def test_helpers():
  assert common.parse_ints("512,1k,2K,16384") == [512, 1024, 2048, 16384]
  assert common.seq_label(16384) == "16k" and common.seq_label(512) == "512"
  assert common.attn_flops(2, 16, 8192, 8192, 128, False) == 4.0 * 2 * 16 * 8192 ** 2 * 128
  assert common.attn_flops(1, 1, 8, 8, 8, True) == common.attn_flops(1, 1, 8, 8, 8, False) / 2
  assert common.device_slug({"gpu_name": "NVIDIA H200"}) == "h200"
  assert common.device_slug({"gpu_name": "NVIDIA H100 80GB HBM3"}) == "h100-80gb-hbm3"
  assert common.device_slug({"gpu_name": None, "backend": "cpu"}) == "cpu"
  assert common.sanitize({"a": float("nan"), "b": (1, 2.5)}) == {"a": None, "b": [1, 2.5]}
  assert common.PASS_FLOP_MULT == {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
  b = common.Budget(None)
  assert b.fits("x") and b.left() == math.inf


# --- the five smoke modes -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def attention_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("attention")
  data = attention.main(["--smoke", "--out", str(out)])
  return out, data


def test_attention_smoke(attention_run):
  out, _ = attention_run
  js = _load(out / "attention.json")
  assert js["status"] == "done"
  _check_meta(js["meta"])
  cells = js["cells"]
  assert {c["impl"] for c in cells} == {"fa2_triton", "xla"}
  assert {c["seq"] for c in cells} == {64, 128} and {c["causal"] for c in cells} == {False, True}
  for c in cells:
    assert c["status"] == "ok", c
    assert _pos(c["tflops"]["fwd"]) and _pos(c["tflops"]["fwd+bwd"]), c
    assert set(c["vs_cudnn"]) == {"fwd", "bwd", "fwd+bwd"}  # no cuDNN on a CPU: None values
    assert c["rel_err"] < 2e-2  # checked against the f32 reference
    assert c["flops_fwd"] == common.attn_flops(c["batch"], c["heads"], c["seq"], c["seq"],
                                               c["head_dim"], c["causal"])
  for impl in ("fa2_triton", "xla"):
    assert any(_pos(c["tflops"].get("bwd")) for c in cells if c["impl"] == impl)
  md = (out / "attention.md").read_text()
  assert "## head_dim 32, non-causal" in md and "## head_dim 32, causal" in md
  assert "fwd / bwd / fwd+bwd" in md and "fa2_jax triton" in md
  for p in ("fwd", "bwd", "fwd_bwd"):
    _png(out / f"attention_{p}.png")


def test_attention_merge(attention_run, tmp_path):
  out, _ = attention_run
  data = attention.main(["--merge", str(out / "attention.json"), str(out / "attention.json"),
                         "--out", str(tmp_path)])
  assert len(data["cells"]) == 8  # the same cells twice: one copy each
  assert (tmp_path / "attention_merged.md").exists()
  _png(tmp_path / "attention_fwd_merged.png")


def test_merge_later_measurement_wins_but_not_a_skip(attention_run, tmp_path):
  out, _ = attention_run
  first = _load(out / "attention.json")
  second = json.loads(json.dumps(first))
  a, b = second["cells"][0], second["cells"][1]
  a["tflops"] = {"fwd": 123.0, "bwd": 45.0, "fwd+bwd": 67.0}  # re-measured later: replaces
  b.update(status="skipped", tflops={})  # skipped later: the earlier measurement stays
  p1, p2 = tmp_path / "one.json", tmp_path / "two.json"
  p1.write_text(json.dumps(first))
  p2.write_text(json.dumps(second))
  merged = common.merge_json([p1, p2])
  key = common._cell_key
  by = {key(c): c for c in merged["cells"]}
  assert len(merged["cells"]) == len(first["cells"])
  assert by[key(a)]["tflops"]["fwd"] == 123.0 and by[key(a)]["source"] == str(p2)
  assert by[key(b)]["tflops"] == first["cells"][1]["tflops"] and by[key(b)]["source"] == str(p1)


def test_merge_keeps_notes_once_and_the_newest_meta(attention_run, tmp_path):
  out, _ = attention_run
  first = _load(out / "attention.json")
  second = json.loads(json.dumps(first))
  first["notes"] = ["same note", "tokamax rows left out: not importable"]
  second["notes"] = ["same note"]
  second["meta"]["timestamp"] = "newer"
  second["cells"][0]["impl"] = "tokamax_mosaic"  # a later run measured tokamax
  p1, p2 = tmp_path / "one.json", tmp_path / "two.json"
  p1.write_text(json.dumps(first))
  p2.write_text(json.dumps(second))
  merged = common.merge_json([p1, p2])
  assert merged["notes"] == ["same note"]
  assert merged["meta"]["timestamp"] == "newer"
  assert merged["merged_meta"] == [first["meta"]]


def test_ablation_smoke(tmp_path):
  ablation.main(["--smoke", "--out", str(tmp_path)])
  js = _load(tmp_path / "ablation.json")
  assert js["status"] == "done"
  _check_meta(js["meta"])
  ideas = [c for c in js["cells"] if c["part"] == "ideas"]
  assert {c["variant"] for c in ideas} == set(ablation.FWD_VARIANTS) | set(ablation.BWD_VARIANTS)
  for c in ideas:
    assert c["status"] == "ok", c
    assert _pos(c["ms"]), c
  rows = ablation.ideas_rows(js["cells"])
  assert len(rows) == 1 and _pos(rows[0]["fwd_fa2"]) and _pos(rows[0]["no_deferred_norm_gain"])
  sweep = [c for c in js["cells"] if c["part"] == "sweep"]
  assert {c["sweep"] for c in sweep} >= {"fwd", "bwd_dkv"}
  assert all(_pos(c.get("tflops")) for c in sweep), sweep
  md = (tmp_path / "ablation.md").read_text()
  assert "## The three ideas" in md and "Best block sizes" in md and "BlockSizes(" in md


def test_numerics_smoke(tmp_path):
  numerics.main(["--smoke", "--out", str(tmp_path)])
  js = _load(tmp_path / "numerics.json")
  assert js["status"] == "done"
  _check_meta(js["meta"])
  cells = js["cells"]
  assert {c["impl"] for c in cells} == {"fa2_triton", "fa2_normstep", "xla"}
  assert {c["dtype"] for c in cells} == {"bf16", "fp32"}
  for c in cells:
    assert c["status"] == "ok", c
    for q in ("out", "dq", "dk", "dv"):
      e = c["errors"][q]
      assert e["nonfinite"] == 0 and _pos(e["rel_l2"]) and _pos(e["max_abs"]), (c["impl"], q)
      assert e["rel_l2"] < (3e-2 if c["dtype"] == "bf16" else 1e-4), (c["impl"], c["dtype"], q, e)
    if c["impl"] != "fa2_normstep":
      assert c["errors"]["lse"]["rel_l2"] < 1e-4
  md = (tmp_path / "numerics.md").read_text()
  assert "Does the unscaled accumulator lose precision at long sequence?" in md
  assert "## out, non-causal" in md and "## dq, non-causal" in md
  _png(tmp_path / "numerics.png")


def test_numerics_reference_matches_autodiff():
  """The chunked float64 reference (forward and analytic gradients) equals jax autodiff of the plain
  formula, also across chunk boundaries and with a causal mask."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  q, k, v, do = numerics.exact_inputs(3, (1, 48, 2, 16))
  cpu = jax.devices("cpu")[0]
  for causal in (False, True):
    ref = numerics.reference_f64(q, k, v, do, scale=0.25, causal=causal, device=cpu,
                                 chunk_elems=16 * 48)  # chunks of 16 rows
    with jax.enable_x64(True):
      f = lambda q, k, v: common.ensure_fa2().reference_attention(  # noqa: E731
          q, k, v, scale=0.25, is_causal=causal, return_residual=True)
      args = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
      (o, lse), pull = jax.vjp(f, *args)
      grads = pull((jnp.asarray(do, jnp.float64), jnp.zeros_like(lse)))
      np.testing.assert_allclose(ref["out"], np.asarray(o), atol=1e-12)
      np.testing.assert_allclose(ref["lse"], np.asarray(lse), atol=1e-12)
      for name, g in zip(("dq", "dk", "dv"), grads):
        np.testing.assert_allclose(ref[name], np.asarray(g), atol=1e-11)


def test_memory_smoke(tmp_path):
  memory.main(["--smoke", "--out", str(tmp_path)])
  js = _load(tmp_path / "memory.json")
  assert js["status"] == "done"
  _check_meta(js["meta"])
  cells = js["cells"]
  assert {c["impl"] for c in cells} == {"fa2_triton", "xla"}
  for c in cells:
    assert c["status"] == "ok", c
    comp = c["compiled"]
    assert _pos(comp["total"]) and comp["total"] >= c["io_floor_bytes"] * 0.99, c
  s_fa2, s_xla = memory.slope(cells, "fa2_triton"), memory.slope(cells, "xla")
  assert s_fa2 < 1.4 and s_xla > s_fa2 + 0.3, (s_fa2, s_xla)
  md = (tmp_path / "memory.md").read_text()
  assert "## Growth" in md and "linear" in md
  _png(tmp_path / "memory.png")


def test_latency_smoke(tmp_path):
  latency.main(["--smoke", "--out", str(tmp_path)])
  js = _load(tmp_path / "latency.json")
  assert js["status"] == "done"
  _check_meta(js["meta"])
  for c in js["cells"]:
    assert c["status"] == "ok", c
    for p in ("fwd", "fwd+bwd"):
      lat = c["latency"][p]
      assert _pos(lat["median_us"]) and lat["p10_us"] <= lat["median_us"] <= lat["p90_us"]
  assert "## causal" in (tmp_path / "latency.md").read_text()
  _png(tmp_path / "latency.png")


# --- run_all: stages as processes, resume after a crash, archive ------------------------------------

def test_run_all_resumes_after_crash(tmp_path):
  out, arc = tmp_path / "out", tmp_path / "bench.tar.gz"
  env = dict(os.environ, FA2_BENCH_TEST_CRASH="xla")  # the xla cell "crashes" the stage process
  r = subprocess.run(
      [sys.executable, "-m", "benchmarks.run_all", "--smoke", "--only", "attention",
       "--out", str(out), "--archive", str(arc), "--budget-s", "200",
       "--stage-args", "attention=--seqs 64 --causal false"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "SUMMARY" in r.stdout and "resume" in r.stdout
  js = _load(out / "attention.json")
  by = {c["impl"]: c for c in js["cells"]}
  assert by["xla"]["status"] == "crashed"
  assert by["fa2_triton"]["status"] == "ok" and _pos(by["fa2_triton"]["tflops"]["fwd"])
  assert js["resumed"] == 1
  assert (out / "run_all.md").exists() and (out / "attention.md").exists()
  names = tarfile.open(arc).getnames()
  assert "out/attention.json" in names and "out/run_all.md" in names


def test_gpt_table_script_rejects_an_unknown_mode(tmp_path):
  root = Path(__file__).resolve().parents[1]
  r = subprocess.run(["bash", str(root / "scripts" / "gpu_gpt_table1.sh"), str(tmp_path), "nope"],
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 2 and "mode must be single" in r.stderr and "'nope'" in r.stderr


def test_bar_report_medians_ratios_and_bad_input(tmp_path):
  """benchmarks.bar_report: per-cell medians over rounds, fwd+bwd ratio to cuDNN, the bar column."""
  from benchmarks import bar_report
  rows = []
  for rnd, (c_fb, o_fb) in enumerate([(500.0, 450.0), (520.0, 470.0), (510.0, 530.0)]):
    rows.append(dict(impl="cudnn", b=2, n=16, t=8192, h=128, causal=True, round=rnd, fwd=600.0,
                     bwd=480.0, fwdbwd=c_fb))
    rows.append(dict(impl="fa2_mosaic", b=2, n=16, t=8192, h=128, causal=True, round=rnd, fwd=610.0,
                     bwd=470.0, fwdbwd=o_fb))
  rows.append(dict(impl="tokamax_mosaic", b=2, n=16, t=8192, h=128, causal=True, round=0,
                   error="ImportError"))
  src = tmp_path / "a.json"
  src.write_text(json.dumps(dict(meta=dict(device="X"), rows=rows)))
  bar_report.main([str(src), "--out", str(tmp_path / "rep"), "--commit", "abc"])
  md = (tmp_path / "rep.md").read_text()
  line = next(x for x in md.splitlines() if x.startswith("| 128 | 8k | causal"))
  assert "600 / 480 / 510 (1.00×)" in line  # medians of 500/520/510
  assert "610 / 470 / 470 (0.92×)" in line  # median 470 / 510
  assert line.rstrip(" |").endswith("471")  # the anchors' tokamax bar for 8k causal
  assert "abc" in md
  bad = tmp_path / "b.json"
  bad.write_text(json.dumps([1, 2]))
  with pytest.raises(ValueError, match="rows"):
    bar_report.main([str(bad), "--out", str(tmp_path / "x")])
