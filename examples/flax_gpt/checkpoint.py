"""Orbax checkpoints of the example GPT's train state (``--ckpt-dir``, ``--resume``).

A checkpoint holds a :class:`.steps.TrainState` as host arrays. orbax is imported inside the
functions, so a run without ``--ckpt-dir`` does not load it.
"""
from __future__ import annotations

import os
import tempfile

import jax
import numpy as np

from .steps import TrainState


def checkpoint_manager(ckpt_dir: str):
  """An orbax CheckpointManager keeping the two newest checkpoints."""
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  return ocp.CheckpointManager(os.path.abspath(ckpt_dir), options=options)


def unwritable_reason(ckpt_dir: str) -> str | None:
  """Why checkpoints cannot be written to ``ckpt_dir`` (None: they can), found before any training by
  making and removing a folder in it, or in its nearest existing parent when it does not exist yet
  (orbax would make it). A URL (``gs://...``) is left to orbax."""
  if "://" in ckpt_dir:
    return None
  existing = os.path.abspath(ckpt_dir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"{existing} is a file, not a folder"
  try:
    tempfile.TemporaryDirectory(prefix=".write-check-", dir=existing).cleanup()
  except OSError as e:
    return f"cannot write in {existing} ({e.strerror or e})"
  return None


def latest_checkpoint_step(ckpt_dir: str) -> int | None:
  """The newest checkpoint's step in ``ckpt_dir``, or None when it holds none (or does not exist)."""
  if not os.path.isdir(ckpt_dir):
    return None
  manager = checkpoint_manager(ckpt_dir)
  try:
    return manager.latest_step()
  finally:
    manager.close()


def save_checkpoint(manager, state: TrainState) -> None:
  """Saves ``state`` as the checkpoint of its step (replacing one of the same step)."""
  import orbax.checkpoint as ocp
  manager.save(int(state.step), args=ocp.args.StandardSave(state), force=True)


class CheckpointMismatch(ValueError):
  """The checkpoint holds another model or optimizer state than the run's flags build."""


def restore_checkpoint(manager, template: TrainState) -> TrainState | None:
  """The newest checkpoint as host arrays shaped like ``template``, or None if there is none.

  Raises:
    CheckpointMismatch: its arrays' tree, shapes or dtypes differ from ``template``'s.
  """
  import orbax.checkpoint as ocp
  step = manager.latest_step()
  if step is None:
    return None
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          template)
  try:
    restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  except ValueError as e:  # orbax: the trees (or shapes) differ
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise CheckpointMismatch(
        f"--resume: the checkpoint of step {step} in {manager.directory} holds another model or "
        f"optimizer state than these flags build ({first[:300]}); resume with the flags it was "
        "trained with, or give another --ckpt-dir") from e
  leaves = jax.tree_util.tree_leaves_with_path(restored)
  mismatched = [jax.tree_util.keystr(path) for (path, got), want in zip(
      leaves, jax.tree.leaves(abstract)) if np.shape(got) != want.shape]
  if mismatched:
    raise CheckpointMismatch(
        f"--resume: the checkpoint of step {step} in {manager.directory} holds arrays of other "
        f"shapes than these flags build ({', '.join(mismatched[:3])}); resume with the flags it "
        "was trained with, or give another --ckpt-dir")
  return jax.device_get(restored)
