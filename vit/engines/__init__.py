"""qvl.vit.engines: qvl inside serving engines, one subpackage per engine, and what they share.

- :mod:`.vllm`: vLLM's plugin (the ``vllm.general_plugins`` entry point ``qvl.vit.engines.vllm.plugin:register``),
  its encoder-attention route, its tower route and its route log;
- :mod:`.sglang`: SGLang's plugin (the ``sglang.srt.plugins`` entry point ``qvl.vit.engines.sglang.plugin:register``),
  its vision-attention backend and its tower route;
- :mod:`.tower`: what both tower routes share (the checks, the tower instance's ``forward`` on qvl's runner);
- :mod:`.routes`: the route log, the plugins' switch and the attention routes' tile hint;
- :mod:`.cpu_path`: whether the plugins take an engine's vision work on a CPU (``QVL_CPU_ROUTES``, the measured
  table).

The engines build on the tower core (:mod:`qvl.vit.runner`, :mod:`qvl.vit.families`, ...), which knows nothing of
them; neither engine's subpackage imports the other's. This package and its subpackages import nothing at import
time, so loading a plugin module imports no engine until the engine calls it.
"""
