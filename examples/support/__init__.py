"""The examples' shared code: not an example itself, nothing here runs on its own.

The scripts in ``examples/`` (``serve_sim.py``, ``llama_runner.py``, ``deepseek_runner.py``,
``qwen35_runner.py``, ``disagg_sim.py``) are what a user runs; each puts ``examples/`` on
``sys.path`` and imports its parts from here:

- ``support.sim``: the serving simulation behind ``serve_sim.py`` and ``disagg_sim.py`` (its
  configuration, scheduler, model runners, byte checks, loop and summary, and the hybrid, prefix-cache
  and calibration variants);
- ``support.runners``: what the three model runners share (the scheduler over a pool, Hugging Face
  references and comparisons, the prefix-cache scheduler) and the Qwen3.5 runner's model pieces;
- ``support.cache_requests``: the request fields and request-table calls both schedulers on a prefix
  cache use;
- ``support.progress``: the progress line every long run prints on stderr.
"""
