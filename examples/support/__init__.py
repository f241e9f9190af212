"""The examples' shared code: not an example itself, nothing here runs on its own.

The scripts in ``examples/`` (``serve_sim.py``, ``llama_runner.py``, ``deepseek_runner.py``,
``qwen35_runner.py``, ``gemma3_runner.py``, ``gpt_oss_runner.py``, ``disagg_sim.py``) are what a user runs; each puts ``examples/`` on
``sys.path`` and imports its parts from here:

- ``support.sim``: the serving simulation behind ``serve_sim.py`` and ``disagg_sim.py`` (its
  configuration, scheduler, model runners, byte checks, loop and summary, and the hybrid,
  sliding-window, prefix-cache and calibration variants);
- ``support.runners``: what the model runners share (the scheduler over a pool, Hugging Face
  references and comparisons, the prefix-cache scheduler, speculative decoding's verify step) and
  the Qwen3.5, Gemma 3 and gpt-oss runners' model pieces;
- ``support.cache_requests``: the request fields and request-table calls both schedulers on a prefix
  cache use;
- ``support.part_counts``: the write-path counts of an ``SWAKVPool``'s two parts as one pool's ``stats``;
- ``support.progress``: the progress line every long run prints on stderr.
"""
