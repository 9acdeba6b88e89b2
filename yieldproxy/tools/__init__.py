"""What runs outside the proxy's process, or beside it: the command, the demo, the sim, the broker library.

* :mod:`.cli`: the ``yieldproxy`` command (status, yield, resume, reload, the demo, the sim,
  the example config, ``check-fallback``, ``ops-files``);
* :mod:`.demo`: ``yieldproxy demo``; :mod:`.opsfiles`: ``yieldproxy ops-files``; :mod:`.exits`: how a
  command ends (its exit statuses, ``CliError``);
* :mod:`.broker`: the broker library (``from yieldproxy import Admin``), the one client of the admin API;
* :mod:`.sim`: a simulated Ollama (and OpenAI, llama.cpp, TEI, Infinity) for the demo, the
  benchmarks and the tests.

Layer 12, the top: it may import every layer below; no module of the package imports it
(the package root names the broker library lazily, for its public face).
"""
