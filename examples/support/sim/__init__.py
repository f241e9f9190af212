"""serve_sim's parts (examples/serve_sim.py is the script): ``config`` (``SimConfig``), ``values`` (the
K/V the simulated model writes), ``scheduler``, ``runner`` (the writes and their byte check),
``parking`` (``--host-tier``, ``--cpu-park``, ``--spec-decode``), ``loop`` (the scheduler loop and
``SimResult``), ``run`` (one run of any variant), ``summary``, and the variants: ``hybrid``
(``--model qwen3.5``), ``prefix`` (``--prefix-cache``), ``calibration`` (``--calibrate``)."""
