"""The decode family: a few new query rows against a long key/value cache (flash-decoding).

Modules (nothing is imported eagerly):

* ``config``: :class:`DecodeConfig` (tiles, splits, launch settings), the split heuristic, and
  :class:`DecodeLaunch`, a config resolved against one call.
* ``forward``: the split-KV forward with the GQA group packed into one tile, and the combine.
* ``backend``: the :class:`kernels.backend.Backend` (``"decode"``); its backward is the training
  family's.
"""
