"""qvl inside vLLM: :mod:`.plugin` (the entry point and its switch, ``QVL_VLLM``), :mod:`.attention` (the
out-of-tree ``MMEncoderAttention``), :mod:`.tower` (vLLM's towers on qvl's runner) and :mod:`.routes` (what the
routes did in this process). Only :mod:`.plugin` and :mod:`.routes` import without vLLM."""
