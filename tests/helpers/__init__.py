"""Helpers shared by the tests, imported as ``tests.helpers.<module>`` (the repository root is on
``sys.path``: pytest's ``pythonpath``, or ``python -m`` from the root for the workers).

* :mod:`~tests.helpers.env`: where the model files are, CI or not, the user's XLA flags, the quick
  training budget;
* :mod:`~tests.helpers.tiny`: the tiny target and drafter configs and their random weights;
* :mod:`~tests.helpers.drafters`: the drafters of the decode-equality tests and their check;
* :mod:`~tests.helpers.gguf_files`: a writer of tiny GGUF files;
* :mod:`~tests.helpers.server`: the server tests' fake-engine server and metric readers;
* :mod:`~tests.helpers.engine_drive`: a serving engine's slots driven by hand (chunked or one-shot prefill);
* :mod:`~tests.helpers.forced_devices`, the ``*_worker`` modules: checks on 8 forced CPU devices,
  each worker run as ``python -m tests.helpers.<name>`` in a process of its own;
* :mod:`~tests.helpers.tpu_compiler`: the guard of the TPU-compile tests;
* :mod:`~tests.helpers.parity_report`: the parity table of docs/results.md.

Fixtures stay in ``tests/conftest.py`` (and a folder's own ``conftest.py``); shared code is imported
from here, never from a conftest.
"""
