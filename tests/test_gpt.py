"""The flax GPT example: learning, flash == xla, pmap == one device, bit-identical resume, the CLI.

Tiny shapes on CPU; tests/conftest.py provides 4 CPU devices for the pmap test.
"""
import dataclasses
import json
import pathlib
import sys

import jax
import numpy as np
import optax
import pytest

# The example is a package of the repository, not of the installed fa2_jax: import it from the root.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from examples.flax_gpt import data as data_lib  # noqa: E402
from examples.flax_gpt import train as train_lib  # noqa: E402
from examples.flax_gpt.config import GPTConfig, TrainConfig, get_preset  # noqa: E402
from examples.flax_gpt.model import GPT, attention_core, count_params  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
MODEL = GPTConfig(seq_len=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, position="rotary",
                  dtype="float32", attention="xla")
TRAIN = TrainConfig(batch_size=8, steps=4, lr=3e-3, warmup_steps=0, eval_every=0, eval_batches=1,
                    log_every=1, data_bytes=200_000)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  """200 kB of the stdlib sources in a file, so each run skips the directory walk."""
  path = tmp_path_factory.mktemp("data") / "stdlib.py.txt"
  path.write_bytes(data_lib.stdlib_source_bytes(200_000))
  return str(path)


def run(text_file, model=MODEL, **kw):
  train_kw = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(TrainConfig)}}
  state, summary = train_lib.train(model, dataclasses.replace(TRAIN, **train_kw),
                                   data_path=text_file, progress=False, **kw)
  return state, summary


def losses(summary):
  return np.array([h["loss"] for h in summary["history"] if "loss" in h])


def assert_trees_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_data_is_deterministic(text_file):
  train, val = data_lib.load_splits(text_file, 200_000, 32)
  assert len(train) + len(val) == 200_000 and len(val) == 20_000
  a = data_lib.get_batch(train, 7, batch_size=4, seq_len=32, seed=0)
  b = data_lib.get_batch(train, 7, batch_size=4, seq_len=32, seed=0)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[0][:, 1:], a[1][:, :-1])  # targets are the inputs shifted by one
  assert not np.array_equal(a[0], data_lib.get_batch(train, 8, batch_size=4, seq_len=32, seed=0)[0])
  assert data_lib.stdlib_source_bytes(1000) == data_lib.stdlib_source_bytes(1000)
  assert data_lib.decode(data_lib.encode("déf f():")) == "déf f():"


def test_training_reduces_the_loss(text_file):
  _, summary = run(text_file, steps=40, lr=1e-2, log_every=5, eval_every=40, eval_batches=2,
                   sample_tokens=8, prompt="def ")
  curve = losses(summary)
  assert curve[0] > 5.0  # about ln(256) = 5.55 at initialisation
  assert curve[-1] < curve[0] - 1.5, curve
  assert summary["final_val_loss"] < curve[0] - 1.5
  assert summary["sample"].startswith("def ") and len(summary["sample"].encode()) >= 8


def test_flash_kernel_matches_xla_attention(text_file):
  """The same first steps with the fa2_jax kernels (interpret mode on CPU) and with XLA attention."""
  xla = dataclasses.replace(MODEL, n_layer=1)  # one layer: the interpreted kernels are slow
  flash = dataclasses.replace(xla, attention="flash", flash_interpret=not ON_GPU)
  _, s_flash = run(text_file, model=flash, steps=3)
  _, s_xla = run(text_file, model=xla, steps=3)
  np.testing.assert_allclose(losses(s_flash), losses(s_xla), rtol=1e-4 if not ON_GPU else 1e-2)


@pytest.mark.skipif(jax.local_device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_pmap_update_equals_single_device_update(text_file):
  """Same global batch: the pmean-averaged gradient step equals the one-device step."""
  model, tx = GPT(MODEL), optax.sgd(0.5)  # SGD: the update is linear in the gradient
  train_tokens, _ = data_lib.load_splits(text_file, 200_000, MODEL.seq_len)
  state = train_lib.init_state(model, tx, seed=0)
  results = []
  for mode in ("none", "pmap"):
    runner = train_lib.Runner.create(mode, model, tx, batch_size=8)
    st = runner.put_state(state)
    for step in range(2):
      x, y = data_lib.get_batch(train_tokens, step, batch_size=8, seq_len=MODEL.seq_len, seed=0)
      st, metrics = runner.train_step(st, runner.shard(x), runner.shard(y))
    results.append((runner.get_state(st), runner.scalar(metrics["loss"])))
  (single, loss1), (multi, loss4) = results
  assert int(multi.step) == int(single.step) == 2
  np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               multi.params, single.params)
  # And the full AdamW loop agrees too, loss for loss.
  _, s_multi = run(text_file, data_parallel="pmap", steps=3)
  _, s_single = run(text_file, steps=3)
  np.testing.assert_allclose(losses(s_multi), losses(s_single), rtol=1e-4)


def test_checkpoint_resume_is_bit_identical(text_file, tmp_path):
  straight, _ = run(text_file, steps=4)
  ckpt = str(tmp_path / "ckpt")
  first, s1 = run(text_file, steps=4, ckpt_dir=ckpt, stop_at=2)
  assert int(first.step) == 2 and s1["end_step"] == 2
  resumed, s2 = run(text_file, steps=4, ckpt_dir=ckpt, resume=True)
  assert s2["start_step"] == 2 and int(resumed.step) == 4
  assert_trees_equal(resumed.params, straight.params)
  assert_trees_equal(resumed.opt_state, straight.opt_state)


def test_cli_writes_a_json_summary(text_file, tmp_path):
  out = tmp_path / "summary.json"
  summary = train_lib.main([
      "--preset", "tiny", "--data", text_file, "--steps", "2", "--n-layer", "1", "--seq-len", "32",
      "--batch-size", "4", "--eval-batches", "1", "--sample-tokens", "4", "--no-progress",
      "--out", str(out)])
  saved = json.loads(out.read_text())
  assert saved["preset"] == "tiny" and saved["attention"] == "flash"
  # On CPU the default flash attention is fa2_jax's XLA formula; on a GPU one of its kernels.
  assert saved["attention_backend"] in (
      ("fa2_jax/triton", "fa2_jax/mosaic") if ON_GPU else ("fa2_jax/xla",))
  assert saved["model_config"]["n_layer"] == 1 and saved["train_config"]["steps"] == 2
  for key in ("final_train_loss", "final_val_loss", "tokens_per_s", "tflops_per_s", "mfu",
              "devices", "versions", "sample"):
    assert key in saved
  assert saved["mfu"] is None if not ON_GPU else saved["mfu"] > 0
  assert summary["n_params"] == saved["n_params"]


def test_presets_and_flop_formula():
  small, _ = get_preset("small")
  params = jax.eval_shape(GPT(small).init, jax.random.PRNGKey(0),
                          jax.ShapeDtypeStruct((1, small.seq_len), np.int32))
  n = count_params(params)
  assert 120e6 < n < 130e6, n  # GPT-2 small
  long8k, _ = get_preset("long8k")
  assert long8k.seq_len == 8192 and long8k.head_dim == 128
  t = small.seq_len
  assert train_lib.flops_per_sequence(small, n) == 6 * t * n + 12 * 12 * 768 * t * t
  with pytest.raises(ValueError, match="preset"):
    get_preset("huge")
  with pytest.raises(ValueError, match="n_kv_head"):
    GPTConfig(n_head=4, n_kv_head=3)
  with pytest.raises(TypeError, match="scan_layers must be a bool"):
    GPTConfig(scan_layers="yes")
  with pytest.raises(ValueError, match="attention must be one of"):
    GPTConfig(attention="flash_cuda")
  with pytest.raises(SystemExit):  # argparse: "expected true/false"
    train_lib.parse_args(["--scan-layers", "maybe"])


@pytest.mark.skipif(ON_GPU, reason="checks the CPU error")
def test_cudnn_attention_needs_a_gpu():
  with pytest.raises(ValueError, match="cudnn"):
    attention_core(dataclasses.replace(MODEL, attention="cudnn"))


@pytest.mark.parametrize("remat", [False, True])
def test_scan_layers_is_the_same_model(remat):
  """scan_layers=True stacks the blocks' parameters on a leading axis and computes the same logits
  (and gradients) as the unrolled blocks given those parameters."""
  import jax.numpy as jnp
  unrolled = dataclasses.replace(MODEL, n_layer=3, remat=remat)
  scanned = dataclasses.replace(unrolled, scan_layers=True)
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, unrolled.vocab_size)
  params = GPT(unrolled).init(jax.random.key(1), tokens)["params"]
  blocks = [params[f"h_{i}"] for i in range(unrolled.n_layer)]
  stacked = {k: v for k, v in params.items() if not k.startswith("h_")}
  stacked["h"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}
  # the scanned model's own init has exactly this structure
  own = GPT(scanned).init(jax.random.key(1), tokens)["params"]
  assert jax.tree.structure(own) == jax.tree.structure(stacked)
  assert jax.tree.map(jnp.shape, own) == jax.tree.map(jnp.shape, stacked)
  out_u = GPT(unrolled).apply({"params": params}, tokens)
  out_s = GPT(scanned).apply({"params": stacked}, tokens)
  np.testing.assert_allclose(out_s, out_u, rtol=1e-5, atol=1e-5)
  loss = lambda m, p: GPT(m).apply({"params": p}, tokens).sum()
  g_u = jax.grad(lambda p: loss(unrolled, p))(params)
  g_s = jax.grad(lambda p: loss(scanned, p))(stacked)
  np.testing.assert_allclose(g_s["h"]["block"]["mlp"]["fc"]["kernel"][1],
                             g_u["h_1"]["mlp"]["fc"]["kernel"], rtol=1e-4, atol=1e-5)
