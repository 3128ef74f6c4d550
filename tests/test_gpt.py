"""The flax GPT example: learning, flash == xla, pmap, a mesh, a data x context mesh and two
processes == one device, bit-identical resume, and the command line as a user meets it (usage errors
instead of tracebacks, boolean flags, --help defaults, checkpoint messages, plain log lines without a
terminal, the sample's prompt, the README).

Tiny shapes on CPU; tests/conftest.py provides 4 CPU devices for the pmap test. Compiling is most of
this file's time: the runs share one TrainConfig, so ``steps_lib.compiled_steps`` reuses one set of
compiled steps across them (``stop_at`` ends a run early without changing its schedule).
"""
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

# The example is a package of the repository, not of the installed fa2_jax: import it from the root.
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fa2_jax  # noqa: E402
from examples.flax_gpt import checkpoint as checkpoint_lib  # noqa: E402
from examples.flax_gpt import cli as cli_lib  # noqa: E402
from examples.flax_gpt import data as data_lib  # noqa: E402
from examples.flax_gpt import generate as generate_lib  # noqa: E402
from examples.flax_gpt import metrics as metrics_lib  # noqa: E402
from examples.flax_gpt import steps as steps_lib  # noqa: E402
from examples.flax_gpt import train as train_lib  # noqa: E402
from examples.flax_gpt.config import PRESETS, GPTConfig, TrainConfig, get_preset  # noqa: E402
from examples.flax_gpt.model import GPT, attention_core, count_params  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
README = ROOT / "examples" / "flax_gpt" / "README.md"
# XLA's GPU scatter-adds and reductions are nondeterministic without this flag: two identical GPU runs
# then differ after a few steps (seen on an H200: 2.6e-2 in the parameters after 40 steps).
DETERMINISTIC_GPU_FLAG = "--xla_gpu_deterministic_ops=true"
DETERMINISTIC = not ON_GPU or DETERMINISTIC_GPU_FLAG in os.environ.get("XLA_FLAGS", "")
MODEL = GPTConfig(seq_len=32, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, position="rotary",
                  dtype="float32", attention="xla")
# 40 steps at lr 1e-2 learn visibly; validation only at the end; a loss logged at every step.
TRAIN = TrainConfig(batch_size=8, steps=40, lr=1e-2, warmup_steps=0, eval_every=0, eval_batches=2,
                    log_every=1, data_bytes=200_000)
# The same MODEL and TRAIN through the command line (the tiny preset with these overrides).
CLI_MODEL_TRAIN = [
    "--preset", "tiny", "--seq-len", "32", "--n-layer", "1", "--n-kv-head", "2", "--n-embd", "64",
    "--position", "rotary", "--attention", "xla", "--batch-size", "8", "--steps", "40",
    "--lr", "0.01", "--warmup-steps", "0", "--eval-every", "0", "--eval-batches", "2",
    "--log-every", "1", "--data-bytes", "200000"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  """200 kB of the stdlib sources in a file, so each run skips the directory walk."""
  path = tmp_path_factory.mktemp("data") / "stdlib.py.txt"
  path.write_bytes(data_lib.stdlib_source_bytes(200_000))
  return str(path)


def run(text_file, model=MODEL, **kw):
  return train_lib.train(model, TRAIN, data_path=text_file, progress="off", **kw)


@pytest.fixture(scope="module")
def baseline(text_file):
  """(state, summary) of one uninterrupted run of MODEL and TRAIN with a greedy 8-byte sample."""
  return run(text_file, sample_tokens=8, prompt="def ", temperature=0.0)


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
  # a command-line prompt that is not UTF-8 (Python hands its bytes over as lone surrogates)
  assert data_lib.encode(b"\xff\xfeab".decode("utf-8", "surrogateescape")).tolist() == [255, 254, 97, 98]


def test_samples_print_without_replacement_characters():
  """A sample of a barely trained byte model is often not UTF-8: its bad bytes print as \\xNN, and
  control characters as escapes, instead of U+FFFD or terminal control sequences."""
  ids = list(b"ok \xff\xc3( r\xc3\xa9\n\tx\x1b[2J\r") + [300] + list("\u202e".encode())
  text = data_lib.decode(ids)
  assert text == "ok \\xff\\xc3( ré\n\tx\\x1b[2J\\r?\\u202e"
  assert "\ufffd" not in text and text.isascii() is False and text.replace("\n\t", "").isprintable()


def test_sample_expectation_follows_the_validation_loss():
  summary = {"n_params": 842_496, "end_step": 600}
  assert train_lib.sample_expectation({**summary, "final_val_loss": None}) is None
  line = train_lib.sample_expectation({**summary, "final_val_loss": 1.8})
  assert line == ("(what to expect: a 0.84M-parameter byte-level model after 600 steps, validation "
                  "loss 1.80 nats per byte, writes byte-level gibberish with word-like fragments of "
                  "the training text)")
  worse = train_lib.sample_expectation({**summary, "final_val_loss": 3.0})
  better = train_lib.sample_expectation({**summary, "final_val_loss": 1.2})
  assert "barely started" in worse and "common words" in better
  assert "near-random bytes" in train_lib.sample_expectation({**summary, "final_val_loss": 5.1})


def test_training_reduces_the_loss_and_samples_greedily(baseline):
  state, summary = baseline
  curve = losses(summary)
  assert len(curve) == TRAIN.steps
  assert curve[0] > 5.0  # about ln(256) = 5.55 at initialisation
  assert curve[-1] < curve[0] - 1.5, curve
  assert summary["final_val_loss"] < curve[0] - 1.5
  # Temperature 0 is greedy: the first sampled byte is the trained model's most likely one.
  model, prompt = GPT(MODEL), data_lib.encode("def ")  # prompt: [4]
  window = np.pad(prompt, (0, MODEL.seq_len - len(prompt)))[None]  # [1, seq_len], as generate pads
  logits = jax.jit(model.apply)({"params": state.params}, window)  # [1, seq_len, vocab]
  most_likely = int(np.argmax(logits[0, len(prompt) - 1]))
  assert summary["sample"].startswith(data_lib.decode([*prompt, most_likely]))
  assert len(summary["sample"].encode()) >= 8
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    train_lib.generate(model, state.params, "def ", 2, temperature=-0.5)


def test_flash_kernel_matches_xla_attention(text_file, baseline):
  """The first steps with the fa2_jax kernels (interpret mode on CPU) equal those with XLA attention."""
  flash = dataclasses.replace(MODEL, attention="flash", flash_interpret=not ON_GPU)
  _, s_flash = run(text_file, model=flash, stop_at=3)
  np.testing.assert_allclose(losses(s_flash), losses(baseline[1])[:3],
                             rtol=1e-4 if not ON_GPU else 1e-2)


@pytest.mark.skipif(jax.local_device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_pmap_update_equals_single_device_update(text_file, baseline):
  """Same global batch split over 4 devices: the pmean-averaged AdamW steps equal the one-device
  steps, loss for loss and parameter for parameter."""
  multi, s_multi = run(text_file, data_parallel="pmap", stop_at=3)
  single, s_single = run(text_file, stop_at=3)  # the baseline's compiled step, stopped at step 3
  np.testing.assert_allclose(losses(s_multi), losses(baseline[1])[:3], rtol=1e-5)
  np.testing.assert_array_equal(losses(s_single), losses(baseline[1])[:3])
  assert int(multi.step) == int(single.step) == 3
  # AdamW's first steps move each parameter by about lr = 1e-2 whatever the gradient's size; the
  # summation order of the pmean changes the parameters by float32 rounding only.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
               multi.params, single.params)


@pytest.mark.skipif(jax.local_device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_mesh_update_equals_single_device_update(text_file):
  """--data-parallel mesh: one jit step over the global batch sharded on a 4-device mesh, with the
  fa2_jax kernels (interpret mode on CPU). Its steps equal the one-device steps of the same kernels,
  and the compiled step moves no activations between devices: the attention runs on each device's
  batch rows (fa2_jax.sharding); the collectives are the all-reduces of the gradients and the loss."""
  flash = dataclasses.replace(MODEL, attention="flash", flash_interpret=not ON_GPU)
  model, tx, runner = steps_lib.compiled_steps(flash, TRAIN, "mesh", jax.local_device_count())
  with pytest.raises(ValueError, match=r"--batch-size 6 must be divisible by the 4 devices of the "
                     r"mesh axis 'data' \(--mesh data=4,context=1\)"):
    steps_lib.Runner.create("mesh", model, tx, 6)
  state = runner.put_state(steps_lib.init_state(model, tx, TRAIN.seed))
  tokens = runner.shard(np.zeros((TRAIN.batch_size, flash.seq_len), np.int32))
  hlo = runner.train_step.lower(state, tokens, tokens).compile().as_text()
  ops = set(re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce)(?:-start)?\(", hlo))
  assert ops == {"all-reduce"}, ops
  multi, s_multi = run(text_file, model=flash, data_parallel="mesh", stop_at=3)
  single, s_single = run(text_file, model=flash, stop_at=3)
  assert s_multi["data_parallel"] == "mesh" and int(multi.step) == int(single.step) == 3
  np.testing.assert_allclose(losses(s_multi), losses(s_single), rtol=1e-5)
  # As for pmap: the all-reduce's summation order changes the parameters by float32 rounding only.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
               multi.params, single.params)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_fsdp_update_equals_single_device_update(text_file):
  """--mesh data=4 --fsdp: the parameters and AdamW's moments sharded over 'data' (each array along
  its largest dimension the axis divides), gathered by XLA where the step uses them. Three steps
  equal the one-device steps; the compiled step shards the state (no all-reduce of whole
  gradients alone: their reduce-scatter and the parameters' all-gather); the host state comes back
  whole. --fsdp without a mesh is refused, naming the flag."""
  multi, s_multi = run(text_file, mesh="data=4", fsdp=True, stop_at=3)
  single, s_single = run(text_file, stop_at=3)
  assert s_multi["fsdp"] is True and s_single["fsdp"] is False
  np.testing.assert_allclose(losses(s_multi), losses(s_single), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5),
               multi.params, single.params)
  axes = (("data", 4), ("context", 1))
  model, tx, runner = steps_lib.compiled_steps(MODEL, TRAIN, "mesh", jax.local_device_count(), axes,
                                               True)
  state = runner.put_state(steps_lib.init_state(model, tx, TRAIN.seed))
  emb = state.params["wte"]["embedding"]  # [vocab 256, 64]: sharded along the vocabulary
  assert emb.sharding.spec == jax.sharding.PartitionSpec("data") and not emb.is_fully_replicated
  assert all(x.addressable_data(0).size * 4 == x.size for x in jax.tree.leaves(state.opt_state)
             if x.ndim == 2)
  tokens = runner.shard(np.zeros((TRAIN.batch_size, MODEL.seq_len), np.int32))
  hlo = runner.train_step.lower(state, tokens, tokens).compile().as_text()
  assert re.search(r"\ball-gather(-start)?\(", hlo) and re.search(
      r"\b(reduce-scatter|all-reduce)(-start)?\(", hlo)
  assert_trees_equal(runner.get_state(state), jax.device_get(steps_lib.init_state(model, tx,
                                                                                 TRAIN.seed)))
  with pytest.raises(ValueError, match="--fsdp shards .* needs --mesh or --data-parallel mesh"):
    run(text_file, fsdp=True)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_context_mesh_step_equals_single_device_step(text_file):
  """--mesh data=2,context=2 --context-strategy ring: the batch split over 2 devices and the
  sequence over 2 in the zigzag layout, the attention a ring over 'context'
  (fa2_jax.context_parallel_attention, the kernels in interpret mode on CPU). Three AdamW steps equal the one-device steps, loss for loss and
  parameter for parameter (rotary positions and GQA: positions are the tokens' global ones on every
  device); a packed batch (segment ids and restarting positions split along the sequence) gives the
  one-device loss; the compiled step passes keys and values around the ring."""
  flash = dataclasses.replace(MODEL, attention="flash", flash_interpret=not ON_GPU,
                              context_strategy="ring")
  multi, s_multi = run(text_file, model=flash, mesh="data=2,context=2", stop_at=3)
  single, s_single = run(text_file, model=flash, stop_at=3)
  assert s_multi["data_parallel"] == "mesh" and s_multi["mesh"] == {"data": 2, "context": 2}
  assert int(multi.step) == int(single.step) == 3
  np.testing.assert_allclose(losses(s_multi), losses(s_single), rtol=1e-5)
  # The all-reduce's summation order and the ring's merge of partial softmaxes change the
  # gradients by float32 rounding only; AdamW's normalised update can carry such a difference of a
  # near-zero gradient into a parameter (2e-5 seen at lr 1e-2, 3 steps).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=5e-5),
               multi.params, single.params)

  axes = (("data", 2), ("context", 2))
  model, tx, runner = steps_lib.compiled_steps(flash, TRAIN, "mesh", jax.local_device_count(), axes)
  hlo = runner.eval_step.lower(multi.params, *map(runner.shard, (np.zeros((8, 32), np.int32),) * 2)
                               ).compile().as_text()
  assert re.search(r"\bcollective-permute(-start)?\(", hlo)  # keys and values around the ring
  lengths = [5, 9, 3, 30, 7, 2, 40, 11, 6, 25, 4, 60]  # many short documents: boundaries vary
  split = data_lib.Split(np.arange(sum(lengths), dtype=np.uint8) % 251,
                         np.cumsum([0] + lengths[:-1]))
  x, y = steps_lib.packed_batch(data_lib.get_packed_batch(split, 0, batch_size=8,
                                                          seq_len=flash.seq_len, seed=3))
  want = jax.jit(steps_lib.make_steps(model, tx, None)[1])(single.params, x, y)
  got = runner.eval_step(runner.put_state(single).params, runner.shard(x), runner.shard(y))
  np.testing.assert_allclose(runner.scalar(got), float(want), rtol=1e-5 if not ON_GPU else 2e-3)


def _free_port() -> int:
  import socket
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


@pytest.mark.skipif(ON_GPU, reason="the processes run on CPU; the one-process run here would not")
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
# fsdp=True is slow (CI time: two more processes, about 18 s): the state sharded over 'data' runs in
# CI in one process (test_fsdp_update_equals_single_device_update), two processes with fsdp=False
@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_two_processes_equal_one(text_file, tmp_path, fsdp):
  """Two processes on localhost (jax.distributed, CPU collectives through gloo), 2 CPU devices each,
  run the command line's --mesh data=2,context=2 steps (the batch split across the processes, the
  sequence within each; with --fsdp the state sharded across the processes too, gathered from both
  at the end); their losses equal those of one process on 4 devices (this one)."""
  flash = dataclasses.replace(MODEL, attention="flash")
  _, single = run(text_file, model=flash, mesh="data=2,context=2", stop_at=2, fsdp=fsdp)
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  argv = [sys.executable, "-m", "examples.flax_gpt.train", *CLI_MODEL_TRAIN, "--attention",
          "flash", "--mesh", "data=2,context=2", "--stop-at", "2", "--data", text_file,
          "--sample-tokens", "0", "--no-progress", "--coordinator", f"localhost:{port}",
          "--num-processes", "2"] + (["--fsdp"] if fsdp else [])
  procs = [subprocess.Popen(argv + ["--process-id", str(i), "--out", str(tmp_path / f"{i}.json")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in range(2)]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
  assert ("mesh data=2,context=2" + (", state sharded over data (FSDP)" if fsdp else "")
          + ", 2 processes") in outputs[0]
  assert json.loads((tmp_path / "0.json").read_text())["fsdp"] is fsdp
  assert not (tmp_path / "1.json").exists()  # process 0 prints and writes --out
  summary = json.loads((tmp_path / "0.json").read_text())
  assert summary["processes"] == 2 and summary["devices"]["count"] == 4
  np.testing.assert_allclose(losses(summary), losses(single), rtol=1e-5)
  np.testing.assert_allclose(summary["final_val_loss"], single["final_val_loss"], rtol=1e-5)


def test_checkpoint_resume_is_bit_identical_and_says_so(text_file, baseline, tmp_path, capsys):
  ckpt = tmp_path / "ckpt"
  first, s1 = run(text_file, ckpt_dir=str(ckpt), stop_at=20, resume=True)
  out = capsys.readouterr().out
  assert f"no checkpoint in {ckpt}: starting from step 0" in out
  assert f"saving the checkpoint of step 20 to {ckpt / '20'}" in out and (ckpt / "20").is_dir()
  assert int(first.step) == 20 and s1["end_step"] == 20
  # A folder that holds checkpoints is not trained over from step 0 without --resume.
  message = cli_error(CLI_MODEL_TRAIN + ["--data", text_file, "--ckpt-dir", str(ckpt)], capsys)
  assert message.endswith(f"--ckpt-dir {ckpt} already holds checkpoints (newest: step 20): pass "
                          "--resume to continue from it, or choose another folder")
  with pytest.raises(ValueError, match="already holds checkpoints"):
    run(text_file, ckpt_dir=str(ckpt))
  resumed, s2 = run(text_file, ckpt_dir=str(ckpt), resume=True)
  out = capsys.readouterr().out
  assert f"resuming from the checkpoint of step 20 in {ckpt}" in out
  assert f"saving the checkpoint of step 40 to {ckpt / '40'}" in out
  assert s2["start_step"] == 20 and int(resumed.step) == 40
  if DETERMINISTIC:
    assert_trees_equal(resumed.params, baseline[0].params)
    assert_trees_equal(resumed.opt_state, baseline[0].opt_state)
  else:  # test_resume_is_bit_identical_on_gpu_with_deterministic_ops checks the bits on GPU
    np.testing.assert_allclose(s2["final_val_loss"], baseline[1]["final_val_loss"], rtol=2e-2)


def test_resume_with_other_model_flags_is_a_usage_error(text_file, baseline, tmp_path, capsys):
  """A checkpoint of another model (other layers: another tree; another width: other shapes) is
  refused with a usage error, not restored with its own shapes or an orbax traceback."""
  ckpt = tmp_path / "ckpt"
  run(text_file, ckpt_dir=str(ckpt), stop_at=2)
  capsys.readouterr()
  base = CLI_MODEL_TRAIN + ["--data", text_file, "--ckpt-dir", str(ckpt), "--resume"]
  for flags, what in ((["--n-layer", "2"], "another model or optimizer state"),
                      (["--n-embd", "32"], "arrays of other shapes")):
    message = cli_error(base + flags, capsys)
    assert f"--resume: the checkpoint of step 2 in {ckpt} holds {what}" in message
    assert message.endswith("resume with the flags it was trained with, or give another --ckpt-dir")


def test_validation_at_the_last_step_run_and_with_its_train_loss(text_file, capsys):
  """An evaluation step that is not a logging step reports that step's train loss, and a run that
  stop_at ends early still validates at its last step."""
  train = dataclasses.replace(TRAIN, eval_every=5, log_every=10)
  _, summary = train_lib.train(MODEL, train, data_path=text_file, progress="off", stop_at=7)
  _, every = train_lib.train(MODEL, dataclasses.replace(train, log_every=1), data_path=text_file,
                             progress="off", stop_at=7)
  out = capsys.readouterr().out
  loss_at = {h["step"]: h["loss"] for h in every["history"] if "loss" in h}
  assert f"step 5: train loss {loss_at[5]:.4f}, val loss" in out
  assert f"step 7: train loss {loss_at[7]:.4f}, val loss" in out
  vals = [h["step"] for h in summary["history"] if "val_loss" in h]
  assert vals == [5, 7] and summary["final_val_loss"] is not None


@pytest.mark.gpu
def test_resume_is_bit_identical_on_gpu_with_deterministic_ops(text_file, tmp_path):
  """With XLA's deterministic GPU ops a resumed run ends exactly where an uninterrupted one does
  (same final train and validation losses, to the bit). Separate processes: XLA_FLAGS is read when
  the GPU backend starts."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC_GPU_FLAG}".strip()
  env = dict(os.environ, XLA_FLAGS=flags)

  def cli(name, *extra):
    out = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, "-m", "examples.flax_gpt.train", *CLI_MODEL_TRAIN,
                    "--data", text_file, "--sample-tokens", "0", "--no-progress", "--out", str(out),
                    *extra], check=True, cwd=ROOT, env=env, capture_output=True)
    return json.loads(out.read_text())
  ckpt = str(tmp_path / "ckpt")
  straight = cli("straight")
  assert cli("first", "--ckpt-dir", ckpt, "--stop-at", "20")["end_step"] == 20
  resumed = cli("resumed", "--ckpt-dir", ckpt, "--resume")
  assert resumed["start_step"] == 20 and resumed["end_step"] == 40
  assert resumed["final_train_loss"] == straight["final_train_loss"]
  assert resumed["final_val_loss"] == straight["final_val_loss"]


def test_cli_run_logs_lines_and_writes_a_json_summary(text_file, tmp_path, capsys):
  argv = CLI_MODEL_TRAIN + ["--data", text_file, "--stop-at", "4", "--sample-tokens", "4",
                            "--out", str(tmp_path / "summary.json")]
  assert cli_lib.configs_from_args(cli_lib.parse_args(argv)) == (MODEL, TRAIN)
  summary = train_lib.main(argv)
  out = capsys.readouterr().out  # captured: stdout is not a terminal, so no progress bar
  assert "\r" not in out
  # TFLOP/s only on a GPU (or with --peak-tflops), MFU only with a known peak
  flops = r", [\d.e+-]+ TFLOP/s(, MFU [\d.]+%)?" if ON_GPU else ""
  logged = re.findall(rf"^step (\d+)/4: loss [\d.]+, [\d,]+ tok/s{flops}( \(includes compilation\))?$",
                      out, flags=re.M)
  assert [step for step, *_ in logged] == ["1", "2", "3", "4"]  # every --log-every 1 steps
  if not ON_GPU:
    assert "TFLOP/s" not in out and "MFU" not in out
    assert re.search(r"^[\d,]+ parameters; final train loss [\d.]+, val loss [\d.]+; [\d,]+ "
                     r"tokens/s; wall time [\d.]+ s$", out, flags=re.M), out
  # A short summary of the configs, not their dataclass reprs.
  assert "GPTConfig(" not in out and "TrainConfig(" not in out
  assert out.startswith(
      "preset tiny, changed by --seq-len 32 --n-layer 1 --n-kv-head 2 --n-embd 64 --position "
      "rotary --attention xla --batch-size 8 --steps 40 --lr 0.01 --warmup-steps 0 --eval-every 0 "
      "--eval-batches 2 --log-every 1 --data-bytes 200000\n"
      "  model: a GPT of 1 layer x 64 wide, 4 heads of 16 (2 key/value heads), a context of 32 "
      "tokens (bytes), rotary positions, float32 compute\n"
      "  training: 40 steps of 8 sequences, learning rate 0.01 after 0 warm-up steps, then cosine "
      "decay; validation at the last step\n"
      f"  data: {text_file}, at most 200,000 bytes; jax {jax.__version__} on ")
  assert re.search(r"^--- sample: 4 bytes after the prompt, temperature 0.8 ---$", out, flags=re.M)
  assert re.search(r"^\(what to expect: a 0.\d+M-parameter byte-level model after 4 steps, "
                   r"validation loss [\d.]+ nats per byte, writes .*\)$", out, flags=re.M), out
  assert "attention xla: jax.nn.dot_product_attention(implementation='xla')" in out
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["preset"] == "tiny" and saved["attention"] == "xla"
  assert saved["attention_backend"] == "jax.nn.dot_product_attention/xla"
  assert saved["model_config"] == dataclasses.asdict(MODEL) and saved["end_step"] == 4
  for key in ("final_train_loss", "tokens_per_s", "tflops_per_s", "mfu", "devices", "versions"):
    assert key in saved
  assert saved["mfu"] is None if not ON_GPU else saved["mfu"] > 0
  assert summary["n_params"] == saved["n_params"]
  # The sample continues the first line of --data, not the default Python prompt.
  first_line = pathlib.Path(text_file).read_text().splitlines(keepends=True)[0]
  assert saved["prompt"] == first_line != train_lib.DEFAULT_PROMPT
  assert saved["sample"].startswith(first_line)


def test_attention_kernels_are_fa2_jax_public_dispatch():
  flash = dataclasses.replace(MODEL, attention="flash")
  q = jax.ShapeDtypeStruct((1, MODEL.seq_len, MODEL.n_head, MODEL.head_dim), np.float32)
  k = jax.ShapeDtypeStruct((1, MODEL.seq_len, MODEL.kv_heads, MODEL.head_dim), np.float32)
  expected = fa2_jax.backend_for(q, k, is_causal=True)
  assert train_lib.attention_dispatch(flash) == expected
  assert expected.backend == ("xla" if not ON_GPU else "triton")  # float32: not the Mosaic kernels
  assert train_lib.describe_attention(flash) == (
      f"attention flash: fa2_jax {cli_lib.cli_message(str(expected))}")
  interpreted = dataclasses.replace(flash, attention="flash_triton", flash_interpret=True)
  assert train_lib.attention_dispatch(interpreted) == fa2_jax.backend_for(
      q, k, is_causal=True, implementation="triton", interpret=True)
  assert train_lib.attention_dispatch(MODEL) is None  # xla: jax.nn.dot_product_attention


def test_presets_and_flop_formula():
  small, _ = get_preset("small")
  params = jax.eval_shape(GPT(small).init, jax.random.PRNGKey(0),
                          jax.ShapeDtypeStruct((1, small.seq_len), np.int32))
  n = count_params(params)
  assert 120e6 < n < 130e6, n  # GPT-2 small
  long8k, _ = get_preset("long8k")
  assert long8k.seq_len == 8192 and long8k.head_dim == 128
  t = small.seq_len
  assert metrics_lib.flops_per_sequence(small, n) == 6 * t * n + 12 * 12 * 768 * t * t
  with pytest.raises(ValueError, match="preset"):
    get_preset("huge")
  with pytest.raises(ValueError, match="n_kv_head"):
    GPTConfig(n_head=4, n_kv_head=3)
  for bad in (0, -2):  # 0 would have meant n_head, -2 divides 4
    with pytest.raises(ValueError, match="n_kv_head must be >= 1"):
      GPTConfig(n_head=4, n_kv_head=bad)
  with pytest.raises(TypeError, match="scan_layers must be a bool"):
    GPTConfig(scan_layers="yes")
  with pytest.raises(ValueError, match="attention must be one of"):
    GPTConfig(attention="flash_cuda")
  for field, bad in (("lr", 0.0), ("lr", float("nan")), ("lr", float("inf")), ("seed", -1),
                     ("beta2", 1.0), ("grad_clip", float("nan")), ("weight_decay", float("inf"))):
    with pytest.raises(ValueError, match=field):
      TrainConfig(**{field: bad})


@pytest.mark.skipif(ON_GPU, reason="checks the CPU error")
def test_cudnn_attention_needs_a_gpu():
  with pytest.raises(ValueError, match="cudnn"):
    attention_core(dataclasses.replace(MODEL, attention="cudnn"))


def test_scan_layers_is_the_same_model():
  """scan_layers=True stacks the blocks' parameters on a leading axis and computes the same logits
  (and gradients) as the unrolled blocks given those parameters, with and without remat."""
  import jax.numpy as jnp
  unrolled = dataclasses.replace(MODEL, n_layer=2)
  scanned = dataclasses.replace(unrolled, scan_layers=True)
  tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, unrolled.vocab_size)
  params = jax.jit(GPT(unrolled).init)(jax.random.key(1), tokens)["params"]
  blocks = [params[f"h_{i}"] for i in range(unrolled.n_layer)]
  stacked = {k: v for k, v in params.items() if not k.startswith("h_")}
  stacked["h"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}
  # the scanned model's own init has exactly this structure
  own = jax.eval_shape(GPT(scanned).init, jax.random.key(1), tokens)["params"]
  assert jax.tree.structure(own) == jax.tree.structure(stacked)
  assert jax.tree.map(jnp.shape, own) == jax.tree.map(jnp.shape, stacked)

  def logits_and_grads(config, p):
    logits = lambda p: GPT(config).apply({"params": p}, tokens)  # [2, 32, vocab]
    return jax.jit(lambda p: (logits(p), jax.grad(lambda q: logits(q).sum())(p)))(p)
  out_u, g_u = logits_and_grads(unrolled, params)
  second_block = {  # the gradient of block 1's MLP input matrix, in each parameter layout
      False: lambda g: g["h_1"]["mlp"]["fc"]["kernel"],
      True: lambda g: g["h"]["block"]["mlp"]["fc"]["kernel"][1]}
  for config in (scanned, dataclasses.replace(scanned, remat=True),
                 dataclasses.replace(unrolled, remat=True)):
    out, g = logits_and_grads(config, stacked if config.scan_layers else params)
    np.testing.assert_allclose(out, out_u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second_block[config.scan_layers](g), second_block[False](g_u),
                               rtol=1e-4, atol=1e-5)


# --- the command line as a user meets it ----------------------------------------------------------

def cli_error(argv, capsys) -> str:
  """Runs the CLI expecting a usage error (status 2, before any training): one line on stderr,
  ``train: error: MESSAGE; see --help``, without argparse's usage text; its MESSAGE."""
  with pytest.raises(SystemExit) as exit_info:
    train_lib.main(argv)
  assert exit_info.value.code == 2
  captured = capsys.readouterr()
  assert not re.search(r"^step \d", captured.out, flags=re.M)  # no training step ran
  line, = captured.err.splitlines()
  assert line.startswith("train: error: ") and line.endswith("; see --help"), line
  return line[len("train: error: "):-len("; see --help")]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--n-kv-head", "3"], "--n-head (4) must be a multiple of --n-kv-head (3)"),
    (["--n-kv-head", "0"], "--n-kv-head must be >= 1 (unset: --n-head), got 0"),
    (["--n-embd", "130"], "--n-embd (130) must be a multiple of --n-head (4)"),
    (["--position", "rotary", "--n-embd", "132"],
     "--position 'rotary' needs an even head_dim (--n-embd / --n-head), got 132 / 4 = 33"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--grad-clip", "nan"], "--grad-clip must be a finite number >= 0, got nan"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["--vocab-size", "100"], "--vocab-size must be >= 256 (the tokens are bytes), got 100"),
    (["--temperature", "-1"], "--temperature must be >= 0 (0: greedy), got -1.0"),
    (["--sample-tokens", "-1"], "--sample-tokens must be >= 0, got -1"),
    (["--stop-at", "0"], "--stop-at must be >= 1, got 0"),
    (["--steps", "20", "--stop-at", "50"], "--stop-at 50 is past --steps 20 (the last step of "
                                           "the learning-rate schedule); give a smaller --stop-at "
                                           "or more --steps"),
    # (argparse quotes the choices or not, by Python version)
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge' (choose from ..."),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--context-strategy", "spiral"], "argument --context-strategy: invalid choice: 'spiral' "
                                       "(choose from ..."),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0, got 0.0"),
    (["--resume"], "--resume needs --ckpt-dir, the folder of the checkpoints to resume from"),
    (["--attention", "xla", "--interpret"], "--interpret true runs the fa2_jax kernels, which "
                                            "--attention xla does not use; pass --attention flash "
                                            "or flash_triton"),
    (["--remat", "maybe"], "argument --remat: expected true/false, got 'maybe'"),
    (["--window", "-1"], "--window must be an int >= 0 (unset: the whole context), got -1"),
    (["--soft-cap", "0"], "--soft-cap must be a finite number > 0 (unset: no cap), got 0.0"),
    # values the example's own check lets through reach fa2_jax's, whose names become the flags
    (["--soft-cap", "1e-40"], "--soft-cap must be in [1e-30, 1e+30] (the ..."),
    (["--window", str(2**30)], "--window must be < 2**30 (unset: the "
                               "whole context), got 1073741824"),
    (["--attention", "xla", "--packing"], "--packing needs fa2_jax attention (--attention flash, "
                                          "flash_triton or flash_mosaic): "
                                          "jax.nn.dot_product_attention (--attention xla) has no "
                                          "segment ids"),
    (["--attention", "xla", "--soft-cap", "30"], "--soft-cap needs fa2_jax attention (--attention "
                                                 "flash, flash_triton or flash_mosaic): "
                                                 "jax.nn.dot_product_attention (--attention xla) "
                                                 "has no logits soft cap"),
    (["--mesh", "model=2"], "argument --mesh: --mesh 'model=2': unknown axis 'model'; the axes are "
                            "('data', 'context')"),
    (["--mesh", "data=2;context=2"], "argument --mesh: --mesh 'data=2;context=2': expected "
                                     "axis=size items separated by commas, e.g. data=2,context=2"),
    (["--mesh", "data=3"], "--mesh data=3 covers 3 devices, but there are 4 (every process's); the "
                           "axis sizes must multiply to 4"),
    (["--mesh", "context=4", "--seq-len", "36"], "--seq-len 36 must be divisible by 8: twice the 4 "
                                                 "devices of the mesh axis 'context', whose layout "
                                                 "gives each device two chunks of the sequence "
                                                 "(--mesh data=1,context=4)"),
    (["--mesh", "data=4", "--batch-size", "6"], "--batch-size 6 must be divisible by the 4 devices "
                                                "of the mesh axis 'data' (--mesh data=4,context=1)"),
    (["--fsdp"], "--fsdp shards the parameters and optimizer state over the mesh axis 'data': it "
                 "needs --mesh or --data-parallel mesh, got --data-parallel none"),
    (["--fsdp", "maybe"], "argument --fsdp: expected true/false, got 'maybe'"),
    (["--context-strategy", "ring"], "--context-strategy ring exchanges the sequence over the mesh "
                                     "axis 'context': it needs --mesh with context=C, C > 1"),
    (["--mesh", "context=4", "--context-strategy", "all_to_all", "--n-kv-head", "2"],
     "--context-strategy all_to_all splits the heads over the 4 devices of the mesh axis 'context': "
     "--n-head 4 and the 2 key/value heads (--n-kv-head) must both be divisible by it; use "
     "--context-strategy ring or all_gather (--mesh data=1,context=4)"),
    (["--mesh", "data=2,context=2", "--data-parallel", "pmap"],
     "--mesh runs one jit step on a device mesh; it cannot be combined with --data-parallel pmap "
     "(leave --data-parallel out, or pass mesh)"),
    (["--coordinator", "localhost:1234"], "a multi-process run needs --coordinator, --num-processes "
                                          "and --process-id; missing: --num-processes (or "
                                          "JAX_NUM_PROCESSES), --process-id (or JAX_PROCESS_ID)"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "--coordinator must be HOST:PORT (process 0's address), got 'localhost'"),
    (["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in [0, 2) for --num-processes 2, got 2"),
])
def test_cli_rejects_bad_values_with_a_usage_error(argv, message, capsys):
  error = cli_error(argv, capsys)
  if message.endswith("..."):  # the message's start: its rest explains the library's bound, ...
    assert error.startswith(message[:-3]), error
  else:
    assert error == message


def test_config_rejects_an_unknown_context_strategy():
  with pytest.raises(ValueError, match=r"context_strategy must be one of \('ring', 'all_to_all', "
                                       r"'all_gather'\) or None \(fa2_jax's choice\), got 'spiral'"):
    GPTConfig(context_strategy="spiral")


def test_cli_checks_the_checkpoint_folder_before_training(tmp_path, capsys):
  """--ckpt-dir where nothing can be written: one line before any work, not orbax's traceback at
  the first save."""
  a_file = tmp_path / "notes.txt"
  a_file.write_text("")
  assert cli_error(["--ckpt-dir", str(a_file)], capsys) == (
      f"--ckpt-dir {a_file} is a file, not a folder")
  assert cli_error(["--ckpt-dir", str(a_file / "ckpt")], capsys) == (
      f"--ckpt-dir {a_file / 'ckpt'}: {a_file} is a file, not a folder; choose a folder you can "
      "write to")
  locked = tmp_path / "locked"
  locked.mkdir()
  locked.chmod(0o500)
  try:
    probe = locked if os.geteuid() != 0 else pathlib.Path("/sys")  # root writes in a 0o500 folder
    try:
      checkpoint_lib.tempfile.TemporaryDirectory(dir=probe).cleanup()
      pytest.skip(f"{probe} is writable here")
    except OSError as e:
      reason = e.strerror
    assert cli_error(["--ckpt-dir", str(probe / "run" / "ckpt")], capsys) == (
        f"--ckpt-dir {probe / 'run' / 'ckpt'}: cannot write in {probe} ({reason}); choose a folder "
        "you can write to")
  finally:
    locked.chmod(0o700)
  assert checkpoint_lib.unwritable_reason(str(tmp_path / "new" / "ckpt")) is None
  assert not (tmp_path / "new").exists()  # the check leaves nothing behind
  assert checkpoint_lib.unwritable_reason("gs://bucket/ckpt") is None  # left to orbax


def test_cli_rejects_missing_and_too_short_data(tmp_path, capsys):
  missing = str(tmp_path / "missing.txt")
  assert cli_error(["--data", missing], capsys).endswith(f"--data {missing}: no such file or folder")
  short = tmp_path / "short.txt"
  short.write_text("x = 1\n" * 20)  # 120 bytes: a 12-byte validation split cannot hold 129 bytes
  assert "too short for seq_len=128" in cli_error(["--data", str(short)], capsys)


@pytest.mark.skipif(ON_GPU, reason="the CPU messages of the GPU-only kernels")
def test_cli_names_its_own_flags_for_gpu_only_attention(capsys):
  triton = cli_error(["--attention", "flash_triton"], capsys)
  assert "--attention flash_triton cannot run this call: it needs a GPU" in triton
  assert "pass --interpret true" in triton and "use --attention flash or --attention xla" in triton
  assert "interpret=True" not in triton and "implementation=" not in triton
  mosaic = cli_error(["--attention", "flash_mosaic"], capsys)
  assert "Hopper" in mosaic and "use --attention flash or --attention xla" in mosaic
  assert "implementation=" not in mosaic
  assert "needs an NVIDIA GPU" in cli_error(["--attention", "cudnn"], capsys)
  # With the kernels in interpret mode the same choice is accepted and reported.
  interpreted = dataclasses.replace(MODEL, attention="flash_triton", flash_interpret=True)
  assert train_lib.attention_dispatch(interpreted).backend == "triton"
  assert train_lib.describe_attention(dataclasses.replace(MODEL, attention="flash")).endswith(
      "pass --interpret true to run the Triton kernels in Pallas interpret mode")


def test_every_boolean_flag_is_a_switch_or_takes_a_value():
  parser = cli_lib.build_parser()
  bool_flags = {a.option_strings[0]: a.dest for a in parser._actions if a.type is cli_lib._bool}
  assert set(bool_flags) == {"--interpret", "--tie-embeddings", "--remat", "--scan-layers",
                             "--packing", "--resume", "--no-progress", "--fsdp"}
  for flag, dest in bool_flags.items():
    assert getattr(parser.parse_args([flag]), dest) is True, flag
    assert getattr(parser.parse_args([flag, "--steps", "3"]), dest) is True, flag
    assert getattr(parser.parse_args([flag, "true"]), dest) is True, flag
    assert getattr(parser.parse_args([flag, "false"]), dest) is False, flag
    assert getattr(parser.parse_args([]), dest) in (None, False), flag  # None: the preset's
  mc, _ = cli_lib.configs_from_args(parser.parse_args(["--remat", "--scan-layers", "no"]))
  assert mc.remat is True and mc.scan_layers is False and mc.tie_embeddings is True


def test_help_shows_real_defaults(capsys):
  with pytest.raises(SystemExit) as exit_info:
    train_lib.main(["--help"])
  assert exit_info.value.code == 0
  text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
  assert "default: None" not in text
  steps = ", ".join(f"{name} {train.steps}" for name, (_, train) in PRESETS.items())
  assert f"optimizer steps; also the length of the learning-rate schedule (warm-up, then cosine " \
         f"decay; a run of at most --warmup-steps steps stops before the peak --lr) (default per " \
         f"preset: {steps})" in text
  assert "--sample-tokens SAMPLE_TOKENS bytes to sample after training (0: no sample) " \
         "(default: 300)" in text
  # Every preset-derived flag lists each preset's value of its field.
  for action in cli_lib.build_parser()._actions:
    if action.dest in cli_lib._OVERRIDES:
      assert action.default is None and "default" in action.help, action.dest
      assert "in every preset" in action.help or all(name in action.help for name in PRESETS)


def test_progress_is_a_bar_only_on_a_terminal(monkeypatch):
  assert train_lib.progress_mode("auto") == "lines"  # pytest captures stdout: not a terminal
  assert train_lib.progress_mode(False) == "off" and train_lib.progress_mode("bar") == "bar"
  monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
  assert train_lib.progress_mode("auto") == "bar" and train_lib.progress_mode(True) == "bar"
  with pytest.raises(ValueError, match="progress must be one of"):
    train_lib.progress_mode("quiet")


def test_cli_passes_its_run_flags_to_train(text_file, monkeypatch, capsys):
  """What main hands to train() for --no-progress, --prompt, --resume and the rest."""
  calls = []

  class Stop(Exception):
    pass

  def fake_train(mc, tc, **kw):
    calls.append(kw)
    raise Stop
  monkeypatch.setattr(train_lib, "train", fake_train)
  for argv in (["--no-progress"], ["--no-progress", "false", "--prompt", "x = ", "--temperature",
                                   "0", "--stop-at", "3", "--data", text_file]):
    with pytest.raises(Stop):
      train_lib.main(argv)
  capsys.readouterr()
  assert calls[0]["progress"] == "off" and calls[0]["prompt"] is None  # None: from the data
  assert calls[0]["data_path"] is None and calls[0]["resume"] is False
  assert calls[1]["progress"] == "auto" and calls[1]["prompt"] == "x = "
  assert calls[1]["temperature"] == 0.0 and calls[1]["stop_at"] == 3
  assert calls[1]["data_path"] == text_file


def test_prompt_from_the_data():
  tokens = data_lib.encode("\n  \n# notes on tea\nmore\n").astype(np.uint8)
  assert data_lib.opening_line(tokens) == "# notes on tea\n"
  long_line = data_lib.encode("é" * 100).astype(np.uint8)  # 200 bytes, 2 per character
  assert data_lib.opening_line(long_line, max_bytes=7) == "é" * 3  # the half character is dropped


def test_readme_matches_the_cli():
  text = README.read_text()
  parser_flags = {s for a in cli_lib.build_parser()._actions for s in a.option_strings
                  if s.startswith("--")}
  # (not XLA's --xla_... flags: theirs have underscores)
  readme_flags = set(re.findall(r"(?<![\w=-])--[a-z][a-z0-9-]*(?![\w])", text))
  assert parser_flags - readme_flags == set(), "flags missing from the README"
  generate_flags = {s for a in generate_lib.build_parser()._actions for s in a.option_strings
                    if s.startswith("--")}
  assert generate_flags - readme_flags == set(), "generate.py's flags missing from the README"
  assert readme_flags - parser_flags - generate_flags == set(), \
      "the README names flags the CLI does not have"
  for flag, listed in re.findall(r"`(--[a-z-]+) \{([\w,]+)\}", text):  # e.g. `--dtype {...}`
    action = next(a for a in cli_lib.build_parser()._actions if flag in a.option_strings)
    assert listed.split(",") == list(action.choices), flag
  installs = re.findall(r"pip install[^\n`]*", text)
  assert installs and all("-c constraints.txt" in line for line in installs), installs
  for name, (model, train) in PRESETS.items():  # the preset table's row
    row = next(line for line in text.splitlines() if line.startswith(f"| `{name}`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert str(model.seq_len) in cells and str(train.batch_size) in cells, row
    assert str(train.steps) in cells and format(train.lr, "g") in cells, row


# --- packing, sliding window, soft cap ------------------------------------------------------------

def test_packed_batch_marks_the_documents():
  """get_packed_batch: the windows of get_batch, each byte's document as its segment id, positions
  from 0 where a document starts in the window, and weight 0 on the targets in the next document;
  load_documents: one document per file of a folder, the starts carried across the 90/10 split."""
  docs = [b"abc" * 5, b"x" * 40, b"hello\n" * 3, b"yz" * 20]  # 15, 40, 18 and 40 bytes
  split = data_lib.Split(np.frombuffer(b"".join(docs), np.uint8), np.array([0, 15, 55, 73]))
  packed = data_lib.get_packed_batch(split, 3, batch_size=6, seq_len=16, seed=1)
  x, y = data_lib.get_batch(split.tokens, 3, batch_size=6, seq_len=16, seed=1)
  np.testing.assert_array_equal(packed.tokens, x)
  np.testing.assert_array_equal(packed.targets, y)
  doc_of = np.repeat(np.arange(4), [15, 40, 18, 40])  # each byte's document
  for row in range(6):
    start = next(s for s in range(len(split.tokens)) if np.array_equal(
        split.tokens[s:s + 16], packed.tokens[row]))  # the window's offset
    docs_here = doc_of[start:start + 17]  # inputs and the last target
    np.testing.assert_array_equal(packed.segment_ids[row], docs_here[:-1])
    np.testing.assert_array_equal(packed.weights[row], docs_here[:-1] == docs_here[1:])
    for i in range(16):  # tokens since the document's start, or since the window's
      earlier = [j for j in range(i + 1) if docs_here[j] == docs_here[i]]
      assert packed.positions[row, i] == i - earlier[0]
  assert any(len(set(r)) > 1 for r in packed.segment_ids)  # the draw holds a boundary

  folder = pathlib.Path(__file__).parent  # these .py files: many documents
  train, val = data_lib.load_documents(str(folder), 20_000, 32)
  assert len(train.tokens) + len(val.tokens) == 20_000
  assert train.doc_starts[0] == val.doc_starts[0] == 0 and len(train.doc_starts) > 1
  assert np.all(np.diff(train.doc_starts) > 0)
  assert b"".join(data_lib.text_documents(folder, 20_000)) == data_lib.text_bytes(folder, 20_000)


# Window and soft cap small enough to change this model's attention (seq_len 32).
VARIANT_MODEL = dataclasses.replace(MODEL, attention="flash", window=6, soft_cap=2.0)


@pytest.mark.parametrize("config", [
    VARIANT_MODEL,  # rotary positions
    dataclasses.replace(VARIANT_MODEL, position="learned", n_layer=2, scan_layers=True)],
    ids=["rotary", "learned-scan"])
def test_packing_gives_the_loss_of_separate_documents(config):
  """Two documents packed into one sequence give the loss summed over the same tokens of each
  document run alone: segment ids keep attention inside each, positions restart, and the target
  crossing into the second document is left out. The packed loss goes through the training loss
  (steps_lib.make_steps); the separate documents through the model alone."""
  n1 = 13  # the first document's length; the second fills the sequence
  docs = [np.asarray(jax.random.randint(jax.random.key(i), (n,), 0, 256), np.int32)
          for i, n in enumerate((n1 + 1, config.seq_len - n1))]  # doc 0 has one byte as its end
  stream = np.concatenate(docs)  # [seq_len + 1]: inputs and targets of one window
  split = data_lib.Split(stream.astype(np.uint8), np.array([0, n1 + 1]))
  packed = data_lib.get_packed_batch(split, 0, batch_size=1, seq_len=config.seq_len, seed=0)
  np.testing.assert_array_equal(packed.tokens[0], stream[:-1])  # the only window there is
  model = GPT(config)
  params = jax.jit(model.init)(jax.random.key(1), packed.tokens)["params"]
  _, eval_step = steps_lib.make_steps(model, steps_lib.make_optimizer(TRAIN), None)
  weight = packed.weights.sum()
  assert weight == config.seq_len - 1  # every target but the one in the next document
  packed_sum = float(jax.jit(eval_step)(params, *steps_lib.packed_batch(packed))) * weight

  separate_sum = 0.0
  for doc in docs:  # each alone, from position 0: its next-byte losses within itself
    logits = jax.jit(model.apply)({"params": params}, doc[None, :-1])  # [1, n - 1, vocab]
    logp = jax.nn.log_softmax(logits[0], axis=-1)
    separate_sum -= np.sum(np.take_along_axis(np.asarray(logp, np.float64), doc[1:, None], -1))
  # On a GPU the model's float32 XLA matmuls may use TF32, which rounds the two shapes differently.
  np.testing.assert_allclose(packed_sum, separate_sum, rtol=1e-5 if not ON_GPU else 2e-3)

  # Without the segment ids the second document sees the first: the loss differs.
  unpacked = steps_lib.packed_batch(packed._replace(segment_ids=np.zeros_like(packed.segment_ids)))
  assert abs(float(jax.jit(eval_step)(params, *unpacked)) * weight - packed_sum) > 1e-3


def test_window_soft_cap_and_packing_train_from_the_cli(tmp_path, capsys):
  """A short run with --packing --window --soft-cap on a folder of documents: the flags reach the
  configs, the dispatch line and the summary; the loss is finite and the attended FLOPs are fewer
  than the dense ones."""
  folder = tmp_path / "docs"
  folder.mkdir()
  for i, path in enumerate(sorted((ROOT / "examples" / "flax_gpt").glob("*.py"))):
    (folder / f"{i}.txt").write_bytes(path.read_bytes())
  argv = ["--preset", "tiny", "--seq-len", "32", "--n-layer", "1", "--n-kv-head", "2",
          "--n-embd", "64", "--position", "rotary", "--attention", "flash", "--batch-size", "4",
          "--steps", "40", "--stop-at", "2", "--eval-every", "0", "--eval-batches", "1",
          "--log-every", "1", "--data-bytes", "20000", "--data", str(folder), "--packing",
          "--window", "6", "--soft-cap", "2", "--sample-tokens", "0",
          "--out", str(tmp_path / "summary.json")]
  mc, tc = cli_lib.configs_from_args(cli_lib.parse_args(argv))
  assert (mc.window, mc.soft_cap, tc.packing) == (6, 2.0, True)
  summary = train_lib.main(argv)
  out = capsys.readouterr().out
  assert train_lib.describe_attention(mc, packing=True) in out
  expected = fa2_jax.backend_for(
      jax.ShapeDtypeStruct((1, 32, 4, 16), np.float32), jax.ShapeDtypeStruct((1, 32, 2, 16),
                                                                             np.float32),
      is_causal=True, local_window_size=(6, 0), logits_soft_cap=2.0,
      q_segment_ids=jax.ShapeDtypeStruct((1, 32), np.int32),
      kv_segment_ids=jax.ShapeDtypeStruct((1, 32), np.int32))
  assert train_lib.attention_dispatch(mc, packing=True) == expected
  assert np.isfinite(summary["final_train_loss"]) and summary["end_step"] == 2
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["model_config"]["window"] == 6 and saved["train_config"]["packing"] is True
  # 32 tokens, window 6: query i sees min(i, 6) + 1 keys.
  assert metrics_lib.attended_pairs(mc) == sum(min(i, 6) + 1 for i in range(32))
  dense_attention = saved["flops_per_sequence"] - 6 * 32 * saved["n_params"]
  attended_attention = saved["attended_flops_per_sequence"] - 6 * 32 * saved["n_params"]
  assert attended_attention / dense_attention == pytest.approx(
      metrics_lib.attended_pairs(mc) / 32**2)


@pytest.mark.skipif(jax.local_device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_packed_loss_under_pmap_is_the_global_weighted_mean():
  """Devices whose shares of the batch leave out different numbers of targets: the pmean of their
  losses is still the weighted mean over the global batch, as on one device."""
  config = dataclasses.replace(VARIANT_MODEL, n_layer=1)
  lengths = [5, 9, 3, 30, 7, 2, 40, 11, 6, 25, 4, 60]  # many short documents: boundaries vary
  split = data_lib.Split(np.arange(sum(lengths), dtype=np.uint8) % 251,
                         np.cumsum([0] + lengths[:-1]))
  packed = data_lib.get_packed_batch(split, 0, batch_size=8, seq_len=config.seq_len, seed=3)
  per_device = packed.weights.reshape(4, -1).sum(-1)
  assert len(set(per_device.tolist())) > 1, per_device  # the test needs unequal shares
  model = GPT(config)
  params = jax.jit(model.init)(jax.random.key(1), packed.tokens)["params"]
  tx = steps_lib.make_optimizer(TRAIN)
  x, y = steps_lib.packed_batch(packed)
  single = float(jax.jit(steps_lib.make_steps(model, tx, None)[1])(params, x, y))
  runner = steps_lib.Runner.create("pmap", model, tx, 8)
  replicated = jax.tree.map(lambda p: np.broadcast_to(p, (4, *p.shape)), params)
  multi = runner.eval_step(replicated, runner.shard(x), runner.shard(y))
  np.testing.assert_allclose(np.asarray(multi), single, rtol=1e-5 if not ON_GPU else 2e-3)
